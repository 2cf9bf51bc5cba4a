"""The checkers of lecture 11's exercises accept right answers and reject wrong ones."""

import pytest
import torch

from lmfs.exercises.lecture11 import check_mup_lrs, check_wsd_lr
from lmfs.nn import TransformerLM
from lmfs.scaling.mup import config_at_width


def shapes(config):
    with torch.device("meta"):
        return {name: p.shape for name, p in TransformerLM(config).named_parameters()}


def mup_lrs(config, base_width, lr, hidden_scale=lambda ratio: 1 / ratio):
    # Hidden matrices (both dimensions grow): lr · base fan_in / fan_in; everything else: lr.
    base = shapes(config_at_width(config, base_width))
    out = {}
    for name, shape in shapes(config).items():
        is_hidden = len(shape) == 2 and "emb" not in name and "lm_head" not in name
        out[name] = lr * hidden_scale(shape[1] / base[name][1]) if is_hidden else lr
    return out


def wsd_lr(step, max_lr, min_lr, warmup_steps, decay_start, decay_steps):
    if step < warmup_steps:
        return max_lr * step / warmup_steps
    if step < decay_start:
        return max_lr
    return max_lr + (min_lr - max_lr) * min(1.0, (step - decay_start) / decay_steps)


def test_mup_lrs_checker():
    assert check_mup_lrs(mup_lrs) == 4
    with pytest.raises(AssertionError, match="mup_lrs: wrong result"):  # standard parametrisation
        check_mup_lrs(lambda c, b, lr: {name: lr for name in shapes(c)})
    with pytest.raises(AssertionError, match="mup_lrs: wrong result"):  # 1/√m: the init rule, not the rate
        check_mup_lrs(lambda c, b, lr: mup_lrs(c, b, lr, lambda ratio: ratio ** -0.5))
    with pytest.raises(AssertionError, match="mup_lrs: wrong result"):  # the head scaled like a hidden matrix
        check_mup_lrs(lambda c, b, lr: {**mup_lrs(c, b, lr), "tok_emb.weight": lr * b / c.d_model})


def test_wsd_lr_checker():
    assert check_wsd_lr(wsd_lr) == 23
    with pytest.raises(AssertionError, match="wsd_lr: wrong result"):  # decays one step late
        check_wsd_lr(lambda s, *args: wsd_lr(max(s - 1, 0) if s > args[3] else s, *args))
    with pytest.raises(AssertionError, match="wsd_lr: wrong result"):  # never reaches min_lr
        check_wsd_lr(lambda s, hi, lo, w, start, d: wsd_lr(s, hi, lo, w, start, d + 1))
