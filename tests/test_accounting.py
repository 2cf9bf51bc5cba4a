import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmfs.accounting import (activation_memory_per_layer, flops_per_token, largest_trainable_model, matmul_params,
                             mfu, param_count, time_to_train, training_flops)
from lmfs.bench import memory
from lmfs.bench.memory import activation_bytes_per_layer, memory_at_peak, step_peak, torch_step_peak, training_memory
from lmfs.hardware import gpu
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


def saved_by_forward(parts: dict) -> int:
    """What training_memory says the forward pass saves: the bf16 weight copies, the activations and
    the log-softmax, one of the three (B·T, vocab) fp32 buffers that `logits` counts."""
    return parts["weight_copies"] + parts["activations"] + parts["logits"] // 3


@pytest.mark.parametrize("overrides", [dict(), dict(norm="layer", ffn="gelu", positions="learned"),
                                       dict(n_kv_heads=2, ffn="relu", tie_embeddings=False),
                                       dict(attn_impl="reference", ffn="geglu", positions="none")], ids=str)
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_activation_formula_counts_every_saved_tensor(overrides, autocast):
    config = tiny(**overrides)
    model = TransformerLM(config)
    x, y = batch(config)
    parts = training_memory(config, *x.shape, compute_bytes=2 if autocast else 4)
    # The 4 bytes left over are nll_loss's scalar total weight.
    assert 0 <= saved_tensor_bytes(model, x, y, autocast) - saved_by_forward(parts) <= 4


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_heads=2), dict(positions="learned", ffn="gelu")], ids=str)
def test_activation_formula_counts_the_fused_model(overrides):
    """The model through fuse_model: one cast per fused matmul, q/k/v views that keep their base alive."""
    from lmfs.kernels.fused import fuse_model

    config = tiny(**overrides)
    model = fuse_model(TransformerLM(config), projections=True, triton=False, chunked_loss=False)
    x, y = batch(config)
    fused = training_memory(config, *x.shape, compute_bytes=2, fused_projections=True)
    assert 0 <= saved_tensor_bytes(model, x, y, autocast=True) - saved_by_forward(fused) <= 4
    plain = training_memory(config, *x.shape, compute_bytes=2)
    assert fused["activations"] < plain["activations"]  # fewer casts of each block's input
    # In fp32 nothing is fused: the flag changes nothing.
    assert training_memory(config, 3, 40, fused_projections=True) == training_memory(config, 3, 40)


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
    plain = training_memory(config, 8, 1024, compute_bytes=2)
    ckpt = training_memory(config, 8, 1024, compute_bytes=2, activation_checkpointing=True)
    assert plain["total"] == (plain["parameters"] + plain["optimizer_state"] + plain["weight_copies"]
                              + plain["activations"] + plain["logits"])
    assert ckpt["activations"] < plain["activations"] / 5 and ckpt["recompute"] > 0
    assert ckpt["total"] < plain["total"]
    # Per layer and token: 34·d + 8·f + 4·H + 8 bytes for a SwiGLU block under bf16 autocast
    # (each projection casts its own copy of the input), 32·d + ... with fused projections,
    # 28·d + 6·f + ... when those go through lmfs.kernels.fused (no RoPE table casts); 40·d + 16·f
    # + ... in fp32, where the three projections share one input.
    rope = 4 * 1024 * 64 * 2
    tokens = 8 * 1024
    assert activation_bytes_per_layer(config, 8, 1024, 2) == tokens * (34 * 768 + 8 * 2048 + 4 * 12 + 8) + rope
    assert activation_bytes_per_layer(config, 8, 1024, 2, fused_projections=True) == tokens * (
        32 * 768 + 8 * 2048 + 4 * 12 + 8) + rope
    assert activation_bytes_per_layer(config, 8, 1024, 2, fused_projections=True, triton_kernels=True) == tokens * (
        28 * 768 + 6 * 2048 + 4 * 12 + 8)
    assert activation_bytes_per_layer(config, 8, 1024, 2, triton_kernels=True) == (
        activation_bytes_per_layer(config, 8, 1024, 2))  # the kernels work on fused projections only
    assert activation_bytes_per_layer(config, 8, 1024) == tokens * (40 * 768 + 16 * 2048 + 4 * 12 + 8)
    # The loss: 12·vocab bytes per token from the logits; chunked, the kept bf16 gradient (2·vocab)
    # plus one chunk's temporaries, 2^28 / (4·32000) = 2097 rows of 17 (PyTorch) or 2 (Triton) bytes.
    assert plain["logits"] == 12 * 32000 * tokens
    chunked = training_memory(config, 8, 1024, compute_bytes=2, chunked_loss=True)
    assert chunked["logits"] == 2 * 32000 * tokens + 17 * 2097 * 32000
    fast = training_memory(config, 8, 1024, compute_bytes=2, fused_projections=True, triton_kernels=True,
                           chunked_loss=True)
    assert fast["logits"] == 2 * 32000 * tokens + 2 * 2097 * 32000 and fast["total"] < chunked["total"]
    with pytest.raises(ValueError, match="norm_position='post'"):
        training_memory(tiny(norm_position="post"), 1, 8)
    with pytest.raises(ValueError, match="unknown optimizer"):
        training_memory(tiny(), 1, 8, optimizer="lion")
    with pytest.raises(ValueError, match="compute_bytes"):
        activation_bytes_per_layer(config, 1, 8, 1)


def test_closed_form_activation_memory_by_hand():
    """Korthikanti et al. (2022): s·b·h·(34 + 5·a·s/h) bytes per layer, summed tensor by tensor."""
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, one sequence
    layernorms = 2 * 2 * s * b * h
    attention = (2 + 4 + 2 + 2 + 1) * s * b * h + (2 + 1 + 2) * a * s * s * b
    mlp = (2 + 8 + 8 + 1) * s * b * h
    assert activation_memory_per_layer(b, s, h, a) == layernorms + attention + mlp == s * b * h * (34 + 80)
    assert activation_memory_per_layer(b, s, h, a, recompute="selective") == 34 * s * b * h
    assert activation_memory_per_layer(b, s, h, a, flash_attention=True) == 34 * s * b * h
    assert activation_memory_per_layer(b, s, h, a, recompute="full") == 2 * s * b * h
    # GPT-2 small at T = 1024, batch 8: 34 + 5·12·1024/768 = 114 again (a/h is the same).
    assert activation_memory_per_layer(8, 1024, 768, 12) == 8 * 1024 * 768 * 114
    with pytest.raises(ValueError, match="recompute"):
        activation_memory_per_layer(1, 8, 8, 1, recompute="some")


def test_mfu():
    config = gpt2_small()
    # 100k tokens/s of GPT-2-small needs 3 · 256.77 MFLOP per token: 77.0 TFLOP/s, 7.8 % of an H100.
    assert mfu(100_000, config, 1024, 989.5e12) == pytest.approx(3 * 256_770_048 * 1e5 / 989.5e12)
    assert mfu(100_000, config, 1024, gpu("H100").peak("bf16")) == pytest.approx(0.07785, abs=1e-5)


def test_napkin_math_by_hand():
    # 6 · 70e9 · 15e12 = 6.3e24 FLOPs; 1024 · 989.5e12 · 0.5 = 5.066e17 FLOP/s -> 143.9 days.
    days = time_to_train(70e9, 15e12, 1024, gpu("H100").peak("bf16"), 0.5) / 86400
    assert days == pytest.approx(6.3e24 / 5.06624e17 / 86400) and round(days, 1) == 143.9
    assert largest_trainable_model(8, gpu("H100").memory_bytes) == 40_000_000_000
    assert largest_trainable_model(1, gpu("H200").memory_bytes, bytes_per_param=2) == 70_500_000_000
    with pytest.raises(ValueError, match="fraction"):
        time_to_train(1e9, 1e9, 1, 1e15, 50)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "checkpointed", "fused"])
def test_memory_prediction_on_gpu(variant):
    """training_memory against the CUDA allocator's peak: the plain model (with and without
    checkpointing) and the model through fuse_model with every opt-in (Triton kernels, chunked loss)."""
    from lmfs.kernels.fused import fuse_model
    from lmfs.train import activation_checkpointing

    config = gpt2_small()
    B, T = 8, 1024
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = TransformerLM(config).to(device)
    fused = variant == "fused"
    if fused:
        model = fuse_model(model, projections=True, triton=True, chunked_loss=True)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    x, y = (t.to(device) for t in batch(config, B, T))

    def step():
        accumulate_gradients(model, [(x, y)], torch.bfloat16)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    checkpointing = variant == "checkpointed"
    with activation_checkpointing(model) if checkpointing else contextlib.nullcontext():
        measured = memory.peak_memory(step, device)
    predicted = training_memory(config, B, T, compute_bytes=2, activation_checkpointing=checkpointing,
                                fused_projections=fused, triton_kernels=fused, chunked_loss=fused)["total"]
    ratio = measured / predicted
    assert abs(ratio - 1) < 0.10, f"measured {measured / 2**30:.2f} GiB = {ratio:.3f} x predicted"


def test_peak_memory_needs_cuda():
    assert memory.peak_memory(lambda: None, torch.device("cpu")) is None


@pytest.mark.parametrize("vocab", [256, 1024])
@pytest.mark.parametrize("checkpointing, grad_accum", [(False, 1), (True, 1), (False, 4)])
def test_predicted_peak_equals_tracked_tensor_peak(checkpointing, grad_accum, vocab):
    """training_memory's total against the tensor bytes really alive at the peak of a step (CPU)."""
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
            torch_peak = torch_step_peak(step, model, optimizer, x, y)
            assert abs(ours / torch_peak - 1) < 0.01  # our tracker agrees with torch's
    parts = training_memory(config, 8 // grad_accum, 64, compute_bytes=4,
                            activation_checkpointing=checkpointing, grad_accum=grad_accum)
    assert abs(ours / parts["total"] - 1) < 0.03
    assert sum(memory_at_peak(parts, grad_accum).values()) == parts["total"]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_chunked_loss_peak_equals_tracked_tensor_peak(autocast):
    """The chunked loss (fuse_model(chunked_loss=True)) against the tensors alive at its step's peak:
    the kept logit gradient plus one chunk's float32 temporaries (CPU: the PyTorch path)."""
    from lmfs.kernels.fused import fuse_model

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=2048, context_length=64, d_model=64, n_layers=2, n_heads=4,
                               tie_embeddings=False)
    model = fuse_model(TransformerLM(config), projections=False, triton=False, chunked_loss=True)
    optimizer = AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(2048, (8, 64)), torch.randint(2048, (8, 64))

    def step():
        accumulate_gradients(model, [(x, y)], torch.bfloat16 if autocast else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # 512 tokens fit in one chunk here, so the temporaries are as large as the logits themselves.
    parts = training_memory(config, 8, 64, compute_bytes=2 if autocast else 4, chunked_loss=True)
    assert parts["logits"] == (2 if autocast else 4) * 2048 * 512 + 17 * 512 * 2048
    assert abs(step_peak(step, model, optimizer, x, y) / parts["total"] - 1) < 0.03


# ----------------------------------------------------------------------------------------------
# The checkers of lecture 02's exercises


def test_lecture02_checkers_accept_right_and_reject_wrong_answers(capsys):
    from lmfs.exercises.lecture02 import check_activation_memory, check_flops_per_token

    def flops(c, T):
        kv = c.kv_heads * c.head_dim
        per_layer = 2 * c.d_model * c.d_model + 2 * c.d_model * kv + (3 if c.ffn == "swiglu" else 2) * c.d_model * c.ffn_dim
        return 2 * (c.n_layers * per_layer + c.vocab_size * c.d_model) + 4 * c.n_layers * T * c.d_model

    assert check_flops_per_token(flops) == 3
    with pytest.raises(AssertionError, match="flops_per_token: wrong result"):  # the head forgotten
        check_flops_per_token(lambda c, T: flops(c, T) - 2 * c.vocab_size * c.d_model)

    def korthikanti(b, s, h, a, recompute):
        return {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h, "full": 2 * s * b * h}[recompute]

    assert check_activation_memory(korthikanti) == 9
    with pytest.raises(AssertionError, match="activation_memory: wrong result"):  # s/h instead of a·s/h
        check_activation_memory(lambda b, s, h, a, r: korthikanti(b, s, h, 1, r))
    assert "correct on 9 cases" in capsys.readouterr().out
