"""Fused RMSNorm in Triton: forward and backward, as an autograd Function.

    y = x̂ ∘ w,   x̂ = x · r,   r = 1 / sqrt(mean(x²) + eps)      (per row of x, over its N columns)

Forward: one program per row loads the row once, reduces Σx² in registers, writes y and the
row's ``r`` (one float, saved for the backward so it need not be recomputed from a second pass).

Backward, with ``g = dL/dy``:

    dL/dw = Σ_rows g ∘ x̂                     (a reduction over all rows)
    dL/dx = r · (g∘w − x̂ · mean(g∘w∘x̂))      (per row: the second term is the gradient through r)

``dx`` is per row like the forward. ``dw`` sums over every row, and many programs adding into the
same N floats would need atomics (slow, and not deterministic). Instead a fixed number of
programs (a few per SM) share the rows out in tiles of several rows each; each program keeps a
private partial sum of ``g∘x̂`` in registers and writes it once, and a small second kernel adds
the partial sums up. Every element of x, dy and dx crosses memory exactly once, as in the forward.

>>> x, w = torch.randn(8, 64), torch.rand(64)
>>> torch.allclose(rms_norm(x, w), torch.nn.functional.rms_norm(x, (64,), w, eps=1e-5), atol=1e-5)
True
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import (INTERPRET, autotune_bench, check_tensors, config_str, row_block, row_warps, sm_count,
                                  tl, triton)

# The longest row one program keeps in registers; rms_norm refuses longer ones (and
# lmfs.kernels.fused.FusedRMSNorm computes them in PyTorch).
MAX_COLS = 32768


@triton.jit
def rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row·n_cols may exceed 2^31
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Mean of squares in fp32: in 16 bits the sum of N squares loses most of its digits.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


# Row counts vary, and PROGRAMS_PER_SM only sizes the grid: one compiled kernel serves all of them.
@triton.jit(do_not_specialize=["n_rows", "PROGRAMS_PER_SM"])
def rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols, ROWS_BUCKET,
                        PROGRAMS_PER_SM, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """dx for every row, and this program's partial sum of dw, over tiles of ``ROWS`` rows.

    Program p takes tiles p, p + P, p + 2P, ... (P programs in all): one load of ``ROWS`` rows of
    x and of dy and one store of dx per tile, every element read and written once. ``STAGES`` > 1
    lets the compiler fetch the next tiles into shared memory while this one is computed (Triton
    pipelines loads of a loop without matmuls only when the loop asks for it, as here).
    ``PROGRAMS_PER_SM`` and ``ROWS_BUCKET`` are only read on the host (grid size, autotuning key)."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_SIZE)
    col_ok = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    # The partial sum keeps one row per tile row and adds those up once, at the end, rather than
    # reducing across the tile's rows at every step.
    dw = tl.zeros([ROWS, BLOCK_SIZE], dtype=tl.float32)
    n_tiles = tl.cdiv(n_rows, ROWS)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]  # int64: rows·n_cols may exceed 2^31
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]  # gradient with respect to x̂
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / n_cols)[:, None])
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw, axis=0), mask=col_ok)


@triton.jit
def _sum_rows_kernel(partial_ptr, out_ptr, n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """out[c] = Σ_r partial[r, c], written in out's dtype: the partial sums of dw added up."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < n_cols
    total = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        tile = tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :],
                       mask=(rows < n_rows)[:, None] & col_ok[None, :], other=0.0)
        total += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


# Bandwidth needs bytes in flight (Little's law, lecture 06). Tiles hold 16 elements a thread
# (ROWS·N = 16·32·warps). 16 or 32 warps share an SM (programs per SM = 16 or 32 / warps): with 16,
# at up to 128 registers a thread, all programs fit at once and run as one wave with equal shares
# of tiles (no half-empty last wave); 32 keep more loads in flight if the registers allow. With
# STAGES = 3 each program also has two more tiles loading into shared memory. The candidates
# fitting N are timed on the first call for each row length, dtype and row count (rounded up to a
# power of two); the interpreter gets fixed ones.
_BWD_CANDIDATES = [(rows, warps, per_sm // warps, stages) for rows in (1, 2, 4, 8, 16, 32, 64)
                   for warps in (4, 8, 16) for per_sm in (16, 32) for stages in (1, 3)]


def _bwd_prune(configs, named_args, **kwargs):
    block = {**named_args, **kwargs}["BLOCK_SIZE"]
    kept = [c for c in configs if c.kwargs["ROWS"] * block == 16 * 32 * c.num_warps]
    if kept:
        return kept
    if block > 16 * 32 * 16:  # rows longer than 16 elements a thread at 16 warps: one row a tile
        return [c for c in configs if c.kwargs["ROWS"] == 1 and c.num_warps == 16]
    return [c for c in configs if c.kwargs["ROWS"] == 64 and c.num_warps == 4]  # very short rows


if INTERPRET:
    _bwd = rmsnorm_bwd_kernel
    _BWD_FIXED = {"ROWS": 2, "PROGRAMS_PER_SM": 1, "STAGES": 1}
else:
    _bwd = triton.autotune(
        [triton.Config({"ROWS": r, "PROGRAMS_PER_SM": p, "STAGES": s}, num_warps=w, num_stages=s)
         for r, w, p, s in _BWD_CANDIDATES],
        key=["BLOCK_SIZE", "ROWS_BUCKET"], prune_configs_by={"early_config_prune": _bwd_prune},
        do_bench=autotune_bench)(rmsnorm_bwd_kernel)
    _BWD_FIXED = {}


def _bwd_programs(meta: dict, n_rows: int, device: torch.device) -> int:
    """Programs of the backward: ``PROGRAMS_PER_SM`` on every SM, fewer if there are fewer tiles.
    Each writes one row of partial sums of dw (N floats): 2 to 8 × SMs rows (264 to 1056 × N on an
    H200), against the 3 × rows × N elements the backward must move anyway."""
    return min(triton.cdiv(n_rows, meta["ROWS"]), sm_count(device) * meta["PROGRAMS_PER_SM"])


def backward_choice() -> str:
    """Rows per tile, programs per SM, stages and warps of the latest backward launch (the
    autotuner's choice on a GPU, the fixed values under the interpreter)."""
    return config_str(_BWD_FIXED if INTERPRET else getattr(_bwd, "best_config", None))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2, weight = x.contiguous().view(-1, x.shape[-1]), weight.contiguous()
        n_rows, n_cols = x2.shape
        block = row_block("rms_norm", n_cols, MAX_COLS)
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        rmsnorm_fwd_kernel[(n_rows,)](x2, weight, y, rstd, n_cols, eps, BLOCK_SIZE=block,
                                       num_warps=row_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy = dy.contiguous().view(n_rows, n_cols)
        block = row_block("rms_norm", n_cols, MAX_COLS)
        device = x2.device
        # Room for the most programs a candidate may launch; each writes its own row of partial sums.
        most = sm_count(device) * (_BWD_FIXED["PROGRAMS_PER_SM"] if INTERPRET else 8)
        dx = torch.empty_like(x2)
        dw_partial = torch.empty(min(n_rows, most), n_cols, device=device, dtype=torch.float32)
        _bwd[lambda meta: (_bwd_programs(meta, n_rows, device),)](
            x2, weight, dy, rstd, dx, dw_partial, n_rows, n_cols, max(1024, triton.next_power_of_2(n_rows)),
            BLOCK_SIZE=block, **_BWD_FIXED)
        programs = _bwd_programs(_BWD_FIXED if INTERPRET else _bwd.best_config.kwargs, n_rows, device)
        dw = torch.empty_like(weight)  # the partial sums added up, in the weight's dtype
        _sum_rows_kernel[(triton.cdiv(n_cols, 32),)](dw_partial, dw, programs, n_cols, BLOCK_ROWS=32,
                                                     BLOCK_COLS=32)
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of ``x`` (``(..., N)``) with gain ``weight`` (``(N,)``) by fused Triton kernels.

    Differentiable in ``x`` and ``weight``; same as ``torch.nn.functional.rms_norm(x, (N,), weight,
    eps)`` and :class:`lmfs.nn.layers.RMSNorm`. The output has ``x``'s dtype; statistics are fp32.
    """
    check_tensors("rms_norm", x=x, weight=weight)
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must be 1-D with x's last dimension; got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    return RMSNormFunction.apply(x, weight, eps)
