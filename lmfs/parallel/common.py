"""What every strategy in :mod:`lmfs.parallel` shares: the test bed and the one training loop.

The test bed is a tiny model (:func:`demo_config`), fixed random batches (:func:`demo_batches`)
and plain single-process training (:func:`train_single`), the reference every strategy must
reproduce. The loop is :func:`train_on_rank`: each strategy builds its model and optimizer its own
way and hands over one function, ``step(batch)``, that runs forward and backward on this rank's
part of the batch, synchronises the gradients the way the strategy needs, and returns this
rank's share of the batch's loss. The loop does the rest, the same for every strategy::

    for batch in batches:
        with count_bytes() as sent:          # what this rank sends (lmfs.parallel.comm)
            share = step(batch)              # forward, backward, gradient communication
            optimizer.step()                 # ZeRO communicates here too
        memory = memory_report(model, optimizer)
        optimizer.zero_grad()
        loss = sum of the shares over ranks  # for reporting only

"Share" makes every strategy report the same number: the ranks' shares sum to the mean loss of
the global batch (a data-parallel rank's share is its slice's mean loss divided by ``n``; a
tensor-parallel rank, which sees the whole batch, contributes ``loss / n``; only the last
pipeline stage has a loss at all and contributes all of it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lmfs.bench.memory import optimizer_tensors, storage_bytes
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.parallel import comm


def demo_config(**overrides) -> TransformerConfig:
    """A model small enough for several CPU processes at once (about 40k parameters)."""
    base = dict(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)
    return TransformerConfig(**{**base, **overrides})


def demo_batches(steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
    """``steps`` global batches ``(x, y)`` of random tokens, each ``(batch_size, seq_len)``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (steps, batch_size, seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def shard_batch(batch, rank: int, world_size: int):
    """Rank ``rank``'s rows of a global batch (a tuple of tensors with the batch first, such as
    ``(x, y)``); the batch must split evenly."""
    rows = batch[0].shape[0]
    if rows % world_size:
        raise ValueError(f"batch size {rows} does not split over {world_size} ranks: use a "
                         f"multiple of {world_size}")
    k = rows // world_size
    return tuple(t[rank * k:(rank + 1) * k] for t in batch)


def build_model(config: TransformerConfig, seed: int, device) -> TransformerLM:
    """``TransformerLM(config)`` initialised from ``seed``; on a GPU, peak-memory tracking restarts
    (from the memory in use, the model included)."""
    torch.manual_seed(seed)
    model = TransformerLM(config).to(device)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return model


def now(device) -> float:
    """Wall-clock seconds, once the GPU has finished its queued work (so a step is timed whole)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def memory_report(model: nn.Module, optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state.

    Tensors are counted by their storage, once each: a parameter that is a view into a flat
    buffer counts as (its share of) that buffer, not twice. On a GPU, ``peak_allocated`` adds
    the allocator's high-water mark since the last ``torch.cuda.reset_peak_memory_stats``
    (activations and temporary buffers included).
    """
    params = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]]
    out = {"params": storage_bytes(params),
           "grads": storage_bytes([p.grad for p in params if p.grad is not None]),
           "optimizer": storage_bytes(optimizer_tensors(optimizer))}
    out["total"] = sum(out.values())
    if params and params[0].is_cuda:
        out["peak_allocated"] = torch.cuda.max_memory_allocated(params[0].device)
    return out


def train_on_rank(model: nn.Module, optimizer, batches, step: Callable, device,
                  final_state: Callable[[], dict | None], distributed: bool = True) -> dict:
    """The training loop every strategy shares (see the module docstring).

    ``step(batch)`` returns this rank's share of the batch's loss (a tensor) after backward and
    the gradient communication; ``model`` is what this rank holds (its memory is reported);
    ``final_state()`` is called once after the last step (a collective for strategies that
    gather their shards). ``distributed=False`` runs it in a single process (no sum over ranks).

    Returns ``{"state", "losses", "step_seconds", "bytes_per_step", "memory"}``: the final state,
    the global batch's loss per step, seconds per step, the bytes this rank sent in the last step
    (by collective) and the memory it held right after that step's update.
    """
    losses, seconds = [], []
    for batch in batches:
        start = now(device)
        with comm.count_bytes() as sent:
            share = step(batch)
            optimizer.step()
        memory = memory_report(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        seconds.append(now(device) - start)
        loss = share.detach().reshape(1).to(device=device, dtype=torch.float64)
        if distributed:  # reporting only: a plain all-reduce, not counted as training traffic
            dist.all_reduce(loss)
        losses.append(loss.item())
    return {"state": final_state(), "losses": losses, "step_seconds": seconds,
            "bytes_per_step": sent.summary(), "memory": memory}


def train_single(config: TransformerConfig, batches, optimizer_class=torch.optim.AdamW,
                 optimizer_kwargs: dict | None = None, seed: int = 0, device="cpu") -> dict:
    """Train ``TransformerLM(config)`` (initialised from ``seed``) on ``batches`` in this process.

    Returns what :func:`train_on_rank` returns, the state on the CPU: what every distributed
    strategy must reproduce on the same data. On a GPU ``device`` it is also the one-GPU
    baseline a throughput comparison starts from.
    """
    model = build_model(config, seed, device)
    optimizer = optimizer_class(model.parameters(), **(optimizer_kwargs or {}))

    def step(batch):
        x, y = (t.to(device) for t in batch)
        _, loss = model(x, y)
        loss.backward()
        return loss

    return train_on_rank(model, optimizer, batches, step, device, distributed=False,
                         final_state=lambda: {k: v.detach().cpu() for k, v in model.state_dict().items()})
