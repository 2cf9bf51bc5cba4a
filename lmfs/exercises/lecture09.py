"""Checkers for the exercises of lecture 09 (scaling laws 1).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with :mod:`lmfs.scaling`: the closed-form compute-optimal allocation of
:class:`lmfs.scaling.ChinchillaLaw`, the IsoFLOP parabola of :func:`lmfs.scaling.isoflop_profile`,
and the two-batch-size noise estimate of :func:`lmfs.scaling.noise_from_norms`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmfs.exercises import check
from lmfs.scaling import BESIROGLU_2024, HOFFMANN_2022, ChinchillaLaw, isoflop_profile, noise_from_norms

_LAWS = [HOFFMANN_2022, BESIROGLU_2024, ChinchillaLaw(E=2.0, A=100.0, B=5000.0, alpha=0.5, beta=0.3)]


def check_compute_optimal(answer: Callable[[float, float, float, float, float, float], tuple]) -> int:
    """``compute_optimal(E, A, B, alpha, beta, C)`` -> ``(N_opt, D_opt)``: the model size and token
    count that minimise ``E + A/N^α + B/D^β`` subject to ``6·N·D = C``, compared with
    :meth:`lmfs.scaling.ChinchillaLaw.compute_optimal`."""
    cases = [(law.E, law.A, law.B, law.alpha, law.beta, C) for law in _LAWS for C in (1e18, 1e21, 5.76e23)]

    def reference(E, A, B, alpha, beta, C):
        N, D = ChinchillaLaw(E, A, B, alpha, beta).compute_optimal(C)
        return float(N), float(D)

    def answered(*case):
        N, D = answer(*case)
        return float(N), float(D)

    return check("compute_optimal", answered, reference, cases, atol=0.0, rtol=1e-6)


def _isoflop_cases():
    rng = np.random.default_rng(0)
    law = BESIROGLU_2024
    for C, spread, noise in [(1e19, 1.0, 0.0), (1e21, 0.8, 0.01), (1e23, 1.2, 0.005)]:
        N = law.compute_optimal(C)[0] * np.logspace(-spread, spread, 9)
        yield N, law.isoflop_loss(N, C) + rng.normal(0, noise, N.size)


def check_isoflop_minimum(answer: Callable[[np.ndarray, np.ndarray], float]) -> int:
    """``isoflop_minimum(N, loss)`` -> ``N*``: fit ``loss ≈ c2·(log N)² + c1·log N + c0`` by least
    squares and return the ``N`` at the parabola's minimum, compared with
    :func:`lmfs.scaling.isoflop_profile`."""
    return check("isoflop_minimum", lambda N, loss: float(answer(N, loss)),
                 lambda N, loss: isoflop_profile(N, loss, 1.0).N_opt, _isoflop_cases(), atol=0.0, rtol=1e-6)


def check_noise_scale(answer: Callable[[float, float, int, int], float]) -> int:
    """``noise_scale(g2_small, g2_big, small, big)`` -> ``B_simple = tr(Σ)/|G|²`` from the mean squared
    gradient norms at two batch sizes, compared with :func:`lmfs.scaling.noise_from_norms`."""
    cases = []
    for grad_sq, trace, small, big in [(1.0, 20.0, 4, 64), (0.01, 5.0, 8, 512), (3.0, 3.0, 1, 2)]:
        cases.append((grad_sq + trace / small, grad_sq + trace / big, small, big))
    cases.append((2.5, 1.2, 16, 128))  # measured norms, not exact ones

    def reference(g2_small, g2_big, small, big):
        grad_sq, trace = noise_from_norms(g2_small, g2_big, small, big)
        return trace / grad_sq

    return check("noise_scale", lambda *case: float(answer(*case)), reference, cases, atol=0.0, rtol=1e-6)
