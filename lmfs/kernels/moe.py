"""A mixture-of-experts layer's sorted dispatch fused into a few Triton kernels, without atomics.

:meth:`lmfs.nn.moe.MoE.combine_sorted` is the readable fast path: gather the tokens in expert
order, three grouped matmuls with the SwiGLU between them, weight the outputs, ``index_add`` them
back per token. Every step is its own kernel, and most of them only move memory: on an H200 at
the benchmark's shape the grouped matmuls take a third of the layer's time (docs/performance.md).
:class:`FusedMoE` computes the same function (same parameters, same routing) like this:

* **The gather happens inside the matmul.** The first kernel reads row ``rows[p]`` of ``x`` for
  sorted position ``p`` (``rows`` = the token of each sorted assignment) while it loads its tile,
  so the ``(tokens·k, d_model)`` gathered copy of ``x`` is never written; the weight gradient of
  the first layer reads ``x`` through the same indices (:func:`~lmfs.kernels.grouped_gemm._weight_grad`).
* **SwiGLU and the routing weights in the epilogues.** The first kernel multiplies each tile by
  the gate and the up matrices at once (one read of the activations for both) and writes
  ``h = weight · silu(g) · u`` along with ``g`` and ``u`` for the backward: a routing weight is
  one number per row, so it may scale the down projection's input instead of its output. The
  backward of the second layer's input product applies the weight and SwiGLU's derivative to its
  tile before storing, so it writes ``dg`` and ``du`` directly; the backward of the first layer
  sums the two products ``dg·W_gateᵀ + du·W_upᵀ`` in one kernel.
* **Combine by the inverse permutation.** Token ``t``'s assignments sit at known sorted positions
  ``slot_pos[t, j]`` (``-1`` for an empty slot: a dropped assignment, or fewer experts under
  expert choice). So ``out[t] = Σ_j y[slot_pos[t, j]]`` is a gather and a sum, a tile of tokens
  × columns per program with all of its k row loads in flight at once: no scatter, no atomic
  adds (16-bit ones are compare-and-swap loops on a GPU). The shared experts' output is the
  accumulator's starting value, so adding it costs one more read instead of a separate pass
  over the output (its gradient is the output's). The input's gradient, a sum over each token's
  sorted rows, is the same gather-and-sum.
* **No gradient of the expert outputs.** Row ``p`` of that gradient would be ``dout[rows[p]]``,
  a copy of the output's gradient in sorted order; the down projection's input gradient and
  weight gradient read ``dout`` through ``rows`` instead, like the first layer reads ``x``. The
  routing weight's gradient, ``⟨dout[t], (silu(g)·u)[p]·W_down⟩ = ⟨dout[t]·W_downᵀ, (silu(g)·u)[p]⟩``,
  is a row sum of numbers the input-gradient kernel holds anyway (one partial sum per column tile,
  added up after).

Four kernels here (first layer; the two backward products; combine) and the second layer's
product and all weight gradients by :mod:`lmfs.kernels.grouped_gemm`'s kernels.
Opt in with :func:`use_fused_moe` (the MoE layers of a model become :class:`FusedMoE`, keeping
their parameters). Checked against the loop and sorted dispatch of :mod:`lmfs.nn.moe`, forward and
backward, in tests/test_moe_fused.py; timed by ``python -m lmfs.benchmarks moe`` (row ``lmfs fused``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmfs.kernels._triton import INTERPRET, check_tensors, config_str, tl, triton
from lmfs.kernels.grouped_gemm import (_FWD_BLOCKS, _FWD_CONFIGS, _FWD_NAMES, _autotuned, _block_e, _matmul,
                                       _precision, _rows_bucket, _tile_coords, _tile_grid, _tile_product, _weight_grad)
from lmfs.kernels.fused import fused_linear, swiglu
from lmfs.nn.moe import MoE, Routing


@triton.jit(do_not_specialize=["N", "ROWS_BUCKET", "N_CANDIDATES"])
def moe_up_kernel(x_ptr, rows_ptr, rw_ptr, wg_ptr, wu_ptr, h_ptr, g_ptr, u_ptr, offsets_ptr, N, K, M, E,
                  ROWS_BUCKET, N_CANDIDATES, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of the first layer: ``g = x[rows] · W_gate[e]``, ``u = x[rows] · W_up[e]`` and
    ``h = rw · silu(g) · u``, all (N, M) in sorted order, ``rw`` (N,) float32 the routing weight
    of each sorted row. x: (tokens, K); W_gate, W_up: (E, K, M); all contiguous. Each A tile
    (gathered rows of x) is loaded once for both products."""
    group, pos, pos_ok, cols, col_ok = _tile_coords(offsets_ptr, E, M, BLOCK_E, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    token = tl.load(rows_ptr + pos, mask=pos_ok, other=0)  # row of x for each sorted position
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token.to(tl.int64)[:, None] * K + ks[None, :]
    w_offs = ks[:, None] * M + cols[None, :]  # within one expert's matrix: int32 suffices
    wg_ptrs = wg_ptr + group.to(tl.int64) * K * M + w_offs
    wu_ptrs = wu_ptr + group.to(tl.int64) * K * M + w_offs
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_ptrs, mask=pos_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(wg_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        bu = tl.load(wu_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * M
        wu_ptrs += BLOCK_K * M
    offs = pos.to(tl.int64)[:, None] * M + cols[None, :]
    mask = pos_ok[:, None] & col_ok[None, :]
    # h from g and u as stored (rounded to their dtype): the backward sees the same numbers.
    g = acc_g.to(g_ptr.dtype.element_ty)
    u = acc_u.to(u_ptr.dtype.element_ty)
    tl.store(g_ptr + offs, g, mask=mask)
    tl.store(u_ptr + offs, u, mask=mask)
    g32 = g.to(tl.float32)
    rw = tl.load(rw_ptr + pos, mask=pos_ok, other=0.0)
    h = g32 * tl.sigmoid(g32) * u.to(tl.float32) * rw[:, None]
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "ROWS_BUCKET", "N_CANDIDATES"])
def moe_down_dx_kernel(dout_ptr, rows_ptr, rw_ptr, wd_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, parts_ptr, offsets_ptr, N,
                       K, M, E, stride_we, stride_wk, stride_wm, ROWS_BUCKET, N_CANDIDATES,
                       NEED_DWEIGHT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of the second layer's input gradient with SwiGLU's backward in the epilogue.

    The layer's output is ``out[t] = Σ_p∈t rw[p] · (silu(g)·u)[p] · W_down[e]``, so with
    ``a = dout[rows] · W_down[e]ᵀ`` (K = d_model, M = width; ``dout`` (tokens, K) read through
    the token of each sorted row, ``wd`` W_downᵀ as a strided view) the gradients are
    ``dh = rw · a``, ``dg = dh · u · silu'(g)`` with ``silu'(g) = σ(g)(1 + g(1 − σ(g)))``,
    ``du = dh · silu(g)``, stored (N, M); and, if ``NEED_DWEIGHT``, the routing weight's
    ``⟨a, silu(g)·u⟩`` over this tile's columns into ``parts[column tile, p]`` (float32, zeros
    beforehand; the caller sums over the column tiles). The epilogue is ordered for registers:
    ``g`` is loaded, turned into ``a·silu(g)`` and ``a·silu'(g)`` and dropped before ``u`` is
    loaded, so no more than three float32 tiles are live at once (each 64 registers a thread at
    128 × 128 with 8 warps)."""
    group, pos, pos_ok, cols, col_ok = _tile_coords(offsets_ptr, E, M, BLOCK_E, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    token = tl.load(rows_ptr + pos, mask=pos_ok, other=0)
    a = _tile_product(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), dout_ptr, token, pos_ok, K,
                      wd_ptr + group.to(tl.int64) * stride_we, stride_wk, stride_wm, cols, col_ok, K,
                      UPCAST, PRECISION, BLOCK_K)
    offs = pos.to(tl.int64)[:, None] * M + cols[None, :]
    mask = pos_ok[:, None] & col_ok[None, :]
    rw = tl.load(rw_ptr + pos, mask=pos_ok, other=0.0)[:, None]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    a_silu = a * silu                         # the product with u is h's share of the weight's gradient
    a_dsilu = a * (sig + silu * (1 - sig))   # a · silu'(g): from here on a and g are dead
    tl.store(du_ptr + offs, (rw * a_silu).to(du_ptr.dtype.element_ty), mask=mask)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dg_ptr + offs, (rw * a_dsilu * u).to(dg_ptr.dtype.element_ty), mask=mask)
    if NEED_DWEIGHT:
        col_tile = tl.program_id(0) % tl.cdiv(M, BLOCK_N)
        tl.store(parts_ptr + col_tile.to(tl.int64) * N + pos, tl.sum(a_silu * u, axis=1), mask=pos_ok)


@triton.jit(do_not_specialize=["N", "ROWS_BUCKET", "N_CANDIDATES"])
def moe_up_dx_kernel(dg_ptr, du_ptr, wg_ptr, wu_ptr, dx_ptr, offsets_ptr, N, K, M, E, stride_we, stride_wk,
                     stride_wm, ROWS_BUCKET, N_CANDIDATES, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of the first layer's input gradient, still in sorted order:
    ``dg · W_gate[e]ᵀ + du · W_up[e]ᵀ`` (K = width, M = d_model; ``wg``, ``wu`` transposed views
    with the same strides). Both products accumulate into one tile: no second pass to add them."""
    group, pos, pos_ok, cols, col_ok = _tile_coords(offsets_ptr, E, M, BLOCK_E, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    w_off = group.to(tl.int64) * stride_we
    acc = _tile_product(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), dg_ptr, pos, pos_ok, K,
                        wg_ptr + w_off, stride_wk, stride_wm, cols, col_ok, K, UPCAST, PRECISION, BLOCK_K)
    acc = _tile_product(acc, du_ptr, pos, pos_ok, K, wu_ptr + w_off, stride_wk, stride_wm, cols, col_ok, K,
                        UPCAST, PRECISION, BLOCK_K)
    tl.store(dx_ptr + pos.to(tl.int64)[:, None] * M + cols[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=pos_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_combine_kernel(y_ptr, slot_pos_ptr, base_ptr, out_ptr, T, D, stride_st, stride_sj, SLOTS: tl.constexpr,
                       HAS_BASE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out[t] = base[t] + Σ_j y[slot_pos[t, j]]`` for a tile of BLOCK_T tokens × BLOCK_D columns;
    slots with ``slot_pos = -1`` add nothing, and without ``HAS_BASE`` there is no ``base`` term.
    y: (A, D), base and out: (T, D), contiguous, base in any float dtype; slot_pos (int32): (T, SLOTS)
    with strides ``stride_st``, ``stride_sj``. Sums in float32.

    The loop over slots is unrolled, so the SLOTS row loads of every token of the tile are issued
    before the first one is needed: a gather of scattered rows is bound by how many loads are in
    flight, and one token per program (SLOTS short rows) kept too few of them going."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tokens < T
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    offs = tokens.to(tl.int64)[:, None] * D + cols[None, :]
    mask = tok_ok[:, None] & col_ok[None, :]
    if HAS_BASE:
        acc = tl.load(base_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        pos = tl.load(slot_pos_ptr + tokens * stride_st + j * stride_sj, mask=tok_ok, other=-1)
        used = pos >= 0
        acc += tl.load(y_ptr + pos.to(tl.int64)[:, None] * D + cols[None, :], mask=used[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_router_kernel(x_ptr, w_ptr, logits_ptr, probs_ptr, weight_ptr, expert_ptr, token_ptr, load_ptr, N, D, E,
                      TOP_K: tl.constexpr, TOPK_THEN_SOFTMAX: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Token-choice routing of ``BLOCK_T`` tokens: ``logits = x · Wᵀ`` in float32 (x (N, D) in any
    float dtype, upcast as it is loaded; W (E, D), the router's Linear weight), the softmax
    ``probs``, and the top ``TOP_K`` experts by repeated arg-max (descending, the lowest index
    first among equal logits) with their weights: the chosen probabilities, or with
    ``TOPK_THEN_SOFTMAX`` a softmax over the chosen logits. Stores logits and probs (N, E) and the
    weights, experts and tokens choice-major, ``(TOP_K, N)``: the order of
    :func:`~lmfs.nn.moe._token_choice`; adds this tile's assignments per expert to ``load`` (E,)
    int64 (zeros beforehand)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    ds = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d_ok = ds < D - d0
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * D + (d0 + ds)[None, :], mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        b = tl.load(w_ptr + es[None, :] * D + (d0 + ds)[:, None], mask=d_ok[:, None] & e_ok[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    logits = tl.where(e_ok[None, :], acc, float("-inf"))
    top = tl.max(logits, axis=1)
    p = tl.exp(logits - top[:, None])
    total = tl.sum(p, axis=1)
    offs = rows.to(tl.int64)[:, None] * E + es[None, :]
    mask = row_ok[:, None] & e_ok[None, :]
    tl.store(logits_ptr + offs, acc, mask=mask)
    tl.store(probs_ptr + offs, p / total[:, None], mask=mask)
    # The probabilities rank the experts as the logits do: choose on the logits.
    ks = tl.arange(0, BLOCK_K)
    chosen = tl.full([BLOCK_T, BLOCK_K], float("-inf"), tl.float32)
    vals = logits
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(vals, axis=1)
        idx = tl.min(tl.where(vals == best[:, None], es[None, :], BLOCK_E), axis=1)
        tl.store(expert_ptr + j * N + rows, idx.to(tl.int64), mask=row_ok)
        tl.store(token_ptr + j * N + rows, rows.to(tl.int64), mask=row_ok)
        chosen = tl.where(ks[None, :] == j, best[:, None], chosen)
        hit = es[None, :] == idx[:, None]
        count += tl.sum(tl.where(hit & row_ok[:, None], 1, 0), axis=0)
        vals = tl.where(hit, float("-inf"), vals)
    tl.atomic_add(load_ptr + es, count.to(tl.int64), mask=e_ok, sem="relaxed")
    if TOPK_THEN_SOFTMAX:
        weight = tl.exp(chosen - top[:, None])   # the first choice is the largest logit
        weight = weight / tl.sum(weight, axis=1)[:, None]
    else:
        weight = tl.exp(chosen - top[:, None]) / total[:, None]
    tl.store(weight_ptr + ks[None, :] * N + rows[:, None], weight, mask=row_ok[:, None] & (ks < TOP_K)[None, :])


@triton.jit
def moe_router_dx_kernel(probs_ptr, weight_ptr, expert_ptr, dweight_ptr, dprobs_ptr, dlogits_in_ptr, w_ptr,
                         dlogits_ptr, dx_ptr, N, D, E, TOP_K: tl.constexpr, TOPK_THEN_SOFTMAX: tl.constexpr,
                         HAS_DWEIGHT: tl.constexpr, HAS_DPROBS: tl.constexpr, HAS_DLOGITS: tl.constexpr,
                         NEED_DX: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """The router's backward for ``BLOCK_T`` tokens: the logits' gradient (float32, stored (N, E)
    for the weight's gradient) from the gradients of the weights (choice-major, as
    :func:`moe_router_kernel` stores them) and, where given, of probs and logits; then
    ``dx = dlogits · W`` (W (E, D)) in x's dtype."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    offs = rows.to(tl.int64)[:, None] * E + es[None, :]
    mask = row_ok[:, None] & e_ok[None, :]
    probs = tl.load(probs_ptr + offs, mask=mask, other=0.0)
    dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)   # gradient of the probabilities
    dl = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)   # of the logits, beyond the softmax's
    if HAS_DWEIGHT:
        if TOPK_THEN_SOFTMAX:   # w = softmax(chosen logits): dl_j = w_j (dw_j - Σ_i w_i dw_i)
            s = tl.zeros([BLOCK_T], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                s += tl.load(weight_ptr + j * N + rows, mask=row_ok, other=0.0) * \
                    tl.load(dweight_ptr + j * N + rows, mask=row_ok, other=0.0)
            for j in tl.static_range(TOP_K):
                w_j = tl.load(weight_ptr + j * N + rows, mask=row_ok, other=0.0)
                dw_j = tl.load(dweight_ptr + j * N + rows, mask=row_ok, other=0.0)
                e_j = tl.load(expert_ptr + j * N + rows, mask=row_ok, other=0)
                dl = tl.where(es[None, :] == e_j[:, None], (w_j * (dw_j - s))[:, None], dl)
        else:                   # w = the chosen probabilities
            for j in tl.static_range(TOP_K):
                dw_j = tl.load(dweight_ptr + j * N + rows, mask=row_ok, other=0.0)
                e_j = tl.load(expert_ptr + j * N + rows, mask=row_ok, other=0)
                dp = tl.where(es[None, :] == e_j[:, None], dw_j[:, None], dp)
    if HAS_DPROBS:
        dp += tl.load(dprobs_ptr + offs, mask=mask, other=0.0)
    dl += probs * (dp - tl.sum(probs * dp, axis=1)[:, None])   # the softmax's Jacobian
    if HAS_DLOGITS:
        dl += tl.load(dlogits_in_ptr + offs, mask=mask, other=0.0)
    tl.store(dlogits_ptr + offs, dl, mask=mask)
    if NEED_DX:
        ds = tl.arange(0, BLOCK_D)
        for d0 in range(0, D, BLOCK_D):
            d_ok = ds < D - d0
            w = tl.load(w_ptr + es[:, None] * D + (d0 + ds)[None, :], mask=e_ok[:, None] & d_ok[None, :],
                        other=0.0).to(tl.float32)
            dx = tl.dot(dl, w, input_precision=PRECISION)
            tl.store(dx_ptr + rows.to(tl.int64)[:, None] * D + (d0 + ds)[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def moe_router_dw_kernel(dlogits_ptr, x_ptr, part_ptr, N, D, E, TOKENS_PER_SPLIT, PRECISION: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """One split's share of the router weight's gradient ``dlogitsᵀ · x`` over ``BLOCK_D`` columns:
    the tokens ``[split · TOKENS_PER_SPLIT, ...)``, into ``part[split]`` (E, D) float32 (the caller
    sums over the splits)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    split = tl.program_id(1)
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    ts = tl.arange(0, BLOCK_T)
    start = split * TOKENS_PER_SPLIT
    end = tl.minimum(start + TOKENS_PER_SPLIT, N)
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t_ok = t0 + ts < end
        dl = tl.load(dlogits_ptr + (t0 + ts).to(tl.int64)[None, :] * E + es[:, None],
                     mask=e_ok[:, None] & t_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + (t0 + ts).to(tl.int64)[:, None] * D + cols[None, :], mask=t_ok[:, None] & col_ok[None, :],
                     other=0.0).to(tl.float32)
        acc = tl.dot(dl, xt, acc, input_precision=PRECISION)
    tl.store(part_ptr + split.to(tl.int64) * E * D + es[:, None] * D + cols[None, :], acc,
             mask=e_ok[:, None] & col_ok[None, :])


# Tile shapes of the three matmul kernels, as grouped_gemm's (BLOCK_M, BLOCK_N, BLOCK_K, warps,
# stages), the likeliest first. The first layer keeps two (BLOCK_M, BLOCK_N) float32 accumulators
# (gate and up), and the second layer's input gradient up to three float32 tiles in its epilogue;
# at 128 × 128 with 8 warps one such tile is 64 registers a thread. Those lists lead with 64-wide
# column tiles (two warp groups, 3-4 stages: 24-32 KB of shared memory a stage). The input
# gradient's epilogue moves 8 bytes per output element (g and u in, dg and du out) after its
# K loop; a GPU hides that only behind another program's K loop on the same SM, so its list also
# has tiles small enough for two or three programs per SM (4 warps, 3 stages).
_UP_CONFIGS = {"16-bit": [(128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4),
                          (64, 128, 64, 4, 4), (128, 64, 32, 8, 5), (64, 64, 64, 4, 4)],
               "fp32": _FWD_CONFIGS["fp32"]}
_DOWN_DX_CONFIGS = {"16-bit": [(128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3),
                               (128, 128, 64, 8, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 4),
                               (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)],
                    "fp32": _FWD_CONFIGS["fp32"]}
if INTERPRET:
    _up, _down_dx, _up_dx = moe_up_kernel, moe_down_dx_kernel, moe_up_dx_kernel
else:
    _up = _autotuned(moe_up_kernel, _UP_CONFIGS, _FWD_NAMES, "x_ptr")
    # parts: a candidate with narrower column tiles fills rows that the chosen one leaves alone
    _down_dx = _autotuned(moe_down_dx_kernel, _DOWN_DX_CONFIGS, _FWD_NAMES, "dout_ptr", reset_to_zero=["parts_ptr"])
    _up_dx = _autotuned(moe_up_dx_kernel, _FWD_CONFIGS, _FWD_NAMES, "dg_ptr")
# The narrowest column tile the input-gradient kernel may pick: it sizes the routing weights'
# partial sums (one row per column tile) before the autotuner has chosen.
_DOWN_DX_MIN_BLOCK_N = (_FWD_BLOCKS["BLOCK_N"] if INTERPRET else
                        min(row[1] for rows in _DOWN_DX_CONFIGS.values() for row in rows))
# The combine kernel's tiles: BLOCK_T tokens × BLOCK_D columns. On a GPU, 16 × 256 with 4 warps is
# 32 elements a thread per slot (four 16-byte loads), so top-8 keeps 32 loads a thread in flight;
# the interpreter gets few, wide programs.
_COMBINE_BLOCKS = {"BLOCK_T": 16, "BLOCK_D": 16} if INTERPRET else {"BLOCK_T": 16, "BLOCK_D": 256, "num_warps": 4}
_KERNELS = (("up", _up), ("down_dx", _down_dx), ("up_dx", _up_dx))


def autotune_choices() -> dict[str, str]:
    """Blocks, warps and stages of the latest launches of the three matmul kernels of this module."""
    return {name: config_str(_FWD_BLOCKS if INTERPRET else getattr(kernel, "best_config", None))
            for name, kernel in _KERNELS}


def autotune_timings() -> dict[str, dict[str, float]]:
    """Milliseconds the autotuner measured for every candidate of the three matmul kernels at
    their latest new shape (median of its repeats), fastest first; empty under the interpreter."""
    timings = {}
    for name, kernel in _KERNELS:
        measured = getattr(kernel, "configs_timings", None) or {}
        ms = {config_str(c): (t[0] if isinstance(t, (list, tuple)) else t) for c, t in measured.items()}
        timings[name] = dict(sorted(ms.items(), key=lambda item: item[1]))
    return timings


def _combine(y: torch.Tensor, slot_pos: torch.Tensor, dtype: torch.dtype,
             base: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (tokens, D) in ``dtype``: the sum of each token's sorted rows of ``y`` (A, D), plus
    ``base`` (tokens, D) where given (added in float32 before the one rounding to ``dtype``)."""
    tokens, slots = slot_pos.shape
    out = torch.empty(tokens, y.shape[1], device=y.device, dtype=dtype)
    if base is not None:
        base = base.contiguous()
    if tokens:
        grid = triton.cdiv(tokens, _COMBINE_BLOCKS["BLOCK_T"]), triton.cdiv(y.shape[1], _COMBINE_BLOCKS["BLOCK_D"])
        moe_combine_kernel[grid](y, slot_pos, out if base is None else base, out, tokens, y.shape[1],
                                 *slot_pos.stride(), slots, HAS_BASE=base is not None, **_COMBINE_BLOCKS)
    return out


class _FusedExperts(torch.autograd.Function):
    """``_FusedExperts.apply(x, w_gate, w_up, w_down, row_weight, rows, offsets, slot_pos, out_dtype, shared)``:
    the experts and the combine of :class:`FusedMoE` as one autograd Function.

    x: (tokens, d_model); w_gate, w_up: (E, d_model, width), w_down: (E, width, d_model), all in
    one dtype; row_weight: (A,) float32 routing weight of each sorted position; rows: (A,) token
    of each sorted position; offsets: (E + 1,) group boundaries; slot_pos: (tokens, slots) int32
    sorted position of each token's assignments, -1 where empty; shared: (tokens, d_model), the
    shared experts' output, or None. Returns ``shared`` + the routed experts' weighted sum,
    (tokens, d_model) in ``out_dtype``: the combine kernel adds ``shared`` in its epilogue, and
    its gradient is the output's. Saves x, the first layer's g and u and its weighted output h.

    The routing weight multiplies h (a scalar per row commutes with the down projection), so the
    combine is a plain sum: the down projection's input gradient reads ``dout`` through ``rows``
    (as the first layer reads x), the ``(A, d_model)`` gradient of the expert outputs is never
    written, and the weight's gradient comes out of that kernel's epilogue (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, row_weight, rows, offsets, slot_pos, out_dtype, shared):
        A, E, (K, M) = rows.shape[0], w_gate.shape[0], w_gate.shape[1:]
        h, g, u = (torch.empty(A, M, device=x.device, dtype=x.dtype) for _ in range(3))
        if A:
            _up[_tile_grid(A, E, M)](x, rows, row_weight, w_gate, w_up, h, g, u, offsets, A, K, M, E, _rows_bucket(A),
                                     0, UPCAST=INTERPRET, PRECISION=_precision(x.dtype), BLOCK_E=_block_e(E),
                                     **_FWD_BLOCKS)
        y = _matmul(h, w_down, offsets, 0)  # already weighted
        ctx.save_for_backward(x, w_gate, w_up, w_down, row_weight, rows, offsets, slot_pos, h, g, u)
        ctx.shared_dtype = None if shared is None else shared.dtype
        return _combine(y, slot_pos, out_dtype, base=shared)

    @staticmethod
    def backward(ctx, grad):
        x, w_gate, w_up, w_down, row_weight, rows, offsets, slot_pos, h, g, u = ctx.saved_tensors
        (A, M), (D, E) = g.shape, (x.shape[1], w_gate.shape[0])
        need = ctx.needs_input_grad
        dshared = grad.to(ctx.shared_dtype) if need[9] else None  # shared enters the output as a plain sum
        dout = grad.to(x.dtype).contiguous()  # the matmuls' operand dtype (a no-op unless under autocast)
        dg, du = torch.empty_like(g), torch.empty_like(u)
        dx_sorted = torch.empty(A, D, device=x.device, dtype=x.dtype)
        # the routing weights' gradient, one float32 partial sum per column tile of the width
        parts = torch.zeros(triton.cdiv(M, _DOWN_DX_MIN_BLOCK_N) if need[4] else 0, A, device=x.device,
                            dtype=torch.float32)
        if A:
            wd_t, wg_t, wu_t = (w.transpose(1, 2) for w in (w_down, w_gate, w_up))
            blocks = dict(UPCAST=INTERPRET, PRECISION=_precision(x.dtype), BLOCK_E=_block_e(E), **_FWD_BLOCKS)
            _down_dx[_tile_grid(A, E, M)](dout, rows, row_weight, wd_t, g, u, dg, du, parts, offsets, A, D, M, E,
                                          *wd_t.stride(), _rows_bucket(A), 0, NEED_DWEIGHT=need[4], **blocks)
            _up_dx[_tile_grid(A, E, D)](dg, du, wg_t, wu_t, dx_sorted, offsets, A, M, D, E, *wg_t.stride(),
                                        _rows_bucket(A), 0, **blocks)
        dw_gate = _weight_grad(x, dg, offsets, E, 0, rows=rows) if need[1] else None
        dw_up = _weight_grad(x, du, offsets, E, 0, rows=rows) if need[2] else None
        dw_down = _weight_grad(h, dout, offsets, E, 0, dy_rows=rows) if need[3] else None
        dx = _combine(dx_sorted, slot_pos, x.dtype)
        return dx, dw_gate, dw_up, dw_down, parts.sum(0) if need[4] else None, None, None, None, None, dshared


# The router kernels' tiles, and the precision of their float32 products. "tf32x3" runs them on
# the tensor cores with float32 accuracy: each operand is split into a TF32 part and a TF32
# remainder and three products are summed (the remainders' product, below float32's rounding, is
# left out); bf16 activations are exact in TF32. (Timings of the choices: docs/performance.md.)
_ROUTER_BLOCKS = {"BLOCK_T": 16, "BLOCK_D": 16} if INTERPRET else {"BLOCK_T": 64, "BLOCK_D": 64, "num_warps": 4}
_ROUTER_DX_BLOCKS = {"BLOCK_T": 16, "BLOCK_D": 16} if INTERPRET else {"BLOCK_T": 32, "BLOCK_D": 64, "num_warps": 4}
_ROUTER_DW_BLOCKS = {"BLOCK_T": 16, "BLOCK_D": 16} if INTERPRET else {"BLOCK_T": 32, "BLOCK_D": 64, "num_warps": 4}
_ROUTER_DW_PROGRAMS = 4 if INTERPRET else 512   # about how many programs the weight gradient splits into
ROUTER_PRECISION = "ieee" if INTERPRET else "tf32x3"


class _FusedRouter(torch.autograd.Function):
    """``_FusedRouter.apply(x, w, top_k, topk_then_softmax)`` -> ``(weight, expert, token, probs, logits, load)``:
    :class:`~lmfs.nn.moe.Router`'s ``"softmax_topk"`` / ``"topk_softmax"`` routing in one kernel
    (:func:`moe_router_kernel`); weight, expert and token (A,) choice-major, probs and logits (N, E)
    float32, load (E,) the assignments per expert.
    The backward takes the gradients of the weights and, where the balancing losses were used, of
    probs and logits, and returns x's and w's: ``dlogits`` from the softmax's (and top-k's) Jacobian
    and ``dx = dlogits · W`` in one kernel, ``dW = dlogitsᵀ · x`` in another (split over the tokens),
    products in float32."""

    @staticmethod
    def forward(ctx, x, w, top_k, topk_then_softmax):
        (N, D), E = x.shape, w.shape[0]
        logits, probs = (torch.empty(N, E, device=x.device, dtype=torch.float32) for _ in range(2))
        weight = torch.empty(top_k, N, device=x.device, dtype=torch.float32)
        expert, token = (torch.empty(top_k, N, device=x.device, dtype=torch.int64) for _ in range(2))
        load = torch.zeros(E, device=x.device, dtype=torch.int64)
        if N:
            grid = (triton.cdiv(N, _ROUTER_BLOCKS["BLOCK_T"]),)
            moe_router_kernel[grid](x, w, logits, probs, weight, expert, token, load, N, D, E, top_k, topk_then_softmax,
                                    ROUTER_PRECISION, BLOCK_E=_block_e(E),
                                    BLOCK_K=triton.next_power_of_2(top_k), **_ROUTER_BLOCKS)
        ctx.save_for_backward(x, w, probs, weight, expert)
        ctx.topk_then_softmax = topk_then_softmax
        ctx.mark_non_differentiable(expert, token, load)
        return weight.view(-1), expert.view(-1), token.view(-1), probs, logits, load

    @staticmethod
    def backward(ctx, d_weight, _expert, _token, d_probs, d_logits, _load):
        x, w, probs, weight, expert = ctx.saved_tensors
        (N, D), E, k = x.shape, w.shape[0], weight.shape[0]
        dlogits = torch.empty_like(probs)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx = torch.empty_like(x) if need_dx else None
        if N:
            blocks, block_e = _ROUTER_DX_BLOCKS, _block_e(E)
            inputs = [t.contiguous() if t is not None else probs for t in (d_weight, d_probs, d_logits)]
            moe_router_dx_kernel[(triton.cdiv(N, blocks["BLOCK_T"]),)](
                probs, weight, expert, *inputs, w, dlogits, dlogits if dx is None else dx, N, D, E, k,
                ctx.topk_then_softmax, d_weight is not None, d_probs is not None, d_logits is not None, need_dx,
                ROUTER_PRECISION, BLOCK_E=block_e, **blocks)
        dw = None
        if need_dw:
            col_tiles = triton.cdiv(D, _ROUTER_DW_BLOCKS["BLOCK_D"])
            per_split = _ROUTER_DW_BLOCKS["BLOCK_T"] * max(1, triton.cdiv(N, _ROUTER_DW_BLOCKS["BLOCK_T"] * max(
                1, _ROUTER_DW_PROGRAMS // col_tiles)))
            splits = max(1, triton.cdiv(N, per_split))
            part = torch.empty(splits, E, D, device=x.device, dtype=torch.float32)
            moe_router_dw_kernel[(col_tiles, splits)](dlogits, x, part, N, D, E, per_split, ROUTER_PRECISION,
                                                      BLOCK_E=_block_e(E), **_ROUTER_DW_BLOCKS)
            dw = part.sum(0).to(w.dtype) if splits > 1 else part[0].to(w.dtype)
        return dx, dw, None, None


def fused_routing(router, x: torch.Tensor) -> Routing:
    """The :class:`~lmfs.nn.moe.Routing` that ``router`` (a ``"softmax_topk"`` or ``"topk_softmax"``
    :class:`~lmfs.nn.moe.Router`) computes for ``x`` (N, d_model), from one kernel."""
    k = router.top_k
    check_tensors("fused_routing", x=x)
    check_tensors("fused_routing", weight=router.proj.weight)
    weight, expert, token, probs, logits, load = _FusedRouter.apply(x.contiguous(), router.proj.weight, k,
                                                                    router.kind == "topk_softmax")
    return Routing(token, expert, weight, probs, logits, load)


def slot_table(token: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor, n_tokens: int, n_experts: int,
               slots: int, choice_major: bool = False):
    """From kept assignments ``(token, expert, weight)`` (each (A,)): the layout the fused kernels use.

    Returns ``rows`` (A,): the token of each position once sorted by expert; ``offsets`` (E + 1,)
    int32: where each expert's rows start and end; ``slot_pos`` (tokens, slots): the sorted
    positions of each token's assignments in assignment order (int32), -1 in unused slots;
    ``row_weight`` (A,) float32: the routing weight of each sorted position (differentiable in
    ``weight``). ``slots`` must be at least the most assignments any token has (top-k for token
    choice). Boundaries come from ``searchsorted`` on the sorted keys rather than ``bincount``,
    which on a GPU reads the largest key back to the host and so waits for the GPU. With
    ``choice_major``, assignment ``j·tokens + t`` is token ``t``'s ``j``-th (token choice with
    nothing dropped, the order of :func:`~lmfs.nn.moe._token_choice`): the slots need no sort, and
    ``slot_pos`` is a transposed view of the sorted positions."""
    A, device = token.shape[0], token.device
    # A radix sort makes one pass per 8 bits of its keys, and the ids come as int64: sort the
    # smallest integer type that holds every expert id and the end of the last group.
    key = expert.to(torch.uint8 if n_experts < 256 else torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    experts = torch.arange(n_experts + 1, device=device, dtype=key.dtype)
    offsets = torch.searchsorted(sorted_key, experts, out_int32=True)
    position = torch.empty(A, device=device, dtype=torch.int32)
    position[order] = torch.arange(A, device=device, dtype=torch.int32)  # sorted position of each assignment
    if choice_major:
        if A != n_tokens * slots:
            raise ValueError(f"slot_table: choice_major needs tokens·slots = {n_tokens * slots} assignments, got {A}")
        slot_pos = position.view(slots, n_tokens).T
    else:
        by_token = torch.argsort(token.to(torch.int32), stable=True)        # assignments grouped by token
        owner = token[by_token]
        slot = torch.arange(A, device=device) - torch.searchsorted(owner, owner)  # rank within its token
        slot_pos = torch.full((n_tokens, slots), -1, dtype=torch.int32, device=device)
        slot_pos[owner, slot] = position[by_token]
    # gather, not indexing: its backward is a scatter-add, here one float32 add per element (order
    # is a permutation), where indexing's backward would sort the indices first.
    return token[order], offsets, slot_pos, weight.float().gather(0, order)


class FusedMoE(MoE):
    """:class:`lmfs.nn.moe.MoE` with its ``"sorted"`` dispatch computed by the fused kernels of this
    module (module docstring); routing, capacity, balancing, statistics and the shared experts are
    the parent's. SwiGLU experts only. Made by :func:`use_fused_moe`, which swaps the class."""

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The parent's forward, except that softmax routers run as one kernel (:func:`fused_routing`),
        the shared experts as two matmuls and a SwiGLU kernel (:func:`shared_experts`), and their
        output goes into the combine kernel, which adds it while it writes the routed sum: no
        separate pass over the output."""
        if self.dispatch == "loop":
            return super().forward(x, token_ids)
        flat = x.reshape(-1, x.shape[-1])                                        # (N, d)
        if self.router.kind in FUSED_ROUTERS:
            routing = fused_routing(self.router, flat)
        else:
            routing = self.router(flat, token_ids, self.capacity_factor)
        token, expert, weight = self.drop_over_capacity(routing, flat.shape[0])
        shared = None if self.shared is None else shared_experts(self.shared, flat)
        return self.combine_sorted(flat, token, expert, weight, shared).view_as(x)

    def combine_sorted(self, x, token, expert, weight, shared=None):
        """The routed experts' weighted sum per token, plus ``shared`` (tokens, d_model) if given."""
        N, E = x.shape[0], self.n_experts
        slots = E if self.router.kind == "expert_choice" else self.top_k  # most assignments a token can have
        # token choice with nothing dropped: every token's k choices, choice-major (_token_choice)
        every_choice = self.router.kind != "expert_choice" and token.shape[0] == N * slots
        rows, offsets, slot_pos, row_weight = slot_table(token, expert, weight, N, E, slots, every_choice)
        dtype = x.dtype
        if x.is_cuda and torch.is_autocast_enabled("cuda"):  # the matmuls run in autocast's dtype
            dtype = torch.get_autocast_dtype("cuda")
        experts = self.experts
        xs, w_gate, w_up, w_down = (t.to(dtype).contiguous() for t in (x, experts.w_gate, experts.w_up, experts.w_down))
        check_tensors("FusedMoE", x=xs, w_gate=w_gate)
        return _FusedExperts.apply(xs, w_gate, w_up, w_down, row_weight, rows, offsets, slot_pos, x.dtype, shared)


FUSED_ROUTERS = ("softmax_topk", "topk_softmax")  # the routers fused_routing computes


def shared_experts(mlp, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)`` for the shared experts' :class:`~lmfs.nn.GatedMLP`; with SwiGLU, gate and up as one
    matmul (:func:`~lmfs.kernels.fused.fused_linear`: one gradient for x, not two to add) and the
    activation in one kernel (:func:`~lmfs.kernels.fused.swiglu`)."""
    if mlp.act is not F.silu:
        return mlp(x)
    return mlp.down(swiglu(fused_linear(x, [mlp.gate, mlp.up], split=False)))


def use_fused_moe(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make every :class:`lmfs.nn.moe.MoE` inside ``model`` (a layer or a whole ``TransformerLM``)
    a :class:`FusedMoE`, in place, or back with ``enabled=False``; returns ``model``. Only the class
    changes, so parameters and state dict stay; the ``"loop"`` dispatch still runs the loop."""
    found = 0
    for module in model.modules():
        if type(module) in (MoE, FusedMoE):
            if enabled and module.experts.activation != "swiglu":
                raise ValueError(f"use_fused_moe: the fused kernels compute SwiGLU experts, this layer's are "
                                 f"{module.experts.activation!r}; use lmfs.kernels.grouped_gemm.use_triton_experts")
            module.__class__ = FusedMoE if enabled else MoE
            found += 1
    if not found:
        raise ValueError(f"use_fused_moe: {type(model).__name__} holds no lmfs.nn.moe.MoE layer "
                         "(build the model with moe_experts > 0)")
    return model
