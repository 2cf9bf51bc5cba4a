"""lmfs.parallel on gloo CPU processes (also on GPU machines): every strategy against single-process training.

Starting processes dominates the run time (each imports torch), so each test launches once and
its worker function, defined here at module level so that spawned processes can import it,
batches several checks.
"""

import gc
import time
import weakref
from functools import partial

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lmfs.parallel import run, run_each
from lmfs.parallel.collectives import (bandwidth_worker, collectives_table, compare_all_reduce, demo_collectives,
                                       reference_collectives)
from lmfs.parallel.common import build_model, demo_batches, demo_config, shard_batch, train_single
from lmfs.parallel.costs import STRATEGIES, cost_table, llama_70b, strategy_costs
from lmfs.parallel.ddp import DDP, NaiveDDP, train_ddp
from lmfs.nn.moe import MoE
from lmfs.parallel.expert import ExpertParallelMoE, moe_batches, train_expert_parallel, train_moe_single
from lmfs.parallel.launch import RankFailedError, free_port, placement
from lmfs.parallel.pipeline import bubble, bubble_sweep, plot_timeline, train_pipeline
from lmfs.parallel.ring_attention import check_ring_attention, full_attention, full_attention_inputs
from lmfs.parallel.tensor import train_tensor_parallel
from lmfs.parallel.zero import FullyShardedModel, ZeroOptimizer, train_zero

matplotlib.use("Agg")  # plots render off-screen

ATOL = 1e-5
ADAMW = dict(lr=1e-3)  # small steps: Adam's sign-like first steps would amplify rounding noise


def assert_same_state(got: dict, want: dict, atol=ATOL, what=""):
    assert set(got) == set(want), f"{what}: parameter names differ: {set(got) ^ set(want)}"
    for name in want:
        err = (got[name] - want[name]).abs().max().item()
        assert err <= atol, f"{what}: {name} differs by {err:.2e}"


def merged(states):
    out = {}
    for s in states:
        out |= s
    return out


# ---------------------------------------------------------------------------------------------
# Launcher


def failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def hanging_worker(rank, world_size):
    if rank == 1:
        time.sleep(120)  # never joins the all-reduce below
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


def rank_and_size(rank, world_size):
    return rank, world_size, dist.get_world_size()


def test_collectives_equal_their_definitions():
    # run_each: both rank functions in one launch, results regrouped per job
    each = run_each({"demo": demo_collectives, "all_reduce": partial(compare_all_reduce, numel=1000)}, 4)
    assert list(each) == ["demo", "all_reduce"] and all(len(v) == 4 for v in each.values())
    results = [{job: each[job][rank] for job in each} for rank in range(4)]
    table = collectives_table([r["demo"] for r in results])
    assert table.loc["all_to_all", "rank 1"] == "[10, 11, 12, 13] → [1, 11, 21, 31]"
    want = reference_collectives(4)
    for rank, (res, ref) in enumerate(zip(results, want)):
        for op, r in ref.items():
            got = res["demo"][op]
            assert torch.equal(got["before"], r["before"])
            if r["after"] is None:
                assert got["after"] is None, (op, rank)
            else:
                assert torch.equal(got["after"], r["after"]), (op, rank, got["after"], r["after"])
        inputs = torch.stack([x["all_reduce"]["input"] for x in results])
        torch.testing.assert_close(res["all_reduce"]["all_reduce"], inputs.sum(0))
        torch.testing.assert_close(res["all_reduce"]["rs_ag"], res["all_reduce"]["all_reduce"])


def test_failing_rank_raises_with_its_rank_and_traceback():
    with pytest.raises(RankFailedError, match="rank 1 failed") as info:
        run(failing_worker, 2)
    assert info.value.rank == 1
    assert "rank 1 fails on purpose" in str(info.value)


def test_hung_collective_times_out():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="timed out") as info:
        run(hanging_worker, 2, timeout=5)
    assert info.value.rank == 0
    assert time.monotonic() - start < 60


def test_a_port_taken_before_rank_0_binds_it_is_retried(monkeypatch):
    import socket

    import lmfs.parallel.launch as launch
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        offers = iter([taken.getsockname()[1]])  # first offer: a port someone else holds
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(offers, None) or real())
        assert run(rank_and_size, 2) == [(0, 2, 2), (1, 2, 2)]


def test_unimportable_functions_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="top level of a .py module"):
        run(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match="top level of a .py module"):  # checked before any process starts
        run_each({"fine": rank_and_size, "not": partial(lambda rank, world_size: rank)}, 2)
    with pytest.raises(TypeError, match="functools.partial"):
        run_each({"oops": 3}, 2)

    def nested(rank, world_size):
        return rank
    with pytest.raises(ValueError, match="spawn"):
        run(nested, 2)


def test_placement_uses_gloo_when_there_are_fewer_gpus_than_ranks(monkeypatch):
    monkeypatch.delenv("LMFS_DIST_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_gpu = placement(2)
    assert (one_gpu.backend, one_gpu.device) == ("gloo", "cpu")
    assert "1 GPU for 2 ranks" in one_gpu.reason and "gloo" in str(one_gpu)
    assert (placement(1).backend, placement(1).device) == ("nccl", "cuda")
    with pytest.raises(ValueError, match="one GPU per rank"):
        placement(2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement(2).backend == "nccl"
    assert placement(4).backend == "gloo"
    assert placement(4, ranks_per_node=2).backend == "nccl"  # torchrun: 2 of the 4 ranks on this machine
    monkeypatch.setenv("LMFS_DIST_BACKEND", "gloo")
    assert placement(2).backend == "gloo" and "LMFS_DIST_BACKEND" in placement(2).reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LMFS_DIST_BACKEND")
    assert placement(1).backend == "gloo"


def test_under_torchrun_runs_in_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert run(rank_and_size, 1, backend="gloo") == [(0, 1, 1)]
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="WORLD_SIZE=1"):
        run(rank_and_size, 2)


# ---------------------------------------------------------------------------------------------
# Data parallelism and ZeRO


class Partial(nn.Module):
    """A used layer, a layer only rank 0 uses, one nobody uses and a frozen one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.rank0_only, self.unused = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x, rank):
        h = self.frozen(self.used(x))
        return (self.rank0_only(h) if rank == 0 else h).pow(2).mean()


def partial_grads(rank):
    model = Partial()
    model(torch.full((2, 4), float(rank + 1)), rank).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def fsdp_gathered_tensors_alive(config, batch, rank, world_size):
    """How many gathered full-parameter tensors survive a unit's forward, and the backward."""
    model = FullyShardedModel(build_model(config, 0, "cpu"))
    gathered, gather = [], model._gather
    model._gather = lambda unit, dtype: remember(gathered, gather(unit, dtype))
    _, loss = model(*shard_batch(batch, rank, world_size))
    # Now and then (1 run in 6-10 here) one gathered tensor outlives its unit's forward for a
    # moment: nothing in Python refers to it (gc.get_referrers finds nothing) and it goes away with
    # time, sometimes only at a collection; the process group's worker thread most likely still
    # holds the finished collective, and with it its output. Give it up to two seconds.
    deadline = time.perf_counter() + 2
    while any(ref() is not None for ref in gathered) and time.perf_counter() < deadline:
        gc.collect()
        time.sleep(0.01)
    after_forward = sum(ref() is not None for ref in gathered)
    loss.backward()
    return {"gathers": len(gathered), "after_forward": after_forward,
            "after_backward": sum(ref() is not None for ref in gathered)}


def buckets_launched_in_backward(config, batch, rank, world_size):
    """(buckets whose collective started during backward, buckets) for DDP and ZeRO-2."""
    out = {}
    for name in ("ddp", "ddp_one_bucket", "zero2"):
        model = build_model(config, 0, "cpu")
        if name.startswith("ddp"):
            wrapper = DDP(model, bucket_size_mb=0.02 if name == "ddp" else None)
            bucketers = [wrapper.buckets]
        else:
            wrapper = ZeroOptimizer(model.parameters(), torch.optim.AdamW, 2, bucket_size_mb=0.02)
            bucketers = wrapper.bucketers
        _, loss = model(*shard_batch(batch, rank, world_size))
        loss.backward()
        out[name] = (sum(b.next_to_launch for b in bucketers), sum(len(b.buckets) for b in bucketers))
        wrapper.finish_gradient_sync() if name.startswith("ddp") else wrapper.step()
    return out


def remember(refs, tensor):
    refs.append(weakref.ref(tensor))
    return tensor


def data_parallel_worker(rank, world_size, config, batches):
    out = {mode: train_ddp(rank, world_size, config, batches, mode, torch.optim.AdamW, ADAMW,
                           bucket_size_mb=0.02) for mode in ("naive", "bucketed")}
    out["one_bucket"] = train_ddp(rank, world_size, config, batches, "bucketed", torch.optim.AdamW, ADAMW,
                                  bucket_size_mb=None)
    for stage in (1, 2, 3):
        out[f"zero{stage}"] = train_zero(rank, world_size, config, batches, stage, torch.optim.AdamW,
                                         ADAMW, bucket_size_mb=0.02)
    out["zero3_bf16"] = train_zero(rank, world_size, config, batches, 3, torch.optim.AdamW, ADAMW,
                                   compute_dtype=torch.bfloat16)
    out["fsdp_alive"] = fsdp_gathered_tensors_alive(config, batches[0], rank, world_size)
    out["launched_in_backward"] = buckets_launched_in_backward(config, batches[0], rank, world_size)
    for name, wrap in (("naive_partial", NaiveDDP), ("bucketed_partial", DDP)):
        model = Partial()
        ddp = (wrap(model, find_unused_parameters=True) if wrap is NaiveDDP
               else wrap(model, bucket_size_mb=1e-4, find_unused_parameters=True))
        ddp(torch.full((2, 4), float(rank + 1)), rank).backward()
        ddp.finish_gradient_sync()
        out[name] = {n: p.grad for n, p in model.named_parameters()}
    return out


def test_data_parallel_and_zero_match_single_process():
    config, batches = demo_config(), demo_batches(3, 8, 16, 64)
    ref = train_single(config, batches, torch.optim.AdamW, ADAMW)
    assert len(ref["losses"]) == len(ref["step_seconds"]) == len(batches)
    results = run(data_parallel_worker, 2, config, batches)
    res = results[0]
    for name in ("naive", "bucketed", "one_bucket", "zero1", "zero2", "zero3"):
        assert_same_state(res[name]["state"], ref["state"], what=name)
        assert res[name]["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    # bf16 compute: the same training to bf16 accuracy
    assert res["zero3_bf16"]["losses"] == pytest.approx(ref["losses"], abs=2e-3)
    assert_same_state(res["zero3_bf16"]["state"], ref["state"], atol=0.05, what="zero3 bf16")

    # Memory: ZeRO shards optimizer state, then gradients, then parameters (n = 2).
    mem = {k: res[k]["memory"] for k in ("bucketed", "zero1", "zero2", "zero3")}
    P = mem["bucketed"]["params"]
    assert mem["bucketed"]["optimizer"] == pytest.approx(2 * P, rel=0.01)
    assert mem["zero1"]["optimizer"] == pytest.approx(P, rel=0.01)
    assert mem["zero2"]["grads"] == pytest.approx(P / 2, rel=0.01)
    assert mem["zero3"]["params"] == pytest.approx(P / 2, rel=0.01)
    assert mem["zero3"]["total"] == pytest.approx(mem["bucketed"]["total"] / 2, rel=0.01)

    # Bytes per step (n = 2): an all-reduce sends 2(n-1)/n = 1x the tensor, half-collectives 1/2.
    n_params = sum(v.numel() for v in ref["state"].values())
    by_op = {k: res[k]["bytes_per_step"]["by_op"] for k in res if "bytes_per_step" in res[k]}
    assert by_op["naive"]["all_reduce"] == by_op["bucketed"]["all_reduce"] == 4 * n_params
    assert by_op["one_bucket"]["all_reduce"] == 4 * n_params
    assert by_op["zero2"]["reduce_scatter"] == by_op["zero2"]["all_gather"]
    assert by_op["zero2"]["all_gather"] == pytest.approx(2 * n_params, rel=0.01)
    assert by_op["zero3"]["all_gather"] == pytest.approx(4 * n_params, rel=0.01)       # forward + backward
    assert by_op["zero3_bf16"]["all_gather"] == pytest.approx(2 * n_params, rel=0.01)  # in bf16

    # FSDP frees each unit's gathered parameters after its forward and again after its backward;
    # it gathers every unit twice (forward, backward): n_layers blocks and the root.
    units = config.n_layers + 1
    assert res["fsdp_alive"] == {"gathers": 2 * units, "after_forward": 0, "after_backward": 0}

    # Bucketed DDP and ZeRO-2 start every bucket's collective before backward returns.
    # bucket_size_mb=None: one bucket holding every gradient.
    launched = res["launched_in_backward"]
    for name in ("ddp", "zero2"):
        assert launched[name][0] == launched[name][1] > 1, name
    assert launched["ddp_one_bucket"] == (1, 1)

    # Unused and frozen parameters: the average over ranks, None where nobody had a gradient.
    g0, g1 = partial_grads(0), partial_grads(1)
    for name in ("naive_partial", "bucketed_partial"):
        for rank_result in results:
            grads = rank_result[name]
            torch.testing.assert_close(grads["used.weight"], (g0["used.weight"] + g1["used.weight"]) / 2)
            torch.testing.assert_close(grads["rank0_only.weight"], g0["rank0_only.weight"] / 2)
            assert grads["unused.weight"] is None and grads["frozen.weight"] is None


def inverse_step(step):
    return 1.0 / (1 + step)


def zero_checkpoint_worker(rank, world_size, config, batches, k, folder):
    """ZeRO-1/2 with a LambdaLR: save after k steps, continue; a fresh run restored from the saves
    must end with exactly the same parameters. Also a plain AdamW + LambdaLR replica of the full
    batch (no process group) as the independent reference for the schedule."""
    out = {}
    for stage in (1, 2):
        def fresh(seed):
            model = build_model(config, seed, "cpu")
            opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage, bucket_size_mb=0.02, **ADAMW)
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, inverse_step)

        def train(model, opt, sched, part):
            for batch in part:
                _, loss = model(*shard_batch(batch, rank, world_size))
                loss.backward()  # ZeroOptimizer averages the ranks' gradients in step()
                opt.step()
                sched.step()
                opt.zero_grad()

        model, opt, sched = fresh(0)
        train(model, opt, sched, batches[:k])
        path = folder / f"zero{stage}-rank{rank}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                   path)
        train(model, opt, sched, batches[k:])
        lr_seen = opt.inner.param_groups[0]["lr"]

        restored, opt2, sched2 = fresh(100 + rank)  # a different start: everything must come from the files
        saved = torch.load(path, weights_only=False)
        restored.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optimizer"])
        sched2.load_state_dict(saved["scheduler"])
        train(restored, opt2, sched2, batches[k:])
        out[stage] = {"continued": model.state_dict(), "restored": restored.state_dict(), "lr": lr_seen}

        dist.barrier()  # every rank has written its file
        other = torch.load(folder / f"zero{stage}-rank{1 - rank}.pt", weights_only=False)["optimizer"]
        try:
            opt2.load_state_dict(other)
        except ValueError as err:
            out[stage]["wrong_rank"] = str(err)

    torch.manual_seed(0)
    replica = build_model(config, 0, "cpu")
    opt = torch.optim.AdamW(replica.parameters(), **ADAMW)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_step)
    for x, y in batches:
        replica(x, y)[1].backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    out["replica"] = replica.state_dict()
    return out


def test_zero_optimizer_resumes_from_per_rank_checkpoints_and_takes_lr_schedules(tmp_path):
    config, batches = demo_config(), demo_batches(5, 8, 16, 64)
    k = 2
    results = run(zero_checkpoint_worker, 2, config, batches, k, tmp_path)
    for rank, res in enumerate(results):
        for stage in (1, 2):
            r = res[stage]
            for name, want in r["continued"].items():
                assert torch.equal(r["restored"][name], want), f"stage {stage}, rank {rank}: {name} differs"
            # LambdaLR drove the inner optimizer: lr · 1/(1 + steps taken) ...
            assert r["lr"] == pytest.approx(ADAMW["lr"] / (1 + len(batches)))
            # ... and ZeRO under the schedule trains like plain AdamW under it.
            assert_same_state(r["continued"], res["replica"], what=f"zero{stage} with LambdaLR")
            assert f"rank {1 - rank}'s shard of a 2-rank run" in r["wrong_rank"]
            assert f"this is rank {rank} of 2" in r["wrong_rank"]


# ---------------------------------------------------------------------------------------------
# Tensor, pipeline, expert and context parallelism


def tensor_parallel_worker(rank, world_size, config, batches):
    return {sp: train_tensor_parallel(rank, world_size, config, batches, sp, torch.optim.AdamW, ADAMW)
            for sp in (False, True)}


def test_tensor_and_sequence_parallel_match_single_process():
    config, batches = demo_config(n_kv_heads=2, bias=True), demo_batches(3, 4, 16, 64)  # GQA
    ref = train_single(config, batches, torch.optim.AdamW, ADAMW)
    res = run(tensor_parallel_worker, 2, config, batches)[0]
    for sp in (False, True):
        assert_same_state(res[sp]["state"], ref["state"], what=f"sequence_parallel={sp}")
        assert res[sp]["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    # Each rank holds half of every block's matrices and of the column layers' biases; embedding,
    # norms and the row layers' biases (added after the sum) stay whole.
    whole = ("norms.0.weight", "norms.1.weight", "o_proj.bias", "down.bias")
    full = 4 * sum(v.numel() for v in ref["state"].values())
    split = 4 * sum(v.numel() for k, v in ref["state"].items()
                    if k.startswith("blocks") and not k.endswith(whole))
    assert res[False]["memory"]["params"] == full - split // 2
    # Sequence parallelism trades each all-reduce for a reduce-scatter + all-gather of equal bytes.
    tp, sp = res[False]["bytes_per_step"]["by_op"], res[True]["bytes_per_step"]["by_op"]
    assert sp["reduce_scatter"] + sp["all_gather"] == tp["all_reduce"]


def pipeline_worker(rank, world_size, config, batches):
    out = {s: train_pipeline(rank, world_size, config, batches, s, 4, torch.optim.AdamW, ADAMW)
           for s in ("naive", "gpipe", "1f1b")}
    out["simulated"] = bubble_sweep(rank, world_size, ("gpipe", "1f1b"), (4,), 20, 40)
    return out


def test_pipeline_schedules_match_single_process_and_bubble_formula():
    config, batches = demo_config(n_layers=4), demo_batches(3, 8, 16, 64)  # tied embeddings
    ref = train_single(config, batches, torch.optim.AdamW, ADAMW)
    results = run(pipeline_worker, 4, config, batches)
    for s in ("naive", "gpipe", "1f1b"):
        assert_same_state(merged(r[s]["state"] for r in results), ref["state"], what=s)
        assert results[0][s]["losses"] == pytest.approx(ref["losses"], abs=1e-5)
        order = [(kind, i) for kind, i, *_ in results[-1][s]["timeline"]]
        m = 1 if s == "naive" else 4
        assert sorted(order) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
    # The last stage alternates under 1F1B and does all forwards first under GPipe, so 1F1B's
    # stage s holds at most p - s micro-batches of activations where GPipe holds all m.
    assert [k for k, *_ in results[-1]["1f1b"]["timeline"]] == ["F", "B"] * 4
    assert [k for k, *_ in results[-1]["gpipe"]["timeline"]] == ["F"] * 4 + ["B"] * 4
    assert [r["1f1b"]["max_in_flight"] for r in results] == [4, 3, 2, 1]
    assert [r["gpipe"]["max_in_flight"] for r in results] == [4, 4, 4, 4]
    # Each stage holds only its layers: together exactly the model, plus the last stage's copy
    # of the tied embedding.
    full = 4 * sum(v.numel() for v in ref["state"].values())
    tied_copy = 4 * ref["state"]["tok_emb.weight"].numel()
    assert sum(r["1f1b"]["memory"]["params"] for r in results) == full + tied_copy
    ax = plot_timeline([r["1f1b"]["timeline"] for r in results], title="1F1B")
    assert len(ax.collections) == len(ax.texts) == 4 * 8  # 4 stages × (4 forwards + 4 backwards)
    for s in ("gpipe", "1f1b"):
        b = bubble([r["simulated"][s][4] for r in results], 4)
        assert b["formula_fraction"] == pytest.approx(3 / 7)
        # Sleeps make stage times equal; messages add a little idle time on top of the formula.
        assert b["formula_fraction"] - 0.02 < b["measured_fraction"] < b["formula_fraction"] + 0.12, b


def expert_worker(rank, world_size, batches):
    out = {k: train_expert_parallel(rank, world_size, batches, 16, 32, 8, k, torch.optim.AdamW, ADAMW)
           for k in (1, 2)}
    with pytest.raises(ValueError, match="3 experts do not split over 2 expert-parallel ranks"):
        ExpertParallelMoE(MoE(16, 32, 3, 1))
    return out


def test_expert_parallel_matches_single_process_moe():
    batches = moe_batches(3, 32, 16)
    results = run(expert_worker, 2, batches)  # 8 experts, 4 per rank
    for k in (1, 2):
        ref = train_moe_single(batches, 16, 32, 8, k, torch.optim.AdamW, ADAMW)
        out = torch.cat([r[k]["first_output"] for r in results])
        torch.testing.assert_close(out, ref["first_output"], atol=ATOL, rtol=0)
        assert_same_state(merged(r[k]["state"] for r in results), ref["state"], what=f"top-{k}")
        assert "all_to_all" in results[0][k]["bytes_per_step"]["by_op"]
        for rank, r in enumerate(results):  # rank r holds experts 4r .. 4r + 3 and the router
            experts = {name.split(".")[1] for name in r[k]["state"] if name.startswith("experts.")}
            assert experts == {str(4 * rank + j) for j in range(4)}


def ring_worker(rank, world_size):
    return {c: check_ring_attention(rank, world_size, batch=2, heads=2, seq_len=32, head_dim=8,
                                    causal=c) for c in (True, False)}


def test_ring_attention_equals_full_attention():
    results = run(ring_worker, 4)
    for causal in (True, False):
        want = full_attention(*full_attention_inputs(2, 2, 32, 8), causal=causal)
        for key in ("out", "dq", "dk", "dv"):
            got = torch.cat([r[causal][key] for r in results], dim=2)
            torch.testing.assert_close(got, want[key], atol=ATOL, rtol=0, msg=f"{key} causal={causal}")
        # Each rank passes a K/V block on n-1 times in forward and again in backward, and the
        # block's dK/dV n times (the last hop brings them home): B·H·(T/n)·d fp32 values each.
        kv_block = 2 * (2 * 2 * 8 * 8) * 4
        assert results[0][causal]["bytes"]["total"] == (3 + 3 + 4) * kv_block


# ---------------------------------------------------------------------------------------------
# Costs and benchmark


def test_cost_calculator_relations():
    cfg = llama_70b()
    c = {s: strategy_costs(cfg, s, 8, 8, 4096, n_experts=8 if s == "ep" else None) for s in STRATEGIES}
    ddp = c["ddp"]
    assert ddp["params_GB"] == pytest.approx(2 * 70.55, rel=1e-3)          # bf16 weights
    assert c["zero1"]["optimizer_GB"] == pytest.approx(ddp["optimizer_GB"] / 8)
    assert c["zero2"]["grads_GB"] == pytest.approx(ddp["grads_GB"] / 8)
    assert c["zero3"]["sent_GB_per_step"] == pytest.approx(1.5 * ddp["sent_GB_per_step"])
    assert c["zero1"]["sent_GB_per_step"] == pytest.approx(ddp["sent_GB_per_step"])
    assert c["tp+sp"]["activations_GB"] < c["tp"]["activations_GB"]
    assert c["pp"]["sent_GB_per_step"] < c["tp"]["sent_GB_per_step"] / 100
    assert c["cp"]["activations_GB"] == pytest.approx(ddp["activations_GB"], rel=0.01)  # B/n ≈ T/n
    table = cost_table()
    assert list(table.index) == [s for s in STRATEGIES if s != "ep"]
    with pytest.raises(ValueError, match="n_experts"):
        strategy_costs(cfg, "ep", 8, 8, 4096)


def test_bandwidth_benchmark_rows():
    rows = run(bandwidth_worker, 2, ("all_reduce", "reduce_scatter"), [2**16, 2**18], 1, 3)[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce", 2**16), ("all_reduce", 2**18), ("reduce_scatter", 2**16), ("reduce_scatter", 2**18)]
    for r in rows:
        factor = 1.0 if r["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n for n = 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
        assert r["time_us"] > 0


@pytest.fixture(autouse=True)
def _no_leftover_process_group(monkeypatch):
    # These checks compare with CPU results and use CPU tensors: gloo even on a GPU machine
    # (tests/test_parallel_gpu.py runs the strategies on NCCL).
    monkeypatch.setenv("LMFS_DIST_BACKEND", "gloo")
    yield
    assert not dist.is_initialized()


def test_data_parallel_benchmark_runs_and_zero3_halves_the_state(tmp_path):
    from lmfs.benchmarks.data_parallel import main

    result = main(["--steps", "2", "--json", str(tmp_path / "dp.json")])
    rows = {r["strategy"]: r for r in result["rows"]}
    assert list(rows) == ["single", "lmfs-ddp", "torch-ddp", "lmfs-fsdp", "torch-fsdp"]
    assert rows["single"]["gpus"] == 1 and rows["lmfs-ddp"]["gpus"] == 2
    # n = 2: ZeRO-3 (ours and PyTorch's FSDP2) keeps half of DDP's parameters + gradients + Adam state
    assert rows["lmfs-fsdp"]["state_vs_ddp"] == pytest.approx(0.5, abs=0.01)
    assert rows["torch-fsdp"]["state_vs_ddp"] == pytest.approx(0.5, abs=0.01)
    assert rows["lmfs-ddp"]["optimizer"] == pytest.approx(2 * rows["lmfs-ddp"]["params"], rel=0.01)
    assert (tmp_path / "dp.json").exists()
