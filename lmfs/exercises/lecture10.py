"""Checkers for the exercises of lecture 10 (inference).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with an independent answer: the bytes a real :class:`lmfs.inference.KVCache` allocates, the nucleus
filter of :mod:`lmfs.nn.generate`, and the speculative-sampling rule of
:mod:`lmfs.inference.speculative`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.exercises import check
from lmfs.nn import TransformerConfig, top_p_filter

# Attention variants that differ in what a token leaves in the cache: MHA, GQA, MQA, MLA.
_KV_CONFIGS = [
    dict(vocab_size=64, context_length=64, d_model=64, n_layers=2, n_heads=4),
    dict(vocab_size=64, context_length=64, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2),
    dict(vocab_size=64, context_length=64, d_model=64, n_layers=4, n_heads=8, n_kv_heads=1),
    dict(vocab_size=64, context_length=64, d_model=64, n_layers=2, n_heads=4, attention="mla", kv_latent_dim=24),
]


def _kv_cases():
    for i, fields in enumerate(_KV_CONFIGS):
        for batch, length, dtype in [(1, 16, torch.float32), (3, 40, torch.bfloat16)]:
            yield TransformerConfig(**fields), batch + i, length - i, dtype


def _kv_reference(config: TransformerConfig, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
    """The bytes of the buffers a contiguous cache of that shape really allocates."""
    from lmfs.inference import KVCache

    return KVCache(config, batch_size, seq_len, device="cpu", dtype=dtype).nbytes


def check_kv_cache_bytes(answer: Callable[[TransformerConfig, int, int, torch.dtype], int]) -> int:
    """``kv_cache_bytes(config, batch_size, seq_len, dtype)``: bytes of the KV cache of ``batch_size``
    sequences of ``seq_len`` tokens for a ``TransformerLM(config)`` stored in ``dtype`` (MHA/GQA/MQA:
    keys and values of ``n_kv_heads`` heads per layer; MLA: the ``kv_latent_dim`` latent only),
    compared with the buffers of a real :class:`lmfs.inference.KVCache`."""

    def describe(case):
        c, batch, length, dtype = case
        return (f"(attention={c.attention!r}, n_layers={c.n_layers}, n_heads={c.n_heads}, "
                f"n_kv_heads={c.kv_heads}, head_dim={c.head_dim}, kv_latent_dim={c.kv_latent_dim}, "
                f"batch_size={batch}, seq_len={length}, {dtype})")

    return check("kv_cache_bytes", answer, _kv_reference, _kv_cases(), describe=describe)


def _top_p_cases():
    generator = torch.Generator().manual_seed(0)
    for shape, p in [((1, 10), 0.5), ((4, 32), 0.9), ((3, 7), 1.0), ((2, 50), 0.05)]:
        yield torch.randn(shape, generator=generator) * 3, p
    yield torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 0.9  # 3rd kept: mass before it 0.88 < 0.9, with it 0.97


def check_top_p_filter(answer: Callable[[torch.Tensor, float], torch.Tensor]) -> int:
    """``top_p_filter(logits, p)``: logits ``(B, V)`` -> the same logits with every token outside
    the nucleus set to ``-inf`` (the smallest set of most likely tokens whose probability reaches
    ``p``; the most likely token is always kept), compared with :func:`lmfs.nn.top_p_filter`."""
    return check("top_p_filter", answer, top_p_filter, _top_p_cases())


def _residual_cases():
    generator = torch.Generator().manual_seed(2)
    for N, V, sharpness in [(1, 5, 1.0), (4, 16, 3.0), (3, 50, 0.3)]:
        p = torch.softmax(torch.randn(N, V, generator=generator) * sharpness, dim=-1)
        q = torch.softmax(torch.randn(N, V, generator=generator) * sharpness, dim=-1)
        yield p, q
    p = torch.softmax(torch.randn(2, 8, generator=generator), dim=-1)
    yield p, p.clone()                                                   # identical: no residual mass
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])      # a draft that never proposes some tokens
    yield torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]), q


def check_residual_distribution(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``residual(p, q)``: target and draft distributions ``(N, V)`` -> ``norm(max(0, p - q))`` per row
    (``p`` itself where ``p == q``), compared with
    :func:`lmfs.inference.speculative.residual_distribution`; then the point of it: accepting a
    draft ``x ~ q`` with probability ``min(1, p(x)/q(x))`` and otherwise drawing from the answer's
    residual must emit tokens distributed as ``p`` (the sum over both branches, computed exactly)."""
    from lmfs.inference.speculative import residual_distribution

    n = check("residual", answer, residual_distribution, _residual_cases(), atol=1e-6)

    def emitted(p, q):
        accepted = torch.minimum(p, q)                                   # q(x) · min(1, p(x)/q(x))
        return accepted + (1 - accepted.sum(-1, keepdim=True)) * answer(p, q)

    check("residual: emitted distribution == p", emitted, lambda p, q: p, _residual_cases(), atol=1e-6)
    return n
