"""Checkers for the exercises of lecture 03 (architectures and hyperparameters).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with ``lmfs.nn`` (the modules the lecture trains, or the closed-form :func:`lmfs.nn.count_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lmfs.exercises import check
from lmfs.nn import GatedMLP, RMSNorm, TransformerConfig, count_params


def _rms_norm_cases():
    generator = torch.Generator().manual_seed(0)
    for shape, eps, scale in [((5, 8), 1e-5, 1.0), ((2, 3, 16), 1e-6, 100.0), ((4, 7), 1e-2, 1e-3)]:
        x = torch.randn(*shape, generator=generator) * scale  # large and tiny inputs: eps matters
        weight = torch.randn(shape[-1], generator=generator)
        yield x, weight, eps


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def check_rms_norm(rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> int:
    """``rms_norm(x, weight, eps)``: ``x`` ``(..., d)``, ``weight`` ``(d,)`` -> ``(..., d)``,
    compared with :class:`lmfs.nn.RMSNorm` holding the same ``weight`` and ``eps``."""
    return check("rms_norm", rms_norm, _rms_norm_reference, _rms_norm_cases())


def _swiglu_cases():
    generator = torch.Generator().manual_seed(1)
    for batch, d_model, d_ff in [((3,), 8, 16), ((2, 5), 16, 48), ((1, 1), 4, 4)]:
        x = torch.randn(*batch, d_model, generator=generator)
        w_gate = torch.randn(d_ff, d_model, generator=generator) / d_model ** 0.5
        w_up = torch.randn(d_ff, d_model, generator=generator) / d_model ** 0.5
        w_down = torch.randn(d_model, d_ff, generator=generator) / d_ff ** 0.5
        yield x, w_gate, w_up, w_down


def _swiglu_reference(x, w_gate, w_up, w_down):
    d_ff, d_model = w_gate.shape
    mlp = GatedMLP(d_model, d_ff, "swiglu")
    with torch.no_grad():
        for layer, weight in [(mlp.gate, w_gate), (mlp.up, w_up), (mlp.down, w_down)]:
            layer.weight.copy_(weight)
        return mlp(x)


def check_swiglu(swiglu: Callable[..., torch.Tensor]) -> int:
    """``swiglu(x, w_gate, w_up, w_down)``: ``x`` ``(..., d_model)``; weights in PyTorch's layout,
    ``w_gate`` and ``w_up`` ``(d_ff, d_model)``, ``w_down`` ``(d_model, d_ff)`` -> ``(..., d_model)``,
    compared with :class:`lmfs.nn.GatedMLP` (``"swiglu"``) holding the same weights."""
    return check("swiglu", swiglu, _swiglu_reference, _swiglu_cases())


# LLaMA-like configs (the TransformerConfig defaults: pre-norm RMSNorm, SwiGLU, RoPE, no biases)
# that differ in the fields the exercise asks about.
_LLAMA_LIKE = [
    dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4),
    dict(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2),
    dict(vocab_size=777, d_model=96, n_layers=1, n_heads=6, n_kv_heads=1, d_ff=200),
    dict(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, d_ff=11_008, tie_embeddings=False),
    dict(vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14_336,
         tie_embeddings=False),
]


def check_param_count(param_count: Callable[[TransformerConfig], int]) -> int:
    """``param_count(config)`` for LLaMA-like configs (any vocabulary, width, depth, heads, KV heads,
    ``d_ff``, tied or untied embeddings), compared with :func:`lmfs.nn.count_params`."""
    cases = [(TransformerConfig(**fields),) for fields in _LLAMA_LIKE]
    return check("param_count", param_count, count_params, cases,
                 describe=lambda case: ", ".join(f"{f.name}={getattr(case[0], f.name)}"
                                                 for f in dataclasses.fields(case[0])
                                                 if f.name in _LLAMA_LIKE[-1] or f.name == "n_kv_heads"))
