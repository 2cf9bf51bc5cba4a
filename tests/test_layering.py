"""The package's layering rules, read from the source with ``ast`` (nothing is imported).

* No import circle between lmfs modules, counting imports at the top and inside functions.
* Dependencies run one way: the plain packages (``lmfs.nn``, ``lmfs.inference``, ``lmfs.alignment``)
  never import the speed-ups handed in from outside (``lmfs.kernels``, ``lmfs.fast``) nor the
  benchmarking code (``lmfs.bench``, ``lmfs.benchmarks``).
* No ``from lmfs.x import _name`` across packages.
* The lecture notebooks use public names only: no private import and no ``obj._name`` access in a
  code cell.
* No module over 600 lines and no class over 300, except the Triton kernel files listed below.
* The plain packages and the speed-ups set no attribute outside ``__init__`` (and its helpers
  ``__post_init__``/``reset``): an object's state is listed where it is made.
"""

import ast
import json
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAIN = ("lmfs.nn", "lmfs.inference", "lmfs.alignment")
SPEED_UPS = ("lmfs.kernels", "lmfs.fast", "lmfs.bench", "lmfs.benchmarks")
MAX_MODULE_LINES, MAX_CLASS_LINES = 600, 300
# Triton kernel files longer than MAX_MODULE_LINES, and why one file holds them
LONG_KERNEL_FILES = {
    "lmfs.kernels.flash_attention": "FlashAttention-2 forward and backward kernels with their autotune "
                                    "configurations and the readable PyTorch version lecture 06 compares",
    "lmfs.kernels.decode": "the fused decode forward's kernel family (projections, norms, RoPE, cache "
                           "writes, GEMV path) and the class that launches it",
    "lmfs.kernels.moe": "the fused MoE forward and backward kernels (routing, grouped GEMMs, SwiGLU) and "
                        "the module that launches them",
    "lmfs.kernels.fused": "the fused RoPE/q-k-v and SwiGLU kernels, their backward, and fuse_model",
}
ATTRIBUTE_SCOPE = ("lmfs.nn", "lmfs.inference", "lmfs.fast", "lmfs.kernels", "lmfs.batching")


@cache
def modules() -> dict[str, Path]:
    """Every lmfs module by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted((ROOT / "lmfs").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def resolve(name: str) -> str | None:
    """The lmfs module that importing ``name`` loads last (``lmfs.a.b.func`` -> ``lmfs.a.b``)."""
    known = modules()
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str) -> list[tuple[str, int]]:
    """The lmfs modules ``name`` imports (at the top or inside functions), with the line of each."""
    out = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            out += [(resolve(a.name), node.lineno) for a in node.names if a.name.startswith("lmfs")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lmfs"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append((full if full in modules() else resolve(node.module), node.lineno))
    return [(m, line) for m, line in out if m and m != name]


def graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in imports(name)} for name in modules()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_circles_are_found():
    """The circle finder itself, on made-up graphs: one circle of three, a self-contained chain."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    found = circles(graph())
    assert not found, "import circles (each a set of modules importing each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_plain_packages_import_no_speed_ups():
    bad = [f"{name}:{line} imports {m}" for name in modules() if name.startswith(PLAIN)
           for m, line in imports(name) if m.startswith(SPEED_UPS)]
    assert not bad, "upward imports (hand the speed-up in from outside instead):\n" + "\n".join(bad)


def package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_no_private_names_imported_across_packages():
    bad = []
    for name in modules():
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lmfs"):
                if package(node.module) != package(name):
                    bad += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def notebook_code(path: Path) -> list[tuple[str, str]]:
    """``(cell id, source)`` of each code cell, IPython's ``%magic`` and ``!shell`` lines blanked."""
    cells = json.loads(path.read_text())["cells"]
    out = []
    for cell in cells:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.split("\n")]
            out.append((cell.get("id", "?"), "\n".join(lines)))
    return out


def private_uses(source: str) -> list[str]:
    """``obj._name`` accesses and private lmfs imports in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            out.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmfs"):
            out += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_private_uses_are_found():
    found = private_uses("x = llm._admit(w)\nfrom lmfs.a import _b\ny = z.__class__")
    assert sorted(found) == ["from lmfs.a import _b", "llm._admit"]


@pytest.mark.parametrize("path", sorted((ROOT / "lectures").glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebooks_use_public_names_only(path):
    bad = [f"cell {cell}: {use}" for cell, source in notebook_code(path) for use in private_uses(source)]
    assert not bad, f"{path.name} uses private names:\n" + "\n".join(bad)


def test_modules_and_classes_stay_short():
    bad = []
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES and name not in LONG_KERNEL_FILES:
            bad.append(f"{name}: {lines} lines")
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                bad.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not bad, (f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class (split it, or list "
                     "a Triton kernel file in LONG_KERNEL_FILES with its reason):\n" + "\n".join(bad))


@cache
def classes() -> dict[str, list[ast.ClassDef]]:
    out = {}
    for name in modules():
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


def assigned_to_self(function) -> set[str]:
    """The attributes ``function`` assigns on ``self`` (``register_buffer``/``register_parameter`` too)."""
    out = set()
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            out |= {e.attr for e in ast.walk(target) if isinstance(e, ast.Attribute)
                    and isinstance(e.value, ast.Name) and e.value.id == "self"}
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("register_buffer", "register_parameter") and node.args
                and isinstance(node.args[0], ast.Constant)):
            out.add(node.args[0].value)
    return out


SETUP = ("__init__", "__post_init__", "reset")


def declared(class_name: str, seen: frozenset = frozenset()) -> set[str]:
    """What a class (by name, with its lmfs base classes) sets up: in ``__init__`` and its helpers, in
    the class body, and its properties."""
    out = set()
    for node in classes().get(class_name, []):
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                if item.name in SETUP:
                    out |= assigned_to_self(item)
                if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    out.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                out.add(item.target.id)
            elif isinstance(item, ast.Assign):
                out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        for base in node.bases:
            base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
            if base_name and base_name not in seen:
                out |= declared(base_name, seen | {class_name})
    return out


def test_no_attributes_set_outside_init():
    bad = []
    for name in modules():
        if not name.startswith(ATTRIBUTE_SCOPE):
            continue
        for node in ast.walk(tree(name)):
            if not isinstance(node, ast.ClassDef):
                continue
            known = declared(node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name not in SETUP:
                    extra = assigned_to_self(item) - known
                    if extra:
                        bad.append(f"{name}.{node.name}.{item.name} sets {sorted(extra)}")
    assert not bad, "attributes set outside __init__ (list them there):\n" + "\n".join(bad)
