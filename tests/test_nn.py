import ast
import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import model_of, tiny

from lmfs.nn import (Block, CausalSelfAttention, LayerNorm, Linear, RMSNorm, RotaryEmbedding, TransformerConfig,
                     apply_rope, attention_reference, causal_mask, count_params, cross_entropy, from_hf_llama, generate,
                     rope_angles, silu, sinusoidal_table, softmax, to_hf_llama, top_k_filter, top_p_filter)
from lmfs.nn.layers import default_d_ff

POSITIONS = ("rope", "learned", "sinusoidal", "none")


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


# ---------------------------------------------------------------- the package itself


def test_nn_imports_nothing_from_kernels_or_benchmarks():
    """lmfs.nn is the model as taught: no module of it reaches for the kernels or the harnesses."""
    forbidden = ("lmfs.kernels", "lmfs.bench", "lmfs.benchmarks")
    files = sorted((Path(__file__).parent.parent / "lmfs" / "nn").glob("*.py"))
    assert len(files) >= 9
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith(forbidden)]
            assert not bad, f"{path.name} imports {bad}"


# ---------------------------------------------------------------- functional: written out vs torch


HARD_ROWS = torch.tensor([
    [1000.0, 999.0, -1000.0, 0.0],               # exp would overflow without the shift
    [-1000.0, -1001.0, -1002.0, -1003.0],        # ... or underflow to 0 / 0
    [3.0, float("-inf"), 1.0, float("-inf")],    # masked entries
    [1e-3, 2e-3, -1e-3, 0.0],                    # nearly uniform
])


def test_softmax_matches_torch_including_hard_inputs():
    x = torch.cat([HARD_ROWS, 5 * torch.randn(6, 4, generator=torch.Generator().manual_seed(0))])
    for dim in (-1, 0):
        torch.testing.assert_close(softmax(x, dim), torch.softmax(x, dim), rtol=1e-6, atol=1e-7)
    masked = softmax(HARD_ROWS[2], dim=-1)
    assert masked[1] == 0 and masked[3] == 0
    all_masked = torch.full((4,), float("-inf"))
    assert softmax(all_masked).isnan().all() and torch.softmax(all_masked, -1).isnan().all()  # as torch
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2))
    (ours,) = torch.autograd.grad(softmax(x, 1), x, g)
    (theirs,) = torch.autograd.grad(torch.softmax(x, 1), x, g)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_cross_entropy_matches_torch_including_hard_inputs():
    logits = torch.cat([HARD_ROWS, 10 * torch.randn(8, 4, generator=torch.Generator().manual_seed(0))])
    targets = torch.tensor([0, 3, 2, 1, 0, 1, 2, 3, -100, 1, 2, 0])
    for ignore, t in [(-100, targets), (1, targets.clamp(min=0))]:
        torch.testing.assert_close(cross_entropy(logits, t, ignore_index=ignore),
                                   F.cross_entropy(logits, t, ignore_index=ignore), rtol=1e-6, atol=1e-6)
    x = logits[4:].clone().requires_grad_()
    ours = torch.autograd.grad(cross_entropy(x, targets[4:]), x)[0]
    theirs = torch.autograd.grad(F.cross_entropy(x, targets[4:]), x)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # A masked (-inf) target is infinitely unlikely: an infinite loss, as torch says.
    assert cross_entropy(HARD_ROWS[2:3], torch.tensor([1])).isinf()
    assert F.cross_entropy(HARD_ROWS[2:3], torch.tensor([1])).isinf()
    with pytest.raises(ValueError, match="flatten batch and time"):
        cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))


def test_silu_matches_torch():
    x = torch.cat([torch.linspace(-20, 20, 101), torch.tensor([-1e4, 1e4, 0.0])]).requires_grad_()
    torch.testing.assert_close(silu(x), F.silu(x))
    g = torch.randn(104, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.autograd.grad(silu(x), x, g)[0], torch.autograd.grad(F.silu(x), x, g)[0])
    assert math.isclose(silu(torch.linspace(-3, 0, 3001)).min().item(), -0.2785, abs_tol=1e-4)


# ---------------------------------------------------------------- explicit positions


def test_rope_angles_with_batched_positions():
    # T = head_dim / 2: the shape that broadcasting once got wrong silently.
    for T, head_dim in [(4, 8), (5, 8), (1, 8)]:
        positions = torch.stack([torch.arange(T), torch.arange(T) + 10])  # (B=2, T)
        cos, sin = rope_angles(positions, head_dim)
        assert cos.shape == sin.shape == (2, T, head_dim)
        for b in range(2):
            row_cos, row_sin = rope_angles(positions[b], head_dim)
            torch.testing.assert_close(cos[b], row_cos, rtol=0, atol=0)
            torch.testing.assert_close(sin[b], row_sin, rtol=0, atol=0)


def test_rope_offset_positions_equal_a_slice_of_a_longer_sequence():
    rope = RotaryEmbedding(8, max_positions=16)
    x = torch.randn(2, 3, 20, 8, generator=torch.Generator().manual_seed(0))
    whole = rope(x)  # positions 0..19
    for offset in (0, 5, 12):  # within the cached table, and past it
        torch.testing.assert_close(rope(x[:, :, offset:offset + 8], torch.arange(offset, offset + 8)),
                                   whole[:, :, offset:offset + 8])
    # Per sequence: row 0 continues at 5, row 1 at 11.
    positions = torch.stack([torch.arange(5, 13), torch.arange(11, 19)])
    got = rope(torch.stack([x[0, :, 5:13], x[1, :, 11:19]]), positions)
    torch.testing.assert_close(got, torch.stack([whole[0, :, 5:13], whole[1, :, 11:19]]))


def test_packed_positions_restart_per_document():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, max_positions=16)
    docs = [torch.randn(1, 2, n, 8) for n in (3, 5, 2)]
    positions = torch.cat([torch.arange(n) for n in (3, 5, 2)])  # [0 1 2 0 1 2 3 4 0 1]
    packed = rope(torch.cat(docs, dim=2), positions)
    torch.testing.assert_close(packed, torch.cat([rope(d) for d in docs], dim=2))


def test_model_positions():
    idx = tokens(B=2, T=10)
    model = model_of(tiny())
    logits = model(idx)[0]
    torch.testing.assert_close(model(idx, positions=torch.arange(10))[0], logits)  # the default
    # RoPE sees relative positions only: shifting every token by the same offset changes nothing.
    torch.testing.assert_close(model(idx, positions=torch.arange(10) + 37)[0], logits, rtol=1e-4, atol=1e-4)
    # (B, T) positions: each row as if it ran alone at its own positions.
    per_row = torch.stack([torch.arange(10), torch.arange(10) + 3])
    both = model(idx, positions=per_row)[0]
    torch.testing.assert_close(both[1], model(idx[1:], positions=torch.arange(10) + 3)[0][0])
    learned = model_of(tiny(positions="learned"))
    shifted = learned(idx[:, :6], positions=torch.arange(6) + 4)[0]
    table = learned.pos_emb.table.weight
    x = learned.tok_emb(idx[:, :6]) + table[4:10]
    for block in learned.blocks:
        x = block(x)
    torch.testing.assert_close(shifted, learned.head(learned.final_norm(x)))
    with pytest.raises(ValueError, match="positions must be integer"):
        model(idx, positions=torch.arange(9))
    with pytest.raises(ValueError, match="positions must be integer"):
        model(idx, positions=torch.arange(10.0))


def test_offset_rope_equals_slicing_a_longer_sequence_in_attention():
    """Attention over a suffix at its true positions sees the same rotated q·k as inside the full
    sequence; with a window covering only that suffix, the outputs agree."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(d_model=32, n_heads=4, window=4, context_length=16)
    x = torch.randn(1, 12, 32)
    full = attn(x)
    # Position 11's window is tokens 8..11: the same inputs at positions 8..11 give the same output.
    torch.testing.assert_close(attn(x[:, 8:], torch.arange(8, 12))[0, -1], full[0, -1], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- single layers without a model


def test_layers_from_dims_equal_layers_from_a_config():
    config = TransformerConfig(d_model=64, n_heads=4, n_kv_heads=2, qk_norm=True)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(0))
    for cls in (CausalSelfAttention, Block):
        torch.manual_seed(0)
        from_config = cls(config)
        torch.manual_seed(0)
        from_dims = cls(d_model=64, n_heads=4, n_kv_heads=2, qk_norm=True)
        assert from_dims.state_dict().keys() == from_config.state_dict().keys()
        torch.testing.assert_close(from_dims(x), from_config(x), rtol=0, atol=0)
    attn = CausalSelfAttention(tiny(), window=3)  # a config with one field replaced
    assert attn.window == 3 and attn.n_heads == 4
    block = Block(d_model=48, n_heads=6, ffn="gelu", norm="layer")
    assert block(torch.randn(1, 5, 48)).shape == (1, 5, 48)
    with pytest.raises(TypeError, match="unknown settings.*d_modle"):
        CausalSelfAttention(d_modle=64)
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        CausalSelfAttention(d_model=30, n_heads=4)
