"""The checkers of lecture 04's exercises accept right answers and reject wrong ones."""

import pytest
import torch

from lmfs.exercises.lecture04 import check_active_params, check_gates, check_switch_loss


def switch_loss(probs, counts):
    return probs.shape[-1] * (counts.float() / counts.sum() * probs.mean(0)).sum()


def gates(logits, k, renormalize):
    if renormalize:
        top = logits.topk(k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, top.indices, torch.softmax(top.values, dim=-1))
    top = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    return torch.zeros_like(logits).scatter(-1, top.indices, top.values)


def active_params(c):
    d = c.d_model
    expert = 3 * d * c.moe_dim
    moe = (0 if c.moe_router == "hash" else d * c.moe_experts) + (c.moe_top_k + c.moe_shared_experts) * expert
    ffns = sum(moe if c.is_moe_layer(i) else 3 * d * c.ffn_dim for i in range(c.n_layers))
    return c.n_layers * (4 * d * d + 2 * d) + ffns + d + c.vocab_size * d * (1 if c.tie_embeddings else 2)


def test_switch_loss_checker():
    assert check_switch_loss(switch_loss) == 5
    with pytest.raises(AssertionError, match="switch_loss: wrong result"):  # forgets the factor E
        check_switch_loss(lambda p, c: switch_loss(p, c) / p.shape[-1])
    with pytest.raises(AssertionError, match="switch_loss: wrong result"):  # probabilities summed, not averaged
        check_switch_loss(lambda p, c: p.shape[-1] * (c.float() / c.sum() * p.sum(0)).sum())


def test_gates_checker():
    assert check_gates(gates) == 8
    with pytest.raises(AssertionError, match="gates: wrong result"):  # always renormalizes
        check_gates(lambda logits, k, renormalize: gates(logits, k, True))
    with pytest.raises(AssertionError, match="gates: wrong result"):  # bottom k instead of top k
        check_gates(lambda logits, k, renormalize: gates(-logits, k, renormalize))


def test_active_params_checker():
    assert check_active_params(active_params) == 5
    with pytest.raises(AssertionError, match="active_params: wrong result.*moe_shared_experts=2"):
        check_active_params(lambda c: active_params(c) - sum(c.is_moe_layer(i) for i in range(c.n_layers))
                            * c.moe_shared_experts * 3 * c.d_model * c.moe_dim)  # forgets the shared experts
    with pytest.raises(AssertionError, match="active_params: wrong result"):  # counts every expert
        check_active_params(lambda c: active_params(c) + sum(c.is_moe_layer(i) for i in range(c.n_layers))
                            * (c.moe_experts - c.moe_top_k) * 3 * c.d_model * c.moe_dim)
