"""The checkers of lecture 10's exercises accept right answers and reject wrong ones."""

import pytest
import torch

from lmfs.exercises.lecture10 import check_kv_cache_bytes, check_residual_distribution, check_top_p_filter


def kv_cache_bytes(c, batch_size, seq_len, dtype):
    per_layer = c.kv_latent_dim if c.attention == "mla" else 2 * c.kv_heads * c.head_dim
    return c.n_layers * per_layer * batch_size * seq_len * torch.empty((), dtype=dtype).element_size()


def top_p_filter(logits, p):
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def test_kv_cache_bytes_checker():
    assert check_kv_cache_bytes(kv_cache_bytes) == 8
    with pytest.raises(AssertionError, match="kv_cache_bytes: wrong result.*n_kv_heads=2"):  # GQA ignored
        check_kv_cache_bytes(lambda c, b, s, dtype: kv_cache_bytes(c, b, s, dtype) * c.n_heads // c.kv_heads)
    with pytest.raises(AssertionError, match="kv_cache_bytes: wrong result.*mla"):  # MLA cached as full K/V
        check_kv_cache_bytes(lambda c, b, s, dtype: c.n_layers * 2 * c.kv_heads * c.head_dim * b * s
                             * torch.empty((), dtype=dtype).element_size())


def test_top_p_filter_checker():
    assert check_top_p_filter(top_p_filter) == 5
    with pytest.raises(AssertionError, match="top_p_filter: wrong result"):  # mass *including* the token
        check_top_p_filter(lambda logits, p: logits.masked_fill(
            torch.zeros_like(logits, dtype=torch.bool).scatter(
                -1, torch.softmax(logits, -1).sort(-1, descending=True).indices,
                torch.softmax(logits, -1).sort(-1, descending=True).values.cumsum(-1) >= p), float("-inf")))
    with pytest.raises(AssertionError, match="top_p_filter: wrong result"):  # forgets to filter
        check_top_p_filter(lambda logits, p: logits)


def residual(p, q):
    r = (p - q).clamp(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def test_residual_distribution_checker():
    assert check_residual_distribution(residual) == 5
    with pytest.raises(AssertionError, match="residual: wrong result"):  # not normalised
        check_residual_distribution(lambda p, q: (p - q).clamp(min=0))
    with pytest.raises(AssertionError, match="residual: wrong result"):  # draws from the target itself
        check_residual_distribution(lambda p, q: p)
