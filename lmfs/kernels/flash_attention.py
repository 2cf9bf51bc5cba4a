"""FlashAttention-2: attention without ever storing the T×T score matrix.

    O = softmax(Q·Kᵀ·scale + mask)·V          Q, K, V, O: (B, H, T, D)

Written out (:func:`lmfs.nn.attention.attention_reference`), attention writes the (T, T) scores
to memory, reads them back for the softmax, writes the probabilities, reads them again for the
product with V: Θ(T²) bytes of traffic per head, for Θ(T²·D) FLOPs, so for D ≤ 128 the GPU
waits on memory. FlashAttention (Dao et al., 2022; FA-2: Dao, 2023) never materialises them:

* **Tiling.** A program takes a block of ``BLOCK_M`` query rows and streams K and V past it in
  blocks of ``BLOCK_N`` rows, all in on-chip memory. HBM traffic drops to reading Q, K, V and
  writing O, plus re-reading K and V once per query block: Θ(T²·D / BLOCK_M) instead of Θ(T²).
* **Online softmax.** A row's softmax needs its maximum and its sum, which are only known at the
  end. So each row keeps a running maximum ``m`` and a running sum ``l`` of ``exp(s − m)``; when a
  new block raises the maximum, what was accumulated so far is rescaled by ``exp(m_old − m_new)``
  (see :func:`online_softmax`). At the end ``O = acc / l``.
* **The log-sum-exp.** The forward saves one number per row, ``L = m + log l`` (the log of the
  softmax denominator), instead of the T×T probabilities: ``P = exp(S − L)`` can be recomputed
  exactly from Q and K in the backward.
* **Recomputation in the backward.** With ``dO`` given and ``Δ = rowsum(dO ∘ O)`` precomputed,
  every block recomputes ``S`` and ``P`` and forms ``dV += Pᵀ·dO``, ``dP = dO·Vᵀ``,
  ``dS = P ∘ (dP − Δ)`` (the softmax backward: Δ_i equals Σ_j P_ij·dP_ij),
  ``dQ += dS·K·scale``, ``dK += dSᵀ·Q·scale``. Recomputing costs FLOPs, which are cheap; storing P
  would cost memory and bandwidth, which are not.
* **Causal block skipping.** With a causal mask, key blocks entirely after a query block are all
  masked: the loops stop at the diagonal, halving the work, and only the blocks that straddle the
  diagonal pay for computing the mask.

FA-2's split of the work: the forward and the dQ kernel parallelise over query blocks, the dK/dV
kernel over key blocks, so no two programs write the same output and no atomics are needed.

Two implementations: :func:`flash_attention` (Triton, autotuned block sizes on a GPU) and
:func:`flash_attention_torch` (the same algorithm in readable PyTorch loops, any device).
"""

from __future__ import annotations

import math

import torch

from lmfs.kernels._triton import INTERPRET, check_tensors, tl, triton

HEAD_DIMS = (16, 32, 64, 128)  # powers of two (tl.arange needs them); ≥ 16 for the tensor cores
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x·log2 e), and exp2 is the faster instruction


def online_softmax(x: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    """Softmax over the last dimension, reading the columns one block at a time.

    The statistics FlashAttention keeps per row, in plain PyTorch: after each block, ``m`` is the
    maximum so far and ``l`` the sum of ``exp(x − m)`` so far. A new block's larger maximum
    rescales the old sum by ``exp(m_old − m_new)``. One pass makes ``m`` and ``l`` exact; a second
    normalises (FlashAttention folds that second pass into the output accumulator instead).

    >>> x = torch.randn(3, 10)
    >>> torch.allclose(online_softmax(x, block_size=4), torch.softmax(x, dim=-1))
    True
    """
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)  # noqa: E741
    for start in range(0, x.shape[-1], block_size):
        block = x[..., start:start + block_size]
        m_new = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - m_new) + torch.exp(block - m_new[..., None]).sum(dim=-1)  # noqa: E741
        m = m_new
    return torch.exp(x - m[..., None]) / l[..., None]


def _check_shapes(fn: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"{fn}: expected (batch, heads, seq_len, head_dim) tensors, got q of shape "
                         f"{tuple(q.shape)}; for (batch, seq_len, heads, head_dim) pass q.transpose(1, 2)")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"{fn}: q, k and v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}; for grouped-query attention repeat the K/V heads first")


# ----------------------------------------------------------------------------------------------
# The readable version: tiles and online softmax in PyTorch loops, fp32 arithmetic.


def _tiled_forward(q, k, v, causal: bool, scale: float, bs: int):
    """``(O, L)`` one (query block, key block) pair at a time; L is the log-sum-exp per row."""
    T = q.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    for i in range(0, T, bs):
        qi = q[:, :, i:i + bs].float()
        rows = torch.arange(i, i + qi.shape[2], device=q.device)
        m = torch.full(qi.shape[:3], float("-inf"), device=q.device)
        l = torch.zeros(qi.shape[:3], device=q.device)  # noqa: E741
        acc = torch.zeros_like(qi)
        # Causal: key blocks after the diagonal are fully masked, so they are skipped.
        for j in range(0, i + bs if causal else T, bs):
            kj, vj = k[:, :, j:j + bs].float(), v[:, :, j:j + bs].float()
            s = qi @ kj.transpose(-2, -1) * scale
            if causal and j == i:  # equal block sizes: only the diagonal block is partly masked
                cols = torch.arange(j, j + kj.shape[2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescales what was accumulated under the old maximum
            l = l * alpha + p.sum(dim=-1)  # noqa: E741
            acc = acc * alpha[..., None] + p @ vj
            m = m_new
        o[:, :, i:i + bs] = (acc / l[..., None]).to(q.dtype)
        lse[:, :, i:i + bs] = m + torch.log(l)
    return o, lse


def _tiled_backward(q, k, v, o, lse, do, causal: bool, scale: float, bs: int):
    """``(dQ, dK, dV)`` by recomputing ``P = exp(S − L)`` block by block."""
    T = q.shape[2]
    delta = (do.float() * o.float()).sum(dim=-1)  # Δ_i = Σ_d dO_id·O_id = Σ_j P_ij·dP_ij
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    for j in range(0, T, bs):  # one key block at a time, as FA-2's dK/dV kernel does
        kj, vj = k[:, :, j:j + bs].float(), v[:, :, j:j + bs].float()
        cols = torch.arange(j, j + kj.shape[2], device=q.device)
        for i in range(j if causal else 0, T, bs):  # causal: earlier query blocks never see key block j
            qi, doi = q[:, :, i:i + bs].float(), do[:, :, i:i + bs].float()
            p = torch.exp(qi @ kj.transpose(-2, -1) * scale - lse[:, :, i:i + bs, None])
            if causal and i == j:
                rows = torch.arange(i, i + qi.shape[2], device=q.device)
                p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
            dv[:, :, j:j + bs] += p.transpose(-2, -1) @ doi
            dp = doi @ vj.transpose(-2, -1)
            ds = p * (dp - delta[:, :, i:i + bs, None])
            dq[:, :, i:i + bs] += ds @ kj * scale
            dk[:, :, j:j + bs] += ds.transpose(-2, -1) @ qi * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_size):
        o, lse = _tiled_forward(q, k, v, causal, scale, block_size)
        ctx.save_for_backward(q, k, v, o, lse)  # O and L, not the T×T probabilities
        ctx.causal, ctx.scale, ctx.block_size = causal, scale, block_size
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_tiled_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.block_size), None, None, None)


def flash_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          sm_scale: float | None = None, block_size: int = 64) -> torch.Tensor:
    """FlashAttention in PyTorch loops over ``block_size`` tiles: a readable reference, not fast.

    ``q, k, v``: ``(B, H, T, D)`` on any device; ``sm_scale`` defaults to ``1/√D``. Differentiable:
    the backward recomputes the probabilities from the saved log-sum-exp, block by block.
    Same result as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``.
    """
    _check_shapes("flash_attention_torch", q, k, v)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttentionTorch.apply(q, k, v, causal, scale, block_size)


# ----------------------------------------------------------------------------------------------
# Triton kernels. Every (batch, head) is a contiguous (T, D) matrix, so its row r, column d sits
# at offset head·T·D + r·D + d. Scores are kept in log2 units (s·scale·log2 e) so that every
# exponential is an exp2.


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, offs_d, lo, hi, T, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the key/value blocks in [lo, hi) past one query block (online softmax)."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        kv_offsets = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASKED:  # only the blocks at the sequence end or on the causal diagonal pay for a mask
            visible = in_seq[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales the old sum and accumulator to the new maximum
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P goes into the second matmul in the inputs' dtype: 16-bit operands use the tensor cores.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, T, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M  # this program's query block
    row0 = tl.program_id(1).to(tl.int64) * T  # first row of this (batch, head); int64 for big tensors
    q_ptr, k_ptr, v_ptr = Q + row0 * HEAD_DIM, K + row0 * HEAD_DIM, V + row0 * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T  # the last query block may hang over the end of the sequence
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:  # Triton's interpreter gets 16-bit arithmetic wrong; a GPU keeps 16-bit dot operands
        q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Two ranges of key blocks: those every row sees in full (no mask to compute), then those that
    # need one. Causal: blocks before the query block, then the diagonal (later ones are skipped).
    # Not causal: all complete blocks, then the partial one at the end (if T is not a multiple).
    if CAUSAL:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, offs_d, 0, start_m, T, qk_scale,
                                   False, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, offs_d, start_m,
                                   tl.minimum(start_m + BLOCK_M, T), T, qk_scale,
                                   True, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
    else:
        n_full = (T // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, offs_d, 0, n_full, T, qk_scale,
                                   False, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptr, v_ptr, offs_m, offs_d, n_full, T, T, qk_scale,
                                   True, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
    acc = acc / l_i[:, None]
    tl.store(O + row0 * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    # L = log Σ exp(s) in natural-log units: m_i and log2(l_i) are in log2 units.
    tl.store(LSE + row0 + offs_m, (m_i + tl.log2(l_i)) / LOG2E, mask=row_ok)


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, n_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Δ = rowsum(dO ∘ O) for every row of every head: one pass before the main backward."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < n_rows
    offsets = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_n, offs_d, lo, hi, T, qk_scale,
                MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the query blocks in [lo, hi) past one key block, accumulating its dK and dV."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        q_offsets = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        do = tl.load(do_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # Rows past the end read q = dO = L = Δ = 0: their P is 1 but meets dO = 0 and dP − Δ = 0,
        # so they add nothing and need no mask.
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        # Transposed scores (keys × queries), so dV and dK come out without further transposes.
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :] * LOG2E)
        if MASKED:  # causal diagonal: query i sees key j only if i ≥ j
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, T, sm_scale, HEAD_DIM: tl.constexpr,
                   CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N  # this program's key block
    row0 = tl.program_id(1).to(tl.int64) * T
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n < T
    kv_offsets = row0 * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_offsets, mask=key_ok[:, None], other=0.0)
    v = tl.load(V + kv_offsets, mask=key_ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_ptr, do_ptr = Q + row0 * HEAD_DIM, DO + row0 * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    if CAUSAL:  # query blocks before this key block never see it: start at the diagonal
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             start_n, tl.minimum(start_n + BLOCK_N, T), T, qk_scale,
                             True, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             start_n + BLOCK_N, T, T, qk_scale, False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    else:
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             0, T, T, qk_scale, False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    dk = dk * sm_scale  # S = Q·Kᵀ·scale, so dK = dSᵀ·Q·scale
    tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, lo, hi, T, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the key blocks in [lo, hi) past one query block, accumulating its dQ."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_seq = offs_n < T
        kv_offsets = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=in_seq[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None] * LOG2E)
        if MASKED:  # keys past the end (their P could overflow) and, if causal, future keys
            visible = in_seq[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, T, sm_scale, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M  # this program's query block
    row0 = tl.program_id(1).to(tl.int64) * T
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q_offsets = row0 * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_offsets, mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + q_offsets, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + row0 + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_ptr, v_ptr = K + row0 * HEAD_DIM, V + row0 * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    # The same two ranges of key blocks as the forward.
    if CAUSAL:
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, 0, start_m, T, qk_scale,
                       False, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, start_m,
                       tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, CAUSAL, UPCAST, PRECISION,
                       BLOCK_N, HEAD_DIM)
    else:
        n_full = (T // BLOCK_N) * BLOCK_N
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, 0, n_full, T, qk_scale,
                       False, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, n_full, T, T, qk_scale,
                       True, CAUSAL, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
    dq = dq * sm_scale
    tl.store(DQ + q_offsets, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# Block sizes. On a GPU, triton.autotune times each candidate on the first call for every new
# (T, head dim, causal, dtype) and keeps the fastest. The forward and dQ kernels need BLOCK_M to be
# a multiple of BLOCK_N, and the dK/dV kernel the reverse, so that a query block's diagonal
# region is whole key blocks (and vice versa). The interpreter cannot time anything: it gets
# fixed blocks, large because each block step costs Python overhead, yet small enough that short
# test sequences (T = 48, 100) span several blocks, a partial one, and both loops of each kernel.
def _configs(rows):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in rows]


_AUTOTUNE_KEY = ["T", "HEAD_DIM", "CAUSAL"]
if INTERPRET:
    _fwd, _dq, _dkdv = _attn_fwd, _attn_bwd_dq, _attn_bwd_dkdv
    _FWD_BLOCKS = _DQ_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 32}
    _DKDV_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 64}
else:
    # (BLOCK_M, BLOCK_N, warps, pipeline stages): few candidates, because each one is compiled for
    # every head dim, dtype and causal flag in use.
    _fwd = triton.autotune(_configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)]),
                           key=_AUTOTUNE_KEY)(_attn_fwd)
    _dq = triton.autotune(_configs([(128, 32, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3)]),
                          key=_AUTOTUNE_KEY)(_attn_bwd_dq)
    _dkdv = triton.autotune(_configs([(32, 128, 4, 4), (64, 128, 8, 3), (64, 64, 4, 3)]),
                            key=_AUTOTUNE_KEY)(_attn_bwd_dkdv)
    _FWD_BLOCKS = _DQ_BLOCKS = _DKDV_BLOCKS = {}


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products ("ieee"); Triton's default would round them to TF32.
    # 16-bit operands go to the tensor cores as they are; the setting does not apply to them.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_inputs(fn: str, q, k, v) -> None:
    check_tensors(fn, q=q, k=k, v=v)
    _check_shapes(fn, q, k, v)
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{fn}: head_dim {q.shape[-1]} is not supported; the kernels take head dims "
                         f"{', '.join(map(str, HEAD_DIMS))}. Zero-pad q, k and v to the next one (and pass "
                         f"sm_scale=1/sqrt(original head_dim)) or use F.scaled_dot_product_attention")


def _flash_forward(q, k, v, causal: bool, scale: float):
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)  # noqa: E731
    _fwd[grid](q, k, v, o, lse, T, scale, HEAD_DIM=D, CAUSAL=causal, UPCAST=INTERPRET,
               PRECISION=_precision(q.dtype), **_FWD_BLOCKS)
    return o, lse


def _flash_backward(q, k, v, o, lse, do, causal: bool, scale: float):
    B, H, T, D = q.shape
    delta = torch.empty_like(lse)
    _attn_bwd_delta[(triton.cdiv(B * H * T, 64),)](o, do, delta, B * H * T, HEAD_DIM=D, BLOCK_M=64)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM=D, CAUSAL=causal, UPCAST=INTERPRET, PRECISION=_precision(q.dtype))
    _dkdv[lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), B * H)](
        q, k, v, do, lse, delta, dk, dv, T, scale, **common, **_DKDV_BLOCKS)
    _dq[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, T, scale, **common, **_DQ_BLOCKS)
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _flash_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)  # O and L, not the T×T probabilities
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _flash_backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None) -> torch.Tensor:
    """FlashAttention-2 in Triton: ``softmax(Q·Kᵀ·sm_scale [+ causal mask])·V``, differentiable.

    ``q, k, v``: ``(B, H, T, D)`` with one shape, on a CUDA GPU (or the CPU under Triton's
    interpreter), float32/float16/bfloat16, ``D`` in 16, 32, 64, 128; any ``T``.
    ``sm_scale`` defaults to ``1/√D``. Same result as
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``.
    """
    _check_inputs("flash_attention", q, k, v)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(q, k, v, causal, scale)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            sm_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel alone, no autograd: ``(O, L)``, where ``L`` is the ``(B, H, T)`` fp32
    log-sum-exp of each row's scaled scores, the one number per row the backward keeps."""
    _check_inputs("flash_attention", q, k, v)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _flash_forward(q.contiguous(), k.contiguous(), v.contiguous(), causal, scale)
