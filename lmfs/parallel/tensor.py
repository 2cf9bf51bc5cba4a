"""Tensor parallelism (Megatron-LM, Shoeybi et al., 2019) and sequence parallelism around it.

Split a weight matrix across ``n`` ranks and each rank does ``1/n`` of the layer's matmul:

* :class:`ColumnParallelLinear` splits ``W`` (``d_out × d_in``) by output features (rows of
  ``W``, columns of ``Wᵀ``): from the full input, rank ``r`` computes its slice of the output.
* :class:`RowParallelLinear` splits it by input features: from its slice of the input, rank
  ``r`` computes a partial output, and the partial outputs are summed across ranks.

A column layer followed by a row layer needs no communication in between, so an MLP, or an
attention layer whose heads are split across ranks, costs one all-reduce in forward and one in
backward. Two autograd functions carry the communication (Megatron calls them ``f`` and ``g``):

========================  =====================  ===========================================
function                  forward                backward
========================  =====================  ===========================================
``copy_to_tp`` (f)        identity               all-reduce: every rank's slice of the layer
                                                 contributed to the input's gradient
``reduce_from_tp`` (g)    all-reduce partials    identity: the summed output's gradient is
                                                 already what each partial needs
========================  =====================  ===========================================

Sequence parallelism (Korthikanti et al., 2022): between the tensor-parallel blocks, the norms
and residual adds would otherwise run on ``n`` identical copies of the activations. Instead each
rank keeps ``1/n`` of the *sequence* there. An all-reduce is a reduce-scatter plus an all-gather,
so ``g`` becomes a reduce-scatter along the sequence (each rank keeps the sums for its tokens)
and ``f`` becomes an all-gather along the sequence: the same bytes, ``n`` times less activation
memory outside the matmuls. Parameters used on a slice of the sequence (norms, embeddings, the
row layers' biases) then see only part of the batch, so their gradients are summed across ranks
(:func:`sync_sequence_parallel_grads`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmfs.nn import CausalSelfAttention, GatedMLP, TransformerConfig, TransformerLM
from lmfs.nn.layers import MLP
from lmfs.parallel import comm
from lmfs.parallel.common import build_model, train_on_rank
from lmfs.parallel.launch import device_for

# ---------------------------------------------------------------------------------------------
# Communication with autograd


def _all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    front = x.movedim(dim, 0).contiguous()  # the flat collective concatenates along dim 0
    out = front.new_empty((n * front.shape[0],) + front.shape[1:])
    comm.all_gather_into(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"sequence parallelism splits dim {dim} of size {x.shape[dim]} over {n} "
                         f"ranks: use a sequence length divisible by {n}")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // n,) + front.shape[1:])
    comm.reduce_scatter_into(out, front, group=group)
    return out.movedim(0, dim)


class CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: the identity going forward (every tensor-parallel rank already holds the
    whole input), an all-reduce of the gradient going back (each rank's slice of the layer made
    only part of the input's gradient). Placed before a column-parallel linear."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``, the mirror of :class:`CopyToTP`: an all-reduce going forward (each rank's
    row-parallel linear made a partial sum of the output), the identity going back (every rank
    needs the whole output gradient). Placed after a row-parallel linear."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x, group=None):
    """f: identity forward, all-reduce of the gradient backward."""
    return CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    """g: all-reduce forward, identity backward."""
    return ReduceFromTP.apply(x, group)


def gather_sequence(x, dim: int = 1, group=None):
    """Sequence-parallel f: all-gather along ``dim`` forward, reduce-scatter backward."""
    return _GatherSequence.apply(x, dim, group)


def reduce_scatter_sequence(x, dim: int = 1, group=None):
    """Sequence-parallel g: reduce-scatter along ``dim`` forward, all-gather backward."""
    return _ReduceScatterSequence.apply(x, dim, group)


# ---------------------------------------------------------------------------------------------
# Layers


def _mark_sharded(p: nn.Parameter) -> nn.Parameter:
    p.tensor_parallel = True  # each rank holds a different slice: never sum its gradient
    return p


class ColumnParallelLinear(nn.Module):
    """``y_r = x W_rᵀ``: rank ``r`` holds ``1/n`` of the output features of each fused matrix.

    ``splits`` lists the output widths of the matrices fused into one (``[d_ff, d_ff]`` for a
    gate and an up projection, ``[q, k, v]`` widths for attention); each rank holds ``1/n`` of
    every one, so the local output splits into ``local_splits``. Fusing them means the input
    goes through ``f`` (or the sequence all-gather) once, not once per matrix.

    Input ``(B, T, d_in)`` (with ``sequence_parallel``, this rank's ``(B, T/n, d_in)``);
    output ``(B, T, sum(local_splits))``.
    """

    def __init__(self, d_in: int, splits: list[int], bias: bool = False, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        n = dist.get_world_size(group)
        for s in splits:
            if s % n:
                raise ValueError(f"output width {s} does not split over {n} tensor-parallel ranks: "
                                 f"use a width divisible by {n}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.splits, self.local_splits = list(splits), [s // n for s in splits]
        self.weight = _mark_sharded(nn.Parameter(torch.empty(sum(self.local_splits), d_in)))
        self.bias = _mark_sharded(nn.Parameter(torch.zeros(sum(self.local_splits)))) if bias else None

    @torch.no_grad()
    def load_full(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None):
        """Keep this rank's rows of each full ``(splits[i], d_in)`` weight (and bias)."""
        r = dist.get_rank(self.group)
        self.weight.copy_(torch.cat([w[r * k:(r + 1) * k] for w, k in zip(weights, self.local_splits)]))
        if self.bias is not None:
            self.bias.copy_(torch.cat([b[r * k:(r + 1) * k] for b, k in zip(biases, self.local_splits)]))

    def forward(self, x):
        x = (gather_sequence(x, 1, self.group) if self.sequence_parallel
             else copy_to_tp(x, self.group))
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def full_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The full matrices (and biases) again, from every rank's rows (a collective)."""
        def unshard(t):
            n = dist.get_world_size(self.group)
            everyone = t.new_empty((n,) + t.shape)
            comm.all_gather_into(everyone, t.contiguous(), group=self.group)
            parts = [p.split(self.local_splits) for p in everyone]  # [rank][matrix]
            return [torch.cat([parts[r][i] for r in range(n)]) for i in range(len(self.splits))]
        return unshard(self.weight), unshard(self.bias) if self.bias is not None else None


class RowParallelLinear(nn.Module):
    """``y = Σ_r x_r W_rᵀ (+ b)``: rank ``r`` holds ``1/n`` of the input features.

    Input: this rank's features ``(B, T, d_in/n)``, as a column layer produces them. The partial
    outputs are all-reduced (or, with ``sequence_parallel``, reduce-scattered along the
    sequence); the bias is added once, after the sum.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool = False, group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        n = dist.get_world_size(group)
        if d_in % n:
            raise ValueError(f"input width {d_in} does not split over {n} tensor-parallel ranks")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _mark_sharded(nn.Parameter(torch.empty(d_out, d_in // n)))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None  # replicated

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        r, k = dist.get_rank(self.group), self.weight.shape[1]
        self.weight.copy_(weight[:, r * k:(r + 1) * k])
        if self.bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        partial = x @ self.weight.T
        y = (reduce_scatter_sequence(partial, 1, self.group) if self.sequence_parallel
             else reduce_from_tp(partial, self.group))
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def full_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return _all_gather_dim(self.weight, 1, self.group), self.bias


class TensorParallelMLP(nn.Module):
    """An :mod:`lmfs.nn` feed-forward (SwiGLU/GeGLU or plain) split over ranks by hidden units.

    Gate and up are column-parallel (fused), down is row-parallel: every hidden unit lives on one
    rank, so the activation and the gating need no communication.
    """

    def __init__(self, mlp: nn.Module, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.gated = isinstance(mlp, GatedMLP)
        if not self.gated and not isinstance(mlp, MLP):
            raise TypeError(f"TensorParallelMLP takes lmfs.nn.GatedMLP or MLP, got {type(mlp).__name__}")
        d_ff, d_model = mlp.up.weight.shape
        has_bias = mlp.up.bias is not None
        inputs = [mlp.gate, mlp.up] if self.gated else [mlp.up]
        self.act = mlp.act
        self.up = ColumnParallelLinear(d_model, [d_ff] * len(inputs), has_bias, group, sequence_parallel)
        self.up.load_full([m.weight for m in inputs], [m.bias for m in inputs] if has_bias else None)
        self.down = RowParallelLinear(d_ff, d_model, has_bias, group, sequence_parallel)
        self.down.load_full(mlp.down.weight, mlp.down.bias)
        self.to(mlp.up.weight.device)  # the shards live where the full layer did (a GPU under NCCL)

    def forward(self, x):
        h = self.up(x)
        if self.gated:
            gate, up = h.split(self.up.local_splits, dim=-1)
            return self.down(self.act(gate) * up)
        return self.down(self.act(h))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The original module's parameters by name (``gate.weight``, ...), gathered."""
        (ws, bs), (w_down, b_down) = self.up.full_weights(), self.down.full_weights()
        names = ["gate", "up"] if self.gated else ["up"]
        state = {f"{m}.weight": w for m, w in zip(names, ws)} | {"down.weight": w_down}
        if bs is not None:
            state |= {f"{m}.bias": b for m, b in zip(names, bs)} | {"down.bias": b_down}
        return state


class TensorParallelAttention(nn.Module):
    """:class:`lmfs.nn.CausalSelfAttention` with its heads split over ranks.

    Rank ``r`` holds query heads ``r·H/n .. (r+1)·H/n - 1`` and the K/V heads they use (GQA
    groups stay on one rank because both counts are split by ``n``): fused Q/K/V projection
    column-parallel, output projection row-parallel. Attention itself is per head, so it runs
    locally. Covers MHA and GQA (when both head counts divide by ``n``) with RoPE or no
    positions, windows and soft-caps; not MLA or QK-norm (weights shared by all heads would need
    their gradients summed across ranks).
    """

    def __init__(self, attn: CausalSelfAttention, group=None, sequence_parallel: bool = False):
        super().__init__()
        n = dist.get_world_size(group)
        if attn.mla or attn.q_norm is not None:
            raise ValueError("TensorParallelAttention supports attention='mha' without qk_norm")
        if attn.n_heads % n or attn.n_kv_heads % n:
            raise ValueError(f"n_heads={attn.n_heads} and n_kv_heads={attn.n_kv_heads} must both be "
                             f"divisible by the {n} tensor-parallel ranks")
        self.n_heads, self.n_kv_heads = attn.n_heads // n, attn.n_kv_heads // n
        self.window, self.softcap, self.impl, self.rope = attn.window, attn.softcap, attn.impl, attn.rope
        self.q_norm = None  # QK-norm is refused above
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        has_bias = q.bias is not None
        self.qkv = ColumnParallelLinear(q.weight.shape[1], [q.weight.shape[0], k.weight.shape[0],
                                                            v.weight.shape[0]], has_bias, group,
                                        sequence_parallel)
        self.qkv.load_full([q.weight, k.weight, v.weight], [q.bias, k.bias, v.bias] if has_bias else None)
        self.o_proj = RowParallelLinear(o.weight.shape[1], o.weight.shape[0], has_bias, group,
                                        sequence_parallel)
        self.o_proj.load_full(o.weight, o.bias)
        self.to(o.weight.device)  # the shards live where the full layer did (a GPU under NCCL)

    # Everything after the projections is the single-GPU code, on this rank's heads (it reads
    # n_heads, n_kv_heads, q_norm, rope, window, softcap and impl from self).
    heads = CausalSelfAttention.heads
    attend_heads = CausalSelfAttention.attend_heads
    attend = CausalSelfAttention.attend

    def forward(self, x, positions=None):
        q, k, v = self.qkv(x).split(self.qkv.local_splits, dim=-1)
        return self.o_proj(self.heads(q, k, v, positions))

    def full_state(self) -> dict[str, torch.Tensor]:
        (ws, bs), (w_o, b_o) = self.qkv.full_weights(), self.o_proj.full_weights()
        names = ["q_proj", "k_proj", "v_proj"]
        state = {f"{m}.weight": w for m, w in zip(names, ws)} | {"o_proj.weight": w_o}
        if bs is not None:
            state |= {f"{m}.bias": b for m, b in zip(names, bs)} | {"o_proj.bias": b_o}
        return state


# ---------------------------------------------------------------------------------------------
# A whole model


def tensor_parallel(model: TransformerLM, group=None, sequence_parallel: bool = False) -> TransformerLM:
    """Replace every block's attention and MLP by their tensor-parallel versions, in place.

    Every rank must pass the same full model (same seed); each keeps its shards. Embedding,
    norms and head stay replicated. Without sequence parallelism the model's own ``forward``
    works unchanged (every rank computes the same loss); with it, use
    :func:`sequence_parallel_loss`.
    """
    if sequence_parallel and model.config.positions not in ("rope", "none"):
        raise ValueError("sequence_parallel_loss supports rope or no positions; got "
                         f"positions={model.config.positions!r}")
    for block in model.blocks:
        block.attn = TensorParallelAttention(block.attn, group, sequence_parallel)
        block.mlp = TensorParallelMLP(block.mlp, group, sequence_parallel)
    return model


def sequence_parallel_loss(model: TransformerLM, idx: torch.Tensor, targets: torch.Tensor, group=None):
    """This rank's share of the loss of a :func:`tensor_parallel` model with sequence parallelism.

    Rank ``r`` embeds only its ``T/n`` tokens; each block all-gathers the sequence as it enters
    attention or the MLP and reduce-scatters it on the way out, so the norms, residual stream,
    head and loss see only those tokens. The shares (local mean / ``n``) sum to the mean loss
    over all tokens; call ``backward()`` on the share, then :func:`sync_sequence_parallel_grads`.
    Targets of ``-100`` (ignored) would weight the slices unequally and are not supported.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    T = idx.shape[1]
    if T % n:
        raise ValueError(f"sequence length {T} does not split over {n} ranks: use a multiple of {n}")
    mine = slice(r * T // n, (r + 1) * T // n)
    x = model.tok_emb(idx[:, mine])
    for block in model.blocks:
        x = block(x)
    x = model.final_norm(x) if model.final_norm is not None else x
    logits = x @ model.tok_emb.weight.T if model.lm_head is None else model.lm_head(x)
    if model.config.logit_softcap is not None:
        cap = model.config.logit_softcap
        logits = cap * torch.tanh(logits / cap)
    return model.loss(logits, targets[:, mine]) / n


@torch.no_grad()
def sync_sequence_parallel_grads(model: nn.Module, group=None):
    """Sum the gradients of replicated parameters (each saw only this rank's tokens)."""
    for p in model.parameters():
        if p.grad is not None and not getattr(p, "tensor_parallel", False):
            comm.all_reduce(p.grad, group=group)


def gather_full_state(model: TransformerLM) -> dict[str, torch.Tensor]:
    """The state dict of the original single-GPU model, gathered from the shards (a collective)."""
    state, split_modules = {}, []
    for name, module in model.named_modules():
        if isinstance(module, (TensorParallelAttention, TensorParallelMLP)):
            state |= {f"{name}.{k}": v for k, v in module.full_state().items()}
            split_modules.append(name + ".")
    for name, p in model.named_parameters():
        if not name.startswith(tuple(split_modules)):  # replicated: every rank has it whole
            state[name] = p.detach().clone()
    return state


def train_tensor_parallel(rank: int, world_size: int, config: TransformerConfig, batches,
                          sequence_parallel: bool = False, optimizer_class=torch.optim.AdamW,
                          optimizer_kwargs: dict | None = None, seed: int = 0) -> dict:
    """Rank function: every rank sees the whole batch and holds ``1/n`` of each block.

    Returns what :func:`lmfs.parallel.common.train_on_rank` returns, the gathered final state on
    rank 0 only.
    """
    device = device_for(rank)
    model = tensor_parallel(build_model(config, seed, device), sequence_parallel=sequence_parallel)
    opt = optimizer_class(model.parameters(), **(optimizer_kwargs or {}))

    def step(batch):
        x, y = (t.to(device) for t in batch)
        if sequence_parallel:
            share = sequence_parallel_loss(model, x, y)
            share.backward()
            sync_sequence_parallel_grads(model)
            return share
        _, loss = model(x, y)  # the same full loss on every rank
        loss.backward()
        return loss / world_size

    def final_state():
        state = gather_full_state(model)  # a collective: every rank takes part
        return state if rank == 0 else None

    return train_on_rank(model, opt, batches, step, device, final_state)
