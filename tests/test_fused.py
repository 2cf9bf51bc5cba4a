"""lmfs.kernels.fused and lmfs.kernels.loss: the opt-in fast model against the plain one.

``fuse_model`` must not change the function a model computes: every test compares loss and
gradients with the plain :class:`lmfs.nn.TransformerLM` (or the kernels with their PyTorch
references). Without a GPU the Triton kernels run in Triton's interpreter, so sizes stay small;
tests that need the kernel path on the CPU force it (:func:`kernels_on_the_cpu`).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, forward_backward, model_of, randn, tiny

import lmfs.kernels.fused as fused
import lmfs.kernels.loss as loss_module
from lmfs.kernels import INTERPRET, linear_cross_entropy
from lmfs.kernels.fused import (ChunkedLossLM, FusedAttention, FusedEmbedding, FusedGatedMLP, FusedRMSNorm, fuse_model,
                                fused_linear, rope_qkv, swiglu)
from lmfs.kernels.loss import LinearCrossEntropy, cross_entropy_rows
from lmfs.nn import CausalSelfAttention, Embedding, GatedMLP, Linear, RMSNorm, TransformerConfig, TransformerLM
from lmfs.nn.positions import apply_rope, rope_angles


def assert_all_close(ours, expected, atol=1e-5, rtol=1e-4):
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def twins(config, seed=0, **switches) -> tuple[TransformerLM, TransformerLM]:
    """A plain model and the same weights through ``fuse_model(**switches)``."""
    plain, other = model_of(config, seed), model_of(config, seed)
    return plain, fuse_model(other, **switches)


def tokens(B=2, T=12, vocab=50, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def grads_of(loss, model):
    return dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))


def assert_grads_close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


def kernels_on_the_cpu(monkeypatch):
    """Let the fused modules take their GPU kernel path here (the kernels run in Triton's
    interpreter): the same condition as on a GPU, without the CUDA requirement."""
    monkeypatch.setattr(fused, "kernels_apply", lambda x, weight: fused.autocast_casts(x, weight))
    monkeypatch.setattr(fused, "norm_kernel_applies", fused.norm_kernel_fits)


def count_calls(monkeypatch, *names) -> dict:
    """Count the calls of ``lmfs.kernels.fused``'s functions ``names`` (they still run)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name: calls.update({name: calls[name] + 1})
                            or real(*a))
    return calls


# ----------------------------------------------------------------------------------------------
# fuse_model: what changes and what does not


def test_fuse_model_keeps_parameters_and_state_dict_keys():
    plain = model_of(tiny(tie_embeddings=False))
    model = model_of(tiny(tie_embeddings=False))
    params = list(model.parameters())  # an optimizer built before fusing keeps working
    assert fuse_model(model) is model
    assert type(model) is ChunkedLossLM and isinstance(model, TransformerLM)
    assert all(type(b.attn) is FusedAttention and type(b.mlp) is FusedGatedMLP for b in model.blocks)
    assert not any(type(m) is FusedRMSNorm for m in model.modules())  # norms: only when asked for
    fuse_model(model, norms=True)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * len(model.blocks) + 1 and all(type(m) is FusedRMSNorm for m in norms)
    assert list(model.parameters()) == params
    assert model.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    fuse_model(model, projections=False, chunked_loss=False)  # back to the plain classes
    assert type(model) is TransformerLM
    assert all(type(b.attn) is CausalSelfAttention and type(b.mlp) is GatedMLP for b in model.blocks)
    assert all(type(m) is RMSNorm for m in norms)
    with pytest.raises(TypeError, match="TransformerLM"):
        fuse_model(model.blocks[0])


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_heads=2, ffn="geglu"), dict(attention="mla", kv_latent_dim=8),
                                       dict(bias=True, positions="none", qk_norm=True)], ids=str)
def test_fused_model_in_fp32_is_the_plain_model(overrides, monkeypatch):
    """Without autocast the fused modules run the plain matmuls: logits bit for bit the same."""
    monkeypatch.setattr(fused, "fused_linear", lambda *a, **k: pytest.fail("fp32 needs no stacked copy"))
    plain, model = twins(tiny(**overrides), chunked_loss=False, norms=True)  # FusedRMSNorm: CUDA only
    idx = tokens()
    torch.testing.assert_close(model(idx, idx)[0], plain(idx, idx)[0], rtol=0, atol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_fused_embedding_has_the_plain_lookups_gradient(tie):
    """F.embedding's backward sums repeated ids' rows in another order than the indexed lookup's:
    the same gradient up to rounding, here with every id repeated many times (a small vocabulary)."""
    plain, model = twins(tiny(tie_embeddings=tie), projections=False, chunked_loss=False, embedding=True)
    assert type(model.tok_emb) is FusedEmbedding and type(plain.tok_emb) is Embedding
    idx = tokens(B=4, T=16, vocab=5)
    loss, expected = model(idx, idx)[1], plain(idx, idx)[1]
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    assert_grads_close(grads_of(loss, model), grads_of(expected, plain), atol=1e-5, rtol=1e-5)
    fuse_model(model, projections=False, chunked_loss=False)
    assert type(model.tok_emb) is Embedding


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_separate_layers(bias):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    layers = [Linear(16, 16, bias), Linear(16, 8, bias), Linear(16, 8, bias)]  # GQA-like widths
    for layer in layers:
        if bias:
            layer.bias.data.normal_()
    fused_out = fused_linear(x, layers)
    separate = [layer(x) for layer in layers]
    for f, s in zip(fused_out, separate):
        torch.testing.assert_close(f, s, rtol=1e-6, atol=1e-6)
    params = [x] + [p for layer in layers for p in layer.parameters()]
    g = torch.randn(3, 5, 32)
    got = torch.autograd.grad(torch.cat(fused_out, -1), params, g)
    want = torch.autograd.grad(torch.cat(separate, -1), params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="last dimension must equal d_in"):
        fused_linear(torch.randn(2, 7), layers)


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_heads=2, ffn="geglu"), dict(attention="mla", kv_latent_dim=8),
                                       dict(bias=True, positions="none")], ids=str)
def test_fused_projections_under_autocast_equal_separate_ones(overrides, monkeypatch):
    calls = []
    real = fused.fused_linear
    monkeypatch.setattr(fused, "fused_linear", lambda x, ls, **k: calls.append(len(ls)) or real(x, ls, **k))
    plain, model = twins(tiny(**overrides), chunked_loss=False)
    idx = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_logits, fused_loss = model(idx, idx)
    assert calls, "autocast should take the fused path"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_logits, plain_loss = plain(idx, idx)
    # The same bf16 products: one matmul rounds each output once, like the separate ones.
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-3, atol=1e-3)
    # The input's gradient is one matmul instead of a sum of bf16-rounded ones: bf16-close.
    assert_grads_close(grads_of(fused_loss, model), grads_of(plain_loss, plain), rtol=0.05, atol=2e-3)


def test_fused_attention_takes_positions():
    plain, model = twins(tiny(), chunked_loss=False)
    idx = tokens(B=2, T=10)
    for positions in (torch.arange(10) + 3, torch.stack([torch.arange(10), torch.arange(10) % 4])):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = model(idx, positions=positions)[0], plain(idx, positions=positions)[0]
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------------------------
# The chunked loss


def reference_loss(h, w, targets, z_loss=0.0, softcap=None):
    logits = h @ w.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    keep = targets != -100
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    return loss + z_loss * torch.logsumexp(logits[keep], -1).pow(2).mean() if z_loss else loss


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1000])  # 37 rows: ragged last chunk for 5 and 16
@pytest.mark.parametrize("z_loss, softcap", [(0.0, None), (1e-2, None), (0.0, 3.0), (1e-2, 3.0)])
def test_linear_cross_entropy_equals_cross_entropy(chunk, z_loss, softcap):
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(50, (37,))
    targets[[0, 6, 20]] = -100
    want = reference_loss(h, w, targets, z_loss, softcap)
    got = linear_cross_entropy(h, w, targets, z_loss=z_loss, softcap=softcap, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    scale = torch.tensor(0.25)  # the incoming gradient, e.g. 1 / micro-batches
    for a, b in zip(torch.autograd.grad(got * scale, (h, w)), torch.autograd.grad(want * scale, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    with torch.no_grad():  # no gradient asked: the loss alone
        torch.testing.assert_close(linear_cross_entropy(h, w, targets, z_loss=z_loss, softcap=softcap,
                                                        chunk=chunk), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("overrides", [dict(), dict(tie_embeddings=False), dict(z_loss=1e-3, logit_softcap=5.0)],
                         ids=str)
def test_chunked_loss_equals_loss_from_logits(overrides):
    plain, model = twins(tiny(**overrides), projections=False, triton=False)
    idx, targets = tokens(), tokens(seed=2)
    targets[0, :3] = -100
    logits, loss = plain(idx, targets)
    none, chunked = model(idx, targets)
    assert none is None  # the logits are never made
    torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads_of(chunked, model), grads_of(plain(idx, targets)[1], plain), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(model(idx)[0], logits, rtol=0, atol=0)  # without targets: the logits
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 head and gradient, as the 2-step path
        _, auto_plain = plain(idx, targets)
        _, auto_chunked = model(idx, targets)
    torch.testing.assert_close(auto_chunked, auto_plain, rtol=1e-3, atol=1e-3)
    assert_grads_close(grads_of(auto_chunked, model), grads_of(auto_plain, plain), rtol=0.05, atol=1e-3)


def test_fast_model_compiles_without_graph_breaks():
    model = fuse_model(model_of(tiny(tie_embeddings=False)))
    idx, targets = tokens(), tokens(seed=2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fused projections and chunked loss
        loss = compiled(idx, targets)[1]
        eager = model(idx, targets)[1]
    torch.testing.assert_close(loss, eager)
    assert_grads_close(grads_of(loss, model), grads_of(eager, model), rtol=1e-2, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# SDPA's kernel choice


def test_sdpa_backend_preference():
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

    from lmfs.kernels.fused import prefer_sdpa_backend, sdpa_preference

    before = _cur_sdpa_kernel_backends(with_priority=True)

    def attend(q):
        with prefer_sdpa_backend("cudnn"):
            assert _cur_sdpa_kernel_backends(with_priority=True)[0] == SDPBackend.CUDNN_ATTENTION
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 3, 8, 4)
    torch.testing.assert_close(attend(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert _cur_sdpa_kernel_backends(with_priority=True) == before  # restored on exit
    compiled = torch.compile(_prefer_and_attend, backend="aot_eager", fullgraph=True)  # no graph break
    torch.testing.assert_close(compiled(q), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert _cur_sdpa_kernel_backends(with_priority=True) == before
    # "auto", and any device but CUDA, leave SDPA's choice alone: the CPU path is unchanged.
    assert type(sdpa_preference("auto", torch.device("cuda"))).__name__ == "nullcontext"
    assert type(sdpa_preference("flash", torch.device("cpu"))).__name__ == "nullcontext"
    with pytest.raises(ValueError, match="unknown SDPA backend 'fastest'"):
        prefer_sdpa_backend("fastest")


def _prefer_and_attend(q):
    from lmfs.kernels.fused import prefer_sdpa_backend

    with prefer_sdpa_backend("flash"):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


# ----------------------------------------------------------------------------------------------
# The kernels (float32, interpreter-sized)


@pytest.mark.parametrize("n_q,n_kv,d,T", [(4, 2, 8, 5), (2, 2, 6, 70)])  # GQA; head_dim 6: half not a power of 2
def test_rope_qkv_matches_split_then_apply_rope(n_q, n_kv, d, T):
    cos, sin = (t.to(DEVICE) for t in rope_angles(torch.arange(T + 3), d))
    qkv = randn(2, T, (n_q + 2 * n_kv) * d)

    def reference(x):
        q, k, v = (part.unflatten(-1, (-1, d)).transpose(1, 2) for part in x.split([n_q * d, n_kv * d, n_kv * d], -1))
        return apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T]), v

    qkv_ = qkv.clone().requires_grad_()
    outs = rope_qkv(qkv_, cos, sin, n_q, n_kv)
    ref_outs = reference(qkv)
    assert [o.shape for o in outs] == [r.shape for r in ref_outs]
    assert_all_close(outs, ref_outs)
    grads_out = [randn(*o.shape, seed=i + 1) for i, o in enumerate(outs)]
    (grad,) = torch.autograd.grad(outs, qkv_, grads_out)
    qkv_ref = qkv.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(reference(qkv_ref), qkv_ref, grads_out)
    assert_all_close([grad], [ref_grad])


def test_rope_qkv_rejects_bad_shapes():
    cos, sin = (t.to(DEVICE) for t in rope_angles(torch.arange(8), 8))
    with pytest.raises(ValueError, match="n_heads"):
        rope_qkv(randn(1, 8, 30), cos, sin, 2, 1)
    with pytest.raises(ValueError, match="cos and sin"):
        rope_qkv(randn(1, 9, 32), cos, sin, 2, 1)  # 9 positions, tables for 8


@pytest.mark.parametrize("shape", [(3, 5, 80), (7, 2 * 1100)])  # F = 1100: two column blocks, masked
def test_swiglu_matches_silu_gate_times_up(shape):
    x = randn(*shape) * 2
    out, grads, dy = forward_backward(swiglu, x)
    ref = lambda t: F.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1]  # noqa: E731
    ref_out, ref_grads, _ = forward_backward(ref, x, grad_out=dy)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


@pytest.mark.parametrize("kernel,block", [("row", None), ("looped", 256)])  # looped: 4 blocks, last masked
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_cross_entropy_rows_loss_and_gradient(z_loss, kernel, block, monkeypatch):
    monkeypatch.setattr(loss_module, "CE_KERNEL", kernel)
    if block:
        monkeypatch.setattr(loss_module, "CE_BLOCK", block)

    n, V = 6, 1000
    logits = randn(n, V) * 3
    targets = torch.tensor([3, -100, 999, 0, 512, 7], device=DEVICE)
    kept = (targets != -100).sum()
    grad = torch.full((n + 4, V), 7.0, device=DEVICE)  # rows 2 .. 2 + n get written, the rest not
    rows = cross_entropy_rows(logits, targets, (1 / kept).float(), grad, grad_row=2, z_loss=z_loss)

    x = logits.clone().requires_grad_()
    lse = torch.logsumexp(x, -1)
    per_row = F.cross_entropy(x, targets, reduction="none") + z_loss * lse.square() * (targets != -100)
    (per_row.sum() / kept).backward()
    assert_all_close([rows, grad[2:2 + n]], [per_row.detach(), x.grad])
    assert (grad[:2] == 7).all() and (grad[2 + n:] == 7).all()


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_linear_cross_entropy_kernel_path_matches_pytorch_path(z_loss):
    h, w = randn(37, 16), randn(300, 16, seed=1) * 0.5
    targets = torch.randint(300, (37,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    targets[5] = -100
    results = []
    for kernel in (False, True):
        h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = LinearCrossEntropy.apply(h_, w_, targets, z_loss, None, 10, True, kernel)  # 4 chunks
        results.append([loss, *torch.autograd.grad(loss, (h_, w_))])
    assert_all_close(results[1], results[0])


# ----------------------------------------------------------------------------------------------
# The fast model with its kernels against the plain model


@pytest.mark.skipif(not INTERPRET, reason="forces the kernel path on the CPU, through the interpreter")
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_fast_model_kernel_path_matches_plain_model(monkeypatch, n_kv_heads):
    """fuse_model with fused projections under bf16 autocast: the Triton kernels (rope_qkv, swiglu)
    against the plain model; loss and every gradient."""
    kernels_on_the_cpu(monkeypatch)
    calls = count_calls(monkeypatch, "rope_qkv", "swiglu")
    config = TransformerConfig(vocab_size=128, context_length=32, d_model=64, n_layers=2, n_heads=4,
                               n_kv_heads=n_kv_heads)
    plain, model = twins(config, chunked_loss=False)
    x = torch.randint(128, (2, 32), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, x)[1]
        results.append([loss.float()] + [g.float() for g in grads_of(loss, m).values()])
    assert calls == {"rope_qkv": 2, "swiglu": 2}  # one per layer: the kernels did run
    # bf16 activations; the kernels keep the angles in fp32 where apply_rope rounds them to bf16.
    assert_all_close(results[1], results[0], atol=2e-3, rtol=3e-2)


@pytest.mark.skipif(not INTERPRET, reason="forces the kernel path on the CPU, through the interpreter")
def test_activation_formula_with_the_kernels(monkeypatch):
    """What the kernel path saves for the backward pass, tensor by tensor, against the formula."""
    from lmfs.bench.memory import saved_tensor_bytes, training_memory

    kernels_on_the_cpu(monkeypatch)
    for n_kv_heads in (4, 2):
        config = TransformerConfig(vocab_size=100, context_length=64, d_model=64, n_layers=2, n_heads=4,
                                   n_kv_heads=n_kv_heads)
        model = fuse_model(TransformerLM(config), chunked_loss=False)
        x, y = torch.randint(100, (2, 3, 40), generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            measured = saved_tensor_bytes(lambda: model(x, y), model)  # noqa: B023
        parts = training_memory(config, *x.shape, compute_bytes=2, fused_projections=True, triton_kernels=True)
        predicted = parts["weight_copies"] + parts["activations"] + parts["logits"] // 3
        assert 0 <= measured - predicted <= 4, (n_kv_heads, measured, predicted)  # 4: nll's total weight


# ----------------------------------------------------------------------------------------------
# FusedRMSNorm: the Triton RMSNorm where it computes the plain module's function


def norm_results(model, idx, autocast=False) -> list[torch.Tensor]:
    """Loss and every parameter's gradient, in float32 (the norms' gains, loss first)."""
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(idx, idx)[1]
    return [loss.float()] + [g.float() for g in grads_of(loss, model).values()]


@pytest.mark.skipif(not INTERPRET, reason="forces the kernel path on the CPU, through the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("overrides", [dict(), dict(qk_norm=True, n_kv_heads=2)], ids=str)
def test_fused_norms_match_the_plain_model(dtype, overrides, monkeypatch):
    """norms=True: every RMSNorm (blocks, final, QK-norm) through rms_norm; loss and every gradient
    equal the plain model's, the model in float32 and in float16 (weights and activations)."""
    kernels_on_the_cpu(monkeypatch)
    calls = count_calls(monkeypatch, "rms_norm")
    config = tiny(**overrides)
    plain, model = twins(config, projections=False, triton=False, chunked_loss=False, norms=True)
    for m in (plain, model):
        m.to(dtype)
        for norm in m.modules():  # gains other than 1, so that the weight's place in the formula shows
            if isinstance(norm, RMSNorm):
                norm.weight.data = 1 + 0.3 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(3)
                                                         ).to(dtype)
    idx = tokens()
    want = norm_results(plain, idx)
    assert calls["rms_norm"] == 0
    got = norm_results(model, idx)
    norms = 2 * config.n_layers + 1 + (2 * config.n_layers if config.qk_norm else 0)
    assert calls["rms_norm"] == norms  # every norm took the kernel
    # float32: rounding only. float16: the kernel rounds x̂·w once where the plain norm rounds x̂ first.
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=1e-2)
    assert_all_close(got, want, **tol)
    assert model.final_norm(torch.randn(2, config.d_model, dtype=dtype)).dtype == dtype


@pytest.mark.skipif(not INTERPRET, reason="forces the kernel path on the CPU, through the interpreter")
def test_fused_norms_under_autocast_take_the_kernel_on_the_float32_stream_only(monkeypatch):
    """Under bf16 autocast the residual stream is float32, and so are the block and final norms'
    inputs and outputs: the kernel. QK-norm's inputs are bf16 heads with float32 gains, where
    the plain module returns float32 of a rounded x̂: the plain forward, the same result bit for bit."""
    kernels_on_the_cpu(monkeypatch)
    calls = count_calls(monkeypatch, "rms_norm")
    config = tiny(qk_norm=True)
    plain, model = twins(config, chunked_loss=False, norms=True)
    idx = tokens()
    want, got = norm_results(plain, idx, autocast=True), norm_results(model, idx, autocast=True)
    assert calls["rms_norm"] == 2 * config.n_layers + 1
    assert_all_close(got, want, atol=1e-3, rtol=1e-2)  # bf16 matmuls around float32-equal norms

    norm = model.blocks[0].attn.q_norm
    q = torch.randn(2, 4, 5, 8).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(q)
    assert out.dtype == torch.float32 and calls["rms_norm"] == 2 * config.n_layers + 1  # not the kernel
    torch.testing.assert_close(out, RMSNorm.forward(norm, q), rtol=0, atol=0)


def test_fused_norm_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    """The plain forward (bit for bit) on the CPU without the interpreter switch, without autograd,
    and for mixed dtypes; the kernel path on CUDA tensors only."""
    calls = count_calls(monkeypatch, "rms_norm")
    norm = fuse_model(model_of(tiny()), norms=True).final_norm
    assert type(norm) is FusedRMSNorm
    x = torch.randn(3, 7, 32)
    x16 = x.to(torch.bfloat16)  # with float32 gains the plain module returns float32
    for t in (x, x16):  # CPU tensors: the kernel is for CUDA ones
        torch.testing.assert_close(norm(t), RMSNorm.forward(norm, t), rtol=0, atol=0)
    kernels_on_the_cpu(monkeypatch)  # from here on CPU tensors count as CUDA ones
    with torch.no_grad():  # no autograd: inference keeps the plain forward
        torch.testing.assert_close(norm(x), RMSNorm.forward(norm, x), rtol=0, atol=0)
    out = norm(x16)  # mixed dtypes
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, RMSNorm.forward(norm, x16), rtol=0, atol=0)
    assert calls["rms_norm"] == 0
    if INTERPRET:
        norm(x)  # one dtype, autograd on: the kernel
        assert calls["rms_norm"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [dict(), dict(qk_norm=True, n_kv_heads=2)], ids=str)
def test_fused_norms_in_bf16_autocast_gpu(overrides, monkeypatch):
    """fuse_model with every switch and norms=True on a GPU, under bf16 autocast as the GRPO update
    runs: loss and gradients against the plain model, and the norm kernel did run."""
    config = TransformerConfig(vocab_size=256, context_length=128, d_model=256, n_layers=2, n_heads=4, **overrides)
    plain, model = (m.cuda() for m in twins(config, chunked_loss=False, norms=True))
    idx = tokens(B=4, T=128, vocab=256).cuda()
    calls = count_calls(monkeypatch, "rms_norm")
    got = norm_results(model, idx, autocast=True)
    assert calls["rms_norm"] == 2 * config.n_layers + 1  # blocks and final norm; QK-norm's bf16 heads: plain
    want = norm_results(plain, idx, autocast=True)
    assert_all_close(got, want, atol=2e-3, rtol=3e-2)
