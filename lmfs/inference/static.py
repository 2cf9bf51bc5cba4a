"""Static batching: the baseline that continuous batching (:class:`~lmfs.inference.LLM`) is compared with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmfs.inference.kv_cache import KVCache
from lmfs.inference.runner import forward_cached, pack
from lmfs.inference.sampling import SamplingParams, sample
from lmfs.inference.scheduler import Request, RequestOutput, as_token_lists, finish, params_list


@torch.no_grad()
def generate_static(model, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                    batch_size: int | None = None, tokenizer=None) -> list[RequestOutput]:
    """Generate with static batching and the contiguous :class:`~lmfs.inference.KVCache`.

    Prompts are taken ``batch_size`` at a time (all at once by default); each batch is left-padded
    to its longest prompt, prefilled, then decoded one token per step for every row until its
    *last* request finishes: rows that finished early keep computing padding. That waste is what
    continuous batching (:class:`LLM`) removes. Invalid requests get ``finish_reason="error"``.
    Returns one :class:`RequestOutput` per prompt, in order.
    """
    device = next(model.parameters()).device
    ctx = model.config.context_length
    token_lists = as_token_lists(prompts, tokenizer)
    requests = [Request(i, p, sp, device) for i, (p, sp) in
                enumerate(zip(token_lists, params_list(params, len(token_lists))))]
    valid = []
    for r in requests:
        n = len(r.prompt)
        if n == 0 or n >= ctx:
            r.finish_reason, r.error = "error", ("empty prompt" if n == 0 else
                                                 f"prompt of {n} tokens does not fit context_length={ctx}")
        else:
            valid.append(r)
    batch_size = batch_size or max(len(valid), 1)
    for first in range(0, len(valid), batch_size):
        batch = valid[first:first + batch_size]
        longest = max(len(r.prompt) for r in batch)
        pad = torch.tensor([longest - len(r.prompt) for r in batch], device=device)
        idx = torch.tensor([[0] * (longest - len(r.prompt)) + r.prompt for r in batch], device=device)
        max_len = min(ctx, longest + max(r.params.max_tokens for r in batch))
        cache = KVCache.for_model(model, len(batch), max_len, pad=pad)
        logits = forward_cached(model, idx, cache)[:, -1]
        while True:
            params = [r.params for r in batch]
            previous = [r.tokens for r in batch] if any(p.repetition_penalty != 1 for p in params) else None
            next_ids, logprobs = sample(logits, params, [r.generator for r in batch], previous)
            ids, lps = pack(next_ids, logprobs).tolist()
            for r, t, lp in zip(batch, ids, lps):
                if r.finish_reason is None:
                    r.out.append(int(t))
                    r.logprobs.append(lp)
                    finish(r, ctx, tokenizer)
            if all(r.finish_reason is not None for r in batch) or cache.length >= max_len:
                break
            logits = forward_cached(model, next_ids[:, None], cache)[:, -1]
        for r in batch:   # the cache ran out before max_tokens: the context is full
            r.finish_reason = r.finish_reason or "length"
    return [r.output(tokenizer) for r in requests]
