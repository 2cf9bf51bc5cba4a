"""Collectives that count their bytes: every strategy in :mod:`lmfs.parallel` communicates through here.

Each wrapper calls the ``torch.distributed`` function of the same name and, while a
:func:`count_bytes` block is open, records how many bytes *this rank sends* for it::

    with count_bytes() as counter:
        train_step()
    counter.total, counter.by_op     # -> 1_572_864, {"all_reduce": 1_572_864}

What a rank sends depends on the algorithm the library picks, so we count the textbook
bandwidth-optimal ones, with ``n`` ranks in the group and ``S`` the bytes of the full tensor:

==================  ===================  ====================================================
collective          bytes sent per rank  why
==================  ===================  ====================================================
all_reduce          2·(n-1)/n · S        ring: a reduce-scatter, then an all-gather
reduce_scatter      (n-1)/n · S          ring: each rank forwards n-1 partial sums of S/n
all_gather          (n-1)/n · S          ring: each rank forwards n-1 shards of S/n
broadcast           (n-1)/n · S          pipelined chain: n-1 of the n ranks forward S (mean)
all_to_all_single   S minus its own part exact: whatever is addressed to another rank
send / isend        S                    exact; a receive sends nothing
==================  ===================  ====================================================

``S`` is the input of reduce-scatter and the output of all-gather, i.e. always the full tensor.
Divided by the time, these per-rank figures are what NCCL's tests report as "bus bandwidth"
(see :func:`lmfs.parallel.collectives.bandwidth_worker`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

_ACTIVE: list[ByteCounter] = []


class ByteCounter:
    """Bytes this rank sent, per collective, while it was active."""

    def __init__(self):
        self.by_op: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, op: str, nbytes: float):
        self.by_op[op] += int(nbytes)
        self.calls[op] += 1

    def summary(self) -> dict:
        """``{"total": bytes, "by_op": {...}, "calls": {...}}`` as plain dicts (picklable)."""
        return {"total": self.total, "by_op": dict(self.by_op), "calls": dict(self.calls)}

    def __repr__(self) -> str:
        return f"ByteCounter(total={self.total:,}, by_op={dict(self.by_op)})"


@contextlib.contextmanager
def count_bytes():
    """Count the bytes sent by every wrapper call in the block (blocks may nest)."""
    counter = ByteCounter()
    _ACTIVE.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE.remove(counter)


def _record(op: str, nbytes: float):
    for counter in _ACTIVE:
        counter.add(op, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """In place: every rank ends with the reduction (default: sum) of all ranks' ``tensor``."""
    n = _size(group)
    _record("all_reduce", 2 * (n - 1) / n * _nbytes(tensor))
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# torch 2.13 renamed the flat-tensor collectives (``all_gather_into_tensor`` ->
# ``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``) and warns on
# the old names; older versions (the GPU machines run 2.11) only have the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output, input, group=None, async_op=False):
    """``output`` (n·k elements) = the ranks' ``input`` (k elements each) concatenated in rank order.

    ``output`` must be contiguous: it is written through a flat view.
    """
    n = _size(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather_into needs output.numel() = world size × input.numel() = "
                         f"{n} × {input.numel()}, got {output.numel()}")
    _record("all_gather", (n - 1) / n * _nbytes(output))
    # Flat 1-D views: backends disagree on which multi-dimensional shapes they accept.
    return _all_gather_flat(output.view(-1), input.reshape(-1), group=group, async_op=async_op)


def reduce_scatter_into(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Rank ``r`` gets chunk ``r`` of the element-wise reduction of all ranks' ``input``.

    ``output`` must be contiguous: it is written through a flat view.
    """
    n = _size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter_into needs input.numel() = world size × output.numel() = "
                         f"{n} × {output.numel()}, got {input.numel()}: pad the input to a multiple "
                         f"of {n}")
    _record("reduce_scatter", (n - 1) / n * _nbytes(input))
    return _reduce_scatter_flat(output.view(-1), input.reshape(-1), op=op, group=group,
                                async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op=False):
    """In place: every rank ends with rank ``src``'s ``tensor`` (``src`` is a global rank)."""
    n = _size(group)
    _record("broadcast", (n - 1) / n * _nbytes(tensor))
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """Rank ``r`` sends rows ``input_split_sizes[j]`` of ``input`` to rank ``j`` and receives into
    ``output`` the rows every rank addressed to it, in rank order (equal splits when ``None``)."""
    n, me = _size(group), dist.get_rank(group)
    row_bytes = _nbytes(input) // max(input.shape[0], 1)
    own = input_split_sizes[me] if input_split_sizes is not None else input.shape[0] // n
    _record("all_to_all", (input.shape[0] - own) * row_bytes)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def batch_isend_irecv(ops: list[dist.P2POp]):
    """Start point-to-point sends and receives together; returns the works to ``wait()`` on."""
    for op in ops:
        if op.op in (dist.isend, dist.send):
            _record("send", _nbytes(op.tensor))
    return dist.batch_isend_irecv(ops)
