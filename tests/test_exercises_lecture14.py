"""The checkers of lecture 14's exercises accept right answers and reject wrong ones."""

import math

import numpy as np
import pytest

from lmfs.exercises.lecture14 import check_bloom_size, check_candidate_probability, check_minhash_signature


def bloom_size(n, p):
    m = math.ceil(-n * math.log(p) / math.log(2) ** 2)
    return m, max(1, round(m / n * math.log(2)))


def minhash_signature(x, a, b):
    x, a, b = x.astype(np.uint64), a.astype(np.uint64), b.astype(np.uint64)  # products need 64 bits
    return ((np.outer(a, x) + b[:, None]) % np.uint64(2**32)).min(axis=1)


def test_bloom_size_checker():
    assert check_bloom_size(bloom_size) == 5
    with pytest.raises(AssertionError, match="bloom_size: wrong result"):   # log base 2 instead of ln 2 squared
        check_bloom_size(lambda n, p: (math.ceil(-n * math.log2(p)), bloom_size(n, p)[1]))
    with pytest.raises(AssertionError, match="bloom_size: wrong result"):   # k from the wrong ratio
        check_bloom_size(lambda n, p: (bloom_size(n, p)[0], max(1, round(n / bloom_size(n, p)[0] * math.log(2)))))


def test_minhash_signature_checker():
    assert check_minhash_signature(minhash_signature) == 4
    with pytest.raises(AssertionError, match="minhash_signature: wrong result"):   # max instead of min
        check_minhash_signature(lambda x, a, b: (np.outer(a, x) + b[:, None]).max(axis=1))
    with pytest.raises(AssertionError, match="minhash_signature: wrong result"):   # forgets b
        check_minhash_signature(lambda x, a, b: np.outer(a, x).min(axis=1))


def test_candidate_probability_checker():
    assert check_candidate_probability(lambda s, b, r: 1 - (1 - s**r) ** b) == 24
    with pytest.raises(AssertionError, match="candidate_probability: wrong result"):   # rows and bands swapped
        check_candidate_probability(lambda s, b, r: 1 - (1 - s**b) ** r)
