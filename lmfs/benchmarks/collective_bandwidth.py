"""Collective bandwidth benchmark: ``python -m lmfs.benchmarks collectives [--world-size 2] [--json out.json]``.

For each collective and message size: a few warm-up calls, then timed calls (CUDA events on
GPUs, wall clock on CPUs); each rank takes its median and the slowest rank's median counts, since
a collective is done only when every rank is. Two bandwidths, as NCCL's own tests report them:

* **algorithm bandwidth** ``algbw = S / t``, with ``S`` the bytes of the full tensor (the
  all-reduce buffer, the all-gather output, the reduce-scatter input);
* **bus bandwidth** ``busbw = algbw × factor``: the bytes each rank really sends per second
  (see :mod:`lmfs.parallel.comm`), with factor ``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for
  all-gather and reduce-scatter. It does not depend on ``n``, so it compares directly with the
  link's peak (e.g. NVLink 4 on H100/H200: 450 GB/s per direction).

Sizes run from 1 MB to 1 GB on GPUs and from 64 KB to 16 MB on CPUs (gloo over loopback).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from lmfs.bench import save_json
from lmfs.bench.timing import benchmark
from lmfs.parallel import comm
from lmfs.parallel.launch import device_for, run

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
    """Rank function: one row per (collective, size) with the slowest rank's median time."""
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


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KB"


def print_table(rows: list[dict], world_size: int, device: str):
    print(f"collective bandwidth, {world_size} ranks, {device}")
    print(f"{'collective':<15}{'size':>10}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}")
    for r in rows:
        print(f"{r['op']:<15}{_size(r['bytes']):>10}{r['time_us']:>12.1f}{r['algbw_GBps']:>14.2f}"
              f"{r['busbw_GBps']:>14.2f}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter",
                        help="comma-separated collectives")
    parser.add_argument("--max-mb", type=float, default=None, help="largest message, in MB")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size
    sizes = GPU_SIZES if on_gpus else CPU_SIZES
    if args.max_mb is not None:
        sizes = [s for s in sizes if s <= args.max_mb * 2**20]
    ops = tuple(args.ops.split(","))
    rows = run(bandwidth_worker, args.world_size, ops, sizes, 5, args.iters, timeout=300)[0]
    name = torch.cuda.get_device_name(0) if on_gpus else "CPU (gloo)"
    print_table(rows, args.world_size, name)
    save_json({"world_size": args.world_size, "device": name, "torch": torch.__version__, "rows": rows}, args.json)
    return rows


if __name__ == "__main__":
    main()
