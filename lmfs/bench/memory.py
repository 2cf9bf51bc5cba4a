"""Measure the memory a piece of PyTorch code holds, on any device (the CPU included).

On a GPU, ``torch.cuda.max_memory_allocated`` answers "how much memory did tensors hold at most";
the CPU allocator keeps no such counter, and a process's resident memory mixes in Python, libraries
and cached pages. :class:`TensorMemory` counts tensor storage itself: it watches every tensor that
PyTorch's dispatcher produces, adds its storage's bytes while the storage lives, and keeps the
peak. It sees what autograd saves and what the optimizer makes, on every device alike.

>>> import torch
>>> x = torch.zeros(1024)                       # 4 KiB made before watching: passed in
>>> with TensorMemory([x]) as mem:
...     y = x * 2                               # +4 KiB
...     del y                                   # freed again
...     z = torch.ones(256)                     # +1 KiB
>>> mem.peak, mem.current
(8192, 5120)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """Live bytes of tensor storage (``current``) and their maximum (``peak``) while active.

    ``existing``: tensors made before watching began (parameters, optimizer state, the batch) that
    should count from the start. Views share their base's storage and are counted once.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = self.peak = 0
        self.live: dict[int, weakref.finalize] = {}  # storage address -> called when it is freed
        for t in existing:
            self.track(t)

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in self.live:
            return
        self.current += size
        self.peak = max(self.peak, self.current)
        self.live[ptr] = weakref.finalize(storage, self._release, ptr, size)

    def _release(self, ptr: int, size: int) -> None:
        self.current -= size
        del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer keeps in its state (Adam's two moments, its step counts, ...)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: a view counts as its whole base, once,
    however many views of it are passed; a DTensor (FSDP2) counts as its local shard."""
    seen = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def saved_tensor_bytes(forward: Callable[[], object], model: torch.nn.Module) -> int:
    """Bytes autograd saves for the backward pass while ``forward()`` runs: the distinct storages
    of the saved tensors (a view counts as its whole base, once), the model's own tensors
    (parameters, and buffers such as RoPE's tables) excluded. What the activation formula of
    :func:`lmfs.accounting.training_memory` predicts."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return storage_bytes(saved)


def step_peak(step: Callable[[], object], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              *batch: torch.Tensor) -> int:
    """Peak tensor bytes of one call of a training ``step``, after an untracked first call.

    The first call creates the optimizer's state; the measured call then counts parameters,
    optimizer state and ``batch`` from the start, plus everything the step makes.
    """
    step()
    with TensorMemory([*model.parameters(), *optimizer_tensors(optimizer), *batch]) as mem:
        step()
    return mem.peak
