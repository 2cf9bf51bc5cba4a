"""Counting before measuring: parameters, FLOPs, memory, MFU and napkin math for training.

Closed forms, each with its source; the hardware figures they are used with come from
:mod:`lmfs.hardware`, and the exact byte-for-byte memory model of lmfs's own training step from
:mod:`lmfs.bench.memory`.

>>> from lmfs.nn import TransformerConfig
>>> cfg = TransformerConfig(vocab_size=32000, context_length=1024, d_model=768, n_layers=12,
...                         n_heads=12, tie_embeddings=False)
>>> param_count(cfg)
134105856
>>> round(flops_per_token(cfg, 1024) / 1e9, 3)            # forward GFLOPs per token
0.257
>>> from lmfs.hardware import gpu
>>> round(time_to_train(70e9, 15e12, 1024, gpu("H100").peak("bf16"), 0.5) / 86400)  # days
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

from lmfs.nn.config import TransformerConfig, count_params, moe_params
from lmfs.nn.layers import GATED_FFNS

def param_count(config: TransformerConfig, active: bool = False) -> int:
    """Trainable parameters of ``TransformerLM(config)``; the same as :func:`lmfs.nn.count_params`.

    ``active``: of a mixture-of-experts model, only those one token uses (``moe_top_k`` routed
    experts, the shared ones and the router); an MoE model's total grows with the number of
    experts while its active count, and so its FLOPs per token, stays put.
    """
    return count_params(config, active)


def matmul_params(config: TransformerConfig) -> int:
    """Entries of all the weight matrices one token is multiplied by in a forward pass.

    The projections of every block (attention and feed-forward) plus the output head
    (``vocab_size × d_model``, counted even when tied to the embedding: the lookup is free, the
    head matmul is not). Biases, norms and position tables are excluded: they are not matmuls.
    An MoE feed-forward counts what one token meets: the router and its ``moe_top_k`` routed
    experts plus the shared ones (the *active* parameters; dropped tokens are not discounted).
    """
    c = config
    kv_in = c.kv_latent_dim if c.attention == "mla" else c.d_model
    attn = c.d_model * c.n_heads * c.head_dim                 # q_proj
    attn += 2 * kv_in * c.kv_heads * c.head_dim               # k_proj, v_proj
    attn += c.n_heads * c.head_dim * c.d_model                # o_proj
    attn += c.d_model * kv_in if c.attention == "mla" else 0  # kv_down
    dense_ffn = (3 if c.ffn in GATED_FFNS else 2) * c.d_model * c.ffn_dim
    ffns = sum(moe_params(c, active=True) if c.is_moe_layer(i) else dense_ffn for i in range(c.n_layers))
    return c.n_layers * attn + ffns + c.vocab_size * c.d_model


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

    ``peak_flops`` in FLOP/s, e.g. ``lmfs.hardware.gpu("H100").peak("bf16")`` or a measured matmul rate.
    """
    return training_flops(config, tokens_per_second, seq_len) / peak_flops


# ---------------------------------------------------------------------------------------------
# Memory: the textbook closed form. The model that matches lmfs's implementation tensor by tensor
# is lmfs.bench.memory.activation_bytes_per_layer (with training_memory, the whole step).

RECOMPUTE = ("none", "selective", "full")


def activation_memory_per_layer(batch_size: int, seq_len: int, d_model: int, n_heads: int, *,
                                recompute: str = "none", flash_attention: bool = False) -> int:
    """Bytes one transformer layer keeps for its backward pass, by the closed form of Korthikanti
    et al. (2022), "Reducing Activation Recomputation in Large Transformer Models", section 4:

        ``s·b·h·(34 + 5·a·s/h)``   with ``s = seq_len``, ``b = batch_size``, ``h = d_model``, ``a = n_heads``.

    Assumptions (theirs): a GPT-style block (LayerNorm, attention, a ``4h`` GeLU MLP, dropout after
    attention's softmax and after each residual branch), every activation stored in 16 bits
    (2 bytes), dropout masks in 1 byte, no tensor or sequence parallelism. Per token and ``h``:

    =====================================================  ==========================
    saved tensor                                           bytes
    =====================================================  ==========================
    2 LayerNorm inputs                                     2·2 = 4
    attention: q/k/v input; q, k; v; o_proj input;          2 + 4 + 2 + 2 + 1 = 11
    its dropout mask
    MLP: up input; GeLU input (4h); down input (4h);        2 + 8 + 8 + 1 = 19
    its dropout mask
    attention core, per query and key of each head:         2 + 1 + 2 = 5 (× a·s/h)
    softmax output, dropout mask, dropout output
    =====================================================  ==========================

    ``recompute``: ``"none"``; ``"selective"`` recomputes only the attention core in the backward
    pass (the ``5·a·s/h`` term, quadratic in ``s``), leaving ``34·s·b·h``; ``"full"`` keeps only each
    layer's 16-bit input, ``2·s·b·h``, and recomputes the rest. ``flash_attention``: the kernel never
    stores the ``s × s`` scores (it keeps one fp32 log-sum-exp per row and head, ``4·a·s·b`` bytes,
    which the closed form leaves out as small), so the quadratic term goes as with selective
    recomputation.

    >>> activation_memory_per_layer(1, 2048, 12288, 96) / (2048 * 12288)    # GPT-3 175B: 34 + 80
    114.0
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a = seq_len, batch_size, d_model, n_heads
    if recompute == "full":
        return 2 * s * b * h
    core = 0 if recompute == "selective" or flash_attention else 5 * a * s * s * b
    return 34 * s * b * h + core


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
