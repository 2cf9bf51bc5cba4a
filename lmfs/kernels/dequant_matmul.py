"""Matmul with int8 or int4 weights in Triton: ``y = x · dequant(W)ᵀ``, dequantised in registers.

    x: (M, K) float32/float16/bfloat16     W: (N, K) as group-wise codes     y: (M, N) in x's dtype

The codes, scales and zero points are those of :func:`lmfs.inference.quantize.quantize_weight`:
``w[n, k] = (code[n, k] − zero[n, g]) · scale[n, g]`` with ``g = k // group_size``; int8 codes are
one byte each, int4 codes two a byte (column ``2j`` in the low nibble, ``2j + 1`` in the high one);
symmetric formats have no zero tensor and the zero point ``2^(bits−1)``.

Each program computes one (BLOCK_M, BLOCK_N) tile of y, stepping over K in ``BLOCK_K`` columns:
it loads the x tile, loads the matching (BLOCK_K, BLOCK_N) tile of codes (transposed by its
indexing, no copy), unpacks and dequantises it in float32, casts it to x's dtype and hands both
to ``tl.dot`` with a float32 accumulator. The float weight never exists in memory: the kernel
reads 1 or ½ byte per weight instead of 2, which is the point when decoding is limited by memory
bandwidth. For int4 both nibbles of a byte are fetched by two lanes with the same address (one
memory transaction, the second from cache), which keeps the indexing plain. Scales and zero points
are gathered per element through ``k // group_size``; they are ``group_size`` times fewer than the
codes and stay in cache.

:func:`dequant_matmul_reference` (dequantise with PyTorch, then ``x @ Wᵀ``) checks it.
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import INTERPRET, autotune_bench, check_tensors, config_str, n_candidates, tl, triton


@triton.jit(do_not_specialize=["M", "ROWS_BUCKET", "N_CANDIDATES"])
def dequant_matmul_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, y_ptr, M, N, K, ROWS_BUCKET, N_CANDIDATES,
                          BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, SYM_ZERO: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``y = x · dequant(W)ᵀ``. x (M, K), y (M, N), codes
    (N, K·BITS/8), scales and zeros (N, K/GROUP), all contiguous. ``ROWS_BUCKET`` and
    ``N_CANDIDATES`` only feed the autotuner's key and pruning."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = rows n of W
    row_ok, col_ok = rows < M, cols < N
    n_groups = K // GROUP
    code_row = K * BITS // 8  # bytes per row of codes
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        # The (BLOCK_K, BLOCK_N) tile of Wᵀ: element (k, n) is code[n, k].
        if BITS == 8:
            code = tl.load(codes_ptr + cols.to(tl.int64)[None, :] * code_row + ks[:, None], mask=w_mask, other=0)
        else:
            byte = tl.load(codes_ptr + cols.to(tl.int64)[None, :] * code_row + (ks // 2)[:, None], mask=w_mask,
                           other=0)
            code = (byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF
        group = cols.to(tl.int64)[None, :] * n_groups + (ks // GROUP)[:, None]
        scale = tl.load(scales_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group, mask=w_mask, other=0).to(tl.float32)
        else:
            zero = SYM_ZERO
        w = (code.to(tl.float32) - zero) * scale
        if UPCAST:  # the interpreter gets 16-bit arithmetic wrong; a GPU keeps 16-bit dot operands
            a = a.to(tl.float32)
        else:
            w = w.to(x_ptr.dtype.element_ty)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Autotuning candidates on a GPU (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the likeliest first.
# Decoding has M = batch size, often 1 to 64: tl.dot needs 16 rows, so the smallest M tile is 16
# and the work is in streaming W; narrow N tiles with long K steps give many programs and long
# loads. Prefill (large M) is an ordinary compute-bound matmul and prefers 128-wide tiles.
_CONFIGS = {
    "small-M": [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 32, 256, 4, 4), (32, 64, 128, 4, 4),
                (16, 64, 64, 4, 5), (64, 64, 64, 4, 4)],
    "large-M": [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4),
                (64, 64, 64, 4, 4)],
}


def _prune(_, named_args, **kwargs):
    args = {**named_args, **kwargs}
    rows = _CONFIGS["small-M" if args["ROWS_BUCKET"] <= 64 else "large-M"]
    return [_CONFIG_OBJECTS[row] for row in rows[:args["N_CANDIDATES"] or None]]


_CONFIG_OBJECTS = {row: triton.Config({"BLOCK_M": row[0], "BLOCK_N": row[1], "BLOCK_K": row[2]},
                                      num_warps=row[3], num_stages=row[4])
                   for group in _CONFIGS.values() for row in group}

if INTERPRET:  # the interpreter cannot time anything; large blocks mean few (slow) programs
    _kernel = dequant_matmul_kernel
    _BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}
else:
    _kernel = triton.autotune(list(_CONFIG_OBJECTS.values()), key=["N", "K", "ROWS_BUCKET", "N_CANDIDATES"],
                              prune_configs_by={"early_config_prune": _prune}, do_bench=autotune_bench)(
        dequant_matmul_kernel)
    _BLOCKS = {}


def autotune_choice() -> str:
    """Blocks, warps and stages of the latest launch (fixed ones under the interpreter)."""
    return config_str(_BLOCKS if INTERPRET else getattr(_kernel, "best_config", None))


def _rows_bucket(m: int) -> int:
    """The autotuner's key for M: a power of two (at least 16), so each decode batch size does not
    trigger a new round of timing."""
    return max(16, triton.next_power_of_2(max(m, 1)))


def dequant_matmul(x: torch.Tensor, qweight, autotune_candidates: int | None = None) -> torch.Tensor:
    """``x`` (M, K) times the dequantised transpose of ``qweight`` (a
    :class:`~lmfs.inference.quantize.QuantizedWeight` of shape (N, K)): y (M, N) in x's dtype.

    float32, float16 or bfloat16 activations, float32 accumulation; float32 activations use exact
    fp32 products. On a CUDA GPU (or the CPU under Triton's interpreter). ``autotune_candidates``:
    on a GPU, how many block-size candidates the autotuner tries, the likeliest first (None: all).
    """
    device = check_tensors("dequant_matmul", x=x)
    candidates = n_candidates("dequant_matmul", autotune_candidates)
    N, K = qweight.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"dequant_matmul: expected x (M, {K}) for a weight of shape {(N, K)}, got "
                         f"{tuple(x.shape)}; flatten the leading dimensions first (x.reshape(-1, K))")
    tensors = [qweight.codes, qweight.scales] + ([qweight.zeros] if qweight.zeros is not None else [])
    if any(t.device != device for t in tensors):
        raise ValueError(f"dequant_matmul: x is on {device} but the quantised weight is on "
                         f"{qweight.codes.device}; move them to one device")
    x = x.contiguous()
    M = x.shape[0]
    y = torch.empty(M, N, device=device, dtype=x.dtype)
    if M == 0:
        return y
    codes, scales = qweight.codes.contiguous(), qweight.scales.contiguous()
    zeros = qweight.zeros.contiguous() if qweight.zeros is not None else codes  # a dummy pointer when unused
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    _kernel[grid](x, codes, scales, zeros, y, M, N, K, _rows_bucket(M), candidates, BITS=qweight.bits,
                  GROUP=qweight.group_size, HAS_ZEROS=qweight.zeros is not None,
                  SYM_ZERO=2 ** (qweight.bits - 1), UPCAST=INTERPRET,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **_BLOCKS)
    return y


def dequant_matmul_reference(x: torch.Tensor, qweight) -> torch.Tensor:
    """The same product with PyTorch: dequantise the whole weight in x's dtype, then ``x @ Wᵀ``."""
    from lmfs.inference.quantize import dequantize_weight

    return x @ dequantize_weight(qweight, x.dtype).T


__all__ = ["dequant_matmul", "dequant_matmul_reference", "dequant_matmul_kernel", "autotune_choice"]
