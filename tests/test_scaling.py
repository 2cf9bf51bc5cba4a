"""lmfs.scaling: fits recover known laws, the three Chinchilla methods agree with the law that made
the data, bad input is refused, sweeps resume, and the noise scale matches a closed form."""

import json

import numpy as np
import pytest
import torch

from lmfs.nn import TransformerConfig
from lmfs.scaling import (BESIROGLU_2024, HOFFMANN_2022, ChinchillaLaw, SweepOptions, envelope_method,
                          fit_chinchilla, fit_critical_batch, fit_power_law, gradient_noise_scale,
                          isoflop_method, load_chinchilla_runs, load_records, noise_from_norms,
                          parametric_method, plan_sweep, run_sweep, steps_to_target)
from lmfs.scaling import sweep as sweep_module

LAW = ChinchillaLaw(E=1.8, A=400.0, B=2000.0, alpha=0.34, beta=0.37)


def test_power_law_recovers_known_parameters_from_noisy_data():
    rng = np.random.default_rng(0)
    x = np.logspace(3, 8, 25)
    y = (2.0 + 50 * x ** -0.4) * np.exp(rng.normal(0, 0.005, x.size))   # 0.5 % noise
    fit = fit_power_law(x, y, bootstrap=20)
    assert abs(fit.E / 2.0 - 1) < 0.02 and abs(fit.alpha - 0.4) < 0.02 and abs(fit.A / 50 - 1) < 0.15
    lo, hi = fit.ci()["alpha"]
    assert lo < fit.alpha < hi and hi - lo < 0.1
    np.testing.assert_allclose(fit.predict(x), 2.0 + 50 * x ** -0.4, rtol=0.01)
    assert "alpha" in repr(fit) and "95% CI" in repr(fit)


def test_power_law_without_irreducible_term_is_a_line_in_log_log():
    x = np.logspace(18, 23, 6)
    fit = fit_power_law(x, 0.1 * x ** 0.5, irreducible=False)
    assert abs(fit.exponent - 0.5) < 1e-6 and abs(fit.A / 0.1 - 1) < 1e-5


def test_compute_optimal_allocation_matches_brute_force():
    for law in (LAW, HOFFMANN_2022, BESIROGLU_2024):
        for C in (1e18, 1e21, 5.76e23):
            N = np.logspace(5, 13, 200_001)
            best = N[np.argmin(law.isoflop_loss(N, C))]
            N_opt, D_opt = law.compute_optimal(C)
            assert abs(np.log(N_opt / best)) < 1e-3 and abs(6 * N_opt * D_opt / C - 1) < 1e-12
            assert abs(law.a + law.b - 1) < 1e-12


def test_published_laws():
    # Hoffmann et al.'s rounded fit: N* ∝ C^0.45; the replication: about 20 tokens per parameter
    # at Chinchilla's compute (70B parameters, 1.4T tokens).
    assert abs(HOFFMANN_2022.a - 0.28 / 0.62) < 1e-12
    assert 15 < BESIROGLU_2024.tokens_per_parameter(6 * 70e9 * 1.4e12) < 25


def _grid_runs(law, noise=0.0, seed=0):
    """Runs of 5 budgets x 7 sizes whose losses follow ``law`` (times log-normal noise)."""
    rng = np.random.default_rng(seed)
    N, C = [], []
    for c in np.logspace(18, 22, 5):
        center = law.compute_optimal(c)[0]
        for n in center * np.logspace(-0.9, 0.9, 7):
            N.append(n)
            C.append(c)
    N, C = np.array(N), np.array(C)
    D = C / (6 * N)
    return N, D, C, law.loss(N, D) * np.exp(rng.normal(0, noise, N.size))


def test_chinchilla_fit_recovers_known_law_from_noisy_runs():
    N, D, _, L = _grid_runs(LAW, noise=0.003)
    fit = fit_chinchilla(N, D, L, polish=4)
    est = fit.estimates
    assert abs(est["E"] / LAW.E - 1) < 0.03
    assert abs(est["alpha"] - LAW.alpha) < 0.03 and abs(est["beta"] - LAW.beta) < 0.03
    assert abs(fit.a - LAW.a) < 0.02
    assert abs(np.log(fit.tokens_per_parameter(1e21) / LAW.tokens_per_parameter(1e21))) < 0.3


def test_three_methods_recover_the_exponent_of_the_law_that_made_the_runs():
    N, D, C, L = _grid_runs(LAW)
    iso, profiles = isoflop_method(N, C, L)
    assert len(profiles) == 5 and abs(iso.a - LAW.a) < 0.02
    # Training curves: each size trained to the largest budget, logged along the way.
    curves = []
    for n in np.logspace(np.log10(N.min()), np.log10(N.max()), 12):
        flops = np.logspace(17.5, 22, 60)
        curves.append((n, flops, LAW.loss(n, flops / (6 * n))))
    envelope = envelope_method(curves)
    assert abs(envelope.a - LAW.a) < 0.05
    parametric = parametric_method(N, D, L, polish=3)
    assert abs(parametric.a - LAW.a) < 0.01
    assert abs(np.log(iso.tokens_per_parameter(1e21) / LAW.tokens_per_parameter(1e21))) < 0.2


def test_isoflop_warns_when_a_minimum_sits_at_the_edge_of_its_grid():
    import warnings

    from lmfs.scaling import isoflop_profile

    N = np.array([1e6, 2e6, 4e6, 8e6])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # bracketed: no warning
        assert 2e6 < isoflop_profile(N, [3.0, 2.8, 2.75, 2.9], 1e18).N_opt < 4e6
    with pytest.warns(UserWarning, match="edge of the sizes tried.*add smaller models"):
        isoflop_profile(N, [2.7, 2.8, 3.0, 3.3], 1e18)      # loss rises from the smallest size on
    with pytest.warns(UserWarning, match="add larger models"):
        isoflop_profile(N, [3.3, 3.0, 2.8, 2.79], 1e18)     # still falling at the largest size
    with pytest.warns(UserWarning, match="edge"):            # the same through isoflop_method
        isoflop_method(np.tile(N, 2), [1e18] * 4 + [1e19] * 4, [2.7, 2.8, 3.0, 3.3, 3.0, 2.8, 2.75, 2.9])


def test_plan_sweep_leaves_out_runs_outside_the_step_range(capsys):
    base = TransformerConfig(vocab_size=64, context_length=8, n_heads=2)
    options = SweepOptions(batch_size=4, context_length=8)
    sizes = [dict(d_model=8, n_layers=1), dict(d_model=32, n_layers=1)]
    all_runs = plan_sweep(sizes, [1e8], base, options, min_steps=1)
    steps = sorted(r["steps"] for r in all_runs)
    kept = plan_sweep(sizes, [1e8], base, options, min_steps=1, max_steps=steps[0])
    assert [r["steps"] for r in kept] == [steps[0]] and f"(> {steps[0]})" in capsys.readouterr().out


def test_figure4_fit_reproduces_the_replication():
    runs = load_chinchilla_runs()
    assert len(runs) == 245
    kept = runs.sort_values("tokens_per_param").iloc[5:]   # the replication drops 5 outliers
    fit = fit_chinchilla(kept.N, kept.D, kept.loss, polish=4)
    est = fit.estimates
    assert abs(est["E"] - BESIROGLU_2024.E) < 0.02
    assert abs(est["alpha"] - BESIROGLU_2024.alpha) < 0.01 and abs(est["beta"] - BESIROGLU_2024.beta) < 0.01


@pytest.mark.parametrize("call, message", [
    (lambda: fit_power_law([1, 2, 3], [3, 2, 1]), "at least 4 points"),
    (lambda: fit_power_law([1, 2, 3, 4, 5], [3, 2, 0, 1, 1]), "must be positive"),
    (lambda: fit_power_law([1, -2, 3, 4, 5], [3, 2, 2, 1, 1]), "must be positive"),
    (lambda: fit_power_law([2, 2, 2, 2, 2], [3, 2, 2, 1, 1]), "two different sizes"),
    (lambda: fit_power_law([1, 2, np.nan, 4, 5], [3, 2, 2, 1, 1]), "non-finite"),
    (lambda: fit_chinchilla([1e6] * 3, [1e9] * 3, [3.0] * 3), "at least 6 points"),
    (lambda: fit_chinchilla([1e6] * 8, np.logspace(8, 10, 8), np.linspace(3, 2, 8)), "two different values"),
    (lambda: isoflop_method([1e6, 2e6, 1e6, 2e6, 4e6], [1e18, 1e18, 1e19, 1e19, 1e19], [3, 2.9, 2.5, 2.4, 2.45]),
     "needs at least 3 different sizes per budget"),
    (lambda: isoflop_method([1e6, 2e6, 4e6], [1e18] * 3, [3, 2.9, 3]), "at least two budgets"),
    (lambda: envelope_method([(1e6, [1e18, 1e19], [3.0, 2.5])] * 2), "at least two model sizes"),
    (lambda: envelope_method([(1e6, [0.0, 1e19], [3.0, 2.5]), (2e6, [1e18, 1e19], [3.0, 2.4])]),
     "positive and increasing"),
])
def test_bad_input_is_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------- sweeps

BASE = TransformerConfig(vocab_size=64, context_length=16, n_heads=2)
OPTIONS = SweepOptions(batch_size=4, context_length=16, lr=1e-2, eval_batches=2, curve_points=5)
SIZES = [dict(d_model=8, n_layers=1), dict(d_model=16, n_layers=1)]


def _data():
    return np.random.default_rng(0).integers(0, 64, 5_000).astype(np.uint16)


def _counting(monkeypatch):
    trained = []
    real = sweep_module.train_run

    def counted(run, *args, **kwargs):
        trained.append(run["key"])
        return real(run, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "train_run", counted)
    return trained


def test_sweep_resumes_without_redoing_finished_runs(tmp_path, monkeypatch):
    data = _data()
    runs = plan_sweep(SIZES, [3e7, 6e7], BASE, OPTIONS)
    assert len(runs) == 4 and all(r["steps"] >= 10 for r in runs)

    # An interrupted sweep: the third run is killed while training.
    calls = []
    real = sweep_module.train_run

    def killed_on_third(run, *args, **kwargs):
        calls.append(run["key"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(run, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "train_run", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(runs, tmp_path, data, data, OPTIONS, progress=False)
    monkeypatch.setattr(sweep_module, "train_run", real)
    finished = load_records(tmp_path)
    assert len(finished) == 2 and set(finished) == set(calls[:2])

    # A half-written record (a writer killed mid-file) and a stray temporary file are not finished runs.
    damaged = tmp_path / f"run-{calls[0]}.json"
    damaged.write_text(damaged.read_text()[:50])
    (tmp_path / f"run-{calls[1]}.json.tmp123").write_text("{")
    kept = (tmp_path / f"run-{calls[1]}.json").read_text()

    trained = _counting(monkeypatch)
    records = run_sweep(runs, tmp_path, data, data, OPTIONS, progress=False)
    assert sorted(trained) == sorted({calls[0], calls[2], *({r["key"] for r in runs} - set(calls))})
    assert calls[1] not in trained and (tmp_path / f"run-{calls[1]}.json").read_text() == kept
    assert len(records) == 4 and all(np.isfinite(r["final_loss"]) for r in records)
    rec = json.loads((tmp_path / f"run-{runs[0]['key']}.json").read_text())
    assert rec["curve"]["flops"][-1] == pytest.approx(6 * rec["params"] * rec["tokens"])

    trained.clear()
    run_sweep(runs, tmp_path, data, data, OPTIONS, progress=False)
    assert trained == []  # everything finished: nothing retrained


def test_sweep_in_worker_processes_writes_the_same_records(tmp_path):
    path = tmp_path / "tokens.bin"
    _data().tofile(path)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    runs = plan_sweep(SIZES, [3e7], BASE, OPTIONS)
    parallel = run_sweep(runs, tmp_path / "parallel", data, data, OPTIONS, workers=2, progress=False)
    serial = run_sweep(runs, tmp_path / "serial", data, data, OPTIONS, progress=False)
    for a, b in zip(parallel, serial):  # the same seed and batches on the CPU: the same losses
        assert a["key"] == b["key"] and a["final_loss"] == pytest.approx(b["final_loss"], rel=1e-4)
    with pytest.raises(ValueError, match="np.memmap"):
        run_sweep(runs, tmp_path / "x", _data(), _data(), OPTIONS, workers=2, progress=False)


@pytest.mark.gpu
def test_sweep_trains_concurrently_on_one_gpu(tmp_path):
    path = tmp_path / "tokens.bin"
    _data().tofile(path)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    runs = plan_sweep(SIZES, [3e7, 6e7], BASE, OPTIONS)
    parallel = run_sweep(runs, tmp_path / "parallel", data, data, OPTIONS, "cuda", workers=4, progress=False)
    serial = run_sweep(runs, tmp_path / "serial", data, data, OPTIONS, "cuda", progress=False)
    assert [r["key"] for r in parallel] == [r["key"] for r in serial] == [r["key"] for r in runs]
    for a, b in zip(parallel, serial):  # bf16 autocast: equal up to GPU non-determinism
        assert a["device"] == "cuda" and a["final_loss"] == pytest.approx(b["final_loss"], rel=2e-2)


# ------------------------------------------------------------------------------------- batch size


def test_noise_scale_matches_closed_form_for_linear_regression():
    # Per-example loss (x·w − y)²/2 with x ~ N(0, I_d), y = x·w* + ε, ε ~ N(0, σ²). With δ = w − w*,
    # the gradient (x·δ − ε)·x has mean G = δ and covariance Σ = (|δ|² + σ²)·I + δδᵀ, so
    # B_simple = tr Σ / |G|² = (d·(|δ|² + σ²) + |δ|²) / |δ|².
    d, sigma = 10, 1.0
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    delta = torch.randn(d, generator=gen, dtype=torch.float64)
    delta = delta / delta.norm()                                    # |δ| = 1
    w = (w_star + delta).requires_grad_()

    def sample(b):
        x = torch.randn(b, d, generator=gen, dtype=torch.float64)
        return x, x @ w_star + sigma * torch.randn(b, generator=gen, dtype=torch.float64)

    def loss_fn(batch):
        x, y = batch
        return 0.5 * ((x @ w - y) ** 2).mean()

    est = gradient_noise_scale(loss_fn, [w], sample, small=4, big=128, repeats=200)
    expected = d * (1 + sigma ** 2) + 1
    assert abs(est.b_simple / expected - 1) < 0.1, (est, expected)
    assert abs(est.grad_sq - 1) < 0.1


def test_noise_from_norms_and_critical_batch_fit_are_exact_on_exact_inputs():
    grad_sq, trace = 2.0, 50.0
    g2 = {b: grad_sq + trace / b for b in (8, 64)}
    assert noise_from_norms(g2[8], g2[64], 8, 64) == pytest.approx((grad_sq, trace))
    S_min, E_min = 100.0, 6400.0                                    # B_crit = 64
    B = np.array([8, 16, 32, 64, 128, 256])
    fit = fit_critical_batch(B, S_min + E_min / B)
    assert fit["B_crit"] == pytest.approx(64.0) and fit["S_min"] == pytest.approx(S_min)
    assert steps_to_target([5, 4, 3, 2, 1], 2.5) == 4 and steps_to_target([5, 4], 1.0) is None
    with pytest.raises(ValueError, match="multiple of small"):
        gradient_noise_scale(None, [], None, small=3, big=8)


def test_figure4_fit_command_reproduces_the_published_replication(capsys):
    """`python -m lmfs.scaling chinchilla` on the 240 runs lands on Besiroglu et al.'s estimates."""
    from lmfs.scaling.__main__ import main

    result = main(["chinchilla", "--bootstrap", "0"])
    ours, theirs = result["lmfs"], result["published"]["Besiroglu et al. 2024"]
    assert result["fitted_runs"] == 240 and "ci95" not in ours
    for name, tol in (("E", 0.02), ("alpha", 0.01), ("beta", 0.01)):
        assert abs(ours[name] - theirs[name]) < tol, (name, ours[name], theirs[name])
    assert abs(ours["tokens_per_param"] / theirs["tokens_per_param"] - 1) < 0.1
    assert "Besiroglu et al. 2024" in capsys.readouterr().out
