"""Checkers for the exercises of lecture 04 (mixture of experts).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with :mod:`lmfs.nn.moe` (the router and the Switch loss the lecture trains with) or with the
closed-form parameter count of :func:`lmfs.accounting.param_count`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.accounting import param_count
from lmfs.exercises import check
from lmfs.nn import TransformerConfig
from lmfs.nn.moe import Router, switch_loss


def _switch_cases():
    generator = torch.Generator().manual_seed(0)
    for N, E, skew in [(16, 4, 0.0), (64, 8, 3.0), (5, 3, 1.0), (32, 16, 0.5)]:
        logits = torch.randn(N, E, generator=generator) + skew * torch.arange(E)  # skew: later experts win
        probs = torch.softmax(logits, dim=-1)
        counts = torch.bincount(probs.argmax(-1), minlength=E)
        yield probs, counts
    yield torch.full((8, 4), 0.25), torch.tensor([2, 2, 2, 2])  # uniform: the minimum, 1


def check_switch_loss(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``switch_loss(probs, counts)``: ``probs`` ``(N, E)`` router probabilities, ``counts`` ``(E,)``
    assignments per expert -> the scalar ``E · Σ_i f_i · P_i``, compared with
    :func:`lmfs.nn.moe.switch_loss`."""
    return check("switch_loss", answer, switch_loss, _switch_cases())


def _gates_cases():
    generator = torch.Generator().manual_seed(1)
    for N, E, k in [(6, 4, 1), (10, 8, 2), (3, 5, 5), (7, 16, 4)]:
        logits = torch.randn(N, E, generator=generator) * 2
        for renormalize in (False, True):
            yield logits, k, renormalize


def _gates_reference(logits: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
    """The gate matrix of lmfs's router: a Router whose projection is the identity sees ``logits``."""
    N, E = logits.shape
    router = Router(E, E, k, "topk_softmax" if renormalize else "softmax_topk")
    with torch.no_grad():
        router.proj.weight.copy_(torch.eye(E))
        routing = router(logits)
    gates = torch.zeros(N, E)
    gates[routing.token, routing.expert] = routing.weight
    return gates


def check_gates(answer: Callable[[torch.Tensor, int, bool], torch.Tensor]) -> int:
    """``gates(logits, k, renormalize)``: router ``logits`` ``(N, E)`` -> ``(N, E)`` gate weights,
    zero outside each token's top ``k`` experts. ``renormalize=False``: softmax over all experts,
    then keep the top ``k`` ("softmax_topk"); ``True``: softmax over the top ``k`` logits only
    ("topk_softmax"). Compared with :class:`lmfs.nn.moe.Router`."""
    return check("gates", answer, _gates_reference, _gates_cases())


# MoE configs that differ in what the count depends on: experts, top-k, expert width (fine-grained),
# shared experts, MoE every n-th layer, the router's parameters (none for hashing), tied embeddings.
_MOE_CONFIGS = [
    dict(vocab_size=1000, d_model=64, n_layers=2, n_heads=4, moe_experts=8, moe_top_k=1),
    dict(vocab_size=500, d_model=64, n_layers=4, n_heads=4, moe_experts=8, moe_top_k=2, moe_every=2),
    dict(vocab_size=256, d_model=32, n_layers=3, n_heads=4, moe_experts=16, moe_top_k=4,
         moe_expert_dim=24, moe_shared_experts=2),
    dict(vocab_size=300, d_model=48, n_layers=2, n_heads=4, moe_experts=4, moe_top_k=2, moe_router="hash",
         tie_embeddings=False),
    # DeepSeek-V3's MoE shape on a small stack: 256 fine-grained experts, 8 active, 1 shared.
    dict(vocab_size=129_280, d_model=7168, n_layers=4, n_heads=128, moe_experts=256, moe_top_k=8,
         moe_expert_dim=2048, moe_shared_experts=1, tie_embeddings=False),
]


def check_active_params(answer: Callable[[TransformerConfig], int]) -> int:
    """``active_params(config)``: the parameters one token uses in a LLaMA-like MoE
    ``TransformerLM`` (multi-head attention, SwiGLU experts, no biases), compared with
    :func:`lmfs.accounting.param_count` with ``active=True``."""
    cases = [(TransformerConfig(**fields),) for fields in _MOE_CONFIGS]

    def describe(case):
        c = case[0]
        return (f"TransformerConfig(d_model={c.d_model}, n_layers={c.n_layers}, moe_experts={c.moe_experts}, "
                f"moe_top_k={c.moe_top_k}, moe_every={c.moe_every}, moe_expert_dim={c.moe_dim}, "
                f"moe_shared_experts={c.moe_shared_experts}, moe_router={c.moe_router!r}, "
                f"tie_embeddings={c.tie_embeddings})")

    return check("active_params", answer, lambda c: param_count(c, active=True), cases, describe=describe)
