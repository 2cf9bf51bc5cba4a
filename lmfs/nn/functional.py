"""Softmax, cross-entropy and SiLU written out, each a few lines of tensor operations.

These are the formulas behind ``torch.softmax``, ``F.cross_entropy`` and ``F.silu``, and they
compute the same values (tests compare them, large logits and ``-inf`` masks included). The
model's training path keeps torch's built-ins: they save fewer tensors for the backward pass
(``torch.softmax`` keeps only its output), which the memory model of
:mod:`lmfs.bench.memory` counts byte for byte; :func:`lmfs.nn.generate` samples through
:func:`softmax`.

One trick makes the first two safe in floating point: ``exp`` overflows float32 above about 88,
so each row is shifted by its maximum first. The shift cancels (``softmax(x) = softmax(x - c)``
for any constant ``c``), and the largest exponent becomes ``exp(0) = 1``.
"""

from __future__ import annotations

import torch


def _row_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The maximum along ``dim`` (kept as a size-1 dim), as a constant for autograd: the shift
    cancels in the result, so its gradient is zero anyway. A row of only ``-inf`` is shifted
    by 0 instead, so that it stays ``-inf`` rather than becoming ``-inf - (-inf) = nan``."""
    m = x.detach().amax(dim=dim, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / Σ exp(x)`` along ``dim``: non-negative, summing to 1, order kept.

    ``-inf`` entries (masked positions) get probability 0. A row with every entry ``-inf`` has
    no probability to share out and gives ``nan``, as ``torch.softmax`` does.
    """
    e = torch.exp(x - _row_max(x, dim))
    return e / e.sum(dim=dim, keepdim=True)


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log Σ exp(x)`` along ``dim`` (that dim removed), without overflow: ``m + log Σ exp(x - m)``."""
    m = _row_max(x, dim)
    return (m + torch.log(torch.exp(x - m).sum(dim=dim, keepdim=True))).squeeze(dim)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean of ``-log softmax(logits)[target]`` over the targets that are not ``ignore_index``.

    ``logits`` is ``(N, V)``, ``targets`` integer ``(N,)``. Per row the loss is
    ``logsumexp(logits) - logits[target]``: how far the target's logit falls short of the
    soft maximum. Ignored rows (padding, a prompt) count neither in the sum nor in the mean.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy takes (N, V) logits and (N,) targets, got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}; flatten batch and time first (logits.flatten(0, 1))")
    kept = targets != ignore_index
    target_logit = logits.gather(1, torch.where(kept, targets, 0)[:, None]).squeeze(1)
    row_loss = logsumexp(logits, dim=-1) - target_logit
    return torch.where(kept, row_loss, 0.0).sum() / kept.sum()


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x · sigmoid(x)`` (also called swish): near 0 for large negative ``x``, near ``x`` for
    large positive ``x``, smooth in between, with a small dip below zero (minimum about -0.28)."""
    return x * torch.sigmoid(x)
