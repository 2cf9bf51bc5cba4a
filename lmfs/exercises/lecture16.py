"""Checkers for the exercises of lecture 16 (policy gradients, GRPO).

* :func:`check_group_advantages`: against a loop over the groups in float64 (mean, sample std).
* :func:`check_grpo_clip_loss`: against the clipped surrogate written out token by token.
* :func:`check_kl_k3`: against ``(r - 1) - log r`` computed in float64 from the two log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lmfs.exercises import check


def _group_cases():
    generator = torch.Generator().manual_seed(0)
    yield torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, True
    yield torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 4, True      # an all-equal group: zeros
    yield torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 4, False
    yield torch.randint(0, 2, (48,), generator=generator).float(), 8, True     # verifier rewards
    yield torch.randn(30, generator=generator) * 2 + 5, 3, True                  # continuous rewards
    yield torch.randn(30, generator=generator) * 2 + 5, 5, False


def _group_advantages_loop(rewards: torch.Tensor, group_size: int, normalize_std: bool) -> torch.Tensor:
    out = []
    values = rewards.double().tolist()
    for start in range(0, len(values), group_size):
        group = values[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + 1e-6) if normalize_std else r - mean for r in group]
    return torch.tensor(out, dtype=torch.float32)


def check_group_advantages(answer: Callable[[torch.Tensor, int, bool], torch.Tensor]) -> int:
    """``group_advantages(rewards, group_size, normalize_std)``: ``rewards`` ``(N,)`` in consecutive
    groups -> ``(N,)`` advantages ``r - mean(group)``, divided by ``std(group) + 1e-6`` (the sample
    std, ``G - 1`` in the denominator) when ``normalize_std``. All-equal groups must give zeros."""
    return check("group_advantages", answer, _group_advantages_loop, _group_cases(), atol=1e-4, rtol=1e-4,
                 describe=lambda c: f"(rewards of {len(c[0])}, group_size={c[1]}, normalize_std={c[2]})")


def _clip_cases():
    generator = torch.Generator().manual_seed(1)
    for B, T, spread, clip in ((2, 3, 0.0, 0.2), (4, 6, 0.5, 0.2), (3, 5, 1.0, 0.1), (5, 4, 0.3, 0.3)):
        logp = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 2
        old_logp = logp + torch.randn(B, T, generator=generator, dtype=torch.float64) * spread
        advantages = torch.randn(B, generator=generator, dtype=torch.float64)
        yield logp, old_logp, advantages, clip


def _grpo_clip_brute(logp, old_logp, advantages, clip) -> torch.Tensor:
    out = torch.empty_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            ratio = math.exp(logp[i, t].item() - old_logp[i, t].item())
            a = advantages[i].item()
            out[i, t] = -min(ratio * a, min(max(ratio, 1 - clip), 1 + clip) * a)
    return out


def check_grpo_clip_loss(answer: Callable[..., torch.Tensor]) -> int:
    """``grpo_clip_loss(logp, old_logp, advantages, clip)``: ``(B, T)`` log-probs under the current and
    the sampling policy, ``(B,)`` advantages -> ``(B, T)`` per-token losses
    ``-min(rho * A, clamp(rho, 1 - clip, 1 + clip) * A)`` with ``rho = exp(logp - old_logp)``."""
    return check("grpo_clip_loss", answer, _grpo_clip_brute, _clip_cases(), atol=1e-9, rtol=1e-9)


def _kl_cases():
    generator = torch.Generator().manual_seed(2)
    yield torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -2.0])                # equal policies: 0
    for spread in (0.1, 1.0, 3.0):
        logp = -torch.rand(3, 7, generator=generator, dtype=torch.float64) * 4
        yield logp, logp + torch.randn(3, 7, generator=generator, dtype=torch.float64) * spread


def _k3_reference(logp, ref_logp) -> torch.Tensor:
    log_r = ref_logp.double() - logp.double()
    return (log_r.exp() - 1 - log_r).to(logp.dtype)


def check_kl_k3(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``kl_k3(logp, ref_logp)``: the per-token ``k3`` estimate of ``KL(policy || reference)`` from the
    sampled tokens' log-probs, ``(r - 1) - log r`` with ``r = exp(ref_logp - logp)``, same shape."""
    return check("kl_k3", answer, _k3_reference, _kl_cases(), atol=1e-6, rtol=1e-6)
