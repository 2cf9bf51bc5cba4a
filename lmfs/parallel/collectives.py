"""The eight collectives, each shown on real ranks, and checked against its definition.

Every rank ``r`` starts from the same easy-to-read vector, ``x_r = [10r, 10r + 1, ..., 10r + n-1]``
(``n`` ranks), so ``x_2 = [20, 21, 22, 23]`` on 4 ranks. Element ``j`` of it is "chunk ``j``":
the piece addressed to rank ``j`` in scatter, reduce-scatter and all-to-all.

=================  ==============================================  =============================
collective         rank r ends with                                who talks to whom
=================  ==============================================  =============================
broadcast          x_0                                             root -> everyone
scatter            chunk r of x_0                                  root -> each its piece
gather             (root) x_0, x_1, ..., concatenated              everyone -> root
reduce             (root) x_0 + x_1 + ... + x_{n-1}                everyone -> root, summed
all_gather         x_0, x_1, ..., concatenated                     everyone -> everyone
reduce_scatter     chunk r of the sum                              everyone -> everyone, summed
all_reduce         x_0 + ... + x_{n-1}                             = reduce_scatter + all_gather
all_to_all         chunk r of every x_s, in order of s             a transpose of the chunks
=================  ==============================================  =============================

:func:`demo_collectives` runs them all on ranks (use it with :func:`lmfs.parallel.run`);
:func:`reference_collectives` computes the same results in one process from the definitions.

Measuring a collective (:func:`bandwidth_worker`): time it on a message of ``S`` bytes, taking
``t`` seconds; NCCL's own tests report two bandwidths:

* **algorithm bandwidth** ``algbw = S / t``, with ``S`` the bytes of the full tensor (the
  all-reduce buffer, the all-gather output, the reduce-scatter input);
* **bus bandwidth** ``busbw = algbw × BUS_FACTOR[op](n)``: the bytes each rank really sends per
  second (see :mod:`lmfs.parallel.comm`), with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n``
  for all-gather and reduce-scatter. It does not depend on ``n``, so it compares directly with a
  link's peak (:mod:`lmfs.hardware`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmfs.bench.timing import benchmark
from lmfs.parallel import comm
from lmfs.parallel.launch import device_for

OPS = ("broadcast", "scatter", "gather", "reduce", "all_gather", "reduce_scatter", "all_reduce",
       "all_to_all")


def rank_input(rank: int, world_size: int) -> torch.Tensor:
    """``[10·rank, 10·rank + 1, ..., 10·rank + world_size - 1]`` as float32."""
    return torch.arange(world_size, dtype=torch.float32) + 10 * rank


def demo_collectives(rank: int, world_size: int, root: int = 0) -> dict:
    """Run each collective on a fresh copy of :func:`rank_input`; ``{op: {"before", "after"}}``.

    ``after`` is ``None`` where the collective leaves nothing defined on this rank (the
    non-root ranks of gather and reduce).
    """
    dev = device_for(rank)  # NCCL only moves GPU tensors
    x = rank_input(rank, world_size).to(dev)
    n = world_size
    out = {}

    t = x.clone()
    dist.broadcast(t, src=root)
    out["broadcast"] = t

    piece = torch.empty(1, device=dev)
    dist.scatter(piece, list(x.chunk(n)) if rank == root else None, src=root)
    out["scatter"] = piece

    parts = [torch.empty(n, device=dev) for _ in range(n)] if rank == root else None
    dist.gather(x.clone(), parts, dst=root)
    out["gather"] = torch.cat(parts) if rank == root else None

    t = x.clone()
    dist.reduce(t, dst=root)  # only the root's tensor is defined afterwards
    out["reduce"] = t if rank == root else None

    t = torch.empty(n * n, device=dev)
    comm.all_gather_into(t, x)
    out["all_gather"] = t

    t = torch.empty(1, device=dev)
    comm.reduce_scatter_into(t, x)
    out["reduce_scatter"] = t

    t = x.clone()
    dist.all_reduce(t)
    out["all_reduce"] = t

    t = torch.empty(n, device=dev)
    dist.all_to_all_single(t, x)
    out["all_to_all"] = t

    return {op: {"before": x, "after": out[op]} for op in OPS}


def reference_collectives(world_size: int, root: int = 0) -> dict:
    """What :func:`demo_collectives` must return, per rank, computed from the definitions."""
    xs = [rank_input(r, world_size) for r in range(world_size)]
    total = torch.stack(xs).sum(0)
    per_rank = []
    for r in range(world_size):
        after = {
            "broadcast": xs[root],
            "scatter": xs[root][r:r + 1],
            "gather": torch.cat(xs) if r == root else None,
            "reduce": total if r == root else None,
            "all_gather": torch.cat(xs),
            "reduce_scatter": total[r:r + 1],
            "all_reduce": total,
            "all_to_all": torch.stack([x[r] for x in xs]),
        }
        per_rank.append({op: {"before": xs[r], "after": after[op]} for op in OPS})
    return per_rank


def collectives_table(results: list[dict]):
    """A pandas table: one row per collective, one column per rank, ``before -> after``."""
    import pandas as pd

    def fmt(t):
        return "·" if t is None else "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"

    rows = {op: {f"rank {r}": f"{fmt(res[op]['before'])} → {fmt(res[op]['after'])}"
                 for r, res in enumerate(results)} for op in OPS}
    return pd.DataFrame.from_dict(rows, orient="index")


def all_reduce_via_rs_ag(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce built from its two halves; returns a new tensor (the input is untouched).

    Reduce-scatter leaves rank ``r`` with the finished sum of chunk ``r``; all-gather then hands
    every finished chunk to everyone. Each half moves ``(n-1)/n`` of the data per rank, which is
    why a ring all-reduce costs ``2(n-1)/n`` times the tensor. The tensor is zero-padded to a
    multiple of ``n`` so it splits into equal chunks.
    """
    n = dist.get_world_size(group)
    flat = tensor.detach().reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % n)])
    shard = padded.new_empty(padded.numel() // n)
    comm.reduce_scatter_into(shard, padded, group=group)
    full = torch.empty_like(padded)
    comm.all_gather_into(full, shard, group=group)
    return full[:flat.numel()].view_as(tensor)


def compare_all_reduce(rank: int, world_size: int, numel: int = 1000, seed: int = 0) -> dict:
    """Rank function: ``all_reduce`` and :func:`all_reduce_via_rs_ag` of the same random tensor."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank)).to(device_for(rank))
    direct = x.clone()
    dist.all_reduce(direct)
    return {"input": x, "all_reduce": direct, "rs_ag": all_reduce_via_rs_ag(x)}


# ---------------------------------------------------------------------------------------------
# Bandwidth

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
GPU_SIZES = [2**20 * 2**i for i in range(11)]  # 1 MB .. 1 GB
CPU_SIZES = [2**16 * 4**i for i in range(5)]   # 64 KB .. 16 MB


def _collective(op: str, nbytes: int, n: int, device):
    """A closure that runs ``op`` once on a float32 tensor of ``nbytes`` (the full tensor)."""
    numel = nbytes // 4 // n * n  # divisible by n for the sharded collectives
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: comm.all_gather_into(full, shard)
    return lambda: comm.reduce_scatter_into(shard, full)


def bandwidth_worker(rank: int, world_size: int, ops=("all_reduce", "all_gather", "reduce_scatter"),
                     sizes=None, warmup: int = 5, iters: int = 20) -> list[dict]:
    """Rank function: one row per (collective, message size in bytes) with the slowest rank's
    median time and both bandwidths.

    Each rank times ``iters`` calls after ``warmup`` (CUDA events on a GPU, the wall clock on a
    CPU) and takes the median; the slowest rank's median counts, since a collective is done only
    when every rank is. ``sizes`` defaults to 1 MB .. 1 GB on GPUs, 64 KB .. 16 MB on CPUs.
    """
    device = device_for(rank)
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    rows = []
    for op in ops:
        if op not in BUS_FACTOR:
            raise ValueError(f"unknown collective {op!r}: use {sorted(BUS_FACTOR)}")
        for nbytes in sizes:
            fn = _collective(op, nbytes, world_size, device)
            dist.barrier()
            t = torch.tensor([benchmark(fn, warmup=warmup, repeats=iters, device=device).median], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            seconds = t.item()
            algbw = nbytes / seconds
            rows.append({"op": op, "bytes": nbytes, "time_us": seconds * 1e6, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * BUS_FACTOR[op](world_size) / 1e9})
    return rows
