"""Opt-in speed for a built :class:`lmfs.nn.TransformerLM`: the same function, computed faster.

``lmfs.nn`` is the model as taught, one matmul per projection and the loss from the logits.
:func:`fuse_model` changes how a built model computes, not what (same parameters, same state
dict, the same loss and gradients up to rounding):

    model = fuse_model(TransformerLM(config))   # in place; returns the model

* ``projections``: under autocast, q/k/v (and a gated MLP's gate/up) run as one matmul on the
  stacked weights (:func:`fused_linear`): the input is read and cast once instead of three
  times (twice). The attention and gated-MLP modules become :class:`FusedAttention` and
  :class:`FusedGatedMLP`, subclasses that keep every parameter and buffer where it was.
* ``triton``: where the fused projections run on a CUDA GPU under autocast
  (:func:`kernels_apply`), two memory-bound steps go through Triton kernels, each written so that
  every byte crosses memory once, forward and backward (below); the chunked loss uses
  :func:`lmfs.kernels.loss.cross_entropy_rows`. Elsewhere the fused modules compute in PyTorch.
* ``chunked_loss``: with targets, the model returns ``(None, loss)``, the loss computed by
  :func:`lmfs.kernels.loss.linear_cross_entropy` a chunk of rows at a time, without keeping the
  ``(B, T, vocab)`` logits (:class:`ChunkedLossLM`).
* ``norms`` (off unless asked for): the RMSNorms become :class:`FusedRMSNorm`, which in training
  on a CUDA GPU computes through :func:`lmfs.kernels.rmsnorm.rms_norm`, one Triton kernel forward
  and one backward (plus a small sum for the weight's gradient), instead of the written-out
  norm's chain of elementwise kernels each way, whose backward (``MulBackward0``,
  ``PowBackward0``) led a GPU profile of the GRPO update. Only where the kernel computes the plain
  module's function in the plain module's dtype (:func:`norm_kernel_applies`).
* ``embedding`` (off unless asked for): the token embedding becomes :class:`FusedEmbedding`, a
  lookup through ``F.embedding``. The plain ``weight[ids]``'s backward is an indexed accumulate
  that adds the gradients of repeated ids one after another; ``F.embedding``'s sorts the ids and
  sums each id's rows in parallel pieces. With a small vocabulary every id repeats hundreds of
  times, and a right-padded batch repeats its padding id thousands of times: at the ids of a GRPO
  update (262 ids, 72k tokens, 12k of them padding) the lookup's forward and backward took 8.62 ms
  on an H200, 0.46 ms through ``F.embedding``.

SDPA's kernel can be chosen too, for a whole forward pass: :func:`prefer_sdpa_backend`.

The two kernels of the fused modules:

* :func:`rope_qkv`: the heads of a fused q/k/v projection, with RoPE applied to q and k. One
  kernel reads the ``(B, T, (H_q + 2·H_kv)·d)`` matmul output and writes q, k, v; the backward
  kernel writes ``dq``, ``dk`` (rotated back) and ``dv`` straight into one gradient tensor of
  the matmul's shape. Left to ``torch.compile``, that backward is a ``cat`` of three gradients
  fused with the inverse rotation, which Inductor turned into a kernel ten times slower than
  the bytes it moves (an H200 profile: 319 µs per layer for 75 MB; README, Performance).
* :func:`swiglu`: ``silu(gate) · up`` on a fused gate/up matmul output ``(..., 2F)``; the
  backward writes ``dgate`` and ``dup`` into one ``(..., 2F)`` tensor reading each input once
  (Inductor's version of that ``cat`` loaded the inputs once per output half: 1.8× the time).

The PyTorch code in :mod:`lmfs.nn` is their reference. Forward and backward are computed in
float32 and stored in the inputs' dtype.

Under ``torch.compile`` the autograd Functions stay (not ``torch.library`` custom ops, whose calls go
through Python and the dispatcher), and :func:`rope_qkv` transposes the ``(B, T, H, d)`` tensors
that :class:`_RopeQKV` returns outside the Function, so that Inductor does not copy them; the
measurements behind both choices are in ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmfs.kernels._triton import INTERPRET, check_tensors, tl, triton
from lmfs.kernels.loss import linear_cross_entropy
from lmfs.kernels.rmsnorm import MAX_COLS, rms_norm
from lmfs.nn import CausalSelfAttention, Embedding, GatedMLP, Linear, RMSNorm, TransformerLM
from lmfs.nn.attention import attention_reference
from lmfs.nn.positions import rope_angles


# ----------------------------------------------------------------------------------------------
# RoPE on the heads of a fused q/k/v projection


@triton.jit
def _rope_part(src, dst, cos_ptr, sin_ptr, b, t, h, T, s_b, s_t, s_h, d_b, d_t, d_h, SIGN: tl.constexpr,
               ROTATE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Copy one head of ``BLOCK_T`` tokens from ``src`` to ``dst`` (pointers to the head's first
    element; element strides of batch, token and head; the last dimension contiguous), rotating
    each pair ``(i, i + HALF)`` by its position's angle when ``ROTATE``: by ``+θ`` for ``SIGN = 1``
    (RoPE), by ``-θ`` for ``SIGN = -1`` (its transpose, the backward)."""
    c = tl.arange(0, BLOCK_HALF)
    h = h.to(tl.int64)
    mask = (t < T)[:, None] & (c < HALF)[None, :]
    t64 = t.to(tl.int64)[:, None]
    src_off = b * s_b + h * s_h + t64 * s_t + c[None, :]
    dst_off = b * d_b + h * d_h + t64 * d_t + c[None, :]
    x1 = tl.load(src + src_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + src_off + HALF, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:  # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); both halves share the angle
        table = t64 * (2 * HALF) + c[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0) * SIGN
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    tl.store(dst + dst_off, x1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + dst_off + HALF, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_qkv_kernel(q_src, k_src, v_src, q_dst, k_dst, v_dst, cos_ptr, sin_ptr, T,
                     q_so, qs_b, qs_t, qs_h, k_so, ks_b, ks_t, ks_h, v_so, vs_b, vs_t, vs_h,
                     q_do, qd_b, qd_t, qd_h, k_do, kd_b, kd_t, kd_h, v_do, vd_b, vd_t, vd_h,
                     H_Q: tl.constexpr, H_KV: tl.constexpr, SIGN: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program ``(i, h)``: tokens ``BLOCK_T·j ..`` of sequence ``b`` (``i = b·blocks + j``), head
    ``h`` of the ``H_Q + 2·H_KV`` heads laid out q, k, v. q and k heads are rotated, v heads copied.
    Each part has an element offset in its source (``*_so``) and destination (``*_do``) and
    batch, token and head strides there."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    blocks = tl.cdiv(T, BLOCK_T)
    b = (pid // blocks).to(tl.int64)
    t = (pid % blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    if h < H_Q:
        _rope_part(q_src + q_so, q_dst + q_do, cos_ptr, sin_ptr, b, t, h, T, qs_b, qs_t, qs_h, qd_b, qd_t, qd_h,
                   SIGN, True, HALF, BLOCK_HALF)
    elif h < H_Q + H_KV:
        _rope_part(k_src + k_so, k_dst + k_do, cos_ptr, sin_ptr, b, t, h - H_Q, T, ks_b, ks_t, ks_h, kd_b, kd_t,
                   kd_h, SIGN, True, HALF, BLOCK_HALF)
    else:
        _rope_part(v_src + v_so, v_dst + v_do, cos_ptr, sin_ptr, b, t, h - H_Q - H_KV, T, vs_b, vs_t, vs_h, vd_b,
                   vd_t, vd_h, SIGN, False, HALF, BLOCK_HALF)


ROPE_BLOCK_T = 64 if INTERPRET else 32


def _launch_rope(srcs, src_parts, dsts, dst_parts, cos, sin, n_q, n_kv, B, T, d, sign):
    """Kernel launch. ``srcs`` and ``dsts`` are (q, k, v) *base* tensors (never views: under
    ``torch.compile`` a kernel that writes into a view makes Inductor copy it out and back), and
    ``*_parts`` give each part's element offset in its tensor and its (batch, token, head) strides."""
    parts = [n for offset, strides in src_parts + dst_parts for n in (offset, *strides)]
    grid = (B * triton.cdiv(T, ROPE_BLOCK_T), n_q + 2 * n_kv)
    _rope_qkv_kernel[grid](*srcs, *dsts, cos, sin, T, *parts, H_Q=n_q, H_KV=n_kv, SIGN=sign,
                           HALF=d // 2, BLOCK_HALF=triton.next_power_of_2(d // 2), BLOCK_T=ROPE_BLOCK_T,
                           num_warps=4)


def _fused_parts(T: int, n_q: int, n_kv: int, d: int):
    """Offsets and (batch, token, head) strides of q, k, v in a contiguous ``(B, T, (n_q + 2·n_kv)·d)``."""
    width = (n_q + 2 * n_kv) * d
    strides = (T * width, width, d)  # the same for all three parts: only their offsets differ
    return [(0, strides), (n_q * d, strides), ((n_q + n_kv) * d, strides)]


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_q, n_kv):
        B, T, width = qkv.shape
        d = width // (n_q + 2 * n_kv)
        # Outputs (B, T, H, d): rows of the matmul's output, so the kernel reads and writes in order;
        # rope_qkv hands them out as (B, H, T, d) views, the layout SDPA takes without a copy.
        outs = [qkv.new_empty(B, T, n, d) for n in (n_q, n_kv, n_kv)]
        out_parts = [(0, (T * n * d, n * d, d)) for n in (n_q, n_kv, n_kv)]
        _launch_rope((qkv, qkv, qkv), _fused_parts(T, n_q, n_kv, d), outs, out_parts, cos, sin, n_q, n_kv, B, T, d, 1)
        ctx.save_for_backward(cos, sin)
        ctx.n = (n_q, n_kv)
        # The tensors themselves, not transposed views of them (views made Inductor copy them).
        return tuple(outs)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        n_q, n_kv = ctx.n
        B, T, _, d = dq.shape
        grads = [g if g is not None else torch.zeros(B, T, n, d, device=cos.device, dtype=dq.dtype)
                 for g, n in ((dq, n_q), (dk, n_kv), (dv, n_kv))]
        # The gradients as they come, (B, T, H, d) with any strides (only the last contiguous).
        grads = [g if g.stride(-1) == 1 else g.contiguous() for g in grads]
        grad_parts = [(0, (g.stride(0), g.stride(1), g.stride(2))) for g in grads]
        dqkv = grads[0].new_empty(B, T, (n_q + 2 * n_kv) * d)
        _launch_rope(grads, grad_parts, (dqkv, dqkv, dqkv), _fused_parts(T, n_q, n_kv, d), cos, sin, n_q, n_kv,
                     B, T, d, -1)
        return dqkv, None, None, None, None


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
             n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused projection ``(B, T, (n_heads + 2·n_kv_heads)·d)`` into heads ``(B, H, T, d)``
    and apply RoPE to the query and key heads; differentiable in ``qkv``.

    ``cos`` and ``sin`` are float32 ``(≥T, d)`` tables (:func:`lmfs.nn.positions.rope_angles`,
    halves duplicated); the rotation is the rotate-half convention of
    :func:`lmfs.nn.positions.apply_rope`. Equal to splitting, then ``apply_rope`` on q and k, up
    to rounding (here the angles stay float32 where ``apply_rope`` casts them to the input's dtype).
    """
    check_tensors("rope_qkv", qkv=qkv)
    check_tensors("rope_qkv", cos=cos, sin=sin)
    if qkv.dim() != 3 or qkv.shape[-1] % (n_heads + 2 * n_kv_heads):
        raise ValueError(f"rope_qkv: qkv must be (B, T, (n_heads + 2·n_kv_heads)·head_dim), got {tuple(qkv.shape)} "
                         f"with n_heads={n_heads}, n_kv_heads={n_kv_heads}")
    d = qkv.shape[-1] // (n_heads + 2 * n_kv_heads)
    if d % 2 or cos.shape[-1] != d or cos.shape != sin.shape or cos.shape[0] < qkv.shape[1]:
        raise ValueError(f"rope_qkv: cos and sin must be (≥{qkv.shape[1]}, {d}) with an even head_dim, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dtype != torch.float32:
        raise TypeError(f"rope_qkv: the angle tables must be float32, got {cos.dtype}")
    q, k, v = _RopeQKV.apply(qkv.contiguous(), cos.contiguous(), sin.contiguous(), n_heads, n_kv_heads)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


# ----------------------------------------------------------------------------------------------
# SwiGLU on a fused gate/up projection


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, h_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + row * F + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gu_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + row * F + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    # h = silu(g)·u:  dh/dg = u·σ(g)·(1 + g·(1 - σ(g))),  dh/du = silu(g)
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    du = dh * g * sig
    tl.store(dgu_ptr + row * 2 * F + cols, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptr + row * 2 * F + F + cols, du.to(dgu_ptr.dtype.element_ty), mask=mask)


SWIGLU_BLOCK = 1024


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu):
        F = gu.shape[-1] // 2
        rows = gu.numel() // gu.shape[-1]
        h = gu.new_empty(*gu.shape[:-1], F)
        _swiglu_fwd_kernel[(rows, triton.cdiv(F, SWIGLU_BLOCK))](gu, h, F, BLOCK=SWIGLU_BLOCK, num_warps=4)
        ctx.save_for_backward(gu)
        return h

    @staticmethod
    def backward(ctx, dh):
        (gu,) = ctx.saved_tensors
        F = gu.shape[-1] // 2
        rows = gu.numel() // gu.shape[-1]
        dgu = torch.empty_like(gu)
        _swiglu_bwd_kernel[(rows, triton.cdiv(F, SWIGLU_BLOCK))](gu, dh.contiguous(), dgu, F, BLOCK=SWIGLU_BLOCK,
                                                                 num_warps=4)
        return dgu


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up = cat([gate, up], -1)`` of shape ``(..., 2F)``; returns
    ``(..., F)``. Differentiable; the gradient is one ``(..., 2F)`` tensor, ``cat([dgate, dup])``."""
    check_tensors("swiglu", gate_up=gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension holds gate and up, so it must be even; got {tuple(gate_up.shape)}")
    return _SwiGLU.apply(gate_up.contiguous())


# ----------------------------------------------------------------------------------------------
# Fused projections


def autocast_casts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a matmul of ``x`` with ``weight`` runs under autocast, which casts the weight to
    another dtype (fp32 weights under bf16 autocast) and keeps that copy for the backward pass."""
    device = x.device.type
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != weight.dtype


def fused_linear(x: torch.Tensor, layers: Sequence[Linear], split: bool = True) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` computed as **one** matmul on the stacked weights.

    The layers keep their own parameters (names, shapes and state dicts do not change); only the
    computation is fused: ``torch.cat`` stacks the weights along ``d_out``, one
    ``(..., d_in) @ (d_in, Σ d_out)`` matmul reads ``x`` once, and the output is split into views.
    The backward pass then also makes the gradient of ``x`` in one matmul, instead of summing one
    per layer. (Worth it under autocast only, see :func:`project`.) With ``split=False`` the result
    is the one ``(..., Σ d_out)`` tensor, for a kernel that reads the parts itself
    (:func:`rope_qkv`, :func:`swiglu`).
    """
    if x.shape[-1] != layers[0].weight.shape[1]:
        raise ValueError(f"Linear(d_in={layers[0].weight.shape[1]}) got input of shape {tuple(x.shape)}: "
                         "its last dimension must equal d_in")
    y = x @ torch.cat([layer.weight for layer in layers]).T
    if layers[0].bias is not None:
        y = y + torch.cat([layer.bias for layer in layers])
    if not split:
        return y
    return y.split([layer.weight.shape[0] for layer in layers], dim=-1)


def project(x: torch.Tensor, layers: Sequence[Linear]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``; under autocast as :func:`fused_linear`.

    Only under autocast: there every weight is cast to bf16 for its matmul and the copy is kept
    for the backward pass, so casting the stacked weight instead costs no memory. In plain fp32 the
    separate matmuls use the parameters themselves, and a stacked copy would be one more tensor
    kept for the backward pass.
    """
    if len(layers) > 1 and autocast_casts(x, layers[0].weight):
        return fused_linear(x, layers)
    return tuple(layer(x) for layer in layers)


def kernels_apply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a fused projection of ``x`` takes the Triton kernels: ``x`` on a CUDA GPU and under
    autocast (the only case in which projections are fused, see :func:`project`)."""
    return x.is_cuda and autocast_casts(x, weight)


class FusedAttention(CausalSelfAttention):
    """:class:`~lmfs.nn.CausalSelfAttention` whose projections that read the same input run as one
    matmul under autocast, and, with ``triton`` on a GPU, whose heads are split and rotated by
    :func:`rope_qkv`. Made from a built module by :func:`fuse_model`."""

    triton: bool = True
    documents: PackedDocuments | None = None   # set by packed_documents while it runs

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # rope_qkv takes one (T, head_dim) table for every sequence: not (B, T) positions.
        if (self.triton and not self.mla and self.rope is not None and self.q_norm is None
                and (positions is None or positions.dim() == 1) and kernels_apply(x, self.q_proj.weight)):
            qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), split=False)
            tables = (self.rope.tables(x.shape[1], x.device) if positions is None
                      else rope_angles(positions, self.rope.head_dim, self.rope.theta))
            q, k, v = rope_qkv(qkv, *tables, self.n_heads, self.n_kv_heads)
            return self.o_proj(self.attend_heads(q, k, v))
        if self.mla:
            q, latent = project(x, (self.q_proj, self.kv_down))
            k, v = project(self.kv_norm(latent), (self.k_proj, self.v_proj))
        else:
            q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(self.heads(q, k, v, positions))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Inside packed_documents: causal within each packed sequence, nothing across them.
        if self.documents is None:
            return super().attend(q, k, v)
        return self.documents.attend(q, k, v, self.window, self.softcap)


# ----------------------------------------------------------------------------------------------
# Sequences packed into one row


# Packed tokens at most on the masked path: its scores are (heads, N, N) floats (512 MB for 8 heads).
MASKED_PACKING_TOKENS = 4096


class PackedDocuments:
    """``lengths``: sequences laid one after another in a single row of ``sum(lengths)`` tokens.

    :meth:`attend` is causal attention within each sequence and none across them, the attention of
    each sequence on its own: on a GPU through PyTorch's variable-length flash attention
    (:func:`~lmfs.batching.flash_varlen`), which computes only each sequence's own block of
    scores; elsewhere through SDPA with a block-diagonal causal mask of ``N × N`` entries (memory
    grows with the square of the row: for tests and small batches).
    """

    def __init__(self, lengths: Sequence[int]):
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"packed sequences need at least one token each, got lengths {self.lengths[:8]}...")
        self.total, self.longest = sum(self.lengths), max(self.lengths)
        self._bounds: dict = {}   # device -> cumulative lengths (S + 1,) int32

    def cu_seqlens(self, device) -> torch.Tensor:
        """Where each sequence starts, and the total: int32 ``(S + 1,)`` on ``device``."""
        from lmfs.batching import upload

        device = torch.device(device)
        if device not in self._bounds:
            self._bounds[device] = upload(list(itertools.accumulate(self.lengths, initial=0)), device, torch.int32)
        return self._bounds[device]

    def mask(self, device, window: int | None = None) -> torch.Tensor:
        """``(N, N)`` boolean: query ``i`` may read key ``j`` (same sequence, ``j <= i``, within ``window``)."""
        sequence = torch.repeat_interleave(torch.arange(len(self.lengths), device=device),
                                           torch.tensor(self.lengths, device=device))
        i = torch.arange(self.total, device=device)
        allowed = (sequence[:, None] == sequence[None, :]) & (i[None, :] <= i[:, None])
        if window is not None:
            allowed &= (i[:, None] - i[None, :]) < window
        return allowed

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """Heads ``(1, H, N, d)`` of the packed row (K/V heads already shared out) -> ``(1, H, N, d)``."""
        from lmfs.batching import flash_varlen, flash_varlen_supports

        if q.shape[0] != 1 or q.shape[2] != self.total:
            raise ValueError(f"packed sequences of {self.total} tokens in all need heads (1, H, {self.total}, d), "
                             f"got {tuple(q.shape)}: pass the sequences as one row")
        if flash_varlen_supports(q, softcap):
            bounds = self.cu_seqlens(q.device)
            # squeeze, not [0]: both are views, but the gradient of a view made by indexing is built
            # in a zero-filled copy of the whole input (2.5 ms of the GRPO benchmark's update on an H200)
            q, k, v = (x.squeeze(0).transpose(0, 1) for x in (q, k, v))
            out = flash_varlen(q, k, v, bounds, bounds, self.longest, self.longest, window)      # (N, H, d)
            return out.transpose(0, 1).unsqueeze(0)
        if self.total > MASKED_PACKING_TOKENS:
            raise ValueError(f"{self.total} packed tokens: without flash attention (a CUDA GPU, 16-bit queries, no "
                             f"soft-cap) packing builds an {self.total} x {self.total} mask and scores that large; "
                             f"pack at most {MASKED_PACKING_TOKENS} tokens here, or pad instead "
                             "(GRPOConfig(packed_update=False))")
        allowed = self.mask(q.device, window)
        if softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        blocked = torch.zeros(allowed.shape, device=q.device, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
        return attention_reference(q, k, v, blocked, softcap)


def keeps_sequences_apart(model: torch.nn.Module) -> bool:
    """Whether ``model`` has attention and all of it is :class:`FusedAttention`, which
    :func:`packed_documents` can keep to each packed sequence."""
    attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    return bool(attention) and all(isinstance(m, FusedAttention) for m in attention)


@contextlib.contextmanager
def packed_documents(model: torch.nn.Module, lengths: Sequence[int]):
    """Within the block, every attention module of ``model`` treats its input as the sequences of
    ``lengths`` packed into one row (:class:`PackedDocuments`): each attends only to itself. Give the
    model positions that restart at 0 for each sequence, and read each sequence's outputs from its
    own span of the row. The attention must be :func:`fuse_model`'s :class:`FusedAttention`: a plain
    :class:`~lmfs.nn.CausalSelfAttention` would attend across the sequences, so a model with one is
    refused (``TypeError``)."""
    attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not keeps_sequences_apart(model):
        plain = [type(m).__name__ for m in attention if not isinstance(m, FusedAttention)]
        raise TypeError(f"packed_documents needs attention that keeps packed sequences apart, but the model has "
                        f"{plain[0] if plain else 'no attention module'}: fuse it first "
                        "(lmfs.kernels.fused.fuse_model)")
    documents = PackedDocuments(lengths)
    for m in attention:
        m.documents = documents
    try:
        yield documents
    finally:
        for m in attention:
            m.documents = None


class FusedGatedMLP(GatedMLP):
    """:class:`~lmfs.nn.GatedMLP` with gate and up as one matmul under autocast, and, with
    ``triton`` on a GPU, SwiGLU through :func:`swiglu`. Made by :func:`fuse_model`."""

    triton: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton and self.act is F.silu and kernels_apply(x, self.gate.weight):
            return self.down(swiglu(fused_linear(x, (self.gate, self.up), split=False)))
        gate, up = project(x, (self.gate, self.up))
        return self.down(self.act(gate) * up)


def norm_kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :class:`FusedRMSNorm` takes :func:`~lmfs.kernels.rmsnorm.rms_norm` for ``x``: on a
    CUDA GPU where the kernel computes what :class:`~lmfs.nn.RMSNorm` does (:func:`norm_kernel_fits`)."""
    return x.is_cuda and norm_kernel_fits(x, weight)


def norm_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`~lmfs.kernels.rmsnorm.rms_norm` computes :class:`~lmfs.nn.RMSNorm`'s function
    on ``x``, in its dtype, and is worth it, whatever the device.

    The plain module returns ``weight * x̂.to(x.dtype)``, the promoted dtype of ``x`` and ``weight``
    (float32 for a bfloat16 ``x`` and float32 weights: QK-norm's heads under autocast), and the
    kernel ``x``'s dtype, so only ``x`` and ``weight`` of one dtype qualify. That includes autocast's
    float32 residual stream with float32 weights; with 16-bit ``x`` and ``weight`` the kernel
    rounds ``x̂ · weight`` once where the plain module rounds ``x̂`` first (the same function up to
    rounding). Only while autograd records: the kernels pay off in the backward, and inference
    has fused norms of its own (:mod:`lmfs.kernels.decode`) in steps captured as CUDA graphs.
    Rows longer than one program holds and empty inputs stay in PyTorch.
    """
    return torch.is_grad_enabled() and x.dtype == weight.dtype and x.numel() > 0 and x.shape[-1] <= MAX_COLS


class FusedRMSNorm(RMSNorm):
    """:class:`~lmfs.nn.RMSNorm` through :func:`~lmfs.kernels.rmsnorm.rms_norm`'s Triton kernels,
    forward and backward, where they compute the same function (:func:`norm_kernel_applies`);
    the plain forward elsewhere. Made by :func:`fuse_model` with ``norms``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_kernel_applies(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class FusedEmbedding(Embedding):
    """:class:`~lmfs.nn.Embedding` through ``F.embedding``: the same lookup, whose backward sums
    the gradient rows of repeated ids in parallel (module docstring). Made by :func:`fuse_model`
    with ``embedding``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class ChunkedLossLM(TransformerLM):
    """:class:`~lmfs.nn.TransformerLM` whose loss never keeps the logits: with targets,
    ``forward`` returns ``(None, loss)``, the head and the loss computed chunk by chunk by
    :func:`lmfs.kernels.loss.linear_cross_entropy` (its Triton kernel with ``triton``, on a GPU).
    Without targets it returns ``(logits, None)`` as before. Made by :func:`fuse_model`."""

    triton: bool = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None):
        if targets is None:
            return super().forward(idx, None, positions)
        self._check_input(idx, targets, positions)
        loss = linear_cross_entropy(self.hidden(idx, positions), self.head_weight(), targets,
                                    z_loss=self.config.z_loss, softcap=self.config.logit_softcap,
                                    kernel=self.triton)
        return None, loss


def fuse_model(model: TransformerLM, *, projections: bool = True, triton: bool = True,
               chunked_loss: bool = True, norms: bool = False, embedding: bool = False) -> TransformerLM:
    """Make a built ``model`` compute faster, in place, and return it (see the module docstring).

    ``projections``: attention and gated MLPs become :class:`FusedAttention` and
    :class:`FusedGatedMLP` (``False`` turns them back into the plain modules). ``triton``: their
    Triton kernels, which read the fused projections' output and so need ``projections``, and the
    loss kernel of the chunked loss; used only on CUDA tensors under autocast. ``chunked_loss``:
    the model becomes a :class:`ChunkedLossLM`. ``norms``: every :class:`~lmfs.nn.RMSNorm` (the
    blocks' and the final one, QK-norm's, MLA's latent norm) becomes a :class:`FusedRMSNorm`,
    whose Triton kernel runs in training on CUDA tensors (:func:`norm_kernel_applies`), with or
    without autocast; ``False`` turns them back. ``embedding``: the token embedding becomes a
    :class:`FusedEmbedding`; ``False`` turns it back. Only the class of each module changes, so
    parameters, buffers, state-dict keys, an optimizer built on ``model.parameters()`` and the
    function computed all stay.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"fuse_model takes an lmfs.nn.TransformerLM, got {type(model).__name__}")
    for module in model.modules():
        if type(module) in (CausalSelfAttention, FusedAttention):
            module.__class__ = FusedAttention if projections else CausalSelfAttention
            module.triton = triton
        elif type(module) in (GatedMLP, FusedGatedMLP):
            module.__class__ = FusedGatedMLP if projections else GatedMLP
            module.triton = triton
        elif type(module) in (RMSNorm, FusedRMSNorm):
            module.__class__ = FusedRMSNorm if norms else RMSNorm
        elif type(module) in (Embedding, FusedEmbedding):
            module.__class__ = FusedEmbedding if embedding else Embedding
    if type(model) in (TransformerLM, ChunkedLossLM):
        model.__class__ = ChunkedLossLM if chunked_loss else TransformerLM
        model.triton = triton
    return model


# ----------------------------------------------------------------------------------------------
# Which SDPA kernel runs

# SDPA's kernels on CUDA, in the order torch tries them on Hopper/Blackwell with a recent cuDNN.
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def prefer_sdpa_backend(backend: str):
    """A context in which SDPA tries ``backend`` (a key of :data:`SDPA_BACKENDS`) first.

    Every backend stays enabled, in the order above after the preferred one, so a call the
    preferred kernel cannot serve (a head dimension it lacks, a GPU without it) falls back
    silently instead of failing. ``torch.compile`` traces the context and bakes the chosen
    kernel, forward and backward, into the graph: enter it inside the compiled function
    (e.g. in a wrapper module's ``forward`` around the model's call).
    """
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA backend {backend!r}: use one of {', '.join(SDPA_BACKENDS)}")
    first = SDPA_BACKENDS[backend]
    return sdpa_kernel([first] + [b for b in SDPA_BACKENDS.values() if b != first], set_priority=True)


def sdpa_preference(backend: str, device: torch.device):
    """:func:`prefer_sdpa_backend` on CUDA; nothing (SDPA's own choice) for ``"auto"`` or elsewhere."""
    if backend == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    return prefer_sdpa_backend(backend)
