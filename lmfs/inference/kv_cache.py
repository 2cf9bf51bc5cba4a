"""Where generation keeps the keys and values of the tokens it has already seen.

Two layouts of the same idea:

* :class:`KVCache`, **contiguous**: per layer one ``(B, n_kv_heads, max_len, head_dim)`` buffer for
  keys and one for values (for MLA one ``(B, max_len, kv_latent_dim)`` buffer of the normed latent
  ``c``, from which keys and values are up-projected). Simple and fast for one batch of sequences
  that start together; memory for ``max_len`` tokens is reserved per row whether used or not.
* :class:`PagedKVCache`, **paged** (vLLM's PagedAttention): the memory is cut into fixed-size
  blocks of ``block_size`` tokens; a sequence owns a list of blocks (its *block table*) that grows
  a block at a time, so at most ``block_size - 1`` slots per sequence are wasted. Blocks are
  reference-counted, so sequences whose prompts start with the same full blocks share them
  (*prefix sharing*). :class:`BlockAllocator` does the bookkeeping, on the host; the block tables
  the attention reads are device tensors.

:func:`paged_attention_reference` is decode attention over the paged layout written with a torch
gather: the reference the Triton kernel (:mod:`lmfs.kernels.paged_attention`) is checked against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def cache_entry_shape(config) -> tuple[int, ...]:
    """What one layer caches per token: ``(n_kv_heads, head_dim)`` for keys (and again for values),
    or ``(kv_latent_dim,)`` for MLA, whose cache holds only the latent."""
    if config.attention == "mla":
        return (config.kv_latent_dim,)
    return (config.kv_heads, config.head_dim)


def kv_bytes_per_token(config, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one token occupies in the KV cache, over all layers: ``2·n_layers·n_kv_heads·head_dim``
    elements (keys and values), or ``n_layers·kv_latent_dim`` for MLA."""
    per_layer = math.prod(cache_entry_shape(config)) * (1 if config.attention == "mla" else 2)
    return config.n_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def _model_device_dtype(model, device, dtype):
    p = next(model.parameters())
    return (p.device if device is None else torch.device(device)), (p.dtype if dtype is None else dtype)


class KVCache:
    """Contiguous cache of ``batch_size`` sequences of at most ``max_len`` tokens, every row at the
    same ``length`` (the teaching path; :func:`lmfs.inference.forward_cached` fills it).

    ``k[l]``, ``v[l]``: layer ``l``'s keys and values ``(B, n_kv_heads, max_len, head_dim)``, stored
    after QK-norm and RoPE, so a cached key is never touched again. For MLA ``latent[l]``
    ``(B, max_len, kv_latent_dim)`` holds the normed latent instead and ``k``/``v`` are ``None``.
    ``pad`` ``(B,)`` (optional) counts left-padding tokens at the start of each row: they are never
    attended to and the row's positions start after them (batched prompts of different lengths).
    """

    def __init__(self, config, batch_size: int, max_len: int, device=None, dtype=torch.float32,
                 pad: torch.Tensor | None = None):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size={batch_size} and max_len={max_len} must be positive")
        if max_len > config.context_length:
            raise ValueError(f"max_len={max_len} exceeds the model's context_length={config.context_length}")
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        self.mla = config.attention == "mla"
        self.length = 0
        L = config.n_layers
        if self.mla:
            self.latent = [torch.zeros(batch_size, max_len, config.kv_latent_dim, device=device, dtype=dtype)
                           for _ in range(L)]
            self.k = self.v = None
        else:
            shape = (batch_size, config.kv_heads, max_len, config.head_dim)
            self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(L)]
            self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(L)]
            self.latent = None
        self.pad = None if pad is None else pad.to(device=device, dtype=torch.long)

    @classmethod
    def for_model(cls, model, batch_size: int, max_len: int | None = None, device=None, dtype=None,
                  pad: torch.Tensor | None = None) -> KVCache:
        """An empty cache shaped for ``model``; ``max_len`` defaults to its context length, device
        and dtype to those of its parameters."""
        device, dtype = _model_device_dtype(model, device, dtype)
        max_len = model.config.context_length if max_len is None else max_len
        return cls(model.config, batch_size, max_len, device, dtype, pad)

    def truncate(self, n: int) -> None:
        """Forget every token after the first ``n`` (e.g. draft tokens the target rejected). The
        buffers are not cleared: the next append overwrites them."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) needs 0 <= n <= length={self.length}")
        self.length = n

    def buffers(self) -> list[torch.Tensor]:
        return self.latent if self.mla else self.k + self.v

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the buffers (all ``max_len`` slots of every row)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def bytes_used(self) -> int:
        """Bytes of the tokens cached so far: ``batch_size · length`` token entries."""
        return self.nbytes * self.length // self.max_len

    def __repr__(self) -> str:
        kind = "latent" if self.mla else "k/v"
        return (f"KVCache({kind}, batch_size={self.batch_size}, length={self.length}/{self.max_len}, "
                f"{self.bytes_used / 2**20:.2f}/{self.nbytes / 2**20:.2f} MiB)")


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache, one query token per sequence.

    ``q`` ``(B, n_heads, head_dim)``; ``k_cache``, ``v_cache`` ``(num_blocks, block_size, n_kv_heads,
    head_dim)``; ``block_tables`` ``(B, max_blocks)`` int: sequence ``b``'s token ``j`` lives in block
    ``block_tables[b, j // block_size]`` at offset ``j % block_size``; ``seq_lens`` ``(B,)``: tokens
    cached for each sequence, the query's own included (so the query sits at position
    ``seq_lens - 1``). Returns ``(B, n_heads, head_dim)``. GQA: query head ``h`` reads KV head
    ``h // (n_heads // n_kv_heads)``. ``scale`` defaults to ``1/√head_dim``; ``window`` keeps only the
    last ``window`` keys, ``softcap`` squashes the scaled logits (as :mod:`lmfs.nn.attention`).

    Written for clarity: it gathers every sequence's blocks into a padded ``(B, max_blocks·block_size,
    n_kv_heads, head_dim)`` tensor and masks the slots past ``seq_lens``. Shapes are fixed by
    ``block_tables``, so it runs inside a CUDA graph.
    """
    B, H, d = q.shape
    _, bs, KV, _ = k_cache.shape
    if H % KV:
        raise ValueError(f"n_heads={H} must be a multiple of the cache's n_kv_heads={KV}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tables = block_tables.long()
    k = k_cache[tables].flatten(1, 2)                     # (B, S, KV, d), S = max_blocks·block_size
    v = v_cache[tables].flatten(1, 2)
    groups = H // KV
    qg = q.view(B, KV, groups, d).float()
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k.float()) * scale   # (B, KV, groups, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    j = torch.arange(k.shape[1], device=q.device)
    last = seq_lens.long()[:, None] - 1                   # (B, 1): the query's position
    allowed = j[None, :] <= last
    if window is not None:
        allowed &= (last - j[None, :]) < window
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgs,bskd->bkgd", probs, v.float())
    return out.reshape(B, H, d).to(q.dtype)


class BlockAllocator:
    """Bookkeeping of ``num_blocks`` KV blocks: a free list, a reference count per block, and a
    table from prefix hashes to the blocks holding those full prefixes.

    Block 0 is reserved as a scratch block (padded batch rows of a CUDA graph write there), so
    ``num_blocks - 1`` blocks are usable. A block returns to the free list when its reference
    count drops to 0, i.e. when the last sequence using it lets it go.

    Prefix sharing: the key of full block ``i`` of a token sequence is the hash of the token ids of
    blocks ``0 .. i`` (chained: ``hash((key of block i-1, ids of block i))``), so equal keys mean
    equal prefixes and therefore equal keys/values (positions included).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need at least 2 (block 0 is a reserved scratch block)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))   # pop() hands out low ids first
        self.refs = [0] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.usable - len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV block: free or preempt a sequence first")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """One more user of ``block`` (a prefix hit)."""
        self.refs[block] += 1
        return block

    def release(self, block: int) -> None:
        """One user fewer; the block is free again when none is left."""
        if self.refs[block] <= 0:
            raise RuntimeError(f"block {block} released more often than allocated")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            h = self.hash_of.pop(block, None)
            if h is not None:
                del self.by_hash[h]
            self.free.append(block)

    @staticmethod
    def prefix_hashes(token_ids: Sequence[int], block_size: int, n_blocks: int) -> list[int]:
        """The chained keys of the first ``n_blocks`` full blocks of ``token_ids``."""
        keys, h = [], 0
        for i in range(n_blocks):
            h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
            keys.append(h)
        return keys

    def lookup(self, key: int) -> int | None:
        return self.by_hash.get(key)

    def register(self, block: int, key: int) -> None:
        """Record that ``block`` holds the full prefix ``key`` (first writer wins)."""
        if key not in self.by_hash:
            self.by_hash[key] = block
            self.hash_of[block] = key


class PagedKVCache:
    """The paged KV memory of a model: per layer ``k[l]``, ``v[l]`` ``(num_blocks, block_size,
    n_kv_heads, head_dim)`` (for MLA ``k[l]`` ``(num_blocks, block_size, 1, kv_latent_dim)`` holds the
    latent and ``v`` is ``None``), plus the :class:`BlockAllocator` that hands blocks out.

    Which blocks a sequence holds is the scheduler's business (:class:`~lmfs.inference.Scheduler`);
    this class owns the memory, the allocator and the byte accounting.
    """

    def __init__(self, config, num_blocks: int, block_size: int = 16, device=None, dtype=torch.float32):
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be positive (16 is usual)")
        self.config, self.num_blocks, self.block_size = config, num_blocks, block_size
        self.mla = config.attention == "mla"
        entry = (1, config.kv_latent_dim) if self.mla else cache_entry_shape(config)
        shape = (num_blocks, block_size, *entry)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.device = self.k[0].device
        self.v = None if self.mla else [torch.zeros(shape, device=device, dtype=dtype)
                                        for _ in range(config.n_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.token_bytes = kv_bytes_per_token(config, dtype)

    @classmethod
    def for_model(cls, model, num_tokens: int, block_size: int = 16, device=None, dtype=None) -> PagedKVCache:
        """A cache with room for ``num_tokens`` tokens (rounded up to whole blocks) plus the scratch block."""
        device, dtype = _model_device_dtype(model, device, dtype)
        return cls(model.config, math.ceil(num_tokens / block_size) + 1, block_size, device, dtype)

    @property
    def block_bytes(self) -> int:
        return self.token_bytes * self.block_size

    def bytes_of_tokens(self, n_tokens: int) -> int:
        return n_tokens * self.token_bytes

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the whole cache."""
        return self.num_blocks * self.block_bytes
