"""Deduplication: hashes, exact dedup, the Bloom filter, MinHash + LSH, clusters (lecture 14)."""

import math
from collections import Counter

import numpy as np
import pytest

from lmfs.data.dedup import (BloomFilter, MinHasher, UnionFind, band_keys, bucket_edges, candidate_pairs,
                             dedup_lines, estimate_jaccard, exact_dedup, jaccard, lsh_params, near_duplicates,
                             planted_corpus, s_curve, shingle_sets, text_hashes)
from lmfs.data.ngram import ngram_hashes, word_hashes


def test_word_hashes_are_per_word_and_stable():
    docs = ["the cat  sat\non the mat", "", "The cat\tsat", "naïve café 東京"]
    h, offsets = word_hashes(docs)
    words = [w for d in docs for w in d.split()]
    assert offsets.tolist() == [0, 6, 6, 9, 12]
    by_word = {}
    for w, x in zip(words, h.tolist()):
        by_word.setdefault(w, set()).add(x)
    assert all(len(v) == 1 for v in by_word.values())                 # a word always hashes the same
    assert len({next(iter(v)) for v in by_word.values()}) == len(by_word)  # different words differ
    again, _ = word_hashes(list(reversed(docs)))                       # independent of batch and position
    assert set(again.tolist()) == set(h.tolist())


def test_ngram_hashes_stay_inside_documents():
    docs = ["a b c d e f", "a b", "c d e f g h", "a b c d e"]
    g, offsets = ngram_hashes(*word_hashes(docs), 5)
    assert np.diff(offsets).tolist() == [2, 1, 2, 1]
    # "a b c d e" is the first 5-gram of doc 0 and all of doc 3; "b c d e f" is not in doc 2.
    assert g[0] == g[5] and g[1] not in g[3:5]
    short, _ = ngram_hashes(*word_hashes(["a b"]), 5)
    assert short[0] == g[2]


def test_exact_dedup_keeps_exactly_one_copy():
    rng = np.random.default_rng(0)
    pool = [f"document {i} " * (i % 3 + 1) for i in range(30)]
    docs = [pool[i] for i in rng.integers(0, 30, 500)]
    keep = exact_dedup(docs)
    kept = Counter(d for d, k in zip(docs, keep) if k)
    assert set(kept) == set(docs) and all(n == 1 for n in kept.values())
    first = {d: docs.index(d) for d in set(docs)}
    assert set(np.flatnonzero(keep).tolist()) == set(first.values())  # the first copy is the one kept
    assert len(np.unique(text_hashes(pool))) == len(pool)


def test_dedup_lines_removes_repeated_lines_only():
    docs = ["menu\nhello world\n\nfooter", "menu\nsomething new\n\nfooter", "unique"]
    out, removed = dedup_lines(docs)
    assert out == ["menu\nhello world\n\nfooter", "something new\n", "unique"] and removed == 2


def test_bloom_filter_sizes_no_false_negatives_and_fp_rate():
    n, p = 20_000, 0.01
    bloom = BloomFilter(n, p)
    assert bloom.m == math.ceil(-n * math.log(p) / math.log(2) ** 2) and bloom.k == 7
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, n, dtype=np.uint64)
    bloom.add(keys)
    assert bloom.contains(keys).all()                               # never a false negative
    others = rng.integers(0, 2**63, 200_000, dtype=np.uint64)
    fp = bloom.contains(others).mean()
    theory = bloom.theoretical_fp_rate()
    assert abs(fp - theory) < 4 * math.sqrt(theory * (1 - theory) / len(others)) + 1e-4, (fp, theory)
    assert abs(theory - p) < 0.1 * p


def test_bloom_add_new_streams_first_copies():
    bloom = BloomFilter(1000, 1e-4)
    keys = np.array([5, 7, 5, 9], dtype=np.uint64)
    assert bloom.add_new(keys).tolist() == [True, True, False, True]
    assert bloom.add_new(np.array([7, 11], dtype=np.uint64)).tolist() == [False, True]


def test_minhash_estimates_jaccard_within_standard_error():
    docs, source = planted_corpus(600, seed=1)
    sigs = MinHasher(num_perm=128).signatures(docs)
    sets = shingle_sets(docs)
    pairs = [(int(s), i) for i, s in enumerate(source) if s >= 0]
    J = np.array([jaccard(sets[a], sets[b]) for a, b in pairs])
    est = np.array([estimate_jaccard(sigs[a], sigs[b]) for a, b in pairs])
    z = (est - J) / np.sqrt(np.maximum(J * (1 - J), 1e-3) / 128)
    assert len(pairs) > 100 and J.min() < 0.5 < J.max()
    assert np.mean(np.abs(z) < 2) > 0.9 and abs(z.mean()) < 0.3     # unbiased, spread as the theory says
    unrelated = estimate_jaccard(sigs[source < 0][:-1], sigs[source < 0][1:])
    assert unrelated.mean() < 0.01


def test_minhash_matches_brute_force_definition():
    mh = MinHasher(num_perm=16, ngram=2)
    docs = ["a b c d", "x y", "", "one"]
    x, offsets = mh.shingles(docs)
    sig = mh.sign(x, offsets)
    for d in range(len(docs)):
        xs = x[offsets[d]:offsets[d + 1]].astype(np.uint64)
        want = [min(((int(a) * int(v) + int(b)) % 2**32 for v in xs), default=MinHasher.EMPTY)
                for a, b in zip(mh.a, mh.b)]
        assert sig[d].tolist() == want
    assert (mh.signatures(docs) == sig).all()


def test_minhash_agrees_with_datasketch():
    datasketch = pytest.importorskip("datasketch")
    docs, source = planted_corpus(150, seed=2, copy_fraction=0.6)
    sets = shingle_sets(docs)
    ours = MinHasher(128).signatures(docs)
    theirs = []
    for s in sets:
        m = datasketch.MinHash(num_perm=128)
        m.update_batch([x.encode() for x in s])
        theirs.append(m)
    pairs = [(int(s), i) for i, s in enumerate(source) if s >= 0]
    J = np.array([jaccard(sets[a], sets[b]) for a, b in pairs])
    err_ours = np.abs([estimate_jaccard(ours[a], ours[b]) for a, b in pairs] - J).mean()
    err_theirs = np.abs([theirs[a].jaccard(theirs[b]) for a, b in pairs] - J).mean()
    assert err_ours < 1.5 * err_theirs + 0.01, (err_ours, err_theirs)


def test_lsh_params_and_s_curve():
    from datasketch.lsh import _optimal_param

    for t in (0.5, 0.8, 0.9):
        assert lsh_params(t, 128) == _optimal_param(t, 128, 0.5, 0.5)
    assert s_curve(1.0, 16, 8) == 1.0 and s_curve(0.0, 16, 8) == 0.0
    assert abs(s_curve(0.8, 16, 8) - (1 - (1 - 0.8**8) ** 16)) < 1e-12


def test_candidate_pairs_equal_brute_force_and_s_curve_holds():
    docs, _ = planted_corpus(300, seed=3, copy_fraction=0.5, max_edit=0.3)
    sigs = MinHasher(128).signatures(docs)
    keys = band_keys(sigs, 16, 8)
    pairs = set(map(tuple, candidate_pairs(keys).tolist()))
    brute = {(i, j) for i in range(len(docs)) for j in range(i + 1, len(docs)) if (keys[i] == keys[j]).any()}
    assert pairs == brute
    # Measured collision rate of signature bands vs the S-curve, from the signatures' own agreement.
    rows = sigs.reshape(len(sigs), 16, 8)
    i, j = np.triu_indices(len(docs), 1)
    band_equal = (rows[i] == rows[j]).all(axis=2)                  # (pairs, bands)
    assert ((band_equal.any(1)) == (keys[i] == keys[j]).any(1)).all()


def test_union_find_matches_scipy():
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    rng = np.random.default_rng(0)
    n = 300
    edges = rng.integers(0, n, (200, 2))
    uf = UnionFind(n)
    for a, b in edges.tolist():
        uf.union(a, b)
    _, theirs = connected_components(coo_matrix((np.ones(len(edges)), edges.T), shape=(n, n)), directed=False)
    labels = uf.labels()
    same_ours = labels[:, None] == labels[None, :]
    assert (same_ours == (theirs[:, None] == theirs[None, :])).all()
    assert (labels <= np.arange(n)).all()                           # named by the smallest member


def test_near_duplicates_clusters_and_representative():
    docs, source = planted_corpus(400, seed=4, copy_fraction=0.4, max_edit=0.02)  # copies with J > ~0.8
    sigs = MinHasher(128).signatures(docs)
    result = near_duplicates(sigs, threshold=0.7, bands=32, rows=4)  # S(0.8) = 1 - 1e-8
    copies = np.flatnonzero(source >= 0)
    assert not result.keep[copies].any()                            # every copy is removed ...
    assert result.keep[source < 0].all()                            # ... every original kept
    assert (result.labels[copies] == result.labels[source[copies]]).all()
    edges = bucket_edges(band_keys(sigs, result.bands, result.rows))
    assert (edges[:, 0] < edges[:, 1]).all()
