"""Checkers for the exercises of lecture 12 (evaluation).

* :func:`check_pass_at_k`: against brute-force enumeration of every subset of ``k`` samples (small
  ``n``) and :func:`lmfs.eval.pass_at_k` (large ``n``, where enumeration is too slow).
* :func:`check_bits_per_byte`: against a direct sum of log-softmax entries.
* :func:`check_choose`: against :func:`lmfs.eval.choice_predictions`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch

from lmfs.eval import ContinuationScore, choice_predictions, pass_at_k
from lmfs.exercises import check


def _pass_at_k_brute(n: int, c: int, k: int) -> float:
    """The share of the ``C(n, k)`` subsets of ``k`` samples (``c`` of ``n`` correct) holding a correct one."""
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    return sum(any(s) for s in subsets) / len(subsets)


def check_pass_at_k(answer: Callable[[int, int, int], float]) -> int:
    """``pass_at_k(n, c, k)``: ``n`` samples of which ``c`` pass -> the unbiased pass@k estimate.

    Every ``n <= 7`` case is compared with enumeration; a few large ones (``n`` = 100, 200) with
    :func:`lmfs.eval.pass_at_k`.
    """
    small = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]
    n_small = check("pass_at_k", answer, _pass_at_k_brute, small, atol=1e-9, rtol=0)
    large = [(100, 0, 1), (100, 3, 10), (200, 1, 100), (200, 150, 5), (200, 190, 20)]
    return n_small + check("pass_at_k (large n)", answer, pass_at_k, large, atol=1e-9, rtol=1e-9)


def _bpb_cases():
    generator = torch.Generator().manual_seed(0)
    texts = ["The cat sat.", "Ein Bär aß Äpfel.", "naïve café, ☕ and 😀", "x" * 40]
    for i, text in enumerate(texts):
        T, V = 3 + 4 * i, 7 + 11 * i
        logits = torch.randn(T, V, generator=generator) * (1 + i)
        targets = torch.randint(0, V, (T,), generator=generator)
        yield logits, targets, text


def _bits_per_byte_reference(logits: torch.Tensor, targets: torch.Tensor, text: str) -> float:
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -sum(logp[t, targets[t]].item() for t in range(len(targets)))
    return nll / math.log(2) / len(text.encode("utf-8"))


def check_bits_per_byte(answer: Callable[[torch.Tensor, torch.Tensor, str], float]) -> int:
    """``bits_per_byte(logits, targets, text)``: ``logits`` ``(T, V)`` predicting ``targets`` ``(T,)``,
    which spell ``text`` -> summed negative log-likelihood in bits divided by the text's UTF-8 bytes
    (not its characters: the cases include accents and emoji)."""
    return check("bits_per_byte", answer, _bits_per_byte_reference, _bpb_cases(),
                 describe=lambda case: f"(logits{tuple(case[0].shape)}, targets, {case[2]!r})")


def _choose_cases():
    # (log-probs, tokens, bytes) per option; chosen so raw, per-token and per-byte disagree.
    options = [
        ([-2.0, -5.0, -9.0], [1, 3, 6], [4, 10, 30]),       # raw picks 0, per-token 2, per-byte 2
        ([-4.0, -4.5, -7.0, -3.9], [2, 4, 5, 1], [8, 9, 25, 3]),
        ([-1.0, -1.0], [1, 1], [2, 2]),                     # a tie: the first wins
        ([-12.0, -3.0, -8.0], [6, 1, 2], [40, 5, 6]),
    ]
    for logprobs, n_tokens, n_bytes in options:
        for norm in ("raw", "token", "byte"):
            yield logprobs, n_tokens, n_bytes, norm


def _choose_reference(logprobs, n_tokens, n_bytes, norm) -> int:
    scores = [ContinuationScore(lp, t, b, False) for lp, t, b in zip(logprobs, n_tokens, n_bytes)]
    return choice_predictions(scores, norm)


def check_choose(answer: Callable[[list, list, list, str], int]) -> int:
    """``choose(logprobs, n_tokens, n_bytes, norm)``: one item's options, each with its summed
    log-prob, token count and byte count -> the index of the chosen option under ``norm``
    (``"raw"``: the largest sum; ``"token"``/``"byte"``: the largest sum per token/byte; the first
    of equal ones), compared with :func:`lmfs.eval.choice_predictions`."""
    return check("choose", answer, _choose_reference, _choose_cases())
