"""Optimizers, learning-rate schedules and gradient clipping, written out.

* :mod:`lmfs.optim.optimizers`: ``SGD``, ``AdaGrad``, ``Adam``, ``AdamW`` (``adam_state_for``: their state
  dicts and ``torch.optim``'s Adam/AdamW's, one into the other).
* :mod:`lmfs.optim.schedules`: ``cosine_with_warmup``, ``warmup_stable_decay``, ``as_lr_lambda``.
* :mod:`lmfs.optim.clip`: ``clip_grad_norm``.
"""

from lmfs.optim.clip import clip_grad_norm
from lmfs.optim.optimizers import SGD, AdaGrad, Adam, AdamW, adam_state_for
from lmfs.optim.schedules import as_lr_lambda, cosine_with_warmup, warmup_stable_decay

__all__ = ["SGD", "AdaGrad", "Adam", "AdamW", "adam_state_for", "as_lr_lambda", "clip_grad_norm",
           "cosine_with_warmup", "warmup_stable_decay"]
