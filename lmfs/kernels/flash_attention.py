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

The split of the work: the forward parallelises over query blocks. The backward comes in two
schemes (``flash_attention(..., backward=...)``). ``"split"`` (the default): a dK/dV kernel over key
blocks and a dQ kernel over query blocks, so no two programs write the same output and no atomics
are needed, at the price of computing ``S`` and ``dP`` twice (seven matmuls per block pair).
``"atomic"`` (FA-2's own scheme): one kernel over key blocks that also adds each block's share of
``dQ`` into a float32 buffer with atomic additions (five matmuls, not bit-for-bit reproducible).

Two implementations: :func:`flash_attention` (Triton, autotuned block sizes on a GPU) and
:func:`flash_attention_torch` (the same algorithm in readable PyTorch loops, any device). Their
autograd Functions are public, :class:`FlashAttentionTriton` and :class:`FlashAttentionTorch`:
both take ``(q, k, v, is_causal)`` and save O and the log-sum-exp ``L`` in natural-log units.
"""

from __future__ import annotations

import math

import torch

from lmfs.kernels._triton import (INTERPRET, autotune_bench, check_tensors, config_str, n_candidates,
                                  shared_memory_limit, tl, triton)

HEAD_DIMS = (16, 32, 64, 128)  # powers of two (tl.arange needs them); ≥ 16 for the tensor cores
LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x·log2 e), and exp2 is the faster instruction
LN2 = tl.constexpr(0.6931471805599453)  # log x = log2 x · ln 2


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


def tiled_forward(q, k, v, causal: bool, scale: float, bs: int):
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


def tiled_backward(q, k, v, o, lse, do, causal: bool, scale: float, bs: int):
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


class FlashAttentionTorch(torch.autograd.Function):
    """FlashAttention in PyTorch loops as an autograd Function:
    ``FlashAttentionTorch.apply(q, k, v, is_causal[, sm_scale[, block_size]])`` (``apply`` takes
    positional arguments only; :func:`flash_attention_torch` is the same with keywords).

    ``q, k, v``: ``(B, H, T, D)``. The forward saves ``O`` and the ``(B, H, T)`` fp32
    log-sum-exp ``L = log Σ_j exp(S_ij)`` of each row's scaled scores, in natural-log units;
    the backward recomputes ``P = exp(S − L)`` from them, block by block.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, sm_scale=None, block_size=64):
        _check_shapes("flash_attention_torch", q, k, v)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        o, lse = tiled_forward(q, k, v, is_causal, scale, block_size)
        ctx.save_for_backward(q, k, v, o, lse)  # O and L, not the T×T probabilities
        ctx.causal, ctx.scale, ctx.block_size = is_causal, scale, block_size
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*tiled_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.block_size), None, None, None)


def flash_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                          sm_scale: float | None = None, block_size: int = 64) -> torch.Tensor:
    """FlashAttention in PyTorch loops over ``block_size`` tiles: a readable reference, not fast.

    ``q, k, v``: ``(B, H, T, D)`` on any device; ``sm_scale`` defaults to ``1/√D``. Differentiable:
    the backward recomputes the probabilities from the saved log-sum-exp, block by block.
    Same result as ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``.
    """
    return FlashAttentionTorch.apply(q, k, v, causal, sm_scale, block_size)


# ----------------------------------------------------------------------------------------------
# Triton kernels. Every (batch, head) is a contiguous (T, D) matrix, so its row r, column d sits
# at offset head·T·D + r·D + d. Exponentials are exp2: with c = scale·log2 e, exp(scale·s − m) =
# 2^(c·s − m') where m' is the maximum in log2 units, and c·s − m' is one fused multiply-add per
# score. The forward ends with the log-sum-exp in those log2 units (L₂ = m' + log2 l) and stores
# it in natural-log units (L = L₂·ln 2, one multiply per row), the units of torch.logsumexp; the
# backward converts each row's L back (L₂ = L·log2 e) as it loads it, so it recomputes
# P = 2^(c·s − L₂) with one multiply-add per score as well.
#
# Three kinds of key/value (or query) ranges, so that masks cost only where they are needed:
# blocks every row sees in full (no mask), the blocks on the causal diagonal (a causal mask), and,
# without a causal mask, the partial block at the end of the sequence (a bounds mask). Loads of a
# block that may run past the end of the sequence are masked (zeros come back); that costs one
# comparison per row and is kept wherever a block can be partial.
#
# ``do_not_specialize=["T", ...]``: Triton would otherwise compile a separate kernel for lengths
# that are multiples of 16 and for those that are not (T = 1000 and T = 1024), every autotuning
# candidate twice (likewise for N_CANDIDATES, which only the autotuner reads). Nothing here needs
# it: rows start at multiples of HEAD_DIM ≥ 16 elements, so the loads stay aligned and vectorised
# whatever T is.


@triton.jit
def online_update(acc, l_i, m_i, s, v, offs_m, offs_n, T, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   PRECISION: tl.constexpr):
    """One key/value block's share for one query tile, given its raw scores ``s = q·kᵀ``: the new
    running maximum and sum, and the accumulator rescaled and increased by ``P·V``."""
    if MASKED:
        if CAUSAL:  # query i sees key j only if j ≤ i (this also hides keys past the end)
            visible = offs_m[:, None] >= offs_n[None, :]
        else:
            visible = (offs_n < T)[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:  # the scale is positive, so the maximum of the raw scores, scaled, is the scaled maximum
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)  # rescales the old sum and accumulator to the new maximum
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P goes into the second matmul in the inputs' dtype: 16-bit operands use the tensor cores.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def fwd_inner(acc, l_i, m_i, q, offs_m, acc1, l1, m1, q1, offs_m1, k_ptr, v_ptr, offs_d, lo, hi, T, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
    """Stream the key/value blocks in [lo, hi) past one query block (online softmax).

    ``MASKED``: these blocks need a mask (the causal diagonal, or the partial block at the end).
    Unmasked blocks lie wholly inside the sequence, so their loads need no bounds check either.
    ``SPLIT == 2``: the query block is two tiles (``q``, ``q1``) with their own statistics, and
    both score matmuls are issued before either softmax (see :data:`_FWD_CONFIGS`); with
    ``SPLIT == 1`` the second tile's arguments are unused."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    kv_offsets = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k_ptrs, v_ptrs = k_ptr + kv_offsets, v_ptr + kv_offsets
    for start_n in range(lo, hi, BLOCK_N):  # the offsets advance instead of being recomputed
        if MASKED:
            k = tl.load(k_ptrs, mask=(offs_n < T)[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:  # Triton's interpreter gets 16-bit arithmetic wrong; a GPU keeps 16-bit dot operands
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # raw scores q·k, (rows, BLOCK_N)
        if SPLIT == 2:
            s1 = tl.dot(q1, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            v = tl.load(v_ptrs, mask=(offs_n < T)[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if UPCAST:
            v = v.to(tl.float32)
        acc, l_i, m_i = online_update(acc, l_i, m_i, s, v, offs_m, offs_n, T, qk_scale, MASKED, CAUSAL, PRECISION)
        if SPLIT == 2:
            acc1, l1, m1 = online_update(acc1, l1, m1, s1, v, offs_m1, offs_n, T, qk_scale, MASKED, CAUSAL,
                                          PRECISION)
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * HEAD_DIM
        v_ptrs += BLOCK_N * HEAD_DIM
    return acc, l_i, m_i, acc1, l1, m1


@triton.jit
def _fwd_load_tile(q_ptr, offs_m, offs_d, T, UPCAST: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """A query tile (zeros past ``T``) and its fresh statistics: maximum, sum, accumulator."""
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=(offs_m < T)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)  # running maximum, log2 units
    l_i = tl.zeros([ROWS], dtype=tl.float32)  # running sum of 2^(c·s − m)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)  # unnormalised output
    return q, m_i, l_i, acc


@triton.jit
def _fwd_store_tile(acc, l_i, m_i, O, LSE, row0, offs_m, offs_d, T, HEAD_DIM: tl.constexpr):
    """Normalise once at the end (one reciprocal per row, then multiplications) and store the
    tile's output and log-sum-exp (natural-log units: L = L₂·ln 2)."""
    row_ok = offs_m < T  # the last query block may hang over the end of the sequence
    acc = acc * (1.0 / l_i)[:, None]
    tl.store(O + row0 * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + row0 + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


@triton.jit(do_not_specialize=["T", "N_CANDIDATES"])
def attn_fwd(Q, K, V, O, LSE, T, T_BUCKET, ROWS_BUCKET, N_CANDIDATES, sm_scale, HEAD_DIM: tl.constexpr,
             CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # T_BUCKET, ROWS_BUCKET and N_CANDIDATES are not used here: they are the autotuner's key (see
    # _tune_keys and _pruner).
    ROWS: tl.constexpr = BLOCK_M // SPLIT  # rows per query tile
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks have the most key blocks to see: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M  # this program's query block
    row0 = tl.program_id(1).to(tl.int64) * T  # first row of this (batch, head); int64 for big tensors
    q_ptr, k_ptr, v_ptr = Q + row0 * HEAD_DIM, K + row0 * HEAD_DIM, V + row0 * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = start_m + tl.arange(0, ROWS)
    q, m_i, l_i, acc = _fwd_load_tile(q_ptr, offs_m, offs_d, T, UPCAST, HEAD_DIM, ROWS)
    if SPLIT == 2:
        offs_m1 = offs_m + ROWS
        q1, m1, l1, acc1 = _fwd_load_tile(q_ptr, offs_m1, offs_d, T, UPCAST, HEAD_DIM, ROWS)
    else:  # placeholders that fwd_inner passes through untouched
        offs_m1, q1, m1, l1, acc1 = offs_m, q, m_i, l_i, acc
    qk_scale = sm_scale * LOG2E
    # Causal: key blocks before the query block (all visible), then the diagonal (BLOCK_M is a
    # multiple of BLOCK_N, so that is BLOCK_M / BLOCK_N whole key blocks); later ones are skipped.
    # Not causal: all complete key blocks, then the partial one at the end (if T is not a multiple).
    if CAUSAL:
        lo, mid, hi = 0, start_m, tl.minimum(start_m + BLOCK_M, T)
    else:
        lo, mid, hi = 0, (T // BLOCK_N) * BLOCK_N, T
    acc, l_i, m_i, acc1, l1, m1 = fwd_inner(acc, l_i, m_i, q, offs_m, acc1, l1, m1, q1, offs_m1, k_ptr, v_ptr,
                                             offs_d, lo, mid, T, qk_scale, False, CAUSAL, UPCAST, PRECISION,
                                             BLOCK_N, HEAD_DIM, SPLIT)
    acc, l_i, m_i, acc1, l1, m1 = fwd_inner(acc, l_i, m_i, q, offs_m, acc1, l1, m1, q1, offs_m1, k_ptr, v_ptr,
                                             offs_d, mid, hi, T, qk_scale, True, CAUSAL, UPCAST, PRECISION,
                                             BLOCK_N, HEAD_DIM, SPLIT)
    _fwd_store_tile(acc, l_i, m_i, O, LSE, row0, offs_m, offs_d, T, HEAD_DIM)
    if SPLIT == 2:
        _fwd_store_tile(acc1, l1, m1, O, LSE, row0, offs_m1, offs_d, T, HEAD_DIM)


@triton.jit(do_not_specialize=["n_rows"])
def _attn_bwd_delta(O, DO, DELTA, n_rows, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """Δ = rowsum(dO ∘ O) for every row of every head: one pass before the main backward."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = rows < n_rows
    offsets = rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, axis=1), mask=ok)


@triton.jit
def dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, offs_n, offs_d, lo, hi, T, qk_scale,
                MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the query blocks in [lo, hi) past one key block, accumulating its dK and dV.

    Rows past the end read q = dO = L₂ = Δ = 0: their P is 1 but meets dO = 0 and dP − Δ = 0, so
    they add nothing and need no mask beyond their loads. ``MASKED``: the causal diagonal."""
    offs_m = lo + tl.arange(0, BLOCK_M)
    q_offsets = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q_ptrs, do_ptrs = q_ptr + q_offsets, do_ptr + q_offsets
    for start_m in range(lo, hi, BLOCK_M):
        row_ok = offs_m < T
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0) * LOG2E  # L₂, log2 units
        if UPCAST:
            q = q.to(tl.float32)
        # Transposed scores (keys × queries), so dV and dK come out without further transposes.
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
        if MASKED:  # query i sees key j only if i ≥ j
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        if UPCAST:
            do = do.to(tl.float32)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * HEAD_DIM
        do_ptrs += BLOCK_M * HEAD_DIM
    return dk, dv


@triton.jit
def _load_block_pair(A, B, row0, offs, offs_d, T, UPCAST: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``offs`` of one head from two ``(…, T, HEAD_DIM)`` tensors (a backward program's K and
    V block, or Q and dO block), zeros past ``T``; with the offsets and row mask to store through."""
    ok = offs < T
    offsets = row0 * HEAD_DIM + offs[:, None] * HEAD_DIM + offs_d[None, :]
    a = tl.load(A + offsets, mask=ok[:, None], other=0.0)
    b = tl.load(B + offsets, mask=ok[:, None], other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b, offsets, ok


@triton.jit(do_not_specialize=["T", "N_CANDIDATES"])
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, T, T_BUCKET, ROWS_BUCKET, N_CANDIDATES, sm_scale,
                   HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N  # this program's key block (causal: the first ones have the most work)
    row0 = tl.program_id(1).to(tl.int64) * T
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k, v, kv_offsets, key_ok = _load_block_pair(K, V, row0, offs_n, offs_d, T, UPCAST, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_ptr, do_ptr = Q + row0 * HEAD_DIM, DO + row0 * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    if CAUSAL:  # query blocks before this key block never see it: start at the diagonal
        dk, dv = dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             start_n, tl.minimum(start_n + BLOCK_N, T), T, qk_scale,
                             True, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
        dk, dv = dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             start_n + BLOCK_N, T, T, qk_scale, False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    else:
        dk, dv = dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, offs_n, offs_d,
                             0, T, T, qk_scale, False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    dk = dk * sm_scale  # S = Q·Kᵀ·scale, so dK = dSᵀ·Q·scale
    tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


@triton.jit
def dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, lo, hi, T, qk_scale,
              MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stream the key blocks in [lo, hi) past one query block, accumulating its dQ.

    Keys past the end read k = v = 0: whatever their P, they add dS·k = 0, so only the causal
    diagonal (``MASKED``) needs a mask on P."""
    offs_n = lo + tl.arange(0, BLOCK_N)
    kv_offsets = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k_ptrs, v_ptrs = k_ptr + kv_offsets, v_ptr + kv_offsets
    for start_n in range(lo, hi, BLOCK_N):
        in_seq = offs_n < T
        k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * HEAD_DIM
        v_ptrs += BLOCK_N * HEAD_DIM
    return dq


@triton.jit(do_not_specialize=["T", "N_CANDIDATES"])
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, T, T_BUCKET, ROWS_BUCKET, N_CANDIDATES, sm_scale,
                 HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # as in the forward: the last query blocks have the most work, start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    start_m = pid_m * BLOCK_M  # this program's query block
    row0 = tl.program_id(1).to(tl.int64) * T
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, do, q_offsets, row_ok = _load_block_pair(Q, DO, row0, offs_m, offs_d, T, UPCAST, HEAD_DIM)
    lse = tl.load(LSE + row0 + offs_m, mask=row_ok, other=0.0) * LOG2E  # L₂, log2 units
    delta = tl.load(DELTA + row0 + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_ptr, v_ptr = K + row0 * HEAD_DIM, V + row0 * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    if CAUSAL:  # key blocks before the query block, then the diagonal ones
        dq = dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, 0, start_m, T, qk_scale,
                       False, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
        dq = dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, start_m,
                       tl.minimum(start_m + BLOCK_M, T), T, qk_scale, True, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
    else:
        dq = dq_inner(dq, q, do, lse, delta, k_ptr, v_ptr, offs_m, offs_d, 0, T, T, qk_scale,
                       False, UPCAST, PRECISION, BLOCK_N, HEAD_DIM)
    dq = dq * sm_scale
    tl.store(DQ + q_offsets, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _atomic_inner(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, offs_n, offs_d, lo, n_blocks, first,
                  T, sm_scale, qk_scale, MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Query blocks ``lo + i·BLOCK_M`` for i in [0, n_blocks), starting at block ``first`` and
    wrapping around: dK and dV accumulate here, dQ's share is added to the fp32 DQ in memory."""
    for i in range(0, n_blocks):
        start_m = lo + ((i + first) % n_blocks) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        q_offsets = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        lse = tl.load(lse_ptr + offs_m, mask=row_ok, other=0.0) * LOG2E  # L₂, log2 units
        if UPCAST:
            q = q.to(tl.float32)
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = tl.load(do_ptr + q_offsets, mask=row_ok[:, None], other=0.0)
        delta = tl.load(delta_ptr + offs_m, mask=row_ok, other=0.0)
        if UPCAST:
            do = do.to(tl.float32)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
        # The fifth matmul: this key block's share of dQ = dS·K·scale, added into memory. Many
        # key blocks add to the same rows; "relaxed" asks for nothing beyond the additions themselves.
        dq = tl.dot(tl.trans(ds_t), k, input_precision=PRECISION) * sm_scale
        tl.atomic_add(dq_ptr + q_offsets, dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T", "N_CANDIDATES"])
def _attn_bwd_atomic(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, T, T_BUCKET, ROWS_BUCKET, N_CANDIDATES, sm_scale,
                     HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """FA-2's single backward kernel: one program per key block computes its dK and dV and adds
    its share of dQ atomically into a float32 DQ (zeroed beforehand). Five matmuls per block pair
    instead of the seven of the two-kernel split, at the price of atomic traffic and an order of
    additions that varies from run to run (dQ is not bit-for-bit reproducible)."""
    pid_n = tl.program_id(0)
    start_n = pid_n * BLOCK_N
    row0 = tl.program_id(1).to(tl.int64) * T
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k, v, kv_offsets, key_ok = _load_block_pair(K, V, row0, offs_n, offs_d, T, UPCAST, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_ptr, do_ptr, dq_ptr = Q + row0 * HEAD_DIM, DO + row0 * HEAD_DIM, DQ + row0 * HEAD_DIM
    qk_scale = sm_scale * LOG2E
    if CAUSAL:  # the diagonal query blocks (masked), then every later one; each program starts elsewhere
        diag_end = tl.minimum(start_n + BLOCK_N, T)
        dk, dv = _atomic_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, dq_ptr, offs_n, offs_d,
                               start_n, (diag_end - start_n + BLOCK_M - 1) // BLOCK_M, 0, T, sm_scale, qk_scale,
                               True, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
        rest = tl.maximum(T - (start_n + BLOCK_N), 0)
        dk, dv = _atomic_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, dq_ptr, offs_n, offs_d,
                               start_n + BLOCK_N, (rest + BLOCK_M - 1) // BLOCK_M, 0, T, sm_scale, qk_scale,
                               False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    else:
        # Without a mask every key block visits every query block. Were they all to start at query
        # block 0, the programs of one head would add into the same dQ rows at the same moment;
        # starting each at its own block spreads the atomics over the rows.
        n_blocks = (T + BLOCK_M - 1) // BLOCK_M
        dk, dv = _atomic_inner(dk, dv, k, v, q_ptr, do_ptr, LSE + row0, DELTA + row0, dq_ptr, offs_n, offs_d,
                               0, n_blocks, pid_n % n_blocks, T, sm_scale, qk_scale,
                               False, UPCAST, PRECISION, BLOCK_M, HEAD_DIM)
    dk = dk * sm_scale
    tl.store(DK + kv_offsets, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    tl.store(DV + kv_offsets, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Block sizes. On a GPU, triton.autotune times the candidates on the first call for every new key:
# head dim, causal flag and dtype (which fix the compiled kernel), plus the sequence length and the
# total number of rows, each rounded up to a power of two (so T = 1000 and T = 1024 share a choice,
# and a tiny check does not pick the blocks for a big batch), and the number of candidates asked for
# (``autotune_candidates``). A pruning function keeps only the candidates meant for the head dim and
# dtype at hand, only those whose tiles fit in shared memory, and of those the first
# ``autotune_candidates``, so each kernel compiles and times at most seven.
#
# Tiling rules: the forward and dQ kernels need BLOCK_M to be a multiple of BLOCK_N, the dK/dV
# kernels the reverse, so that the diagonal of a causal mask covers whole blocks.
#
# The interpreter cannot time anything: it gets fixed blocks, large because each block step
# costs Python overhead, yet small enough that short test sequences (T = 48, 100) span several
# blocks, a partial one, and every loop of each kernel.

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per group: head dim 128, 64, ≤ 32 (16-bit), float32,
# the likeliest winners first (``autotune_candidates=n`` tries the first n): the first entries are
# what the autotuner chose on an H200 (triton 3.6, bf16, T = 1k-16k, 2026-11-30). On Hopper a
# warp group (4 warps) issues one 64-row tensor-core instruction (wgmma), so 128-row tiles take 8
# warps at D = 128 (the accumulator alone is 64 fp32 registers a thread) and 4 or 8 at D = 64;
# stages = how many K/V tiles the software pipeline keeps in flight. The backward kernels hold two
# fp32 accumulators (dK and dV, or dQ) plus a score tile and its gradient, so their streamed
# blocks are smaller (32 or 64 rows) where the accumulators are large.
#
# The forward's rows carry a fifth number, SPLIT: with 2, a program's query block is two tiles of
# BLOCK_M / 2 rows that share each K/V block, and both tiles' score matmuls are issued before
# either softmax. The tensor cores run asynchronously, so the second tile's Q·Kᵀ can proceed while
# the first tile's exponentials run: a software version of FlashAttention-3's overlap of softmax
# and matmuls. On the H200 it paid at D = 128 (256-row blocks, 5-11% faster at T ≥ 1k) and not at
# D = 64, where the exponentials are cheap next to the memory traffic (docs/performance.md).
_FWD_CONFIGS = {
    128: [(256, 64, 8, 3, 2), (128, 64, 8, 3, 1), (128, 128, 8, 2, 1), (128, 64, 8, 4, 1), (256, 64, 8, 2, 2),
          (256, 128, 8, 2, 2), (64, 64, 4, 3, 1)],
    64: [(128, 64, 8, 3, 1), (128, 64, 4, 3, 1), (128, 128, 8, 3, 1), (128, 64, 4, 4, 1), (128, 128, 8, 4, 1),
         (128, 64, 4, 5, 1), (64, 64, 4, 4, 1)],
    32: [(128, 64, 4, 3, 1), (64, 64, 4, 3, 1), (64, 32, 4, 4, 1)],
    "fp32": [(64, 32, 4, 2, 1)],
}
_DKDV_CONFIGS = {  # also the atomic backward's: one program per key block there too
    128: [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3)],
    64: [(32, 128, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3), (64, 64, 4, 3)],
    32: [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3)],
    "fp32": [(32, 64, 4, 2)],
}
_DQ_CONFIGS = {
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (128, 64, 4, 3)],
    32: [(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    "fp32": [(64, 32, 4, 2)],
}

def _tune_group(head_dim: int, dtype: torch.dtype):
    if dtype == torch.float32:
        return "fp32"
    return 128 if head_dim >= 128 else 64 if head_dim >= 64 else 32


def _smem_bytes(kernel: str, block_m: int, block_n: int, stages: int, head_dim: int, elem: int) -> int:
    """Shared memory a candidate needs, roughly: the tiles loaded once per program plus ``stages``
    copies of those streamed through the loop (Triton's pipeline keeps one buffer per stage)."""
    if kernel in ("fwd", "dq"):  # Q (and dO) stay, K and V stream
        resident, streamed = block_m * head_dim * (1 if kernel == "fwd" else 2), 2 * block_n * head_dim
    else:  # dK/dV and atomic: K and V stay, Q and dO stream
        resident, streamed = 2 * block_n * head_dim, 2 * block_m * head_dim
    return elem * (resident + stages * streamed)


def _config(row: tuple) -> "triton.Config":
    """A table row ``(BLOCK_M, BLOCK_N, warps, stages[, SPLIT])`` as a ``triton.Config``."""
    blocks = {"BLOCK_M": row[0], "BLOCK_N": row[1], **({"SPLIT": row[4]} if len(row) > 4 else {})}
    return triton.Config(blocks, num_warps=row[2], num_stages=row[3])


def _pruner(kernel: str, table: dict):
    """``early_config_prune`` for ``triton.autotune``: the candidates listed for this head dim and
    dtype, less any whose tiles would not fit in one SM's shared memory."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head_dim, dtype = args["HEAD_DIM"], args["Q"].dtype
        limit = shared_memory_limit()
        wanted = [row for row in table[_tune_group(head_dim, dtype)]
                  if _smem_bytes(kernel, row[0], row[1], row[3], head_dim, dtype.itemsize) <= limit]
        wanted = wanted[:args["N_CANDIDATES"] or None]
        by_row = {(*c.kwargs.values(), c.num_warps, c.num_stages): c for c in configs}
        kept = [by_row[(*_config(row).kwargs.values(), row[2], row[3])] for row in wanted]
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]

    return prune


def _autotuned(kernel_fn, kernel: str, table: dict, reset_to_zero=None, do_bench=autotune_bench):
    """``kernel_fn`` autotuned over every row of ``table`` (pruned per call by :func:`_pruner`)."""
    configs = [_config(row) for row in sorted({row for group in table.values() for row in group})]
    return triton.autotune(configs, key=["T_BUCKET", "ROWS_BUCKET", "N_CANDIDATES", "HEAD_DIM", "CAUSAL"],
                           prune_configs_by={"early_config_prune": _pruner(kernel, table)},
                           reset_to_zero=reset_to_zero, do_bench=do_bench)(kernel_fn)


if INTERPRET:
    _fwd, _dq, _dkdv, _atomic = attn_fwd, _attn_bwd_dq, _attn_bwd_dkdv, _attn_bwd_atomic
    # The forward as two tiles of 32 rows (SPLIT = 2; the autotuned test runs SPLIT = 1 here too).
    _FWD_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 32, "SPLIT": 2}
    _DQ_BLOCKS = {"BLOCK_M": 64, "BLOCK_N": 32}
    _DKDV_BLOCKS = _ATOMIC_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 64}
else:
    _fwd = _autotuned(attn_fwd, "fwd", _FWD_CONFIGS)
    _dkdv = _autotuned(_attn_bwd_dkdv, "dkdv", _DKDV_CONFIGS)
    _dq = _autotuned(_attn_bwd_dq, "dq", _DQ_CONFIGS)
    _atomic = _autotuned(_attn_bwd_atomic, "atomic", _DKDV_CONFIGS, reset_to_zero=["DQ"])
    _FWD_BLOCKS = _DQ_BLOCKS = _DKDV_BLOCKS = _ATOMIC_BLOCKS = {}

# The two backward schemes (flash_attention's ``backward`` argument):
#   "split":  a dK/dV kernel over key blocks and a dQ kernel over query blocks; no two programs
#             write the same output, so no atomics and bit-for-bit reproducible, but QKᵀ and
#             dO·Vᵀ are computed twice: 7 matmuls per block pair.
#   "atomic": one kernel over key blocks that also adds dQ's shares atomically in float32:
#             5 matmuls, plus a float32 dQ buffer (zeroed, then cast) and atomic traffic.
# "split" is the default: Triton's own fused-attention tutorial and PyTorch's FlexAttention take
# it on Hopper; ``python -m lmfs.benchmarks attention`` times both.
BACKWARDS = ("split", "atomic")
DEFAULT_BACKWARD = "split"


def autotune_choices() -> dict[str, str]:
    """The blocks, warps and stages each attention kernel used in its latest launch (on a GPU the
    autotuner's choice for that shape; under the interpreter the fixed blocks)."""
    kernels = {"fwd": (_fwd, _FWD_BLOCKS), "dkdv": (_dkdv, _DKDV_BLOCKS), "dq": (_dq, _DQ_BLOCKS),
               "atomic": (_atomic, _ATOMIC_BLOCKS)}
    return {name: config_str(getattr(kernel, "best_config", None) if not INTERPRET else blocks)
            for name, (kernel, blocks) in kernels.items()}


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products ("ieee"); Triton's default would round them to TF32.
    # 16-bit operands go to the tensor cores as they are; the setting does not apply to them.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tune_keys(B: int, H: int, T: int) -> tuple[int, int]:
    """The autotuner's shape key: T and the total number of rows B·H·T, each rounded up to a power
    of two (at least 1024 and 16384): a new key costs a round of timing, not a compilation."""
    return max(1024, triton.next_power_of_2(T)), max(16384, triton.next_power_of_2(B * H * T))


def _check_inputs(fn: str, q, k, v) -> None:
    check_tensors(fn, q=q, k=k, v=v)
    _check_shapes(fn, q, k, v)
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{fn}: head_dim {q.shape[-1]} is not supported; the kernels take head dims "
                         f"{', '.join(map(str, HEAD_DIMS))}. Zero-pad q, k and v to the next one (and pass "
                         f"sm_scale=1/sqrt(original head_dim)) or use F.scaled_dot_product_attention")


def _flash_forward(q, k, v, causal: bool, scale: float, candidates: int):
    """``(O, L)`` with the log-sum-exp in natural-log units; ``scale`` ≥ 0 (see :func:`_signed`)."""
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)  # noqa: E731
    _fwd[grid](q, k, v, o, lse, T, *_tune_keys(B, H, T), candidates, scale, HEAD_DIM=D, CAUSAL=causal,
               UPCAST=INTERPRET, PRECISION=_precision(q.dtype), **_FWD_BLOCKS)
    return o, lse


def _flash_backward(q, k, v, o, lse, do, causal: bool, scale: float, backward: str, candidates: int):
    B, H, T, D = q.shape
    delta = torch.empty_like(lse)
    _attn_bwd_delta[(triton.cdiv(B * H * T, 64),)](o, do, delta, B * H * T, HEAD_DIM=D, BLOCK_M=64)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    common = dict(HEAD_DIM=D, CAUSAL=causal, UPCAST=INTERPRET, PRECISION=_precision(q.dtype))
    keys = (*_tune_keys(B, H, T), candidates)
    by_key_block = lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), B * H)  # noqa: E731
    if backward == "atomic":
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # the atomics add into it
        _atomic[by_key_block](q, k, v, do, lse, delta, dk, dv, dq, T, *keys, scale, **common, **_ATOMIC_BLOCKS)
        return dq.to(q.dtype), dk, dv
    dq = torch.empty_like(q)
    _dkdv[by_key_block](q, k, v, do, lse, delta, dk, dv, T, *keys, scale, **common, **_DKDV_BLOCKS)
    _dq[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, T, *keys, scale, **common, **_DQ_BLOCKS)
    return dq, dk, dv


def _signed(k: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """The kernels take a scale ≥ 0 (they scale the maximum of the raw scores); softmax(Q·Kᵀ·s) =
    softmax(Q·(−K)ᵀ·|s|) covers a negative one, at the cost of one negated copy of K."""
    return (-k, -scale) if scale < 0 else (k, scale)


class FlashAttentionTriton(torch.autograd.Function):
    """The Triton kernels as an autograd Function:
    ``FlashAttentionTriton.apply(q, k, v, is_causal[, sm_scale[, backward[, autotune_candidates]]])``
    (``apply`` takes positional arguments only; :func:`flash_attention` is the same with keywords
    and explains them).

    The forward saves ``O`` and the ``(B, H, T)`` fp32 log-sum-exp ``L = log Σ_j exp(S_ij)`` of
    each row's scaled scores, in natural-log units (the kernels compute in log2 units and convert
    on the way out and back in); the backward kernels recompute ``P = exp(S − L)`` from them.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, sm_scale=None, backward=DEFAULT_BACKWARD, autotune_candidates=None):
        _check_inputs("flash_attention", q, k, v)
        if backward not in BACKWARDS:
            raise ValueError(f"flash_attention: backward must be one of {', '.join(map(repr, BACKWARDS))}, "
                             f"got {backward!r}")
        candidates = n_candidates("flash_attention", autotune_candidates)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_used, scale_used = _signed(k, scale)
        o, lse = _flash_forward(q, k_used, v, is_causal, scale_used, candidates)
        ctx.save_for_backward(q, k_used, v, o, lse)  # O and L, not the T×T probabilities
        ctx.causal, ctx.scale, ctx.backward, ctx.negated = is_causal, scale_used, backward, k_used is not k
        ctx.candidates = candidates
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _flash_backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.scale, ctx.backward,
                                     ctx.candidates)
        return dq, (-dk if ctx.negated else dk), dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    sm_scale: float | None = None, backward: str = DEFAULT_BACKWARD,
                    autotune_candidates: int | None = None) -> torch.Tensor:
    """FlashAttention-2 in Triton: ``softmax(Q·Kᵀ·sm_scale [+ causal mask])·V``, differentiable.

    ``q, k, v``: ``(B, H, T, D)`` with one shape, on a CUDA GPU (or the CPU under Triton's
    interpreter), float32/float16/bfloat16, ``D`` in 16, 32, 64, 128; any ``T``.
    ``sm_scale`` defaults to ``1/√D``. Same result as
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)``. ``backward`` picks the
    gradient kernels: ``"split"`` (dK/dV and dQ in two kernels, reproducible) or ``"atomic"``
    (one kernel, dQ by float32 atomic additions: fewer matmuls, not bit-for-bit reproducible).
    ``autotune_candidates``: on a GPU, how many block-size candidates per kernel the autotuner
    compiles and times, the likeliest first (``None``: all, up to seven); fewer make the first
    call of a new shape faster. The interpreter uses fixed blocks and ignores it.
    """
    return FlashAttentionTriton.apply(q, k, v, causal, sm_scale, backward, autotune_candidates)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            sm_scale: float | None = None,
                            autotune_candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel alone, no autograd: ``(O, L)``, where ``L`` is the ``(B, H, T)`` fp32
    log-sum-exp of each row's scaled scores (natural-log units, as ``torch.logsumexp``), the one
    number per row the backward keeps."""
    _check_inputs("flash_attention_forward", q, k, v)
    candidates = n_candidates("flash_attention_forward", autotune_candidates)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k_used, scale_used = _signed(k.contiguous(), scale)
    return _flash_forward(q.contiguous(), k_used, v.contiguous(), causal, scale_used, candidates)
