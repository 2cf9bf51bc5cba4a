"""Checkers for the exercises of lecture 08 (every parallel strategy, implemented).

* :func:`check_bubble_fraction`: ``fn(p, m)``, the idle fraction of a GPipe step with ``p``
  stages and ``m`` micro-batches; checked against the idle share that
  :func:`lmfs.parallel.pipeline.bubble` measures on an ideal GPipe timeline built event by event
  (every forward takes 1 unit, every backward 2, messages are free).
* :func:`check_zero_bytes_per_param`: ``fn(stage, n)``, the bytes of parameters, gradients and
  optimizer state one rank holds per parameter of the model under fp32 AdamW (4 + 4 + 8 bytes)
  with ``n`` data-parallel ranks, for ``stage`` 0 (plain DDP), 1 and 2; checked against
  :func:`lmfs.parallel.costs.strategy_costs`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from lmfs.exercises import check


def gpipe_timeline(p: int, m: int, forward: float = 1.0, backward: float = 2.0) -> list[list[tuple]]:
    """Per stage, the ``(kind, micro_batch, start, end)`` events of one GPipe step when each stage
    starts an operation as soon as its own previous one and its input are done."""
    # Stage s runs F0 .. F(m-1), then B(m-1) .. B0. F(s, i) needs F(s-1, i); B(s, i) needs B(s+1, i).
    ops = [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    position = {op: k for k, op in enumerate(ops)}

    @cache
    def end(s: int, k: int) -> float:
        kind, i = ops[k]
        ready = end(s, k - 1) if k else 0.0
        upstream = s - 1 if kind == "F" else s + 1
        if 0 <= upstream < p:
            ready = max(ready, end(upstream, position[(kind, i)]))
        return ready + (forward if kind == "F" else backward)

    return [[(kind, i, end(s, k) - (forward if kind == "F" else backward), end(s, k))
             for k, (kind, i) in enumerate(ops)] for s in range(p)]


def bubble_reference(p: int, m: int) -> float:
    from lmfs.parallel.pipeline import bubble

    return bubble(gpipe_timeline(p, m), m)["measured_fraction"]


def check_bubble_fraction(fn: Callable[[int, int], float]) -> int:
    """``fn(p, m)`` -> the idle fraction of the step, for p = 1 .. 8 stages and m = 1 .. 16."""
    cases = [(p, m) for p in (1, 2, 4, 8) for m in (1, 2, 3, 8, 16)]
    return check("bubble fraction", fn, bubble_reference, cases, atol=1e-9, rtol=1e-9,
                 describe=lambda c: f"p={c[0]} stages, m={c[1]} micro-batches")


def zero_reference(stage: int, n: int) -> float:
    from lmfs.nn import count_params
    from lmfs.parallel.common import demo_config
    from lmfs.parallel.costs import strategy_costs

    config = demo_config()
    name = {0: "ddp", 1: "zero1", 2: "zero2"}[stage]
    c = strategy_costs(config, name, n, batch_size=n, seq_len=16, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    return (c["params_GB"] + c["grads_GB"] + c["optimizer_GB"]) * 1e9 / count_params(config)


def check_zero_bytes_per_param(fn: Callable[[int, int], float]) -> int:
    """``fn(stage, n)`` -> bytes per parameter on one rank (fp32 AdamW), stages 0 (DDP), 1, 2."""
    cases = [(stage, n) for stage in (0, 1, 2) for n in (1, 2, 4, 8, 64)]
    return check("ZeRO bytes per parameter", fn, zero_reference, cases, atol=1e-9, rtol=1e-9,
                 describe=lambda c: f"stage={c[0]}, n={c[1]} ranks")
