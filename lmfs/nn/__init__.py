"""Transformer language models from their parameters up: the model as the lectures teach it.

* :mod:`lmfs.nn.functional`: ``softmax``, ``cross_entropy``, ``silu`` written out.
* :mod:`lmfs.nn.layers`: ``Linear``, ``Embedding``, ``RMSNorm``, ``LayerNorm``, feed-forwards.
* :mod:`lmfs.nn.positions`: RoPE, learned, sinusoidal and no positions.
* :mod:`lmfs.nn.attention`: causal self-attention (MHA/GQA/MQA, QK-norm, soft-cap, window, MLA),
  by SDPA or written out.
* :mod:`lmfs.nn.config`: :class:`TransformerConfig` and the closed-form :func:`count_params`.
* :mod:`lmfs.nn.moe`: mixture of experts: routers, stacked experts, balancing losses,
  capacity, loop and sorted dispatch, upcycling.
* :mod:`lmfs.nn.transformer`: :class:`Block` and :class:`TransformerLM`.
* :mod:`lmfs.nn.generate`: sampling with temperature, top-k and top-p.
* :mod:`lmfs.nn.hf`: conversion to and from Hugging Face Llama.

Every module computes in plain PyTorch, one path per choice. Making a built model faster
without changing what it computes (fused projections, Triton kernels, a loss that never keeps
the logits) is an opt-in applied from outside: :func:`lmfs.kernels.fused.fuse_model`.
"""

from lmfs.nn.attention import CausalSelfAttention, attention_reference, causal_mask
from lmfs.nn.config import TransformerConfig, count_params
from lmfs.nn.functional import cross_entropy, silu, softmax
from lmfs.nn.generate import generate, top_k_filter, top_p_filter
from lmfs.nn.hf import from_hf_llama, to_hf_llama
from lmfs.nn.layers import MLP, Embedding, GatedMLP, LayerNorm, Linear, RMSNorm, make_ffn, make_norm
from lmfs.nn.moe import Experts, MoE, Router, upcycle
from lmfs.nn.positions import (LearnedPositions, RotaryEmbedding, SinusoidalPositions, apply_rope,
                               rope_angles, sinusoidal_table)
from lmfs.nn.transformer import Block, TransformerLM

__all__ = [
    "Block", "CausalSelfAttention", "Embedding", "Experts", "GatedMLP", "LayerNorm", "LearnedPositions",
    "Linear", "MLP", "MoE", "RMSNorm", "Router", "RotaryEmbedding", "SinusoidalPositions", "TransformerConfig",
    "TransformerLM", "apply_rope", "attention_reference", "causal_mask", "count_params",
    "cross_entropy", "from_hf_llama", "generate", "make_ffn", "make_norm", "rope_angles", "silu",
    "sinusoidal_table", "softmax", "to_hf_llama", "top_k_filter", "top_p_filter", "upcycle",
]
