"""The critical batch size: where a larger batch stops buying fewer steps.

McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch Training". A batch of
``B`` examples gives a gradient estimate ``G_B`` whose noise shrinks as ``1/B``; the per-example
gradients have mean ``G`` (the true gradient) and covariance ``Σ``, so

    E|G_B|² = |G|² + tr(Σ)/B.

Below the **simple noise scale** ``B_simple = tr(Σ)/|G|²`` the noise dominates and doubling the
batch nearly halves the steps needed (perfect scaling); far above it the gradient is already
exact and a larger batch only costs more examples. Two measurements, two functions:

* :func:`gradient_noise_scale` estimates ``|G|²`` and ``tr(Σ)`` from squared gradient norms at
  two batch sizes (their appendix A.1) and returns ``B_simple``.
* :func:`fit_critical_batch` fits the steps ``S`` and examples ``E = B·S`` that runs with several
  batch sizes needed to reach one target loss, ``S = S_min + E_min/B`` (their eq. 2.11, rearranged),
  and returns ``B_crit = E_min/S_min``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lmfs.train.data import get_batch


@dataclass
class NoiseScale:
    """``B_simple = trace / grad_sq``, from ``repeats`` measurements at batch sizes ``small`` and ``big``."""

    b_simple: float
    trace: float       # tr(Σ): the summed variance of one example's gradient
    grad_sq: float     # |G|²: the squared norm of the true gradient
    small: int
    big: int
    repeats: int


def noise_from_norms(g2_small: float, g2_big: float, small: int, big: int) -> tuple[float, float]:
    """``(|G|², tr Σ)`` from the mean squared gradient norms at batch sizes ``small`` and ``big``.

    Two equations ``E|G_B|² = |G|² + tr(Σ)/B`` in two unknowns:
    ``|G|² = (big·g2_big − small·g2_small)/(big − small)`` and
    ``tr Σ = (g2_small − g2_big)/(1/small − 1/big)``; both unbiased.
    """
    if not 0 < small < big:
        raise ValueError(f"need 0 < small < big batch sizes, got small={small}, big={big}")
    grad_sq = (big * g2_big - small * g2_small) / (big - small)
    trace = (g2_small - g2_big) / (1 / small - 1 / big)
    return grad_sq, trace


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads]).double()


def gradient_noise_scale(loss_fn: Callable[[object], torch.Tensor], params: list[torch.Tensor],
                         sample: Callable[[int], object], small: int, big: int,
                         repeats: int = 8) -> NoiseScale:
    """Estimate ``B_simple`` from gradients at batch sizes ``small`` and ``big`` (a multiple of it).

    ``sample(b)`` draws a batch of ``b`` examples; ``loss_fn(batch)`` is the **mean** loss over it.
    Each repeat draws ``big`` examples, computes the gradient of each of its ``big/small``
    slices of ``small`` examples, and takes their mean as the big-batch gradient (the mean of
    equal slices' mean losses is the whole batch's mean loss): one pass gives both norms. The
    norms are averaged over repeats before the ratio is taken, since the ratio of two noisy
    averages is less biased than the average of noisy ratios.
    """
    if big % small:
        raise ValueError(f"big={big} must be a multiple of small={small} (the big batch is made of small ones)")
    params = [p for p in params if p.requires_grad]
    g2_small, g2_big = [], []
    for _ in range(repeats):
        batch = sample(big)
        grads = [_flat_grad(loss_fn(part), params) for part in _split(batch, big // small)]
        g2_small.append(float(np.mean([g.square().sum().item() for g in grads])))
        g2_big.append(torch.stack(grads).mean(0).square().sum().item())
    grad_sq, trace = noise_from_norms(float(np.mean(g2_small)), float(np.mean(g2_big)), small, big)
    return NoiseScale(trace / grad_sq, trace, grad_sq, small, big, repeats)


def _split(batch, parts: int):
    """Split a tensor, or a tuple of tensors, into ``parts`` equal slices along the first dimension."""
    if isinstance(batch, torch.Tensor):
        return batch.chunk(parts)
    return list(zip(*(t.chunk(parts) for t in batch)))


def model_noise_scale(model: torch.nn.Module, data: np.ndarray, context_length: int, small: int, big: int,
                      repeats: int = 8, seed: int = 0) -> NoiseScale:
    """:func:`gradient_noise_scale` of a language model on token ids ``data``, in its current state.

    One example is one sequence of ``context_length`` tokens; the loss is the model's mean
    next-token loss. The batches come from a generator seeded with ``seed``.
    """
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.train()
    result = gradient_noise_scale(lambda xy: model(*xy)[1], list(model.parameters()),
                                  lambda b: get_batch(data, b, context_length, device, generator),
                                  small, big, repeats)
    model.train(was_training)
    return result


def steps_to_target(losses, target: float, k: int = 1) -> int | None:
    """The first step (1-based) where the ``k``-step trailing mean of ``losses`` is at most
    ``target``; ``None`` if it never gets there."""
    from lmfs.train import smooth

    reached = np.flatnonzero(smooth(losses, k) <= target)
    return int(reached[0]) + 1 if reached.size else None


def fit_critical_batch(batch_sizes, steps) -> dict:
    """Fit ``S = S_min + E_min/B`` to the steps ``S`` each batch size ``B`` needed for one target.

    McCandlish et al.'s trade-off ``(S/S_min − 1)(E/E_min − 1) = 1`` with ``E = B·S`` is exactly
    this line in ``1/B``: intercept ``S_min`` (steps with an infinite batch), slope ``E_min``
    (examples with a tiny batch). Returns ``S_min``, ``E_min`` and ``B_crit = E_min/S_min``.
    """
    B, S = np.asarray(batch_sizes, dtype=np.float64), np.asarray(steps, dtype=np.float64)
    if B.size != S.size or np.unique(B).size < 2:
        raise ValueError("need the steps of at least two different batch sizes, one value per batch size")
    E_min, S_min = np.polyfit(1 / B, S, 1)
    if S_min <= 0 or E_min <= 0:
        raise ValueError(f"the fit gave S_min={S_min:.3g}, E_min={E_min:.3g}: not the expected trade-off "
                         "(steps should fall as the batch grows); use a reachable target and more batch sizes")
    return dict(S_min=float(S_min), E_min=float(E_min), B_crit=float(E_min / S_min))
