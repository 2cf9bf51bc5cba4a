"""Small helpers shared by the test files (pytest puts tests/ on the import path)."""

import torch

from lmfs.nn import TransformerConfig, TransformerLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape, dtype=torch.float32, device=DEVICE, seed=0):
    """A seeded normal tensor, drawn on the CPU so that every device sees the same numbers."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def forward_backward(fn, *inputs, grad_out=None, seed=1):
    """``fn(*inputs)`` and the gradients of ``<fn(*inputs), grad_out>`` for every input."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    if grad_out is None:
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    grads = torch.autograd.grad(out, inputs, grad_out)
    return out, grads, grad_out


def tiny(**overrides) -> TransformerConfig:
    """A two-layer model config small enough for the CPU; ``overrides`` change any field."""
    base = dict(vocab_size=50, context_length=16, d_model=32, n_layers=2, n_heads=4)
    return TransformerConfig(**{**base, **overrides})


def model_of(config, seed=0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(config)


class HostTransfers(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operators that, on a GPU, move data between host and device: a Python number made
    into a tensor (``scalar_tensor``, ``lift_fresh``: created on the host, then copied over), and a
    tensor read back (``_local_scalar_dense``: ``.item()``). Inside a CUDA graph capture the first
    kind fails and the second breaks the capture; on the CPU they run silently, so this catches them
    before a GPU run does."""

    SUSPECT = ("aten.scalar_tensor", "aten.lift_fresh", "aten._local_scalar_dense")

    def __init__(self):
        super().__init__()
        self.found = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.SUSPECT):
            self.found.add(str(func))
        return func(*args, **(kwargs or {}))
