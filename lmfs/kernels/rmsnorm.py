"""Fused RMSNorm in Triton: forward and backward, as an autograd Function.

    y = x̂ ∘ w,   x̂ = x · r,   r = 1 / sqrt(mean(x²) + eps)      (per row of x, over its N columns)

Forward: one program per row loads the row once, reduces Σx² in registers, writes y and the
row's ``r`` (one float, saved for the backward so it need not be recomputed from a second pass).

Backward, with ``g = dL/dy``:

    dL/dw = Σ_rows g ∘ x̂                     (a reduction over all rows)
    dL/dx = r · (g∘w − x̂ · mean(g∘w∘x̂))      (per row: the second term is the gradient through r)

``dx`` is per row like the forward. ``dw`` sums over every row, and many programs adding into the
same N floats would need atomics (slow, and not deterministic). Instead each of a fixed number
of programs walks its own chunk of rows, keeps a private partial sum of ``g∘x̂`` in registers and
writes it once; a small second step (here ``torch.sum`` over the partials) adds them up.

>>> x, w = torch.randn(8, 64), torch.rand(64)
>>> torch.allclose(rms_norm(x, w), torch.nn.functional.rms_norm(x, (64,), w, eps=1e-5), atol=1e-5)
True
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import INTERPRET, check_tensors, row_block, row_warps, tl, triton


@triton.jit
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row·n_cols may exceed 2^31
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Mean of squares in fp32: in 16 bits the sum of N squares loses most of its digits.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                        rows_per_program, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_SIZE], dtype=tl.float32)  # this program's partial sum of dL/dw
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # Row pointers advance by n_cols each step; starting from an int64 offset keeps them exact
    # beyond 2^31 elements.
    start = first.to(tl.int64) * n_cols
    x_row, dy_row, dx_row = x_ptr + start, dy_ptr + start, dx_ptr + start
    for row in range(first, last):
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        g = dy * w  # gradient with respect to x̂
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols))
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        x_row += n_cols
        dy_row += n_cols
        dx_row += n_cols
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=mask)


def _backward_programs(n_rows: int, device: torch.device) -> int:
    """How many programs share the backward: a few per SM keeps every SM busy, while the partial
    sums they write stay a small fraction of the traffic. The interpreter runs programs one after
    another, so there a handful suffices."""
    if INTERPRET:
        return min(n_rows, 4)
    return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2, weight = x.contiguous().view(-1, x.shape[-1]), weight.contiguous()
        n_rows, n_cols = x2.shape
        block = row_block("rms_norm", n_cols)
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
        _rmsnorm_fwd_kernel[(n_rows,)](x2, weight, y, rstd, n_cols, eps, BLOCK_SIZE=block,
                                       num_warps=row_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy = dy.contiguous().view(n_rows, n_cols)
        block = row_block("rms_norm", n_cols)
        programs = _backward_programs(n_rows, x2.device)
        rows_per_program = triton.cdiv(n_rows, programs)
        dx = torch.empty_like(x2)
        dw_partial = torch.empty(programs, n_cols, device=x2.device, dtype=torch.float32)
        _rmsnorm_bwd_kernel[(programs,)](x2, weight, dy, rstd, dx, dw_partial, n_rows, n_cols,
                                         rows_per_program, BLOCK_SIZE=block, num_warps=row_warps(block))
        dw = dw_partial.sum(dim=0).to(weight.dtype)  # the reduction over programs
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
    return _RMSNorm.apply(x, weight, eps)
