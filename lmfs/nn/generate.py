"""Sampling text from a language model, one token at a time.

Deliberately simple: no KV cache, so every step re-runs the model on the whole (cropped)
context. That costs ``O(T²)`` work per sequence instead of ``O(T)``, and makes the loop easy to
read; the lecture on inference adds the cache.
"""

from __future__ import annotations

import torch

from lmfs.nn.functional import softmax


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (``(..., V)``), set the rest to ``-inf``.

    Logits tied with the ``k``-th largest are kept too, so a row may keep more than ``k``.
    """
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches ``p``.

    Sort each row by probability, descending; a token is kept when the mass *before* it is
    still below ``p``. The most likely token is therefore always kept. Others become ``-inf``.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)  # undo the sort


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``idx`` ``(B, T)`` by ``max_new_tokens`` sampled tokens; returns ``(B, T + n)``.

    Each step feeds the last ``context_length`` tokens to ``model`` (anything returning
    ``(logits, loss)`` with a ``config.context_length``), divides the last position's logits by
    ``temperature``, applies ``top_k`` then ``top_p``, and samples. ``temperature == 0`` is
    greedy decoding (argmax; the filters cannot change it). Pass a seeded ``generator`` for
    reproducible samples. The model's train/eval mode is left as it is.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    context_length = model.config.context_length
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -context_length:])
        logits = logits[:, -1, :]  # (B, V): only the next token matters
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                logits = top_k_filter(logits, top_k)
            if top_p is not None:
                logits = top_p_filter(logits, top_p)
            probs = softmax(logits.float(), dim=-1)
            next_id = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, next_id], dim=1)
    return idx
