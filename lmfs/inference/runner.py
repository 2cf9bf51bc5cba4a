"""Forward passes of a :class:`~lmfs.nn.TransformerLM` that read and fill a KV cache.

:meth:`TransformerLM.forward` recomputes the keys and values of the whole context at every step.
These functions compute them once per token and keep them: each new token's query attends to the
cached keys. They reuse the model's own modules (``block.attn.q_proj``, ``block.residual``,
``block.feed_forward``, ``model.head`` ...), never copy a weight, and follow the same order of
operations, so every architectural choice of :class:`~lmfs.nn.TransformerConfig` (GQA/MQA, MLA,
every position kind, QK-norm, soft-caps, sliding window, norm positions, parallel blocks, MoE)
behaves exactly as in the uncached forward.

* :func:`forward_cached`: the contiguous :class:`~lmfs.inference.KVCache`; ``T`` new tokens per
  row, all rows at the same length (optionally left-padded).
* :func:`paged_forward`: the paged :class:`~lmfs.inference.PagedKVCache`, for the engine. A
  :class:`PagedBatch` describes which new tokens go where: several prompts (or prompt suffixes
  after a shared prefix) packed into one row for prefill, or one token per sequence for decode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from einops import rearrange

from lmfs.batching import PagedBatch, gathered_attention, gathered_batch, masked_attention, upload
from lmfs.inference.kv_cache import paged_attention_reference
from lmfs.inference.sampling import sample
from lmfs.nn.positions import apply_rope, rope_angles


# ---------------------------------------------------------------------------------------------
# Pieces of the model's forward, taken apart at the point where the cache comes in

def _embed(model, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token (+ absolute position) embeddings of ``idx`` ``(B, T)`` at ``positions`` ``(T,)``/``(B, T)``."""
    x = model.tok_emb(idx)
    if model.pos_emb is not None:
        x = x + model.pos_emb(positions)
    return x


def _run_blocks(model, x: torch.Tensor, idx: torch.Tensor,
                attend: Callable[[int, torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Every block of ``model`` on ``x`` ``(B, T, d)``, with ``attend(layer, attn, h)`` in place of
    ``attn(h)``; then the final norm. Mirrors :meth:`lmfs.nn.Block.forward`, through the block's own
    ``residual`` and ``feed_forward`` (so norm positions, parallel blocks and MoE come for free)."""
    for layer, block in enumerate(model.blocks):
        def attn_branch(h, layer=layer, block=block):
            return attend(layer, block.attn, h)
        if block.parallel:
            x = block.residual(x, lambda h: attn_branch(h) + block.feed_forward(h, idx), 0)
        else:
            x = block.residual(x, attn_branch, 0)
            x = block.residual(x, lambda h: block.feed_forward(h, idx), 1)
    return model.final_norm(x) if model.final_norm is not None else x


def _rotate(attn, x: torch.Tensor, positions: torch.Tensor, tables: dict) -> torch.Tensor:
    """``attn.rope(x, positions)`` (``x`` unchanged without RoPE), with the cos/sin tables of
    ``positions`` kept in ``tables`` for the rest of the forward: every layer's queries and keys at
    the same positions share one computation of the angles (about 14 small kernels a layer fewer
    in a decode step) instead of recomputing them twice per layer."""
    rope = attn.rope
    if rope is None:
        return x
    key = (rope.head_dim, rope.theta)
    if key not in tables:
        cos, sin = rope_angles(positions, rope.head_dim, rope.theta)
        tables[key] = (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos, sin)  # (B, T, hd): per row
    return apply_rope(x, *tables[key])


def _queries(attn, x: torch.Tensor, positions: torch.Tensor, tables: dict) -> torch.Tensor:
    """``(B, T, d)`` -> query heads ``(B, H, T, hd)``, QK-normed and rotated like the model does
    (``tables``: :func:`_rotate`'s cache for ``positions``)."""
    q = rearrange(attn.q_proj(x), "b t (h d) -> b h t d", h=attn.n_heads)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    return _rotate(attn, q, positions, tables)


def _kv_input(attn, x: torch.Tensor) -> torch.Tensor:
    """What keys and values are projected from: ``x`` itself, or MLA's normed latent ``c``."""
    return attn.kv_norm(attn.kv_down(x)) if attn.mla else x


def _keys_values(attn, kv_in: torch.Tensor, positions: torch.Tensor,
                 tables: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, S, d_in)`` -> key and value heads ``(B, KV, S, hd)``, keys normed and rotated
    (``tables``: :func:`_rotate`'s cache for ``positions``)."""
    k = rearrange(attn.k_proj(kv_in), "b s (h d) -> b h s d", h=attn.n_kv_heads)
    v = rearrange(attn.v_proj(kv_in), "b s (h d) -> b h s d", h=attn.n_kv_heads)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return _rotate(attn, k, positions, tables), v


# ---------------------------------------------------------------------------------------------
# Contiguous cache

@torch.no_grad()
def forward_cached(model, idx: torch.Tensor, cache) -> torch.Tensor:
    """Run ``model`` on ``idx`` ``(B, T)``, the tokens at positions ``cache.length .. cache.length+T-1``;
    return their logits ``(B, T, V)`` and advance ``cache.length`` by ``T``.

    The new tokens' keys and values (MLA: latents) are written into ``cache`` and their queries
    attend to everything cached before them and to each other, causally (and within the sliding
    window, if any). A prompt is one call; each generated token is one more call with ``T = 1``.
    With ``cache.pad`` (left padding), row ``b``'s first ``pad[b]`` slots are never attended to and
    its positions start after them.
    """
    B, T = idx.shape
    P, S = cache.length, cache.length + T
    if B != cache.batch_size:
        raise ValueError(f"idx has {B} rows but the cache was made for batch_size={cache.batch_size}")
    if S > cache.max_len:
        raise ValueError(f"{P} cached + {T} new tokens exceed the cache's max_len={cache.max_len}: "
                         "make a longer cache (max_len <= context_length)")
    dev = idx.device
    i = torch.arange(P, S, device=dev)              # absolute slots of the new tokens (T,)
    j = torch.arange(S, device=dev)                 # slots of every key (S,)
    allowed = j[None, :] <= i[:, None]              # (T, S)
    if model.config.window is not None:
        allowed &= (i[:, None] - j[None, :]) < model.config.window
    if cache.pad is None:
        positions, key_positions = i, j
    else:
        pad = cache.pad[:, None]
        positions, key_positions = (i[None] - pad).clamp(min=0), (j[None] - pad).clamp(min=0)
        # Padding slots are never keys; a padding query sees only itself so its row stays finite.
        real_key = j[None, None, :] >= pad[:, :, None]                         # (B, 1, S)
        allowed = (allowed[None] & real_key) | (j[None, :] == i[:, None])[None]
        allowed = allowed[:, None]                                             # (B, 1, T, S)

    tables, key_tables = {}, {}   # RoPE tables of the new tokens' positions and of every key's (MLA)
    masks = {}                    # the additive attention mask, built once for every layer

    def attend(layer: int, attn, h: torch.Tensor) -> torch.Tensor:
        q = _queries(attn, h, positions, tables)
        kv_in = _kv_input(attn, h)
        if cache.mla:
            cache.latent[layer][:, P:S] = kv_in
            k, v = _keys_values(attn, cache.latent[layer][:, :S].to(h.dtype), key_positions, key_tables)
        else:
            k, v = _keys_values(attn, kv_in, positions, tables)
            cache.k[layer][:, :, P:S] = k
            cache.v[layer][:, :, P:S] = v
            k, v = cache.k[layer][:, :, :S].to(h.dtype), cache.v[layer][:, :, :S].to(h.dtype)
        return attn.o_proj(masked_attention(attn, q, k, v, allowed, masks))

    x = _run_blocks(model, _embed(model, idx, positions), idx, attend)
    cache.length = S
    return model.head(x)


# ---------------------------------------------------------------------------------------------
# Paged cache

DecodeAttention = Callable[..., torch.Tensor]


@torch.no_grad()
def paged_forward(model, cache, batch: PagedBatch, decode_attention: DecodeAttention | None = None) -> torch.Tensor:
    """Run ``model`` on the new tokens of ``batch``, writing their keys and values (MLA: latents)
    into ``cache``; return the logits ``(R, V)`` of ``batch.logit_rows`` (all ``N`` tokens if None).

    Decode batches use ``decode_attention(q, k_cache, v_cache, block_tables, seq_lens, **kw)``
    (:func:`~lmfs.inference.paged_attention_reference` by default, or the Triton kernel; ``kw``
    holds ``window``/``softcap`` only when the model uses them). MLA caches latents, which the
    decode functions cannot read: its decode batches must come gathered (:func:`gathered_batch`).
    Only tensor operations run here, no host sync, so a decode call can be captured in a CUDA graph.
    """
    decode_attention = decode_attention or paged_attention_reference
    cfg = model.config
    extra = {k: v for k, v in (("window", cfg.window), ("softcap", cfg.attn_softcap)) if v is not None}
    if batch.decode and cache.mla:
        raise ValueError("an MLA cache holds latents: build its decode batches with gathered_batch")
    idx = batch.tokens[None]                                  # (1, N): one packed row
    positions = batch.positions

    tables, key_tables = {}, {}   # RoPE tables of the new tokens' positions and of every key's (MLA)
    masks = {}                    # the additive attention mask, built once for every layer

    def attend(layer: int, attn, h: torch.Tensor) -> torch.Tensor:
        q = _queries(attn, h, positions, tables)              # (1, H, N, hd)
        kv_in = _kv_input(attn, h)
        k_flat = cache.k[layer].flatten(0, 1)                 # (num_blocks·block_size, KV, hd): a view
        if cache.mla:
            k_flat.index_copy_(0, batch.slots, kv_in[0, :, None].to(k_flat.dtype))
            latent = k_flat[batch.key_slots][None, :, 0].to(h.dtype)          # (1, M, L)
            k, v = _keys_values(attn, latent, batch.key_positions, key_tables)
            return attn.o_proj(masked_attention(attn, q, k, v, batch.allowed, masks))
        k, v = _keys_values(attn, kv_in, positions, tables)   # (1, KV, N, hd)
        v_flat = cache.v[layer].flatten(0, 1)
        k_flat.index_copy_(0, batch.slots, k[0].transpose(0, 1).to(k_flat.dtype))
        v_flat.index_copy_(0, batch.slots, v[0].transpose(0, 1).to(v_flat.dtype))
        if batch.decode:
            out = decode_attention(q[0].transpose(0, 1).contiguous(), cache.k[layer], cache.v[layer],
                                   batch.block_tables, batch.seq_lens, **extra)   # (N, H, hd)
            return attn.o_proj(out.to(h.dtype).reshape(1, out.shape[0], -1))
        out = gathered_attention(attn, q[0].transpose(0, 1), cache.k[layer], cache.v[layer], batch, masks)
        return attn.o_proj(out[None])

    x = _run_blocks(model, _embed(model, idx, positions), idx, attend)
    if batch.logit_rows is not None:
        x = x[:, batch.logit_rows]
    return model.head(x)[0]


# ---------------------------------------------------------------------------------------------
# The model runner: a scheduled batch in, its sampled tokens out

def pack(next_ids: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Sampled ids and their log-probs ``(B,)`` as one ``(2, B)`` float64 tensor, so that the host
    reads both in one copy (float64 holds every token id exactly)."""
    return torch.stack([next_ids.double(), logprobs.double()])


def no_hook(kind: str, real_rows: int, computed_rows: int):
    """The forward hook that does nothing (:attr:`lmfs.inference.LLM.forward_hook` is None)."""
    return contextlib.nullcontext()


class ModelRunner:
    """What :class:`~lmfs.inference.LLM` runs each scheduled step with by default: the step's
    forward (:func:`paged_forward`: a prefill packs the new prompt tokens into one row, on the
    gathered attention path; a decode step feeds each request its last token, and attention reads
    the paged cache through the block tables) and the draw of one token per request
    (:func:`~lmfs.inference.sample`), read back to the host at once.

    The engine calls :meth:`bind` once (the model, its cache, the batch rows, the autocast dtype),
    :meth:`begin` at the start of each generation, :meth:`step` for each
    :class:`~lmfs.inference.ScheduledBatch`, and :meth:`end` when it stops. A runner that launches
    steps ahead (:class:`lmfs.fast.FastRunner`) implements the same four methods."""

    def __init__(self):
        self.model = self.cache = self.autocast = None
        self.block_size = self.max_blocks = 0
        self.stats: dict = {}

    def bind(self, model, cache, max_batch_size: int, autocast: torch.dtype | None) -> None:
        """Run ``model`` over ``cache`` (a :class:`~lmfs.inference.PagedKVCache`), at most
        ``max_batch_size`` requests a step, its forwards under ``autocast`` (None: off)."""
        self.model, self.cache, self.autocast = model, cache, autocast
        self.block_size = cache.block_size
        self.max_blocks = -(-model.config.context_length // cache.block_size)

    def begin(self, stats: dict) -> None:
        """A generation starts; its statistics go to ``stats``."""
        self.stats = stats

    def end(self, stats: dict) -> None:
        """The generation ended (or was abandoned): nothing of it is left in flight."""

    def autocast_context(self):
        """The context every forward runs in: autocast to ``self.autocast`` (its cast cache off, so that
        each forward casts the weights as they are now), or none."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.cache.device.type, dtype=self.autocast, cache_enabled=False)

    def step(self, batch, hook=None) -> list[tuple[list, list, list, bool]]:
        """Run ``batch``; returns the tokens handed back: ``(requests, ids, logprobs, prefill)`` per step
        read (here the step itself, or nothing for an empty batch). ``hook(kind, real_rows,
        computed_rows)``: a context entered around each forward (None: none)."""
        reqs = batch.requests
        if not reqs:
            return []
        hook = hook or no_hook
        if batch.prefill:
            pb = gathered_batch([(r.tokens[r.cached:], r.cached, r.blocks) for r in reqs], self.block_size,
                                self.model.config.window, self.cache.device)
            kind = "prefill"
        else:
            pb = self.decode_batch(reqs)
            kind = "decode"
        n = pb.tokens.numel()
        with hook(kind, n, n), self.autocast_context():
            logits = paged_forward(self.model, self.cache, pb)
        ids, lps = pack(*self.sample(reqs, logits)).tolist()
        return [(reqs, ids, lps, batch.prefill)]

    def decode_batch(self, reqs: list) -> PagedBatch:
        """The decode batch of ``reqs``: each one's last token at its position, its slot in the cache,
        the block tables (cut to the longest) and the lengths attention reads. MLA caches latents,
        which paged decode attention cannot read: its decode batch takes the gathered path."""
        bs = self.block_size
        if self.cache.mla:
            return gathered_batch([(r.out[-1:], r.length - 1, r.blocks) for r in reqs], bs,
                                  self.model.config.window, self.cache.device)
        width = max(len(r.blocks) for r in reqs)
        rows = []
        for r in reqs:
            pos = r.length - 1
            rows.append([r.out[-1], pos, r.blocks[pos // bs] * bs + pos % bs] + r.blocks
                        + [0] * (width - len(r.blocks)))
        t = upload(rows, self.cache.device)
        return PagedBatch(t[:, 0], t[:, 1], t[:, 2], block_tables=t[:, 3:].to(torch.int32),
                          seq_lens=(t[:, 1] + 1).to(torch.int32))

    @staticmethod
    def sample(reqs: list, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request from ``logits`` ``(B, V)`` by its sampling params (and generator)."""
        params = [r.params for r in reqs]
        previous = [r.tokens for r in reqs] if any(p.repetition_penalty != 1 for p in params) else None
        return sample(logits.float(), params, [r.generator for r in reqs], previous)
