"""lmfs.inference: caches, cached forwards, sampling and the engine, each against an independent
reference (the uncached model, lmfs.nn.generate, brute-force filters, dense attention)."""

import dataclasses
import math

import pytest
import torch
from helpers import DEVICE, HostTransfers

from lmfs.inference import (LLM, BlockAllocator, KVCache, PagedKVCache, SamplingParams, forward_cached,
                            gathered_batch, generate_static, paged_attention_reference, paged_forward,
                            process_logits, sample)
from lmfs.fast import fast_engine
from lmfs.nn import TransformerConfig, TransformerLM, generate
from lmfs.tokenization import Tokenizer

BASE = dict(vocab_size=97, context_length=48, d_model=32, n_layers=2, n_heads=4)
VARIANTS = {
    "mha": {}, "gqa": dict(n_kv_heads=2), "mqa": dict(n_kv_heads=1),
    "mla": dict(attention="mla", kv_latent_dim=8, n_kv_heads=2),
    "window": dict(window=5, n_kv_heads=2), "learned": dict(positions="learned"),
    "sinusoidal": dict(positions="sinusoidal"), "nope": dict(positions="none"),
    "post_layernorm": dict(norm_position="post", norm="layer", ffn="gelu"),
    "double_parallel": dict(norm_position="double", parallel=True),
    "qknorm_softcaps": dict(qk_norm=True, attn_softcap=5.0, logit_softcap=3.0),
    "moe": dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1), "moe_hash": dict(moe_experts=4, moe_router="hash"),
}


def tiny(seed=0, **fields):
    torch.manual_seed(seed)
    return TransformerLM(TransformerConfig(**{**BASE, **fields})).eval()


def random_prompts(lengths, vocab=97, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_reference(model, prompts, n):
    device = next(model.parameters()).device
    return [generate(model, torch.tensor([p], device=device), n, temperature=0)[0, len(p):].tolist() for p in prompts]


# ---------------------------------------------------------------------------------------------
# Cached forwards

@pytest.mark.parametrize("name", VARIANTS)
def test_forward_cached_equals_uncached(name):
    model = tiny(**VARIANTS[name])
    idx = torch.randint(0, 97, (2, 20))
    reference, _ = model(idx)
    cache = KVCache.for_model(model, batch_size=2, max_len=24)
    pieces = [forward_cached(model, idx[:, :7], cache)]             # a prompt, then one token at a time
    pieces += [forward_cached(model, idx[:, t:t + 1], cache) for t in range(7, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(pieces, 1), reference, atol=1e-4, rtol=0)


def test_kv_cache_truncate_and_bytes():
    model = tiny(n_kv_heads=2)
    idx = torch.randint(0, 97, (1, 12))
    reference, _ = model(idx)
    cache = KVCache.for_model(model, 1, 16)
    forward_cached(model, idx[:, :8], cache)
    forward_cached(model, torch.randint(0, 97, (1, 3)), cache)      # rejected draft tokens
    cache.truncate(8)
    torch.testing.assert_close(forward_cached(model, idx[:, 8:], cache), reference[:, 8:], atol=1e-4, rtol=0)
    c = model.config    # keys and values, n_layers · n_kv_heads · head_dim floats each, per token
    assert cache.bytes_used == 12 * 2 * c.n_layers * 2 * c.head_dim * 4
    assert cache.nbytes == 16 * 2 * c.n_layers * 2 * c.head_dim * 4
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(13)


def test_paged_attention_reference_matches_dense_attention():
    torch.manual_seed(0)
    B, H, KV, d, bs, nb = 3, 8, 2, 16, 4, 20
    k_cache, v_cache = torch.randn(nb, bs, KV, d), torch.randn(nb, bs, KV, d)
    lens = torch.tensor([1, 7, 13], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb)[:4] for _ in range(B)]).to(torch.int32)  # scattered blocks
    q = torch.randn(B, H, d)
    for window in (None, 3):
        out = paged_attention_reference(q, k_cache, v_cache, tables, lens, window=window)
        for b in range(B):
            n = int(lens[b])
            k = k_cache[tables[b].long()].flatten(0, 1)[:n]            # (n, KV, d) in position order
            v = v_cache[tables[b].long()].flatten(0, 1)[:n]
            first = 0 if window is None else max(0, n - window)
            kh = k[first:].transpose(0, 1).repeat_interleave(H // KV, 0)    # (H, n', d)
            vh = v[first:].transpose(0, 1).repeat_interleave(H // KV, 0)
            dense = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], kh, vh)[:, 0]
            torch.testing.assert_close(out[b], dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_gathered_batch_equals_a_sequence_by_sequence_construction(window):
    """gathered_batch builds its tensors for the whole batch at once; they must be what listing each
    sequence's keys and new tokens one by one gives: positions, slots through the block table (a
    cached prefix skipped as queries but kept as keys), which query may read which key, last rows."""
    g = torch.Generator().manual_seed(0)
    block = 4
    chunks = []
    for start, n in [(0, 5), (8, 3), (0, 1), (3, 9), (4, 0)]:
        blocks = torch.randperm(40, generator=g)[:-(-(start + n) // block) + 1].tolist()   # one block spare
        chunks.append((torch.randint(0, 50, (n,), generator=g).tolist(), start, blocks))
    got = gathered_batch(chunks, block, window, "cpu")
    tokens, qpos, slots, key_slots, kpos, qseq, kseq, last = [], [], [], [], [], [], [], []
    for s, (new, start, table) in enumerate(chunks):
        for p in range(start + len(new)):
            slot = table[p // block] * block + p % block
            key_slots.append(slot), kpos.append(p), kseq.append(s)
            if p >= start:
                tokens.append(new[p - start]), qpos.append(p), slots.append(slot), qseq.append(s)
        last.append(len(tokens) - 1)
    allowed = [[qs == ks and kp <= qp and (window is None or qp - kp < window) for ks, kp in zip(kseq, kpos)]
               for qs, qp in zip(qseq, qpos)]
    for name, want in [("tokens", tokens), ("positions", qpos), ("slots", slots), ("key_slots", key_slots),
                       ("key_positions", kpos), ("allowed", allowed), ("logit_rows", last)]:
        assert getattr(got, name).tolist() == want, name
    # where each sequence's queries and keys start, for the variable-length flash kernel
    for name, seqs in (("cu_seq_q", qseq), ("cu_seq_k", kseq)):
        assert getattr(got, name).tolist() == [sum(x < s for x in seqs) for s in range(len(chunks) + 1)], name
    assert (got.max_q, got.max_k) == (max(qseq.count(s) for s in range(len(chunks))),
                                      max(kseq.count(s) for s in range(len(chunks))))
    with pytest.raises(ValueError, match="block table"):
        gathered_batch([([1, 2, 3], 2, [0])], block, None, "cpu")


@pytest.mark.parametrize("name", ["gqa", "mla", "window", "moe"])
def test_paged_forward_equals_contiguous(name):
    """Prefill two prompts packed (one after a shared, already cached prefix), then decode one
    token each over scattered blocks: the logits of the model on the full sequences."""
    model = tiny(**VARIANTS[name])
    bs = 4
    cache = PagedKVCache.for_model(model, num_tokens=64, block_size=bs)
    seqs = random_prompts([10, 13])
    tables = [[5, 2, 9, 1], [7, 3, 11, 4]]
    full = [model(torch.tensor([s]))[0][0] for s in seqs]
    # Sequence 1's first 4 tokens are prefilled alone first (a cached prefix).
    paged_forward(model, cache, gathered_batch([(seqs[1][:4], 0, tables[1])], bs, model.config.window, "cpu"))
    chunks = [(seqs[0][:9], 0, tables[0]), (seqs[1][4:12], 4, tables[1])]
    logits = paged_forward(model, cache, gathered_batch(chunks, bs, model.config.window, "cpu"))
    torch.testing.assert_close(logits, torch.stack([full[0][8], full[1][11]]), atol=1e-4, rtol=0)
    decode = [(seqs[0][9:10], 9, tables[0]), (seqs[1][12:13], 12, tables[1])]
    if name == "mla":
        logits = paged_forward(model, cache, gathered_batch(decode, bs, model.config.window, "cpu"))
    else:
        from lmfs.inference import PagedBatch
        pos = torch.tensor([9, 12])
        t = torch.tensor(tables, dtype=torch.int32)
        slots = t[torch.arange(2), pos // bs].long() * bs + pos % bs
        logits = paged_forward(model, cache, PagedBatch(torch.tensor([seqs[0][9], seqs[1][12]]), pos, slots,
                                                        block_tables=t, seq_lens=(pos + 1).int()))
    torch.testing.assert_close(logits, torch.stack([full[0][9], full[1][12]]), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Sampling

def test_masked_attention_equals_softmax_and_prefers_the_memory_efficient_kernel_on_cuda():
    """masked_attention (prefill's masked attention) equals softmax(q kᵀ/√d + mask) v written out, GQA included;
    on CUDA it lets SDPA use only the memory-efficient kernel, then the written-out one (cuDNN plans
    every new prefill length anew); elsewhere SDPA chooses as before."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends

    from lmfs.batching import masked_attention, masked_sdpa_preference

    attn = tiny(n_kv_heads=2).blocks[0].attn
    g = torch.Generator().manual_seed(0)
    T, S, hd = 5, 9, BASE["d_model"] // BASE["n_heads"]
    q = torch.randn(1, attn.n_heads, T, hd, generator=g)
    k, v = (torch.randn(1, attn.n_kv_heads, S, hd, generator=g) for _ in range(2))
    allowed = torch.rand(T, S, generator=g) < 0.5
    allowed[:, 0] = True   # every query reads at least one key
    kk, vv = (t.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) @ vv).transpose(1, 2).reshape(1, T, -1)
    torch.testing.assert_close(masked_attention(attn, q, k, v, allowed), expected, atol=1e-5, rtol=1e-5)

    before = _cur_sdpa_kernel_backends(with_priority=True)
    assert type(masked_sdpa_preference(torch.device("cpu"))).__name__ == "nullcontext"
    enabled = (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled,
               torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled)
    was = [f() for f in enabled]
    with masked_sdpa_preference(torch.device("cuda")):
        assert _cur_sdpa_kernel_backends(with_priority=True)[0] == SDPBackend.EFFICIENT_ATTENTION
        assert [f() for f in enabled] == [True, True, False, False]   # no cuDNN, no flash (it takes no mask)
    assert _cur_sdpa_kernel_backends(with_priority=True) == before and [f() for f in enabled] == was


@pytest.mark.gpu
def test_prefill_attention_kernels_gpu():
    """On CUDA a packed prefill attends with variable-length flash attention in 16 bits (one call over
    every sequence, no mask) and with SDPA's memory-efficient kernel and the mask in float32 (never
    cuDNN, whose plan building costs ~12 ms of host time per new length); either way the last
    tokens' logits are the model's own forward's."""
    from torch.profiler import ProfilerActivity, profile

    prompts = random_prompts([5, 11, 7])
    batch = gathered_batch([(p, 0, [1 + 4 * i + j for j in range(4)]) for i, p in enumerate(prompts)], 4, None,
                           "cuda")
    for dtype, kernel, tol in ((torch.bfloat16, "flash_attention", 2e-2), (torch.float32, "efficient_attention", 1e-4)):
        model = tiny(n_kv_heads=2).cuda()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got = paged_forward(model, PagedKVCache(model.config, 16, 4, device="cuda", dtype=dtype), batch)
            own = torch.cat([model(torch.tensor([p], device="cuda"))[0][:, -1] for p in prompts])
        names = {e.name for e in prof.events()}
        assert any(kernel in n for n in names), (dtype, sorted(n for n in names if "attention" in n))
        assert not any("cudnn_attention" in n for n in names)
        torch.testing.assert_close(got.float(), own.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [dict(n_kv_heads=2), dict(n_kv_heads=1, window=6), dict()])
def test_varlen_flash_equals_the_masked_attention_gpu(fields):
    """gathered_attention's flash path against its masked SDPA path on the same batch: sequences
    with and without a cached prefix (the flash kernel's causal mask aligned at the end), GQA/MQA/MHA,
    a sliding window."""
    from lmfs.batching import gathered_attention, varlen_flash_usable

    attn = tiny(**fields).blocks[0].attn
    g = torch.Generator().manual_seed(0)
    hd, block = BASE["d_model"] // BASE["n_heads"], 4
    k_cache, v_cache = (torch.randn(20, block, attn.n_kv_heads, hd, generator=g).cuda().bfloat16() for _ in range(2))
    chunks = [([1] * 5, 0, [1, 2]), ([2] * 3, 8, [3, 4, 5]), ([3] * 9, 4, [6, 7, 8, 9]), ([4], 12, [10, 11, 12, 13])]
    batch = gathered_batch(chunks, block, attn.window, "cuda")
    q = torch.randn(batch.tokens.numel(), attn.n_heads, hd, generator=g).cuda().bfloat16()
    assert varlen_flash_usable(attn, q, batch)
    masked = dataclasses.replace(batch, cu_seq_q=None)
    assert not varlen_flash_usable(attn, q, masked)
    got = gathered_attention(attn, q, k_cache, v_cache, batch)
    expected = gathered_attention(attn, q, k_cache, v_cache, masked)
    assert got.shape == expected.shape == (q.shape[0], attn.n_heads * hd)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_sampling_params_validation():
    for bad, field in [(dict(max_tokens=0), "max_tokens"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                       (dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"), (dict(min_p=2), "min_p"),
                       (dict(repetition_penalty=0), "repetition_penalty"), (dict(stop=[""]), "stop")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    assert SamplingParams(stop="x", stop_token_ids=[3]).stop == ("x",)


def brute_force(z, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, penalty=1.0, seen=()):
    """The filters of lmfs.inference.sampling, one token at a time with Python floats."""
    z = [float(x) for x in z]
    for t in set(seen):
        z[t] = z[t] / penalty if z[t] > 0 else z[t] * penalty
    z = [x / temperature for x in z]
    V = len(z)
    keep = [True] * V
    if top_k is not None:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [x >= kth for x in z]
    if top_p < 1:
        zs = [z[i] if keep[i] else -math.inf for i in range(V)]
        total = sum(math.exp(x) for x in zs)
        before = 0.0
        for i in sorted(range(V), key=lambda i: -zs[i]):
            if before >= top_p:
                keep[i] = False
            before += math.exp(zs[i]) / total
    if min_p > 0:
        zs = [z[i] if keep[i] else -math.inf for i in range(V)]
        total = sum(math.exp(x) for x in zs)
        p = [math.exp(x) / total for x in zs]
        keep = [keep[i] and p[i] >= min_p * max(p) for i in range(V)]
    zs = [z[i] if keep[i] else -math.inf for i in range(V)]
    total = sum(math.exp(x) for x in zs)
    return torch.tensor([math.log(math.exp(x) / total) if x > -math.inf else -math.inf for x in zs])


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
                                dict(penalty=1.5, seen=(0, 2, 2, 5)), dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05)])
def test_each_filter_against_brute_force(kw):
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    names = dict(penalty="repetition_penalty")
    params = SamplingParams(**{names.get(k, k): v for k, v in kw.items() if k != "seen"})
    seen = kw.get("seen", ())
    got = torch.log_softmax(process_logits(logits, [params] * 4, [seen] * 4), dim=-1)
    for row in range(4):
        torch.testing.assert_close(got[row], brute_force(logits[row], **kw), atol=1e-5, rtol=1e-5)
    # Samples come from that distribution: never a filtered token, frequencies close to the probabilities,
    # and the reported log-probs are those of the processed distribution.
    n = 20000
    ids, logprobs = sample(logits[:1].expand(n, -1), [params] * n, None, [seen] * n if seen else None)
    probs = got[0].exp()
    assert probs[ids].min() > 0
    freq = torch.bincount(ids, minlength=12).float() / n
    assert (freq - probs).abs().max() < 0.02      # 4.5 standard deviations at p = 0.5
    torch.testing.assert_close(logprobs, got[0][ids])


def test_greedy_and_seeded_sampling():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    ids, logprobs = sample(logits, [SamplingParams(temperature=0)] * 3)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)
    seeded = SamplingParams(seed=7)
    alone = [sample(logits[1:2], [seeded], [g])[0].item()
             for g in [seeded.generator("cpu")] for _ in range(5)]
    g = seeded.generator("cpu")
    batched = [sample(logits, [SamplingParams(), seeded, SamplingParams(top_k=2)], [None, g, None])[0][1].item()
               for _ in range(5)]
    assert alone == batched


# ---------------------------------------------------------------------------------------------
# The engine

def test_start_then_result_equals_generate_and_holds_the_engine():
    """LLM.start admits and prefills, result() finishes: the same outputs as generate, callbacks
    included; while a start is open the engine refuses other work, and close() frees what it held."""
    model = tiny()
    prompts = random_prompts([3, 9, 17, 5])
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(4)]
    llm = LLM(model)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    finished = []
    started = llm.start(prompts + [[]], params + [SamplingParams()], on_finish=finished.append)
    assert [o.index for o in finished] == [4]                 # the refused request is handed over at once
    assert llm.stats["prefill_steps"] == 1 and llm.stats["decode_steps"] == 0
    with pytest.raises(RuntimeError, match="earlier start"):
        llm.generate(prompts, params)
    with pytest.raises(RuntimeError, match="start"):
        list(llm.stream(prompts, params))
    outs = started.result()
    assert [o.token_ids for o in outs[:4]] == expected and outs[4].finish_reason == "error"
    assert sorted(o.index for o in finished) == [0, 1, 2, 3, 4] and started.result() is outs
    abandoned = llm.start(prompts, params)
    assert llm.allocator.num_used > 0
    abandoned.close()
    assert llm.allocator.num_used == 0 and sorted(llm.scheduler.free_rows) == list(range(llm.scheduler.max_batch_size))
    with pytest.raises(RuntimeError, match="closed"):
        abandoned.result()
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("name", ["mha", "gqa", "mla", "window", "moe", "qknorm_softcaps"])
def test_engine_greedy_equals_generate(name):
    model = tiny(**VARIANTS[name])
    prompts = random_prompts([3, 9, 17, 5, 12])
    reference = greedy_reference(model, prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0)
    for kw in (dict(), dict(block_size=4, kv_cache_tokens=40)):      # the second forces preemptions
        llm = LLM(model, **kw)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == reference
        assert all(o.finish_reason == "length" for o in outs)
        assert (llm.stats["preemptions"] > 0) == bool(kw)
        assert llm.allocator.num_used == 0 and sorted(llm.scheduler.free_rows) == list(range(llm.scheduler.max_batch_size))
    # Log-probs of greedy tokens: the model's log-softmax at those positions.
    full = torch.tensor([prompts[1] + reference[1]])
    logp = torch.log_softmax(model(full)[0][0, len(prompts[1]) - 1:-1], -1)
    torch.testing.assert_close(torch.tensor(outs[1].logprobs), logp.gather(-1, full[0, len(prompts[1]):, None])[:, 0],
                               atol=1e-4, rtol=0)


def test_engine_with_the_triton_decode_kernel():
    """attention="triton" (Triton's interpreter without a GPU) gives the reference path's tokens."""
    model = tiny(n_kv_heads=2).to(DEVICE)
    prompts = random_prompts([3, 7])
    params = SamplingParams(max_tokens=4, temperature=0)
    outs = fast_engine(model, block_size=4, attention="triton").generate(prompts, params)
    assert [o.token_ids for o in outs] == greedy_reference(model, prompts, 4)
    with pytest.raises(ValueError, match="reference"):
        fast_engine(tiny(window=4), attention="triton")


def test_static_batching_equals_generate():
    model = tiny(n_kv_heads=2, positions="learned")
    prompts = random_prompts([3, 11, 6, 8, 2])
    outs = generate_static(model, prompts, SamplingParams(max_tokens=10, temperature=0), batch_size=3)
    assert [o.token_ids for o in outs] == greedy_reference(model, prompts, 10)


def test_prefix_sharing_saves_blocks_and_frees():
    model = tiny()
    shared = random_prompts([16])[0]
    prompts = [shared + [1, 2, 3], shared + [4], shared[:9]]
    params = SamplingParams(max_tokens=5, temperature=0)
    llm = LLM(model, block_size=4)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == greedy_reference(model, prompts, 5)
    # Prompts 2 and 3 reuse prompt 1's blocks 0..3 and 0..1: 16 + 8 tokens not recomputed.
    assert llm.stats["shared_prefix_tokens"] == 24
    assert llm.stats["prefill_tokens"] == sum(map(len, prompts)) - 24
    assert llm.allocator.num_used == 0 and llm.allocator.by_hash == {}
    alone = LLM(model, block_size=4)
    for p in prompts:
        alone.generate([p], params)
    assert llm.stats["peak_kv_blocks"] < sum(math.ceil((len(p) + 5) / 4) for p in prompts)


def test_block_allocator_reference_counts():
    a = BlockAllocator(num_blocks=4, block_size=2)
    assert a.usable == 3
    b = a.allocate()
    key = BlockAllocator.prefix_hashes([1, 2, 3, 4], 2, 2)
    assert key != BlockAllocator.prefix_hashes([9, 2, 3, 4], 2, 2)[1:] and len(key) == 2
    a.register(b, key[0])
    assert a.lookup(key[0]) == b
    a.share(b)
    a.release(b)
    assert a.num_used == 1 and a.lookup(key[0]) == b     # still one user
    a.release(b)
    assert a.num_used == 0 and a.lookup(key[0]) is None  # last user gone: freed and forgotten
    with pytest.raises(RuntimeError, match="released"):
        a.release(b)
    [a.allocate() for _ in range(3)]
    with pytest.raises(RuntimeError, match="no free"):
        a.allocate()


def test_seeded_request_same_alone_or_batched():
    model = tiny()
    prompts = random_prompts([5, 8, 3])
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=123)
    alone = LLM(model).generate([prompts[1]], seeded)[0].token_ids
    batch = LLM(model, block_size=4, kv_cache_tokens=32).generate(
        prompts, [SamplingParams(max_tokens=12), seeded, SamplingParams(max_tokens=9, top_p=0.5)])
    assert batch[1].token_ids == alone


@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_draws_plain_requests_as_sample_does(overlap):
    """A prefill of plain requests (temperature only, seeded or greedy) draws its first tokens on the
    device, and with overlap reads them with the decode step after it: the same tokens and log-probs
    as sample() with the same generators on the uncached model's logits. One-token requests end
    right there; a request with one more token then takes a decode step."""
    model = tiny()
    prompts = random_prompts([5, 8, 3, 6])
    params = [SamplingParams(max_tokens=1, temperature=t, seed=s, logprobs=True)
              for t, s in ((0.9, 1), (0.0, None), (1.3, 7), (0.7, 3))]
    params[3] = dataclasses.replace(params[3], max_tokens=2)
    llm = fast_engine(model, overlap=overlap)
    outs = llm.generate(prompts, params)
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([p]))[0][0, -1] for p in prompts])
    ids, logprobs = sample(logits, params, [p.generator(torch.device("cpu")) for p in params])
    assert [o.token_ids[0] for o in outs] == ids.tolist()
    torch.testing.assert_close(torch.tensor([o.logprobs[0] for o in outs]), logprobs, atol=1e-5, rtol=0)
    assert [len(o.token_ids) for o in outs] == [1, 1, 1, 2] and llm.stats["decode_tokens"] == 1
    assert llm.stats["prefill_steps"] == 1 and llm.allocator.num_used == 0


def test_bad_requests_get_errors_and_others_go_on():
    model = tiny()
    good = random_prompts([6])[0]
    llm = LLM(model, block_size=4, kv_cache_tokens=32)
    outs = llm.generate([[], good, list(range(48)), good + [500]] + [good],
                        [SamplingParams(max_tokens=4, temperature=0)] * 4 + [SamplingParams(max_tokens=40)])
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "error"]
    assert "empty" in outs[0].error and "context_length" in outs[2].error
    assert "vocabulary" in outs[3].error and "kv_cache_tokens" in outs[4].error
    assert outs[1].token_ids == greedy_reference(model, [good], 4)[0] and outs[1].error is None
    with pytest.raises(TypeError, match="tokenizer"):
        llm.generate(["text"])


def test_on_finish_reports_each_request_as_it_finishes():
    """generate's on_finish gets every request's output once, the refused one first, each as soon as
    it finishes: the short request after a few decode steps, the long one after all of them. The
    outputs are the ones returned, and equal those of a call without the hook."""
    model = tiny()
    prompts = [[]] + random_prompts([5, 7])
    params = [SamplingParams(max_tokens=2, temperature=0)] * 2 + [SamplingParams(max_tokens=12, temperature=0)]
    llm = LLM(model)
    seen = []
    outs = llm.generate(prompts, params, on_finish=lambda out: seen.append((out, llm.stats["decode_steps"])))
    assert [(o.index, o.finish_reason, len(o.token_ids)) for o, _ in seen] == [(0, "error", 0), (1, "length", 2),
                                                                                (2, "length", 12)]
    assert seen[1][1] <= 3 < 10 <= seen[2][1]          # decode steps launched when each was reported
    assert [o for o, _ in sorted(seen, key=lambda x: x[0].index)] == outs
    assert all(a is b for a, b in zip(sorted((o for o, _ in seen), key=lambda o: o.index), outs))
    plain = LLM(model).generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in plain]


def test_context_limit_stop_tokens_and_stream():
    model = tiny()
    prompt = random_prompts([40])[0]
    reference = greedy_reference(model, [prompt], 8)[0]
    llm = LLM(model)
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0))[0]
    assert out.token_ids == reference and out.finish_reason == "length"       # 40 + 8 = context_length
    stop = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, stop_token_ids=[reference[3]]))[0]
    assert stop.token_ids == reference[:reference.index(reference[3]) + 1] and stop.finish_reason == "stop"
    events = list(llm.stream([prompt, prompt[:5]], SamplingParams(max_tokens=6, temperature=0)))
    assert [t for i, t, _ in events if i == 0] == reference[:6]
    assert len(events) == 12


def test_stop_strings_with_a_tokenizer():
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    model = tiny(vocab_size=256)
    llm = LLM(model, tokenizer=tok)
    prompt = "hello"
    full = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert full.text == tok.decode(full.token_ids)
    stop = full.text[4:6]
    cut = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    pieces = "".join(p for _, _, p in llm.stream([prompt], SamplingParams(max_tokens=12, temperature=0)))
    assert pieces == full.text


def test_kv_memory_in_use_close_to_cached_tokens():
    model = tiny()
    llm = LLM(model, block_size=4)
    llm.generate(random_prompts([20, 24, 28, 32]), SamplingParams(max_tokens=16, temperature=0))
    s = llm.stats
    assert s["kv_bytes_of_tokens"] <= s["kv_bytes_in_use"] <= 1.1 * s["kv_bytes_of_tokens"]
    assert s["kv_memory_ratio"] == s["kv_bytes_in_use"] / s["kv_bytes_of_tokens"]
    assert s["decode_tokens"] == 4 * 15 and s["prefill_tokens"] == 104


def test_in_step_sampling_equals_sample():
    """Temperature-only requests are drawn inside the decode step (sample_scaled); seeded, they give
    the tokens and log-probs of static batching, which draws through sample()."""
    model = tiny(n_kv_heads=2)
    prompts = random_prompts([4, 9])
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=11), SamplingParams(max_tokens=12, temperature=0,
                                                                                        seed=3)]
    llm = LLM(model, block_size=4)
    outs = llm.generate(prompts, params)
    static = generate_static(model, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in static]
    for a, b in zip(outs, static):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_weights_changed_in_place_are_used_by_the_next_call():
    """RL rollouts: the policy is trained between generate calls; the engine must not keep old weights."""
    model = tiny(n_kv_heads=2).to(DEVICE)
    prompts = random_prompts([5, 8])
    params = SamplingParams(max_tokens=8, temperature=0)
    llm = LLM(model)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    after = [o.token_ids for o in llm.generate(prompts, params)]
    assert after == greedy_reference(model, prompts, 8) and after != before


def test_failed_capture_falls_back_to_decoding_without_graphs(monkeypatch):
    """A decode step that cannot be captured in a CUDA graph decodes without graphs, with a warning
    (the capture is made to fail; on the CPU the plain step then runs as usual)."""
    def broken_capture(self, size, greedy):
        raise RuntimeError("operation not permitted when stream is capturing")
    from lmfs.fast.engine import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "capture", broken_capture)
    model = tiny(n_kv_heads=2)
    prompts = random_prompts([3, 6])
    llm = fast_engine(model)
    llm.runner.cuda_graphs = True
    with pytest.warns(UserWarning, match="decoding without graphs"):
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [o.token_ids for o in outs] == greedy_reference(model, prompts, 5)
    assert llm.runner.cuda_graphs is False and llm.stats["cuda_graphs"] is False


def _first_new(tokens, start):
    """The first token at or after ``start`` that does not occur before it (a stop token met there)."""
    return next(t for i, t in enumerate(tokens) if i >= start and t not in tokens[:i])


def _outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason, o.text, o.logprobs) for o in llm.generate(prompts, params)]


def assert_same_outputs(got, expected):
    """Tokens, finish reasons and texts equal; log-probs close (another batch composition may change
    their last digits)."""
    assert [o[:3] for o in got] == [o[:3] for o in expected]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("in_flight", [1, 2, 3])
@pytest.mark.parametrize("case", ["greedy", "seeded", "stop_tokens", "preemption"])
def test_overlapped_decoding_equals_waiting_for_every_step(case, in_flight):
    """Launching steps n+1..n+k before reading step n's tokens changes nothing: tokens, log-probs and
    finish reasons equal those of the engine that waits for every step (overlap=False), with stop
    tokens found k steps late, requests ending by length sitting out, and preemptions; every block
    and row is free at the end."""
    model = tiny(n_kv_heads=2)
    prompts = random_prompts([3, 9, 17, 5, 12, 7])
    lengths = [4, 16, 9, 12, 1, 7]
    kw = dict(block_size=4)
    if case == "greedy":
        params = [SamplingParams(max_tokens=n, temperature=0) for n in lengths]
    elif case == "seeded":   # in-step draws (temperature only) and host draws (top-k, top-p)
        params = [SamplingParams(max_tokens=n, temperature=0.9, seed=i, top_k=[None, 20][i % 2],
                                 top_p=[1.0, 1.0, 0.8][i % 3]) for i, n in enumerate(lengths)]
    else:
        # seeded draws (greedy outputs of a random model repeat one token), in the step and after it (top-k)
        params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i, top_k=[None, 30][i % 2])
                  for i in range(len(prompts))]
        free = [o.token_ids for o in LLM(model).generate(prompts, params)]
        firsts = [1 + 2 * i if case == "stop_tokens" else 8 + i for i in range(len(prompts))]
        params = [dataclasses.replace(p, stop_token_ids=[_first_new(out, first)]) for p, out, first in
                  zip(params, free, firsts)]   # a stop token each request meets at a different step
        if case == "preemption":
            kw["kv_cache_tokens"] = 40
    waiting = _outputs(fast_engine(model, overlap=False, **kw), prompts, params)
    llm = fast_engine(model, in_flight=in_flight, **kw)
    assert_same_outputs(_outputs(llm, prompts, params), waiting)
    assert llm.stats["overlapped_steps"] > 0 and llm.allocator.num_used == 0
    assert sorted(llm.scheduler.free_rows) == list(range(llm.scheduler.max_batch_size))
    if case == "stop_tokens":
        assert [len(r[0]) for r in waiting] == [free[i].index(_first_new(free[i], firsts[i])) + 1
                                                for i in range(len(prompts))]
        assert llm.stats["decode_tokens"] == sum(len(r[0]) for r in waiting) - len(prompts)   # extra tokens dropped
    if case == "preemption":
        assert llm.stats["preemptions"] > 0
    with pytest.raises(ValueError, match="in_flight"):
        fast_engine(model, in_flight=0)


def test_overlapped_stop_strings_and_streaming_equal_waiting():
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    model = tiny(vocab_size=256)
    prompts = ["hello", "a much longer prompt", "xy"]
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(len(prompts))]
    full = LLM(model, tokenizer=tok).generate(prompts, sampled)
    params = [dataclasses.replace(p, stop=[o.text[2 + 3 * i:4 + 3 * i]]) for i, (p, o) in enumerate(zip(sampled, full))]
    engines = fast_engine(model, tokenizer=tok, overlap=False), fast_engine(model, tokenizer=tok)
    waiting, overlapped = (_outputs(llm, prompts, params) for llm in engines)
    assert_same_outputs(overlapped, waiting)
    assert {r[1] for r in waiting} == {"stop"} and len({len(r[0]) for r in waiting}) > 1
    streams = [list(llm.stream(prompts, sampled)) for llm in engines]
    for i in range(len(prompts)):   # each request's tokens and text pieces in the same order
        assert [e for e in streams[1] if e[0] == i] == [e for e in streams[0] if e[0] == i]
        assert "".join(p for j, _, p in streams[1] if j == i) == full[i].text


def test_fused_decode_option():
    """fused_decode: off by default on the CPU; True runs lmfs.kernels.decode.FusedDecode (Triton's
    interpreter on the CPU) and gives the reference tokens, or, where that module or the model's
    support is missing, a clear error."""
    model = tiny(n_kv_heads=2)
    prompts = random_prompts([3, 7])
    params = SamplingParams(max_tokens=4, temperature=0)
    llm = LLM(model)
    llm.generate(prompts, params)
    assert llm.stats["fused_decode"] is False and llm.stats["cuda_graphs"] is False
    with pytest.raises(ValueError, match="fused_decode"):
        fast_engine(model, fused_decode="yes")
    try:
        from lmfs.kernels.decode import FusedDecode
    except ImportError:
        with pytest.raises(ImportError, match="fused_decode"):
            fast_engine(model, fused_decode=True)
        return
    fused = fast_engine(model, fused_decode=True)
    assert [o.token_ids for o in fused.generate(prompts, params)] == greedy_reference(model, prompts, 4)
    assert fused.stats["fused_decode"] is True
    mla = tiny(**VARIANTS["mla"])
    assert FusedDecode.supports(mla) is not None
    with pytest.raises(ValueError, match="fused_decode"):
        fast_engine(mla, fused_decode=True)


def test_fused_decode_under_autocast_copies_the_weights_only_after_updates():
    """fast_engine(autocast=bf16, fused_decode=True) on float32 weights: the fused forward holds bf16 copies
    of the projection weights (the parameters keep their storage), each generate call first copies
    the parameters updated in place since the call before and nothing otherwise, and its outputs
    equal a fresh engine's on the updated model."""
    pytest.importorskip("lmfs.kernels.decode")
    model = tiny(n_kv_heads=2)
    where = [p.data_ptr() for p in model.parameters()]
    prompts = random_prompts([3, 7, 5])
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=True)
    options = dict(block_size=4, autocast=torch.bfloat16, fused_decode=True)
    llm = fast_engine(model, **options)
    assert llm.runner._fused.dtype == torch.bfloat16 and [p.data_ptr() for p in model.parameters()] == where
    assert fast_engine(model, fused_decode=True).runner._fused.dtype is None   # no autocast: nothing to copy
    per_update = 7 * model.config.n_layers   # q, k, v, o, gate, up, down of each layer
    first = llm.generate(prompts, params)
    assert llm.stats["fused_decode"] and llm.runner._fused.weight_copies == per_update   # made once, when built
    assert _same(llm.generate(prompts, params), first) and llm.runner._fused.weight_copies == per_update
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    updated = llm.generate(prompts, params)
    assert llm.runner._fused.weight_copies == 2 * per_update
    assert not _same(updated, first)
    assert _same(updated, fast_engine(model, **options).generate(prompts, params))


def _same(a, b) -> bool:
    return [(o.token_ids, o.logprobs) for o in a] == [(o.token_ids, o.logprobs) for o in b]


# ---------------------------------------------------------------------------------------------
# GPU: CUDA graphs and the Triton decode kernel give the same tokens as the plain path

@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_cuda_graphs_and_kernel_match_plain_gpu(attention):
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([3, 9, 17, 5, 12, 30, 1])
    params = SamplingParams(max_tokens=16, temperature=0)
    plain = fast_engine(model, cuda_graphs=False, attention="reference", fused_decode=False).generate(prompts, params)
    for kv in (None, 64):   # 64 tokens: preemptions while graphs replay
        graphs = fast_engine(model, cuda_graphs=True, attention=attention, block_size=4, kv_cache_tokens=kv,
                     fused_decode=False)
        outs = graphs.generate(prompts, params)
        assert graphs._graphs, "no CUDA graph was captured"
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for a, b in zip(outs, plain):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("in_flight", [1, 3])
def test_sampling_through_cuda_graphs_matches_plain_gpu(in_flight):
    """Sampled decoding through CUDA graphs, whose uniforms are drawn straight into the graph's input
    buffer and whose tokens come back through a ring of pinned buffers, gives the tokens and
    log-probs of the plain path from the same seed (the same random numbers, read back intact with up
    to three steps in flight)."""
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([3, 9, 17, 5, 12, 30, 1, 8])
    params = SamplingParams(max_tokens=24, temperature=1.0, logprobs=True)
    torch.manual_seed(3)
    plain = fast_engine(model, cuda_graphs=False, attention="reference", fused_decode=False).generate(prompts, params)
    graphs = fast_engine(model, cuda_graphs=True, attention="reference", fused_decode=False, in_flight=in_flight)
    for _ in range(2):   # the second run draws into the graphs captured by the first
        torch.manual_seed(3)
        outs = graphs.generate(prompts, params)
        assert graphs._graphs and graphs.stats["overlapped_steps"] > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for a, b in zip(outs, plain):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_uniforms_drawn_into_a_buffer_are_the_fresh_ones():
    from lmfs.inference.sampling import draw_uniforms

    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    generators = [p.generator("cpu") for p in params]
    torch.manual_seed(0)
    fresh = draw_uniforms(params, generators, "cpu")
    buffer = torch.full((5,), -1.0)
    generators = [p.generator("cpu") for p in params]
    torch.manual_seed(0)
    drawn = draw_uniforms(params, generators, "cpu", out=buffer[:3])
    assert drawn.data_ptr() == buffer.data_ptr() and torch.equal(drawn, fresh) and (buffer[3:] == -1).all()
    assert fresh[1] == torch.rand((), generator=torch.Generator().manual_seed(5))   # the seeded row's own


@pytest.mark.gpu
def test_pinned_staging_ring_uploads_exactly_gpu():
    """Uploads through the pinned ring arrive intact: many in a row while the device is busy (the ring
    wraps and must wait for copies still reading a region), one larger than the ring (it grows), and
    each dtype and shape upload is given (lists, numpy arrays, bools, empty)."""
    import numpy as np

    from lmfs.batching import PinnedStaging, upload

    ring = PinnedStaging(torch.device("cuda"), nbytes=1 << 12)
    busy = torch.randn(2048, 2048, device="cuda")
    rng = np.random.default_rng(0)
    sent, got = [], []
    for i in range(64):
        if i % 8 == 0:
            busy = busy @ busy / 50              # keep the device busy, so copies are still in flight
        a = rng.integers(-2**40, 2**40, size=int(rng.integers(1, 300)))
        sent.append(a)
        got.append(ring.upload(torch.as_tensor(a)))
    big = rng.standard_normal(5000).astype(np.float32)          # 20 kB > the 4 kB ring
    got_big = ring.upload(torch.as_tensor(big))
    assert ring.buffer.numel() >= 2 * big.nbytes
    for a, g in zip(sent, got):
        assert g.device.type == "cuda" and g.tolist() == a.tolist()
    assert got_big.cpu().numpy().tobytes() == big.tobytes()
    assert upload([[1, 2], [3, 4]], "cuda").tolist() == [[1, 2], [3, 4]]
    assert upload(np.array([True, False]), "cuda", torch.bool).tolist() == [True, False]
    assert upload([0.5], "cuda", torch.float32).dtype == torch.float32
    assert upload([], "cuda").numel() == 0


@pytest.mark.gpu
def test_graphs_use_weights_changed_in_place_gpu():
    """The CUDA graphs (and the fused forward's merged weights, where it runs) read weights updated
    in place; new weight tensors (a reload) make the engine capture again."""
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([5, 8, 3])
    params = SamplingParams(max_tokens=10, temperature=0)
    llm = LLM(model)
    assert llm.cuda_graphs
    assert [o.token_ids for o in llm.generate(prompts, params)] == greedy_reference(model, prompts, 10)
    assert llm.stats["cuda_graphs"] and llm.stats["decode_device_seconds"] > 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert [o.token_ids for o in llm.generate(prompts, params)] == greedy_reference(model, prompts, 10)
    for name, p in list(model.named_parameters()):   # new tensors at new addresses
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, torch.nn.Parameter(p.detach().clone() * 1.1))
    assert [o.token_ids for o in llm.generate(prompts, params)] == greedy_reference(model, prompts, 10)


@pytest.mark.gpu
def test_overlapped_graphs_equal_waiting_gpu():
    """On the GPU, where the overlap is real (pinned copies, events): same tokens as waiting for
    every step, with stop tokens, seeds and preemptions; and with the fused decode forward (on by
    default where it supports the model) the same greedy tokens."""
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([3, 9, 17, 5, 12, 30, 1])
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(len(prompts))]
    free = [o.token_ids for o in LLM(model).generate(prompts, params)]
    params = [dataclasses.replace(p, stop_token_ids=[_first_new(out, 1 + i)]) for i, (p, out) in
              enumerate(zip(params, free))]
    for kv in (None, 64):
        waiting = _outputs(fast_engine(model, block_size=4, kv_cache_tokens=kv, overlap=False), prompts, params)
        for in_flight in (1, 2):
            llm = fast_engine(model, block_size=4, kv_cache_tokens=kv, in_flight=in_flight)
            assert_same_outputs(_outputs(llm, prompts, params), waiting)
            assert llm.stats["overlapped_steps"] > 0 and llm.allocator.num_used == 0
    fused = fast_engine(model, fused_decode="auto")
    outs = fused.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    assert [o.token_ids for o in outs] == greedy_reference(model, prompts, 16)
    from lmfs.kernels.decode import FusedDecode
    assert fused.stats["fused_decode"] == (FusedDecode.supports(model) is None) and fused.stats["cuda_graphs"]


@pytest.mark.gpu
def test_engine_bf16_seeded_gpu():
    model = tiny().cuda().to(torch.bfloat16)
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5)
    prompts = random_prompts([4, 7, 9])
    a = LLM(model).generate(prompts, params)
    b = LLM(model).generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 20 for o in a)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_step_moves_nothing_between_host_and_device(temperature):
    # The decode step is what a CUDA graph captures (greedy and temperature sampling both run in it).
    model = tiny()
    llm = fast_engine(model, cuda_graphs=False)
    step, found = llm.runner._step, set()

    def watched(*args, **kwargs):
        with HostTransfers() as mode:
            out = step(*args, **kwargs)
        found.update(mode.found)
        return out

    llm.runner._step = watched
    outs = llm.generate(random_prompts([5, 9, 3]), SamplingParams(max_tokens=6, temperature=temperature, seed=0))
    assert all(len(o.token_ids) == 6 for o in outs)
    assert not found, f"the decode step copies between host and device (fails under CUDA graph capture): {found}"


# ---------------------------------------------------------------------------------------------
# Autocast: rollouts in the dtype a training step under autocast computes in

def _forward_logprobs(model, prompts, outs, autocast):
    """log p of each generated token under the model's own (uncached) forward, in ``autocast`` (None: off)."""
    device = next(model.parameters()).device
    result = []
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt + out.token_ids], device=device)
        with torch.no_grad(), torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                                             enabled=autocast is not None):
            logits = model(seq[:, :-1])[0][0, len(prompt) - 1:].float()
        result.append(torch.log_softmax(logits, -1).gather(-1, seq[0, len(prompt):, None])[:, 0].cpu())
    return result


@pytest.mark.parametrize("variant", ["gqa", "mla", "fused"])
def test_engine_autocast_matches_the_forward_under_autocast(variant):
    """LLM(autocast=bf16) on float32 weights: the KV cache holds bf16 and the sampled tokens' log-probs
    are those of the model's own forward under the same autocast (to bf16 precision), not the fp32
    ones; prefill, the plain decode step, the gathered path (MLA) and the fused decode forward."""
    model = tiny(**VARIANTS["mla" if variant == "mla" else "gqa"])
    prompts = random_prompts([3, 11, 6])
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=4, logprobs=True)
    if variant == "fused":
        pytest.importorskip("lmfs.kernels.decode")
    llm = fast_engine(model, block_size=4, autocast=torch.bfloat16, fused_decode=variant == "fused")
    assert all(t.dtype == torch.bfloat16 for t in llm.cache.k) and next(model.parameters()).dtype == torch.float32
    outs = llm.generate(prompts, params)
    assert llm.stats["fused_decode"] is (variant == "fused")
    engine = [torch.tensor(o.logprobs) for o in outs]
    same = _forward_logprobs(model, prompts, outs, torch.bfloat16)
    fp32 = _forward_logprobs(model, prompts, outs, None)
    gap_same = max((a - b).abs().max().item() for a, b in zip(engine, same))
    gap_fp32 = max((a - b).abs().max().item() for a, b in zip(engine, fp32))
    # bf16 keeps 8 bits: log-probs near -4.5 agree to a few units of 2^-8 · 4.5 ≈ 0.02, here to ~1e-3;
    # the fp32 forward differs by about as much, and it must differ at all (autocast applied)
    assert gap_same < 1e-2, gap_same
    assert gap_fp32 > 1e-4, "the engine's log-probs equal the fp32 forward's: autocast did not apply"
    with pytest.raises(ValueError, match="autocast"):
        LLM(model, autocast=torch.int8)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_decode", [False, "auto"])
def test_autocast_graphs_cast_the_weights_of_each_replay_gpu(fused_decode):
    """With autocast the captured decode step casts the float32 weights at every replay: after an
    in-place update (an optimizer step) the log-probs are those of the updated model's forward under
    the same autocast, with and without the fused decode forward."""
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([5, 8, 3, 12, 20])
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=2, logprobs=True)
    llm = fast_engine(model, autocast=torch.bfloat16, fused_decode=fused_decode)
    assert all(t.dtype == torch.bfloat16 for t in llm.cache.k)
    before = None
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert llm.stats["cuda_graphs"] and llm.runner._graphs.graphs
        engine = [torch.tensor(o.logprobs) for o in outs]
        same = _forward_logprobs(model, prompts, outs, torch.bfloat16)
        assert max((a - b).abs().max().item() for a, b in zip(engine, same)) < 2e-2
        if before is not None:
            assert [o.token_ids for o in outs] != before, "the update changed nothing: the test tests nothing"
        before = [o.token_ids for o in outs]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
