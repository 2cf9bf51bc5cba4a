"""Data parallelism: every rank holds the whole model, trains on its own slice of the batch, and
the ranks average their gradients so that every replica takes the same optimizer step.

Why averaging is exact: the loss of a global batch split into ``n`` equal slices is the mean of
the slices' mean losses, and the gradient is linear, so ``mean_r ∇L_r = ∇L``. Each replica then
applies the same update to the same parameters and they stay identical, step after step, as long
as they started identical (hence the broadcast from rank 0 at construction).

Two implementations:

* :class:`NaiveDDP`: after ``backward()`` finishes, one all-reduce per parameter. Simple, but
  the network idles during backward and the GPU idles during communication, and many small
  messages pay the per-message latency many times.
* :class:`DDP`: gradients are copied into flat *buckets* of ``bucket_size_mb`` as soon as
  autograd has finished them (a post-accumulate-grad hook), and each full bucket's all-reduce
  starts right away, asynchronously, while backward keeps computing the earlier layers'
  gradients. ``finish_gradient_sync()`` waits for the last ones before the optimizer step.
  Buckets fill in reverse parameter order because backward produces gradients from the last
  layer to the first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmfs.nn import TransformerConfig
from lmfs.parallel import comm
from lmfs.parallel.common import build_model, shard_batch, train_on_rank
from lmfs.parallel.launch import device_for

def broadcast_parameters(module: nn.Module, src: int = 0, group=None):
    """Make every rank's parameters and buffers equal to rank ``src``'s."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            comm.broadcast(t, src=src, group=group)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    # parameters() yields each Parameter once, so a tied weight is one entry with one gradient
    # (autograd sums its uses); frozen parameters have no gradient and need no communication.
    return [p for p in module.parameters() if p.requires_grad]


def _sync_used(has_grad: list[bool], enabled: bool, device, group) -> list[bool]:
    """Which parameters got a gradient on *some* rank (an all-reduce of 0/1 flags); without
    ``enabled`` (``find_unused_parameters`` off) every parameter counts as used, with no traffic.

    A parameter unused on one rank (say, an expert no token of its slice picked) must still take
    part in the average, as zeros; one unused everywhere keeps ``grad = None``, as it would in a
    single process, so the optimizer skips it rather than applying weight decay to it.
    """
    if not enabled:
        return [True] * len(has_grad)
    used = torch.tensor([float(h) for h in has_grad], device=device)
    comm.all_reduce(used, group=group)
    return [u > 0 for u in used.tolist()]


class NaiveDDP(nn.Module):
    """Wrap ``module``; after ``backward()`` call :meth:`finish_gradient_sync`, then step.

    ``find_unused_parameters=True`` handles parameters that get no gradient on some ranks (an
    extra all-reduce of flags, and the host waits for its result); by default every trainable
    parameter is assumed used, and a missing gradient counts as zeros.
    """

    def __init__(self, module: nn.Module, group=None, find_unused_parameters: bool = False):
        super().__init__()
        self.module, self.group = module, group
        self.find_unused_parameters = find_unused_parameters
        broadcast_parameters(module, group=group)
        self.params = _trainable(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def finish_gradient_sync(self):
        """Average every gradient over the ranks: one blocking all-reduce per parameter."""
        n = dist.get_world_size(self.group)
        anyone_used = _sync_used([p.grad is not None for p in self.params], self.find_unused_parameters,
                                 self.params[0].device, self.group)
        for p, anyone in zip(self.params, anyone_used):
            if not anyone:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, group=self.group)
            p.grad.div_(n)


class Bucket:
    """A run of parameters whose gradients travel together as one flat tensor.

    ``offsets[i]`` is where ``params[i]`` starts in the flat layout; ``numel`` is the layout's
    length, padded up to a multiple of ``pad_to`` so it splits into equal shards (ZeRO).
    """

    def __init__(self, params: list[nn.Parameter], pad_to: int):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total + (-total % pad_to)
        self.grads: torch.Tensor | None = None  # the flat gradient of the current step
        self.seen: set[int] = set()              # indices of params whose gradient arrived
        self.work = None                         # the in-flight collective

    def write_grad(self, i: int):
        """Copy ``params[i].grad`` into the flat buffer, then free it (the buffer holds it now)."""
        p = self.params[i]
        if self.grads is None:
            self.grads = torch.zeros(self.numel, dtype=p.dtype, device=p.device)
        self.grads[self.offsets[i]:self.offsets[i] + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        self.seen.add(i)

    def grad_view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.grads[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class GradBuckets:
    """Packs parameters into buckets and starts ``launch(bucket)`` as each one fills in backward.

    Collectives must be issued in the same order on every rank, or they pair up wrongly and
    hang. Gradients usually arrive in the same order everywhere, but to be certain, bucket ``i``
    is launched only after buckets ``0 .. i-1``: a bucket that fills early waits for its turn.
    """

    def __init__(self, params: list[nn.Parameter], bucket_size_mb: float | None, launch=None, pad_to: int = 1):
        # None: no limit, so one bucket holds every gradient (its collective starts only once
        # backward has produced the last of them, i.e. no overlap: the naive schedule in one message).
        limit = float("inf") if bucket_size_mb is None else max(int(bucket_size_mb * 2**20), 1)
        self.buckets: list[Bucket] = []
        current, size = [], 0
        for p in reversed(params):  # backward finishes the last layers' gradients first
            if current and size + p.numel() * p.element_size() > limit:
                self.buckets.append(Bucket(current, pad_to))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(Bucket(current, pad_to))
        self.where = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self.launch = launch
        self.next_to_launch = 0
        # Without ``launch`` this only decides the flat layout (ZeRO-1 reduces at step time).
        self.handles = ([p.register_post_accumulate_grad_hook(self.grad_ready) for p in params]
                        if launch is not None else [])

    def grad_ready(self, p: nn.Parameter):
        """The hook autograd calls inside backward, right after it wrote ``p.grad``: copy the
        gradient into its bucket's flat tensor and launch every bucket that is now complete."""
        bucket, i = self.where[p]
        if i in bucket.seen:
            raise RuntimeError("a parameter received a second gradient before the gradients were "
                               "synchronised: call finish_gradient_sync() (or the optimizer's step) "
                               "after every backward(); accumulating micro-batches is not supported")
        bucket.write_grad(i)
        self.launch_ready(force=False)

    def launch_ready(self, force: bool):
        """Launch the all-reduce of the complete buckets, in bucket order (every rank must launch
        its collectives in the same order); ``force`` launches the rest too, at the end of backward."""
        while self.next_to_launch < len(self.buckets):
            bucket = self.buckets[self.next_to_launch]
            if not force and len(bucket.seen) < len(bucket.params):
                return
            if bucket.grads is None:  # no gradient at all arrived for it: contribute zeros
                p = bucket.params[0]
                bucket.grads = torch.zeros(bucket.numel, dtype=p.dtype, device=p.device)
            bucket.work = self.launch(bucket)
            self.next_to_launch += 1

    def finish(self):
        """Launch what is left (buckets with unused parameters) and wait for every bucket."""
        self.launch_ready(force=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work = None
        self.next_to_launch = 0

    def reset(self):
        """Forget this step's gradients (whoever still needs a bucket's buffer keeps a reference)."""
        for bucket in self.buckets:
            bucket.grads, bucket.seen = None, set()


class DDP(nn.Module):
    """Bucketed data parallelism whose all-reduces overlap with the backward pass.

    Usage per step: ``loss = ddp(x, y)[1]; loss.backward(); ddp.finish_gradient_sync();
    opt.step(); opt.zero_grad()``. After the sync each ``p.grad`` is a view into its bucket's
    averaged flat buffer (no second copy). ``bucket_size_mb=None`` puts every gradient in one
    bucket. ``find_unused_parameters`` as in :class:`NaiveDDP`: off, the step never waits on the
    host (a parameter without a gradient contributes zeros).
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25, group=None,
                 find_unused_parameters: bool = False):
        super().__init__()
        self.module, self.group = module, group
        self.find_unused_parameters = find_unused_parameters
        broadcast_parameters(module, group=group)
        self.params = _trainable(module)
        self.n = dist.get_world_size(group)
        self.buckets = GradBuckets(self.params, bucket_size_mb, self._all_reduce)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _all_reduce(self, bucket: Bucket):
        # Divide first, then sum: the result is the mean, and low-precision sums cannot overflow.
        bucket.grads.div_(self.n)
        return comm.all_reduce(bucket.grads, group=self.group, async_op=True)

    @torch.no_grad()
    def finish_gradient_sync(self):
        """Wait for the bucket all-reduces and hand the averaged gradients back to the parameters."""
        self.buckets.finish()
        pairs = [(b, i) for b in self.buckets.buckets for i in range(len(b.params))]
        anyone_used = _sync_used([i in b.seen for b, i in pairs], self.find_unused_parameters,
                                 self.params[0].device, self.group)
        for (b, i), anyone in zip(pairs, anyone_used):
            b.params[i].grad = b.grad_view(i) if anyone else None
        self.buckets.reset()  # the parameters' grad views keep the buffers alive


def train_ddp(rank: int, world_size: int, config: TransformerConfig, batches, mode: str = "bucketed",
              optimizer_class=torch.optim.AdamW, optimizer_kwargs: dict | None = None,
              bucket_size_mb: float | None = 25, seed: int = 0) -> dict:
    """Rank function: data-parallel training of ``TransformerLM(config)`` on ``batches``.

    Each rank builds the model from a *different* seed on purpose: the broadcast from rank 0 has
    to make them equal. ``mode`` is ``"naive"`` or ``"bucketed"``. Returns what
    :func:`lmfs.parallel.common.train_on_rank` returns, the final state on rank 0 only.
    """
    if mode not in ("naive", "bucketed"):
        raise ValueError(f"mode={mode!r}: use 'naive' or 'bucketed'")
    device = device_for(rank)
    model = build_model(config, seed + rank, device)
    ddp = NaiveDDP(model) if mode == "naive" else DDP(model, bucket_size_mb)
    opt = optimizer_class(model.parameters(), **(optimizer_kwargs or {}))

    def step(batch):
        x, y = (t.to(device) for t in shard_batch(batch, rank, world_size))
        _, loss = ddp(x, y)
        loss.backward()
        ddp.finish_gradient_sync()
        return loss / world_size  # the slices are equal: the global mean is the mean of theirs

    return train_on_rank(model, opt, batches, step, device,
                         final_state=lambda: model.state_dict() if rank == 0 else None)
