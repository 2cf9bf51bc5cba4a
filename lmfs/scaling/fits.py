"""Scaling-law fits: a power law with an irreducible term, and Chinchilla's parametric law L(N, D).

Both are fitted the way Hoffmann et al. (2022, "Training Compute-Optimal Large Language Models",
section 3.3 and appendix D.2) fitted theirs: in **log space**, with a **Huber** loss, from **many
starting points**. Working with ``log L`` makes a 1 % miss count the same at every loss level; the
Huber loss (quadratic below ``delta``, linear above) keeps a few bad runs from dragging the fit;
and many starts guard against the local minima a sum of power laws has.

>>> import numpy as np
>>> x = np.logspace(3, 7, 12)
>>> fit = fit_power_law(x, 2.0 + 50 * x ** -0.4)
>>> [round(fit.estimates[k], 3) for k in ("E", "A", "alpha")]
[2.0, 50.0, 0.4]

* :func:`fit_power_law`: ``y = E + A·x^(−α)`` (or ``A·x^(−α)`` with ``irreducible=False``).
* :func:`fit_chinchilla`: ``L = E + A/N^α + B/D^β``, fitted in Hoffmann et al.'s log-sum-exp form.
* :class:`ChinchillaLaw`: such a law with its compute-optimal allocation ``N*(C), D*(C)`` in
  closed form under ``C = 6·N·D``.
* Each fit returns an object that predicts, plots and prints its estimates with bootstrap
  confidence intervals (runs resampled with replacement, the fit repeated on each resample).

The optimiser is L-BFGS (``torch.optim.LBFGS`` with a strong-Wolfe line search, in float64). The
objective is first evaluated on the whole grid of starts at once, then L-BFGS runs from the best
``polish`` of them and the lowest result wins.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

# ------------------------------------------------------------------------------- the optimiser


def huber(residual: torch.Tensor, delta: float) -> torch.Tensor:
    """Elementwise Huber loss: ``r²/2`` for ``|r| <= delta``, ``delta·(|r| − delta/2)`` beyond."""
    a = residual.abs()
    return torch.where(a <= delta, 0.5 * residual ** 2, delta * (a - 0.5 * delta))


def lbfgs(objective: Callable[[torch.Tensor], torch.Tensor], theta0: torch.Tensor,
          max_iter: int = 1000) -> tuple[torch.Tensor, float]:
    """Minimise the scalar ``objective(theta)`` from ``theta0`` ``(P,)`` by L-BFGS (strong-Wolfe line
    search, float64); return ``(theta, objective(theta))``."""
    theta = theta0.to(torch.float64).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10,
                            tolerance_change=1e-13, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = objective(theta)
        value.backward()
        return value

    opt.step(closure)
    with torch.no_grad():
        return theta.detach(), float(objective(theta))


def minimize_huber(predict_log: Callable[[torch.Tensor], torch.Tensor], log_y: torch.Tensor,
                   starts: torch.Tensor, delta: float, polish: int = 8) -> tuple[torch.Tensor, float]:
    """Minimise ``Σ_i huber(predict_log(θ)_i − log_y_i, delta)`` over ``θ``; return ``(θ*, objective)``.

    ``predict_log`` maps parameters ``(S, P)`` to predictions ``(S, n)`` for ``S`` candidate
    parameter vectors at once; ``starts`` is ``(S, P)``. Every start is scored in one batched call,
    then L-BFGS runs from each of the ``polish`` best ones and the lowest end wins.
    The objective is a **sum** over points, not a mean: with ``delta = 1e-3`` a mean makes the
    gradients so small that the optimiser's stopping tests fire long before the optimum (Besiroglu
    et al. 2024 give such a loss scale as the reason the original fit stopped before converging).
    """
    def objective(theta):
        return torch.nan_to_num(huber(predict_log(theta) - log_y, delta).sum(-1), nan=math.inf)

    starts = starts.to(torch.float64)
    with torch.no_grad():
        best = objective(starts).argsort()[:polish]
    ends = [lbfgs(lambda theta: objective(theta[None])[0], starts[i]) for i in best.tolist()]
    theta, value = min(ends, key=lambda end: end[1] if math.isfinite(end[1]) else math.inf)
    if not math.isfinite(value):
        raise RuntimeError("every start of the fit gave a non-finite objective: check the data for "
                           "zeros or infinities, or widen the grid of starts")
    return theta, value


# ------------------------------------------------------------------------------- fit results


def _positive_array(name: str, values) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} has non-finite values (NaN or inf): drop those runs before fitting")
    if np.any(arr <= 0):
        raise ValueError(f"{name} must be positive (a log-space fit takes its logarithm), but "
                         f"{int(np.sum(arr <= 0))} of {arr.size} values are <= 0: drop or fix those runs")
    return arr


def _enough_points(n: int, n_params: int, what: str) -> None:
    if n < n_params + 1:
        raise ValueError(f"{what} has {n_params} parameters and needs at least {n_params + 1} points "
                         f"(one more than parameters, or it just interpolates), got {n}: add runs")


@dataclass
class FitResult:
    """Estimates of a fitted law and their bootstrap samples.

    ``estimates``: name -> value. ``samples``: ``(n_boot, n_params)`` refits on resampled runs
    (columns in the order of ``estimates``), or ``None`` without a bootstrap. ``objective``: the
    summed Huber loss at the estimate, over ``n`` points.
    """

    estimates: dict[str, float]
    samples: np.ndarray | None
    objective: float
    n: int

    def ci(self, level: float = 0.95) -> dict[str, tuple[float, float]]:
        """Percentile bootstrap interval of each estimate (``level`` of the resampled fits inside)."""
        if self.samples is None or len(self.samples) < 2:
            raise ValueError("no bootstrap samples: fit again with bootstrap=200 (or more) resamples")
        lo, hi = 50 * (1 - level), 50 * (1 + level)
        return {name: (float(np.percentile(self.samples[:, i], lo)), float(np.percentile(self.samples[:, i], hi)))
                for i, name in enumerate(self.estimates)}

    def derived_ci(self, fn: Callable[[dict], float], level: float = 0.95) -> tuple[float, float, float]:
        """``(value, low, high)`` of a quantity computed from the estimates by ``fn(dict)``, its interval
        from applying ``fn`` to every bootstrap refit (e.g. tokens per parameter at some budget)."""
        value = fn(self.estimates)
        if self.samples is None or len(self.samples) < 2:
            return value, math.nan, math.nan
        values = [fn(dict(zip(self.estimates, row))) for row in self.samples]
        return value, float(np.percentile(values, 50 * (1 - level))), float(np.percentile(values, 50 * (1 + level)))

    def _lines(self) -> list[str]:
        intervals = self.ci() if self.samples is not None and len(self.samples) >= 2 else {}
        lines = []
        for name, value in self.estimates.items():
            line = f"  {name:>5} = {value:.4g}"
            if name in intervals:
                lo, hi = intervals[name]
                line += f"  (95% CI {lo:.4g} .. {hi:.4g}, {len(self.samples)} bootstrap refits)"
            lines.append(line)
        return lines


@dataclass(repr=False)
class PowerLawFit(FitResult):
    """``y = E + A·x^(−α)`` fitted to ``(x, y)``; ``E = 0`` when fitted with ``irreducible=False``.

    ``exponent`` is the slope of the reducible part in log-log axes, ``−α``: negative for a loss
    that falls, positive for a quantity that grows (``N*(C) ∝ C^a`` has ``exponent = a``).
    """

    x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    y: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def E(self) -> float:
        return self.estimates.get("E", 0.0)

    @property
    def A(self) -> float:
        return self.estimates["A"]

    @property
    def alpha(self) -> float:
        return self.estimates["alpha"]

    @property
    def exponent(self) -> float:
        return -self.alpha

    def predict(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        return self.E + self.A * x ** (-self.alpha)

    def plot(self, ax=None, label: str | None = None, color=None, extend: float = 1.0):
        """The data (dots) and the fitted law (line) on log-log axes; the line runs ``extend``×
        beyond the data's largest ``x``. Returns ``ax``."""
        import matplotlib.pyplot as plt

        if ax is None:
            ax = plt.subplots(figsize=(5.5, 3.5))[1]
        grid = np.logspace(np.log10(self.x.min()), np.log10(self.x.max() * extend), 200)
        dots = ax.loglog(self.x, self.y, "o", color=color, ms=4)[0]
        ax.loglog(grid, self.predict(grid), "-", color=dots.get_color(), lw=1.2,
                  label=label or self.formula())
        ax.legend(fontsize=8)
        return ax

    def formula(self) -> str:
        head = f"{self.E:.3g} + " if "E" in self.estimates else ""
        return f"{head}{self.A:.3g}·x^{self.exponent:+.3g}"

    def __repr__(self) -> str:
        return "\n".join([f"PowerLawFit: y = {self.formula()}  ({self.n} points, Huber objective "
                          f"{self.objective:.3g})"] + self._lines())


def bootstrap_refits(make_predict: Callable[..., Callable], columns: list[np.ndarray], log_y: np.ndarray,
                     theta_hat: torch.Tensor, delta: float, n_boot: int, seed: int) -> np.ndarray | None:
    """Refit on ``n_boot`` resamples of the runs (drawn with replacement); ``(n_boot, P)`` or ``None``.

    ``make_predict(*columns)`` builds the model's ``predict_log`` from per-run inputs (log sizes).
    Each refit is one L-BFGS run started from the full-data estimate ``theta_hat``: a resample's
    optimum lies close to it, so the grid of starts is not needed again.
    """
    if not n_boot:
        return None
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_boot):
        idx = rng.integers(0, log_y.size, log_y.size)
        predict = make_predict(*(torch.tensor(col[idx]) for col in columns))
        ly = torch.tensor(log_y[idx])
        # The same tight stop as the estimate's: a loose one leaves each refit near its start, and the
        # intervals come out implausibly narrow (what Besiroglu et al. found in the published ones).
        rows.append(lbfgs(lambda th: huber(predict(th[None])[0] - ly, delta).sum(), theta_hat)[0])
    return torch.stack(rows).numpy()


def _power_law_predict(irreducible: bool):
    """``predict_log`` of a power law on log x ``(n,)`` or ``(S, n)``; theta ``(S, 3)`` = (log E,
    log A, α), or ``(S, 2)`` = (log A, α) without the irreducible term."""
    def make(lx):
        def predict(theta):
            reducible = theta[:, -2:-1] - theta[:, -1:] * lx
            return torch.logaddexp(reducible, theta[:, 0:1]) if irreducible else reducible
        return predict
    return make


def fit_power_law(x, y, *, irreducible: bool = True, delta: float = 1e-3, bootstrap: int = 0,
                  seed: int = 0, polish: int = 8) -> PowerLawFit:
    """Fit ``y = E + A·x^(−α)`` by a Huber loss on ``log y``; ``bootstrap`` resamples give intervals.

    The fit runs on ``x / x0`` (``x0`` the geometric mean of ``x``) so that the parameters are of
    order one whatever the units (FLOPs reach 1e23), and ``A`` is converted back at the end. The
    model in log space is ``log ŷ = logsumexp(log A − α·log x, log E)``. Starts: a grid over
    ``E`` (fractions of the smallest ``y``), ``α`` and ``log A``, plus the least-squares line in
    log-log axes (the exact answer when ``irreducible=False``, ``E = 0``, and the data are clean).
    """
    x, y = _positive_array("x", x), _positive_array("y", y)
    if x.size != y.size:
        raise ValueError(f"x and y must have one value per run, got {x.size} and {y.size}")
    names = ("E", "A", "alpha") if irreducible else ("A", "alpha")
    _enough_points(x.size, len(names), "y = E + A·x^(−α)" if irreducible else "y = A·x^(−α)")
    if np.unique(x).size < 2:
        raise ValueError("all runs have the same x: a power law needs at least two different sizes")
    x0 = float(np.exp(np.log(x).mean()))
    lx, ly = np.log(x / x0), np.log(y)

    slope, intercept = np.polyfit(lx, ly, 1)
    alphas = np.array([-2, -1, -0.5, -0.2, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0])
    log_as = ly.mean() + np.array([-6, -3, -1.5, -0.5, 0.0, 0.5, 1.5])
    if irreducible:
        log_es = np.log(y.min()) + np.log([1e-3, 0.2, 0.5, 0.8, 0.95])
        grid = np.array(np.meshgrid(log_es, log_as, alphas, indexing="ij")).reshape(3, -1).T
        grid = np.vstack([grid, [np.log(y.min()) - 7, intercept, -slope]])
    else:
        grid = np.vstack([np.array(np.meshgrid(log_as, alphas, indexing="ij")).reshape(2, -1).T,
                          [intercept, -slope]])
    make = _power_law_predict(irreducible)
    theta, objective = minimize_huber(make(torch.tensor(lx)), torch.tensor(ly), torch.tensor(grid), delta, polish)
    rows = theta[None].numpy()
    samples = bootstrap_refits(make, [lx], ly, theta, delta, bootstrap, seed)
    if samples is not None:
        rows = np.vstack([rows, samples])
    # back to the caller's units: A·(x/x0)^−α = (A·x0^α)·x^−α
    A = np.exp(rows[:, -2]) * x0 ** rows[:, -1]
    values = np.column_stack([np.exp(rows[:, 0]), A, rows[:, -1]] if irreducible else [A, rows[:, -1]])
    return PowerLawFit(dict(zip(names, values[0].tolist())), None if samples is None else values[1:],
                       objective, x.size, x=x, y=y)


# ------------------------------------------------------------------------------- Chinchilla's law


@dataclass(frozen=True)
class ChinchillaLaw:
    """``L(N, D) = E + A/N^α + B/D^β`` with ``N`` parameters and ``D`` training tokens.

    Minimising it at fixed compute ``C = 6·N·D`` gives (Hoffmann et al. 2022, eq. 4)::

        N*(C) = G·(C/6)^a,   D*(C) = G⁻¹·(C/6)^b,   G = (α·A / (β·B))^(1/(α+β)),
        a = β/(α+β),         b = α/(α+β)

    so the compute-optimal tokens per parameter, ``D*/N* = G⁻²·(C/6)^(b−a)``, stays constant only
    when ``α = β``. ``E`` does not move the optimum, only the loss reached there.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str = ""

    def loss(self, N, D):
        N, D = np.asarray(N, dtype=np.float64), np.asarray(D, dtype=np.float64)
        return self.E + self.A / N ** self.alpha + self.B / D ** self.beta

    @property
    def a(self) -> float:
        """Exponent of ``N*(C) ∝ C^a``."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of ``D*(C) ∝ C^b`` (``a + b = 1``)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))

    def compute_optimal(self, C):
        """``(N*, D*)``: the model size and token count of least loss for ``C = 6·N·D`` FLOPs."""
        C = np.asarray(C, dtype=np.float64)
        return self.G * (C / 6) ** self.a, (C / 6) ** self.b / self.G

    def tokens_per_parameter(self, C):
        """``D*/N*`` at compute ``C``."""
        N, D = self.compute_optimal(C)
        return D / N

    def optimal_loss(self, C):
        """The least loss reachable with ``C`` FLOPs: ``L(N*(C), D*(C))``."""
        return self.loss(*self.compute_optimal(C))

    def isoflop_loss(self, N, C):
        """Loss of an ``N``-parameter model trained with ``C`` FLOPs (``D = C / 6N`` tokens)."""
        N = np.asarray(N, dtype=np.float64)
        return self.loss(N, np.asarray(C, dtype=np.float64) / (6 * N))

    def __str__(self) -> str:
        return (f"L = {self.E:.4g} + {self.A:.4g}/N^{self.alpha:.4g} + {self.B:.4g}/D^{self.beta:.4g}"
                + (f"  [{self.source}]" if self.source else ""))


CHINCHILLA_NAMES = ("E", "A", "B", "alpha", "beta")

#: Hoffmann et al. (2022)'s grid of starts (appendix D.2), for ``(a, b, e, α, β)`` with
#: ``A = exp(a)``, ``B = exp(b)``, ``E = exp(e)``: 6 × 6 × 6 × 5 × 5 = 5400 starting points.
HOFFMANN_GRID = dict(a=np.arange(0, 30, 5.0), b=np.arange(0, 30, 5.0), e=np.arange(-1, 2, 0.5),
                     alpha=np.arange(0, 2.5, 0.5), beta=np.arange(0, 2.5, 0.5))


@dataclass(repr=False)
class ChinchillaFit(FitResult):
    """:func:`fit_chinchilla`'s result: the estimates, their bootstrap refits, the data; ``.law`` is the
    fitted :class:`ChinchillaLaw`, and its allocation methods are available here directly."""

    N: np.ndarray = field(default_factory=lambda: np.zeros(0))
    D: np.ndarray = field(default_factory=lambda: np.zeros(0))
    L: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def law(self) -> ChinchillaLaw:
        return ChinchillaLaw(**self.estimates, source="fitted")

    def predict(self, N, D):
        return self.law.loss(N, D)

    def compute_optimal(self, C):
        return self.law.compute_optimal(C)

    def tokens_per_parameter(self, C):
        return self.law.tokens_per_parameter(C)

    @property
    def a(self) -> float:
        return self.law.a

    @property
    def b(self) -> float:
        return self.law.b

    def plot(self, ax=None, budgets: int = 6):
        """Loss against ``N`` for the data (dots coloured by compute ``6·N·D``) and the fitted law's
        IsoFLOP curves at ``budgets`` compute levels spanning the data. Returns ``ax``."""
        import matplotlib.pyplot as plt

        if ax is None:
            ax = plt.subplots(figsize=(6, 4))[1]
        C = 6 * self.N * self.D
        norm = plt.Normalize(np.log10(C.min()), np.log10(C.max()))
        ax.scatter(self.N, self.L, c=np.log10(C), cmap="viridis", norm=norm, s=10)
        for c in np.logspace(np.log10(C.min()), np.log10(C.max()), budgets):
            n = np.logspace(np.log10(self.N.min()) - 0.3, np.log10(self.N.max()) + 0.3, 200)
            ax.plot(n, self.law.isoflop_loss(n, c), color=plt.cm.viridis(norm(np.log10(c))), lw=1)
        ax.set(xscale="log", yscale="log", xlabel="parameters N", ylabel="loss",
               title="fitted L(N, D) along IsoFLOP curves")
        ax.set_ylim(self.L.min() * 0.95, self.L.max() * 1.05)
        return ax

    def __repr__(self) -> str:
        law = self.law
        head = [f"ChinchillaFit: {law}  ({self.n} runs, Huber objective {self.objective:.4g})",
                f"  compute-optimal: N* ∝ C^{law.a:.3f}, D* ∝ C^{law.b:.3f}"]
        return "\n".join(head + self._lines())


def _chinchilla_predict(log_n: torch.Tensor, log_d: torch.Tensor):
    """``log L̂ = logsumexp(a − α·log N, b − β·log D, e)`` for parameters ``(S, 5)`` in the order
    ``(a, b, e, α, β)``; ``log_n``, ``log_d`` are ``(n,)`` or ``(S, n)``."""
    def predict(theta):
        a, b, e, alpha, beta = (t[:, None] for t in theta.unbind(-1))
        model, data = a - alpha * log_n, b - beta * log_d
        return torch.logsumexp(torch.stack([model, data, e.expand_as(model)]), dim=0)
    return predict


def fit_chinchilla(N, D, L, *, delta: float = 1e-3, grid: dict | None = None, polish: int = 8,
                   bootstrap: int = 0, seed: int = 0) -> ChinchillaFit:
    """Fit ``L = E + A/N^α + B/D^β`` to runs with ``N`` parameters, ``D`` tokens and final loss ``L``.

    Hoffmann et al.'s procedure: minimise ``Σ huber(logsumexp(a − α·log N, b − β·log D, e) − log L)``
    with ``delta = 1e-3``, by L-BFGS from the best ``polish`` points of ``grid`` (default
    :data:`HOFFMANN_GRID`, 5400 starts). ``bootstrap`` resamples the runs with replacement and
    refits each resample from the full-data estimate, for confidence intervals.
    """
    N, D, L = _positive_array("N", N), _positive_array("D", D), _positive_array("L", L)
    if not N.size == D.size == L.size:
        raise ValueError(f"N, D and L need one value per run, got {N.size}, {D.size} and {L.size}")
    _enough_points(N.size, 5, "L = E + A/N^α + B/D^β")
    if np.unique(N).size < 2 or np.unique(D).size < 2:
        raise ValueError("N and D must each take at least two different values: with one model size "
                         "(or one token count) the A/N^α (or B/D^β) term is indistinguishable from E")
    g = HOFFMANN_GRID if grid is None else grid
    starts = np.array(np.meshgrid(g["a"], g["b"], g["e"], g["alpha"], g["beta"], indexing="ij")).reshape(5, -1).T
    log_n, log_d, log_l = np.log(N), np.log(D), np.log(L)
    theta, objective = minimize_huber(_chinchilla_predict(torch.tensor(log_n), torch.tensor(log_d)),
                                      torch.tensor(log_l), torch.tensor(starts), delta, polish)
    rows = theta[None].numpy()
    samples = bootstrap_refits(_chinchilla_predict, [log_n, log_d], log_l, theta, delta, bootstrap, seed)
    if samples is not None:
        rows = np.vstack([rows, samples])
    a, b, e, alpha, beta = rows.T
    values = np.column_stack([np.exp(e), np.exp(a), np.exp(b), alpha, beta])
    return ChinchillaFit(dict(zip(CHINCHILLA_NAMES, values[0].tolist())),
                         None if samples is None else values[1:], objective, N.size, N=N, D=D, L=L)
