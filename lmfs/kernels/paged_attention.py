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

One program handles one (sequence, KV head) pair. With grouped-query attention the
``n_heads / n_kv_heads`` query heads that read the same KV head are processed together, as the rows
of one small matrix, so each key and value is loaded once for all of them (and ``tl.dot`` can
multiply; the rows are padded to 16, its smallest size). The program walks the sequence
``BLOCK_S`` tokens at a time, looking every token's pool block up in the block table (a step may
span several cache blocks, or part of one), and keeps FlashAttention's online softmax in float32:
a running maximum ``m``, normaliser ``l`` and unnormalised output ``acc`` per query head, rescaled
by ``exp(m_old − m_new)`` whenever the maximum grows. Nothing of size ``seq_len`` is ever stored.

Decoding is memory-bound: the kernel's job is to read each cached key and value once. Long
sequences at small batch sizes would want the sequence split across programs as well
("flash-decoding"), which this kernel does not do. The reference it is checked against is
:func:`lmfs.inference.kv_cache.paged_attention_reference` (gather the blocks, plain attention).
"""

from __future__ import annotations

import math

import torch

from lmfs.kernels._triton import INTERPRET, autotune_bench, check_tensors, config_str, n_candidates, tl, triton


@triton.jit(do_not_specialize=["N_CANDIDATES"])
def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale, max_blocks, block_size,
                        n_heads, n_kv_heads, N_CANDIDATES, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Attention output of the ``GROUP`` query heads of KV head ``program_id(1)`` of sequence
    ``program_id(0)``. q and out are (B, n_heads, HEAD_DIM), caches (blocks, block_size,
    n_kv_heads, HEAD_DIM), all contiguous."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
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
    for start in range(0, seq_len, BLOCK_S):
        tokens = start + tl.arange(0, BLOCK_S)
        token_ok = tokens < seq_len
        # The block table turns a token position into a pool block; the remainder is its row there.
        block = tl.load(tables_ptr + b.to(tl.int64) * max_blocks + tokens // block_size, mask=token_ok, other=0)
        row = block.to(tl.int64) * block_size + tokens % block_size
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
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # seq_len 0 (no tokens) gives zeros, not NaN
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])


# Autotuning candidates on a GPU: (BLOCK_S, warps, stages), the likeliest first. Each step loads
# BLOCK_S keys and values of HEAD_DIM elements; 64 tokens of 128 dims in 16 bits are 16 KB each.
_CANDIDATES = [(64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 2), (16, 4, 4)]
_CONFIG_OBJECTS = [triton.Config({"BLOCK_S": s}, num_warps=w, num_stages=st) for s, w, st in _CANDIDATES]


def _prune(configs, named_args, **kwargs):
    n = {**named_args, **kwargs}["N_CANDIDATES"]
    return configs[:n or None]


if INTERPRET:  # the interpreter cannot time anything: one fixed block of tokens
    _kernel = paged_decode_kernel
    _BLOCKS = {"BLOCK_S": 32}
else:
    _kernel = triton.autotune(_CONFIG_OBJECTS, key=["HEAD_DIM", "GROUP", "N_CANDIDATES"],
                              prune_configs_by={"early_config_prune": _prune}, do_bench=autotune_bench)(
        paged_decode_kernel)
    _BLOCKS = {}


def autotune_choice() -> str:
    """Tokens per step, warps and stages of the latest launch (fixed ones under the interpreter)."""
    return config_str(_BLOCKS if INTERPRET else getattr(_kernel, "best_config", None))


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


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None,
                           autotune_candidates: int | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache; shapes in the module
    docstring. ``scale`` defaults to ``1/sqrt(head_dim)``. Query head ``h`` reads KV head
    ``h // (n_heads // n_kv_heads)``. The sequence's tokens are ``0 .. seq_lens[b] − 1`` (all of them
    attend: the new token is the last one, so no causal mask is needed). float32/float16/bfloat16,
    float32 softmax; on a CUDA GPU (or the CPU under Triton's interpreter). ``autotune_candidates``:
    on a GPU, how many block-size candidates the autotuner tries (None: all).
    """
    device = check_tensors("paged_decode_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    candidates = n_candidates("paged_decode_attention", autotune_candidates)
    _check("paged_decode_attention", q, k_cache, v_cache, block_tables, seq_lens)
    B, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(device=device, dtype=torch.int32).contiguous()
    lens = seq_lens.to(device=device, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    _kernel[(B, n_kv_heads)](q, k_cache, v_cache, tables, lens, out, scale, tables.shape[1], block_size, n_heads,
                             n_kv_heads, candidates, HEAD_DIM=head_dim, GROUP=group,
                             BLOCK_G=max(16, triton.next_power_of_2(group)),
                             BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST=INTERPRET,
                             PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **_BLOCKS)
    return out


__all__ = ["paged_decode_attention", "paged_decode_kernel", "autotune_choice"]
