"""lmfs.parallel on NCCL, one process per GPU (needs 2 GPUs; skipped elsewhere).

The same strategies as tests/test_parallel.py, now on GPUs: they must still reproduce
single-GPU training, and the throughput benchmark must run and shard memory as ZeRO says.
"""

from functools import partial

import pytest
import torch

from lmfs.parallel import placement, run, run_each
from lmfs.parallel.common import demo_batches, demo_config, train_single
from lmfs.parallel.ddp import train_ddp
from lmfs.parallel.expert import moe_batches, train_expert_parallel, train_moe_single
from lmfs.parallel.pipeline import train_pipeline
from lmfs.parallel.ring_attention import check_ring_attention, full_attention, full_attention_inputs
from lmfs.parallel.tensor import train_tensor_parallel
from lmfs.parallel.zero import train_zero

# The decision the lectures use (lmfs.parallel.placement): NCCL when there is a GPU per rank.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(placement(2).backend != "nccl",
                                                  reason="needs 2 GPUs (NCCL, one process each)")]

ADAMW = dict(lr=1e-3, eps=1e-6)


def test_strategies_on_nccl_match_one_gpu(monkeypatch):
    monkeypatch.delenv("LMFS_DIST_BACKEND", raising=False)
    config, batches = demo_config(n_kv_heads=2), demo_batches(3, 8, 16, 64)
    ref = train_single(config, batches, torch.optim.AdamW, ADAMW, device="cuda:0")
    common = dict(config=config, batches=batches, optimizer_class=torch.optim.AdamW, optimizer_kwargs=ADAMW)
    jobs = {"naive": partial(train_ddp, mode="naive", **common),
            "bucketed": partial(train_ddp, mode="bucketed", bucket_size_mb=0.02, **common),
            "zero1": partial(train_zero, stage=1, bucket_size_mb=0.02, **common),
            "zero2": partial(train_zero, stage=2, bucket_size_mb=0.02, **common),
            "zero3": partial(train_zero, stage=3, **common),
            "tensor": partial(train_tensor_parallel, sequence_parallel=True, **common),
            "pipeline": partial(train_pipeline, schedule="1f1b", micro_batches=4, **common)}
    out = run_each(jobs, 2, backend="nccl", timeout=300)
    for name, per_rank in out.items():
        state = {k: v for r in per_rank for k, v in (r["state"] or {}).items()}  # pipeline: per stage
        for key, want in ref["state"].items():
            err = (state[key] - want).abs().max().item()
            assert err <= 1e-4, f"{name}: {key} differs from one-GPU training by {err:.2e}"


def test_data_parallel_benchmark_on_gpus(monkeypatch):
    from lmfs.benchmarks.data_parallel import main

    monkeypatch.delenv("LMFS_DIST_BACKEND", raising=False)
    result = main(["--steps", "3", "--batch-size", "2"])
    rows = {r["strategy"]: r for r in result["rows"]}
    assert set(rows) == {"single", "lmfs-ddp", "torch-ddp", "lmfs-fsdp", "torch-fsdp"}
    # ZeRO-3 keeps half of DDP's parameters, gradients and optimizer state on each of 2 ranks.
    assert rows["lmfs-fsdp"]["state_vs_ddp"] == pytest.approx(0.5, abs=0.02)
    assert rows["torch-fsdp"]["state_vs_ddp"] == pytest.approx(0.5, abs=0.02)
    assert all(r["tokens_per_s"] > 0 for r in rows.values())


def expert_and_ring_worker(rank, world_size, batches):
    return {"moe": train_expert_parallel(rank, world_size, batches, 16, 32, 8, 2, torch.optim.AdamW, ADAMW),
            "ring": check_ring_attention(rank, world_size, batch=2, heads=2, seq_len=32, head_dim=8,
                                         causal=True)}


def test_expert_parallel_and_ring_attention_on_nccl(monkeypatch):
    monkeypatch.delenv("LMFS_DIST_BACKEND", raising=False)
    batches = moe_batches(3, 32, 16)
    results = run(expert_and_ring_worker, 2, batches, backend="nccl", timeout=300)
    ref = train_moe_single(batches, 16, 32, 8, 2, torch.optim.AdamW, ADAMW)
    state = {k: v for r in results for k, v in r["moe"]["state"].items()}
    for key, want in ref["state"].items():
        assert (state[key] - want).abs().max().item() <= 1e-4, key
    want = full_attention(*full_attention_inputs(2, 2, 32, 8), causal=True)
    for key in ("out", "dq", "dk", "dv"):
        got = torch.cat([r["ring"][key] for r in results], dim=2)
        torch.testing.assert_close(got, want[key], atol=1e-4, rtol=0, msg=key)
