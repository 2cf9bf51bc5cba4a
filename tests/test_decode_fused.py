"""lmfs.kernels.decode.FusedDecode against lmfs.inference.paged_forward on decode and prefill batches.

On the CPU the Triton kernels run in the interpreter: a small model (d_model 64, 2 layers, 4 query
heads), block size 4, a few sequences whose new token sits at the start, middle and end of a block.
Both paths start from the same cache contents; the logits and every cache entry must agree.
"""

import copy
import dataclasses
import json

import pytest
import torch
from helpers import DEVICE

from lmfs.inference import PagedBatch, PagedKVCache, paged_forward
from lmfs.inference.kv_cache import paged_attention_reference
from lmfs.kernels import decode
from lmfs.kernels.decode import GEMV_MAX_ROWS, FusedDecode, gemv, merge_rows
from lmfs.kernels.paged_attention import paged_decode_attention
from lmfs.nn import TransformerConfig, TransformerLM

BASE = TransformerConfig(vocab_size=64, context_length=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96)
BLOCK_SIZE = 4
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def build(dtype=torch.float32, device=DEVICE, seed=0, **fields) -> TransformerLM:
    torch.manual_seed(seed)
    with torch.device(device):
        model = TransformerLM(dataclasses.replace(BASE, **fields))
    with torch.no_grad():  # norm gains away from 1, so that a gain read from the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def decode_setup(model, lengths, seed=0):
    """A paged cache holding random keys/values for ``lengths[b] - 1`` earlier tokens of each
    sequence (blocks handed out in a shuffled order), and the decode batch of each sequence's
    next token at position ``lengths[b] - 1``."""
    cfg, p = model.config, next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-max(lengths) // BLOCK_SIZE)
    cache = PagedKVCache(cfg, 1 + per_seq * len(lengths), BLOCK_SIZE, device=p.device, dtype=p.dtype)
    for buffers in (cache.k, cache.v):
        for b in buffers:
            b.copy_(torch.randn(b.shape, generator=gen))
    order = torch.randperm(per_seq * len(lengths), generator=gen) + 1   # block 0 is the scratch block
    tables = order.view(len(lengths), per_seq).to(device=p.device, dtype=torch.int32)
    pos = torch.tensor(lengths, device=p.device) - 1
    slots = tables.long().gather(1, (pos // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + pos % BLOCK_SIZE
    tokens = torch.randint(0, cfg.vocab_size, (len(lengths),), generator=gen).to(p.device)
    return cache, PagedBatch(tokens, pos, slots, block_tables=tables, seq_lens=(pos + 1).int())


def assert_same_step(model, lengths, attention=paged_attention_reference, fused=None, logit_rows=None):
    cache, batch = decode_setup(model, lengths)
    batch.logit_rows = logit_rows
    cache2 = copy.deepcopy(cache)
    expected = paged_forward(model, cache, batch, attention)
    got = (fused or FusedDecode(model))(model, cache2, batch, attention)
    tol = TOLERANCE[expected.dtype]
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **tol)
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(cache2.k[layer], cache.k[layer], **tol)
        torch.testing.assert_close(cache2.v[layer], cache.v[layer], **tol)
    return got


# ----------------------------------------------------------------------------------------------
# Same logits and cache as paged_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])   # MHA, GQA, MQA
def test_fused_decode_matches_paged_forward(dtype, n_kv_heads):
    model = build(dtype, n_kv_heads=n_kv_heads)
    # New tokens at the first, second and last slot of a block and the first of a third block.
    assert_same_step(model, [1, 4, 5, 9, 2])
    assert_same_step(model, [7])


@pytest.mark.parametrize("tie", [False, True])
def test_fused_decode_head_and_logit_rows(tie):
    model = build(tie_embeddings=tie)
    got = assert_same_step(model, [3, 8, 6], logit_rows=torch.tensor([2, 0], device=DEVICE))
    assert got.shape == (2, model.config.vocab_size)


def test_fused_decode_with_the_triton_attention_kernel_and_other_variants():
    assert_same_step(build(), [5, 12, 1], attention=paged_decode_attention)
    assert_same_step(build(positions="none"), [5, 2])                     # NoPE: k and q not rotated
    assert_same_step(build(logit_softcap=5.0, rope_theta=500.0), [6, 3])  # the model's own head soft-caps


@pytest.mark.parametrize("dtype,n_kv_heads", [(torch.float32, 4), (torch.float32, 1), (torch.float16, 2)])
def test_gemv_path_matches(dtype, n_kv_heads, monkeypatch):
    """The six-kernel GEMV layer (norm + q/k/v + RoPE + cache writes, o + residual, norm + gate/up +
    SwiGLU, down + residual, norm + head) gives paged_forward's logits and cache, at one row and
    at several (each a pass over the weights already loaded)."""
    model = build(dtype, n_kv_heads=n_kv_heads)
    fused = FusedDecode(model, gemv=True)
    assert_same_step(model, [7], fused=fused)
    monkeypatch.setattr(decode, "GEMV_STEP_ROWS", GEMV_MAX_ROWS)   # a step of several rows takes it too
    assert_same_step(model, [1, 4, 5, 9, 2], fused=fused)
    assert_same_step(model, [6, 3], fused=fused, logit_rows=torch.tensor([1], device=DEVICE))
    other = build(dtype, positions="none", logit_softcap=5.0, tie_embeddings=False)   # NoPE, capped, own head
    assert_same_step(other, [5, 2], fused=FusedDecode(other, gemv=True))
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(s, generator=g).to(DEVICE, dtype) for s in ((3, 40), (37, 40)))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(gemv(x, w), (x.float() @ w.float().T).to(dtype), **tol)
    with pytest.raises(ValueError, match="at most"):
        gemv(x.new_zeros(GEMV_MAX_ROWS + 1, 40), w)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_fused_prefill_matches_paged_forward(n_kv_heads):
    """A gathered (prefill) batch: three prompts packed in one row, one after a cached prefix of two
    blocks. Same logits and cache contents as paged_forward's op-by-op prefill; its 17 tokens run the
    matmuls on rows padded to 18 (prefill_rows)."""
    from lmfs.inference import gathered_batch
    from lmfs.kernels.decode import prefill_rows

    model = build(n_kv_heads=n_kv_heads)
    cache, _ = decode_setup(model, [16, 16, 16])   # random contents: the prefix's keys are read from there
    gen = torch.Generator().manual_seed(3)
    new = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    tables = [[1, 2], [3, 4, 5, 6], [7, 8, 9]]   # the third sequence: 8 cached tokens, 3 new
    chunks = [(new[0], 0, tables[0]), (new[1], 0, tables[1]), (new[2], 8, tables[2])]
    batch = gathered_batch(chunks, BLOCK_SIZE, None, DEVICE)
    assert prefill_rows(batch.tokens.numel()) == 18
    cache2 = copy.deepcopy(cache)
    expected = paged_forward(model, cache, batch)
    got = FusedDecode(model)(model, cache2, batch, paged_attention_reference)
    assert got.shape == expected.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    for layer in range(model.config.n_layers):
        torch.testing.assert_close(cache2.k[layer], cache.k[layer], **TOLERANCE[torch.float32])
        torch.testing.assert_close(cache2.v[layer], cache.v[layer], **TOLERANCE[torch.float32])


def test_fused_forward_refuses_an_mla_cache():
    from lmfs.inference import gathered_batch

    model = build()
    mla = build(attention="mla", kv_latent_dim=16)
    cache = PagedKVCache(mla.config, 4, BLOCK_SIZE, device=DEVICE)
    batch = gathered_batch([([1, 2, 3], 0, [1])], BLOCK_SIZE, None, DEVICE)
    with pytest.raises(ValueError, match="MLA"):
        FusedDecode(model)(model, cache, batch, paged_attention_reference)


# ----------------------------------------------------------------------------------------------
# What it supports


@pytest.mark.parametrize("fields, reason", [
    (dict(attention="mla", kv_latent_dim=16), "MLA"),
    (dict(moe_experts=4), "MoE"),
    (dict(qk_norm=True), "QK-norm"),
    (dict(attn_softcap=30.0), "soft-capped attention"),
    (dict(window=8), "sliding window"),
    (dict(positions="learned"), "learned positions"),
    (dict(positions="sinusoidal"), "sinusoidal positions"),
    (dict(bias=True), "biases"),
    (dict(parallel=True), "parallel blocks"),
    (dict(norm_position="post"), "post-norm"),
    (dict(norm_position="double"), "sandwich"),
    (dict(norm="layer"), "LayerNorm"),
    (dict(ffn="geglu"), "geglu"),
    (dict(ffn="gelu"), "gelu"),
])
def test_supports_names_the_reason(fields, reason):
    model = build(**fields)
    why = FusedDecode.supports(model)
    assert why is not None and reason in why
    with pytest.raises(ValueError, match=reason):
        FusedDecode(model)


def test_supports_plain_llama_and_refuses_quantised_or_other_models():
    model = build()
    assert FusedDecode.supports(model) is None
    assert "not an lmfs TransformerLM" in FusedDecode.supports(torch.nn.Linear(2, 2))
    from lmfs.inference.quantize import quantize_model
    assert "quantised" in FusedDecode.supports(quantize_model(build(), bits=8, group_size=32))


# ----------------------------------------------------------------------------------------------
# Parameters: identity, state dict, in-place updates


def sgd_step(model) -> None:
    """One optimizer step on a random loss: every parameter changes in place."""
    model.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    logits, _ = model(torch.randint(0, 64, (1, 6), device=DEVICE))
    logits.square().mean().backward()
    opt.step()
    model.requires_grad_(False)


def test_merging_keeps_parameters_and_sees_in_place_updates():
    model = build()
    before = {name: p for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fused = FusedDecode(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    new_state = model.state_dict()
    assert new_state.keys() == state.keys()
    assert all(new_state[k].shape == state[k].shape and torch.equal(new_state[k], state[k]) for k in state)
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    qkv, _, gate_up, _ = fused._layers[0]   # (q/k/v, o, gate/up, down)
    assert attn.k_proj.weight.data_ptr() == qkv[attn.q_proj.weight.shape[0]:].data_ptr()
    assert mlp.up.weight.data_ptr() == gate_up[mlp.gate.weight.shape[0]:].data_ptr()
    # Preparing again (a second engine on the same model) copies nothing.
    assert FusedDecode(model)._layers[0][0].data_ptr() == qkv.data_ptr()

    # An optimizer step changes the parameters in place; the next fused call must use the new values.
    sgd_step(model)
    assert not torch.equal(model.blocks[0].attn.v_proj.weight, state["blocks.0.attn.v_proj.weight"])
    assert_same_step(model, [4, 7], fused=fused)
    # load_state_dict copies into the merged buffers too.
    model.load_state_dict(state)
    assert torch.equal(qkv[-attn.v_proj.weight.shape[0]:], state["blocks.0.attn.v_proj.weight"])
    assert_same_step(model, [4, 7], fused=fused)


def test_replaced_parameters_are_merged_again():
    model = build()
    fused = FusedDecode(model)
    model.half().float()   # every parameter gets new storage: the merge must be redone on the next call
    assert fused._stale(model)
    assert_same_step(model, [3, 5], fused=fused)
    assert not fused._stale(model)


def test_merge_rows_views_and_errors():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    values = torch.cat([a.detach(), b.detach()])
    merged = merge_rows([a, b])
    assert torch.equal(merged, values) and merged.shape == (5, 4)
    b.data.add_(1)
    assert torch.equal(merged[3:], values[3:] + 1)
    assert merge_rows([a, b]).data_ptr() == merged.data_ptr()


# ----------------------------------------------------------------------------------------------
# dtype=bf16: 16-bit copies of float32 weights, for calls under autocast


def bf16_step(model, fused, lengths=(4, 7, 10)):
    """``fused``'s logits and bf16 cache for one decode batch under bf16 autocast."""
    cache, batch = decode_setup(model, list(lengths))
    cache.k, cache.v = [k.bfloat16() for k in cache.k], [v.bfloat16() for v in cache.v]
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, cache_enabled=False):
        logits = fused(model, cache, batch, paged_attention_reference)
    return logits, cache


def assert_equal_steps(a, b):
    assert a[0].dtype == b[0].dtype == torch.bfloat16
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1].k + a[1].v, b[1].k + b[1].v))


def test_bf16_copies_leave_the_parameters_and_compute_as_autocasts_casts():
    """FusedDecode(dtype=bf16) on float32 weights: the parameters keep their storage and state dict,
    and the step under autocast equals, bit for bit, the step that casts the float32 weights (copying
    rounds as autocast's cast does)."""
    model = build()
    where = {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fused = FusedDecode(model, dtype=torch.bfloat16)
    assert {name: (p.data_ptr(), p.dtype) for name, p in model.named_parameters()} == where
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(w.dtype == torch.bfloat16 for layer in fused._layers for w in layer)
    assert fused.weight_copies == 7 * model.config.n_layers   # q, k, v, o, gate, up, down
    cast = copy.deepcopy(model)
    assert_equal_steps(bf16_step(model, fused), bf16_step(cast, FusedDecode(cast)))
    with pytest.raises(ValueError, match="torch.autocast"):   # bf16 weights, fp32 activations: refused
        fused(model, *decode_setup(model, [3]), paged_attention_reference)
    with pytest.raises(ValueError, match="gemv"):
        FusedDecode(model, gemv=True, dtype=torch.bfloat16)


def test_bf16_copies_follow_in_place_updates_and_copy_only_what_changed():
    """An in-place update (an optimizer step, load_state_dict, one parameter) is copied before the
    next step, exactly the parameters it changed; without one nothing is copied. The step then equals
    a fresh FusedDecode's on the updated model; new tensors (model.half().float()) rebuild the copies."""
    model = build()
    n = 7 * model.config.n_layers
    fused = FusedDecode(model, dtype=torch.bfloat16)
    first = bf16_step(model, fused)
    assert fused.weight_copies == n and fused.refresh(model) == 0
    assert_equal_steps(bf16_step(model, fused), first)
    assert fused.weight_copies == n   # nothing changed, nothing copied

    sgd_step(model)
    updated = bf16_step(model, fused)
    assert fused.weight_copies == 2 * n
    assert not torch.equal(updated[0], first[0])
    assert_equal_steps(updated, bf16_step(model, FusedDecode(model, dtype=torch.bfloat16)))

    with torch.no_grad():
        model.blocks[1].attn.v_proj.weight.mul_(-1)
    assert fused.refresh(model) == 1 and fused.weight_copies == 2 * n + 1
    assert_equal_steps(bf16_step(model, fused), bf16_step(model, FusedDecode(model, dtype=torch.bfloat16)))

    model.half().float()   # every parameter gets new storage: new copies, from the new tensors
    assert fused._stale(model)
    assert_equal_steps(bf16_step(model, fused), bf16_step(model, FusedDecode(model, dtype=torch.bfloat16)))
    assert not fused._stale(model)


@pytest.mark.gpu
def test_bf16_copies_in_a_cuda_graph_follow_refresh_gpu():
    """Captured in a CUDA graph, the step reads the bf16 copies: the capture itself copies nothing, an
    in-place update reaches a replay through refresh() (outside the graph) and not without it."""
    model = build(device="cuda")
    fused = FusedDecode(model, dtype=torch.bfloat16)
    cache, batch = decode_setup(model, [4, 7, 10])
    cache.k, cache.v = [k.bfloat16() for k in cache.k], [v.bfloat16() for v in cache.v]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

    def step():
        with autocast:
            return fused(model, cache, batch, paged_decode_attention)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()   # warm-up: Triton compiles
    torch.cuda.current_stream().wait_stream(stream)
    copies = fused.weight_copies
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    assert fused.weight_copies == copies
    graph.replay()
    before = static.clone()
    with torch.no_grad():   # the projections' weights: the ones held as copies (norms and head are read as they are)
        for block in model.blocks:
            for group in FusedDecode._weight_groups(block):
                for p in group:
                    p.add_(torch.randn_like(p) * 0.5)
    graph.replay()
    torch.testing.assert_close(static, before, atol=0, rtol=0)   # the copies are what the graph reads
    assert fused.refresh(model) == 7 * model.config.n_layers
    graph.replay()
    with autocast:
        fresh = FusedDecode(model, dtype=torch.bfloat16)(model, cache, batch, paged_decode_attention)
    torch.cuda.synchronize()
    assert not torch.equal(static, before)
    torch.testing.assert_close(static, fresh, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# GPU: bf16, the 1B model's layer widths (2 layers), the Triton attention kernel


@pytest.mark.gpu
@pytest.mark.parametrize("gemv_path", [False, True])
def test_fused_decode_gpu_llama_widths(gemv_path, monkeypatch):
    monkeypatch.setattr(decode, "GEMV_STEP_ROWS", GEMV_MAX_ROWS)   # the GEMV path for all of these batches
    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=32_000, context_length=2048, d_model=2048, n_layers=2, n_heads=32,
                            n_kv_heads=8, d_ff=8192)
    model = TransformerLM(cfg).cuda().to(torch.bfloat16).eval()
    exact = copy.deepcopy(model).float()      # the same bf16 weights, computed in float32
    fused = FusedDecode(model, gemv=gemv_path)
    for lengths in ([1], [300], [17, 512, 1, 64, 200, 33, 2, 1000]):
        cache, batch = decode_setup(model, lengths)
        cache2, cache32 = copy.deepcopy(cache), copy.deepcopy(cache)
        cache32.k, cache32.v = [k.float() for k in cache.k], [v.float() for v in cache.v]
        expected = paged_forward(model, cache, batch, paged_decode_attention)
        got = fused(model, cache2, batch, paged_decode_attention)
        reference = paged_forward(exact, cache32, batch, paged_attention_reference)
        assert got.dtype == torch.bfloat16
        # Both bf16 paths round differently (merged matmuls pick other cuBLAS kernels), so neither is
        # the truth: the fused path must be as close to the float32 computation as the plain one is.
        plain_error = (expected.float() - reference).abs().max().item()
        fused_error = (got.float() - reference).abs().max().item()
        assert fused_error <= 1.5 * plain_error + 1e-2, (fused_error, plain_error)
        for layer in range(2):   # the cached keys and values: as close to float32's as the plain path's
            for fused_c, plain_c, exact_c in ((cache2.k, cache.k, cache32.k), (cache2.v, cache.v, cache32.v)):
                plain_error = (plain_c[layer].float() - exact_c[layer]).abs().max().item()
                fused_error = (fused_c[layer].float() - exact_c[layer]).abs().max().item()
                assert fused_error <= 1.5 * plain_error + 1e-2, (layer, fused_error, plain_error)
    # Captured in a CUDA graph and replayed: the same logits as the direct call.
    cache, batch = decode_setup(model, [100, 7])
    direct = fused(model, copy.deepcopy(cache), batch, paged_decode_attention)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused(model, cache, batch, paged_decode_attention)   # warm-up: Triton compiles, autotunes
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused(model, cache, batch, paged_decode_attention)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static, direct)


# ----------------------------------------------------------------------------------------------
# The benchmark


def test_decode_step_benchmark_runs(tmp_path, capsys):
    """The tiny CPU run; on a GPU machine one batch size of the real model (the kernels do not run
    on CPU tensors there)."""
    from lmfs.benchmarks import decode_step

    path = tmp_path / "decode_step.json"
    cuda = torch.cuda.is_available()
    gpu_args = ["--batches", "1", "--repeats", "3"] if cuda else []
    result = decode_step.main(["--json", str(path), "--profile", *gpu_args])
    saved = json.loads(path.read_text())
    assert [row["batch"] for row in saved["rows"]] == ([1] if cuda else [1, 8])
    for row in result["rows"]:
        assert row["plain_ms"] > 0 and row["fused_ms"] > 0 and row["fused_over_plain"] > 0
        assert row["max_abs_logit_diff"] < (0.25 if cuda else 1e-3)   # bf16 on a GPU, float32 here
    assert "fused / plain" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# Under autocast: float32 weights, 16-bit activations and cache (lmfs.inference.LLM(autocast=...))

@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_fused_decode_under_autocast_matches_the_models_forward(n_kv_heads):
    """A float32 model decoding under bf16 autocast (what GRPO rollouts do): the merged q/k/v and
    gate/up matmuls read their float32 weights through autocast's casts, the Triton kernels take
    the bf16 activations and write the bf16 cache. The logits of each sequence's last token equal
    the model's own uncached forward under the same autocast, and paged_forward's, to bf16 precision;
    the weights stay float32."""
    from lmfs.inference import gathered_batch

    model = build(n_kv_heads=n_kv_heads)
    device, cfg = next(model.parameters()).device, model.config
    lengths = [3, 6, 9, 13]
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    per_seq = -(-max(lengths) // BLOCK_SIZE)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(len(seqs))]
    cache = PagedKVCache(cfg, 1 + per_seq * len(seqs), BLOCK_SIZE, device=device, dtype=torch.bfloat16)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    with autocast:   # prefill everything but each sequence's last token
        paged_forward(model, cache, gathered_batch([(s[:-1], 0, t) for s, t in zip(seqs, tables)], BLOCK_SIZE,
                                                   None, device))
    pos = torch.tensor(lengths, device=device) - 1
    table = torch.tensor(tables, device=device, dtype=torch.int32)
    slots = table.long().gather(1, (pos // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + pos % BLOCK_SIZE
    batch = PagedBatch(torch.tensor([s[-1] for s in seqs], device=device), pos, slots, block_tables=table,
                       seq_lens=(pos + 1).int())
    plain_cache = copy.deepcopy(cache)
    fused = FusedDecode(model)
    with autocast:
        got = fused(model, cache, batch, paged_attention_reference)
        plain = paged_forward(model, plain_cache, batch, paged_attention_reference)
        with torch.no_grad():
            own = torch.cat([model(torch.tensor([s], device=device))[0][:, -1] for s in seqs])
    assert got.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in model.parameters())
    assert cache.k[0].dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), own.float(), **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(got.float(), plain.float(), **TOLERANCE[torch.bfloat16])
    for layer in range(cfg.n_layers):   # the new token's keys and values, written by the RoPE kernel
        torch.testing.assert_close(cache.k[layer].float(), plain_cache.k[layer].float(), **TOLERANCE[torch.bfloat16])
        torch.testing.assert_close(cache.v[layer].float(), plain_cache.v[layer].float(), **TOLERANCE[torch.bfloat16])
    with torch.no_grad():   # and differ from float32 logits beyond fp32 rounding: autocast applied
        fp32 = torch.cat([model(torch.tensor([s], device=device))[0][:, -1] for s in seqs])
    assert (got.float() - fp32).abs().max() > 1e-4


# ----------------------------------------------------------------------------------------------
# The engine's step bookkeeping kernels (lmfs.kernels.engine_step) against the PyTorch lines


def test_gather_decode_batch_matches_indexing():
    from lmfs.kernels.engine_step import gather_decode_batch

    g = torch.Generator().manual_seed(0)
    R, width, page = 6, 5, 4
    tables = torch.randint(1, 50, (R, width), generator=g, dtype=torch.int32).to(DEVICE)
    positions = torch.randint(0, width * page, (R,), generator=g).to(DEVICE)
    last = torch.randint(0, 100, (R,), generator=g).to(DEVICE)
    rows = torch.tensor([4, 1, 5, 5], device=DEVICE)   # the last two: padding on one row
    got = gather_decode_batch(rows, positions, tables, last, page)
    pos = positions[rows]
    torch.testing.assert_close(got.positions, pos)
    torch.testing.assert_close(got.tokens, last[rows])
    torch.testing.assert_close(got.block_tables, tables[rows])
    blocks = tables[rows].gather(1, (pos // page)[:, None])[:, 0].long()
    torch.testing.assert_close(got.slots, blocks * page + pos % page)
    torch.testing.assert_close(got.seq_lens, (pos + 1).int())
    assert got.decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_advance_matches_sample_scaled(dtype):
    from lmfs.inference.sampling import sample_scaled
    from lmfs.kernels import engine_step

    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(3, 300, generator=g)).to(DEVICE, dtype)
    logits[1, 17] = logits[1, 250] = logits[1].max() + 1   # a tie: the first index wins, as torch.argmax's
    rows, dummy = torch.tensor([2, 0, 5], device=DEVICE), 5
    last, positions = torch.zeros(6, dtype=torch.long, device=DEVICE), torch.arange(6, device=DEVICE) + 10
    drawn = engine_step.greedy_advance(logits, rows, last, positions, dummy, block_v=128)   # three chunks
    ids, logprobs = sample_scaled(logits.float(), None, None)
    assert drawn.dtype == torch.float64 and drawn.shape == (2, 3)
    assert drawn[0].long().tolist() == ids.tolist() and ids[1] == 17
    torch.testing.assert_close(drawn[1].float(), logprobs, atol=1e-5, rtol=1e-5)
    assert last[rows[:2]].tolist() == ids[:2].tolist()
    assert positions.tolist() == [11, 11, 13, 13, 14, 0]   # rows 2 and 0 advanced, the padding row 5 at 0
