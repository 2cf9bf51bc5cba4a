"""Counting before measuring: parameters, FLOPs, memory, MFU and napkin math for training.

>>> from lmfs.nn import TransformerConfig
>>> cfg = TransformerConfig(vocab_size=32000, context_length=1024, d_model=768, n_layers=12,
...                         n_heads=12, tie_embeddings=False)
>>> param_count(cfg)
134105856
>>> round(flops_per_token(cfg, 1024) / 1e9, 3)            # forward GFLOPs per token
0.257
>>> round(time_to_train(70e9, 15e12, 1024, PEAK_FLOPS["H100"]["bf16"], 0.5) / 86400)  # days
144

Conventions, used everywhere below:

* A matmul of ``(m, k) @ (k, n)`` costs ``2·m·k·n`` FLOPs (one multiply, one add per term).
* Forward FLOPs per token are ``2·N_mm`` for the weight matmuls, where ``N_mm`` (see
  :func:`matmul_params`) counts every weight matrix a token is multiplied by: the blocks'
  projections and the output head. Embedding lookups, norms, activations, RoPE and the softmax
  are left out: they are a few percent at most, and they are not matmuls.
* Attention adds ``QKᵀ`` and ``softmax·V``: ``2·2·n_layers·seq_len·n_heads·head_dim`` per token.
  We count the **full** ``T×T`` score matrix, as PaLM's and Chinchilla's MFU formulas do, even
  though a causal mask makes half of it unnecessary. That is what the reference path
  (:func:`lmfs.nn.attention_reference`) computes and what torch's FLOP counter counts for it,
  and it keeps MFU figures comparable with published ones. A causal FlashAttention kernel skips
  the masked half, so the same run measured against the FLOPs it really executes would look
  about ``attention share / 2`` better.
* Training is three forwards: the backward pass does two matmuls (gradient with respect to the
  input, and with respect to the weight) for every one of the forward. Hence ``6·N_mm`` per
  token plus three times the attention term. Activation checkpointing recomputes the forward
  once more (4 forwards), but MFU counts only the model's FLOPs, so those are not added.
"""

from __future__ import annotations

import math

from lmfs.nn.config import TransformerConfig, count_params
from lmfs.nn.layers import GATED_FFNS

# Dense (no 2:4 sparsity) peak FLOP/s per GPU, by dtype; None where the chip has no such mode.
# Sources: NVIDIA's datasheets, "NVIDIA A100 Tensor Core GPU" (SXM 80GB), "NVIDIA H100 Tensor
# Core GPU" (SXM), "NVIDIA H200 Tensor Core GPU" (SXM) and "NVIDIA Blackwell HGX B200" (per GPU,
# 1000 W). H100/H200/B200 datasheets print tensor-core figures *with* sparsity: we halve them.
# "fp32" is the plain (non-tensor-core) rate; "tf32" is fp32 inputs on the tensor cores.
PEAK_FLOPS: dict[str, dict[str, float | None]] = {
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12, "fp8": None},
    "H100": {"fp32": 67e12, "tf32": 989e12 / 2, "bf16": 1979e12 / 2, "fp16": 1979e12 / 2,
             "fp8": 3958e12 / 2},
    "H200": {"fp32": 67e12, "tf32": 989e12 / 2, "bf16": 1979e12 / 2, "fp16": 1979e12 / 2,
             "fp8": 3958e12 / 2},
    "B200": {"fp32": 75e12, "tf32": 2.2e15 / 2, "bf16": 4.5e15 / 2, "fp16": 4.5e15 / 2,
             "fp8": 9e15 / 2},
}

# Memory per GPU in bytes, from the same datasheets (vendors' GB are 10^9 bytes).
GPU_MEMORY_BYTES: dict[str, float] = {"A100": 80e9, "H100": 80e9, "H200": 141e9, "B200": 180e9}

# Optimizer state tensors per parameter, each the size of the parameter.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "adamw": 2}


def param_count(config: TransformerConfig) -> int:
    """Trainable parameters of ``TransformerLM(config)``; the same as :func:`lmfs.nn.count_params`."""
    return count_params(config)


def matmul_params(config: TransformerConfig) -> int:
    """Entries of all the weight matrices one token is multiplied by in a forward pass.

    The projections of every block (attention and feed-forward) plus the output head
    (``vocab_size × d_model``, counted even when tied to the embedding: the lookup is free, the
    head matmul is not). Biases, norms and position tables are excluded: they are not matmuls.
    """
    c = config
    kv_in = c.kv_latent_dim if c.attention == "mla" else c.d_model
    attn = c.d_model * c.n_heads * c.head_dim                 # q_proj
    attn += 2 * kv_in * c.kv_heads * c.head_dim               # k_proj, v_proj
    attn += c.n_heads * c.head_dim * c.d_model                # o_proj
    attn += c.d_model * kv_in if c.attention == "mla" else 0  # kv_down
    ffn = (3 if c.ffn in GATED_FFNS else 2) * c.d_model * c.ffn_dim
    return c.n_layers * (attn + ffn) + c.vocab_size * c.d_model


def attention_flops_per_token(config: TransformerConfig, seq_len: int) -> int:
    """Forward FLOPs per token of ``QKᵀ`` and ``softmax·V``, full ``T×T`` convention (module doc).

    Each query meets ``seq_len`` keys in each of ``n_heads`` heads of width ``head_dim``: one
    dot product for the score, one weighted sum for the output, 2 FLOPs per multiply-add.
    """
    return 2 * 2 * config.n_layers * seq_len * config.n_heads * config.head_dim


def flops_per_token(config: TransformerConfig, seq_len: int, include_attention: bool = True) -> int:
    """Forward FLOPs per token: ``2·matmul_params`` plus, optionally, the attention term."""
    flops = 2 * matmul_params(config)
    return flops + (attention_flops_per_token(config, seq_len) if include_attention else 0)


def training_flops(config: TransformerConfig, tokens: float, seq_len: int | None = None,
                   include_attention: bool = True) -> float:
    """FLOPs to train on ``tokens`` tokens: ``3 × forward`` = ``6·N_mm·D`` + 3 × attention.

    ``seq_len`` defaults to the config's ``context_length``.
    """
    seq_len = config.context_length if seq_len is None else seq_len
    return 3 * flops_per_token(config, seq_len, include_attention) * tokens


def mfu(tokens_per_second: float, config: TransformerConfig, seq_len: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the training FLOP/s the model needs at this speed over the peak.

    ``peak_flops`` in FLOP/s, e.g. ``PEAK_FLOPS["H100"]["bf16"]`` or a measured matmul rate.
    """
    return training_flops(config, tokens_per_second, seq_len) / peak_flops


# ---------------------------------------------------------------------------------------------
# Memory


def _memory_model_problems(c: TransformerConfig) -> list[str]:
    """Settings whose saved tensors :func:`training_memory` does not model."""
    required = {"norm_position": "pre", "parallel": False, "attention": "mha", "qk_norm": False,
                "bias": False, "logit_softcap": None, "attn_softcap": None, "window": None,
                "z_loss": 0.0}
    return [f"{name}={getattr(c, name)!r} (needs {want!r})"
            for name, want in required.items() if getattr(c, name) != want]


def _norm_bytes(c: TransformerConfig) -> int:
    """Bytes per token one norm saves: its fp32 input and normalised output, and 1/rms (fp32).

    Our LayerNorm computes ``x - mean`` twice (once for the variance, once to normalise), and
    autograd keeps both copies.
    """
    return (8 if c.norm == "rms" else 12) * c.d_model + 4


def activation_bytes_per_layer(config: TransformerConfig, batch_size: int, seq_len: int,
                               compute_bytes: int = 2, triton_kernels: bool = False) -> int:
    """Bytes one block keeps for its backward pass, counted tensor by tensor.

    ``a = compute_bytes`` is the width of matmul outputs: 2 under bf16/fp16 autocast, 4 in
    fp32. The residual stream stays fp32 under autocast (the embedding is fp32, and an fp32 +
    bf16 sum is fp32), and the norms compute in fp32. Per token, with ``d = d_model``,
    ``f = ffn_dim``, ``H = n_heads``:

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

    With ``config.fused_projections`` (on by default), autocast runs q/k/v, and a gated MLP's gate
    and up, as one matmul each (:func:`lmfs.nn.layers.project`): one cast of the input instead of
    three (two), ``a·d`` each. The q/k/v output is then one tensor, and q, k, v are views of it;
    a view kept for the backward pass keeps all of it, ``a·(H + 2·H_kv)·d_head``. With RoPE (which
    makes new q and k) and MHA (v not repeated for GQA), v is such a view: attention keeps ``a·d``
    (the cast) ``+ 2·a·d`` (q, k) ``+ 3·a·d`` (the q/k/v output), as much as unfused, and a fused
    SwiGLU block keeps ``32d + 8f + 4H + 8`` under autocast.

    ``triton_kernels``: the step runs on a CUDA GPU with ``config.triton_kernels``, so fused
    projections go through :mod:`lmfs.kernels.fused`. ``rope_qkv`` makes q, k and v anew and its
    backward needs only the fp32 tables (no casts of them, no q/k/v output kept): attention keeps
    ``a·d + 3·a·d``. ``swiglu`` keeps the gate/up output, one ``2·a·f`` tensor, and not the
    activation: the MLP hidden is ``3·a·f``. A SwiGLU block: ``28d + 6f + 4H + 8``.
    """
    c = config
    problems = _memory_model_problems(c)
    if problems:
        raise ValueError("the memory model covers pre-norm sequential blocks without biases, "
                         "QK-norm, MLA, soft-caps, windows or z-loss; this config has "
                         + "; ".join(problems) + ". Measure with torch.cuda.max_memory_allocated.")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes must be 2 (bf16/fp16 autocast) or 4 (fp32), got {compute_bytes}")
    a, d, f, H = compute_bytes, c.d_model, c.ffn_dim, c.n_heads
    autocast = a < 4
    gated = c.ffn in GATED_FFNS
    hidden = {"relu": 1, "gelu": 2}.get(c.ffn, 4)  # relu saves only its output
    per_token = 2 * _norm_bytes(c)                                   # the two norms
    # Autocast casts a matmul's fp32 input anew for each matmul; in fp32 they share one tensor.
    fused = autocast and c.fused_projections                         # one matmul, one cast
    kernels = fused and triton_kernels and c.triton_kernels
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


def training_memory(config: TransformerConfig, batch_size: int, seq_len: int, *,
                    compute_bytes: int = 2, optimizer: str = "adamw",
                    activation_checkpointing: bool = False, grad_accum: int = 1,
                    triton_kernels: bool = False) -> dict[str, int]:
    """Bytes of one training step of ``TransformerLM(config)`` as :func:`lmfs.train.train` runs it.

    Parameters, gradients and optimizer state are fp32 (4 bytes each). ``compute_bytes`` is 2
    for bf16 (or fp16) autocast, 4 for fp32 training. Returns, in bytes:

    * ``parameters``, ``gradients``: ``4·N`` each.
    * ``optimizer_state``: ``4·N`` per state tensor (:data:`OPTIMIZER_STATES`; AdamW keeps two).
    * ``weight_copies``: under autocast every weight matrix is cast to bf16 for its matmul, and
      the copy is kept for the backward pass: ``2·N_mm``.
    * ``activations``: what the forward pass keeps: ``n_layers ×``
      :func:`activation_bytes_per_layer` (with checkpointing only each block's fp32 input,
      ``4·d`` per token), plus the final norm and the head's input (``8d + 4 + a·d`` per token
      with RMSNorm, ``a = 4`` in fp32), plus the batch itself (two int64 ``(B, T)`` tensors).
    * ``recompute``: with checkpointing, the one block whose activations are rebuilt at a time.
    * ``logits``: the loss's ``(B·T, vocab)`` fp32 buffers at the start of the backward pass: the
      saved log-softmax plus its incoming and outgoing gradients, ``12·vocab`` bytes per token.
      (This is often the largest single item for small models with large vocabularies.)
    * ``triton_kernels``: the step runs on a CUDA GPU, where ``config.triton_kernels`` routes
      fused projections through :mod:`lmfs.kernels.fused` (see :func:`activation_bytes_per_layer`).
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
    layer = activation_bytes_per_layer(c, batch_size, seq_len, compute_bytes, triton_kernels)  # validates c
    head = tokens * (_norm_bytes(c) + a * c.d_model)                # final norm, head input
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
        "logits": 12 * c.vocab_size * tokens,
    }
    parts["total"] = sum(memory_at_peak(parts, grad_accum).values())
    return parts


def memory_at_peak(parts: dict[str, int], grad_accum: int = 1) -> dict[str, int]:
    """The items of :func:`training_memory` that are in memory together at the step's peak.

    Parameters and optimizer state are always there. Gradients are set to ``None`` between
    steps, so the peak is one of two moments: the start of the backward pass (bf16 weight copies,
    activations and the loss's logit buffers all alive, no gradient yet), or later in the backward
    pass (gradients growing while a recomputed block is alive; with checkpointing the stored
    block inputs of the earlier layers are still there too). With gradient accumulation, the
    gradients of the earlier micro-batches are held through the later forward passes.
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


# ---------------------------------------------------------------------------------------------
# Napkin math


def time_to_train(params: float, tokens: float, n_gpus: int, peak_flops: float, mfu: float) -> float:
    """Seconds to train a ``params``-parameter model on ``tokens`` tokens: ``6·N·D / (GPUs·peak·MFU)``.

    Llama-3-70B-like: 70e9 parameters, 15e12 tokens, 1024 H100s (989.5 TFLOP/s bf16) at 50 % MFU:
    ``6 · 70e9 · 15e12 = 6.3e24`` FLOPs at ``1024 · 989.5e12 · 0.5 = 5.07e17`` FLOP/s is
    ``1.24e7`` s, about 144 days.

    >>> round(time_to_train(70e9, 15e12, 1024, 989.5e12, 0.5) / 86400, 1)
    143.9
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction in (0, 1], got {mfu} (50 % is 0.5)")
    return 6 * params * tokens / (n_gpus * peak_flops * mfu)


def largest_trainable_model(n_gpus: int, gpu_memory_bytes: float, bytes_per_param: float = 16) -> int:
    """Most parameters whose training state fits in the GPUs' memory, activations ignored.

    16 bytes per parameter is mixed-precision AdamW: bf16 weights (2) and gradients (2), fp32
    master weights (4) and two fp32 Adam moments (8); fp32 weights and gradients with two moments
    also make 16. On 8 H100s of 80 GB: ``8 · 80e9 / 16 = 40e9`` parameters, with the state sharded
    across them (ZeRO-3 / FSDP); one GPU alone holds 5e9.

    >>> largest_trainable_model(8, 80e9) / 1e9
    40.0
    """
    return math.floor(n_gpus * gpu_memory_bytes / bytes_per_param)
