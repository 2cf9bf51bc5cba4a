"""Timing helpers of ``python -m lmfs.benchmarks inference`` and its Hugging Face peers: wall time
of a call, decode tokens/s, and Hugging Face ``generate`` on lmfs's weights (batch-1 decode and one
static batch of a request trace)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from lmfs.bench.timing import synchronize
from lmfs.nn import TransformerLM, to_hf_llama


def wall(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def decode_rate(generate: Callable[[int], object], n: int, repeats: int, device: torch.device) -> float:
    """Decode tokens/s of ``generate(k)`` (one request, ``k`` new tokens): ``n / (t(n+1) - t(1))``
    with medians over ``repeats`` calls, after one untimed call of each length."""
    generate(1)
    generate(n + 1)
    first = statistics.median(wall(lambda: generate(1), device) for _ in range(repeats))
    full = statistics.median(wall(lambda: generate(n + 1), device) for _ in range(repeats))
    return n / max(full - first, 1e-9)


def hf_llama(model: TransformerLM):
    """Hugging Face ``LlamaForCausalLM`` holding ``model``'s weights, on its device and dtype, ready
    to ``generate`` (no EOS: every request runs to its length)."""
    from transformers import LlamaForCausalLM

    state, hf_config = to_hf_llama(model)
    weight = model.tok_emb.weight
    with torch.device(weight.device):
        hf = LlamaForCausalLM._from_config(hf_config, attn_implementation="sdpa", dtype=weight.dtype)
    hf.load_state_dict(state)
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def hf_decode(model, prompt, sizes, device, roofline, kwargs, greedy, name) -> dict:
    hf = hf_llama(model)
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, **kwargs)

    rate = decode_rate(generate, sizes.decode_tokens, sizes.repeats, device)
    greedy[name] = generate(sizes.decode_tokens)[0, len(prompt):].tolist()
    del hf
    return {"tokens_per_s": rate, "of_roofline": rate / roofline}


def hf_batch(model: TransformerLM, requests: list[tuple[list[int], int]], device: torch.device) -> dict:
    """One static batch through Hugging Face ``generate``: prompts left-padded to the longest, the
    batch runs to the longest output; only each request's own output length counts."""
    hf = hf_llama(model)
    width = max(len(p) for p, _ in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(requests):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    longest = max(o for _, o in requests)
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        seconds = wall(lambda: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                            min_new_tokens=longest, do_sample=False, disable_compile=True),
                        device)
    del hf
    useful = sum(o for _, o in requests)
    return {"seconds": seconds, "tokens_per_s": useful / seconds,
            "padding_waste": 1 - useful / (len(requests) * longest),
            "method": f"measured: one batch of the trace's first {len(requests)} requests, "
                      "its tokens/s stands for the trace"}
