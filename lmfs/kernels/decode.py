"""A decode step of a dense Llama-shaped model in few kernels: :class:`FusedDecode`.

At batch 1 a decode step reads every weight once and does almost nothing with it, so its time
should be the weight bytes over the memory bandwidth. Written as :func:`lmfs.inference.paged_forward`
writes it (the model's own modules, op by op), a step of a 16-layer model launches about 600 small
kernels besides its matmuls: each RMSNorm is seven (cast, square, mean, add, rsqrt, multiply,
cast), RoPE about ten, the cache writes, casts and residual adds more. Each costs 1-2 µs whatever
it does, and together they take longer than the matmuls. Here one layer is nine or ten kernels:

    h = rmsnorm(x += delta)                 residual add + norm, one kernel (the first layer's also
                                            gathers the token embeddings)
    qkv = h @ W_qkvᵀ                        ONE matmul on the merged q/k/v weight
    q, cache[slots] = rope(qkv)             RoPE on q and k, k and v written into the paged cache
    o = decode_attention(q, cache)          the paged kernel (1 or 2 launches), unchanged
    delta = o @ W_oᵀ
    h = rmsnorm(x += delta)
    gu = h @ W_guᵀ                          ONE matmul on the merged gate/up weight
    delta = swiglu(gu) @ W_downᵀ            SwiGLU kernel + matmul (or one Triton GEMV, below)

then the final add + norm and the model's own head. A prefill (a gathered batch, many tokens per
sequence) runs the same kernels with :func:`lmfs.batching.gathered_attention` (variable-length
flash attention on a GPU, masked SDPA otherwise) over the keys gathered from the cache in place of
the decode attention.

**Merged weights without a second copy.** One matmul for q, k and v needs their weights in one
``((H + 2·KV)·hd, d)`` tensor. Concatenating them at every step would copy them (more bytes than
the matmul reads); keeping a merged copy would double their memory and go stale after an optimizer
step. Instead the merged buffer is made once and the parameters are *re-pointed* into it
(``param.data = buffer[rows]``): each parameter keeps its identity, shape and state-dict entry,
and an in-place update of it (an optimizer step, ``load_state_dict``) writes into the buffer that
the next step reads. Gate and up are merged the same way. If the parameters are replaced later
(``model.to(dtype)``, new tensors), the next call notices and merges again.

**16-bit copies for float32 weights under autocast** (``dtype=torch.bfloat16``, what
:class:`lmfs.inference.LLM` passes for ``autocast=`` on float32 weights, as in RL rollouts).
Autocast would cast every projection weight at every step: in a small model's step those casts
take longer than the matmuls. Instead each layer's merged q/k/v, o, merged gate/up and down weights
are held in ``dtype``, in buffers of their own (the parameters are left alone), and
:meth:`FusedDecode.refresh` copies into them each parameter that changed since its last copy. A
change is seen through ``param._version``, which every in-place update of the parameter bumps (an
optimizer step, ``load_state_dict``), so it costs host-side checks only and nothing when nothing
changed; an update through ``param.data`` bypasses the counter and is not seen. Each call refreshes
first, except while a CUDA graph is being captured: whoever replays a captured step refreshes
before it (the engine, at the start of each ``generate``), and the copy lands in the buffers the
graph reads. The copy rounds as autocast's cast does, so the results do not change.

**Same numbers as the op-by-op path, up to rounding.** The kernels compute in float32 but round
where the PyTorch ops round (the residual sum, the normalised row before the gain, each product of
RoPE), so with 16-bit weights they stay within a unit in the last place of the modules' results.
What differs is the order of additions inside the reductions (the norm's sum of squares, one merged
matmul instead of three) and SwiGLU, rounded once instead of twice.

**Batch 1: the GEMV path** (``gemv``, on by default for models in their own dtype; used for decode
steps of at most :data:`GEMV_STEP_ROWS` token). A batch-1 step is matrix-vector products, and on
an H200 cuBLAS reads the small ones (q/k/v, o) at about a third of the memory bandwidth, while
every kernel boundary leaves the GPU idle for a few microseconds. Here a layer is six kernels,
each matrix-vector product carrying its neighbours (:func:`layer_gemv_kernel`):

    [norm, q/k/v, RoPE, cache writes]  attention  merge  [o, residual add]
    [norm, gate/up, SwiGLU]  [down, residual add]        ... and [final norm, head]

Each program holds a whole strip of weight rows in registers. With programmatic dependent launch
(Hopper and newer) each kernel starts while the one before finishes and loads its weights before
it waits for that one's output, so the weights stream across kernel boundaries. Measured on an
H200 (bf16, the 1 B model, 512-token context): 0.69 ms a step against 0.97 ms with cuBLAS.

Everything is launched with fixed shapes, without host syncs or host-to-device copies, so a step
is captured in a CUDA graph as is. The positions of the batch must be below the model's
``context_length`` (RoPE reads the model's precomputed cos/sin tables).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lmfs.batching import gathered_attention
from lmfs.kernels._triton import FLOAT_DTYPES, INTERPRET, pdl_launch, pdl_supported, row_block, row_warps, tl, triton
from lmfs.kernels.fused import swiglu
from lmfs.kernels.paged_attention import paged_decode_attention
from lmfs.nn import GatedMLP, Linear, TransformerLM
from lmfs.nn.layers import RMSNorm

# ----------------------------------------------------------------------------------------------
# Residual add + RMSNorm


@triton.jit
def residual_rmsnorm_kernel(x_ptr, delta_ptr, ids_ptr, emb_ptr, w_ptr, h_ptr, n_cols, eps, GATHER: tl.constexpr,
                            BLOCK: tl.constexpr):
    """Row ``program_id(0)``: ``x += delta`` (or, with ``GATHER``, ``x = emb[ids[row]]``), written
    back to ``x``, and ``h = rmsnorm(x)·w``. Rounds where :class:`lmfs.nn.layers.RMSNorm` does: the
    sum to x's dtype, the normalised row to h's dtype before the gain."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    if GATHER:  # the first layer: the residual stream starts as the token embeddings
        token = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(emb_ptr + token * n_cols + cols, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x += tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = x.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + offsets, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(h_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(h_ptr + offsets, (w * normed).to(h_ptr.dtype.element_ty), mask=mask)


def prefill_rows(n: int) -> int:
    """The row count a prefill of ``n`` tokens runs its matmuls at: ``n`` rounded up to one of eight
    sizes per power of two (``n`` itself below 16), so at most 12.5% of the rows are padding and
    the packed prompts of one run keep meeting the same few shapes.

    >>> [prefill_rows(n) for n in (5, 16, 17, 100, 2224, 4096)]
    [5, 16, 18, 104, 2304, 4096]
    """
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


def residual_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm, h: torch.Tensor,
                     ids: torch.Tensor | None = None, emb: torch.Tensor | None = None) -> None:
    """``x += delta; h = norm(x)`` for ``(N, d)`` rows in one kernel, in place; with ``ids`` ``(N,)``
    instead of ``delta``, ``x = emb[ids]`` first."""
    block = row_block("residual_rmsnorm", x.shape[1])
    gather = ids is not None
    residual_rmsnorm_kernel[(x.shape[0],)](x, x if gather else delta, ids if gather else x, emb if gather else x,
                                           norm.weight, h, x.shape[1], norm.eps, GATHER=gather, BLOCK=block,
                                           num_warps=row_warps(block))


# ----------------------------------------------------------------------------------------------
# RoPE on q and k, k and v into the paged cache


@triton.jit
def _round(v, dtype: tl.constexpr):
    """``v`` rounded to ``dtype`` and back to float32: what storing it in that dtype keeps."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _rope_pair(x1, x2, cos, sin, dtype: tl.constexpr):
    """``(x1 cos − x2 sin, x2 cos + x1 sin)``, each product and sum rounded to ``dtype`` as
    ``apply_rope`` rounds them (rotate-half convention: ``x1``, ``x2`` are a head's two halves)."""
    return (_round(_round(x1 * cos, dtype) - _round(x2 * sin, dtype), dtype),
            _round(_round(x2 * cos, dtype) + _round(x1 * sin, dtype), dtype))


@triton.jit
def _rotate(src, cos_ptr, sin_ptr, pos, c, mask, HALF: tl.constexpr, ROTATE: tl.constexpr):
    """One head's two halves from ``src``, rotated by the angles of position ``pos`` (rotate-half
    convention), each product and the sum rounded to the source dtype as ``apply_rope`` rounds."""
    dtype = src.dtype.element_ty
    x1 = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + c, mask=mask, other=0.0).to(tl.float32)
    if ROTATE:  # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); both halves share the angle
        cos = tl.load(cos_ptr + pos * (2 * HALF) + c, mask=mask, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * (2 * HALF) + c, mask=mask, other=0.0).to(dtype).to(tl.float32)
        x1, x2 = _rope_pair(x1, x2, cos, sin, dtype)
    return x1, x2


@triton.jit
def rope_cache_kernel(qkv_ptr, pos_ptr, slots_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, H: tl.constexpr,
                      KV: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr):
    """Program ``(n, j)`` of token ``n``: for ``j < H`` query head ``j`` of ``qkv`` ``(N, (H + 2·KV)·D)``,
    rotated, into ``q`` ``(N, H, D)``; otherwise KV head ``g = j − H``: the key rotated and the value
    copied into the caches ``(slots, KV, D)`` at row ``slots[n]``."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    D = 2 * HALF
    c = tl.arange(0, BLOCK_HALF)
    mask = c < HALF
    src = qkv_ptr + n * (H + 2 * KV) * D
    pos = tl.load(pos_ptr + n).to(tl.int64)
    if j < H:
        x1, x2 = _rotate(src + j * D, cos_ptr, sin_ptr, pos, c, mask, HALF, ROTATE)
        dst = q_ptr + (n * H + j) * D
        tl.store(dst + c, x1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + c, x2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        g = j - H
        row = (tl.load(slots_ptr + n).to(tl.int64) * KV + g) * D
        x1, x2 = _rotate(src + (H + g) * D, cos_ptr, sin_ptr, pos, c, mask, HALF, ROTATE)
        tl.store(k_ptr + row + c, x1.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_ptr + row + HALF + c, x2.to(k_ptr.dtype.element_ty), mask=mask)
        v = src + (H + KV + g) * D
        tl.store(v_ptr + row + c, tl.load(v + c, mask=mask), mask=mask)
        tl.store(v_ptr + row + HALF + c, tl.load(v + HALF + c, mask=mask), mask=mask)


# ----------------------------------------------------------------------------------------------
# A layer's matrix-vector products for a few rows, with what comes before and after them


@triton.jit
def _gemv_input(x_ptr, ids_ptr, emb_ptr, gain, eps, m, ks, k_ok, K, store_x, SOURCE: tl.constexpr):
    """Row ``m`` of a layer GEMV's input, float32 ``(BLOCK_K,)``. ``SOURCE``: ``"plain"`` reads it
    from ``x``; ``"norm"`` RMS-normalises the residual row ``x[m]`` and applies the norm's ``gain``
    (loaded, float32; rounded as :func:`residual_rmsnorm_kernel` rounds); ``"gather"`` is ``"norm"`` on the token
    embedding ``emb[ids[m]]``, which is also written to ``x[m]`` where ``store_x`` (the first layer
    starts the residual stream)."""
    dtype = x_ptr.dtype.element_ty
    if SOURCE == "gather":
        token = tl.load(ids_ptr + m).to(tl.int64)
        x = tl.load(emb_ptr + token * K + ks, mask=k_ok, other=0.0)
        if store_x:
            tl.store(x_ptr + m * K + ks, x.to(dtype), mask=k_ok)
        x = x.to(tl.float32)
    else:
        x = tl.load(x_ptr + m * K + ks, mask=k_ok, other=0.0).to(tl.float32)
    if SOURCE != "plain":
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
        x = _round(gain * _round(x * rstd, dtype), dtype)
    return x


@triton.jit
def layer_gemv_kernel(x_ptr, ids_ptr, emb_ptr, nw_ptr, eps, w_ptr, y_ptr, N, K, pos_ptr, slots_ptr, cos_ptr, sin_ptr,
                      k_ptr, v_ptr, M: tl.constexpr, SOURCE: tl.constexpr, EPILOGUE: tl.constexpr,
                      H: tl.constexpr, KV: tl.constexpr, HALF: tl.constexpr, ROTATE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One matrix-vector product of a decode layer for ``M`` rows (tokens), fused with its
    neighbours. Program ``p`` owns ``BLOCK_N`` weight rows of ``W`` ``(·, K)`` (two strips of them for
    the paired epilogues), loads them whole, then computes its outputs for every one of the ``M``
    input rows (:func:`_gemv_input`: plain, RMS-normed, or gathered from the embeddings and normed).
    ``EPILOGUE``:

    * ``"store"``: ``y[m, rows] = x·Wᵀ`` (``N`` outputs);
    * ``"residual"``: ``y[m, rows] += x·Wᵀ``, ``y`` being the residual stream (each program
      updates only its own columns, so in place is safe);
    * ``"swiglu"``: strips ``r`` (gate) and ``N + r`` (up) of the merged gate/up weight,
      ``y[m, r] = silu(gate)·up`` (``N`` = the feed-forward width);
    * ``"rope"``: the merged q/k/v weight, ``H + 2·KV`` heads of ``2·HALF``; the strips are
      ``BLOCK_N`` rows of one head's first half and the matching rows of its second half, so RoPE
      (at position ``pos[m]``) is elementwise between the two. Query heads go to ``y`` ``(M, H, 2·HALF)``,
      keys (rotated) and values to the paged caches at row ``slots[m]``.

    Every product is rounded where the op-by-op forward stores it (the projection's output, the
    residual sum, SwiGLU, each RoPE product), so results match :class:`FusedDecode`'s other path.

    ``PDL`` (programmatic dependent launch, Hopper and newer): the kernel lets the next one start
    launching at once (``gdc_launch_dependents``) and reads its weights (and the norm's gain), which no
    kernel of the step writes, *before* waiting for the previous kernel to finish (``gdc_wait``); only the
    activations are read after. In a chain of such kernels each one's weights are on their way
    while the one before is still finishing: the gap between kernels is filled with useful reads.
    """
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    r = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPILOGUE == "rope":   # BLOCK_N divides HALF: all of a program's rows are in one head
        head = (pid * BLOCK_N) // HALF
        c = r % HALF
        rows, ok = head * 2 * HALF + c, r < (H + 2 * KV) * HALF
    else:
        rows, ok = r, r < N
    w_mask = ok[:, None] & k_ok[None, :]
    w1 = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
    if EPILOGUE == "rope":
        w2 = tl.load(w_ptr + (rows + HALF).to(tl.int64)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
    elif EPILOGUE == "swiglu":
        w2 = tl.load(w_ptr + (rows + N).to(tl.int64)[:, None] * K + ks[None, :], mask=w_mask, other=0.0)
    if SOURCE == "plain":
        gain = tl.zeros([BLOCK_K], dtype=tl.float32)   # unused
    else:   # the norm's gain is a weight too
        gain = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    dtype = w_ptr.dtype.element_ty
    for m in tl.static_range(M):
        x = _gemv_input(x_ptr, ids_ptr, emb_ptr, gain, eps, m, ks, k_ok, K, pid == 0, SOURCE)
        a1 = tl.sum(w1.to(tl.float32) * x[None, :], axis=1)
        if EPILOGUE == "store":
            tl.store(y_ptr + m * N + rows, a1.to(y_ptr.dtype.element_ty), mask=ok)
        elif EPILOGUE == "residual":
            old = tl.load(y_ptr + m * N + rows, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * N + rows, (old + _round(a1, dtype)).to(y_ptr.dtype.element_ty), mask=ok)
        elif EPILOGUE == "swiglu":
            g = _round(a1, dtype)
            u = _round(tl.sum(w2.to(tl.float32) * x[None, :], axis=1), dtype)
            tl.store(y_ptr + m * N + rows, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=ok)
        else:   # rope
            x1 = _round(a1, dtype)
            x2 = _round(tl.sum(w2.to(tl.float32) * x[None, :], axis=1), dtype)
            if ROTATE:
                if head < H + KV:   # queries and keys; values are not rotated
                    pos = tl.load(pos_ptr + m).to(tl.int64)
                    cos = tl.load(cos_ptr + pos * (2 * HALF) + c, mask=ok, other=0.0).to(dtype).to(tl.float32)
                    sin = tl.load(sin_ptr + pos * (2 * HALF) + c, mask=ok, other=0.0).to(dtype).to(tl.float32)
                    x1, x2 = _rope_pair(x1, x2, cos, sin, dtype)
            if head < H:
                dst = y_ptr + (m * H + head) * 2 * HALF + c
                tl.store(dst, x1.to(y_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + HALF, x2.to(y_ptr.dtype.element_ty), mask=ok)
            else:   # key head g or value head g − KV, into the caches (slots, KV, 2·HALF) at slots[m]
                g = head - H
                row = (tl.load(slots_ptr + m).to(tl.int64) * KV + g % KV) * 2 * HALF + c
                if g < KV:
                    tl.store(k_ptr + row, x1.to(k_ptr.dtype.element_ty), mask=ok)
                    tl.store(k_ptr + row + HALF, x2.to(k_ptr.dtype.element_ty), mask=ok)
                else:
                    tl.store(v_ptr + row, x1.to(v_ptr.dtype.element_ty), mask=ok)
                    tl.store(v_ptr + row + HALF, x2.to(v_ptr.dtype.element_ty), mask=ok)


#: The most rows (tokens) the layer GEMVs take: each row is a pass over the weights already loaded.
GEMV_MAX_ROWS = 8
#: The most tokens a decode step sends through them (more go through cuBLAS, faster from batch 2 on).
GEMV_STEP_ROWS = 1
#: The widest input they take (a program holds whole weight rows: ``K`` columns each).
GEMV_MAX_K = 16384
#: 16-bit weights a program holds (half as many float32 ones: the same bytes), and its warps, by
#: epilogue (so by matrix: q/k/v "rope", o and down "residual", gate/up "swiglu", the head "store"):
#: 32,768 16-bit weights are 64 KB, 256 a thread in four warps.
GEMV_TILES = {epilogue: (1024, 4) if INTERPRET else (32768, 4) for epilogue in ("rope", "residual", "swiglu", "store")}
#: The most pieces the GEMV path's decode attention cuts a context into (batch 1 has few programs
#: whatever the split; each piece more is one more partial result to merge).
GEMV_SPLITS = 4


def layer_gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, source: str = "plain",
               epilogue: str = "store", norm: RMSNorm | None = None, ids: torch.Tensor | None = None,
               emb: torch.Tensor | None = None, rope: dict | None = None, pdl: bool = False) -> None:
    """Launch :func:`layer_gemv_kernel` for the ``M = x.shape[0]`` rows of ``x`` (all contiguous).
    ``norm``: the :class:`RMSNorm` for ``source="norm"``/``"gather"`` (with ``ids`` and ``emb`` for the
    latter). ``rope``: for ``epilogue="rope"``, a dict of ``H``, ``KV``, ``HALF``, ``ROTATE``, ``pos``,
    ``slots``, ``cos``, ``sin``, ``k_cache``, ``v_cache``. Writes ``y``."""
    M, K = x.shape
    if M > GEMV_MAX_ROWS or K > GEMV_MAX_K or w.shape[1] != K:
        raise ValueError(f"layer_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit (at most "
                         f"{GEMV_MAX_ROWS} rows and {GEMV_MAX_K} columns, w as wide as x)")
    block_k = triton.next_power_of_2(K)
    strip, warps = GEMV_TILES[epilogue]
    block_n = max(1, strip * 2 // w.element_size() // block_k)   # the strip's bytes, whatever the dtype
    if epilogue == "rope":
        half = rope["HALF"]
        block_n = min(block_n, half & -half)   # a power of two dividing HALF
        n_out, n = (rope["H"] + 2 * rope["KV"]) * half, 0
        extra = (rope["pos"], rope["slots"], rope["cos"], rope["sin"], rope["k_cache"], rope["v_cache"])
        consts = {k: rope[k] for k in ("H", "KV", "HALF", "ROTATE")}
    else:
        n_out = n = y.shape[-1]
        extra = (x,) * 6   # unread
        consts = dict(H=1, KV=1, HALF=1, ROTATE=False)
    if epilogue in ("rope", "swiglu"):
        block_n = max(1, block_n // 2)   # two strips a program
    ids = x if ids is None else ids
    emb = x if emb is None else emb
    nw, eps = (x, 0.0) if norm is None else (norm.weight, norm.eps)
    layer_gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, ids, emb, nw, eps, w, y, n, K, *extra, M=M, SOURCE=source, EPILOGUE=epilogue, **consts,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps, **pdl_launch(pdl))


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``(M, K)`` with ``M <= GEMV_MAX_ROWS`` through :func:`layer_gemv_kernel`
    (the plain store epilogue). Returns ``(M, N)`` in ``x``'s dtype."""
    y = x.new_empty(x.shape[0], w.shape[0])
    layer_gemv(x.contiguous(), w.contiguous(), y)
    return y


# ----------------------------------------------------------------------------------------------
# Merging parameters into one buffer


def _rows_of(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The ``(Σ rows, d)`` tensor of which ``params`` are consecutive row blocks, or None if they
    are not laid out so (separate tensors, other strides, a gap)."""
    first = params[0]
    offset = first.storage_offset()
    for p in params:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.device != first.device
                or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.storage_offset() != offset):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in params)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


@torch.no_grad()
def merge_rows(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One ``(Σ rows, d)`` tensor holding ``params`` (2-D, same width, dtype, device) one after the
    other, with every parameter re-pointed at its rows of it (``p.data = merged[a:b]``): identity,
    shape, ``requires_grad`` and state-dict entries unchanged, in-place updates shared. Parameters
    already laid out so are left alone (no copy)."""
    merged = _rows_of(params)
    if merged is not None:
        return merged
    merged = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = merged[start:start + p.shape[0]]
        start += p.shape[0]
    return merged


# ----------------------------------------------------------------------------------------------
# The fused decode forward


class FusedDecode:
    """The decode forward of a dense Llama-shaped :class:`~lmfs.nn.TransformerLM` in about ten
    kernels a layer (module docstring). Prepared once per model: merges each layer's q/k/v and
    gate/up weights into one buffer each, re-pointing the parameters into it (no second copy;
    in-place updates of the parameters are seen, state-dict keys and shapes do not change).

    ``fused(model, cache, batch, decode_attention)`` is :func:`lmfs.inference.paged_forward`: it
    writes the new keys and values into ``cache`` at ``batch.slots`` and returns the logits ``(R, V)``
    (rows ``batch.logit_rows``, all if None) in the model's dtype. A decode batch (one token per
    sequence) attends through ``decode_attention``; a gathered batch (a prefill, several prompts
    packed in one row) through :func:`lmfs.batching.gathered_attention`, over the keys it
    lists. The kernels are the same for both: a prefill of a few thousand tokens launches about
    fourteen a layer instead of about fifty, which on a GPU is the difference between waiting for
    the host and waiting for the matmuls. ``gemv``: a Triton GEMV instead of cuBLAS for batches of at most
    :data:`GEMV_MAX_ROWS` tokens (off by default; see the module docstring). ``dtype``: for calls
    under ``torch.autocast(dtype=dtype)`` on weights of another dtype, hold the projection weights
    in ``dtype`` (copies, refreshed from the parameters; the parameters are not re-pointed), so
    that no step casts them; ``weight_copies`` counts the parameters copied so far.
    """

    def __init__(self, model, gemv: bool | None = None, dtype: torch.dtype | None = None, pdl: bool | None = None):
        reason = self.supports(model)
        if reason is not None:
            raise ValueError(f"FusedDecode cannot run this model ({reason}); decode it with "
                             "lmfs.inference.paged_forward")
        if gemv and dtype is not None:
            raise ValueError("FusedDecode(gemv=True) reads the weights in the model's dtype, which autocast does "
                             "not reach; use dtype=None with gemv, or gemv=False")
        if pdl and not pdl_supported():
            raise ValueError("FusedDecode(pdl=True) needs a GPU of compute capability 9.0 or newer and a Triton with "
                             "programmatic dependent launch (triton.language.extra.cuda.gdc_wait); use pdl=None")
        self.gemv = dtype is None if gemv is None else gemv
        self.dtype = dtype
        self.pdl = pdl_supported() if pdl is None else pdl
        # Per layer (w_qkv, w_o, w_gate_up, w_down), the tensors the matmuls read.
        self._layers: list[tuple[torch.Tensor, ...]] = []
        # With ``dtype``: [parameter, its rows of the copy, the parameter's _version when copied].
        self._copies: list[list] = []
        self._where: tuple = ()
        self.weight_copies = 0
        self._prepare(model)

    @staticmethod
    def supports(model) -> str | None:
        """None if ``model`` can take the fused path, otherwise why not (a short phrase)."""
        if not isinstance(model, TransformerLM):
            return f"not an lmfs TransformerLM but a {type(model).__name__}"
        c = model.config
        reasons = [
            (c.attention == "mla", "MLA caches latents"),
            (c.moe_experts > 0, "MoE feed-forward"),
            (c.qk_norm, "QK-norm"),
            (c.attn_softcap is not None, "soft-capped attention"),
            (c.window is not None, "sliding window"),
            (c.positions in ("learned", "sinusoidal"), f"{c.positions} positions"),
            (c.bias, "biases"),
            (c.parallel, "parallel blocks"),
            (c.norm_position == "post", "post-norm"),
            (c.norm_position == "double", "sandwich norms"),
            (c.norm == "layer", "LayerNorm"),
            (c.ffn != "swiglu", f"{c.ffn} feed-forward (only SwiGLU is fused)"),
        ]
        for applies, reason in reasons:
            if applies:
                return reason
        for block in model.blocks:
            attn, mlp = block.attn, block.mlp
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
            if not isinstance(mlp, GatedMLP) or mlp.act is not F.silu:
                return f"feed-forward {type(mlp).__name__} is not a SwiGLU GatedMLP"
            if not all(isinstance(m, Linear) for m in (*linears, mlp.gate, mlp.up, mlp.down)):
                return "quantised or replaced linear layers"
            if not all(isinstance(n, RMSNorm) for n in block.norms):
                return "norms other than RMSNorm"
        weights = list(model.parameters())
        dtype, device = weights[0].dtype, weights[0].device
        if any(p.dtype != dtype or p.device != device for p in weights):
            return "parameters of mixed dtypes or devices"
        if dtype not in FLOAT_DTYPES:
            return f"dtype {dtype}"
        if not (device.type == "cuda" or (INTERPRET and device.type == "cpu")):
            return f"weights on {device}, where the Triton kernels do not run"
        return None

    @staticmethod
    def _weight_groups(block) -> tuple[list, list, list, list]:
        """The parameters behind each matmul of ``block``: q/k/v (merged), o, gate/up (merged), down."""
        attn, mlp = block.attn, block.mlp
        return ([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], [attn.o_proj.weight],
                [mlp.gate.weight, mlp.up.weight], [mlp.down.weight])

    def _addresses(self, model) -> tuple:
        return tuple((p.data_ptr(), p.dtype) for block in model.blocks for group in self._weight_groups(block)
                     for p in group)

    def _prepare(self, model) -> None:
        """(Re)build every layer's matmul weights: without ``dtype`` the q/k/v and gate/up parameters
        merged in place (:func:`merge_rows`) and o and down as they are; with it, new buffers in
        ``dtype``, filled from the parameters."""
        self._layers, self._copies = [], []
        for block in model.blocks:
            groups = self._weight_groups(block)
            if self.dtype is None:
                self._layers.append(tuple(merge_rows(g) if len(g) > 1 else g[0] for g in groups))
                continue
            weights = []
            for group in groups:
                buffer = group[0].new_empty(sum(p.shape[0] for p in group), group[0].shape[1], dtype=self.dtype)
                start = 0
                for p in group:
                    self._copies.append([p, buffer[start:start + p.shape[0]], None])
                    start += p.shape[0]
                weights.append(buffer)
            self._layers.append(tuple(weights))
        self._where = self._addresses(model)
        self.refresh(model)

    def _stale(self, model) -> bool:
        """Whether some parameter read by the matmuls has moved since :meth:`_prepare` (the model was
        cast or moved, or a parameter replaced): host-side pointer checks only, no device work."""
        return self._addresses(model) != self._where

    @torch.no_grad()
    def refresh(self, model) -> int:
        """Bring the ``dtype`` copies up to date with ``model``'s parameters (rebuilding everything if
        they moved): copy each parameter whose ``_version`` changed since its last copy into its rows.
        Returns how many were copied (0 without ``dtype``, and when nothing changed). Not to be
        called while a CUDA graph is captured (the copy would run at every replay)."""
        if self._stale(model):
            self._prepare(model)   # new tensors: new buffers, filled there
            return len(self._copies)
        copied = 0
        for entry in self._copies:
            p, rows, version = entry
            if p._version != version:
                rows.copy_(p)   # the rounding autocast's cast does
                entry[2] = p._version
                copied += 1
        self.weight_copies += copied
        return copied

    def _gemv_fits(self, batch) -> bool:
        """Whether this step takes the GEMV path: asked for, a decode batch of at most
        :data:`GEMV_STEP_ROWS` tokens, matrices no wider than :data:`GEMV_MAX_K`."""
        w_qkv, w_o, _, w_down = self._layers[0]
        return (self.gemv and batch.decode and batch.tokens.shape[0] <= GEMV_STEP_ROWS
                and max(w_qkv.shape[1], w_o.shape[1], w_down.shape[1]) <= GEMV_MAX_K)

    def _gemv_step(self, model, cache, batch, decode_attention) -> torch.Tensor:
        """The decode step in six kernels a layer (:func:`layer_gemv_kernel`): [norm, q/k/v, RoPE, cache
        writes], attention and its merge, [o, residual add], [norm, gate/up, SwiGLU], [down, residual
        add]; then [final norm, head]."""
        cfg, emb = model.config, model.tok_emb.weight
        N, d = batch.tokens.shape[0], cfg.d_model
        H, KV, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        x = emb.new_empty(N, d)   # the residual stream
        q = emb.new_empty(N, H, hd)
        act = emb.new_empty(N, self._layers[0][3].shape[1])   # the feed-forward width
        rope = model.blocks[0].attn.rope
        pdl = self.pdl
        attend = decode_attention
        if decode_attention is paged_decode_attention:
            attend = functools.partial(paged_decode_attention, pdl=pdl, max_splits=GEMV_SPLITS)
        rope_args = dict(H=H, KV=KV, HALF=hd // 2, ROTATE=rope is not None, pos=batch.positions, slots=batch.slots,
                         cos=rope.cos if rope is not None else x, sin=rope.sin if rope is not None else x)
        for layer, (block, (w_qkv, w_o, w_gate_up, w_down)) in enumerate(zip(model.blocks, self._layers)):
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            rope_args.update(k_cache=k_cache, v_cache=v_cache)
            first = dict(source="gather", ids=batch.tokens, emb=emb) if layer == 0 else dict(source="norm")
            layer_gemv(x, w_qkv, q, epilogue="rope", norm=block.norms[0], rope=rope_args, pdl=pdl, **first)
            out = attend(q, k_cache, v_cache, batch.block_tables, batch.seq_lens)
            layer_gemv(out.to(x.dtype).reshape(N, H * hd), w_o, x, epilogue="residual", pdl=pdl)
            layer_gemv(x, w_gate_up, act, source="norm", epilogue="swiglu", norm=block.norms[1], pdl=pdl)
            layer_gemv(act, w_down, x, epilogue="residual", pdl=pdl)
        rows = x if batch.logit_rows is None else x[batch.logit_rows].contiguous()
        logits = emb.new_empty(rows.shape[0], cfg.vocab_size)
        layer_gemv(rows, model.head_weight(), logits, source="norm", norm=model.final_norm, pdl=pdl)
        if cfg.logit_softcap is not None:   # as model.head caps
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        return logits

    @torch.no_grad()
    def __call__(self, model, cache, batch, decode_attention) -> torch.Tensor:
        if cache.mla:
            raise ValueError("FusedDecode runs over a K/V paged cache, not an MLA cache of latents; use "
                             "lmfs.inference.paged_forward")
        emb = model.tok_emb.weight
        if self.dtype is not None and not (torch.is_autocast_enabled(emb.device.type)
                                           and torch.get_autocast_dtype(emb.device.type) == self.dtype):
            raise ValueError(f"FusedDecode(dtype={self.dtype}) holds its weights in {self.dtype}: call it under "
                             f"torch.autocast({emb.device.type!r}, dtype={self.dtype}), or build it with dtype=None")
        if not (emb.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.refresh(model)
        if self._gemv_fits(batch):
            return self._gemv_step(model, cache, batch, decode_attention)
        cfg = model.config
        N, d = batch.tokens.shape[0], cfg.d_model
        H, KV, hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # A prefill's matmuls run on rows padded to a few sizes (prefill_rows): a new row count
        # costs the host up to milliseconds per matmul shape while cuBLAS picks (and may first
        # load) its kernel, and packed prompts give a new count almost every time. Padded rows
        # stay zero and are never read back; decode batches come in the CUDA graphs' sizes.
        padded = N if batch.decode else prefill_rows(N)
        x = emb.new_empty(N, d)   # the residual stream
        h_rows = emb.new_zeros(padded, d) if padded > N else emb.new_empty(N, d)
        h = h_rows[:N]            # its normed copy, the input of each branch
        o_rows = emb.new_zeros(padded, H * hd) if padded > N else None
        rope = model.blocks[0].attn.rope
        delta, masks = None, {}   # masks: a gathered batch's attention mask, built once for every layer
        for layer, (block, (w_qkv, w_o, w_gate_up, w_down)) in enumerate(zip(model.blocks, self._layers)):
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            if layer == 0:
                residual_rmsnorm(x, None, block.norms[0], h, ids=batch.tokens, emb=emb)
            else:
                residual_rmsnorm(x, delta, block.norms[0], h)
            qkv = (h_rows @ w_qkv.T)[:N]
            q = qkv.new_empty(N, H, hd)
            cos, sin = (rope.cos, rope.sin) if rope is not None else (qkv, qkv)   # unread without RoPE
            rope_cache_kernel[(N, H + KV)](qkv, batch.positions, batch.slots, cos, sin, q, k_cache, v_cache, H=H,
                                           KV=KV, HALF=hd // 2, BLOCK_HALF=triton.next_power_of_2(hd // 2),
                                           ROTATE=rope is not None, num_warps=1)
            if batch.decode:
                out = decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens)   # (N, H, hd)
            else:   # prefill: attention over the keys the batch lists, gathered from the cache
                out = gathered_attention(block.attn, q, k_cache, v_cache, batch, masks)
            out = out.to(h.dtype).reshape(N, H * hd)
            if o_rows is not None:   # into the padded rows
                o_rows[:N] = out
                out = o_rows
            residual_rmsnorm(x, (out @ w_o.T)[:N], block.norms[1], h)
            delta = (swiglu(h_rows @ w_gate_up.T) @ w_down.T)[:N]
        residual_rmsnorm(x, delta, model.final_norm, h)
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
        return model.head(h)


__all__ = ["FusedDecode", "prefill_rows", "residual_rmsnorm", "residual_rmsnorm_kernel", "rope_cache_kernel", "gemv",
           "layer_gemv", "layer_gemv_kernel", "merge_rows", "GEMV_MAX_ROWS"]
