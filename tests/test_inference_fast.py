"""The plain runner (LLM(model)) and the fast one (lmfs.fast.fast_engine) give the same tokens.

Same scheduler, same model: the fast runner's device state, steps in flight, CUDA graphs, step
kernels and fused forward change the speed, never the tokens, greedy or sampled from the same seeds
(preemption included). On the CPU the fast runner runs its steps in flight (and the fused forward
in Triton's interpreter); the GPU tests (marker ``gpu``) add CUDA graphs and the step kernels."""

import dataclasses

import pytest
import torch
from test_inference import VARIANTS, random_prompts, tiny

from lmfs.fast import FastRunner, fast_engine
from lmfs.inference import LLM, SamplingParams


def tokens(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


def cases():
    greedy = SamplingParams(max_tokens=12, temperature=0)
    sampled = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, top_k=[None, 20][i % 2]) for i in range(5)]
    return {"greedy": greedy, "sampled": sampled}


@pytest.mark.parametrize("name", ["gqa", "mla", "window", "moe", "qknorm_softcaps"])
def test_plain_and_fast_runners_give_the_same_tokens(name):
    """Greedy and seeded sampling (temperature only: drawn inside the fast step; top-k: after it),
    with a roomy KV cache and with one that forces preemptions."""
    model = tiny(**VARIANTS[name])
    prompts = random_prompts([3, 9, 17, 5, 12])
    for kw in (dict(), dict(block_size=4, kv_cache_tokens=40)):
        for case, params in cases().items():
            plain = LLM(model, **kw)
            fast = fast_engine(model, **kw)
            expected = tokens(plain, prompts, params)
            assert tokens(fast, prompts, params) == expected, (name, kw, case)
            assert (plain.stats["preemptions"] > 0) == (fast.stats["preemptions"] > 0) == bool(kw)
            if name != "mla":   # MLA's decode batches are built from the host's tokens: nothing overlaps
                assert fast.stats["overlapped_steps"] > 0
            assert plain.stats["overlapped_steps"] == 0 and plain.stats["decode_tokens"] == fast.stats["decode_tokens"]


def test_plain_and_fast_runners_give_the_same_stream_and_stop_strings():
    from lmfs.tokenization import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    model = tiny(vocab_size=256)
    prompts = ["hello", "a much longer prompt", "xy"]
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(len(prompts))]
    full = LLM(model, tok).generate(prompts, sampled)
    params = [dataclasses.replace(p, stop=[o.text[2 + 3 * i:4 + 3 * i]]) for i, (p, o) in enumerate(zip(sampled, full))]
    plain, fast = LLM(model, tok), fast_engine(model, tok)
    a, b = plain.generate(prompts, params), fast.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [(o.token_ids, o.text, o.finish_reason) for o in b]
    assert {o.finish_reason for o in a} == {"stop"}
    streams = [list(llm.stream(prompts, sampled)) for llm in (plain, fast)]
    for i in range(len(prompts)):
        assert [e for e in streams[0] if e[0] == i] == [e for e in streams[1] if e[0] == i]


def test_fused_fast_runner_gives_the_plain_tokens_on_the_cpu():
    """The fused forward (Triton's interpreter on the CPU) inside the fast runner: the plain tokens."""
    pytest.importorskip("lmfs.kernels.decode")
    model = tiny(n_kv_heads=2)
    prompts = random_prompts([3, 7])
    params = SamplingParams(max_tokens=4, temperature=0)
    fast = fast_engine(model, fused_decode=True)
    assert tokens(fast, prompts, params) == tokens(LLM(model), prompts, params)
    assert fast.stats["fused_decode"] is True


def test_fast_options_belong_to_the_fast_runner():
    model = tiny()
    with pytest.raises(TypeError, match="fast_engine"):
        LLM(model, cuda_graphs=False)
    with pytest.raises(TypeError, match="unexpected"):
        LLM(model, bogus=1)
    with pytest.raises(ValueError, match="cuda_graphs"):
        FastRunner(model, cuda_graphs="yes")
    with pytest.raises(ValueError, match="in_flight"):
        FastRunner(model, in_flight=0)
    with pytest.raises(ValueError, match="same model"):
        LLM(tiny(seed=1), runner=FastRunner(model))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_fast_runners_give_the_same_tokens_gpu(dtype):
    """On a GPU: CUDA graphs, steps in flight and the step kernels (greedy) with the plain forward,
    the same tokens as the plain runner, greedy and sampled from the same seeds, preemption included."""
    model = tiny(n_kv_heads=2).cuda().to(dtype)
    prompts = random_prompts([3, 9, 17, 5, 12])
    for kw in (dict(), dict(block_size=4, kv_cache_tokens=40)):
        for case, params in cases().items():
            expected = tokens(LLM(model, **kw), prompts, params)
            fast = fast_engine(model, attention="reference", fused_decode=False, **kw)
            assert tokens(fast, prompts, params) == expected, (kw, case)
            assert fast.stats["cuda_graphs"] and fast.stats["overlapped_steps"] > 0


@pytest.mark.gpu
def test_fast_engine_defaults_give_the_plain_greedy_tokens_gpu():
    """The fast engine as it comes on a GPU (fused forward, Triton paged attention, CUDA graphs) in
    float32: the plain runner's greedy tokens over a short run."""
    model = tiny(n_kv_heads=2).cuda()
    prompts = random_prompts([3, 9, 17, 5, 12])
    params = SamplingParams(max_tokens=8, temperature=0)
    fast = fast_engine(model)
    assert tokens(fast, prompts, params) == tokens(LLM(model), prompts, params)
    assert fast.stats["cuda_graphs"] and fast.stats["fused_decode"]
