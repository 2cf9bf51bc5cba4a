"""Checkers for the exercises of lecture 06 (kernels and Triton).

* :func:`check_online_softmax`: ``fn(x, block_size)``, a softmax over the last dimension that reads
  the columns ``block_size`` at a time, keeping a running maximum and sum (FlashAttention's trick);
  checked against ``torch.softmax``.
* :func:`check_row_logsumexp`: ``fn(x)``, the log-sum-exp of each row of a 2-D tensor (e.g. a Triton
  kernel, one row per program); checked against ``torch.logsumexp``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.exercises import check


def _cases(device, with_block: bool):
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 1), (3, 10), (4, 37), (2, 3, 100)] if with_block else [(1, 1), (3, 10), (5, 37), (4, 300)]
    cases = []
    for i, shape in enumerate(shapes):
        x = (torch.randn(*shape, generator=gen) * (1 + 30 * (i % 2))).to(device)  # odd cases: large logits
        if with_block:
            cases += [(x, b) for b in (1, 4, 16)]
        else:
            cases.append((x,))
    big = torch.tensor([[1000.0, 0.0, -1000.0], [-5e4, -5e4, -5e4]], device=device)  # exp(1000) overflows
    cases.append((big, 2) if with_block else (big,))
    return cases


def check_online_softmax(fn: Callable[[torch.Tensor, int], torch.Tensor], device: str = "cpu") -> int:
    """``fn(x, block_size)`` against ``torch.softmax(x, dim=-1)``, for block sizes 1, 4, 16 on rows
    whose length is no multiple of them, and on logits whose ``exp`` overflows float32."""
    return check("online softmax", fn, lambda x, b: torch.softmax(x, dim=-1), _cases(device, True),
                 describe=lambda c: f"x of shape {tuple(c[0].shape)}, block_size={c[1]}")


def check_row_logsumexp(fn: Callable[[torch.Tensor], torch.Tensor], device: str | None = None) -> int:
    """``fn(x)`` for 2-D ``x`` against ``torch.logsumexp(x, dim=-1)``: one float per row, stable
    for large logits. ``device``: where ``x`` lives (default: CUDA if present, else the CPU, where
    a Triton kernel runs through the interpreter)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return check("row log-sum-exp", fn, lambda x: torch.logsumexp(x, dim=-1), _cases(device, False),
                 describe=lambda c: f"x of shape {tuple(c[0].shape)}")
