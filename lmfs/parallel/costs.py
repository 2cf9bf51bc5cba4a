"""Napkin math for every parallelism strategy: memory per GPU and bytes each GPU sends per step.

Each strategy is priced on its own, at degree ``n`` (real runs combine them; the costs then
compose: divide by each degree, add each traffic on its own group). The setting:

* a global batch of ``batch_size`` sequences of ``seq_len`` tokens per optimizer step;
* mixed-precision AdamW: ``param_bytes = 2`` (bf16 weights), ``grad_bytes = 2`` (bf16 gradients,
  reduced in bf16), ``optimizer_bytes = 12`` (fp32 master weights and two fp32 moments);
* activations of the transformer blocks as :func:`lmfs.bench.memory.activation_bytes_per_layer`
  counts them (bf16 autocast, no recomputation); the logits and the batch are left out;
* communication by the bandwidth-optimal algorithms of :mod:`lmfs.parallel.comm` (a ring
  all-reduce sends ``2(n-1)/n`` of the tensor per GPU).

================  ============================================  ========================================
strategy          memory per GPU                                bytes sent per GPU per step
================  ============================================  ========================================
ddp               all of P, G, O; activations of B/n            all-reduce G: 2(n-1)/n·G
zero1             O/n                                           reduce-scatter G + all-gather P
zero2             G/n, O/n                                      same as zero1
zero3 (FSDP)      P/n, G/n, O/n (+ one layer's P gathered)      2 all-gathers of P + reduce-scatter G
tp                P, G, O /n; activations /n except the norms   4 all-reduces of B·T·d per layer
tp+sp             + the norms' activations /n too               same bytes (reduce-scatter + all-gather)
pp (1F1B)         P, G, O /n; min(n, m) micro-batches of        activations forward and gradients back,
                  L/n layers' activations                       B·T·d each, at n-1 boundaries
ep                experts /n (MoE only); activations of B/n     4 all-to-alls of the routed tokens per
                                                                MoE layer + all-reduce of the rest
cp (ring)         all of P, G, O; activations of T/n            K/V blocks round the ring: 3(n-1)·2·B·
                                                                (T/n)·d_kv per layer + all-reduce G
================  ============================================  ========================================

(``P``, ``G``, ``O``: parameter, gradient and optimizer bytes; ``L`` layers, ``d`` = d_model,
``d_kv`` = kv_heads·head_dim, ``m`` micro-batches.) ZeRO-1 is priced with the reduce-scatter it
needs; :class:`lmfs.parallel.zero.ZeroOptimizer` at stage 1 all-reduces, ``(n-1)/n·G`` more.
The model and the batch are the same in every row: the strategies differ in what each GPU
holds, in what the network carries, and in which network can carry it (TP's traffic is
hundreds of times PP's, which is why TP stays inside an NVLink domain).
"""

from __future__ import annotations

from lmfs.bench.memory import activation_bytes_per_layer, norm_bytes
from lmfs.nn import TransformerConfig, count_params
from lmfs.nn.layers import ffn_params

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "tp", "tp+sp", "pp", "ep", "cp")


def llama_70b() -> TransformerConfig:
    """Llama-3-70B's shape: 80 layers of width 8192, 64 query and 8 K/V heads, SwiGLU 28672."""
    return TransformerConfig(vocab_size=128256, context_length=8192, d_model=8192, n_layers=80,
                             n_heads=64, n_kv_heads=8, d_ff=28672, rope_theta=500000.0,
                             tie_embeddings=False)


def strategy_costs(config: TransformerConfig, strategy: str, n: int, batch_size: int, seq_len: int,
                   micro_batches: int = 8, n_experts: int | None = None, top_k: int = 1,
                   param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12,
                   activation_bytes: int = 2) -> dict:
    """Bytes per GPU for ``strategy`` at degree ``n`` (see the module docstring for the model).

    With ``n_experts`` the feed-forward of every layer becomes ``n_experts`` experts of the
    same width (``top_k`` per token), so the parameter count grows and ``"ep"`` applies;
    without it ``"ep"`` has nothing to split and raises.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {STRATEGIES}")
    c, B, T, L = config, batch_size, seq_len, config.n_layers
    a, d, d_kv = activation_bytes, c.d_model, c.kv_heads * c.head_dim
    expert = ffn_params(c.ffn, d, c.ffn_dim, c.bias)
    E = n_experts or 1
    N = count_params(c) + L * expert * (E - 1)
    experts_total = L * expert * E
    ring = (n - 1) / n

    def act(batch, tokens):  # all blocks' activations for `batch` sequences of `tokens` tokens
        return L * activation_bytes_per_layer(c, batch, tokens, activation_bytes)

    P, G, O = N * param_bytes, N * grad_bytes, N * optimizer_bytes
    if strategy in ("ddp", "zero1", "zero2", "zero3", "ep"):
        if B % n:
            raise ValueError(f"{strategy} splits the batch: batch_size={B} must be a multiple of n={n}")
    if strategy == "ddp":
        mem = (P, G, O, act(B // n, T))
        sent, pattern = 2 * ring * G, "all-reduce gradients"
    elif strategy == "zero1":
        mem = (P, G, O / n, act(B // n, T))
        sent, pattern = ring * (G + P), "reduce-scatter gradients, all-gather parameters"
    elif strategy == "zero2":
        mem = (P, G / n, O / n, act(B // n, T))
        sent, pattern = ring * (G + P), "reduce-scatter gradients, all-gather parameters"
    elif strategy == "zero3":
        layer = (N - c.vocab_size * d * (1 if c.tie_embeddings else 2)) / L
        mem = (P / n + layer * param_bytes, G / n, O / n, act(B // n, T))
        sent = ring * (2 * P + G)
        pattern = "all-gather parameters (forward, backward), reduce-scatter gradients"
    elif strategy in ("tp", "tp+sp"):
        whole = act(B, T)
        norms = L * 2 * norm_bytes(c) * B * T  # the two norms' tensors, per layer
        activations = whole / n if strategy == "tp+sp" else (whole - norms) / n + norms
        mem = (P / n, G / n, O / n, activations)
        sent = L * 4 * 2 * ring * B * T * d * a
        pattern = ("all-reduce activations (2 forward, 2 backward per layer)" if strategy == "tp"
                   else "all-gather + reduce-scatter activations along the sequence")
    elif strategy == "pp":
        if B % micro_batches:
            raise ValueError(f"batch_size={B} must split into micro_batches={micro_batches}")
        in_flight = min(n, micro_batches)
        mem = (P / n, G / n, O / n, act(B // micro_batches, T) / n * in_flight)
        sent = 2 * ring * B * T * d * a
        pattern = f"send/recv activations and their gradients ({micro_batches} micro-batches)"
    elif strategy == "ep":
        if n_experts is None or n_experts % n:
            raise ValueError("ep needs an MoE: pass n_experts, a multiple of n")
        dense = N - experts_total
        mem = (dense * param_bytes + experts_total * param_bytes / n,
               dense * grad_bytes + experts_total * grad_bytes / n,
               dense * optimizer_bytes + experts_total * optimizer_bytes / n, act(B // n, T))
        routed = B // n * T * top_k * d * a
        sent = L * 4 * ring * routed + 2 * ring * dense * grad_bytes
        pattern = "all-to-all tokens (dispatch, combine; both again in backward), all-reduce dense grads"
    else:  # cp
        if T % n:
            raise ValueError(f"cp splits the sequence: seq_len={T} must be a multiple of n={n}")
        mem = (P, G, O, act(B, T // n))
        kv_block = 2 * B * (T // n) * d_kv * a
        sent = L * 3 * (n - 1) * kv_block + 2 * ring * G
        pattern = "K/V blocks round the ring (forward; K/V and dK/dV in backward), all-reduce grads"
    params, grads, optimizer, activations = mem
    return {"strategy": strategy, "n": n, "params_GB": params / 1e9, "grads_GB": grads / 1e9,
            "optimizer_GB": optimizer / 1e9, "activations_GB": activations / 1e9,
            "total_GB": (params + grads + optimizer + activations) / 1e9,
            "sent_GB_per_step": sent / 1e9, "communication": pattern}


def cost_table(config: TransformerConfig | None = None, n: int = 8, batch_size: int = 8,
               seq_len: int = 4096, micro_batches: int = 8, n_experts: int | None = None, **kwargs):
    """A pandas table of :func:`strategy_costs` for every strategy (default: Llama-3-70B on 8 GPUs).

    ``"ep"`` is left out for a dense model.
    """
    import pandas as pd

    config = config or llama_70b()
    rows = [strategy_costs(config, s, n, batch_size, seq_len, micro_batches, n_experts, **kwargs)
            for s in STRATEGIES if s != "ep" or n_experts is not None]
    table = pd.DataFrame(rows).set_index("strategy")
    return table.round({k: 1 for k in table.columns if k.endswith("_GB") or k.endswith("_step")})
