"""The checkers of lecture 09's exercises accept right answers and reject wrong ones."""

import numpy as np
import pytest

from lmfs.exercises.lecture09 import check_compute_optimal, check_isoflop_minimum, check_noise_scale


def compute_optimal(E, A, B, alpha, beta, C):
    G = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
    N = G * (C / 6) ** (beta / (alpha + beta))
    return N, C / (6 * N)


def isoflop_minimum(N, loss):
    c2, c1, _ = np.polyfit(np.log(N), loss, 2)
    return np.exp(-c1 / (2 * c2))


def noise_scale(g2_small, g2_big, small, big):
    grad_sq = (big * g2_big - small * g2_small) / (big - small)
    trace = (g2_small - g2_big) / (1 / small - 1 / big)
    return trace / grad_sq


def test_compute_optimal_checker():
    assert check_compute_optimal(compute_optimal) == 9
    with pytest.raises(AssertionError, match="compute_optimal: wrong result"):  # exponents swapped
        check_compute_optimal(lambda E, A, B, a, b, C: compute_optimal(E, A, B, b, a, C))
    with pytest.raises(AssertionError, match="compute_optimal: wrong result"):  # forgets the 6 in C = 6ND
        check_compute_optimal(lambda E, A, B, a, b, C: compute_optimal(E, A, B, a, b, 6 * C))


def test_isoflop_minimum_checker():
    assert check_isoflop_minimum(isoflop_minimum) == 3
    with pytest.raises(AssertionError, match="isoflop_minimum: wrong result"):  # best run, not the parabola
        check_isoflop_minimum(lambda N, loss: N[np.argmin(loss)])
    with pytest.raises(AssertionError, match="isoflop_minimum: wrong result"):  # parabola in N, not log N
        check_isoflop_minimum(lambda N, loss: -np.polyfit(N, loss, 2)[1] / (2 * np.polyfit(N, loss, 2)[0]))


def test_noise_scale_checker():
    assert check_noise_scale(noise_scale) == 4
    with pytest.raises(AssertionError, match="noise_scale: wrong result"):  # the small batch's norm as |G|²
        check_noise_scale(lambda g2s, g2b, s, b: noise_scale(g2s, g2b, s, b) * (b * g2b - s * g2s) / (b - s) / g2s)
