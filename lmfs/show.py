"""Show the real source of an ``lmfs`` object in a notebook, instead of pasting a copy of it."""

from __future__ import annotations

import inspect
import os


def source_of(obj) -> tuple[str, str]:
    """Return ``(location, source)`` of a function, class, method or module.

    ``location`` is ``path:line`` relative to the repository, so a learner can open the file.
    """
    target = inspect.unwrap(obj)
    if isinstance(target, property):
        target = target.fget
    # Triton kernels (@triton.jit, @triton.autotune) wrap the Python function in objects whose
    # `.fn` is the next layer in; follow it down to the function itself.
    while not (inspect.isroutine(target) or inspect.isclass(target) or inspect.ismodule(target)) \
            and callable(getattr(target, "fn", None)):
        target = target.fn
    try:
        lines, start = inspect.getsourcelines(target)
        path = inspect.getsourcefile(target) or "?"
    except (TypeError, OSError) as err:
        raise TypeError(
            f"lmfs.show cannot find the source of {obj!r}: pass a Python function, class, method or "
            "module (built-ins and C extensions have no Python source)"
        ) from err
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rel = os.path.relpath(path, root) if os.path.abspath(path).startswith(root) else path
    return f"{rel}:{max(start, 1)}", "".join(lines)


def show(obj, *, lines: tuple[int, int] | None = None) -> None:
    """Render ``obj``'s source with syntax highlighting in Jupyter (plain text elsewhere).

    ``lines=(a, b)`` shows only lines ``a``..``b`` (1-based, inclusive) of that source.
    """
    location, source = source_of(obj)
    if lines is not None:
        a, b = lines
        source = "".join(source.splitlines(keepends=True)[a - 1 : b])
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", type(obj).__name__))
    header = f"{name}  —  {location}"
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display

        if get_ipython() is not None:
            display(Markdown(f"**`{header}`**\n\n```python\n{source.rstrip()}\n```"))
            return
    except ImportError:
        pass
    print(f"# {header}\n{source.rstrip()}")
