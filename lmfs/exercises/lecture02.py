"""Checkers for the exercises of lecture 02 (PyTorch and resource accounting).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with :mod:`lmfs.accounting`, whose formulas the lecture checks against torch's FLOP counter and a
hand computation.
"""

from __future__ import annotations

from collections.abc import Callable

from lmfs.accounting import activation_memory_per_layer, flops_per_token
from lmfs.exercises import check
from lmfs.nn import TransformerConfig


def _configs():
    yield TransformerConfig(vocab_size=1000, context_length=64, d_model=64, n_layers=2, n_heads=4), 64
    yield TransformerConfig(vocab_size=32000, context_length=1024, d_model=768, n_layers=12, n_heads=12,
                            tie_embeddings=False), 1024
    yield TransformerConfig(vocab_size=500, context_length=128, d_model=96, n_layers=3, n_heads=6, ffn="gelu",
                            n_kv_heads=2), 100  # GQA and a plain MLP; shorter than the context


def check_flops_per_token(answer: Callable[[TransformerConfig, int], int]) -> int:
    """``answer(config, seq_len)``: forward FLOPs per token of ``TransformerLM(config)`` (weight
    matmuls and the output head, plus attention's two matmuls over the full ``T × T`` scores),
    compared with :func:`lmfs.accounting.flops_per_token`."""
    return check("flops_per_token", answer, flops_per_token, _configs(),
                 describe=lambda case: f"d_model={case[0].d_model}, ffn={case[0].ffn}, "
                                       f"n_kv_heads={case[0].kv_heads}, seq_len={case[1]}")


def check_activation_memory(answer: Callable[..., float]) -> int:
    """``answer(batch_size, seq_len, d_model, n_heads, recompute)``: bytes one layer keeps, by the
    closed form of Korthikanti et al. (2022), with ``recompute`` one of ``"none"``,
    ``"selective"``, ``"full"``; compared with :func:`lmfs.accounting.activation_memory_per_layer`."""
    cases = [(b, s, h, a, r) for b, s, h, a in [(1, 2048, 12288, 96), (8, 1024, 768, 12), (4, 4096, 4096, 32)]
             for r in ("none", "selective", "full")]
    return check("activation_memory", answer,
                 lambda b, s, h, a, r: activation_memory_per_layer(b, s, h, a, recompute=r), cases)
