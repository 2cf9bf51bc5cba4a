"""Measure the memory a piece of PyTorch code holds, on any device (the CPU included), and
predict it byte for byte.

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

:func:`training_memory` (with :func:`activation_bytes_per_layer`) predicts the peak of one
training step of ``lmfs.nn.TransformerLM`` tensor by tensor: the casts autocast makes, the views
that keep a larger tensor alive, the loss's buffers. It is exact for this implementation and
tested against :class:`TensorMemory` and ``torch.cuda.max_memory_allocated``; the textbook closed
form it refines is :func:`lmfs.accounting.activation_memory_per_layer`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lmfs.accounting import matmul_params, param_count
from lmfs.nn.config import TransformerConfig
from lmfs.nn.layers import GATED_FFNS


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
    :func:`training_memory` predicts."""
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


def torch_step_peak(step: Callable[[], object], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    *batch: torch.Tensor) -> int:
    """:func:`step_peak` measured by PyTorch's own tracker instead (``MemTracker``, which torch keeps
    under a private module path): the independent reference ours is checked against. Like it, one
    untracked call first. The tracker handles one forward per module only (no gradient accumulation)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch)
    with tracker:
        step()
    return sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())


def peak_memory(step: Callable[[], object], device: torch.device) -> int | None:
    """``torch.cuda.max_memory_allocated`` over one call of ``step`` (after one untracked call,
    which creates the optimizer state); ``None`` off CUDA, whose allocators keep no such counter
    (use :func:`step_peak` there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


# ---------------------------------------------------------------------------------------------
# The exact model of a training step's memory

# Optimizer state tensors per parameter, each the size of the parameter.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "adamw": 2}


def _memory_model_problems(c: TransformerConfig) -> list[str]:
    """Settings whose saved tensors :func:`training_memory` does not model."""
    required = {"norm_position": "pre", "parallel": False, "attention": "mha", "qk_norm": False,
                "bias": False, "logit_softcap": None, "attn_softcap": None, "window": None,
                "z_loss": 0.0}
    return [f"{name}={getattr(c, name)!r} (needs {want!r})"
            for name, want in required.items() if getattr(c, name) != want]


def norm_bytes(config: TransformerConfig) -> int:
    """Bytes per token one norm saves: its fp32 input and normalised output, and 1/rms (fp32).

    lmfs's LayerNorm computes ``x - mean`` twice (once for the variance, once to normalise), and
    autograd keeps both copies.
    """
    return (8 if config.norm == "rms" else 12) * config.d_model + 4


def activation_bytes_per_layer(config: TransformerConfig, batch_size: int, seq_len: int, compute_bytes: int = 4,
                               *, fused_projections: bool = False, triton_kernels: bool = False) -> int:
    """Bytes one block of ``TransformerLM(config)`` keeps for its backward pass, tensor by tensor.

    ``a = compute_bytes`` is the width of matmul outputs: 2 under bf16/fp16 autocast, 4 in
    fp32. The residual stream stays fp32 under autocast (the embedding is fp32, and an fp32 +
    bf16 sum is fp32), and the norms compute in fp32. Per token, with ``d = d_model``,
    ``f = ffn_dim``, ``H = n_heads``, for the model as ``lmfs.nn`` builds it:

    ======================================  ============================  ===================
    saved tensor                            autocast (a = 2)              fp32 (a = 4)
    ======================================  ============================  ===================
    2 norms: input, normalised, 1/rms       2·(4d + 4d + 4)               same
    (LayerNorm: its input centred twice)    2·(4d + 4d + 4d + 4)          same
    inputs of q/k/v projections             3·a·d (one cast per matmul)   a·d (one shared)
    q, k, v after RoPE (SDPA inputs)        3·a·d                         3·a·d
    attention output (and, SDPA, logsumexp) a·d + 4H                      a·d + 4H
    inputs of the MLP's first matmuls       2·a·d gated, a·d plain        a·d
    MLP hidden: gated 4·a·f (gate, act,     4·a·f / 2·a·f / a·f           same
    up, product); gelu 2·a·f; relu a·f
    ======================================  ============================  ===================

    For a SwiGLU block under autocast that is ``34d + 8f + 4H + 8`` bytes per token; in fp32
    ``40d + 16f + 4H + 8``. The reference attention path saves no logsumexp but the softmax,
    ``4·H·T`` per token, plus its bf16 copy ``a·H·T`` under autocast: the ``T²`` memory that
    FlashAttention avoids. RoPE's cos/sin tables are the model's own fp32 buffers
    (:class:`lmfs.nn.RotaryEmbedding`): in fp32 the backward keeps views of them, nothing new;
    under autocast each rotation (of q, of k) casts both, four ``(T, head_dim)`` copies per layer.

    ``fused_projections``: the model runs through :func:`lmfs.kernels.fused.fuse_model`, whose
    q/k/v (and a gated MLP's gate and up) are one matmul each under autocast: one cast of the
    input instead of three (two), ``a·d`` each. The q/k/v output is then one tensor, and q, k, v
    are views of it; a view kept for the backward pass keeps all of it, ``a·(H + 2·H_kv)·d_head``.
    With RoPE (which makes new q and k) and MHA (v not repeated for GQA), v is such a view:
    attention keeps ``a·d`` (the cast) ``+ 2·a·d`` (q, k) ``+ 3·a·d`` (the q/k/v output), as much
    as unfused, and a fused SwiGLU block keeps ``32d + 8f + 4H + 8`` under autocast. In fp32
    nothing is fused (a stacked weight would be one more copy), so the flag changes nothing.

    ``triton_kernels`` (with ``fused_projections``, on a CUDA GPU): the fused projections go
    through the Triton kernels of :mod:`lmfs.kernels.fused`. ``rope_qkv`` makes q, k and v anew
    and its backward needs only the fp32 tables (no casts of them, no q/k/v output kept):
    attention keeps ``a·d + 3·a·d``. ``swiglu`` keeps the gate/up output, one ``2·a·f`` tensor, and
    not the activation: the MLP hidden is ``3·a·f``. A SwiGLU block: ``28d + 6f + 4H + 8``.
    """
    c = config
    problems = _memory_model_problems(c)
    if problems:
        raise ValueError("the memory model covers pre-norm sequential blocks without biases, "
                         "QK-norm, MLA, soft-caps, windows or z-loss; this config has "
                         + "; ".join(problems) + ". Measure with TensorMemory or torch.cuda.max_memory_allocated.")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 2 (bf16/fp16 autocast) or 4 (fp32), got {compute_bytes}")
    a, d, f, H = compute_bytes, c.d_model, c.ffn_dim, c.n_heads
    autocast = a < 4
    gated = c.ffn in GATED_FFNS
    hidden = {"relu": 1, "gelu": 2}.get(c.ffn, 4)  # relu saves only its output
    per_token = 2 * norm_bytes(c)                                    # the two norms
    # Autocast casts a matmul's fp32 input anew for each matmul; in fp32 they share one tensor.
    fused = autocast and fused_projections                           # one matmul, one cast
    kernels = fused and triton_kernels
    rope_kernel = kernels and c.positions == "rope"                  # lmfs.kernels.fused.rope_qkv
    if rope_kernel:
        per_token += a * d + 3 * a * d                               # input; new q, k, v
    elif fused:
        # q, k and v as attention keeps them: a new tensor where RoPE rotated it (q, k) or GQA
        # repeated its heads (k, v); otherwise a view that keeps the whole q/k/v output alive.
        rope, gqa = c.positions == "rope", c.kv_heads != c.n_heads
        new = rope + (rope or gqa) + gqa
        qkv_output = a * (H + 2 * c.kv_heads) * c.head_dim if new < 3 else 0
        per_token += a * d + new * a * d + qkv_output                # input; q, k, v
    else:
        per_token += (3 if autocast else 1) * a * d                  # q/k/v projection inputs
        per_token += 3 * a * d                                       # q, k, v
    if c.attn_impl == "sdpa":
        per_token += a * d + 4 * H                                   # output, logsumexp
    else:
        per_token += a * d + (4 + (a if autocast else 0)) * H * seq_len  # output, softmax
    per_token += (2 if gated and autocast and not fused else 1) * a * d  # MLP inputs
    per_token += (3 if kernels and c.ffn == "swiglu" else hidden) * a * f  # swiglu: gate|up, product
    rope_tables = 4 * seq_len * c.head_dim * a if c.positions == "rope" and autocast and not rope_kernel else 0
    return batch_size * seq_len * per_token + rope_tables


def loss_bytes(config: TransformerConfig, batch_size: int, seq_len: int, compute_bytes: int = 4, *,
               chunked_loss: bool = False, triton_kernels: bool = False) -> int:
    """Bytes of the loss's ``(tokens, vocab)`` buffers at their largest, with every activation alive.

    * From the logits (``TransformerLM.forward(idx, targets)``): at the start of the backward
      pass the saved fp32 log-softmax and its incoming and outgoing gradients, ``12·vocab`` bytes
      per token.
    * ``chunked_loss`` (:func:`lmfs.kernels.linear_cross_entropy`): the logit gradient it keeps,
      ``a·vocab`` per token (``a = compute_bytes``), plus, at the end of the forward pass, the
      temporaries of one chunk of ``r`` rows: in PyTorch five fp32 ``(r, vocab)`` tensors and a
      boolean one (the logits, ``logits - lse``, its ``exp``, the gradient minus one-hot, the
      one-hot test), ``17·r·vocab``; with ``triton_kernels`` on a GPU one kernel makes the loss
      and gradient of the chunk's logits, ``a·r·vocab``.
    """
    from lmfs.kernels.loss import default_chunk  # the rows per chunk linear_cross_entropy uses

    tokens, V = batch_size * seq_len, config.vocab_size
    if not chunked_loss:
        return 12 * V * tokens
    rows = min(default_chunk(V), tokens)
    return compute_bytes * V * tokens + (compute_bytes if triton_kernels else 17) * rows * V


def training_memory(config: TransformerConfig, batch_size: int, seq_len: int, *,
                    compute_bytes: int = 4, activation_checkpointing: bool = False, fused_projections: bool = False,
                    triton_kernels: bool = False, chunked_loss: bool = False, optimizer: str = "adamw",
                    grad_accum: int = 1) -> dict[str, int]:
    """Bytes of one training step of ``TransformerLM(config)`` as :func:`lmfs.train.train` runs it.

    Parameters, gradients and optimizer state are fp32 (4 bytes each). ``compute_bytes`` is 2
    for bf16 (or fp16) autocast, 4 for fp32 training. ``fused_projections``, ``triton_kernels``
    and ``chunked_loss`` describe a model passed through :func:`lmfs.kernels.fused.fuse_model`
    (the kernels on a CUDA GPU only); by default the plain model. Returns, in bytes:

    * ``parameters``, ``gradients``: ``4·N`` each.
    * ``optimizer_state``: ``4·N`` per state tensor (:data:`OPTIMIZER_STATES`; AdamW keeps two).
    * ``weight_copies``: under autocast every weight matrix is cast to bf16 for its matmul, and
      the copy is kept for the backward pass: ``2·N_mm``.
    * ``activations``: what the forward pass keeps: ``n_layers ×``
      :func:`activation_bytes_per_layer` (with checkpointing only each block's fp32 input,
      ``4·d`` per token), plus the final norm and the head's input (``8d + 4 + a·d`` per token
      with RMSNorm, ``a = 4`` in fp32), plus the batch itself (two int64 ``(B, T)`` tensors).
    * ``recompute``: with checkpointing, the one block whose activations are rebuilt at a time.
    * ``logits``: the loss's ``(B·T, vocab)`` buffers, :func:`loss_bytes`. (Often the largest
      single item for small models with large vocabularies.)
    * ``total``: the peak, the sum of :func:`memory_at_peak`'s items. ``batch_size`` is the
      micro-batch: with ``grad_accum > 1`` micro-batches per step, the gradients of the earlier
      ones are held while the next one runs forward.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {sorted(OPTIMIZER_STATES)}")
    c = config
    tokens = batch_size * seq_len
    n_params = param_count(c)
    a = compute_bytes
    layer = activation_bytes_per_layer(c, batch_size, seq_len, compute_bytes, fused_projections=fused_projections,
                                       triton_kernels=triton_kernels)  # validates c
    head = tokens * (norm_bytes(c) + a * c.d_model)                 # final norm, head input
    batch = 2 * 8 * tokens
    if activation_checkpointing:
        stored = c.n_layers * 4 * c.d_model * tokens
        recompute = layer + (a * (matmul_params(c) - c.vocab_size * c.d_model) // c.n_layers
                             if a < 4 else 0)
    else:
        stored, recompute = c.n_layers * layer, 0
    parts = {
        "parameters": 4 * n_params,
        "gradients": 4 * n_params,
        "optimizer_state": 4 * n_params * OPTIMIZER_STATES[optimizer],
        "weight_copies": (a * (c.vocab_size * c.d_model if activation_checkpointing else matmul_params(c))
                          if a < 4 else 0),
        "activations": stored + head + batch,
        "recompute": recompute,
        "logits": loss_bytes(c, batch_size, seq_len, a, chunked_loss=chunked_loss, triton_kernels=triton_kernels),
    }
    parts["total"] = sum(memory_at_peak(parts, grad_accum).values())
    return parts


def memory_at_peak(parts: dict[str, int], grad_accum: int = 1) -> dict[str, int]:
    """The items of :func:`training_memory` that are in memory together at the step's peak.

    Parameters and optimizer state are always there. Gradients are set to ``None`` between
    steps, so the peak is one of two moments: the end of the forward pass or the start of the
    backward pass (bf16 weight copies, activations and the loss's buffers all alive, no gradient
    yet), or later in the backward pass (gradients growing while a recomputed block is alive;
    with checkpointing the stored block inputs of the earlier layers are still there too). With
    gradient accumulation, the gradients of the earlier micro-batches are held through the later
    forward passes.
    """
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    peak = {"parameters": parts["parameters"], "optimizer_state": parts["optimizer_state"]}
    forward = {k: parts[k] for k in ("weight_copies", "activations", "logits")}
    backward = {"recompute": parts["recompute"]}
    if parts["recompute"]:  # activation checkpointing: the stored block inputs are still alive
        backward["activations"] = parts["activations"]
    if grad_accum > 1:
        peak["gradients"] = parts["gradients"]
    else:
        backward["gradients"] = parts["gradients"]
    peak.update(forward if sum(forward.values()) >= sum(backward.values()) else backward)
    return peak
