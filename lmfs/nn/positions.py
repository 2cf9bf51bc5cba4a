"""How a transformer learns where each token is.

Attention by itself is blind to order (permute the keys and the output does not change), so
position must come from somewhere:

* ``"learned"``: a trainable vector per position, added to the token embedding (GPT-2).
* ``"sinusoidal"``: fixed sines and cosines of geometric wavelengths, added likewise
  (Vaswani et al., 2017).
* ``"rope"``: rotary embeddings rotate each query and key by an angle proportional to its
  position, so ``q·k`` depends only on the *relative* offset (Su et al., 2021; Llama).
* ``"none"`` (NoPE): nothing at all. A causal mask already leaks position: token ``t`` sees
  exactly ``t + 1`` tokens, and a model can learn to count them (Haviv et al., 2022).

RoPE pairing convention
-----------------------
RoPE rotates pairs of dimensions. The RoFormer paper pairs *adjacent* dims ``(2i, 2i+1)``;
Llama and Hugging Face pair dim ``i`` with dim ``i + d/2`` ("rotate_half"). The two are the same
operation up to a fixed permutation of the head dimensions, which a trained ``W_q``/``W_k`` absorb,
so neither is better. **lmfs uses the rotate_half convention**: dims ``i`` and ``i + d/2`` share
the frequency ``theta^(-2i/d)``. That makes Llama checkpoints load by copying ``W_q`` and ``W_k``
unchanged (see :mod:`lmfs.nn.hf`).
"""

from __future__ import annotations

import torch
from torch import nn

from lmfs.nn.layers import Embedding

POSITION_KINDS = ("rope", "learned", "sinusoidal", "none")


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    """``(cos, sin)``, each ``(..., T, head_dim)``, for integer ``positions`` ``(..., T)``: ``(T,)``
    for one sequence, ``(B, T)`` for a batch whose sequences are offset or packed differently.

    Pair ``i`` (dims ``i`` and ``i + head_dim/2``) turns at frequency ``theta^(-2i/head_dim)``:
    the first pairs spin fast and resolve nearby tokens, the last ones barely move and carry
    long-range position. Always float32, on ``positions.device``: angles reach thousands of
    radians, and bfloat16 would round them to the wrong rotation.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dims, so head_dim must be even, got {head_dim}")
    dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / theta ** (dims / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, head_dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # dims i and i + head_dim/2 share an angle
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim: a 90° turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every pair of ``x`` ``(..., T, head_dim)`` by its angle: ``x·cos + rot(x)·sin``;
    ``cos`` and ``sin`` broadcast against ``x`` (e.g. ``(T, head_dim)`` for every batch and head).

    For a pair ``(a, b)`` this is ``(a cos - b sin, b cos + a sin)``, a plane rotation.
    """
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding; no parameters. ``forward(x, positions=None)`` rotates ``x``
    ``(B, H, T, head_dim)``; token ``t`` is at position ``t`` unless ``positions`` says otherwise.

    ``positions`` is an integer ``(T,)`` or ``(B, T)`` tensor: a sequence that continues an
    earlier one starts at an offset (``arange(T) + offset``), and several documents packed into
    one row restart at 0 each (``[0, 1, 2, 0, 1, ...]``), so each is rotated as if it were alone.

    The cos/sin tables for positions ``0 .. max_positions - 1`` are computed once and kept as
    float32 buffers (not saved in the state dict); longer inputs compute theirs on the fly. Why
    not compute them in every forward, which looks free (``T·head_dim`` trig ops next to
    attention's ``T²·head_dim`` multiply-adds)? Because ``torch.compile`` fuses that computation
    into the element-wise kernel that rotates q and k, and so evaluates the cosine and sine once
    per *element* of q and k, ``B·H`` times more, in the forward and again in the backward:
    measured on an H200 for a GPT-2-small shape, 3 ms of a 34 ms training step (README).
    Explicit ``positions`` compute their angles in each call. Casting the model
    (``model.to(torch.bfloat16)``) leaves the tables in float32; ``apply_rope`` casts them to the
    activations' dtype where they are used.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, max_positions: int = 0):
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        cos, sin = rope_angles(torch.arange(max_positions), head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:  # a dtype cast reached the tables: recompute them exactly
            cos, sin = rope_angles(torch.arange(self.max_positions, device=self.cos.device), self.head_dim,
                                   self.theta)
            self.cos, self.sin = cos, sin
        return self

    def tables(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``(T, head_dim)`` cos and sin tables for positions ``0 .. T - 1``."""
        if T <= self.max_positions:
            return self.cos[:T], self.sin[:T]
        return rope_angles(torch.arange(T, device=device), self.head_dim, self.theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            return apply_rope(x, *self.tables(x.shape[-2], x.device))
        cos, sin = rope_angles(positions, self.head_dim, self.theta)
        if cos.dim() == 3:  # (B, T, head_dim): one table per sequence, shared by its heads
            cos, sin = cos[:, None], sin[:, None]
        return apply_rope(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, max_positions={self.max_positions}"


def sinusoidal_table(context_length: int, d_model: int, base: float = 10000.0) -> torch.Tensor:
    """``(context_length, d_model)`` table: ``PE[p, 2i] = sin(p·w_i)``, ``PE[p, 2i+1] = cos(p·w_i)``.

    ``w_i = base^(-2i/d_model)``, so wavelengths grow geometrically from 2π to ``base·2π``.
    """
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
    freqs = base ** (-torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
    angles = torch.arange(context_length, dtype=torch.float32)[:, None] * freqs[None, :]
    table = torch.empty(context_length, d_model)
    table[:, 0::2] = angles.sin()
    table[:, 1::2] = angles.cos()
    return table


class LearnedPositions(nn.Module):
    """One trainable ``d_model`` vector per position. ``forward(T)`` returns the ``(T, d_model)``
    rows of positions ``0 .. T - 1``; ``forward(positions)``, for an integer tensor ``(..., T)``,
    the rows of those positions ``(..., T, d_model)``."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        self.table = Embedding(context_length, d_model)

    def forward(self, positions: int | torch.Tensor) -> torch.Tensor:
        if isinstance(positions, torch.Tensor):
            return self.table(positions)
        return self.table.weight[:positions]


class SinusoidalPositions(nn.Module):
    """The fixed table of :func:`sinusoidal_table`; ``forward`` as :class:`LearnedPositions`'."""

    def __init__(self, context_length: int, d_model: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(context_length, d_model), persistent=False)

    def forward(self, positions: int | torch.Tensor) -> torch.Tensor:
        if isinstance(positions, torch.Tensor):
            return self.table[positions]
        return self.table[:positions]


def make_absolute_positions(kind: str, context_length: int, d_model: int) -> nn.Module | None:
    """The additive position module for ``kind``, or ``None`` when positions live elsewhere.

    RoPE acts inside attention and NoPE has nothing to add, so both return ``None``.
    """
    if kind not in POSITION_KINDS:
        raise ValueError(f"unknown positions {kind!r}: use one of {POSITION_KINDS}")
    if kind == "learned":
        return LearnedPositions(context_length, d_model)
    if kind == "sinusoidal":
        return SinusoidalPositions(context_length, d_model)
    return None

