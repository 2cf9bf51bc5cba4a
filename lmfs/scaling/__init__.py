"""Scaling laws: fits with uncertainty, Chinchilla's three methods, sweeps, the critical batch size.

* :mod:`lmfs.scaling.fits`: power laws with an irreducible term and Chinchilla's ``L(N, D)``, fitted
  with a Huber loss in log space from many starts, with bootstrap intervals.
* :mod:`lmfs.scaling.chinchilla`: the envelope, IsoFLOP and parametric methods on one set of runs;
  the published fits; the runs of Chinchilla's Figure 4.
* :mod:`lmfs.scaling.sweep`: train a grid of model sizes × FLOP budgets, resumable, on several
  processes at once.
* :mod:`lmfs.scaling.batch_size`: the gradient noise scale and the critical batch size.
* :mod:`lmfs.scaling.mup`: μP (lecture 11).
"""

from lmfs.scaling.batch_size import (NoiseScale, fit_critical_batch, gradient_noise_scale, model_noise_scale,
                                     noise_from_norms, steps_to_target)
from lmfs.scaling.chinchilla import (BESIROGLU_2024, HOFFMANN_2022, HOFFMANN_2022_TEX, Allocation, envelope_method, isoflop_method,
                                     isoflop_profile, law_allocation, load_chinchilla_runs, parametric_method)
from lmfs.scaling.fits import ChinchillaFit, ChinchillaLaw, PowerLawFit, fit_chinchilla, fit_power_law
from lmfs.scaling.sweep import SweepOptions, load_records, plan_sweep, run_sweep, sweep_curves, sweep_frame

__all__ = [
    "Allocation", "BESIROGLU_2024", "ChinchillaFit", "ChinchillaLaw", "HOFFMANN_2022", "HOFFMANN_2022_TEX",
    "NoiseScale",
    "PowerLawFit", "SweepOptions", "envelope_method", "fit_chinchilla", "fit_critical_batch", "fit_power_law",
    "gradient_noise_scale", "isoflop_method", "isoflop_profile", "law_allocation", "load_chinchilla_runs",
    "load_records", "model_noise_scale", "noise_from_norms", "parametric_method", "plan_sweep", "run_sweep",
    "steps_to_target", "sweep_curves", "sweep_frame",
]
