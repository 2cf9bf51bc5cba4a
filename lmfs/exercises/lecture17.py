"""Checkers for the exercises of lecture 17 (alignment: RL 2, the GRPO trainer).

* :func:`check_masked_sequence_loss`: against :func:`lmfs.alignment.pg.aggregate` with
  ``how="sequence_mean"``, on batches with padding, responses of different lengths and empty ones.
* :func:`check_kl_k3`: against :func:`lmfs.alignment.pg.kl_estimate` with ``kind="k3"``.
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


def _kl_cases():
    generator = torch.Generator().manual_seed(1)
    for shape in ((3,), (2, 5), (4, 9)):
        logp = -torch.rand(shape, generator=generator) * 3
        yield logp, logp + torch.randn(shape, generator=generator) * 0.5
    same = -torch.rand(4, generator=generator)
    yield same, same.clone()                             # identical policies: exactly 0


def check_kl_k3(answer: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> int:
    """``kl_k3(logp, ref_logp)``: log-probs of the sampled tokens under the policy and the reference
    (same shape) -> Schulman's per-token ``k3`` estimate of ``KL(policy || reference)``, with
    ``r = pi_ref / pi``: ``(r - 1) - log r``."""
    return check("kl_k3", answer, lambda lp, ref: kl_estimate(lp, ref, kind="k3"), _kl_cases(),
                 atol=1e-6, rtol=1e-5)
