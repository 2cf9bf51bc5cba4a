"""Chinchilla's three ways to find the compute-optimal model size, on one set of runs.

Hoffmann et al. (2022) trained hundreds of models and asked: for a budget of ``C`` FLOPs, which
model size ``N`` (and so which token count ``D = C / 6N``) gives the lowest loss? They answered
three ways, and each is a function here that takes the same runs:

1. :func:`envelope_method`: the lower envelope of all training curves. At each compute ``C`` the
   best loss over every run's curve tells which model size was best at that ``C``; a power law
   through those sizes is ``N_opt(C)``.
2. :func:`isoflop_method`: IsoFLOP profiles. For each budget, loss against ``log N`` is close to
   a parabola; its minimum is ``N*(C)``; a power law through the minima gives the exponent.
3. :func:`parametric_method`: fit ``L(N, D) = E + A/N^α + B/D^β`` (:func:`lmfs.scaling.fits.fit_chinchilla`)
   and minimise it at fixed ``C`` in closed form.

Each returns an :class:`Allocation`: ``N_opt(C) = k_N·C^a``, ``D_opt(C) = k_D·C^b``, and tokens
per parameter at any budget. :data:`HOFFMANN_2022` and :data:`BESIROGLU_2024` are the published
parametric fits; :func:`load_chinchilla_runs` reads the 245 runs read off Hoffmann et al.'s Figure 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import warnings

import numpy as np

from lmfs.scaling.fits import ChinchillaFit, ChinchillaLaw, PowerLawFit, fit_chinchilla, fit_power_law

#: Hoffmann et al. (2022), "Training Compute-Optimal Large Language Models", eq. (10): the
#: parametric fit (Approach 3) as printed in the paper, rounded.
HOFFMANN_2022 = ChinchillaLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28,
                              source="Hoffmann et al. 2022, eq. 10")

#: The same fit with the unrounded values of the paper's TeX source (E = 1.6934, α = 0.3392,
#: β = 0.2849), as reported by Besiroglu et al. (2024); with these the law puts the optimum for
#: Gopher's 5.76e23 FLOPs at 40B parameters, the figure Hoffmann et al. quote for Approach 3.
HOFFMANN_2022_TEX = ChinchillaLaw(E=1.6934, A=406.4, B=410.7, alpha=0.3392, beta=0.2849,
                                  source="Hoffmann et al. 2022, unrounded (TeX source)")

#: Besiroglu, Erdil, Barnett and You (2024), "Chinchilla Scaling: A replication attempt"
#: (arXiv:2404.10102, Epoch AI): the same law refitted to 240 of the 245 runs extracted from
#: Hoffmann et al.'s Figure 4 (Huber δ = 1e-3, summed; five outliers dropped).
BESIROGLU_2024 = ChinchillaLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658,
                               source="Besiroglu et al. 2024, replication")

#: Chinchilla itself: 70B parameters trained on 1.4T tokens (Hoffmann et al. 2022).
CHINCHILLA_N, CHINCHILLA_D = 70e9, 1.4e12

DATA_DIR = Path(__file__).resolve().parent.parent.parent / "data"


def load_chinchilla_runs(path: str | Path | None = None):
    """The runs of Hoffmann et al.'s Figure 4 as a DataFrame: ``N``, ``C``, ``D = C / 6N``, ``loss``.

    The file (``data/chinchilla_figure4_extracted.csv``, see ``data/chinchilla_README.md``) was
    extracted from the figure's SVG by Besiroglu et al. (2024); ``tokens_per_param`` is ``D / N``.
    """
    import pandas as pd

    path = Path(path) if path is not None else DATA_DIR / "chinchilla_figure4_extracted.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: it ships in the repository's data/ folder "
                                "(run from a source checkout of lmfs, or pass its path)")
    raw = pd.read_csv(path)
    runs = pd.DataFrame({"N": raw["Model Size"], "C": raw["Training FLOP"], "loss": raw["loss"]})
    runs["D"] = runs.C / (6 * runs.N)
    runs["tokens_per_param"] = runs.D / runs.N
    return runs


@dataclass
class Allocation:
    """Compute-optimal allocation found by one method: ``N_opt = k_N·C^a``, ``D_opt = k_D·C^b``.

    ``points``: the ``(C, N_opt)`` pairs the method found (``None`` for the parametric method,
    which needs none); ``fit``: the power-law fit through them, or the :class:`ChinchillaFit`
    (``None`` when two IsoFLOP minima give the line through them, or for a published law).
    """

    method: str
    a: float
    b: float
    k_N: float
    k_D: float
    points: dict | None
    fit: PowerLawFit | ChinchillaFit | None

    def N_opt(self, C):
        return self.k_N * np.asarray(C, dtype=np.float64) ** self.a

    def D_opt(self, C):
        return self.k_D * np.asarray(C, dtype=np.float64) ** self.b

    def tokens_per_parameter(self, C):
        return self.D_opt(C) / self.N_opt(C)

    def summary(self, C: float) -> dict:
        """One row for a comparison table: exponents and the allocation at budget ``C``."""
        return dict(method=self.method, a=self.a, b=self.b, N_opt=float(self.N_opt(C)),
                    D_opt=float(self.D_opt(C)), tokens_per_param=float(self.tokens_per_parameter(C)))


def _from_points(method: str, C: np.ndarray, N: np.ndarray, points: dict) -> Allocation:
    """Fit ``N_opt = k·C^a`` (a straight line in log-log axes) and set ``D_opt = C / (6·N_opt)``."""
    fit = fit_power_law(C, N, irreducible=False)
    a, k_N = fit.exponent, fit.A
    return Allocation(method, a, 1 - a, k_N, 1 / (6 * k_N), points, fit)


def envelope_method(curves, n_grid: int = 200, min_points: int = 3) -> Allocation:
    """Approach 1: the lower envelope of the training curves of many runs.

    ``curves``: one ``(N, flops, loss)`` per run, ``flops`` increasing (the compute spent so far
    at each logged point, ``6·N·tokens``). Each curve is interpolated in ``log C`` onto ``n_grid``
    compute values spanning the curves; at each, the run with the lowest loss is the best size for
    that compute. Only grid values reached by at least two runs count (``min_points`` of them are
    needed). Every winning ``(C, N)`` pair enters the power law, so a size that wins over a wide
    range of ``C`` pulls on the fit in proportion.

    Caveat (taught with it): a point in the middle of a run with a cosine schedule is worse than
    a run of that length would be, since its learning rate has not decayed yet. Chinchilla
    therefore trained each size for several lengths; our grid does the same (several budgets).
    """
    curves = [(float(N), np.asarray(f, dtype=np.float64), np.asarray(l, dtype=np.float64)) for N, f, l in curves]
    if len({N for N, _, _ in curves}) < 2:
        raise ValueError("the envelope needs training curves of at least two model sizes")
    if any(f.size < 2 or f[0] <= 0 or np.any(np.diff(f) <= 0) for _, f, _ in curves):
        raise ValueError("each curve's flops must be positive and increasing, with two points or more "
                         "(the compute spent after each logged step)")
    lo = min(f[0] for _, f, _ in curves)
    hi = max(f[-1] for _, f, _ in curves)
    grid = np.logspace(np.log10(lo), np.log10(hi), n_grid)
    losses = np.full((len(curves), n_grid), np.inf)
    for i, (_, f, l) in enumerate(curves):
        inside = (grid >= f[0]) & (grid <= f[-1])
        losses[i, inside] = np.interp(np.log(grid[inside]), np.log(f), l)
    reached = np.isfinite(losses).sum(0) >= 2
    best = losses[:, reached].argmin(0)
    C = grid[reached]
    N = np.array([curves[i][0] for i in best])
    if np.unique(N).size < 2:
        raise ValueError(f"one model size (N={N[0]:.3g}) is best at every compute value: the sizes do "
                         "not bracket the optimum, add smaller and larger models")
    if C.size < min_points:
        raise ValueError(f"only {C.size} compute values are reached by two or more curves; "
                         f"need {min_points}: make the runs overlap in compute")
    return _from_points("envelope of training curves", C, N,
                        dict(C=C, N=N, loss=losses[best, np.flatnonzero(reached)]))


@dataclass
class IsoFLOPProfile:
    """One budget's parabola ``loss ≈ c2·(log N)² + c1·log N + c0`` and its minimum."""

    C: float
    N: np.ndarray
    loss: np.ndarray
    coeffs: np.ndarray
    N_opt: float
    loss_opt: float

    def predict(self, N):
        return np.polyval(self.coeffs, np.log(np.asarray(N, dtype=np.float64)))


def isoflop_profile(N, loss, C: float) -> IsoFLOPProfile:
    """Fit one budget's parabola in ``log N`` (least squares) and return its minimum.

    Needs three different sizes (a parabola has three coefficients) and an upward parabola. A
    minimum that is not bracketed (the lowest loss measured at the smallest or largest size, or
    the parabola's minimum outside the sizes tried) is extrapolated, not measured: it is returned
    with a warning, and the sizes should be widened on that side.
    """
    N, loss = np.asarray(N, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if np.unique(N).size < 3:
        raise ValueError(f"budget C={C:.3g} has {np.unique(N).size} model size(s): an IsoFLOP parabola "
                         "needs at least 3 different sizes per budget; add runs or drop this budget")
    coeffs = np.polyfit(np.log(N), loss, 2)
    if coeffs[0] <= 0:
        raise ValueError(f"budget C={C:.3g}: loss against log N curves downward (no minimum); the sizes "
                         "do not bracket the optimum or the runs are too noisy: widen the range of sizes")
    log_n = -coeffs[1] / (2 * coeffs[0])
    best = N[np.argmin(loss)]
    if best in (N.min(), N.max()) or not N.min() <= np.exp(log_n) <= N.max():
        side = "smaller" if best == N.min() or np.exp(log_n) < N.min() else "larger"
        warnings.warn(f"budget C={C:.3g}: the minimum sits at the edge of the sizes tried "
                      f"(lowest loss at N={best:,.0f}, parabola minimum at N={np.exp(log_n):,.0f}, sizes "
                      f"{N.min():,.0f}..{N.max():,.0f}): it is extrapolated; add {side} models", stacklevel=2)
    return IsoFLOPProfile(C, N, loss, coeffs, float(np.exp(log_n)), float(np.polyval(coeffs, log_n)))


def isoflop_method(N, C, loss, rtol: float = 0.05) -> tuple[Allocation, list[IsoFLOPProfile]]:
    """Approach 2: a parabola per budget, then a power law through the minima.

    Runs whose ``C`` agree within ``rtol`` are one budget. Returns the allocation and the
    per-budget profiles (for plotting). Needs at least two budgets (three for a meaningful fit).
    """
    N, C, loss = (np.asarray(v, dtype=np.float64) for v in (N, C, loss))
    if not N.size == C.size == loss.size:
        raise ValueError(f"N, C and loss need one value per run, got {N.size}, {C.size} and {loss.size}")
    order = np.argsort(C)
    groups, current = [], [order[0]]
    for i in order[1:]:
        if C[i] <= C[current[0]] * (1 + rtol):
            current.append(i)
        else:
            groups.append(current)
            current = [i]
    groups.append(current)
    if len(groups) < 2:
        raise ValueError("all runs share one budget: the IsoFLOP method needs at least two budgets "
                         "(three or more for a trustworthy exponent)")
    profiles = [isoflop_profile(N[g], loss[g], float(np.exp(np.log(C[g]).mean()))) for g in groups]
    Cs = np.array([p.C for p in profiles])
    Ns = np.array([p.N_opt for p in profiles])
    if Cs.size < 3:  # two points: the line through them (a fit with 2 parameters needs 3 points)
        a = float(np.diff(np.log(Ns))[0] / np.diff(np.log(Cs))[0])
        k_N = float(Ns[0] / Cs[0] ** a)
        return Allocation("IsoFLOP parabolas", a, 1 - a, k_N, 1 / (6 * k_N),
                          dict(C=Cs, N=Ns, loss=np.array([p.loss_opt for p in profiles])), None), profiles
    return _from_points("IsoFLOP parabolas", Cs, Ns,
                        dict(C=Cs, N=Ns, loss=np.array([p.loss_opt for p in profiles]))), profiles


def parametric_method(N, D, loss, **fit_options) -> Allocation:
    """Approach 3: fit ``L(N, D)`` and read the allocation off its closed form (``C = 6·N·D``)."""
    fit = fit_chinchilla(N, D, loss, **fit_options)
    return law_allocation(fit.law, "parametric fit", fit)


def law_allocation(law: ChinchillaLaw, method: str | None = None, fit=None) -> Allocation:
    """The :class:`Allocation` a parametric law implies: ``N* = G·(C/6)^a``, ``D* = G⁻¹·(C/6)^b``."""
    return Allocation(method or law.source, law.a, law.b, law.G * 6.0 ** -law.a, 6.0 ** -law.b / law.G,
                      None, fit)
