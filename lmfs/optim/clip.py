"""Gradient clipping by global norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                   eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients together so that their joint L2 norm is at most ``max_norm``.

    The norm is over every gradient entry as one long vector; each gradient is multiplied by
    ``min(1, max_norm / (norm + eps))``, so the update's direction is kept and only its length
    shrinks (``eps`` guards against dividing by 0). Returns the norm *before* clipping, which is
    worth logging: spikes in it often come just before loss spikes. Parameters without a
    gradient are skipped, as in ``torch.nn.utils.clip_grad_norm_``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
    total_norm = torch.linalg.vector_norm(norms)  # sqrt of the sum of squared per-tensor norms
    scale = torch.clamp(max_norm / (total_norm + eps), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return total_norm
