"""SGD, AdaGrad, Adam and AdamW, each written out as a ``torch.optim.Optimizer``.

Each ``step`` follows the same update, in the same order, as its ``torch.optim`` namesake with
the same hyperparameters (the extras torch offers, such as dampening, AMSGrad or ``maximize``,
are left out). Subclassing ``Optimizer`` gives us ``param_groups`` (so schedules can change
``lr``), ``zero_grad`` and ``state_dict`` for free; only the update rule is ours.
"""

from __future__ import annotations

import math

import torch


def _check(name: str, value: float, low: float = 0.0, high: float = math.inf):
    if not low <= value < high:
        raise ValueError(f"{name}={value} must lie in [{low}, {high})")


class _Optimizer(torch.optim.Optimizer):
    """What every optimizer here shares: ``step`` evaluates the optional closure, then calls the
    subclass's ``update(p, grad, group, state)`` for each parameter that has a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, p.grad, group, self.state[p])
        return loss

    def update(self, p: torch.Tensor, g: torch.Tensor, group: dict, state: dict) -> None:
        raise NotImplementedError


class SGD(_Optimizer):
    """Stochastic gradient descent with optional momentum, Nesterov momentum and weight decay.

    Per parameter ``p`` with gradient ``g``::

        g = g + weight_decay · p           (L2 regularisation, folded into the gradient)
        b = momentum · b + g               (b starts as the first g, not as 0)
        g = g + momentum · b  if nesterov  else  b
        p = p - lr · g
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0):
        _check("lr", lr)
        _check("momentum", momentum, high=1.0)
        _check("weight_decay", weight_decay)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0 (e.g. momentum=0.9)")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                      weight_decay=weight_decay))

    def update(self, p, g, group, state):
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        if wd != 0:
            g = g.add(p, alpha=wd)
        if mu != 0:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = g.clone()
            else:
                state["momentum_buffer"].mul_(mu).add_(g)
            buf = state["momentum_buffer"]
            g = g.add(buf, alpha=mu) if group["nesterov"] else buf
        p.add_(g, alpha=-lr)


class AdaGrad(_Optimizer):
    """Per-coordinate learning rates from the running sum of squared gradients.

    ``s = s + g²``;  ``p = p - lr · g / (sqrt(s) + eps)`` (with ``g = g + weight_decay · p``).
    Coordinates that saw large gradients slow down for good, which suits sparse features but
    makes the effective step shrink forever: the problem RMSProp and Adam fix with decay.
    """

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0):
        _check("lr", lr)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))

    def update(self, p, g, group, state):
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        if wd != 0:
            g = g.add(p, alpha=wd)
        if "sum_sq" not in state:
            state["sum_sq"] = torch.zeros_like(p)
        state["sum_sq"].addcmul_(g, g)
        p.addcdiv_(g, state["sum_sq"].sqrt().add_(eps), value=-lr)


class Adam(_Optimizer):
    """Adam: momentum on the gradient, scaled by a running RMS of the gradient.

    Per parameter, at step ``t`` (from 1)::

        g = g + weight_decay · p                       (Adam: L2 in the gradient)
        m = β1 · m + (1 - β1) · g                      (first moment)
        v = β2 · v + (1 - β2) · g²                     (second moment)
        p = p - lr · (m / (1 - β1^t)) / (sqrt(v / (1 - β2^t)) + eps)

    The ``1 - β^t`` factors undo the bias of ``m`` and ``v`` starting at 0. With L2 in the
    gradient, the decay of a parameter gets divided by ``sqrt(v)`` too, so weights with large
    gradients are barely decayed; :class:`AdamW` fixes that.
    """

    decoupled = False  # AdamW sets True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        _check("lr", lr)
        _check("betas[0]", betas[0], high=1.0)
        _check("betas[1]", betas[1], high=1.0)
        _check("eps", eps)
        _check("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def update(self, p, g, group, state):
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if wd != 0 and self.decoupled:
            p.mul_(1 - lr * wd)
        elif wd != 0:
            g = g.add(p, alpha=wd)
        if "step" not in state:
            state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        t, m, v = state["step"], state["m"], state["v"]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


class AdamW(Adam):
    """Adam with *decoupled* weight decay (Loshchilov & Hutter, 2019).

    Before the Adam step, ``p = p - lr · weight_decay · p``: every weight shrinks by the same
    fraction, whatever its gradient history. This is the optimizer nearly every LM trains with.
    The default ``weight_decay=0.01`` matches ``torch.optim.AdamW``.
    """

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


# Per-parameter state names of the same Adam quantities: ours and torch.optim.Adam/AdamW's.
_ADAM_NAMES = {"m": "exp_avg", "v": "exp_avg_sq"}
# How a torch optimizer computes its step, not what: the optimizer's own, whatever a checkpoint says.
_TORCH_SWITCHES = ("fused", "foreach", "capturable", "differentiable")


def adam_state_for(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` of an Adam or AdamW, ours or ``torch.optim``'s, renamed for ``optimizer``.

    The two keep the same moments under other names (``m``/``v`` and ``exp_avg``/``exp_avg_sq``)
    and the step as an int or a tensor, so a checkpoint written by one resumes the other (e.g. a
    run that stepped torch's fused AdamW on a GPU, resumed on a CPU with ours). A torch optimizer
    keeps its own switches of how it computes (:data:`_TORCH_SWITCHES`: a checkpoint of the foreach
    AdamW resumes as fused where the optimizer is fused), and its other settings where the saved
    groups lack them. Other optimizers' state dicts are returned as they are.
    """
    ours = isinstance(optimizer, Adam)
    if not (ours or isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))):
        return state_dict
    names = {v: k for k, v in _ADAM_NAMES.items()} if ours else _ADAM_NAMES
    state = {}
    for index, entry in state_dict["state"].items():
        entry = {names.get(key, key): value for key, value in entry.items()}
        if "step" in entry:
            step = entry["step"]
            entry["step"] = int(step) if ours else torch.as_tensor(step, dtype=torch.float32)
        state[index] = entry
    groups = [dict(saved) for saved in state_dict["param_groups"]]
    if not ours:
        for saved, current in zip(groups, optimizer.state_dict()["param_groups"]):
            for key, value in current.items():
                if key in _TORCH_SWITCHES:
                    saved[key] = value
                else:
                    saved.setdefault(key, value)
    return {"state": state, "param_groups": groups}
