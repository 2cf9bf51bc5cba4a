"""Numbers about scores: pass@k, bootstrap confidence intervals, comparing two models.

**pass@k.** Draw ``n >= k`` samples per problem, count the ``c`` that pass. The chance that at
least one of ``k`` samples drawn without replacement from those ``n`` passes is
``1 - C(n-c, k) / C(n, k)``, an unbiased estimate of pass@k (Chen et al. 2021). The binomials
overflow for large ``n``; the same quantity is the product ``1 - Π_{i=n-c+1}^{n} (1 - k/i)``.
(The naive estimate ``1 - (1 - c/n)^k`` is biased: it treats the samples as drawn with replacement.)

**Bootstrap.** A benchmark is a sample of items; a score on it is an estimate. Resampling the
items with replacement and recomputing the score shows how much it would move with another
draw of items: the middle 95% of those scores is a percentile confidence interval.

**Paired comparison.** Two models scored on the *same* items: their per-item differences
remove the items' shared difficulty, so a paired test sees differences an unpaired one misses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al. 2021).

    >>> round(pass_at_k(10, 1, 1), 12), pass_at_k(10, 0, 5), pass_at_k(10, 8, 3)
    (0.1, 0.0, 1.0)
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:            # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(ns: Sequence[int], cs: Sequence[int], k: int) -> float:
    """pass@k averaged over problems (``ns[i]`` samples, ``cs[i]`` correct for problem ``i``)."""
    return float(np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(ns, cs, strict=True)]))


@dataclass
class Interval:
    """A point estimate and its confidence interval ``[low, high]``."""

    estimate: float
    low: float
    high: float

    def __repr__(self) -> str:
        return f"{self.estimate:.4f} [{self.low:.4f}, {self.high:.4f}]"


def bootstrap_ci(values, statistic: Callable = np.mean, n_resamples: int = 10_000, confidence: float = 0.95,
                 seed: int = 0) -> Interval:
    """Percentile bootstrap interval of ``statistic`` over per-item ``values`` ``(n,)``.

    Resamples ``n`` items with replacement ``n_resamples`` times (a seeded numpy generator, so
    the interval is reproducible) and takes the ``(1 ± confidence) / 2`` quantiles.
    """
    values = np.asarray(values, dtype=float)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"values must be a non-empty 1-D array of per-item scores, got shape {values.shape}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_resamples, len(values)))
    if statistic is np.mean:
        stats = values[idx].mean(axis=1)       # vectorised: (n_resamples,)
    else:
        stats = np.array([statistic(values[row]) for row in idx])
    alpha = (1 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return Interval(float(statistic(values)), float(low), float(high))


@dataclass
class PairedComparison:
    """``diff = mean(a) - mean(b)`` over the same items, its bootstrap interval and a two-sided p-value."""

    diff: float
    low: float
    high: float
    p_value: float

    def __repr__(self) -> str:
        return f"diff {self.diff:+.4f} [{self.low:+.4f}, {self.high:+.4f}], p = {self.p_value:.3g}"


def _paired(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"a and b must be per-item scores on the same items, got shapes {a.shape} and {b.shape}")
    return a - b


def paired_bootstrap(a, b, n_resamples: int = 10_000, confidence: float = 0.95, seed: int = 0) -> PairedComparison:
    """Compare two models scored on the same items: resample *items* (keeping each pair together).

    The p-value is twice the fraction of resampled mean differences on the far side of zero
    (capped at 1): small when the interval stays clear of zero.
    """
    d = _paired(a, b)
    ci = bootstrap_ci(d, n_resamples=n_resamples, confidence=confidence, seed=seed)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(n_resamples, len(d)))].mean(axis=1)
    p = 2 * min(np.mean(means <= 0), np.mean(means >= 0))
    return PairedComparison(ci.estimate, ci.low, ci.high, float(min(1.0, p)))


def paired_permutation_test(a, b, n_resamples: int = 10_000, seed: int = 0) -> float:
    """Two-sided p-value of ``mean(a - b) = 0`` by flipping the sign of each pair's difference.

    Under the null hypothesis the two models are exchangeable on every item, so each difference is
    as likely to have either sign. Enumerates all ``2^n`` sign patterns when that is at most
    ``n_resamples``, otherwise samples ``n_resamples`` of them (plus the observed one).
    """
    d = _paired(a, b)
    observed = abs(d.mean())
    if 2 ** len(d) <= n_resamples:
        signs = np.array(list(product((1.0, -1.0), repeat=len(d))))
        return float(np.mean(np.abs((signs * d).mean(axis=1)) >= observed - 1e-12))
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(n_resamples, len(d)))
    hits = np.sum(np.abs((signs * d).mean(axis=1)) >= observed - 1e-12)
    return float((hits + 1) / (n_resamples + 1))


def chi_square_test(counts, probs, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square test that ``counts`` (observed draws per cell, any shape) come from
    ``probs`` (the same shape, summing to 1): returns ``(p-value, degrees of freedom)``.

    The statistic ``Σ (observed − expected)² / expected`` follows a chi-square law only when every
    cell expects about 5 draws, so cells expected to get fewer than ``min_expected`` are pooled into
    one. The p-value is the law's survival function, the regularised upper incomplete gamma
    ``Q(dof/2, statistic/2)``.
    """
    import torch

    counts = torch.as_tensor(counts).flatten().double()
    expected = torch.as_tensor(probs).flatten().double() * counts.sum()
    small = expected < min_expected
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    keep = expected > 0                          # the pooled cell is empty when nothing was small
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item(), dof


def sign_test(a, b) -> float:
    """Exact two-sided sign test: among items where the models differ, is ``a > b`` as likely as ``a < b``?"""
    d = _paired(a, b)
    wins, losses = int(np.sum(d > 0)), int(np.sum(d < 0))
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(wins, losses) + 1)) / 2 ** n
    return float(min(1.0, 2 * tail))
