"""DSIR: data selection with importance resampling over hashed n-gram features (Xie et al., 2023).

We want samples from the target distribution ``p`` (say, Wikipedia and books) but can only draw
from the raw distribution ``q`` (the web). Importance resampling: weigh each raw document by
``w(x) = p(x) / q(x)`` and resample the raw pool with probabilities proportional to ``w``; the
resampled set is distributed (approximately) like ``p``.

``p`` and ``q`` are unknowable for text, so DSIR models both in a cheap feature space: a document
is its bag of hashed word n-grams (unigrams and bigrams in ``n_buckets`` buckets), and each
distribution is a multinomial over the buckets fitted by counting (add-``alpha`` smoothed). Then

    log w(x) = Σ_j c_j(x) · (log p_j - log q_j)        (c_j(x): count of bucket j in x)

one sparse dot product per document. Resampling ``k`` documents without replacement with
probabilities proportional to ``w`` uses the Gumbel-top-k trick: add independent Gumbel noise to
``log w`` and keep the ``k`` largest.

>>> dsir = DSIR(n_buckets=256).fit(["the cat sat"] * 5, ["buy now", "the cat", "cheap pills"])
>>> [int(i) for i in dsir.resample(["buy now cheap", "the cat sat down"], 1, seed=0)]
[1]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmfs.data.ngram import bucket_counts, hashed_features


class DSIR:
    """Importance weights of raw documents toward a target, from hashed n-gram bag models."""

    def __init__(self, n_buckets: int = 10_000, ngrams: Sequence[int] = (1, 2), alpha: float = 1.0):
        self.n_buckets, self.ngrams, self.alpha = n_buckets, tuple(ngrams), alpha

    def counts(self, texts: Sequence[str]):
        """Sparse ``(len(texts), n_buckets)`` bucket counts."""
        return bucket_counts(*hashed_features(texts, self.n_buckets, self.ngrams), self.n_buckets)

    def distribution(self, texts: Sequence[str]) -> np.ndarray:
        """The add-``alpha`` smoothed multinomial over buckets that ``texts`` fit, shape ``(n_buckets,)``."""
        total = np.asarray(self.counts(texts).sum(axis=0)).ravel() + self.alpha
        return total / total.sum()

    def fit(self, target: Sequence[str], raw: Sequence[str]) -> DSIR:
        """Fit ``p`` on the target texts and ``q`` on (a sample of) the raw texts."""
        self.p, self.q = self.distribution(target), self.distribution(raw)
        self.log_ratio = np.log(self.p) - np.log(self.q)
        return self

    def log_importance(self, texts: Sequence[str]) -> np.ndarray:
        """``log w(x) = Σ_j c_j(x) (log p_j - log q_j)`` for each text, shape ``(len(texts),)``."""
        if not hasattr(self, "log_ratio"):
            raise RuntimeError("DSIR is not fitted: call fit(target_texts, raw_texts) first")
        return self.counts(texts) @ self.log_ratio

    def resample(self, texts: Sequence[str], k: int, seed: int = 0,
                 log_weights: np.ndarray | None = None) -> np.ndarray:
        """Indices of ``k`` texts drawn without replacement with probability proportional to ``w``."""
        if not 0 <= k <= len(texts):
            raise ValueError(f"cannot draw k={k} documents without replacement from {len(texts)}")
        logw = self.log_importance(texts) if log_weights is None else np.asarray(log_weights)
        gumbel = np.random.default_rng(seed).gumbel(size=len(logw))
        return np.argsort(-(logw + gumbel), kind="stable")[:k]


def kl_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """``KL(p || q) = Σ p log(p / q)`` in nats, for two distributions over the same buckets."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    mask = p > 0
    return float((p[mask] * np.log(p[mask] / q[mask])).sum())
