"""The output head and the cross-entropy in one step, without keeping the logits.

A language model's loss is ``cross_entropy(h Wᵀ, targets)`` for final hidden states ``h``
``(N, d)`` and the output matrix ``W`` ``(V, d)``. Written as two steps, autograd keeps the
``(N, V)`` logits, or their float32 log-softmax, for the backward pass, and the backward pass
makes two more ``(N, V)`` float32 buffers: at GPT-2-small's shape (``N`` = 16k tokens, ``V`` = 32k)
about 6 GB, often the largest item of a training step.

:func:`linear_cross_entropy` computes the same loss a chunk of rows at a time. For each chunk it
makes the logits, reduces them to the loss, and at once turns them into their gradient, which is
closed-form: ``∂loss/∂logits = (softmax(logits) − onehot(target)) / n`` (``n`` the number of
counted targets). Only that gradient is kept, in the matmul's dtype (bf16 under autocast, as the
two-step version's logit gradient is), so the float32 buffers exist for one chunk at a time. The
backward pass is then just the two matmuls of the head, ``G W`` and ``Gᵀ h``, scaled by the
incoming gradient.

On a CUDA GPU each chunk's loss and gradient come from one Triton kernel,
:func:`cross_entropy_rows` (one row per program: an online-softmax pass, then the gradient pass,
which reads the row again mostly from the L2 cache): 119 µs a chunk on an H200 where Inductor's
kernel for the same work took 144 µs. The model uses this loss when
:func:`lmfs.kernels.fused.fuse_model` makes it chunked; ``lmfs.nn`` itself computes the loss
from the logits.
"""

from __future__ import annotations

import torch

from lmfs.kernels._triton import check_tensors, row_block, row_warps, tl, triton

IGNORE_INDEX = -100
CHUNK_BYTES = 2**28  # float32 logits of one chunk: 256 MiB


def default_chunk(vocab_size: int) -> int:
    """Rows per chunk: as many as keep one chunk's float32 logits within :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


# ----------------------------------------------------------------------------------------------
# Cross-entropy of a chunk of rows, with its gradient, in one pass


@triton.jit
def _cross_entropy_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, grad_ptr, grad_row, V, z_loss, ignore_index,
                          BLOCK_V: tl.constexpr, NEED_GRAD: tl.constexpr, Z_LOSS: tl.constexpr):
    """Row ``r``: ``loss[r] = lse - x[target] (+ z·lse²)`` (0 if the target is ignored), and
    ``grad[grad_row + r] = (softmax(x)·(1 + 2z·lse) - onehot(target)) · scale`` (0 if ignored)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(logits_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
    target = tl.load(targets_ptr + row)
    kept = target != ignore_index
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    x_target = tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    loss = lse - x_target
    if Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if NEED_GRAD:
        p = tl.exp(x - lse)
        if Z_LOSS:
            p = p * (1.0 + 2.0 * z_loss * lse)
        scale = tl.load(scale_ptr) * kept.to(tl.float32)
        grad = tl.where(cols == target, p - 1.0, p) * scale
        tl.store(grad_ptr + (grad_row + row) * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_looped_kernel(logits_ptr, targets_ptr, scale_ptr, loss_ptr, grad_ptr, grad_row, V, z_loss,
                                 ignore_index, BLOCK_V: tl.constexpr, NEED_GRAD: tl.constexpr,
                                 Z_LOSS: tl.constexpr):
    """:func:`_cross_entropy_kernel` for rows longer than the registers hold comfortably: a first
    pass over the row in blocks keeps a running maximum and a rescaled sum of exponentials (the
    online softmax of lecture 06), a second pass writes the gradient. The second read of the row
    comes mostly from the L2 cache, which the program read it into a moment before."""
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row)
    kept = target != ignore_index
    m = -float("inf")
    total = 0.0
    x_target = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        x_target += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
    lse = m + tl.log(total)
    loss = lse - x_target
    if Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr + row, tl.where(kept, loss, 0.0))
    if NEED_GRAD:
        scale = tl.load(scale_ptr) * kept.to(tl.float32)
        factor = scale
        if Z_LOSS:
            factor = scale * (1.0 + 2.0 * z_loss * lse)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            grad = tl.exp(x - lse) * factor - tl.where(cols == target, scale, 0.0)
            tl.store(grad_ptr + (grad_row + row) * V + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < V)


# Which kernel cross_entropy_rows launches: "looped" (two passes over blocks of CE_BLOCK columns)
# or "row" (the whole row in registers, for rows up to 65,536). Measured on an H200 for 2,097 rows
# of 32,000 bf16 logits (loss and gradient): row 143 µs; looped with 4096-column blocks and 8 warps
# 119 µs (8192 and 16 warps: 131; 2048 and 8: 137). Inductor's kernel for the same work: 144 µs.
CE_KERNEL = "looped"
CE_BLOCK, CE_WARPS = 4096, 8


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       grad: torch.Tensor | None = None, grad_row: int = 0, z_loss: float = 0.0,
                       ignore_index: int = -100) -> torch.Tensor:
    """Per-row loss of ``logits`` ``(n, V)`` against ``targets`` ``(n,)`` (float32 ``(n,)``, 0 for
    ``ignore_index``, plus ``z_loss · lse²``), and, if ``grad`` is given, the gradient of
    ``scale · Σ loss`` with respect to the logits, written into rows ``grad_row .. grad_row + n - 1``
    of ``grad`` (``(≥ grad_row + n, V)``, in its own dtype); ``scale`` is a float32 scalar tensor.
    (The whole gradient buffer and an offset, not a slice of it, so that under ``torch.compile``
    the kernel writes into the buffer in place.)

    One program per row (:data:`CE_KERNEL` picks how it walks the row); the gradient is written
    once. Not differentiable itself: :func:`linear_cross_entropy` calls
    it in its forward, which makes the gradient there.
    """
    check_tensors("cross_entropy_rows", logits=logits)
    n, V = logits.shape
    if targets.shape != (n,) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"cross_entropy_rows: targets must be ({n},) and scale a float32 scalar, got "
                         f"{tuple(targets.shape)} and {tuple(scale.shape)} {scale.dtype}")
    if not logits.is_contiguous() or (grad is not None and (grad.dim() != 2 or grad.shape[1] != V
                                                            or grad.shape[0] < grad_row + n
                                                            or not grad.is_contiguous())):
        raise ValueError(f"cross_entropy_rows: logits must be contiguous (n, V) and grad a contiguous "
                         f"(≥ grad_row + n, V) tensor; got logits {tuple(logits.shape)}, grad "
                         f"{None if grad is None else tuple(grad.shape)}, grad_row {grad_row}")
    if CE_KERNEL == "looped":
        kernel, block, warps = _cross_entropy_looped_kernel, min(CE_BLOCK, triton.next_power_of_2(V)), CE_WARPS
    else:
        block = row_block("cross_entropy_rows", V, limit=65536)
        kernel, warps = _cross_entropy_kernel, row_warps(block)
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    kernel[(n,)](logits, targets.contiguous(), scale, loss, grad if grad is not None else logits, grad_row, V,
                 float(z_loss), ignore_index, BLOCK_V=block, NEED_GRAD=grad is not None, Z_LOSS=bool(z_loss),
                 num_warps=warps)
    return loss


# ----------------------------------------------------------------------------------------------
# The head and the loss, chunk by chunk


class LinearCrossEntropy(torch.autograd.Function):
    """The chunked loss as an autograd Function (:func:`linear_cross_entropy` is the entry point).

    Forward: for each chunk of rows, the logits ``h @ weight.T``, their loss and, in the same pass,
    the gradient of the mean loss with respect to them, ``(softmax - onehot) / n``; only that
    gradient is kept. Backward: the output layer's two matmuls with the kept gradient."""

    @staticmethod
    def forward(ctx, h, weight, targets, z_loss, softcap, chunk, need_grad, kernel):
        keep = targets != IGNORE_INDEX
        count = keep.sum()
        if kernel:  # one Triton kernel per chunk makes its loss and gradient (cross_entropy_rows)
            scale = 1.0 / count.float()
            grad_logits = h.new_empty(h.shape[0], weight.shape[0]) if need_grad else None
            total = h.new_zeros((), dtype=torch.float32)
            for start in range(0, h.shape[0], chunk):
                logits = h[start:start + chunk] @ weight.T
                total = total + cross_entropy_rows(logits, targets[start:start + chunk], scale, grad_logits,
                                                   start, z_loss, IGNORE_INDEX).sum()
            if need_grad:
                ctx.save_for_backward(h, weight, grad_logits)
            return total * scale
        vocab = torch.arange(weight.shape[0], device=h.device)
        total, grads = h.new_zeros((), dtype=torch.float32), []
        # Eagerly the chunks' gradients go straight into one buffer; a compiled graph instead
        # concatenates them, and inductor writes each chunk into its slice of the result.
        compiling = torch.compiler.is_compiling()
        grad_logits = h.new_empty(h.shape[0], weight.shape[0]) if need_grad and not compiling else None
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (h[rows] @ weight.T).float()            # (chunk, V), rounded like the 2-step head's
            if softcap is not None:
                squashed = torch.tanh(logits / softcap)
                logits = softcap * squashed
            kept, target = keep[rows], targets[rows].unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            row_loss = lse - logits.gather(1, target.clamp(min=0)).squeeze(1)
            if z_loss:
                row_loss = row_loss + z_loss * lse.square()
            total = total + torch.where(kept, row_loss, 0.0).sum()
            if need_grad:
                # d/dlogits of (lse - logit[target] + z·lse²) = softmax·(1 + 2z·lse) - onehot.
                grad = torch.exp(logits - lse.unsqueeze(1))
                if z_loss:
                    grad = grad * (1 + 2 * z_loss * lse).unsqueeze(1)
                grad = torch.where(vocab == target, grad - 1, grad)  # minus one-hot: fuses, unlike a scatter
                if softcap is not None:
                    grad = grad * (1 - squashed.square())  # through cap·tanh(z/cap)
                grad = (grad * (kept.unsqueeze(1) / count)).to(h.dtype)
                if compiling:
                    grads.append(grad)
                else:
                    grad_logits[rows] = grad
        if need_grad:
            ctx.save_for_backward(h, weight, torch.cat(grads) if compiling else grad_logits)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, grad_logits = ctx.saved_tensors
        grad_h = (grad_logits @ weight) * grad_loss
        grad_weight = (grad_logits.T @ h) * grad_loss
        return grad_h, grad_weight, None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         z_loss: float = 0.0, softcap: float | None = None,
                         chunk: int | None = None, kernel: bool = True) -> torch.Tensor:
    """``cross_entropy(h @ weight.T, targets)`` (mean over targets that are not ``-100``), without
    keeping the logits; equal to the two-step computation up to float rounding.

    ``h`` is ``(..., d)``, ``weight`` ``(V, d)``, ``targets`` ``(...)``. ``z_loss`` adds
    ``z_loss · mean(logsumexp(logits)²)`` and ``softcap`` passes the logits through
    ``softcap·tanh(logits/softcap)`` first, as :class:`lmfs.nn.TransformerLM` does. ``chunk`` is
    the rows per chunk (default :func:`default_chunk`). Under autocast the matmuls run in its
    dtype, the softmax in float32. On a CUDA GPU, without ``softcap`` and with ``kernel``, each
    chunk's loss and gradient come from one pass of :func:`cross_entropy_rows`
    over its logits, which are then kept in the matmul's dtype only, not in float32.
    """
    device = h.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast would for the head's matmul
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    chunk = chunk or default_chunk(weight.shape[0])
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    kernel = kernel and h.is_cuda and softcap is None
    return LinearCrossEntropy.apply(h, weight, targets, z_loss, softcap, chunk, need_grad, kernel)
