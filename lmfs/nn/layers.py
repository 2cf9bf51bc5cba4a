"""The building blocks of a transformer, written from their parameters up.

Every layer here owns plain :class:`torch.nn.Parameter` tensors and spells out its forward
computation, so nothing is hidden inside ``nn.Linear``, ``nn.Embedding`` or ``nn.LayerNorm``.
Weights use PyTorch's layout (a linear weight is ``(d_out, d_in)``) so that state dicts convert
to and from other libraries by copying tensors, never by transposing them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FFN_KINDS = ("relu", "gelu", "swiglu", "geglu")
GATED_FFNS = ("swiglu", "geglu")


class Linear(nn.Module):
    """``y = x Wᵀ (+ b)``; ``x`` is ``(..., d_in)``, ``y`` is ``(..., d_out)``.

    No bias by default: modern LMs drop it (it adds parameters and little else). The weight
    starts as normal(0, 1/√d_in), which keeps the output variance close to the input's; a model
    may re-initialise it with its own scheme.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"Linear(d_in={self.weight.shape[1]}) got input of shape {tuple(x.shape)}: "
                             "its last dimension must equal d_in")
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        d_out, d_in = self.weight.shape
        return f"d_in={d_in}, d_out={d_out}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """A lookup table: integer ids ``(...)`` -> rows of ``weight`` ``(..., dim)``."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.weight.shape[0]}, dim={self.weight.shape[1]}"


class RMSNorm(nn.Module):
    """``x / rms(x) * g`` over the last dimension, with ``rms(x) = sqrt(mean(x²) + eps)``.

    Unlike LayerNorm it neither subtracts the mean nor adds a bias. The statistics are computed
    in float32 even for bfloat16 inputs, because a mean of squares loses precision quickly.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * g + b`` over the last dimension (biased variance)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean = x32.mean(dim=-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        x32 = (x32 - mean) * torch.rsqrt(var + self.eps)
        return self.weight * x32.to(x.dtype) + self.bias

    def extra_repr(self) -> str:
        return f"dim={self.weight.shape[0]}, eps={self.eps}"


def make_norm(kind: str, dim: int, eps: float = 1e-5) -> nn.Module:
    """``"rms"`` -> :class:`RMSNorm`, ``"layer"`` -> :class:`LayerNorm`."""
    if kind == "rms":
        return RMSNorm(dim, eps)
    if kind == "layer":
        return LayerNorm(dim, eps)
    raise ValueError(f"unknown norm {kind!r}: use 'rms' or 'layer'")


def norm_params(kind: str, dim: int) -> int:
    """Parameters of one norm: a gain for RMSNorm, a gain and a bias for LayerNorm."""
    return dim if kind == "rms" else 2 * dim


def default_d_ff(d_model: int, ffn: str) -> int:
    """The usual hidden width: ``4·d_model`` for a plain MLP, ``8/3·d_model`` for a gated one.

    A gated MLP has three matrices instead of two, so ``8/3`` keeps its parameter count equal to
    the plain one's; the width is rounded up to a multiple of 64 so matmuls tile well on GPUs.
    """
    if ffn not in GATED_FFNS:
        return 4 * d_model
    return 64 * math.ceil(8 * d_model / 3 / 64)


class MLP(nn.Module):
    """Plain feed-forward: ``down(act(up(x)))`` with ``act`` ReLU or GeLU (exact, erf form).

    ``x`` is ``(..., d_model)``; the hidden activation is ``(..., d_ff)``.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = False):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"MLP activation must be 'relu' or 'gelu', got {activation!r}; "
                             "use GatedMLP for 'swiglu' / 'geglu'")
        self.act = F.relu if activation == "relu" else F.gelu
        self.up = Linear(d_model, d_ff, bias)
        self.down = Linear(d_ff, d_model, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class GatedMLP(nn.Module):
    """Gated linear unit feed-forward: ``down(act(gate(x)) * up(x))``.

    SwiGLU uses ``act = SiLU`` (Llama), GeGLU uses ``act = GeLU`` (Gemma). The gate lets each
    hidden unit scale its own value multiplicatively, which trains a little better than a plain
    MLP of the same parameter count (Shazeer, 2020). ``x`` is ``(..., d_model)``; the hidden
    activations are ``(..., d_ff)``.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", bias: bool = False):
        super().__init__()
        if activation not in GATED_FFNS:
            raise ValueError(f"GatedMLP activation must be 'swiglu' or 'geglu', got {activation!r}; "
                             "use MLP for 'relu' / 'gelu'")
        self.act = F.silu if activation == "swiglu" else F.gelu
        self.gate = Linear(d_model, d_ff, bias)
        self.up = Linear(d_model, d_ff, bias)
        self.down = Linear(d_ff, d_model, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


def make_ffn(kind: str, d_model: int, d_ff: int | None = None, bias: bool = False) -> nn.Module:
    """Build the feed-forward named ``kind`` (one of :data:`FFN_KINDS`), ``d_ff`` wide (default
    :func:`default_d_ff`)."""
    if kind not in FFN_KINDS:
        raise ValueError(f"unknown ffn {kind!r}: use one of {FFN_KINDS}")
    d_ff = d_ff or default_d_ff(d_model, kind)
    if kind in GATED_FFNS:
        return GatedMLP(d_model, d_ff, kind, bias)
    return MLP(d_model, d_ff, kind, bias)


def ffn_params(kind: str, d_model: int, d_ff: int, bias: bool) -> int:
    """Parameters of one feed-forward: two or three matrices, plus their biases if any."""
    if kind in GATED_FFNS:
        return 3 * d_model * d_ff + bias * (2 * d_ff + d_model)
    return 2 * d_model * d_ff + bias * (d_ff + d_model)
