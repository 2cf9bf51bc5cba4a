"""Checkers for the exercises of lecture 15 (SFT and RLHF).

* :func:`check_sft_labels`: next-token labels with the prompt masked, against
  :func:`lmfs.alignment.sft.pack` on one example.
* :func:`check_dpo_loss`: DPO's loss from summed log-probs, against :func:`lmfs.alignment.dpo_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmfs.alignment.preference import dpo_loss
from lmfs.alignment.sft import pack
from lmfs.exercises import check


def _labels_reference(ids: list[int], mask: list[bool]) -> list[int]:
    return pack([(ids, mask)], len(ids))["labels"][0].tolist()


def check_sft_labels(answer: Callable[[list[int], list[bool]], list[int]]) -> int:
    """``sft_labels(ids, mask)`` -> ``labels``: for an example's token ids and loss mask (True on
    response tokens), ``labels[t]`` is the token after position ``t`` when that token is a response
    token, else -100; the last position has no next token (-100). Compared with
    :func:`lmfs.alignment.sft.pack`."""
    cases = [
        ([5, 6, 7, 8, 9], [False, False, True, True, True]),
        ([1, 2, 3], [False, False, True]),
        ([4, 4, 4, 4], [False, True, True, True]),
        ([10, 11, 12, 13, 14, 15], [False, False, False, False, False, True]),
        ([3, 1, 4, 1, 5, 9, 2, 6], [False, False, False, True, True, True, True, True]),
    ]
    return check("sft_labels", lambda ids, mask: [int(x) for x in answer(ids, mask)], _labels_reference, cases)


def _dpo_cases():
    generator = torch.Generator().manual_seed(0)
    for B, beta in ((1, 0.1), (4, 0.5), (16, 0.05), (8, 2.0)):
        pc, pr, rc, rr = (-20 * torch.rand(B, generator=generator) for _ in range(4))
        yield pc, pr, rc, rr, beta


def check_dpo_loss(answer: Callable[..., torch.Tensor]) -> int:
    """``dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)`` -> the mean DPO loss
    (a 0-dim tensor) from summed response log-probs ``(B,)``, compared with
    :func:`lmfs.alignment.dpo_loss`."""
    return check("dpo_loss", lambda *case: torch.as_tensor(answer(*case)).float().reshape(()),
                 lambda *case: dpo_loss(*case)[0].float().reshape(()), _dpo_cases(),
                 describe=lambda c: f"B={len(c[0])}, beta={c[4]}")
