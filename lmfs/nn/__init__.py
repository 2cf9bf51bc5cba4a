"""Transformer language models from their parameters up.

* :mod:`lmfs.nn.layers`: ``Linear``, ``Embedding``, ``RMSNorm``, ``LayerNorm``, feed-forwards.
* :mod:`lmfs.nn.positions`: RoPE, learned, sinusoidal and no positions.
* :mod:`lmfs.nn.attention`: causal self-attention (MHA/GQA/MQA, QK-norm, soft-cap, window, MLA).
* :mod:`lmfs.nn.config`: :class:`TransformerConfig` and the closed-form :func:`count_params`.
* :mod:`lmfs.nn.transformer`: :class:`Block` and :class:`TransformerLM`.
* :mod:`lmfs.nn.loss`: the output head and cross-entropy in chunks, without keeping the logits.
* :mod:`lmfs.nn.generate`: sampling with temperature, top-k and top-p.
* :mod:`lmfs.nn.hf`: conversion to and from Hugging Face Llama.
"""

from lmfs.nn.attention import CausalSelfAttention, attention_reference, causal_mask
from lmfs.nn.config import TransformerConfig, count_params
from lmfs.nn.generate import generate, top_k_filter, top_p_filter
from lmfs.nn.hf import from_hf_llama, to_hf_llama
from lmfs.nn.layers import (MLP, Embedding, GatedMLP, LayerNorm, Linear, RMSNorm, fused_linear, make_ffn,
                            make_norm)
from lmfs.nn.loss import linear_cross_entropy
from lmfs.nn.positions import (LearnedPositions, RotaryEmbedding, SinusoidalPositions, apply_rope,
                               rope_angles, sinusoidal_table)
from lmfs.nn.transformer import Block, TransformerLM

__all__ = [
    "Block", "CausalSelfAttention", "Embedding", "GatedMLP", "LayerNorm", "LearnedPositions",
    "Linear", "MLP", "RMSNorm", "RotaryEmbedding", "SinusoidalPositions", "TransformerConfig",
    "TransformerLM", "apply_rope", "attention_reference", "causal_mask", "count_params",
    "from_hf_llama", "fused_linear", "generate", "linear_cross_entropy", "make_ffn", "make_norm",
    "rope_angles", "sinusoidal_table", "to_hf_llama", "top_k_filter", "top_p_filter",
]
