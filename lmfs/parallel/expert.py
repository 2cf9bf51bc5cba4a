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

The layer itself (router, experts, their grouped computation) is :class:`lmfs.nn.moe.MoE`'s;
this module adds only the communication. The all-to-all's backward is the reverse all-to-all, so
autograd sends every gradient row back to where its activation came from. Expert weights are
gradient-complete on their owner (they saw every token routed to them); the router (and any
shared expert) is replicated and saw only local tokens, so its gradient is summed over ranks, as
in data parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmfs.nn.moe import MoE, bin_counts
from lmfs.parallel import comm
from lmfs.parallel.common import shard_batch, train_on_rank
from lmfs.parallel.launch import device_for


def moe_state(moe: MoE) -> dict[str, torch.Tensor]:
    """The state of a single-device :class:`~lmfs.nn.moe.MoE` with one name per expert
    (``experts.{e}.w_gate``, ...), the form in which the ranks' expert shards merge."""
    state = {k: v.detach().clone() for k, v in moe.state_dict().items() if not k.startswith("experts.")}
    return state | {f"experts.{k}": v for k, v in moe.experts.per_expert_state().items()}


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
    """An :class:`lmfs.nn.moe.MoE` with its experts split over the ranks of ``group``; see the
    module docstring. Only the communication lives here: routing and the experts' grouped
    computation are the layer's own (:class:`~lmfs.nn.moe.Router`, :class:`~lmfs.nn.moe.Experts`).

    Built from a full ``MoE`` (the same on every rank): this rank keeps the router, the shared
    experts (both replicated) and its ``E/n`` routed experts. ``forward`` takes this rank's tokens
    only. Token-choice and hash routers without a capacity limit are supported; the layer's
    balancing losses and statistics are not computed here.
    """

    def __init__(self, moe: MoE, group=None):
        super().__init__()
        if moe.capacity_factor is not None or moe.router.kind == "expert_choice":
            raise ValueError("expert parallelism here needs token-choice routing without a capacity limit: "
                             "build the MoE with capacity_factor=None and a router other than 'expert_choice'")
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        E = moe.n_experts
        if E % self.n:
            ranks = [d for d in range(1, E + 1) if E % d == 0]
            raise ValueError(f"{E} experts do not split over {self.n} expert-parallel ranks: use a number of "
                             f"experts that is a multiple of {self.n}, or a number of ranks in {ranks}")
        self.n_experts, self.local = E, E // self.n
        self.first_expert = self.rank * self.local
        self.router, self.shared = moe.router, moe.shared
        self.experts = moe.experts.sliced(self.first_expert, self.local)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """Parameters every rank holds (router, shared experts): their gradients are summed over ranks."""
        return [p for m in (self.router, self.shared) if m is not None for p in m.parameters()]

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat, token_ids)

        # 1) Every (token, choice) assignment is a row; sorting by expert groups rows by owner rank.
        order = torch.argsort(routing.expert, stable=True)
        token = routing.token[order]
        per_expert = bin_counts(routing.expert, self.n_experts)

        # 2) Counts: rank j receives our counts for its experts; we receive theirs for ours,
        #    laid out [source rank][local expert].
        incoming = torch.empty_like(per_expert)
        comm.all_to_all_single(incoming, per_expert, group=self.group)
        send_splits = per_expert.view(self.n, self.local).sum(1).tolist()
        recv_splits = incoming.view(self.n, self.local).sum(1).tolist()

        # 3) Dispatch the rows to the experts' owners.
        received = _AllToAll.apply(flat[token], recv_splits, send_splits, self.group)

        # 4) The local experts run as one grouped computation: sort the received rows by local
        #    expert (they arrive grouped by source rank), compute, put them back in arrival order.
        local_expert = torch.arange(self.local, device=x.device).repeat(self.n)
        row_expert = local_expert.repeat_interleave(incoming)
        by_expert = torch.argsort(row_expert, stable=True)
        y = self.experts(received[by_expert], bin_counts(row_expert, self.local))
        results = y[torch.argsort(by_expert)]

        # 5) Combine: rows come back in the order they left. Put them back in assignment order,
        #    which token choice without a capacity limit makes choice-major with every token k
        #    times, and sum each token's k weighted rows: a plain sum, no scatter-add.
        back = _AllToAll.apply(results, send_splits, recv_splits, self.group)
        unsorted = torch.empty_like(back)
        unsorted[order] = back
        weighted = unsorted * routing.weight.to(back.dtype)[:, None]
        out = weighted.view(-1, *flat.shape).sum(0).to(flat.dtype)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The replicated parts and *this rank's* experts under their names in :func:`moe_state`."""
        state = {f"router.{k}": v for k, v in self.router.state_dict().items()}
        if self.shared is not None:
            state |= {f"shared.{k}": v for k, v in self.shared.state_dict().items()}
        state = {k: v.detach().clone() for k, v in state.items()}
        return state | {f"experts.{k}": v for k, v in self.experts.per_expert_state(self.first_expert).items()}


def moe_batches(steps: int, tokens: int, d_model: int, seed: int = 0):
    """Random regression data ``(x, target)``, each ``(steps, tokens, d_model)``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, d_model, generator=g), torch.randn(tokens, d_model, generator=g))
            for _ in range(steps)]


def build_moe(d_model: int, d_ff: int, n_experts: int, top_k: int, seed: int = 0) -> MoE:
    """The :class:`~lmfs.nn.moe.MoE` both the single-process reference and the ranks start from."""
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

    result = train_on_rank(moe, opt, batches, step, "cpu", final_state=lambda: moe_state(moe), distributed=False)
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
        for p in moe.replicated_parameters():  # replicated, saw only this rank's tokens
            comm.all_reduce(p.grad, group=moe.group)
        return share

    result = train_on_rank(moe, opt, batches, step, device, final_state=moe.full_state)
    return result | {"first_output": outputs[0]}
