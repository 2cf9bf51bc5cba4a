"""Causal self-attention and its modern variants.

One module, :class:`CausalSelfAttention`, covers:

* **MHA / GQA / MQA** through ``n_kv_heads``: ``n_heads`` query heads share ``n_kv_heads`` key and
  value heads (``n_kv_heads == n_heads`` is MHA, ``1`` is MQA). Fewer K/V heads shrink the KV cache
  at inference for a small quality cost (Ainslie et al., 2023).
* **QK-norm**: RMSNorm on each query and key head before the dot product, which bounds the logits
  and stabilises training at high learning rates (OLMo 2, Gemma 3).
* **Soft-capping**: ``cap·tanh(logits/cap)`` squashes attention logits smoothly into
  ``(-cap, cap)`` (Gemma 2).
* **Sliding window**: token ``t`` sees only the ``window`` tokens ``t - window + 1 .. t``
  (itself included) (Mistral, Gemma 2 local layers).
* **MLA** (multi-head latent attention, DeepSeek-V2), see :class:`CausalSelfAttention`.

Two implementations of the same maths (``config.attn_impl``): :func:`attention_reference`
spells out ``softmax(QKᵀ/√d + mask)V``; ``"sdpa"`` calls ``F.scaled_dot_product_attention``
(fused kernels, FlashAttention on GPUs). SDPA has no soft-cap, so soft-capping always takes the
reference path. Heads are split and merged with einops (``rearrange``, ``repeat``), whose
patterns name every axis: ``"b t (h d) -> b h t d"``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from lmfs.nn.config import TransformerConfig, layer_config
from lmfs.nn.layers import Linear, RMSNorm, make_norm
from lmfs.nn.positions import RotaryEmbedding


def causal_mask(T: int, window: int | None = None, device=None, dtype=torch.float32) -> torch.Tensor:
    """Additive ``(T, T)`` mask: 0 where query ``i`` may attend to key ``j``, ``-inf`` elsewhere.

    Allowed means ``j <= i`` (no peeking at the future) and, with a ``window``, ``i - j < window``.
    """
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return torch.zeros(T, T, device=device, dtype=dtype).masked_fill(~allowed, float("-inf"))


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """``softmax(QKᵀ/√d + mask)V``, written out.

    ``q`` is ``(B, H, T, d)``, ``k`` and ``v`` are ``(B, H, S, d)``, ``mask`` is an additive
    ``(T, S)`` tensor (0 / ``-inf``, see :func:`causal_mask`); returns ``(B, H, T, d)``.
    With ``softcap`` the scaled logits pass through ``softcap·tanh(·/softcap)`` before the mask.
    The softmax runs in float32 so low-precision inputs do not lose the small probabilities.
    """
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v


class CausalSelfAttention(nn.Module):
    """Causal self-attention; ``forward(x, positions=None)`` maps ``(B, T, d_model)`` to
    ``(B, T, d_model)``.

    Built from a :class:`TransformerConfig`, or from its fields alone for a layer on its own:
    ``CausalSelfAttention(d_model=64, n_heads=4)`` (see :func:`lmfs.nn.config.layer_config`).
    ``positions`` (integer ``(T,)`` or ``(B, T)``) places the tokens for RoPE, e.g. a sequence
    that continues at an offset or documents packed into one row; by default token ``t`` is at
    position ``t``. Other position kinds are added to the embeddings, not here.

    Keys and values come from ``x`` directly (``config.attention == "mha"``, which with
    ``n_kv_heads`` also covers GQA and MQA), or through a latent (``"mla"``):

        c = norm(kv_down(x))          # (B, T, kv_latent_dim): the only thing an MLA KV cache stores
        k, v = k_proj(c), v_proj(c)   # up-projections to n_kv_heads · head_dim each

    ``norm`` is ``config.norm`` (DeepSeek-V2 uses RMSNorm). Left out, to keep MLA small: the
    *decoupled* RoPE. With ``positions="rope"`` we simply rotate the full up-projected keys and
    the queries. That trains fine, and lmfs generates without a KV cache anyway; what it gives
    up is folding ``k_proj`` into ``q_proj`` at inference (a position-dependent rotation between
    them blocks the fold), which is why DeepSeek adds a few separate RoPE-only key dims. Queries
    are not compressed either.
    """

    def __init__(self, config: TransformerConfig | None = None, **fields):
        super().__init__()
        config = layer_config(config, fields)
        d, hd = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.window, self.softcap, self.impl = config.window, config.attn_softcap, config.attn_impl
        self.mla = config.attention == "mla"

        self.q_proj = Linear(d, self.n_heads * hd, config.bias)
        kv_in = d
        if self.mla:
            self.kv_down = Linear(d, config.kv_latent_dim, config.bias)
            self.kv_norm = make_norm(config.norm, config.kv_latent_dim, config.norm_eps)
            kv_in = config.kv_latent_dim
        self.k_proj = Linear(kv_in, self.n_kv_heads * hd, config.bias)
        self.v_proj = Linear(kv_in, self.n_kv_heads * hd, config.bias)
        self.o_proj = Linear(self.n_heads * hd, d, config.bias)

        self.q_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.norm_eps) if config.qk_norm else None
        self.rope = (RotaryEmbedding(hd, config.rope_theta, config.context_length)
                     if config.positions == "rope" else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q_proj(x)
        kv_in = self.kv_norm(self.kv_down(x)) if self.mla else x
        k, v = self.k_proj(kv_in), self.v_proj(kv_in)
        return self.o_proj(self.heads(q, k, v, positions))

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Projected ``(B, T, H·d)`` queries, keys and values -> attended ``(B, T, H·d)``:
        split into heads, QK-norm, RoPE (at ``positions``), GQA sharing, attention, heads merged."""
        q = rearrange(q, "b t (h d) -> b h t d", h=self.n_heads)
        k = rearrange(k, "b t (h d) -> b h t d", h=self.n_kv_heads)
        v = rearrange(v, "b t (h d) -> b h t d", h=self.n_kv_heads)
        if self.q_norm is not None:  # normalise before rotating, as OLMo 2 and Gemma 3 do
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        return self.attend_heads(q, k, v)

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Heads ``(B, H, T, d)`` ready for attention -> attended ``(B, T, H·d)``, K/V heads shared."""
        # GQA: K/V head j serves the `groups` consecutive query heads j·groups .. (j+1)·groups - 1.
        groups = self.n_heads // self.n_kv_heads
        k = repeat(k, "b h t d -> b (h g) t d", g=groups)
        v = repeat(v, "b h t d -> b (h g) t d", g=groups)
        return rearrange(self.attend(q, k, v), "b h t d -> b t (h d)")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of ``(B, H, T, d)`` heads, by the path ``config.attn_impl`` picks."""
        T = q.shape[-2]
        if self.impl == "sdpa" and self.softcap is None:
            if self.window is None:  # is_causal lets the kernel skip masked blocks entirely
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            mask = causal_mask(T, self.window, q.device, q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask = causal_mask(T, self.window, q.device, q.dtype)
        return attention_reference(q, k, v, mask, self.softcap)
