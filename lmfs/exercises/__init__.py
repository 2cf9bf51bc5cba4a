"""Checkers for the exercises at the end of each lecture.

An exercise that asks for a function comes with a checker here: the learner writes the function
in the notebook and calls ``check_<name>(their_function)``. The checker runs it on a set of cases
and compares each result with an independent answer (the ``lmfs`` implementation, a torch
built-in or a brute force), and says which case disagrees and how. The stored notebooks call each
checker on a working answer, so the test suite runs every checker.

One module per lecture (``lmfs.exercises.lecture01``, ...) holds that lecture's checkers; they
share :func:`check`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


def _same(got: Any, want: Any, atol: float, rtol: float) -> str | None:
    """``None`` when ``got`` matches ``want``, else a short description of the difference."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        try:
            torch.testing.assert_close(got.to(want.dtype), want, atol=atol, rtol=rtol)
        except AssertionError as err:
            return str(err).splitlines()[0] + " " + " ".join(str(err).splitlines()[1:3])
        return None
    if isinstance(want, float) and isinstance(got, (int, float)):
        return None if abs(got - want) <= atol + rtol * abs(want) else f"{got!r}, expected {want!r}"
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want)):
            problem = _same(g, w, atol, rtol)
            if problem:
                return f"item {i}: {problem}"
        return None
    return None if got == want else f"{got!r}, expected {want!r}"


def check(name: str, answer: Callable, reference: Callable, cases: Iterable[Sequence[Any]], *,
          atol: float = 1e-5, rtol: float = 1e-4, describe: Callable[[Sequence[Any]], str] | None = None) -> int:
    """Call ``answer(*case)`` and ``reference(*case)`` for every case and compare the results.

    Tensors are compared with :func:`torch.testing.assert_close` (``atol``, ``rtol``), floats within
    the same tolerance, everything else with ``==``. The first disagreement raises an
    ``AssertionError`` that names the case; an exception inside ``answer`` is reported with the case
    that raised it. Returns the number of cases checked and prints a one-line verdict.

        >>> check("square", lambda x: x * x, lambda x: x ** 2, [(1,), (2,), (3,)])
        square: correct on 3 cases
        3
    """
    if not callable(answer):
        raise TypeError(f"{name}: pass your function itself (no parentheses), got {type(answer).__name__}")
    n = 0
    for case in cases:
        label = describe(case) if describe else _short(case)
        try:
            got = answer(*case)
        except Exception as err:  # the learner's code failed: say on which input
            raise AssertionError(f"{name}: your function raised {type(err).__name__}: {err} "
                                 f"on input {label}") from err
        problem = _same(got, reference(*case), atol, rtol)
        if problem:
            raise AssertionError(f"{name}: wrong result on input {label}: {problem}")
        n += 1
    print(f"{name}: correct on {n} cases")
    return n


def _short(case: Sequence[Any], limit: int = 120) -> str:
    parts = [f"tensor{tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x) for x in case]
    text = "(" + ", ".join(parts) + ")"
    return text if len(text) <= limit else text[:limit - 3] + "..."
