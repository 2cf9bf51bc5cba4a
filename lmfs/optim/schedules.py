"""Learning-rate schedules as pure functions of the step number.

A pure function is easy to plot, test and reason about; set the rate each step with
``for g in optimizer.param_groups: g["lr"] = schedule(step, ...)``, or hand
:func:`as_lr_lambda` to ``torch.optim.lr_scheduler.LambdaLR``.

Both schedules warm up linearly from 0 at step 0 to ``max_lr`` at step ``warmup_steps``: Adam's
second-moment estimate is noisy over the first steps, and large steps then can diverge.
Every ``*_steps`` argument is the *length* of its phase, so a schedule ends at the sum of them;
after that the rate stays at ``min_lr``.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def _warmup(step: int, max_lr: float, warmup_steps: int) -> float:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return max_lr * step / warmup_steps


def cosine_with_warmup(step: int, max_lr: float, min_lr: float, warmup_steps: int,
                       cosine_steps: int) -> float:
    """Linear warmup over ``warmup_steps``, then a half cosine from ``max_lr`` to ``min_lr``
    over ``cosine_steps``, then ``min_lr``.

    At step ``warmup_steps + t`` with ``0 <= t <= cosine_steps``:
    ``min_lr + (max_lr - min_lr) · (1 + cos(π t / cosine_steps)) / 2``.
    """
    if step < warmup_steps:
        return _warmup(step, max_lr, warmup_steps)
    t = step - warmup_steps
    if t >= cosine_steps:
        return min_lr
    return min_lr + (max_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t / cosine_steps))


def warmup_stable_decay(step: int, max_lr: float, min_lr: float, warmup_steps: int,
                        stable_steps: int, decay_steps: int) -> float:
    """Warmup, then ``max_lr`` for ``stable_steps``, then a linear decay to ``min_lr`` over
    ``decay_steps`` (WSD, as in MiniCPM).

    Unlike cosine, the stable phase does not depend on when training ends, so one long run can
    branch off short decays at any checkpoint and give a whole loss-vs-compute curve.
    """
    if step < warmup_steps:
        return _warmup(step, max_lr, warmup_steps)
    t = step - warmup_steps
    if t < stable_steps:
        return max_lr
    t -= stable_steps
    if t >= decay_steps:
        return min_lr
    return max_lr + (min_lr - max_lr) * t / decay_steps


def as_lr_lambda(schedule: Callable[..., float], **kwargs) -> Callable[[int], float]:
    """``step -> schedule(step, **kwargs) / max_lr``, the multiplier ``LambdaLR`` expects.

    ``LambdaLR`` multiplies the optimizer's initial ``lr`` by this factor, so build the optimizer
    with ``lr=max_lr``::

        sched = LambdaLR(opt, as_lr_lambda(cosine_with_warmup, max_lr=3e-4, min_lr=3e-5,
                                           warmup_steps=100, cosine_steps=900))
    """
    if "max_lr" not in kwargs or kwargs["max_lr"] <= 0:
        raise ValueError("as_lr_lambda needs a positive max_lr keyword (the optimizer's lr)")
    return lambda step: schedule(step, **kwargs) / kwargs["max_lr"]
