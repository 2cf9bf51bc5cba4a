"""Context parallelism with ring attention (Liu et al., 2023): a sequence too long for one device
is split into ``n`` contiguous blocks, one per rank, and attention is computed exactly anyway.

Rank ``r`` keeps its queries ``Q_r`` and starts with its own keys and values ``K_r, V_r``. At each
of ``n`` steps it attends ``Q_r`` to the K/V block it holds, then passes that block to rank
``r + 1`` and receives one from ``r - 1``, so after ``n`` steps every query has met every key.
The send of the next block is started *before* computing on the current one, so the transfer
hides behind the compute when the blocks are large enough.

Partial results merge exactly with the online softmax (as in FlashAttention): for each query,
keep the output ``o`` normalised so far and the log-sum-exp ``ℓ`` of the scores seen so far; a
new block with output ``o_b`` and ``ℓ_b`` gives ``ℓ' = log(e^ℓ + e^ℓ_b)`` and
``o' = e^(ℓ - ℓ') o + e^(ℓ_b - ℓ') o_b``.

Causal masking by block: a block from an earlier rank is entirely visible, the rank's own block
needs the usual triangular mask, and blocks from later ranks are skipped (all masked). That
makes the work unequal (rank ``n-1`` computes ``n`` blocks, rank 0 one); production systems
split the sequence in ``2n`` chunks and give rank ``r`` chunks ``r`` and ``2n-1-r`` to balance it.

Backward (:class:`RingAttention`) goes round the ring again, recomputing each block's
probabilities from the saved ``ℓ`` (FlashAttention's backward), while the gradients for ``K``
and ``V`` travel with their block and arrive back at its owner after the last step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmfs.parallel import comm
from lmfs.parallel.launch import device_for


def _rotate(t: torch.Tensor, group):
    """Start sending ``t`` to the next rank and receiving the previous rank's; returns (buffer, works)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = (r + 1) % n, (r - 1) % n
    if group is not None:  # point-to-point takes global ranks
        nxt, prv = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prv)
    incoming = torch.empty_like(t)
    works = comm.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt, group),
                                    dist.P2POp(dist.irecv, incoming, prv, group)])
    return incoming, works


def _scores(q, k, scale, diagonal: bool):
    """Scaled scores ``(B, H, Tq, Tk)`` in fp32; on the diagonal block, the causal mask."""
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if diagonal:
        T = s.shape[-1]
        future = torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd Function: ``RingAttention.apply(q, k, v, causal, group)`` with
    each rank holding one contiguous slice of the sequence. Forward passes the K/V blocks round the
    ring, merging each block's partial attention into the output by its log-sum-exp; backward goes
    round again with the blocks and their gradients. :func:`ring_attention` is the entry point."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(n):
            src = (r - step) % n  # whose K/V block we hold at this step
            if step < n - 1:
                incoming, works = _rotate(kv, group)  # in flight while we compute
            if not causal or src <= r:
                s = _scores(q, kv[0], scale, diagonal=causal and src == r)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.exp(s - block_lse[..., None]) @ kv[1].float()
                new_lse = torch.logaddexp(lse, block_lse)
                out = (torch.exp(lse - new_lse)[..., None] * out
                       + torch.exp(block_lse - new_lse)[..., None] * block_out)
                lse = new_lse
            if step < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        scale = 1 / math.sqrt(q.shape[-1])
        dout = dout.float()
        delta = (dout * out).sum(-1, keepdim=True)  # rowsum(dO ∘ O), the softmax-backward term
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # for the block we hold
        for step in range(n):
            src = (r - step) % n
            if step < n - 1:
                incoming, works = _rotate(kv, group)
            if not ctx.causal or src <= r:
                kb, vb = kv[0].float(), kv[1].float()
                p = torch.exp(_scores(q, kb, scale, diagonal=ctx.causal and src == r) - lse[..., None])
                dp = dout @ vb.transpose(-2, -1)
                ds = p * (dp - delta) * scale
                dq += ds @ kb
                dkv[0] += ds.transpose(-2, -1) @ q.float()
                dkv[1] += p.transpose(-2, -1) @ dout
            # The block's gradient follows the block: the next rank holds it at the next step,
            # and after the last step it lands on the block's owner.
            if n > 1:
                dkv, dkv_works = _rotate(dkv, group)
                for w in dkv_works:
                    w.wait()
            if step < n - 1:
                for w in works:
                    w.wait()
                kv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, group=None):
    """Exact attention over the whole sequence, of which this rank holds block ``rank``.

    ``q``, ``k``, ``v``: ``(B, H, T/n, d)``, the rank's contiguous slice of the sequence (rank
    order = sequence order). Returns this rank's ``(B, H, T/n, d)`` output; differentiable.
    """
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v must have the same (B, H, T/n, d) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (repeat K/V heads for GQA first)")
    return RingAttention.apply(q, k, v, causal, group)


def check_ring_attention(rank: int, world_size: int, batch: int = 2, heads: int = 2, seq_len: int = 32,
                         head_dim: int = 8, causal: bool = True, seed: int = 0) -> dict:
    """Rank function: ring attention of this rank's slice of a seeded random ``q, k, v``.

    Returns the slice's output and the gradients of ``q, k, v`` for a seeded random upstream
    gradient; concatenated over ranks (along the sequence) they must equal full attention's.
    """
    if seq_len % world_size:
        raise ValueError(f"seq_len={seq_len} must be divisible by the {world_size} ranks")
    device = device_for(rank)
    q, k, v, dout = full_attention_inputs(batch, heads, seq_len, head_dim, seed)
    T = seq_len // world_size
    mine = slice(rank * T, (rank + 1) * T)
    q, k, v = (t[:, :, mine].to(device).requires_grad_() for t in (q, k, v))
    with comm.count_bytes() as sent:
        out = ring_attention(q, k, v, causal)
        out.backward(dout[:, :, mine].to(device))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "bytes": sent.summary()}


def full_attention_inputs(batch: int, heads: int, seq_len: int, head_dim: int, seed: int = 0):
    """Seeded ``q, k, v`` and an upstream gradient, each ``(batch, heads, seq_len, head_dim)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g) for _ in range(4)]


def full_attention(q, k, v, dout, causal: bool = True) -> dict:
    """The reference on one device: PyTorch's attention, and its gradients for ``dout``."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
