"""Weight-only quantisation: int8 and int4 linear layers, group-wise, with activation-aware scaling.

Decoding one token at a time reads every weight once per step and does two flops per weight it
reads: the step is bound by memory bandwidth, not arithmetic. Storing the weights in 8 or 4 bits
instead of 16 cuts the bytes read, hence the time per token, by 2 or 4 (minus the overhead of the
scales). The activations stay in 16 or 32 bits; each weight is turned back into a float just
before it is multiplied (:func:`lmfs.kernels.dequant_matmul.dequant_matmul`, handed in as ``matmul=``, does
that in registers).

**Group-wise codes.** A weight matrix ``W`` (out, in) is cut along its input dimension into groups
of ``group_size`` consecutive columns; every row's group gets its own float scale ``s`` and each
weight becomes a ``bits``-bit unsigned integer code ``c``, with

    w ≈ (c − z) · s,     c = clamp(round(w / s) + z, 0, 2^bits − 1)

* symmetric: ``s = max|w| / (2^(bits−1) − 1)`` and the fixed zero point ``z = 2^(bits−1)``
  (codes 1 .. 2^bits − 1 around it: int8 covers −127..127, int4 −7..7);
* asymmetric: ``s = (max w − min w) / (2^bits − 1)`` and a per-group integer ``z`` that puts
  ``min w`` on code 0, which wastes no code on a range the group does not use.

Either way rounding moves a weight by at most half a step: ``|w − dequant(c)| ≤ s/2``. Small groups
follow the weights' local range closely (smaller ``s``) but store more scales: with float32
scales, int4 at group size 128 costs 4 + 32/128 = 4.25 bits per weight. int4 codes are packed two
per byte, column ``2j`` in the low nibble and ``2j + 1`` in the high one.

**Activation-aware scaling (AWQ).** Rounding errors matter in proportion to the inputs they are
multiplied with, and LM activations have a few channels far larger than the rest. For any
per-input-channel ``t > 0``, ``x Wᵀ = (x / t)(W · t)ᵀ``: multiplying the weight columns of the
large channels by ``t > 1`` before quantising shrinks their relative rounding error (the group's
scale grows less than the column does), and dividing the input by ``t`` undoes it exactly in full
precision. AWQ takes ``t = mean|x|^α`` from calibration activations and picks ``α ∈ [0, 1]`` per layer
by a grid search on the layer's output error; ``α = 0`` is plain round-to-nearest (RTN), so on the
calibration data the search can only help. Here the division by ``t`` happens in
:class:`QuantLinear` (an inference engine would fold it into the preceding norm or linear layer).

>>> w = torch.randn(16, 64)
>>> qw = quantize_weight(w, bits=4, group_size=32)
>>> bool(((w - dequantize_weight(qw)).abs() <= qw.scales.repeat_interleave(32, 1) / 2 + 1e-6).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmfs.nn.layers import Linear

BITS = (4, 8)


@dataclass
class QuantizedWeight:
    """A (out, in) weight matrix in ``bits``-bit group-wise codes; ``w ≈ (codes − zeros)·scales``.

    ``codes``: uint8, (out, in) for 8 bits, (out, in/2) for 4 bits (two codes a byte, the even
    column in the low nibble). ``scales``: float32 (out, in/group_size). ``zeros``: uint8
    (out, in/group_size) for asymmetric codes, None for symmetric ones (whose zero point is the
    constant 2^(bits−1)).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and zero points together."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)


def _check_format(fn: str, bits: int, group_size: int, in_features: int) -> None:
    if bits not in BITS:
        raise ValueError(f"{fn}: bits must be 4 or 8, got {bits!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"{fn}: int4 packs two codes a byte, so group_size must be even, got {group_size}")
    if in_features % group_size:
        divisor = next((g for g in (128, 64, 32, 16, 8, 4, 2) if in_features % g == 0 and g < group_size), 1)
        raise ValueError(f"{fn}: group_size {group_size} does not divide in_features {in_features}; pick a "
                         f"divisor of {in_features} (e.g. {divisor})")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (..., n) with n even -> uint8 (..., n/2): column 2j low nibble, 2j+1 high nibble."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 (..., n/2) -> uint8 codes (..., n)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def quantize_weight(w: torch.Tensor, bits: int = 8, group_size: int = 128, symmetric: bool = True) -> QuantizedWeight:
    """Round-to-nearest group-wise quantisation of a weight ``w`` (out, in); see the module docstring.

    The scales are computed in float32 from ``w`` (any float dtype). An all-zero group gets scale 1
    rather than 0, so dequantising never divides by zero and gives back exact zeros.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: expected a (out, in) weight matrix, got shape {tuple(w.shape)}")
    out_features, in_features = w.shape
    _check_format("quantize_weight", bits, group_size, in_features)
    groups = w.detach().float().reshape(out_features, in_features // group_size, group_size)
    top = 2 ** bits - 1
    if symmetric:
        scales = groups.abs().amax(dim=-1) / (2 ** (bits - 1) - 1)
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zeros = None
        zero = torch.full_like(scales, 2 ** (bits - 1))
    else:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)  # keep 0 representable
        scales = (high - low) / top
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        zero = torch.round(-low / scales).clamp(0, top)
        zeros = zero.to(torch.uint8)
    codes = torch.clamp(torch.round(groups / scales[..., None]) + zero[..., None], 0, top)
    codes = codes.reshape(out_features, in_features).to(torch.uint8)
    if bits == 4:
        codes = pack_int4(codes)
    return QuantizedWeight(codes, scales, zeros, bits, group_size, (out_features, in_features))


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight (out, in) that ``qw`` stands for: ``(codes − zeros) · scales``, in ``dtype``."""
    out_features, in_features = qw.shape
    codes = unpack_int4(qw.codes) if qw.bits == 4 else qw.codes
    codes = codes.float().reshape(out_features, in_features // qw.group_size, qw.group_size)
    zero = qw.zeros.float() if qw.zeros is not None else torch.full_like(qw.scales, 2 ** (qw.bits - 1))
    w = (codes - zero[..., None]) * qw.scales[..., None]
    return w.reshape(out_features, in_features).to(dtype)


class QuantLinear(nn.Module):
    """A linear layer ``y = x Wᵀ (+ b)`` with ``W`` held as a :class:`QuantizedWeight`.

    ``x`` (..., in) in float32/float16/bfloat16 -> ``y`` (..., out) in x's dtype. The codes, scales
    and zero points are buffers (they are not trained). ``input_scale`` (in,), when set by
    activation-aware scaling, multiplies the input first (it holds ``1/t``; the stored weight is
    ``W·t``). ``matmul(x2, qweight)``: the product of the ``(M, in)`` inputs with the quantised
    weight, handed in from outside (:func:`lmfs.kernels.dequant_matmul.dequant_matmul`, the Triton
    kernel that dequantises in registers and never writes the float weight to memory); None:
    the weight is dequantised with PyTorch and multiplied (the same numbers, on any device).
    """

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, matmul: Callable | None = None):
        super().__init__()
        self.matmul = matmul
        self.bits, self.group_size = qweight.bits, qweight.group_size
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("codes", qweight.codes)
        self.register_buffer("scales", qweight.scales)
        self.register_buffer("zeros", qweight.zeros)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Module, bits: int = 8, group_size: int = 128, symmetric: bool = True,
                    channel_scale: torch.Tensor | None = None) -> QuantLinear:
        """Quantise ``linear`` (an ``lmfs.nn.Linear`` or ``torch.nn.Linear``). ``channel_scale``
        ``t`` (in,): quantise ``W·t`` and divide inputs by ``t`` (activation-aware scaling)."""
        w = linear.weight.detach().float()
        input_scale = None
        if channel_scale is not None:
            w = w * channel_scale
            input_scale = (1.0 / channel_scale).float()
        qw = quantize_weight(w, bits, group_size, symmetric)
        return cls(qw, linear.bias, input_scale)

    @property
    def qweight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes, self.scales, self.zeros, self.bits, self.group_size,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear(in={self.in_features}) got input of shape {tuple(x.shape)}: its last "
                             "dimension must equal in_features")
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        x2 = x.reshape(-1, self.in_features)
        if self.matmul is not None:
            y = self.matmul(x2, self.qweight)
        else:
            y = x2 @ dequantize_weight(self.qweight, x.dtype).T
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        kind = "asymmetric" if self.zeros is not None else "symmetric"
        return (f"in={self.in_features}, out={self.out_features}, int{self.bits}, group_size={self.group_size}, "
                f"{kind}, awq={self.input_scale is not None}, bias={self.bias is not None}")


# ----------------------------------------------------------------------------------------------
# Whole models


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (Linear, nn.Linear))


def quantizable_linears(model: nn.Module, include_head: bool = False) -> dict[str, nn.Module]:
    """The linear layers :func:`quantize_model` replaces, by qualified name.

    Left out: MoE routers (a small error there changes which experts a token goes to, for a
    negligible saving) and the output head unless ``include_head`` (its errors go straight into the
    logits; the tied head is the embedding matrix, which is not a linear layer and stays as it is).
    MoE experts keep their stacked weights (not linear layers either).
    """
    from lmfs.nn.moe import Router

    routers = {id(m.proj) for m in model.modules() if isinstance(m, Router) and m.proj is not None}
    found = {}
    for name, module in model.named_modules():
        if not _is_linear(module) or id(module) in routers:
            continue
        if name.split(".")[-1] == "lm_head" and not include_head:
            continue
        found[name] = module
    return found


@torch.no_grad()
def record_input_activations(model: nn.Module, layers: dict[str, nn.Module], calibration: torch.Tensor,
                             max_rows: int = 2048) -> dict[str, torch.Tensor]:
    """Run ``model(calibration)`` once and return, per layer name, the inputs it saw: float32
    (rows, in), at most ``max_rows`` of them (evenly spaced over all tokens), recorded by forward
    hooks. ``calibration``: token ids (B, T)."""
    inputs: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, args, _output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            step = max(1, x.shape[0] // max_rows)
            inputs[name] = x[::step][:max_rows].cpu()
        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in layers.items()]
    try:
        model(calibration)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def awq_scale(linear: nn.Module, x: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
              alphas=tuple(i / 10 for i in range(11))) -> tuple[torch.Tensor, float, dict[float, float]]:
    """The activation-aware channel scale ``t`` (in,) for ``linear`` given its inputs ``x`` (rows, in).

    ``t = mean|x|^α``, normalised so that ``sqrt(max t · min t) = 1`` (keeps the weights' overall
    range where it was); ``α`` is the grid value with the lowest mean squared output error
    ``‖x Wᵀ − (x/t) deq(q(W·t))ᵀ‖²``. Returns ``(t, α, {α: error})``; ``α = 0`` (``t = 1``) is plain
    round-to-nearest, so the result is never worse than RTN on ``x``.
    """
    w = linear.weight.detach().float()
    x = x.to(w.device)
    reference = x @ w.T
    magnitude = x.abs().mean(dim=0).clamp(min=1e-8)  # (in,)
    errors, best = {}, None
    for alpha in alphas:
        t = magnitude ** alpha
        t = t / (t.max() * t.min()).sqrt()
        deq = dequantize_weight(quantize_weight(w * t, bits, group_size, symmetric))
        errors[alpha] = ((x / t) @ deq.T - reference).pow(2).mean().item()
        if best is None or errors[alpha] < errors[best[1]]:
            best = (t, alpha)
    return best[0], best[1], errors


@torch.no_grad()
def quantize_model(model: nn.Module, bits: int = 8, group_size: int = 128, calibration: torch.Tensor | None = None,
                   symmetric: bool = True, include_head: bool = False, max_rows: int = 2048,
                   matmul: Callable | None = None) -> nn.Module:
    """Replace the model's linear layers by :class:`QuantLinear` ones, in place; returns ``model``.

    ``bits`` 8 or 4; ``group_size`` must divide every replaced layer's input width. Which layers:
    :func:`quantizable_linears`. With ``calibration`` token ids (B, T), every layer's inputs are
    recorded in one full-precision forward and its weight is quantised with activation-aware
    scaling (:func:`awq_scale`); without, by plain round-to-nearest. The chosen ``α`` of each
    layer is kept in ``model.awq_alphas`` (name -> α). ``matmul``: set on every :class:`QuantLinear`
    (e.g. ``functools.partial(lmfs.kernels.dequant_matmul, autotune_candidates=1)``; None: PyTorch).
    """
    if include_head and getattr(model, "lm_head", False) is None:
        raise ValueError("quantize_model: include_head=True, but this model's head is tied to the token embedding "
                         "(tie_embeddings=True), which stays in full precision; build it untied to quantise the head")
    if matmul is not None and not callable(matmul):
        raise TypeError(f"quantize_model: matmul must be callable as matmul(x, qweight), got {matmul!r}")
    layers = quantizable_linears(model, include_head)
    if not layers:
        raise ValueError(f"quantize_model: {type(model).__name__} has no linear layers to quantise")
    for name, layer in layers.items():
        try:
            _check_format("quantize_model", bits, group_size, layer.weight.shape[1])
        except ValueError as err:
            raise ValueError(f"{err} (layer {name})") from None
    inputs = record_input_activations(model, layers, calibration, max_rows) if calibration is not None else {}
    alphas = {}
    for name, layer in layers.items():
        scale = None
        if name in inputs:
            scale, alphas[name], _ = awq_scale(layer, inputs[name], bits, group_size, symmetric)
        quant = QuantLinear.from_linear(layer, bits, group_size, symmetric, scale).to(layer.weight.device)
        quant.matmul = matmul
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quant)
    if calibration is not None:
        model.awq_alphas = alphas
    return model


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored: every parameter (a tied one once) plus the codes,
    scales, zero points and input scales of its :class:`QuantLinear` layers."""
    tensors = {id(p): p for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            tensors.update({id(b): b for b in module.buffers(recurse=False)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


__all__ = ["QuantizedWeight", "QuantLinear", "quantize_weight", "dequantize_weight", "pack_int4", "unpack_int4",
           "quantize_model", "quantizable_linears", "record_input_activations", "awq_scale", "model_weight_bytes"]
