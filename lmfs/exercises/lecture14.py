"""Checkers for the exercises of lecture 14 (filtering and deduplication).

Each ``check_*`` calls the learner's function on several cases and compares the result with
:mod:`lmfs.data.dedup` (the Bloom filter's sizing, MinHash signatures) or :mod:`lmfs.data.dsir`
(importance weights), or with the closed form of the LSH S-curve.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmfs.data.dedup import BloomFilter, MinHasher, s_curve
from lmfs.exercises import check


def check_bloom_size(answer: Callable[[int, float], tuple[int, int]]) -> int:
    """``bloom_size(n, p)`` -> ``(m, k)``: the bits and hash functions of a Bloom filter holding
    ``n`` keys at false-positive rate ``p`` (``m`` rounded up, ``k`` rounded, at least 1),
    compared with :class:`lmfs.data.dedup.BloomFilter`."""
    cases = [(1000, 0.01), (1, 0.5), (10**6, 1e-3), (12_345, 0.2), (500, 1e-6)]
    return check("bloom_size", answer, lambda n, p: (BloomFilter(n, p).m, BloomFilter(n, p).k), cases)


def _minhash_cases():
    rng = np.random.default_rng(0)
    for n_shingles, num_perm in [(1, 4), (10, 8), (300, 16), (50, 128)]:
        x = rng.integers(0, 2**32, n_shingles, dtype=np.uint64).astype(np.uint32)
        a = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32) | np.uint32(1)
        b = rng.integers(0, 2**32, num_perm, dtype=np.uint64).astype(np.uint32)
        yield x, a, b


def _minhash_reference(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> list[int]:
    mh = MinHasher(num_perm=len(a))
    mh.a, mh.b = a, b
    return mh.sign(x, np.array([0, len(x)]))[0].tolist()


def check_minhash_signature(answer: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]) -> int:
    """``minhash_signature(x, a, b)``: 32-bit shingle hashes ``x`` of one document, ``P`` hash
    parameters ``a``, ``b`` (``uint32``) -> the ``P`` values ``min_x (a_p·x + b_p) mod 2^32``,
    compared with :meth:`lmfs.data.dedup.MinHasher.sign`."""
    return check("minhash_signature", lambda x, a, b: [int(v) for v in answer(x, a, b)], _minhash_reference,
                 _minhash_cases(), describe=lambda c: f"{len(c[0])} shingles, {len(c[1])} permutations")


def check_candidate_probability(answer: Callable[[float, int, int], float]) -> int:
    """``candidate_probability(s, bands, rows)``: the probability that two documents of Jaccard
    similarity ``s`` share at least one LSH band, compared with :func:`lmfs.data.dedup.s_curve`."""
    cases = [(s, b, r) for s in (0.0, 0.3, 0.5, 0.8, 0.95, 1.0) for b, r in ((16, 8), (20, 5), (1, 1), (128, 1))]
    return check("candidate_probability", answer, lambda s, b, r: float(s_curve(s, b, r)), cases, atol=1e-9, rtol=1e-9)
