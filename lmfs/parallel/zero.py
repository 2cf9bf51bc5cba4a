"""ZeRO: data parallelism without keeping ``n`` copies of everything.

Per parameter, mixed-precision Adam keeps 2 bytes of weights, 2 of gradient and 12 of optimizer
state (fp32 master weight and two moments). Plain data parallelism replicates all 16 bytes on
every rank. ZeRO (Rajbhandari et al., 2020) shards them over the ``n`` data-parallel ranks:

=========  ==========================  ===============================  ======================
stage      sharded                     communication per step           bytes sent per rank
=========  ==========================  ===============================  ======================
1          optimizer state             all-reduce gradients, all-gather 3 · (n-1)/n · P
                                       the updated parameters
2          + gradients                 reduce-scatter gradients (during 2 · (n-1)/n · P
                                       backward), all-gather parameters
3 / FSDP   + parameters                all-gather each layer in         3 · (n-1)/n · P
                                       forward and again in backward,
                                       reduce-scatter its gradients
=========  ==========================  ===============================  ======================

(``P`` = bytes of one copy of the parameters, gradients in the same dtype.) Stage 1 all-reduces
the gradients, as the lecture describes it, although each rank then uses only its own shard: a
reduce-scatter would do. Stage 2 makes that switch, which costs the same as plain data
parallelism's all-reduce, and because it reduces during backward it can free each full
gradient as soon as it is sent.

:class:`ZeroOptimizer` (stages 1 and 2) wraps any *element-wise* ``torch.optim`` optimizer (SGD,
Adam, AdamW, ...): it packs the parameters into flat buckets (the layout of
:class:`lmfs.parallel.ddp.GradBuckets`, padded to a multiple of ``n``), points every parameter
at its slice of a flat buffer, and hands the inner optimizer only this rank's 1/n of each
bucket, as one flat tensor. An optimizer that mixes elements of a matrix (Shampoo, Muon) would
need whole tensors per rank instead.

:class:`FullyShardedModel` (stage 3) keeps only a flat 1/n shard of each layer's parameters.
A forward pre-hook gathers the layer's full parameters just before it runs and the forward
hook drops them after; backward gathers them again, and the gathered tensor's backward
reduce-scatters the gradient straight into the shard's ``.grad``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from lmfs.nn import Block, TransformerConfig
from lmfs.parallel import comm
from lmfs.parallel.common import build_model, shard_batch, train_on_rank
from lmfs.parallel.ddp import Bucket, GradBuckets, broadcast_parameters
from lmfs.parallel.launch import device_for


def _param_groups(params) -> list[dict]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=list(g["params"])) for g in params]
    return [{"params": params}]


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around ``optimizer_class`` (any element-wise ``torch.optim`` optimizer).

    ``params`` are parameters or param groups, as for a torch optimizer; ``defaults`` go to
    ``optimizer_class``. Construction broadcasts rank 0's parameters. Per step::

        loss.backward(); zero_opt.step(); zero_opt.zero_grad()

    Stage 2 reduce-scatters each bucket during backward (hooks) and frees the full gradients
    as soon as they are copied; stage 1 all-reduces everything in :meth:`step`. A parameter no
    rank computed a gradient for is treated as having a zero gradient. ``bucket_size_mb=None``
    makes one bucket per param group.

    It is a ``torch.optim.Optimizer`` whose ``param_groups`` are the inner optimizer's (each
    holding this rank's flat shards), so torch's learning-rate schedulers drive it. Checkpoints
    are per rank: :meth:`state_dict` holds this rank's shard of the optimizer state, and
    :meth:`load_state_dict` accepts only a state saved by the same rank of the same layout (the
    model's parameters are saved as usual, with ``model.state_dict()``).
    """

    def __init__(self, params, optimizer_class, stage: int = 1, bucket_size_mb: float | None = 25,
                 group=None, **defaults):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, got stage={stage}; "
                             "stage 3 is FullyShardedModel")
        self.stage, self.group = stage, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bucketers: list[GradBuckets] = []
        inner_groups = []
        for g in _param_groups(params):
            ps = [p for p in g["params"] if p.requires_grad]
            with torch.no_grad():
                for p in ps:
                    comm.broadcast(p, src=0, group=group)
            launch = self.reduce_scatter_bucket if stage == 2 else None
            buckets = GradBuckets(ps, bucket_size_mb, launch, pad_to=self.n)
            for b in buckets.buckets:
                self.shard_bucket(b)
            self.bucketers.append(buckets)
            options = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({**options, "params": [b.shard for b in buckets.buckets]})
        self.inner = optimizer_class(inner_groups, **defaults)
        # The outer optimizer's groups are the inner one's (the same dicts): a scheduler that sets
        # group["lr"] here sets it for the inner step. Its state is the inner one's too.
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.state = self.inner.state

    def shard_bucket(self, b: Bucket):
        """Move the bucket's parameters into one flat buffer; this rank's 1/n is its ``shard``.

        The model keeps reading full parameters (views into the buffer), the inner optimizer
        steps only the shard, and the all-gather at the end of :meth:`step` writes the other
        ranks' shards into the same buffer. Adds to the bucket: ``flat_params``, ``shard`` and
        ``reduced`` (stage 2's shard of the summed gradient, while it is in flight).
        """
        p0 = b.params[0]
        b.flat_params = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        for p, off in zip(b.params, b.offsets):
            b.flat_params[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = b.flat_params[off:off + p.numel()].view_as(p)  # the model now reads the buffer
        c = b.numel // self.n
        # A Parameter built from a slice shares its storage: stepping it updates the buffer.
        b.shard = nn.Parameter(b.flat_params[self.rank * c:(self.rank + 1) * c])
        b.reduced = None

    @property
    def buckets(self) -> list[Bucket]:
        return [b for bk in self.bucketers for b in bk.buckets]

    def reduce_scatter_bucket(self, b: Bucket):
        """Stage 2, called inside backward by the bucket hooks of :class:`GradBuckets` once this
        bucket's gradients are complete on this rank: start a reduce-scatter that leaves each rank
        only the mean gradient of its own shard (``b.reduced``); returns the pending work."""
        # Everyone sends each owner the pieces it owns; the owner receives the sum (pre-divided:
        # the mean).
        b.grads.div_(self.n)
        b.reduced = torch.empty(b.numel // self.n, dtype=b.grads.dtype, device=b.grads.device)
        return comm.reduce_scatter_into(b.reduced, b.grads, group=self.group, async_op=True)

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce the gradients, step this rank's shards, all-gather the updated parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step takes no closure: call loss.backward() before step()")
        if self.stage == 1:
            works = []
            for b in self.buckets:
                b.grads = torch.zeros(b.numel, dtype=b.flat_params.dtype, device=b.flat_params.device)
                for p, off in zip(b.params, b.offsets):
                    if p.grad is not None:
                        b.grads[off:off + p.numel()].copy_(p.grad.reshape(-1))
                b.grads.div_(self.n)
                works.append(comm.all_reduce(b.grads, group=self.group, async_op=True))
            for w in works:
                w.wait()
            for b in self.buckets:
                c = b.numel // self.n
                b.shard.grad = b.grads[self.rank * c:(self.rank + 1) * c].clone()  # keep only ours
        else:
            for bk in self.bucketers:
                bk.finish()  # the reduce-scatters started during backward
            for b in self.buckets:
                b.shard.grad, b.reduced = b.reduced, None
        for bk in self.bucketers:
            bk.reset()

        self.inner.step()  # updates only this rank's shards, in place in the flat buffers

        # Everyone contributes its updated shard; afterwards every rank has all parameters again.
        works = [comm.all_gather_into(b.flat_params, b.shard.detach().clone(), group=self.group,
                                      async_op=True) for b in self.buckets]
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True):
        """Drop all gradients (always set to ``None``; the argument mirrors torch's optimizers)."""
        for b in self.buckets:
            b.shard.grad = None
            for p in b.params:
                p.grad = None

    def _layout(self) -> list[list[int]]:
        """Per param group, the flat length of each bucket: the shards' shape depends on it."""
        return [[b.numel for b in bk.buckets] for bk in self.bucketers]

    def state_dict(self) -> dict:
        """This rank's checkpoint: its shard of the optimizer state, the learning-rate settings of
        the groups, and where it belongs (rank, world size, stage, bucket layout)."""
        return {"rank": self.rank, "world_size": self.n, "stage": self.stage, "layout": self._layout(),
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved on this same rank (each rank loads its own file)."""
        missing = {"rank", "world_size", "stage", "layout", "inner"} - set(state_dict)
        if missing:
            raise ValueError(f"not a ZeroOptimizer checkpoint (no {sorted(missing)}): save it with "
                             "ZeroOptimizer.state_dict() on every rank, one file per rank")
        saved = (state_dict["rank"], state_dict["world_size"])
        if saved != (self.rank, self.n):
            raise ValueError(f"this checkpoint holds rank {saved[0]}'s shard of a {saved[1]}-rank run, "
                             f"but this is rank {self.rank} of {self.n}: load each rank's own file "
                             "(e.g. f'zero-rank{rank}.pt') into the same number of ranks")
        if state_dict["stage"] != self.stage or state_dict["layout"] != self._layout():
            raise ValueError(f"the checkpoint's shards were cut for stage {state_dict['stage']} and "
                             f"bucket sizes {state_dict['layout']}, this optimizer has stage {self.stage} "
                             f"and {self._layout()}: build it with the same model, param groups, stage "
                             "and bucket_size_mb as the run that saved it")
        self.inner.load_state_dict(state_dict["inner"])
        # The inner optimizer replaced its group dicts with the loaded ones: share them again.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state


# ---------------------------------------------------------------------------------------------
# Stage 3: fully sharded parameters


class _Unit:
    """One sharded layer: where its parameters live in the flat layout, and its shard."""

    def __init__(self, module: nn.Module, entries: list, numel: int, shard: nn.Parameter):
        self.module = module
        self.entries = entries   # (owner module, attribute, offset, shape, qualified name)
        self.numel = numel       # padded length of the flat layout
        self.shard = shard       # fp32 master: this rank's numel/n elements
        self.full = None         # the gathered parameters while forward runs through the unit
        self.full_for_backward = None


class _ParamRef:
    """What autograd stores instead of a view of gathered parameters: where to find it again."""

    def __init__(self, unit: _Unit, t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class _GatherParams(torch.autograd.Function):
    """shard -> full parameters (all-gather); backward: full gradient -> shard gradient
    (reduce-scatter). Autograd thereby routes every layer's gradient to its owner."""

    @staticmethod
    def forward(ctx, shard, fsdp, unit):
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp._gather(unit, fsdp.compute_dtype)

    @staticmethod
    def backward(ctx, grad_full):
        return ctx.fsdp._reduce_scatter_grad(ctx.unit, grad_full), None, None


class FullyShardedModel(nn.Module):
    """ZeRO-3 / FSDP: each ``unit_types`` submodule (default: every transformer :class:`Block`)
    and the rest of the model (the root unit: embedding, final norm, head) is one unit whose
    parameters are flattened, padded and split ``n`` ways.

    ``compute_dtype=torch.bfloat16`` gives mixed precision: the fp32 shard is the master copy the
    optimizer steps; it is cast to bf16 *before* the all-gather (half the bytes), the layer
    computes in bf16, and gradients are reduce-scattered in fp32.

    Memory between layers is ``1/n`` of the parameters, gradients and optimizer state, plus
    one unit's full parameters while it runs. Freeing them after forward needs one trick: autograd
    would keep the weights it saves for backward (``x @ Wᵀ`` saves ``W``) alive. A
    ``saved_tensors_hooks`` pair replaces each saved view of gathered parameters by a small
    :class:`_ParamRef`, and gathers the unit again when backward asks for it.

    Left out for clarity: prefetching the next unit's all-gather so it overlaps with compute.
    """

    def __init__(self, module: nn.Module, unit_types=(Block,), compute_dtype: torch.dtype | None = None,
                 group=None):
        super().__init__()
        self.module, self.group = module, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.compute_dtype = compute_dtype or torch.float32
        broadcast_parameters(module, group=group)
        names = {m: name for name, m in module.named_modules()}
        # Children before parents, root last: each unit takes the parameters no inner unit took.
        candidates = [m for m in module.modules() if isinstance(m, unit_types) and m is not module]
        self.units: list[_Unit] = []
        for m in list(reversed(candidates)) + [module]:  # modules() lists parents before children
            unit = self._shard(m, names)
            if unit is not None:
                self.units.append(unit)
                m.register_forward_pre_hook(partial(self.pre_forward, unit))
                m.register_forward_hook(partial(self._post_forward, unit))
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self._live: dict[int, _Unit] = {}  # id(gathered tensor) -> unit, during forward

    def _shard(self, m: nn.Module, names) -> _Unit | None:
        entries, slots, pieces, total = [], {}, [], 0
        for sub in m.modules():
            for attr, p in list(sub._parameters.items()):
                if p is None or not p.requires_grad:
                    continue  # frozen parameters stay ordinary, replicated tensors
                if id(p) not in slots:  # a tied parameter gets one slot, however often it appears
                    slots[id(p)] = total
                    pieces.append(p.detach().reshape(-1).float())
                    total += p.numel()
                qual = f"{names[sub]}.{attr}" if names[sub] else attr
                entries.append((sub, attr, slots[id(p)], p.shape, qual))
                del sub._parameters[attr]
                setattr(sub, attr, None)  # filled with a view of the gathered tensor in forward
        if not entries:
            return None
        flat = torch.cat(pieces)
        flat = torch.cat([flat, flat.new_zeros(-total % self.n)])
        c = flat.numel() // self.n
        shard = nn.Parameter(flat[self.rank * c:(self.rank + 1) * c].clone())
        return _Unit(m, entries, flat.numel(), shard)

    # -- communication ------------------------------------------------------------------------

    def _gather(self, unit: _Unit, dtype) -> torch.Tensor:
        shard = unit.shard.detach().to(dtype)
        full = torch.empty(unit.numel, dtype=dtype, device=shard.device)
        comm.all_gather_into(full, shard, group=self.group)
        return full

    def _reduce_scatter_grad(self, unit: _Unit, grad_full: torch.Tensor) -> torch.Tensor:
        # The unit's backward is complete (this is the last use of its parameters): drop them.
        unit.full_for_backward = None
        grad = grad_full.float().div_(self.n)  # reduce in fp32, pre-divided: the mean over ranks
        out = torch.empty(unit.numel // self.n, device=grad.device)
        comm.reduce_scatter_into(out, grad, group=self.group)
        return out

    # -- hooks --------------------------------------------------------------------------------

    def pre_forward(self, unit: _Unit, module, args):
        """The forward pre-hook of each unit: all-gather its parameter shards into one full tensor
        and point every parameter of the unit at its slice of it, just before the unit runs."""
        full = _GatherParams.apply(unit.shard, self, unit)
        unit.full = full
        self._live[id(full)] = unit
        for sub, attr, off, shape, _ in unit.entries:
            setattr(sub, attr, full[off:off + shape.numel()].view(shape))

    def _post_forward(self, unit: _Unit, module, args, output):
        for sub, attr, *_ in unit.entries:
            setattr(sub, attr, None)
        self._live.pop(id(unit.full), None)
        unit.full = None  # nothing else refers to the gathered tensor: it is freed here

    def pack(self, t: torch.Tensor):
        """Autograd calls this for every tensor it saves in forward: a view of gathered parameters
        is kept as a reference to its unit instead, so the gathered tensor can be freed after the
        unit ran."""
        base = t._base if t._base is not None else t
        unit = self._live.get(id(base))
        if unit is not None and unit.full is base:
            return _ParamRef(unit, t)
        return t

    def unpack(self, saved):
        """... and this when backward needs a saved tensor: a reference to a unit's parameters
        gathers the unit again (once per backward) and returns the view."""
        if not isinstance(saved, _ParamRef):
            return saved
        unit = saved.unit
        if unit.full_for_backward is None:  # first use in this backward: gather again
            unit.full_for_backward = self._gather(unit, self.compute_dtype)
        return unit.full_for_backward.as_strided(saved.size, saved.stride, saved.offset)

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return self.module(*args, **kwargs)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, gathered in fp32 under its original name (a collective: all ranks)."""
        state = {}
        for unit in self.units:
            full = self._gather(unit, torch.float32)
            for _, _, off, shape, qual in unit.entries:
                state[qual] = full[off:off + shape.numel()].view(shape).clone()
        return state


def train_zero(rank: int, world_size: int, config: TransformerConfig, batches, stage: int,
               optimizer_class=torch.optim.AdamW, optimizer_kwargs: dict | None = None,
               bucket_size_mb: float | None = 25, compute_dtype: torch.dtype | None = None,
               seed: int = 0) -> dict:
    """Rank function: data-parallel training with ZeRO ``stage`` 1, 2 or 3.

    Returns, like :func:`lmfs.parallel.ddp.train_ddp`, what :func:`lmfs.parallel.common.train_on_rank`
    returns, the full final state on rank 0 only. ``compute_dtype`` applies to stage 3 only.
    """
    device = device_for(rank)
    model = build_model(config, seed + rank, device)  # different per rank; ZeRO broadcasts rank 0's
    kwargs = optimizer_kwargs or {}
    if stage == 3:
        forward = FullyShardedModel(model, compute_dtype=compute_dtype)
        opt = optimizer_class(forward.parameters(), **kwargs)
    elif stage in (1, 2):
        if compute_dtype is not None:
            raise ValueError("compute_dtype (mixed precision) is implemented for stage 3 only")
        forward = model
        opt = ZeroOptimizer(model.parameters(), optimizer_class, stage, bucket_size_mb, **kwargs)
    else:
        raise ValueError(f"stage={stage}: use 1, 2 or 3")

    def step(batch):  # the gradient communication happens in backward (hooks) and in opt.step()
        x, y = (t.to(device) for t in shard_batch(batch, rank, world_size))
        _, loss = forward(x, y)
        loss.backward()
        return loss / world_size

    def final_state():
        state = forward.full_state_dict() if stage == 3 else model.state_dict()  # stage 3: a collective
        return state if rank == 0 else None

    return train_on_rank(forward, opt, batches, step, device, final_state)
