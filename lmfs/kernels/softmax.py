"""Row softmax in Triton, one row per program, forward and backward.

    y = softmax(x) along the last dimension: y_i = exp(x_i − max x) / Σ_j exp(x_j − max x)

Subtracting the row maximum changes nothing mathematically and keeps ``exp`` from overflowing.
Eager PyTorch written out (max, subtract, exp, sum, divide) reads and writes the whole tensor
about five times. Here each program loads its row into registers once, does all of it there and
writes the result once: 2 × n × bytes, the minimum. The price is that a whole row must fit in
one program's registers, which caps the row length (see :func:`lmfs.kernels._triton.row_block`).

The backward needs only the output: with ``g = dL/dy``, ``dL/dx = y ∘ (g − Σ_j g_j·y_j)``, again
one row per program, reading y and g and writing dx.

>>> x = torch.randn(4, 100)
>>> torch.allclose(softmax(x), torch.softmax(x, dim=-1), atol=1e-6)
True
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import check_tensors, row_block, row_warps, tl, triton


@triton.jit
def softmax_fwd_kernel(x_ptr, y_ptr, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row·n_cols may exceed 2^31
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols  # BLOCK_SIZE is a power of two ≥ n_cols
    # Padding lanes read −inf so they neither win the max nor add to the sum (exp(−inf) = 0).
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=float("-inf")).to(tl.float32)
    z = x - tl.max(x, axis=0)
    e = tl.exp(z)
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(y * dy, axis=0))
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = x.contiguous().view(-1, x.shape[-1])  # (rows, n_cols): rows are independent
        n_rows, n_cols = x2.shape
        block = row_block("softmax", n_cols)
        y = torch.empty_like(x2)
        softmax_fwd_kernel[(n_rows,)](x2, y, n_cols, BLOCK_SIZE=block, num_warps=row_warps(block))
        ctx.save_for_backward(y)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        n_rows, n_cols = y.shape
        dy = dy.contiguous().view(n_rows, n_cols)
        block = row_block("softmax", n_cols)
        dx = torch.empty_like(y)
        softmax_bwd_kernel[(n_rows,)](y, dy, dx, n_cols, BLOCK_SIZE=block, num_warps=row_warps(block))
        return dx.view(ctx.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of ``x`` over its last dimension by a Triton kernel, differentiable.

    Same as ``torch.softmax(x, dim=-1)``; rows longer than 32768 are refused.
    """
    check_tensors("softmax", x=x)
    if x.dim() == 0:
        raise ValueError("softmax: x must have at least one dimension (softmax runs over the last one)")
    return SoftmaxFunction.apply(x)
