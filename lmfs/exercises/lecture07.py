"""Checkers for the exercises of lecture 07 (devices, networks and collectives).

Both run on *simulated* ranks: a list ``xs`` whose entry ``r`` is what rank ``r`` holds.

* :func:`check_ring_reduce_scatter`: ``fn(xs)``, the reduce-scatter phase of a ring all-reduce;
  rank ``r`` must end with chunk ``r`` of the sum (``torch.stack(xs).sum(0).chunk(n)[r]``).
* :func:`check_all_to_all`: ``fn(xs)``, all-to-all on vectors of ``n`` equal chunks; rank ``r``
  must end with chunk ``r`` of every rank's vector, in rank order (a transpose of the chunks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.exercises import check


def _rank_inputs() -> list[tuple[list[torch.Tensor]]]:
    """Cases: ``n`` ranks' vectors of ``n · chunk`` elements (n = 1 .. 8, chunks of 1 and 3)."""
    gen = torch.Generator().manual_seed(0)
    return [([torch.randn(n * chunk, generator=gen) for _ in range(n)],)
            for n in (1, 2, 3, 4, 8) for chunk in (1, 3)]


def _describe(case) -> str:
    xs = case[0]
    return f"{len(xs)} ranks, vectors of {xs[0].numel()} elements"


def reduce_scatter_reference(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The definition: rank ``r`` gets chunk ``r`` of the element-wise sum of all ranks' vectors."""
    return list(torch.stack(xs).sum(0).chunk(len(xs)))


def all_to_all_reference(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The definition: rank ``r`` gets chunk ``r`` of rank 0's vector, then of rank 1's, ..."""
    n = len(xs)
    return [torch.cat([x.chunk(n)[r] for x in xs]) for r in range(n)]


def check_ring_reduce_scatter(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> int:
    """``fn(xs)`` -> a list of ``n`` tensors, entry ``r`` being chunk ``r`` of ``sum(xs)``."""
    return check("ring reduce-scatter", fn, reduce_scatter_reference, _rank_inputs(), describe=_describe)


def check_all_to_all(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> int:
    """``fn(xs)`` -> a list of ``n`` tensors, entry ``r`` being chunk ``r`` of every ``xs[s]`` in order."""
    return check("all-to-all", fn, all_to_all_reference, _rank_inputs(), atol=0, rtol=0, describe=_describe)
