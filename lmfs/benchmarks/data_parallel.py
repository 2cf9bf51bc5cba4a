"""Data-parallel training throughput and memory: lmfs's DDP and FSDP against PyTorch's.

    python -m lmfs.benchmarks data-parallel [--world-size 2] [--batch-size 16] [--steps 20] [--json out.json]

On ``n`` GPUs (NCCL, one process each) every strategy trains the GPT-2-small-shaped model of
:mod:`lmfs.benchmarks.train_step` (134M parameters, context 1024, vocabulary 32,000) with the same local
batch per GPU, so ``n`` GPUs process ``n`` times the tokens of one (weak scaling):

=============  ==============================================================================
single         one GPU, no process group traffic: the baseline (rank 0 only)
lmfs-ddp       :class:`lmfs.parallel.ddp.DDP`: bucketed all-reduce overlapped with backward
torch-ddp      ``torch.nn.parallel.DistributedDataParallel`` (same 25 MB buckets)
lmfs-fsdp      :class:`lmfs.parallel.zero.FullyShardedModel` (ZeRO-3, bf16 gathers)
torch-fsdp     PyTorch's FSDP2 ``fully_shard`` per block and at the root, bf16 parameters,
               fp32 gradient reduction
=============  ==============================================================================

Every strategy steps ``torch.optim.AdamW`` (fused on GPUs) under bf16 autocast, eagerly (not
compiled: a compiled backward hands all gradients over at its end, which would hide how well a
DDP overlaps its communication). Each rank times its steps with CUDA events after warm-up; the
slowest rank's median counts. "host ms" is the time Python takes to issue one step (near the
step time: the step is bound by the host, not the GPU). Memory is what :func:`lmfs.parallel.common.memory_report` finds on
rank 0 after a step, before the gradients are dropped: parameters, gradients and optimizer state
(sharded ones counted by their local shard), and the allocator's peak during that step.

Without enough GPUs it runs a tiny model on CPU processes with gloo, only to exercise the code.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from lmfs.bench import save_json
from lmfs.bench.timing import benchmark, profile_table
from lmfs.benchmarks.train_step import gpt2_small, tiny
from lmfs.parallel.common import build_model, memory_report
from lmfs.parallel.ddp import DDP
from lmfs.parallel.launch import device_for, placement, run
from lmfs.parallel.zero import FullyShardedModel

STRATEGIES = ("single", "lmfs-ddp", "torch-ddp", "lmfs-fsdp", "torch-fsdp")


def _wrap(strategy: str, model: torch.nn.Module, device: torch.device, bucket_size_mb: float):
    """``(module to call, parameters to optimise, gradient sync to call after backward or None)``."""
    cuda = device.type == "cuda"
    if strategy == "single":
        return model, list(model.parameters()), None
    if strategy == "lmfs-ddp":
        ddp = DDP(model, bucket_size_mb)
        return ddp, list(model.parameters()), ddp.finish_gradient_sync
    if strategy == "torch-ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None,
                                                        bucket_cap_mb=bucket_size_mb)
        return ddp, list(model.parameters()), None
    if strategy == "lmfs-fsdp":
        fsdp = FullyShardedModel(model, compute_dtype=torch.bfloat16 if cuda else None)
        return fsdp, list(fsdp.parameters()), None
    if strategy == "torch-fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda
                  else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, list(model.parameters()), None
    raise ValueError(f"unknown strategy {strategy!r}: use {', '.join(STRATEGIES)}")


def _measure(strategy: str, config, x, y, device, steps: int, warmup: int, bucket_size_mb: float,
             profile: bool = False) -> dict:
    """Time ``steps`` training steps of one strategy on this rank; its memory after one more."""
    cuda = device.type == "cuda"
    model = build_model(config, seed=0, device=device)
    forward, params, sync = _wrap(strategy, model, device, bucket_size_mb)
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else contextlib.nullcontext()

    def forward_backward():
        with autocast:
            _, loss = forward(x, y)
        loss.backward()
        if sync is not None:
            sync()
        opt.step()

    def step():
        forward_backward()
        opt.zero_grad(set_to_none=True)

    timing = benchmark(step, warmup=warmup, repeats=steps, device=device)
    # Host time to issue one step (no synchronisation): close to the step time means the
    # step is bound by Python and kernel launches, not by the GPU.
    host = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        host.append(time.perf_counter() - start)
        if cuda:
            torch.cuda.synchronize(device)
    kernels = None
    if profile:  # every rank runs the profiled steps (their collectives pair up); rank 0 prints
        kernels = profile_table(step, warmup=1, repeats=3, row_limit=12)
        kernels = kernels if dist.get_rank() == 0 else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    forward_backward()
    memory = memory_report(forward if strategy.endswith("fsdp") else model, opt)
    opt.zero_grad(set_to_none=True)
    del forward, params, sync, opt, model
    if cuda:
        torch.cuda.empty_cache()
    if kernels is not None:
        print(f"\n{strategy}, rank 0: {kernels.attrs['where']} per step\n{kernels.to_string()}", flush=True)
    return {"step_s": timing.median, "spread": timing.spread, "host_s": statistics.median(host), "memory": memory}


def throughput_worker(rank: int, world_size: int, strategies=STRATEGIES, batch_size: int = 8,
                      steps: int = 20, warmup: int = 5, bucket_size_mb: float = 25, profile=()) -> dict:
    """Rank function: every strategy in turn on this rank's own random batch."""
    device = device_for(rank)
    config = gpt2_small() if device.type == "cuda" else tiny()
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = (torch.randint(config.vocab_size, (batch_size, config.context_length), generator=g).to(device)
            for _ in range(2))
    out = {}
    for strategy in strategies:
        if strategy == "single":  # the one-device baseline: rank 0 alone, the others wait
            if rank == 0:
                out[strategy] = _measure(strategy, config, x, y, device, steps, warmup, bucket_size_mb,
                                         strategy in profile)
            dist.barrier()
            continue
        out[strategy] = _measure(strategy, config, x, y, device, steps, warmup, bucket_size_mb,
                                 strategy in profile)
    return out


def summarise(per_rank: list[dict], world_size: int, batch_size: int, context: int) -> list[dict]:
    """One row per strategy: the slowest rank's median step, tokens/s, rank 0's memory."""
    rows = []
    for strategy in per_rank[0]:
        results = [r[strategy] for r in per_rank if strategy in r]
        n = 1 if strategy == "single" else world_size
        step = max(r["step_s"] for r in results)
        rows.append({"strategy": strategy, "gpus": n, "step_ms": step * 1e3,
                     "host_ms": max(r["host_s"] for r in results) * 1e3,
                     "spread": statistics.median(r["spread"] for r in results),
                     "tokens_per_s": n * batch_size * context / step, **per_rank[0][strategy]["memory"]})
    base = {r["strategy"]: r for r in rows}
    for r in rows:
        if "single" in base:
            r["speedup_vs_single"] = r["tokens_per_s"] / base["single"]["tokens_per_s"]
        peer = {"lmfs-ddp": "torch-ddp", "lmfs-fsdp": "torch-fsdp"}.get(r["strategy"])
        if peer in base:
            r["vs_torch"] = r["tokens_per_s"] / base[peer]["tokens_per_s"]
        if r["strategy"].endswith("fsdp") and r["strategy"].replace("fsdp", "ddp") in base:
            r["state_vs_ddp"] = r["total"] / base[r["strategy"].replace("fsdp", "ddp")]["total"]
    return rows


def print_table(rows: list[dict], title: str) -> None:
    mib = 2**20
    print(f"\n{title}")
    head = (f"{'strategy':<11}{'GPUs':>5}{'step ms':>9}{'IQR':>6}{'host ms':>8}{'tokens/s':>12}{'x single':>9}{'x torch':>8}"
            f"{'params MiB':>11}{'grads MiB':>10}{'optim MiB':>10}{'state/DDP':>10}{'peak MiB':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def opt(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{r['strategy']:<11}{r['gpus']:>5}{r['step_ms']:>9.1f}{r['spread']:>6.0%}{r['host_ms']:>8.1f}{r['tokens_per_s']:>12,.0f}"
              f"{opt('speedup_vs_single', '.2f'):>9}{opt('vs_torch', '.2f'):>8}{r['params'] / mib:>11.0f}"
              f"{r['grads'] / mib:>10.0f}{r['optimizer'] / mib:>10.0f}{opt('state_vs_ddp', '.2f'):>10}"
              f"{r['peak_allocated'] / mib if 'peak_allocated' in r else float('nan'):>10.0f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks data-parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per GPU (default 16, as lmfs.benchmarks.train_step; 2 on CPU)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, from: "
                        + ", ".join(STRATEGIES))
    parser.add_argument("--bucket-mb", type=float, default=25)
    parser.add_argument("--profile", default="", help="comma-separated strategies whose kernels rank 0 "
                        "prints (torch.profiler)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    strategies = tuple(s for s in args.strategies.split(",") if s)
    for s in strategies:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}: use {', '.join(STRATEGIES)}")
    on_gpus = placement(args.world_size).backend == "nccl"
    batch = args.batch_size or (16 if on_gpus else 2)
    steps, warmup = (args.steps, 5) if on_gpus else (min(args.steps, 3), 1)
    if not on_gpus:
        print(f"fewer than {args.world_size} GPUs: a tiny model on CPU processes (gloo), to exercise the code")
    per_rank = run(throughput_worker, args.world_size, strategies, batch, steps, warmup, args.bucket_mb,
                   tuple(args.profile.split(",")), timeout=900)
    config = gpt2_small() if on_gpus else tiny()
    rows = summarise(per_rank, args.world_size, batch, config.context_length)
    device = torch.cuda.get_device_name(0) if on_gpus else "CPU (gloo)"
    precision = "bf16 autocast" if on_gpus else "fp32"
    print_table(rows, f"{device}: {args.world_size} ranks, {batch} x {config.context_length} tokens per rank, "
                      f"{precision}, eager, AdamW")
    result = {"device": device, "world_size": args.world_size, "batch_per_rank": batch,
              "context": config.context_length, "torch": torch.__version__, "rows": rows}
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
