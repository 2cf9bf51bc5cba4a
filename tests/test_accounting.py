import contextlib
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmfs.accounting import (GPU_MEMORY_BYTES, PEAK_FLOPS, activation_bytes_per_layer, flops_per_token,
                             largest_trainable_model, matmul_params, mfu, param_count, time_to_train,
                             training_flops, training_memory)
from lmfs.bench import memory
from lmfs.nn import Linear, TransformerConfig, TransformerLM
from lmfs.optim import AdamW
from lmfs.train import TrainConfig, accumulate_gradients, make_optimizer


def tiny(**overrides) -> TransformerConfig:
    base = dict(vocab_size=100, context_length=64, d_model=64, n_layers=2, n_heads=4)
    return TransformerConfig(**{**base, **overrides})


def gpt2_small(**overrides) -> TransformerConfig:
    return TransformerConfig(vocab_size=32000, context_length=1024, d_model=768, n_layers=12, n_heads=12,
                             tie_embeddings=False, **overrides)


VARIANTS = [
    dict(),
    dict(tie_embeddings=False, n_kv_heads=2),
    dict(norm="layer", ffn="gelu", positions="learned", bias=True),
    dict(attention="mla", kv_latent_dim=16, qk_norm=True, ffn="relu"),
    dict(norm_position="double", parallel=True, d_ff=100, positions="sinusoidal"),
]


def batch(config, B=3, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(config.vocab_size, (B, T), generator=g),
            torch.randint(config.vocab_size, (B, T), generator=g))


@pytest.mark.parametrize("overrides", VARIANTS, ids=str)
def test_param_and_matmul_counts_match_the_model(overrides):
    config = tiny(**overrides)
    model = TransformerLM(config)
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    head = 0 if model.lm_head is not None else config.vocab_size * config.d_model  # tied: the embedding
    assert matmul_params(config) == linears + head


@pytest.mark.parametrize("overrides", VARIANTS[:4], ids=str)
def test_flops_match_torchs_flop_counter(overrides):
    # SDPA is not counted on the CPU, so attention runs through the explicit reference path.
    config = tiny(attn_impl="reference", **overrides)
    model = TransformerLM(config)
    x, y = batch(config)
    with FlopCounterMode(display=False) as forward_counter:
        loss = model(x, y)[1]
    counted = forward_counter.get_total_flops()
    predicted = x.numel() * flops_per_token(config, x.shape[1])
    assert abs(counted / predicted - 1) < 0.01
    assert counted == predicted  # exact, in fact: every matmul is counted, nothing else
    with FlopCounterMode(display=False) as backward_counter:
        loss.backward()
    assert counted + backward_counter.get_total_flops() == training_flops(config, x.numel(), x.shape[1])
    without = x.numel() * flops_per_token(config, x.shape[1], include_attention=False)
    assert without == x.numel() * 2 * matmul_params(config) < predicted


def saved_tensor_bytes(model, x, y, autocast: bool) -> int:
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast:
        return memory.saved_tensor_bytes(lambda: model(x, y), model)


@pytest.mark.parametrize("overrides", [dict(), dict(norm="layer", ffn="gelu", positions="learned"),
                                       dict(n_kv_heads=2, ffn="relu", tie_embeddings=False),
                                       dict(attn_impl="reference", ffn="geglu", positions="none")], ids=str)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_activation_formula_counts_every_saved_tensor(overrides, autocast):
    config = tiny(**overrides)
    model = TransformerLM(config)
    x, y = batch(config)
    parts = training_memory(config, *x.shape, compute_bytes=2 if autocast else 4)
    # Saved in the forward pass: the bf16 weight copies, the activations and the log-softmax, which
    # is one of the three (B·T, vocab) fp32 buffers that `logits` counts at the backward's start.
    predicted = parts["weight_copies"] + parts["activations"] + parts["logits"] // 3
    # The 4 bytes left over are nll_loss's scalar total weight.
    assert 0 <= saved_tensor_bytes(model, x, y, autocast) - predicted <= 4


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_gradient_and_optimizer_bytes_are_exact(tie):
    config = tiny(tie_embeddings=tie)
    model = TransformerLM(config)
    optimizer = make_optimizer(model, TrainConfig(steps=1, batch_size=3, context_length=40))
    accumulate_gradients(model, [batch(config)])
    grads = tensor_bytes(p.grad for p in model.parameters())
    optimizer.step()
    parts = training_memory(config, 3, 40, optimizer="adamw")
    assert parts["parameters"] == tensor_bytes(model.state_dict().values())
    assert parts["gradients"] == grads
    state = optimizer.state_dict()["state"]
    assert parts["optimizer_state"] == sum(tensor_bytes(s.values()) for s in state.values())
    sgd = training_memory(config, 3, 40, optimizer="sgd")
    assert sgd["optimizer_state"] == 0 and training_memory(config, 3, 40, optimizer="momentum")[
        "optimizer_state"] == parts["parameters"]


def test_memory_breakdown_adds_up_and_checkpointing_saves():
    config = gpt2_small()
    plain = training_memory(config, 8, 1024)
    ckpt = training_memory(config, 8, 1024, activation_checkpointing=True)
    assert plain["total"] == (plain["parameters"] + plain["optimizer_state"] + plain["weight_copies"]
                              + plain["activations"] + plain["logits"])
    assert ckpt["activations"] < plain["activations"] / 5 and ckpt["recompute"] > 0
    assert ckpt["total"] < plain["total"]
    # Per layer and token: 34·d + 8·f + 4·H + 8 bytes for a SwiGLU block under bf16 autocast
    # (each projection casts its own copy of the input), 32·d + ... with fused projections (the
    # default), 28·d + 6·f + ... when those go through lmfs.kernels.fused (no RoPE table casts).
    rope = 4 * 1024 * 64 * 2
    assert activation_bytes_per_layer(gpt2_small(fused_projections=False), 8, 1024) == 8 * 1024 * (
        34 * 768 + 8 * 2048 + 4 * 12 + 8) + rope
    assert activation_bytes_per_layer(config, 8, 1024) == 8 * 1024 * (32 * 768 + 8 * 2048 + 4 * 12 + 8) + rope
    assert activation_bytes_per_layer(config, 8, 1024, triton_kernels=True) == 8 * 1024 * (
        28 * 768 + 6 * 2048 + 4 * 12 + 8)
    assert activation_bytes_per_layer(gpt2_small(triton_kernels=False), 8, 1024, triton_kernels=True) == (
        activation_bytes_per_layer(config, 8, 1024))  # the config's switch turns them off
    with pytest.raises(ValueError, match="norm_position='post'"):
        training_memory(tiny(norm_position="post"), 1, 8)
    with pytest.raises(ValueError, match="unknown optimizer"):
        training_memory(tiny(), 1, 8, optimizer="lion")


def test_mfu_and_peak_table():
    assert PEAK_FLOPS["H100"]["bf16"] == 989.5e12 and PEAK_FLOPS["A100"]["fp8"] is None
    for chip, rates in PEAK_FLOPS.items():
        assert rates["fp32"] < rates["tf32"] < rates["bf16"] == rates["fp16"], chip
        assert chip in GPU_MEMORY_BYTES
    config = gpt2_small()
    # 100k tokens/s of GPT-2-small needs 3 · 256.77 MFLOP per token: 77.0 TFLOP/s, 7.8 % of an H100.
    assert mfu(100_000, config, 1024, 989.5e12) == pytest.approx(3 * 256_770_048 * 1e5 / 989.5e12)
    assert mfu(100_000, config, 1024, 989.5e12) == pytest.approx(0.07785, abs=1e-5)


def test_napkin_math_by_hand():
    # 6 · 70e9 · 15e12 = 6.3e24 FLOPs; 1024 · 989.5e12 · 0.5 = 5.066e17 FLOP/s -> 143.9 days.
    days = time_to_train(70e9, 15e12, 1024, PEAK_FLOPS["H100"]["bf16"], 0.5) / 86400
    assert days == pytest.approx(6.3e24 / 5.06624e17 / 86400) and round(days, 1) == 143.9
    assert largest_trainable_model(8, 80e9) == 40_000_000_000
    assert largest_trainable_model(1, 141e9, bytes_per_param=2) == 70_500_000_000
    with pytest.raises(ValueError, match="fraction"):
        time_to_train(1e9, 1e9, 1, 1e15, 50)


def test_bench_runs_on_cpu(tmp_path, capsys):
    from lmfs.benchmarks.train_step import main

    result = main(["--steps", "2", "--device", "cpu", "--json", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    assert "real numbers need a CUDA GPU" in out and "tokens/s" in out
    assert json.loads((tmp_path / "bench.json").read_text())["lmfs"]["tokens_per_s"] > 0
    assert "speedup_vs_hf" in result


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_memory_prediction_on_gpu(checkpointing):
    from lmfs.train import activation_checkpointing

    config = gpt2_small()
    B, T = 8, 1024
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = TransformerLM(config).to(device)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    x, y = (t.to(device) for t in batch(config, B, T))

    def step():
        accumulate_gradients(model, [(x, y)], torch.bfloat16)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    recompute = activation_checkpointing(model) if checkpointing else contextlib.nullcontext()
    with recompute:
        step()  # creates the optimizer state, which every later step carries
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = training_memory(config, B, T, activation_checkpointing=checkpointing, triton_kernels=True)["total"]
    ratio = measured / predicted
    assert abs(ratio - 1) < 0.10, f"measured {measured / 2**30:.2f} GiB = {ratio:.3f} x predicted"


@pytest.mark.parametrize("vocab", [256, 1024])
@pytest.mark.parametrize("checkpointing, grad_accum", [(False, 1), (True, 1), (False, 4)])
def test_predicted_peak_equals_tracked_tensor_peak(checkpointing, grad_accum, vocab):
    """training_memory's total against the tensor bytes really alive at the peak of a step (CPU)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from lmfs.accounting import memory_at_peak
    from lmfs.bench.memory import step_peak
    from lmfs.train import activation_checkpointing

    torch.manual_seed(0)
    # A small vocabulary puts the peak in the backward pass, a large one at its start.
    config = TransformerConfig(vocab_size=vocab, context_length=64, d_model=64, n_layers=2, n_heads=4,
                               tie_embeddings=False)
    model = TransformerLM(config)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(vocab, (8, 64)), torch.randint(vocab, (8, 64))
    micro = [(x[i::grad_accum], y[i::grad_accum]) for i in range(grad_accum)]

    def step():
        accumulate_gradients(model, micro)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with activation_checkpointing(model) if checkpointing else contextlib.nullcontext():
        ours = step_peak(step, model, optimizer, x, y)
        if grad_accum == 1:  # torch's tracker handles one forward per module only
            tracker = MemTracker()
            tracker.track_external(model, optimizer, x, y)
            with tracker:
                step()
            torch_peak = sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())
            assert abs(ours / torch_peak - 1) < 0.01  # our tracker agrees with torch's
    parts = training_memory(config, 8 // grad_accum, 64, compute_bytes=4,
                            activation_checkpointing=checkpointing, grad_accum=grad_accum)
    assert abs(ours / parts["total"] - 1) < 0.03
    assert sum(memory_at_peak(parts, grad_accum).values()) == parts["total"]
