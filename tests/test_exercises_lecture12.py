"""The checkers of lecture 12's exercises accept right answers and reject wrong ones."""

import math

import pytest
import torch.nn.functional as F

from lmfs.exercises.lecture12 import check_bits_per_byte, check_choose, check_pass_at_k


def pass_at_k(n, c, k):
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bits_per_byte(logits, targets, text):
    return F.cross_entropy(logits.double(), targets, reduction="sum").item() / math.log(2) / len(text.encode())


def choose(logprobs, n_tokens, n_bytes, norm):
    lengths = {"raw": [1] * len(logprobs), "token": n_tokens, "byte": n_bytes}[norm]
    values = [lp / n for lp, n in zip(logprobs, lengths)]
    return values.index(max(values))


def test_pass_at_k_checker():
    assert check_pass_at_k(pass_at_k) == 168 + 5
    with pytest.raises(AssertionError, match="pass_at_k: wrong result"):  # the biased estimate 1 - (1 - c/n)^k
        check_pass_at_k(lambda n, c, k: 1 - (1 - c / n) ** k)
    with pytest.raises(AssertionError, match="pass_at_k: wrong result"):  # plain success rate, k ignored
        check_pass_at_k(lambda n, c, k: c / n)


def test_bits_per_byte_checker():
    assert check_bits_per_byte(bits_per_byte) == 4
    with pytest.raises(AssertionError, match="bits_per_byte: wrong result"):  # nats, not bits
        check_bits_per_byte(lambda lg, t, text: bits_per_byte(lg, t, text) * math.log(2))
    with pytest.raises(AssertionError, match="bits_per_byte: wrong result.*Bär"):  # characters, not bytes
        check_bits_per_byte(lambda lg, t, text: bits_per_byte(lg, t, text) * len(text.encode()) / len(text))
    with pytest.raises(AssertionError, match="bits_per_byte: wrong result"):  # mean over tokens, per token
        check_bits_per_byte(lambda lg, t, text: F.cross_entropy(lg.double(), t).item() / math.log(2))


def test_choose_checker():
    assert check_choose(choose) == 12
    with pytest.raises(AssertionError, match="choose: wrong result"):  # always the raw sum
        check_choose(lambda lp, nt, nb, norm: choose(lp, nt, nb, "raw"))
    with pytest.raises(AssertionError, match="choose: wrong result"):  # the last of equal scores
        check_choose(lambda lp, nt, nb, norm: len(lp) - 1 - choose(lp[::-1], nt[::-1], nb[::-1], norm))
    with pytest.raises(AssertionError, match="choose: wrong result"):  # multiplies instead of divides
        check_choose(lambda lp, nt, nb, norm: choose([x * n * n for x, n in zip(lp, nt)], nt, nb, norm)
                     if norm == "token" else choose(lp, nt, nb, norm))


def test_bits_per_byte_cases_use_multibyte_text():
    # The check must tell bytes from characters: at least one case has non-ASCII text.
    from lmfs.exercises.lecture12 import _bpb_cases

    assert any(len(text.encode()) != len(text) for _, _, text in _bpb_cases())
