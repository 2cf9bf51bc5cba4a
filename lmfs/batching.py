"""Batch primitives shared by the inference engine, its fast runner, the kernels and the trainers.

Below both :mod:`lmfs.inference` and :mod:`lmfs.kernels` (it imports only :mod:`lmfs.nn`): what a
paged forward is handed (:class:`PagedBatch`, built by :func:`gathered_batch`), the attention of a
gathered batch (:func:`gathered_attention`, with :func:`masked_attention` and the variable-length
flash path), host-to-device copies that do not wait for the device (:func:`upload` through
:class:`PinnedStaging`), the right-padding of token lists (:func:`right_padded`) and the capture of
a CUDA graph (:func:`capture_graph`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from einops import rearrange

from lmfs.nn.attention import attention_reference



# The SDPA kernels allowed for the masked attention of :func:`masked_attention` on CUDA: the
# memory-efficient kernel takes a float mask at any length without building a plan, which SDPA's
# own first choice there, cuDNN, does for every new shape (and a packed prefill's length changes
# from call to call); flash attention takes no mask; the written-out (math) kernel is the fallback.
# Only these are enabled: with every backend enabled, cuDNN runs whatever the priority.
MASKED_SDPA_BACKENDS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def masked_sdpa_preference(device: torch.device):
    """The context :func:`masked_attention` calls SDPA in: on CUDA only :data:`MASKED_SDPA_BACKENDS` enabled,
    in that order; nothing elsewhere (SDPA's own choice)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(MASKED_SDPA_BACKENDS), set_priority=True)


def masked_attention(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            masks: dict | None = None) -> torch.Tensor:
    """Masked attention: ``q`` ``(B, H, T, hd)``, ``k``/``v`` ``(B, KV, S, hd)``, ``allowed`` a bool mask
    broadcasting to ``(B, H, T, S)``. Returns ``(B, T, H·hd)``. Every query row must allow at least
    one key (a fully masked row would turn into NaN and spread through the cache). ``masks``: a
    dict kept for one forward, so that its layers build the additive mask once, not once each."""
    groups = attn.n_heads // attn.n_kv_heads
    if groups > 1:  # K/V head j serves query heads j·groups .. (j+1)·groups - 1, as in the model
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None if masks is None else masks.get(q.dtype)
    if mask is None:
        mask = torch.zeros(allowed.shape, device=q.device, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
        if masks is not None:
            masks[q.dtype] = mask
    if attn.softcap is not None:  # SDPA cannot soft-cap: the written-out path, as the model does
        out = attention_reference(q, k, v, mask, attn.softcap)
    else:
        with masked_sdpa_preference(q.device):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return rearrange(out, "b h t d -> b t (h d)")




@dataclass
class PagedBatch:
    """One forward over a :class:`~lmfs.inference.PagedKVCache`: ``N`` new tokens packed in one row.

    ``tokens``, ``positions``, ``slots`` ``(N,)``: the new tokens, their positions in their own
    sequences, and the flat cache slot (``block·block_size + offset``) each one's keys go to.

    Attention takes one of two paths:

    * ``decode`` (one new token per sequence, ``N = B``): ``block_tables`` ``(B, max_blocks)`` and
      ``seq_lens`` ``(B,)`` feed a paged decode-attention function (the kernel or the reference);
    * gathered (prefill, and MLA): ``key_slots``/``key_positions`` ``(M,)`` list every key the new
      tokens may read (cached prefix included), and ``allowed`` ``(N, M)`` says which query reads
      which key (same sequence, causal, within the window).

    ``logit_rows`` ``(R,)``: the tokens whose logits are wanted (a prompt's last), ``None`` for all.

    ``cu_seq_q``/``cu_seq_k`` ``(S + 1,)`` int32 and ``max_q``/``max_k`` (gathered path, optional):
    where each of the ``S`` sequences' queries and keys start in the packed order, and the longest
    of each, for a variable-length attention kernel that needs no ``allowed`` mask.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None
    cu_seq_q: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    @property
    def decode(self) -> bool:
        return self.key_slots is None


def gathered_batch(chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], block_size: int,
                   window: int | None, device) -> PagedBatch:
    """The :class:`PagedBatch` of several sequences' new tokens, on the gathered attention path.

    ``chunks``: per sequence ``(new token ids, start, block table)``: the new tokens sit at
    positions ``start .. start + n - 1`` (the first ``start`` are cached already, e.g. a shared
    prefix) and the block table (a list of block ids) covers all of them. Logits are asked for at
    each sequence's last new token.
    """
    # Built with a few whole-batch numpy operations and one upload, not a loop of tensor calls per
    # sequence: a GRPO rollout prefills hundreds of short prompts at once, and per-sequence tensor
    # calls (or a copy per field) cost the host far more than the device's work.
    news = [new for new, _, _ in chunks]
    starts = np.array([start for _, start, _ in chunks], dtype=np.int64)
    lengths = np.array([len(new) for new in news], dtype=np.int64)
    ends = starts + lengths
    widths = np.array([len(table) for _, _, table in chunks], dtype=np.int64)
    short = np.flatnonzero(widths * block_size < ends)
    if len(short):
        i = short[0]
        raise ValueError(f"a block table of {widths[i]} blocks holds {widths[i] * block_size} tokens, not {ends[i]}")
    tables = right_padded([table for _, _, table in chunks], widths, widths.max())
    ks = np.repeat(np.arange(len(chunks)), ends)                                # (M,) sequence of each key
    kpos = np.arange(len(ks)) - np.repeat(np.cumsum(ends) - ends, ends)         # its position
    key_slots = tables[ks, kpos // block_size] * block_size + kpos % block_size  # (M,) every key's slot
    new_keys = kpos >= starts[ks]                       # the keys that are this batch's new tokens, in order
    tokens = np.fromiter(itertools.chain.from_iterable(news), dtype=np.int64, count=lengths.sum())
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (lengths, ends))
    parts = [tokens, kpos[new_keys], key_slots[new_keys], key_slots, kpos, np.cumsum(lengths) - 1, cu_q, cu_k,
             ks[new_keys], ks]
    flat = upload(np.concatenate(parts), device)       # one copy to the device, then views of it
    tokens, qpos, slots, key_slots, kpos, logit_rows, cu_q, cu_k, qs, ks = flat.split([len(x) for x in parts])
    allowed = (qs[:, None] == ks[None, :]) & (kpos[None, :] <= qpos[:, None])
    if window is not None:
        allowed &= (qpos[:, None] - kpos[None, :]) < window
    return PagedBatch(tokens, qpos, slots, key_slots=key_slots, key_positions=kpos, allowed=allowed,
                      logit_rows=logit_rows, cu_seq_q=cu_q.int(), cu_seq_k=cu_k.int(), max_q=int(lengths.max()),
                      max_k=int(ends.max()))


def gathered_attention(attn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                       masks: dict | None = None) -> torch.Tensor:
    """Attention of a gathered batch's queries ``q`` ``(N, H, hd)`` over the keys and values it lists
    (``batch.key_slots``), read from one layer's paged cache ``(num_blocks, block_size, KV, hd)``
    (its new tokens' written there first). Returns ``(N, H·hd)``; ``masks`` as for :func:`masked_attention`.

    Two ways, same result: where :func:`varlen_flash_usable`, one variable-length flash-attention
    call that takes every sequence's queries and keys from where ``cu_seq_q``/``cu_seq_k`` say and
    is causal within each (aligned at the end, so a cached prefix is visible to all new tokens); it
    computes only each sequence's own block of scores. Otherwise SDPA over all ``N x M`` pairs
    with the ``allowed`` mask (:func:`masked_attention`), which also serves soft-caps and the CPU.
    """
    k = k_cache.flatten(0, 1)[batch.key_slots].to(q.dtype)   # (M, KV, hd)
    v = v_cache.flatten(0, 1)[batch.key_slots].to(q.dtype)
    if varlen_flash_usable(attn, q, batch):
        out = flash_varlen(q, k, v, batch.cu_seq_q, batch.cu_seq_k, batch.max_q, batch.max_k, attn.window)
        return out.reshape(q.shape[0], -1)
    return masked_attention(attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                   batch.allowed, masks)[0]


def varlen_flash_usable(attn, q: torch.Tensor, batch: PagedBatch) -> bool:
    """Whether :func:`gathered_attention` may call :func:`flash_varlen`: queries it takes
    (:func:`flash_varlen_supports`) and a batch that says where its sequences start."""
    return batch.cu_seq_q is not None and flash_varlen_supports(q, attn.softcap)


def flash_varlen_supports(q: torch.Tensor, softcap: float | None = None) -> bool:
    """Whether :func:`flash_varlen` runs for queries like ``q``: a CUDA build with flash attention,
    16-bit queries on an Ampere or newer GPU, a head size it takes, and no soft-cap."""
    hd = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256
            and softcap is None and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, window: int | None = None) -> torch.Tensor:
    """PyTorch's variable-length flash attention (differentiable): queries ``(N, H, d)`` and keys and
    values ``(M, KV, d)`` of ``S`` sequences packed one after another, sequence ``s`` owning queries
    ``cu_q[s]:cu_q[s+1]`` and keys ``cu_k[s]:cu_k[s+1]`` (int32 ``(S + 1,)``); causal within each
    sequence, aligned at its end (a sequence with more keys than queries sees its first keys from
    every query), and within ``window`` keys when given. Returns ``(N, H, d)``. Check
    :func:`flash_varlen_supports` first."""
    window_args = {} if window is None else dict(window_size_left=window - 1, window_size_right=0)
    return torch.ops.aten._flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k,
                                                   max_q, max_k, 0.0, True, False, **window_args)[0]


def right_padded(rows, lengths: np.ndarray, width: int) -> np.ndarray:
    """The ``rows`` (iterables of ints, row ``i`` holding ``lengths[i]``) as an int64 ``(len(lengths),
    width)`` array, right-padded with 0. Every value goes into one flat array first, read straight
    from the iterables (numpy's ``fromiter``: about 3x faster than ``torch.tensor`` of nested lists,
    4 against 12 ms for 256 sequences of 250 tokens on a laptop-class core), then scattered into
    the rows in one step."""
    out = np.zeros((len(lengths), width), dtype=np.int64)
    out[np.arange(width) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                                           count=int(lengths.sum()))
    return out


def upload(values, device, dtype=torch.long) -> torch.Tensor:
    """Host ``values`` (a list, nested lists or a numpy array) as a tensor on ``device`` (None: the
    CPU); on CUDA staged through a pinned buffer (:class:`PinnedStaging`) and copied without
    waiting, so that the host does not stall until the device has run the work queued before the
    copy (a plain copy from pageable memory would)."""
    # (numpy reads nested lists about twice as fast as torch does)
    t = torch.as_tensor(np.asarray(values) if isinstance(values, list) else values, dtype=dtype)
    if device is not None and torch.device(device).type == "cuda":
        return PinnedStaging.of(torch.device(device)).upload(t)
    return t.to(device)


class PinnedStaging:
    """A ring of pinned host memory that small uploads to one CUDA device pass through.

    A copy from pageable memory makes the host wait for the work queued on the device; pinning a
    fresh tensor instead (``t.pin_memory()``) costs the host milliseconds per call (1.5-7 ms for a
    0.5 MB batch on an H200's host, against 0.1 ms through this ring). Each upload takes the next
    region of one buffer allocated once; an event recorded after its copy says when the region may
    be written again, and a region is reused only after its event has passed (with a buffer much
    larger than an upload, long before)."""

    _rings: dict = {}

    @classmethod
    def of(cls, device: torch.device) -> "PinnedStaging":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in cls._rings:
            cls._rings[device] = cls(device)
        return cls._rings[device]

    def __init__(self, device: torch.device, nbytes: int = 1 << 23):
        self.device, self.buffer, self.cursor = device, torch.empty(0, dtype=torch.uint8), 0
        self.nbytes = nbytes
        self.in_flight: list[tuple[int, int, torch.cuda.Event]] = []   # (start, end, copy done)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        size = -(-n // 256) * 256                      # regions start 256-byte aligned
        if size > self.buffer.numel():                 # (the old buffer lives on in copies still in flight)
            self.buffer = torch.empty(max(self.nbytes, 2 * size), dtype=torch.uint8, pin_memory=True)
            self.cursor, self.in_flight = 0, []
        if self.cursor + size > self.buffer.numel():
            self.cursor = 0
        start, end = self.cursor, self.cursor + size
        waiting = []
        for region in self.in_flight:
            if region[0] < end and start < region[1]:  # overlaps: its copy must be done before we write
                region[2].synchronize()
            elif not region[2].query():
                waiting.append(region)
        self.in_flight = waiting
        staged = self.buffer[start:start + n].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.in_flight.append((start, end, done))
        self.cursor = end
        return out


def capture_graph(step: Callable[[], object], device: torch.device, pool=None,
                  warmup: Callable[[], object] | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture ``step()`` (no host sync, fixed shapes, e.g. a :func:`paged_forward` decode call) in a
    CUDA graph on ``device``; returns ``(graph, output)``: ``graph.replay()`` reruns it and rewrites
    ``output``'s tensors in place. Two warm-up calls (``warmup``, default ``step``) run first on a
    side stream: they pick the kernels and compile and autotune the Triton ones, none of which may
    happen during capture. ``pool``: a memory pool shared with other graphs
    (``torch.cuda.graph_pool_handle()``)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            (warmup or step)()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()
    return graph, output
