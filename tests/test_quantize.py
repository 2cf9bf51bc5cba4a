"""Weight-only quantisation: error bounds, int4 packing, QuantLinear, AWQ, whole models."""

import pytest
import torch
from helpers import model_of, randn, tiny

from lmfs.inference.quantize import (QuantLinear, awq_scale, dequantize_weight, model_weight_bytes, pack_int4,
                                     quantizable_linears, quantize_model, quantize_weight, unpack_int4)
from lmfs.nn.layers import Linear


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [16, 64])
def test_quantise_dequantise_error_at_most_half_a_step(bits, symmetric, group_size):
    w = randn(24, 128, seed=1)
    w[0, :group_size] = 0.0  # an all-zero group
    w[1, :group_size] = 3.0  # a constant one (asymmetric range [0, 3])
    w[2] *= 100  # a row of large weights
    qw = quantize_weight(w, bits=bits, group_size=group_size, symmetric=symmetric)
    step = qw.scales.repeat_interleave(group_size, dim=1)  # (out, in): each weight's group scale
    error = (w - dequantize_weight(qw)).abs()
    assert (error <= step / 2 * (1 + 1e-6)).all()
    assert (dequantize_weight(qw)[0, :group_size] == 0).all()
    # the scales are as large as they need to be and no larger: some weight sits at the clipping end
    levels = 2 ** (bits - 1) - 1 if symmetric else 2 ** bits - 1
    span = w.abs().reshape(24, -1, group_size).amax(-1) if symmetric else (
        w.reshape(24, -1, group_size).amax(-1).clamp(min=0) - w.reshape(24, -1, group_size).amin(-1).clamp(max=0))
    torch.testing.assert_close(qw.scales[span > 0], (span / levels)[span > 0])
    assert qw.codes.dtype == torch.uint8
    assert qw.codes.shape == (24, 128 * bits // 8)


def test_symmetric_codes_are_the_rounded_multiples():
    """Weights on the grid come back exactly; int8 symmetric is round(w/s) around the zero 128."""
    s = 0.01
    w = torch.arange(-127, 129, dtype=torch.float32).reshape(2, 128) * s
    w[1, 127] = 127 * s  # the row's largest magnitude sets the scale to s
    qw = quantize_weight(w, bits=8, group_size=128)
    torch.testing.assert_close(qw.scales, torch.full((2, 1), s))
    torch.testing.assert_close(dequantize_weight(qw), w)
    assert qw.codes[0, 0] == 1 and qw.codes[0, 127] == 128  # −127 and 0


def test_int4_packing_round_trip_and_layout():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # column 2j in the low nibble, 2j + 1 in the high one
    assert pack_int4(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    # and quantize_weight's int4 codes unpack to the same values as its 8-bit path would give at 4 bits
    w = randn(8, 32, seed=2)
    qw = quantize_weight(w, bits=4, group_size=32)
    unpacked = unpack_int4(qw.codes).float()
    torch.testing.assert_close(unpacked, (torch.round(w / qw.scales) + 8).clamp(0, 15))


def test_format_errors():
    w = randn(4, 48)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_weight(w, bits=3, group_size=16)
    with pytest.raises(ValueError, match="does not divide in_features 48"):
        quantize_weight(w, bits=8, group_size=32)
    with pytest.raises(ValueError, match="even"):
        quantize_weight(w, bits=4, group_size=3)
    with pytest.raises(ValueError, match="positive"):
        quantize_weight(w, bits=8, group_size=0)
    with pytest.raises(ValueError, match=r"\(out, in\)"):
        quantize_weight(randn(48), bits=8, group_size=16)


def test_quant_linear_is_dequantise_then_matmul():
    linear = torch.nn.Linear(64, 24, bias=True)
    channel_scale = torch.rand(64) + 0.5
    q = QuantLinear.from_linear(linear, bits=4, group_size=32, symmetric=False, channel_scale=channel_scale)
    x = randn(2, 5, 64, seed=3, device="cpu")  # the layer's torch path; the kernel has its own tests
    w = dequantize_weight(quantize_weight(linear.weight.detach() * channel_scale, 4, 32, symmetric=False))
    expected = (x / channel_scale) @ w.T + linear.bias
    torch.testing.assert_close(q(x), expected, atol=1e-5, rtol=1e-5)
    assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="in_features"):
        q(randn(3, 32, device="cpu"))


def outlier_activations(n: int, d: int, seed: int) -> torch.Tensor:
    """Activations like an LM's: most channels of unit size, a few 30 times larger."""
    x = randn(n, d, seed=seed, device="cpu")
    x[:, :8] *= 30
    return x


@pytest.mark.parametrize("bits,group_size", [(4, 128), (4, 32), (8, 128)])
def test_awq_beats_round_to_nearest_on_outlier_channels(bits, group_size):
    torch.manual_seed(0)
    linear = Linear(256, 128)
    calibration, held_out = outlier_activations(512, 256, 1), outlier_activations(512, 256, 2)
    t, alpha, errors = awq_scale(linear, calibration, bits, group_size)
    assert alpha > 0 and errors[alpha] < errors[0.0]  # α = 0 is RTN
    rtn = QuantLinear.from_linear(linear, bits, group_size)
    awq = QuantLinear.from_linear(linear, bits, group_size, channel_scale=t)
    reference = linear(held_out)
    error = {name: (layer(held_out) - reference).pow(2).mean() for name, layer in (("rtn", rtn), ("awq", awq))}
    assert error["awq"] < 0.8 * error["rtn"]  # on activations the search never saw


def test_quantize_model_replaces_the_linears_and_counts_bytes():
    model = model_of(tiny(tie_embeddings=False))
    before = model_weight_bytes(model)
    names = set(quantizable_linears(model))
    assert names and "lm_head" not in names
    x = torch.randint(0, 50, (2, 16))
    logits = model(x)[0]
    quantize_model(model, bits=8, group_size=32)
    replaced = {name for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert replaced == names and isinstance(model.lm_head, Linear)
    torch.testing.assert_close(model(x)[0], logits, atol=5e-3, rtol=0)
    # bytes: the replaced fp32 weights (4 B each) became 1 B codes plus one fp32 scale per 32
    weights = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear))
    assert model_weight_bytes(model) == before - 4 * weights + weights + 4 * weights // 32


def test_quantize_model_options_and_errors():
    model = model_of(tiny(tie_embeddings=False, moe_experts=4))
    quantize_model(model, bits=4, group_size=16, include_head=True)
    assert isinstance(model.lm_head, QuantLinear)
    assert all(isinstance(block.mlp.router.proj, Linear) for block in model.blocks)  # routers stay exact
    with pytest.raises(ValueError, match="tied"):
        quantize_model(model_of(tiny()), bits=8, group_size=16, include_head=True)
    with pytest.raises(ValueError, match="does not divide in_features 32"):
        quantize_model(model_of(tiny()), bits=8, group_size=24)


@torch.enable_grad()
def trained_model() -> torch.nn.Module:
    """A tiny model trained briefly on sequences that repeat a random 6-token pattern: its loss
    is far below chance, so quantisation damage shows up as a loss increase."""
    torch.manual_seed(0)
    model = model_of(tiny(vocab_size=32, context_length=24, d_model=64, n_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(200):
        x, y = pattern_batch(16)
        loss = model(x, y)[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def pattern_batch(batch_size: int, seed: int | None = None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    patterns = torch.randint(0, 32, (batch_size, 6), generator=g)
    seq = patterns.repeat(1, 5)[:, :25]
    return seq[:, :-1], seq[:, 1:]


@torch.no_grad()
def test_quantised_loss_close_to_full_precision():
    model = trained_model()
    x, y = pattern_batch(64, seed=1)
    losses = {"fp32": model(x, y)[1].item()}
    assert losses["fp32"] < 0.5 * torch.log(torch.tensor(32.0)).item()  # it learned something
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name, bits, group, calibration in (("int8", 8, 64, None), ("int4", 4, 16, None),
                                           ("int4-awq", 4, 16, pattern_batch(16, seed=2)[0])):
        quantized = model_of(model.config)
        quantized.load_state_dict(state)
        quantize_model(quantized.eval(), bits=bits, group_size=group, calibration=calibration)
        losses[name] = quantized(x, y)[1].item()
    assert abs(losses["int8"] - losses["fp32"]) < 0.003 * losses["fp32"]
    assert abs(losses["int4"] - losses["fp32"]) < 0.05 * losses["fp32"]
    assert abs(losses["int4-awq"] - losses["fp32"]) < 0.05 * losses["fp32"]


@pytest.mark.gpu
def test_quant_linear_gpu_kernel_matches_cpu_path():
    from lmfs.kernels.dequant_matmul import dequant_matmul

    model = model_of(tiny(d_model=256, n_heads=4, d_ff=768))  # 768 = 6 groups of 128
    quantize_model(model, bits=4, group_size=128)
    x = torch.randint(0, 50, (3, 16))
    cpu = model(x)[0]
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.matmul = dequant_matmul
    gpu = model.to("cuda", torch.bfloat16)(x.cuda())[0]
    torch.testing.assert_close(gpu.float().cpu(), cpu, atol=5e-2, rtol=5e-2)


def test_quantize_model_hands_its_matmul_to_every_layer():
    """The fast product is handed in from outside (quantize does not import the kernels): every
    QuantLinear calls it with its flattened inputs and its quantised weight; without one, PyTorch."""
    calls = []

    def matmul(x, qweight):
        calls.append((tuple(x.shape), qweight.shape))
        return x @ dequantize_weight(qweight, x.dtype).T

    model = quantize_model(model_of(tiny()), bits=8, group_size=16, matmul=matmul)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.matmul is matmul for m in layers)
    x = torch.randint(0, 50, (2, 5))
    plain = quantize_model(model_of(tiny()), bits=8, group_size=16)
    torch.testing.assert_close(model(x)[0], plain(x)[0])
    assert len(calls) == len(layers) and all(shape[0] == 10 for shape, _ in calls)
    assert all(m.matmul is None for m in plain.modules() if isinstance(m, QuantLinear))
    with pytest.raises(TypeError, match="matmul"):
        quantize_model(model_of(tiny()), bits=8, group_size=16, matmul=1)
