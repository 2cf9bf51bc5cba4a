import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lmfs.nn import (CausalSelfAttention, LayerNorm, Linear, RMSNorm, TransformerConfig, TransformerLM,
                     apply_rope, attention_reference, causal_mask, count_params, from_hf_llama,
                     generate, rope_angles, sinusoidal_table, to_hf_llama, top_k_filter, top_p_filter)
from lmfs.nn.layers import default_d_ff

POSITIONS = ("rope", "learned", "sinusoidal", "none")


def tiny(**overrides) -> TransformerConfig:
    base = dict(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4)
    return TransformerConfig(**{**base, **overrides})


def model_of(config, seed=0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config)


def tokens(B=2, T=12, vocab=50, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- layers


def test_layers_match_torch_functional():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    lin = Linear(8, 6, bias=True)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    with pytest.raises(ValueError, match="last dimension must equal d_in"):
        lin(torch.randn(2, 7))
    rms = RMSNorm(8)
    rms.weight.data.uniform_(0.5, 1.5)
    torch.testing.assert_close(rms(x), F.rms_norm(x, (8,), rms.weight, eps=rms.eps))
    ln = LayerNorm(8)
    ln.weight.data.uniform_(0.5, 1.5)
    ln.bias.data.uniform_(-1, 1)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, eps=ln.eps))


def test_default_d_ff():
    assert default_d_ff(64, "gelu") == 256
    assert default_d_ff(64, "swiglu") == 192  # 8/3·64 = 170.7 -> 192
    assert default_d_ff(96, "geglu") == 256   # 8/3·96 = 256 exactly


# ---------------------------------------------------------------- positions


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(2, 16), torch.randn(2, 16)

    def score(m, n):
        cos, sin = rope_angles(torch.tensor([m, n]), 16)
        rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return (rq[0] * rk[1]).sum()

    for m, n, s in [(3, 1, 5), (0, 7, 100), (9, 9, 33)]:
        torch.testing.assert_close(score(m, n), score(m + s, n + s), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(score(3, 1), score(3, 2))


def test_rope_pairs_dim_i_with_i_plus_half():
    x = torch.zeros(1, 8)
    x[0, 1] = 1.0
    cos, sin = rope_angles(torch.tensor([5]), 8)
    y = apply_rope(x, cos, sin)
    assert set(y[0].nonzero().flatten().tolist()) == {1, 5}  # rotated within the pair (1, 1 + 4)
    torch.testing.assert_close(y.norm(), torch.tensor(1.0))


def test_rotary_tables_are_cached_float32_and_match_on_the_fly_angles():
    from lmfs.nn import RotaryEmbedding

    rope = RotaryEmbedding(16, max_positions=12)
    assert "cos" not in rope.state_dict()  # not saved: recomputed from the config
    x = torch.randn(2, 3, 20, 16)
    for T in (12, 20):  # within the table, and past it (computed on the fly)
        cos, sin = rope_angles(torch.arange(T), 16)
        torch.testing.assert_close(rope(x[:, :, :T]), apply_rope(x[:, :, :T], cos, sin))
    rope.to(torch.bfloat16)  # a model cast must not round the tables
    assert rope.cos.dtype == torch.float32
    torch.testing.assert_close(rope.cos, rope_angles(torch.arange(12), 16)[0], rtol=0, atol=0)


def test_sinusoidal_table_formula():
    table = sinusoidal_table(10, 8)
    p, i = 7, 2
    assert math.isclose(table[p, 2 * i].item(), math.sin(p / 10000 ** (2 * i / 8)), abs_tol=1e-6)
    assert math.isclose(table[p, 2 * i + 1].item(), math.cos(p / 10000 ** (2 * i / 8)), abs_tol=1e-6)


# ---------------------------------------------------------------- attention


def test_gqa_with_all_kv_heads_is_mha():
    x = torch.randn(2, 10, 32)
    mha = model_of(tiny()).blocks[0].attn
    gqa = CausalSelfAttention(tiny(n_kv_heads=4))
    gqa.load_state_dict(mha.state_dict())
    torch.testing.assert_close(gqa(x), mha(x))


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32)
    gqa = CausalSelfAttention(tiny(n_kv_heads=2))
    mha = CausalSelfAttention(tiny())
    state = gqa.state_dict()
    for name in ("k_proj.weight", "v_proj.weight"):  # (2·8, 32) -> each KV head serves 2 q heads
        state[name] = state[name].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    torch.testing.assert_close(gqa(x), mha(x))


def test_mqa_shapes():
    attn = CausalSelfAttention(tiny(n_kv_heads=1))
    assert attn.k_proj.weight.shape == (8, 32) and attn.v_proj.weight.shape == (8, 32)
    assert attn(torch.randn(3, 7, 32)).shape == (3, 7, 32)


def test_sdpa_function_equals_reference():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 9, 8).unbind(0)
    for window in (None, 3):
        mask = causal_mask(9, window)
        torch.testing.assert_close(attention_reference(q, k, v, mask),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("overrides", [
    {}, {"window": 4}, {"n_kv_heads": 2, "qk_norm": True}, {"n_kv_heads": 1},
    {"attention": "mla", "kv_latent_dim": 8}, {"positions": "none", "bias": True},
])
def test_sdpa_path_equals_reference_path(overrides):
    idx = tokens()
    fast = model_of(tiny(**overrides, attn_impl="sdpa"))
    ref = model_of(tiny(**overrides, attn_impl="reference"))
    ref.load_state_dict(fast.state_dict())
    torch.testing.assert_close(fast(idx)[0], ref(idx)[0], atol=1e-5, rtol=1e-5)


def test_attention_softcap_bounds_scores_and_vanishes_when_large():
    torch.manual_seed(0)
    q, k, v = (3 * torch.randn(1, 1, 6, 4) for _ in range(3))
    mask = causal_mask(6)
    plain = attention_reference(q, k, v, mask)
    torch.testing.assert_close(attention_reference(q, k, v, mask, softcap=1e6), plain)
    assert not torch.allclose(attention_reference(q, k, v, mask, softcap=1.0), plain)


def test_sliding_window_ignores_tokens_beyond_it():
    torch.manual_seed(0)
    window, T, t = 3, 10, 8
    attn = CausalSelfAttention(tiny(window=window))
    x = torch.randn(1, T, 32)
    out = attn(x)
    for j in range(T):
        x2 = x.clone()
        x2[0, j] += 1.0
        changed = not torch.allclose(attn(x2)[0, t], out[0, t], atol=1e-6)
        assert changed == (t - window < j <= t), (j, changed)


def test_sliding_window_in_a_one_layer_model():
    model = model_of(tiny(n_layers=1, window=4))
    idx = tokens(B=1, T=12)
    logits = model(idx)[0]
    idx2 = idx.clone()
    idx2[0, 3] = (idx2[0, 3] + 1) % 50
    logits2 = model(idx2)[0]
    torch.testing.assert_close(logits2[0, 7:], logits[0, 7:])   # 3 is out of the window of 7..
    assert not torch.allclose(logits2[0, 3:7], logits[0, 3:7])  # ..but inside that of 3..6


# ---------------------------------------------------------------- model


BLOCK_STYLES = list(itertools.product(("pre", "post", "double"), (False, True)))


@pytest.mark.parametrize("norm_position,parallel", BLOCK_STYLES)
def test_causal_for_every_block_style_and_position(norm_position, parallel):
    variants = [dict(positions=p) for p in POSITIONS] + [
        dict(attention="mla", kv_latent_dim=8, n_kv_heads=2),
        dict(attn_softcap=5.0, logit_softcap=10.0, qk_norm=True, window=5),
    ]
    idx = tokens(B=2, T=12)
    for variant in variants:
        model = model_of(tiny(norm_position=norm_position, parallel=parallel, **variant))
        logits = model(idx)[0]
        for t in (0, 5, 11):
            idx2 = idx.clone()
            idx2[:, t] = (idx2[:, t] + 7) % 50
            logits2 = model(idx2)[0]
            torch.testing.assert_close(logits2[:, :t], logits[:, :t], msg=f"{variant} t={t}")
            assert not torch.allclose(logits2[:, t], logits[:, t]), variant


def test_every_combination_trains_without_nan():
    idx = tokens(B=2, T=8, vocab=32)
    kinds = itertools.product(("pre", "post", "double"), (False, True),
                              ("swiglu", "geglu", "relu", "gelu"), POSITIONS, ("rms", "layer"))
    for i, (position, parallel, ffn, positions, norm) in enumerate(kinds):
        extra = [{}, {"attention": "mla", "kv_latent_dim": 8}, {"qk_norm": True, "n_kv_heads": 1}][i % 3]
        config = TransformerConfig(vocab_size=32, context_length=8, d_model=16, n_layers=1, n_heads=2,
                                   norm_position=position, parallel=parallel, ffn=ffn,
                                   positions=positions, norm=norm, **extra)
        model = model_of(config, seed=i)
        _, loss = model(idx, idx)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        assert torch.isfinite(loss), config
        assert all(g is not None and torch.isfinite(g).all() for g in grads), config


@pytest.mark.parametrize("overrides", [
    {}, {"tie_embeddings": False}, {"n_kv_heads": 2, "bias": True, "positions": "learned"},
    {"norm": "layer", "norm_position": "post", "ffn": "gelu", "parallel": True},
    {"norm_position": "double", "qk_norm": True, "ffn": "geglu", "d_ff": 40, "tie_embeddings": False},
    {"attention": "mla", "kv_latent_dim": 12, "n_kv_heads": 1, "bias": True, "norm": "layer"},
])
def test_count_params_matches_module(overrides):
    config = tiny(**overrides)
    model = model_of(config)
    expected = sum(p.numel() for p in model.parameters())
    assert count_params(config) == config.num_params() == model.num_params() == expected


def test_tied_embeddings_are_one_tensor():
    model = model_of(tiny())
    assert model.lm_head is None
    untied = model_of(tiny(tie_embeddings=False))
    assert untied.num_params() - model.num_params() == 50 * 32


def test_initialisation_as_documented():
    config = TransformerConfig(vocab_size=64, context_length=8, d_model=256, n_layers=8, n_heads=4,
                               bias=True)
    model = model_of(config)
    block = model.blocks[0]
    assert math.isclose(block.attn.q_proj.weight.std().item(), 0.02, rel_tol=0.05)
    assert math.isclose(block.attn.o_proj.weight.std().item(), 0.02 / 4, rel_tol=0.05)
    assert math.isclose(block.mlp.down.weight.std().item(), 0.02 / 4, rel_tol=0.05)
    assert (block.attn.q_proj.bias == 0).all() and (block.norms[0].weight == 1).all()


def test_z_loss_and_logit_softcap():
    idx = tokens()
    base = model_of(tiny())
    logits, loss = base(idx, idx)
    zl = model_of(tiny(z_loss=1e-2))
    zl.load_state_dict(base.state_dict())
    lse = torch.logsumexp(logits, dim=-1)
    torch.testing.assert_close(zl(idx, idx)[1], loss + 1e-2 * lse.pow(2).mean())

    capped = model_of(tiny(logit_softcap=0.5))
    capped.load_state_dict(base.state_dict())
    c_logits, c_loss = capped(idx, idx)
    assert c_logits.abs().max() < 0.5
    torch.testing.assert_close(c_logits, 0.5 * torch.tanh(logits / 0.5))
    torch.testing.assert_close(c_loss, F.cross_entropy(c_logits.flatten(0, 1), idx.flatten()))


def test_ignore_index_in_loss():
    idx = tokens()
    model = model_of(tiny(z_loss=1e-3))
    targets = idx.clone()
    targets[:, :4] = -100
    logits, loss = model(idx, targets)
    keep = targets.flatten() != -100
    flat = logits.flatten(0, 1)[keep]
    z = torch.logsumexp(flat, dim=-1)
    expected = F.cross_entropy(flat, targets.flatten()[keep]) + 1e-3 * z.pow(2).mean()
    torch.testing.assert_close(loss, expected)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"n_heads in \[1, 2, 4, 5"):
        TransformerConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match=r"n_kv_heads in \[1, 2, 3, 6\]"):
        TransformerConfig(d_model=96, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="needs kv_latent_dim"):
        TransformerConfig(attention="mla")
    with pytest.raises(ValueError, match="set attention='mla'"):
        TransformerConfig(kv_latent_dim=16)
    with pytest.raises(ValueError, match="norm_position='sandwich' is not one of"):
        TransformerConfig(norm_position="sandwich")


def test_forward_input_errors():
    model = model_of(tiny())
    with pytest.raises(ValueError, match=r"idx\[None\]"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds context_length=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match=r"idx.long\(\)"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="same shape as idx"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


# ---------------------------------------------------------------- Hugging Face


@torch.no_grad()
def randomise_norm_gains(model):
    """Norm gains start at 1; random ones make a swapped or dropped norm show up in the logits."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_logits_match_both_ways(tie):
    import transformers
    config = TransformerConfig(vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4,
                               n_kv_heads=2, rope_theta=500.0, tie_embeddings=tie,
                               init_std=0.1)  # large enough that attention is far from uniform
    ours = model_of(config)
    randomise_norm_gains(ours)
    idx = tokens(B=2, T=20, vocab=97)

    state, hf_config = to_hf_llama(ours)
    hf_config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(state, strict=True)
    with torch.no_grad():
        hf_logits = hf(idx).logits
        torch.testing.assert_close(hf_logits, ours(idx)[0], atol=1e-5, rtol=1e-5)

    torch.manual_seed(1)
    hf2 = transformers.LlamaForCausalLM(hf_config).eval()  # fresh random weights, imported
    randomise_norm_gains(hf2)
    back = from_hf_llama(hf2)
    assert back.config.tie_embeddings == tie and back.config.rope_theta == 500.0
    with torch.no_grad():
        torch.testing.assert_close(back(idx)[0], hf2(idx).logits, atol=1e-5, rtol=1e-5)


def test_hf_export_lists_unsupported_options():
    model = model_of(tiny(norm="layer", qk_norm=True, window=4))
    with pytest.raises(ValueError) as err:
        to_hf_llama(model)
    for name in ("norm='layer'", "qk_norm=True", "window=4"):
        assert name in str(err.value)


def test_hf_import_rejects_unsupported_config():
    import transformers
    hf_config = transformers.LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         hidden_act="gelu", attention_bias=True)
    with pytest.raises(ValueError, match="hidden_act='gelu'.*attention_bias"):
        from_hf_llama({}, hf_config)


# ---------------------------------------------------------------- generation


def test_greedy_generation_is_argmax_decoding():
    model = model_of(tiny(context_length=8))
    idx = tokens(B=2, T=5)
    out = generate(model, idx, max_new_tokens=10, temperature=0)  # runs past context_length
    expected = idx
    for _ in range(10):
        logits = model(expected[:, -8:])[0][:, -1]
        expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, expected)
    assert torch.equal(generate(model, idx, 10, top_k=1), expected)  # top-1 sampling is greedy


def test_sampling_is_reproducible_with_a_generator():
    model = model_of(tiny())
    idx = tokens(B=3, T=4)
    a = generate(model, idx, 6, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(0))
    b = generate(model, idx, 6, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (3, 10)


def test_top_k_filter_brute_force():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    for k in (1, 4, 30, 50):
        out = top_k_filter(logits, k)
        for row, filtered in zip(logits, out):
            ranked = sorted(range(30), key=lambda i: -row[i].item())
            keep = set(ranked[:k])
            for i in range(30):
                assert (filtered[i] == row[i]) if i in keep else (filtered[i] == float("-inf"))


def test_top_p_filter_brute_force():
    logits = 2 * torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    for p in (0.05, 0.5, 0.9, 1.0):
        out = top_p_filter(logits, p)
        for row, filtered in zip(logits, out):
            probs = torch.softmax(row, -1).tolist()
            ranked = sorted(range(30), key=lambda i: -probs[i])
            keep, mass = set(), 0.0
            for i in ranked:  # add tokens until the kept mass reaches p
                keep.add(i)
                mass += probs[i]
                if mass >= p:
                    break
            kept = {i for i in range(30) if filtered[i] != float("-inf")}
            assert kept == keep, p
            assert all(filtered[i] == row[i] for i in kept)


def test_generation_argument_errors():
    model = model_of(tiny())
    with pytest.raises(ValueError, match="temperature"):
        generate(model, tokens(T=2), 1, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(torch.zeros(3), 0)


def test_replace_resolves_defaults_again():
    config = tiny(d_model=48, ffn="swiglu")
    assert config.ffn_dim == 128
    assert dataclasses.replace(config, ffn="relu").ffn_dim == 192


# ---------------------------------------------------------------- fast paths: same model, other code


def grads_of(loss, model):
    return dict(zip([n for n, _ in model.named_parameters()], torch.autograd.grad(loss, list(model.parameters()))))


def assert_grads_close(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], **tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_separate_layers(bias):
    from lmfs.nn import fused_linear

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    layers = [Linear(16, 16, bias), Linear(16, 8, bias), Linear(16, 8, bias)]  # GQA-like widths
    for layer in layers:
        if bias:
            layer.bias.data.normal_()
    fused = fused_linear(x, layers)
    separate = [layer(x) for layer in layers]
    for f, s in zip(fused, separate):
        torch.testing.assert_close(f, s, rtol=1e-6, atol=1e-6)
    params = [x] + [p for layer in layers for p in layer.parameters()]
    g = torch.randn(3, 5, 32)
    got = torch.autograd.grad(torch.cat(fused, -1), params, g)
    want = torch.autograd.grad(torch.cat(separate, -1), params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="last dimension must equal d_in"):
        fused_linear(torch.randn(2, 7), layers)


@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_heads=2, ffn="geglu"), dict(attention="mla", kv_latent_dim=8),
                                       dict(bias=True, positions="none")], ids=str)
def test_fused_projections_under_autocast_equal_separate_ones(overrides, monkeypatch):
    import lmfs.nn.layers as layers

    calls = []
    real = layers.fused_linear
    monkeypatch.setattr(layers, "fused_linear", lambda x, ls: calls.append(len(ls)) or real(x, ls))
    fused = model_of(tiny(fused_projections=True, **overrides))
    plain = model_of(tiny(fused_projections=False, **overrides))
    plain.load_state_dict(fused.state_dict())  # the switch changes no parameter
    idx = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused_logits, fused_loss = fused(idx, idx)
    assert calls, "autocast should take the fused path"
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_logits, plain_loss = plain(idx, idx)
    assert not calls
    # The same bf16 products: one matmul rounds each output once, like the separate ones.
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-3, atol=1e-3)
    # The input's gradient is one matmul instead of a sum of bf16-rounded ones: bf16-close.
    assert_grads_close(grads_of(fused_loss, fused), grads_of(plain_loss, plain), rtol=0.05, atol=2e-3)


def test_fused_projections_leave_fp32_untouched(monkeypatch):
    import lmfs.nn.layers as layers

    monkeypatch.setattr(layers, "fused_linear", lambda *a: pytest.fail("fp32 needs no stacked copy"))
    model = model_of(tiny(fused_projections=True))
    plain = model_of(tiny(fused_projections=False))
    idx = tokens()
    torch.testing.assert_close(model(idx, idx)[1], plain(idx, idx)[1], rtol=0, atol=0)


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
    from lmfs.nn import linear_cross_entropy

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
def test_loss_without_logits_equals_loss_from_logits(overrides):
    model = model_of(tiny(**overrides))
    idx, targets = tokens(), tokens(seed=2)
    targets[0, :3] = -100
    logits, loss = model(idx, targets)
    none, chunked = model(idx, targets, return_logits=False)
    assert none is None
    torch.testing.assert_close(chunked, loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads_of(chunked, model), grads_of(model(idx, targets)[1], model), rtol=1e-5, atol=1e-7)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 head and gradient, as the 2-step path
        _, auto_plain = model(idx, targets)
        _, auto_chunked = model(idx, targets, return_logits=False)
    torch.testing.assert_close(auto_chunked, auto_plain, rtol=1e-3, atol=1e-3)
    assert_grads_close(grads_of(auto_chunked, model), grads_of(auto_plain, model), rtol=0.05, atol=1e-3)
    with pytest.raises(ValueError, match="return_logits=False only applies with targets"):
        model(idx, return_logits=False)


def test_fast_paths_compile_without_graph_breaks():
    model = model_of(tiny(tie_embeddings=False))
    idx, targets = tokens(), tokens(seed=2)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fused projections and chunked loss
        loss = compiled(idx, targets, return_logits=False)[1]
        eager = model(idx, targets, return_logits=False)[1]
    torch.testing.assert_close(loss, eager)
    assert_grads_close(grads_of(loss, model), grads_of(eager, model), rtol=1e-2, atol=1e-4)


def test_sdpa_backend_preference():
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

    from lmfs.nn.attention import prefer_sdpa_backend, sdpa_preference

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
    model = model_of(tiny(sdpa_backend="flash"))
    torch.testing.assert_close(model(tokens())[0], model_of(tiny())(tokens())[0])
    with pytest.raises(ValueError, match="sdpa_backend"):
        tiny(sdpa_backend="fastest")


def _prefer_and_attend(q):
    from lmfs.nn.attention import prefer_sdpa_backend

    with prefer_sdpa_backend("flash"):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)
