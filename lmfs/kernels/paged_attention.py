"""Decode attention over a paged KV cache, in Triton (the PagedAttention idea of vLLM).

    q: (B, n_heads, head_dim)                    one new token per sequence
    k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim)   shared pool of blocks
    block_tables: (B, max_blocks) int32          block_tables[b, i] = pool block of tokens
                                                 i·block_size .. (i+1)·block_size − 1 of sequence b
    seq_lens: (B,) int32                         tokens cached for b, the new one included
    out: (B, n_heads, head_dim)                  softmax(q·Kᵀ·scale)·V over the sequence's tokens

A paged cache stores each sequence's keys and values in fixed-size blocks scattered over one pool,
so memory is handed out a block at a time and nothing is reserved for tokens that never come. The
price is an indirection: token ``t`` of sequence ``b`` lives at row ``t % block_size`` of pool
block ``block_tables[b, t // block_size]``.

One program handles one (sequence, KV head, split). With grouped-query attention the
``n_heads / n_kv_heads`` query heads that read the same KV head are processed together, as the rows
of one small matrix, so each key and value is loaded once for all of them (and ``tl.dot`` can
multiply; the rows are padded to 16, its smallest size). The program walks its tokens ``BLOCK_S``
at a time, looking every token's pool block up in the block table (a step may span several cache
blocks, or part of one), and keeps FlashAttention's online softmax in float32: a running maximum
``m``, normaliser ``l`` and unnormalised output ``acc`` per query head, rescaled by
``exp(m_old − m_new)`` whenever the maximum grows. Nothing of size ``seq_len`` is ever stored.

**Splitting the sequence (flash-decoding).** Decoding is memory-bound: the kernel's job is to read
each cached key and value once, and that needs every streaming multiprocessor busy. At batch 1 a
model with 8 KV heads gives only 8 (sequence, KV head) pairs, 8 programs on a GPU with 132 SMs,
each walking the whole context alone. So the context is cut into ``num_splits`` contiguous
pieces, one program each, and ``num_splits`` is chosen so that ``B · n_kv_heads · num_splits``
fills the GPU about twice over. Each split returns its own ``m``, ``l`` and ``acc``; a second,
tiny kernel merges them exactly, the way the online softmax merges two steps:
``M = max m_s``, ``out = Σ acc_s·exp(m_s − M) / Σ l_s·exp(m_s − M)``. Splits are cut per sequence
from its own length (a short sequence has empty splits, which return ``l = 0``), and the number
of splits depends only on the shapes, so a CUDA graph captured once serves every length. With one
split the kernel writes the output directly and no merge runs.

**Keeping memory busy at large batch.** With hundreds of sequences there are programs enough, and
what limits the speed is how many bytes are on their way from memory at any moment (a load takes
about a microsecond to come back; 4 TB/s needs megabytes in flight). The compiled loop fetches the
next step's keys and values while it computes on the current ones, one step ahead, so each
program has about one tile in flight: :func:`choose_config` makes the tile large (``BLOCK_S`` of
128 tokens at head_dim 64, 64 at 128) but no wider than a split's share of the block table, and
small enough in registers and shared memory for several programs to share an SM. The block size
is a compile-time constant, so finding a token's block and row costs a shift and a mask, not a
division. The KV head is the fastest-varying program index, so the programs of one sequence run
together and read its pool blocks (where a token's heads lie side by side) at the same time. The
tile is chosen from shapes, not timed: the engine compiles the kernel while capturing a CUDA graph
on placeholder rows of one token, on which every tile looks equally fast.

The reference it is checked against is :func:`lmfs.inference.kv_cache.paged_attention_reference`
(gather the blocks, plain attention).
"""

from __future__ import annotations

import math

import torch

from lmfs.kernels._triton import INTERPRET, check_tensors, pdl_launch, sm_count, tl, triton


@triton.jit
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, scale, max_blocks,
                        n_heads, n_kv_heads, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Attention of the ``GROUP`` query heads of KV head ``program_id(0)`` of sequence
    ``program_id(1)`` over split ``program_id(2)`` of its tokens. q is (B, n_heads, HEAD_DIM), caches
    (blocks, PAGE, n_kv_heads, HEAD_DIM), all contiguous. With one split ``out`` is the output
    (B, n_heads, HEAD_DIM); with several it is the float32 partial ``acc``
    (B, n_heads, NUM_SPLITS, HEAD_DIM) and ``m``, ``l`` (B, n_heads, NUM_SPLITS) are written too.
    ``PDL``: launched as a programmatic dependent launch (see :func:`lmfs.kernels.decode.layer_gemv_kernel`);
    everything it reads may come from the kernel before, so it waits for that one first."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    # The KV head varies fastest from one program to the next, so the programs of one sequence run
    # side by side and read its pool blocks together: the heads of a token sit next to each other.
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    # This split's tokens: an equal share of the sequence, rounded up to whole steps of BLOCK_S.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_S) * BLOCK_S
    first = split * per_split
    last = tl.minimum(first + per_split, seq_len)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_G)  # query heads h with h // GROUP == kv_head
    head_ok = tl.arange(0, BLOCK_G) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offsets = (b.to(tl.int64) * n_heads + heads)[:, None] * HEAD_DIM + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    scale_log2 = scale * 1.4426950408889634  # scores in base 2: exp(s) = exp2(s·log2 e)
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    token_stride = n_kv_heads * HEAD_DIM  # between consecutive tokens (rows) of one pool block
    table = tables_ptr + b.to(tl.int64) * max_blocks
    for start in range(first, last, BLOCK_S):
        tokens = start + tl.arange(0, BLOCK_S)
        token_ok = tokens < last
        # The block table turns a token position into a pool block; the remainder is its row there
        # (PAGE is a compile-time power of two or not: either way no run-time division is left).
        block = tl.load(table + tokens // PAGE, mask=token_ok, other=0)
        row = block.to(tl.int64) * PAGE + tokens % PAGE  # int64: a pool may hold over 2^31 elements
        kv_offsets = (row * token_stride + kv_head * HEAD_DIM)[:, None] + dims[None, :]  # (BLOCK_S, BLOCK_D)
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:  # the interpreter gets 16-bit arithmetic wrong; a GPU keeps 16-bit dot operands
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_S)
        s = tl.where(token_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    mask = head_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len 0 (no tokens) gives zeros, not NaN
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partial results, in base 2 like m, for paged_decode_merge_kernel
        part = (b.to(tl.int64) * n_heads + heads) * NUM_SPLITS + split  # (BLOCK_G,) index of (b, head, split)
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=mask)
        tl.store(m_ptr + part, m, mask=head_ok)
        tl.store(l_ptr + part, l, mask=head_ok)


@triton.jit
def paged_decode_merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                              BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Merge the ``NUM_SPLITS`` partial results of one (sequence, query head), ``program_id(0)`` in
    ``0 .. B·n_heads − 1``: ``Σ acc_s·2^(m_s − M) / Σ l_s·2^(m_s − M)`` with ``M = max m_s``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    m = tl.load(m_ptr + row * NUM_SPLITS + splits)                        # (NUM_SPLITS,)
    l = tl.load(l_ptr + row * NUM_SPLITS + splits)
    acc = tl.load(acc_ptr + (row * NUM_SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=dim_ok[None, :], other=0.0)                       # (NUM_SPLITS, BLOCK_D)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights 0, output 0
    w = tl.exp2(m - top)                            # an empty split (m = -inf) weighs 0
    total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# Tokens per step: the keys (and values) one step loads are BLOCK_S × head_dim elements. The
# compiled loop prefetches the next step's tile while the current one is used, one tile deep, so a
# program has about one tile of keys and values in flight at a time: the bigger the tile, the more
# bytes each trip to memory brings. 8192 elements (16 KB in 16 bits) keeps the registers and shared
# memory of one program small enough for several to share an SM.
_TILE_ELEMENTS = 8192


def choose_config(head_dim: int, max_tokens: int, num_splits: int) -> tuple[int, int, int]:
    """The kernel's ``(BLOCK_S, num_warps, num_stages)`` from shapes only (never from the lengths,
    so one CUDA graph serves them all): tiles of about ``_TILE_ELEMENTS`` keys' elements, but no
    wider than a split's share of ``max_tokens`` (the block table's width in tokens) rounded up to a
    power of two, so a short split does not load a mostly masked tile; at least 16 (``tl.dot``'s
    smallest size). Four warps; two stages (the loop loads step ``i + 1`` while computing step ``i``).

    The configuration is chosen here rather than by Triton's autotuner because the engine compiles
    the kernel while capturing its CUDA graphs, on placeholder rows of one token each: timings of
    such calls cannot tell a good tile from a bad one."""
    widest = max(16, _TILE_ELEMENTS // max(16, triton.next_power_of_2(head_dim)))
    share = triton.next_power_of_2(max(1, math.ceil(max_tokens / num_splits)))
    return max(16, min(widest, share)), 4, 2


def _check(fn: str, q, k_cache, v_cache, block_tables, seq_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{fn}: expected q (B, n_heads, head_dim) and k_cache, v_cache of one shape (num_blocks, "
                         f"block_size, n_kv_heads, head_dim), got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    B, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"{fn}: q has head_dim {head_dim} but the cache {k_cache.shape[3]}")
    if n_heads % n_kv_heads:
        raise ValueError(f"{fn}: {n_heads} query heads cannot share {n_kv_heads} KV heads evenly; n_heads must be "
                         f"a multiple of n_kv_heads")
    for name, t, dims in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[0] != B:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a {dims}-D tensor with one row per sequence ({B}), got {shape}")
        if t.dtype.is_floating_point:
            raise TypeError(f"{fn}: {name} must hold integers, got {t.dtype}; use {name}.int()")


def choose_splits(batch: int, n_kv_heads: int, max_tokens: int, device: torch.device,
                  min_tokens: int = 64) -> int:
    """How many pieces to cut each sequence into: enough for ``batch · n_kv_heads · splits`` programs
    to fill every SM of ``device`` about twice, no more pieces than ``max_tokens / min_tokens`` (a
    piece shorter than ``min_tokens`` costs more in merging than it saves), a power of two (the
    merge kernel loads all of them at once), at least 1. Depends on shapes only, never on lengths."""
    want = math.ceil(2 * sm_count(device) / max(batch * n_kv_heads, 1))
    splits = max(1, min(want, max_tokens // min_tokens, 64))
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, num_splits: int | None = None,
                           config: tuple[int, int, int] | None = None, pdl: bool = False,
                           max_splits: int | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache; shapes in the module
    docstring. ``scale`` defaults to ``1/sqrt(head_dim)``. Query head ``h`` reads KV head
    ``h // (n_heads // n_kv_heads)``. The sequence's tokens are ``0 .. seq_lens[b] − 1`` (all of them
    attend: the new token is the last one, so no causal mask is needed). float32/float16/bfloat16,
    float32 softmax; on a CUDA GPU (or the CPU under Triton's interpreter). ``num_splits``: pieces
    each sequence is cut into (a power of two; None: :func:`choose_splits` from the batch size, the
    KV heads, the block table's width and the GPU's SM count). ``config``: ``(BLOCK_S, num_warps,
    num_stages)`` to force (BLOCK_S a power of two ≥ 16; the benchmark compares them); None:
    :func:`choose_config` from the shapes. ``pdl``: launch both kernels with programmatic dependent
    launch (Hopper or newer; what :class:`lmfs.kernels.decode.FusedDecode`'s GEMV path does).
    ``max_splits``: an upper bound on the chosen ``num_splits`` (a power of two).
    """
    device = check_tensors("paged_decode_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    _check("paged_decode_attention", q, k_cache, v_cache, block_tables, seq_lens)
    B, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    max_tokens = tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_splits(B, n_kv_heads, max_tokens, device)
        if max_splits is not None:
            num_splits = max(1, min(num_splits, max_splits))
    elif num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"paged_decode_attention: num_splits={num_splits} must be a power of two (1, 2, 4, ...), "
                         "or None to choose it from the shapes")
    block_s, warps, stages = choose_config(head_dim, max_tokens, num_splits) if config is None else config
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"paged_decode_attention: config={config} must start with a power of two ≥ 16 "
                         "(tokens per step), e.g. (64, 4, 2), or be None")
    out = torch.empty_like(q)
    if B == 0:
        return out
    BLOCK_D = max(16, triton.next_power_of_2(head_dim))
    if num_splits == 1:
        acc = m = l = out  # m and l are not written with one split
    else:
        acc = torch.empty(B, n_heads, num_splits, head_dim, device=device, dtype=torch.float32)
        m = torch.empty(B, n_heads, num_splits, device=device, dtype=torch.float32)
        l = torch.empty_like(m)
    paged_decode_kernel[(n_kv_heads, B, num_splits)](
        q, k_cache, v_cache, tables, lens, acc, m, l, scale, tables.shape[1], n_heads, n_kv_heads,
        HEAD_DIM=head_dim, PAGE=block_size, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=BLOCK_D, BLOCK_S=block_s, NUM_SPLITS=num_splits, UPCAST=INTERPRET,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl, num_warps=warps, num_stages=stages,
        **pdl_launch(pdl))
    if num_splits > 1:
        paged_decode_merge_kernel[(B * n_heads,)](acc, m, l, out, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
                                                  BLOCK_D=BLOCK_D, PDL=pdl, **pdl_launch(pdl))
    return out


@torch.library.custom_op("lmfs::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """:func:`paged_decode_attention` as a PyTorch operator, which ``torch.compile`` calls as it is
    instead of tracing into the launcher (its checks, its choice of splits and tiles): what the engine's compiled
    decode step uses."""
    return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)


@paged_decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    return torch.empty_like(q)


__all__ = ["paged_decode_attention", "paged_decode_attention_op", "paged_decode_kernel", "paged_decode_merge_kernel",
           "choose_splits", "choose_config"]
