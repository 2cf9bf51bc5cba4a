"""Expert parallelism: the experts of a mixture-of-experts layer live on different ranks, and
tokens travel to their experts and back with two all-to-alls.

With ``E`` experts on ``n`` ranks, rank ``r`` holds experts ``r·E/n .. (r+1)·E/n - 1`` and its own
tokens (the ranks split the batch, as in data parallelism). One MoE forward:

1. **route** locally: the (replicated) router picks ``k`` experts and weights per token;
2. **count**: an all-to-all of per-expert counts tells every rank how many rows it will get from
   each peer for each of its experts (the split sizes change from step to step);
3. **dispatch**: sort this rank's (token, choice) rows by expert, which groups them by owner
   rank, and ``all_to_all_single`` them with those variable split sizes;
4. **compute**: each local expert runs on the rows addressed to it, from all ranks at once;
5. **combine**: the reverse all-to-all brings every row home, and each token sums its ``k``
   results weighted by the router.

The all-to-all's backward is the reverse all-to-all, so autograd sends every gradient row back
to where its activation came from. Expert weights are gradient-complete on their owner (they
saw every token routed to them); the router is replicated and saw only local tokens, so its
gradient is summed over ranks, as in data parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmfs.nn import GatedMLP, Linear
from lmfs.parallel import comm
from lmfs.parallel.common import shard_batch, train_on_rank
from lmfs.parallel.launch import device_for


def top_k_route(logits: torch.Tensor, k: int):
    """Token-choice routing: softmax over experts (in fp32), keep the top ``k``.

    Returns ``(weights, experts)``, each ``(N, k)``. With ``k > 1`` the kept weights are
    renormalised to sum to 1 (Mixtral); with ``k = 1`` the weight stays the probability, so the
    router still gets a gradient through it (Switch Transformer).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    if k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), experts


class MoE(nn.Module):
    """A top-``k`` mixture of SwiGLU experts on one device: the reference for expert parallelism.

    ``x`` ``(..., d_model)`` -> ``(..., d_model)``; each token's output is ``Σ_j w_j · expert_j(x)``
    over its ``k`` chosen experts.
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int = 1):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.top_k = top_k
        self.router = Linear(d_model, n_experts)
        self.experts = nn.ModuleList(GatedMLP(d_model, d_ff) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = top_k_route(self.router(flat), self.top_k)
        out = torch.zeros_like(flat)
        for j, expert in enumerate(self.experts):
            token, slot = (experts == j).nonzero(as_tuple=True)
            if token.numel():
                out = out.index_add(0, token, weights[token, slot, None] * expert(flat[token]))
        return out.view_as(x)


class _AllToAll(torch.autograd.Function):
    """Rows ``input_splits[j]`` of ``x`` go to rank ``j``; backward sends gradients the other way."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits),) + x.shape[1:])
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits),) + grad.shape[1:])
        comm.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(nn.Module):
    """:class:`MoE` with its experts split over the ranks of ``group``; see the module docstring.

    Built from a full ``MoE`` (the same on every rank): this rank keeps the router and its
    ``E/n`` experts. ``forward`` takes this rank's tokens only.
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        E = len(moe.experts)
        if E % self.n:
            raise ValueError(f"{E} experts do not split over {self.n} ranks: use a multiple of {self.n}")
        self.n_experts, self.local = E, E // self.n
        self.first_expert = self.rank * self.local
        self.top_k, self.router = moe.top_k, moe.router
        self.experts = nn.ModuleList(moe.experts[self.first_expert:self.first_expert + self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        N, k = flat.shape[0], self.top_k
        weights, experts = top_k_route(self.router(flat), k)

        # 1) Every (token, choice) pair becomes a row; sorting by expert groups rows by owner rank.
        choice = experts.reshape(-1)
        order = torch.argsort(choice, stable=True)
        token = torch.arange(N, device=x.device).repeat_interleave(k)[order]
        per_expert = torch.bincount(choice, minlength=self.n_experts)

        # 2) Counts: rank j receives our counts for its experts; we receive theirs for ours,
        #    laid out [source rank][local expert].
        incoming = torch.empty_like(per_expert)
        comm.all_to_all_single(incoming, per_expert, group=self.group)
        send_splits = per_expert.view(self.n, self.local).sum(1).tolist()
        recv_splits = incoming.view(self.n, self.local).sum(1).tolist()

        # 3) Dispatch the rows to the experts' owners.
        received = _AllToAll.apply(flat[token], recv_splits, send_splits, self.group)

        # 4) Each local expert processes its rows, whichever rank they came from.
        local_expert = torch.arange(self.local, device=x.device).repeat(self.n)
        row_expert = local_expert.repeat_interleave(incoming)
        results = torch.zeros_like(received)
        for j, expert in enumerate(self.experts):
            rows = (row_expert == j).nonzero(as_tuple=True)[0]
            if rows.numel():
                results = results.index_add(0, rows, expert(received[rows]))

        # 5) Combine: rows come back in the order they left; weight them and sum per token.
        back = _AllToAll.apply(results, send_splits, recv_splits, self.group)
        w = weights.reshape(-1)[order]
        out = torch.zeros_like(flat).index_add(0, token, back * w[:, None])
        return out.view_as(x)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The router and *this rank's* experts under their names in the full :class:`MoE`."""
        state = {f"router.{k}": v for k, v in self.router.state_dict().items()}
        for j, expert in enumerate(self.experts):
            state |= {f"experts.{self.first_expert + j}.{k}": v for k, v in expert.state_dict().items()}
        return {k: v.detach().clone() for k, v in state.items()}


def moe_batches(steps: int, tokens: int, d_model: int, seed: int = 0):
    """Random regression data ``(x, target)``, each ``(steps, tokens, d_model)``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, d_model, generator=g), torch.randn(tokens, d_model, generator=g))
            for _ in range(steps)]


def build_moe(d_model: int, d_ff: int, n_experts: int, top_k: int, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(d_model, d_ff, n_experts, top_k)
    with torch.no_grad():  # small weights keep the outputs, and the regression loss, moderate
        for p in moe.parameters():
            p.mul_(0.5)
    return moe


def train_moe_single(batches, d_model: int, d_ff: int, n_experts: int, top_k: int,
                     optimizer_class=torch.optim.AdamW, optimizer_kwargs: dict | None = None,
                     seed: int = 0) -> dict:
    """The single-process reference: mean squared error of ``MoE(x)`` against the target.

    Returns what :func:`lmfs.parallel.common.train_on_rank` returns, plus the first step's output.
    """
    moe = build_moe(d_model, d_ff, n_experts, top_k, seed)
    opt = optimizer_class(moe.parameters(), **(optimizer_kwargs or {}))
    outputs = []

    def step(batch):
        x, target = batch
        out = moe(x)
        outputs.append(out.detach())
        loss = F.mse_loss(out, target)
        loss.backward()
        return loss

    result = train_on_rank(moe, opt, batches, step, "cpu", final_state=moe.state_dict, distributed=False)
    return result | {"first_output": outputs[0]}


def train_expert_parallel(rank: int, world_size: int, batches, d_model: int, d_ff: int, n_experts: int,
                          top_k: int, optimizer_class=torch.optim.AdamW,
                          optimizer_kwargs: dict | None = None, seed: int = 0) -> dict:
    """Rank function: each rank takes its ``1/n`` of every batch's tokens and ``E/n`` experts.

    Returns what :func:`lmfs.parallel.common.train_on_rank` returns (the state: the router and
    this rank's experts under their full-model names), plus this rank's slice of the first step's
    output.
    """
    device = device_for(rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    moe = ExpertParallelMoE(build_moe(d_model, d_ff, n_experts, top_k, seed).to(device))
    opt = optimizer_class(moe.parameters(), **(optimizer_kwargs or {}))
    outputs = []

    def step(batch):
        x, target = (t.to(device) for t in shard_batch(batch, rank, world_size))
        out = moe(x)
        outputs.append(out.detach())
        # This rank's share of the mean over all ranks' tokens: the shares sum to the loss.
        share = F.mse_loss(out, target) / world_size
        share.backward()
        for p in moe.router.parameters():  # replicated, saw only this rank's tokens
            comm.all_reduce(p.grad, group=moe.group)
        return share

    result = train_on_rank(moe, opt, batches, step, device, final_state=moe.full_state)
    return result | {"first_output": outputs[0]}
