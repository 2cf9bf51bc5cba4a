"""Checkers for the exercises of lecture 11 (scaling laws 2: μP and WSD).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with :mod:`lmfs.scaling.mup` (the μP rules the lecture trains with) or with
:func:`lmfs.optim.warmup_stable_decay`.
"""

from __future__ import annotations

from collections.abc import Callable

from lmfs.exercises import check
from lmfs.nn import TransformerConfig
from lmfs.optim import warmup_stable_decay
from lmfs.scaling.mup import mup_rules

# Widths and shapes that differ in what the rates depend on: the width multiplier, an explicit d_ff
# (its own multiplier for the down projection), an untied head, learned positions, biases.
_MUP_CASES = [
    (dict(vocab_size=100, d_model=128, n_layers=2, n_heads=4), 32, 1e-2),
    (dict(vocab_size=100, d_model=32, n_layers=1, n_heads=4), 32, 3e-3),     # the base itself
    (dict(vocab_size=64, d_model=96, n_layers=2, n_heads=2, d_ff=200, tie_embeddings=False), 48, 1e-3),
    (dict(vocab_size=50, d_model=256, n_layers=1, n_heads=8, positions="learned", bias=True,
          ffn="gelu", context_length=16), 64, 2e-2),
]


def _mup_lrs_reference(config: TransformerConfig, base_width: int, lr: float) -> dict[str, float]:
    return {name: lr * rule.lr_mult for name, rule in mup_rules(config, base_width).items()}


def check_mup_lrs(answer: Callable[[TransformerConfig, int, float], dict]) -> int:
    """``mup_lrs(config, base_width, lr)``: the Adam learning rate of every parameter of
    ``TransformerLM(config)`` under μP with base width ``base_width`` and base rate ``lr``, as a
    dict ``{parameter name: rate}`` (names as ``model.named_parameters()`` gives them). Compared
    with :func:`lmfs.scaling.mup.mup_rules`."""
    cases = [(TransformerConfig(**fields), base, lr) for fields, base, lr in _MUP_CASES]

    def describe(case):
        c, base, lr = case
        return (f"(d_model={c.d_model}, d_ff={c.ffn_dim}, base_width={base}, lr={lr}, "
                f"tie_embeddings={c.tie_embeddings}, positions={c.positions!r}, bias={c.bias})")

    def compared(reference):
        # Same keys, then the rates within tolerance, so a missing name says which one.
        def run(config, base, lr):
            return sorted(reference(config, base, lr).items())
        return run

    return check("mup_lrs", compared(answer), compared(_mup_lrs_reference), cases, describe=describe,
                 rtol=1e-6, atol=0.0)


def _wsd_cases():
    for max_lr, min_lr, warmup, start, decay in [(1e-3, 1e-4, 10, 60, 20), (3e-2, 0.0, 0, 5, 5),
                                                 (1.0, 0.1, 4, 4, 12)]:
        for step in sorted({0, max(warmup - 1, 0), warmup, start - 1, start, start + decay // 2,
                            start + decay - 1, start + decay, start + decay + 7}):
            yield step, max_lr, min_lr, warmup, start, decay


def check_wsd_lr(answer: Callable[[int, float, float, int, int, int], float]) -> int:
    """``wsd_lr(step, max_lr, min_lr, warmup_steps, decay_start, decay_steps)``: the rate of a
    WSD run that warms up linearly from 0 over ``warmup_steps``, holds ``max_lr`` until step
    ``decay_start`` and then decays linearly to ``min_lr`` over ``decay_steps`` (and stays there).
    Compared with :func:`lmfs.optim.warmup_stable_decay`."""
    def reference(step, max_lr, min_lr, warmup, start, decay):
        return warmup_stable_decay(step, max_lr, min_lr, warmup, start - warmup, decay)

    return check("wsd_lr", lambda *case: float(answer(*case)), reference, _wsd_cases(), rtol=1e-9, atol=1e-12)
