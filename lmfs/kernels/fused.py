"""Triton kernels for the parts of a training step that ``torch.compile`` leaves slow.

Three memory-bound steps of :class:`lmfs.nn.TransformerLM`, each written so that every byte
crosses memory once, forward and backward:

* :func:`rope_qkv`: the heads of a fused q/k/v projection, with RoPE applied to q and k. One
  kernel reads the ``(B, T, (H_q + 2·H_kv)·d)`` matmul output and writes q, k, v; the backward
  kernel writes ``dq``, ``dk`` (rotated back) and ``dv`` straight into one gradient tensor of
  the matmul's shape. Left to ``torch.compile``, that backward is a ``cat`` of three gradients
  fused with the inverse rotation, which Inductor turned into a kernel ten times slower than
  the bytes it moves (an H200 profile: 319 µs per layer for 75 MB; README, Performance).
* :func:`swiglu`: ``silu(gate) · up`` on a fused gate/up matmul output ``(..., 2F)``; the
  backward writes ``dgate`` and ``dup`` into one ``(..., 2F)`` tensor reading each input once
  (Inductor's version of that ``cat`` loaded the inputs once per output half: 1.8× the time).
* :func:`cross_entropy_rows`: the loss and its gradient with respect to the logits of a chunk
  of rows in one kernel (one row per program: an online-softmax pass, then the gradient pass,
  which reads the row again mostly from the L2 cache), for :func:`lmfs.nn.linear_cross_entropy`:
  119 µs a chunk on an H200 where Inductor's kernel for the same work took 144 µs.

The PyTorch versions in :mod:`lmfs.nn` are the references; the model calls these only on a GPU
(``TransformerConfig.triton_kernels``). Forward and backward are computed in float32 and stored in
the inputs' dtype.

Measured on an H200 (GPT-2 small, 16 × 1024 tokens, compiled; README): with these kernels fused
projections take a training step from 30.0 ms (separate projections) to 27.5–27.7 ms; fused
projections without them take 32.0 ms. ``torch.compile`` traces into the autograd Functions and
"functionalises" each kernel's writes into the buffers it was handed, and Inductor may copy them:

* :class:`_RopeQKV` returns the ``(B, T, H, d)`` tensors it made and :func:`rope_qkv` transposes
  them outside the Function. Returning the transposed views from inside made Inductor copy q, k
  and v after every forward kernel (36 × 14 µs a step); moving the transposes took the step
  from 28.0–28.2 to 27.5–27.7 ms.
* One copy is left and kept on purpose: the backward kernel receives the fused gradient three
  times (once per part), and Inductor copies it (12 × 54 µs a step). Handing the kernel that
  tensor once (a wrapper kernel with one destination) removed the copy but made the step
  *slower*, 29.1 ms, with the matmuls 9% slower and 1 ms more idle time between kernels; so did
  a forward kernel that takes the fused input once (29.4 ms). Both were measured side by side
  with this version on two GPUs of one machine; the cause is not known.
* Wrapping the kernels as ``torch.library.custom_op`` removed the copies but made every call a
  trip through Python and the dispatcher: the gaps between kernels grew from 1.0 to 3.5 ms and
  the step to 30.3 ms, so the Functions stay. (``torch.library.triton_op``, which lets Inductor
  launch the kernels itself, is untried.)
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import INTERPRET, check_tensors, row_block, row_warps, tl, triton

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
# Cross-entropy of a chunk of rows, with its gradient, in one pass


@triton.jit
def _cross_entropy_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, grad_ptr, grad_row, V, z_loss, ignore_index,
                          BLOCK_V: tl.constexpr, NEED_GRAD: tl.constexpr, Z_LOSS: tl.constexpr):
    """Row ``r``: ``loss[r] = lse - x[target] (+ z·lse²)`` (0 if the target is ignored), and
    ``grad[grad_row + r] = (softmax(x)·(1 + 2z·lse) - onehot(target)) · scale`` (0 if ignored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
    target = tl.load(targets_ptr + row)
    kept = target != ignore_index
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    x_target = tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    loss = lse - x_target
    if Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if NEED_GRAD:
        p = tl.exp(x - lse)
        if Z_LOSS:
            p = p * (1.0 + 2.0 * z_loss * lse)
        scale = tl.load(scale_ptr) * kept.to(tl.float32)
        grad = tl.where(cols == target, p - 1.0, p) * scale
        tl.store(grad_ptr + (grad_row + row) * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_looped_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, grad_ptr, grad_row, V, z_loss,
                                 ignore_index, BLOCK_V: tl.constexpr, NEED_GRAD: tl.constexpr,
                                 Z_LOSS: tl.constexpr):
    """:func:`_cross_entropy_kernel` for rows longer than the registers hold comfortably: a first
    pass over the row in blocks keeps a running maximum and a rescaled sum of exponentials (the
    online softmax of lecture 06), a second pass writes the gradient. The second read of the row
    comes mostly from the L2 cache, which the program read it into a moment before."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    kept = target != ignore_index
    m = -float("inf")
    total = 0.0
    x_target = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        x_target += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    lse = m + tl.log(total)
    loss = lse - x_target
    if Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if NEED_GRAD:
        scale = tl.load(scale_ptr) * kept.to(tl.float32)
        factor = scale
        if Z_LOSS:
            factor = scale * (1.0 + 2.0 * z_loss * lse)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) * factor - tl.where(cols == target, scale, 0.0)
            tl.store(grad_ptr + (grad_row + row) * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < V)


# Which kernel cross_entropy_rows launches: "looped" (two passes over blocks of CE_BLOCK columns)
# or "row" (the whole row in registers, for rows up to 65,536). Measured on an H200 for 2,097 rows
# of 32,000 bf16 logits (loss and gradient): row 143 µs; looped with 4096-column blocks and 8 warps
# 119 µs (8192 and 16 warps: 131; 2048 and 8: 137). Inductor's kernel for the same work: 144 µs.
CE_KERNEL = "looped"
CE_BLOCK, CE_WARPS = 4096, 8


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       grad: torch.Tensor | None = None, grad_row: int = 0, z_loss: float = 0.0,
                       ignore_index: int = -100) -> torch.Tensor:
    """Per-row loss of ``logits`` ``(n, V)`` against ``targets`` ``(n,)`` (float32 ``(n,)``, 0 for
    ``ignore_index``, plus ``z_loss · lse²``), and, if ``grad`` is given, the gradient of
    ``scale · Σ loss`` with respect to the logits, written into rows ``grad_row .. grad_row + n - 1``
    of ``grad`` (``(≥ grad_row + n, V)``, in its own dtype); ``scale`` is a float32 scalar tensor.
    (The whole gradient buffer and an offset, not a slice of it, so that under ``torch.compile``
    the kernel writes into the buffer in place.)

    One program per row (:data:`CE_KERNEL` picks how it walks the row); the gradient is written
    once. Not differentiable itself: :func:`lmfs.nn.linear_cross_entropy` calls
    it in its forward, which makes the gradient there.
    """
    check_tensors("cross_entropy_rows", logits=logits)
    n, V = logits.shape
    if targets.shape != (n,) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"cross_entropy_rows: targets must be ({n},) and scale a float32 scalar, got "
                         f"{tuple(targets.shape)} and {tuple(scale.shape)} {scale.dtype}")
    if not logits.is_contiguous() or (grad is not None and (grad.dim() != 2 or grad.shape[1] != V
                                                            or grad.shape[0] < grad_row + n
                                                            or not grad.is_contiguous())):
        raise ValueError(f"cross_entropy_rows: logits must be contiguous (n, V) and grad a contiguous "
                         f"(≥ grad_row + n, V) tensor; got logits {tuple(logits.shape)}, grad "
                         f"{None if grad is None else tuple(grad.shape)}, grad_row {grad_row}")
    if CE_KERNEL == "looped":
        kernel, block, warps = _cross_entropy_looped_kernel, min(CE_BLOCK, triton.next_power_of_2(V)), CE_WARPS
    else:
        block = row_block("cross_entropy_rows", V, limit=65536)
        kernel, warps = _cross_entropy_kernel, row_warps(block)
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    kernel[(n,)](logits, targets.contiguous(), scale, loss, grad if grad is not None else logits, grad_row, V,
                 float(z_loss), ignore_index, BLOCK_V=block, NEED_GRAD=grad is not None, Z_LOSS=bool(z_loss),
                 num_warps=warps)
    return loss
