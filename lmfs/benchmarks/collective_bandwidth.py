"""Collective bandwidth benchmark: ``python -m lmfs.benchmarks collectives [--world-size 2] [--json out.json]``.

For each collective and message size, :func:`lmfs.parallel.collectives.bandwidth_worker` times a
few warm-up calls, then timed calls, and reports the slowest rank's median with the algorithm and
bus bandwidths (defined there). The bus bandwidth compares directly with the link's peak
(:func:`lmfs.hardware.gpu`'s ``interconnect_bandwidth``, which counts both directions).

Sizes run from 1 MB to 1 GB on GPUs and from 64 KB to 16 MB on CPUs (gloo over loopback).
"""

from __future__ import annotations

import argparse

import torch

from lmfs.bench import save_json
from lmfs.parallel.collectives import CPU_SIZES, GPU_SIZES, bandwidth_worker
from lmfs.parallel.launch import placement, run


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
    on_gpus = placement(args.world_size).backend == "nccl"
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
