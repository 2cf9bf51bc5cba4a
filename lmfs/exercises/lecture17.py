"""Checkers for the exercises of lecture 17 (alignment: RL 2, the GRPO trainer).

* :func:`check_masked_sequence_loss`: against :func:`lmfs.alignment.pg.aggregate` with
  ``how="sequence_mean"``, on batches with padding, responses of different lengths and empty ones.
* :func:`check_k3_gradient`: the expected gradient of the ``k3`` penalty with respect to the
  policy's logits, against the gradient of ``KL(pi_ref || pi)`` by autograd on the closed form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.alignment.pg import aggregate, kl_estimate
from lmfs.exercises import check


def _loss_cases():
    generator = torch.Generator().manual_seed(0)
    for B, T in ((1, 1), (2, 5), (4, 7), (8, 16)):
        per_token = torch.randn(B, T, generator=generator)
        lengths = torch.randint(0, T + 1, (B,), generator=generator)
        lengths[0] = T                                   # at least one full response
        if B > 1:
            lengths[-1] = 0                              # and an empty one (from the second case on)
        mask = torch.arange(T)[None, :] < lengths[:, None]
        per_token = per_token.masked_fill(~mask, 1e3)    # padding holds junk that must not leak
        yield per_token, mask
    yield torch.full((2, 3), 1e3), torch.zeros(2, 3, dtype=torch.bool)   # nothing to score: 0


def check_masked_sequence_loss(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``sequence_loss(per_token, mask)``: per-token losses ``(B, T)`` and a bool ``mask`` ``(B, T)``
    (True on response tokens) -> the mean over responses that have tokens of each response's mean
    per-token loss; padding never counts, and a batch without any response token gives 0."""
    return check("sequence_loss", lambda x, m: torch.as_tensor(answer(x, m)).float().reshape(()),
                 lambda x, m: aggregate(x, m, how="sequence_mean").float().reshape(()), _loss_cases(),
                 atol=1e-5, rtol=1e-5)


def _gradient_cases():
    generator = torch.Generator().manual_seed(1)
    for shape in ((2,), (6,), (3, 5), (2, 4, 11)):
        logits = torch.randn(shape, generator=generator, dtype=torch.float64)
        yield logits, logits + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.7
    same = torch.randn(5, generator=generator, dtype=torch.float64)
    yield same, same.clone()                             # identical policies: no pull at all


def _reverse_kl_gradient(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The gradient of ``KL(pi_ref || pi)`` (summed over leading dimensions) by autograd."""
    z = logits.detach().clone().requires_grad_(True)
    ref = torch.softmax(ref_logits, -1)
    (ref * (ref.log() - torch.log_softmax(z, -1))).sum().backward()
    return z.grad


def check_k3_gradient(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``k3_gradient(logits, ref_logits)``: the policy's and the reference's logits ``(..., V)`` ->
    the expected gradient ``E_{v ~ pi}[grad_logits k3(v)]`` ``(..., V)`` of the per-token ``k3``
    penalty (:func:`lmfs.alignment.pg.kl_estimate`) with the sampled token held fixed, as the GRPO
    loss differentiates it. Checked against the gradient of ``KL(pi_ref || pi)``: the KL the
    penalty pulls toward."""
    return check("k3_gradient", answer, _reverse_kl_gradient, _gradient_cases(), atol=1e-8, rtol=1e-6)
