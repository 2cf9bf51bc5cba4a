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

Two implementations of the same maths: :func:`attention_reference` spells out
``softmax(QKᵀ/√d + mask)V``; the fast path calls ``F.scaled_dot_product_attention`` (fused
kernels, FlashAttention on GPUs). The fast path has no soft-cap, so soft-capping always takes the
reference path. On CUDA, ``config.sdpa_backend`` may ask SDPA to try one of its kernels first
(:func:`sdpa_preference`).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmfs.nn.layers import Linear, RMSNorm, fused_linear, kernels_apply, make_norm, project
from lmfs.nn.positions import RotaryEmbedding

if TYPE_CHECKING:
    from lmfs.nn.config import TransformerConfig

# SDPA's kernels on CUDA, in the order torch tries them on Hopper/Blackwell with a recent cuDNN.
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def prefer_sdpa_backend(backend: str):
    """A context in which SDPA tries ``backend`` (a key of :data:`SDPA_BACKENDS`) first.

    Every backend stays enabled, in the order above after the preferred one, so a call the
    preferred kernel cannot serve (a head dimension it lacks, a GPU without it) falls back
    silently instead of failing. ``torch.compile`` traces the context and bakes the chosen
    kernel, forward and backward, into the graph.
    """
    first = SDPA_BACKENDS[backend]
    return sdpa_kernel([first] + [b for b in SDPA_BACKENDS.values() if b != first], set_priority=True)


def sdpa_preference(backend: str, device: torch.device):
    """:func:`prefer_sdpa_backend` on CUDA; nothing (SDPA's own choice) for ``"auto"`` or elsewhere."""
    if backend == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    return prefer_sdpa_backend(backend)


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
    """Causal self-attention; ``forward(x)`` maps ``(B, T, d_model)`` to ``(B, T, d_model)``.

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

    def __init__(self, config: TransformerConfig):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.window, self.softcap, self.impl = config.window, config.attn_softcap, config.attn_impl
        self.mla = config.attention == "mla"
        self.fused, self.sdpa_backend = config.fused_projections, config.sdpa_backend
        self.kernels = config.triton_kernels

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Projections that read the same input run as one matmul under autocast (layers.project).
        # On a GPU a Triton kernel then splits the heads and rotates q and k in one pass, and its
        # backward writes the three gradients into the fused matmul's (lmfs.kernels.fused).
        if (self.fused and not self.mla and self.rope is not None and self.q_norm is None
                and kernels_apply(x, self.q_proj.weight, self.kernels)):
            from lmfs.kernels.fused import rope_qkv  # imported on a GPU only: it loads Triton

            qkv = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), split=False)
            q, k, v = rope_qkv(qkv, *self.rope.tables(x.shape[1], x.device), self.n_heads, self.n_kv_heads)
            return self.o_proj(self.attend_heads(q, k, v))
        if self.mla:
            q, latent = project(x, (self.q_proj, self.kv_down), self.fused)
            k, v = project(self.kv_norm(latent), (self.k_proj, self.v_proj), self.fused)
        else:
            q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), self.fused)
        return self.o_proj(self.heads(q, k, v))

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Projected ``(B, T, H·d)`` queries, keys and values -> attended ``(B, T, H·d)``:
        split into heads, QK-norm, RoPE, GQA sharing, attention, heads merged again."""
        q = rearrange(q, "b t (h d) -> b h t d", h=self.n_heads)
        k = rearrange(k, "b t (h d) -> b h t d", h=self.n_kv_heads)
        v = rearrange(v, "b t (h d) -> b h t d", h=self.n_kv_heads)
        if self.q_norm is not None:  # normalise before rotating, as OLMo 2 and Gemma 3 do
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
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
            # getattr: TensorParallelAttention shares this method and may not carry the setting.
            with sdpa_preference(getattr(self, "sdpa_backend", "auto"), q.device):
                if self.window is None:  # is_causal lets the kernel skip masked blocks entirely
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                mask = causal_mask(T, self.window, q.device, q.dtype)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        mask = causal_mask(T, self.window, q.device, q.dtype)
        return attention_reference(q, k, v, mask, self.softcap)
