"""The checkers of lecture 03's exercises accept right answers and reject wrong ones."""

import pytest
import torch
import torch.nn.functional as F

from lmfs.exercises.lecture03 import check_param_count, check_rms_norm, check_swiglu


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def param_count(c):
    d, hd = c.d_model, c.head_dim
    attn = 2 * d * c.n_heads * hd + 2 * d * c.kv_heads * hd
    return c.n_layers * (attn + 3 * d * c.ffn_dim + 2 * d) + d + c.vocab_size * d * (2 - c.tie_embeddings)


def test_rms_norm_checker():
    assert check_rms_norm(rms_norm) == 3
    with pytest.raises(AssertionError, match="rms_norm: wrong result"):  # eps outside the root
        check_rms_norm(lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w)
    with pytest.raises(AssertionError, match="rms_norm: wrong result"):  # LayerNorm is not RMSNorm
        check_rms_norm(lambda x, w, eps: F.layer_norm(x, x.shape[-1:], w, None, eps))


def test_swiglu_checker():
    assert check_swiglu(swiglu) == 3
    with pytest.raises(AssertionError, match="swiglu: wrong result"):  # gate and up swapped
        check_swiglu(lambda x, g, u, d: swiglu(x, u, g, d))
    with pytest.raises(AssertionError, match="swiglu: your function raised"):  # weights not transposed
        check_swiglu(lambda x, g, u, d: (F.silu(x @ g) * (x @ u)) @ d)


def test_param_count_checker():
    assert check_param_count(param_count) == 5
    with pytest.raises(AssertionError, match="param_count: wrong result.*n_kv_heads"):  # ignores GQA
        check_param_count(lambda c: param_count(c) + 2 * c.n_layers * c.d_model * (c.n_heads - c.kv_heads)
                          * c.head_dim)
    with pytest.raises(AssertionError, match="param_count: wrong result"):  # forgets the final norm
        check_param_count(lambda c: param_count(c) - c.d_model)
