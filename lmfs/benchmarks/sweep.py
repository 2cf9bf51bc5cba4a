"""Sweep throughput: the same IsoFLOP grid trained one run after another, then several at once.

    python -m lmfs.benchmarks sweep [--workers 6] [--scale full] [--json out.json]

The grid is lecture 09's (``lmfs.scales.lecture_config("09", scale)``: sizes × budgets, data,
batch shape). Both passes train every run from scratch into their own temporary folder with
:func:`lmfs.scaling.sweep.run_sweep`, first with ``workers=1`` (sequential, one process), then with
``--workers`` processes sharing the device. Printed: each pass's wall time, the ratio
concurrent ÷ sequential (the goal on one H200 is ≤ 0.5), and the largest difference between the
two passes' final losses (the same runs, so the same losses up to GPU non-determinism), and the
grid's IsoFLOP minima (:func:`lmfs.scaling.chinchilla.isoflop_method`, as lecture 09 fits them).
Without a GPU the smoke grid runs, two workers on the CPU's cores: the numbers only exercise the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import torch

from lmfs.bench import save_json
from lmfs.bench.timing import synchronize
from lmfs.env import resolve_scale
from lmfs.nn import TransformerConfig
from lmfs.scales import lecture_config
from lmfs.scaling.chinchilla import isoflop_method
from lmfs.scaling.sweep import SweepOptions, plan_sweep, run_sweep, sweep_frame
from lmfs.train import prepare_tokens


def run(scale: str = "auto", workers: int | None = None, device: str | None = None, corpus: str = "stdlib") -> dict:
    """Time the grid sequentially and with ``workers`` processes; print and return the numbers."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = lecture_config("09", scale)
    workers = workers or (cfg.workers if cfg.workers > 1 else 2)
    data = prepare_tokens(corpus, n_bytes=cfg.corpus_bytes, vocab_size=cfg.vocab_size)
    options = SweepOptions(batch_size=cfg.batch_size, context_length=cfg.context_length, lr=cfg.lr,
                           eval_batches=cfg.eval_batches)
    base = TransformerConfig(vocab_size=data.vocab_size, context_length=cfg.context_length, n_heads=cfg.n_heads)
    runs = plan_sweep(list(cfg.sizes), list(cfg.budgets), base, options)
    seconds, losses = {}, {}
    for name, n in (("sequential", 1), (f"{workers} workers", workers)):
        with tempfile.TemporaryDirectory(prefix="lmfs-sweep-") as folder:
            started = time.perf_counter()
            records = run_sweep(runs, folder, data.train, data.val, options, device, workers=n, progress=False)
            synchronize(device)
            seconds[name] = time.perf_counter() - started
            losses[name] = {r["key"]: r["final_loss"] for r in records}
        print(f"  {name}: {seconds[name]:.1f} s", flush=True)
    sequential, concurrent = seconds.values()
    seq_losses, con_losses = losses.values()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "scale": resolve_scale(scale),
              "runs": len(runs), "workers": workers, "steps": sum(r["steps"] for r in runs),
              "options": dataclasses.asdict(options), "budgets": list(cfg.budgets),
              "sequential_s": sequential, "concurrent_s": concurrent, "ratio": concurrent / sequential,
              "max_loss_diff": max(abs(seq_losses[k] - con_losses[k]) for k in seq_losses)}
    frame = sweep_frame(records)   # the concurrent pass's runs: the grid's answer, fitted as lecture 09 does
    if frame.C.nunique() >= 2:
        iso, profiles = isoflop_method(frame.N, frame.C, frame.loss)
        result["isoflop"] = {"a": iso.a, "minima": [{"flops": p.C, "n_opt": p.N_opt, "loss": p.loss_opt}
                                                    for p in profiles]}
        print("IsoFLOP minima: " + ", ".join(f"N* = {p.N_opt:,.0f} at {p.C:.0e} FLOPs" for p in profiles)
              + f"; N* ∝ C^{iso.a:.2f}")
    print(f"\nIsoFLOP grid of {len(runs)} runs ({result['steps']:,} steps) on {result['device']}: "
          f"sequential {sequential:.1f} s, {workers} workers {concurrent:.1f} s, "
          f"ratio {result['ratio']:.2f} (goal <= 0.5); max |Δ final loss| {result['max_loss_diff']:.2e}")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="lecture 09's IsoFLOP sweep: sequential vs several runs at once")
    parser.add_argument("--scale", default="auto", help="grid of lecture 09's config: smoke or full "
                                                         "(default: full on a GPU, smoke without one)")
    parser.add_argument("--workers", type=int, default=None, help="processes of the concurrent pass "
                                                                  "(default: the config's, at least 2)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.scale, args.workers, args.device)
    save_json(result, args.json)
    return result
