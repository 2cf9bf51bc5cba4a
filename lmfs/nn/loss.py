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
"""

from __future__ import annotations

import torch

from lmfs.nn.layers import TRITON_AVAILABLE

IGNORE_INDEX = -100
CHUNK_BYTES = 2**28  # float32 logits of one chunk: 256 MiB


def default_chunk(vocab_size: int) -> int:
    """Rows per chunk: as many as keep one chunk's float32 logits within :data:`CHUNK_BYTES`."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss forward; the gradient with respect to the logits is made in the same pass and kept."""

    @staticmethod
    def forward(ctx, h, weight, targets, z_loss, softcap, chunk, need_grad, kernel):
        keep = targets != IGNORE_INDEX
        count = keep.sum()
        if kernel:  # one Triton kernel per chunk makes its loss and gradient (lmfs.kernels.fused)
            from lmfs.kernels.fused import cross_entropy_rows

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
    chunk's loss and gradient come from one pass of :func:`lmfs.kernels.fused.cross_entropy_rows`
    over its logits, which are then kept in the matmul's dtype only, not in float32.
    """
    device = h.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast would for the head's matmul
        dtype = torch.get_autocast_dtype(device)
        h, weight = h.to(dtype), weight.to(dtype)
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    chunk = chunk or default_chunk(weight.shape[0])
    need_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    kernel = kernel and h.is_cuda and softcap is None and TRITON_AVAILABLE
    return _LinearCrossEntropy.apply(h, weight, targets, z_loss, softcap, chunk, need_grad, kernel)
