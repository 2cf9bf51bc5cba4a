"""The inference engine's bookkeeping around a decode step, in two kernels instead of about twenty.

:class:`lmfs.fast.FastRunner` replays each decode step from a CUDA graph. Around the model's forward
the step does small things in PyTorch: before it, gather the batch's positions, last tokens and
block-table rows and compute each token's cache slot (about eight kernels); after it, cast the
logits to float32, take the argmax and the log-softmax, gather the chosen log-probability, write
the new last tokens, advance the positions, reset the padding row and pack ids and log-probs for
the host (about twelve). Each kernel does next to nothing at batch 1, but each costs a few
microseconds of launch and ramp on the GPU: measured on an H200 they added about 0.1 ms to a
0.69 ms step of the 1 B model. Here they are two kernels:

* :func:`gather_decode_batch`: one program per row of the batch builds its entries of the
  :class:`~lmfs.inference.PagedBatch` (token, position, slot, sequence length, block-table row);
* :func:`greedy_advance`: one program per row takes the argmax of its logits and its log-probability
  (``−log Σ exp(z − max)``, with an online maximum over chunks of the vocabulary, in float32), writes
  the row's new last token and position, and stores ``(id, log-prob)`` as float64 where the host
  reads them.

They replace the PyTorch lines only for greedy steps on a GPU; sampling at a temperature and the
CPU keep :mod:`lmfs.inference.sampling`, which the tests compare these with.
"""

from __future__ import annotations

import torch

from lmfs.batching import PagedBatch
from lmfs.kernels._triton import pdl_launch, pdl_supported, tl, triton


@triton.jit
def gather_decode_batch_kernel(rows_ptr, positions_ptr, tables_ptr, last_ptr, tokens_ptr, pos_ptr, slots_ptr,
                               lens_ptr, batch_tables_ptr, width, PAGE: tl.constexpr, BLOCK_W: tl.constexpr,
                               PDL: tl.constexpr):
    """Row ``b = program_id(0)`` of the batch: engine row ``r = rows[b]``; token ``last[r]``, position
    ``p = positions[r]``, slot ``tables[r, p // PAGE]·PAGE + p % PAGE``, length ``p + 1`` and the
    block-table row ``tables[r, :width]``. ``PDL``: let the forward's first kernel start at once (it
    reads its weights while this runs, and waits for it before reading the batch)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    r = tl.load(rows_ptr + b).to(tl.int64)
    p = tl.load(positions_ptr + r)
    tl.store(tokens_ptr + b, tl.load(last_ptr + r))
    tl.store(pos_ptr + b, p)
    block = tl.load(tables_ptr + r * width + p // PAGE).to(tl.int64)
    tl.store(slots_ptr + b, block * PAGE + p % PAGE)
    tl.store(lens_ptr + b, (p + 1).to(tl.int32))
    for start in range(0, width, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        ok = cols < width
        tl.store(batch_tables_ptr + b * width + cols, tl.load(tables_ptr + r * width + cols, mask=ok), mask=ok)


def gather_decode_batch(rows: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, last_token: torch.Tensor,
                        block_size: int) -> PagedBatch:
    """The decode :class:`~lmfs.inference.PagedBatch` of engine rows ``rows`` ``(B,)``: what
    ``FastRunner._decode_batch`` builds with PyTorch indexing, in one kernel. ``positions`` and ``last_token``
    ``(R,)`` int64, ``tables`` ``(R, width)`` int32, all contiguous on one device."""
    B, width = rows.shape[0], tables.shape[1]
    tokens, pos, slots = (torch.empty(B, dtype=torch.long, device=rows.device) for _ in range(3))
    lens = torch.empty(B, dtype=torch.int32, device=rows.device)
    batch_tables = torch.empty(B, width, dtype=torch.int32, device=rows.device)
    if B:
        gather_decode_batch_kernel[(B,)](rows, positions, tables, last_token, tokens, pos, slots, lens, batch_tables,
                                         width, PAGE=block_size, BLOCK_W=min(1024, triton.next_power_of_2(width)),
                                         PDL=pdl_supported(), num_warps=1)
    return PagedBatch(tokens, pos, slots, block_tables=batch_tables, seq_lens=lens)


@triton.jit
def greedy_advance_kernel(logits_ptr, V, rows_ptr, last_ptr, positions_ptr, drawn_ptr, B, dummy,
                          BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """Row ``b = program_id(0)`` of ``logits`` ``(B, V)``: ``i = argmax`` (the first of equal maxima)
    and its log-probability ``−log Σ_v exp(z_v − z_i)``, over chunks of ``BLOCK_V`` with a running
    maximum; ``drawn[0, b] = i``, ``drawn[1, b] = log-prob`` (float64); for engine row ``r = rows[b]``
    ``last[r] = i`` and ``positions[r] += 1``, except the padding row ``dummy``, kept at 0. ``PDL``:
    launched while the head's kernel finishes, it waits for the logits first."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    index = tl.zeros([], tl.int64)
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(logits_ptr + b * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        top = tl.max(z, axis=0)
        at = start + tl.argmax(z, axis=0, tie_break_left=True)
        new_best = tl.maximum(best, top)
        total = total * tl.exp(best - new_best) + tl.sum(tl.exp(z - new_best), axis=0)
        index = tl.where(top > best, at.to(tl.int64), index)   # strictly greater: the first maximum wins
        best = new_best
    r = tl.load(rows_ptr + b)
    tl.store(last_ptr + r, index)
    p = tl.load(positions_ptr + r)
    tl.store(positions_ptr + r, tl.where(r == dummy, 0, p + 1))
    tl.store(drawn_ptr + b, index.to(tl.float64))
    tl.store(drawn_ptr + B + b, (-tl.log(total)).to(tl.float64))


def greedy_advance(logits: torch.Tensor, rows: torch.Tensor, last_token: torch.Tensor, positions: torch.Tensor,
                   dummy: int, block_v: int | None = None) -> torch.Tensor:
    """The greedy draw of a decode step and the engine's advance, in one kernel: for ``logits``
    ``(B, V)`` (any float dtype, read in float32) the argmax ids and their log-probs (under the
    logits at temperature 1), returned as a ``(2, B)`` float64 tensor as :func:`lmfs.inference.runner.pack`
    packs them, with ``last_token[rows] = ids`` and ``positions[rows] += 1`` done in place (row
    ``dummy``, the padding row, stays at position 0). What :func:`lmfs.inference.sampling.sample_scaled`
    computes for greedy rows, up to the order of the float32 sum. ``block_v``: vocabulary entries per
    chunk (a power of two; default the vocabulary rounded up to one, at most 32,768)."""
    B, V = logits.shape
    drawn = torch.empty(2, B, dtype=torch.float64, device=logits.device)
    if B:
        greedy_advance_kernel[(B,)](logits.contiguous(), V, rows, last_token, positions, drawn, B, dummy,
                                    BLOCK_V=block_v or min(32768, triton.next_power_of_2(V)), PDL=pdl_supported(),
                                    num_warps=8, **pdl_launch(pdl_supported()))
    return drawn


__all__ = ["gather_decode_batch", "gather_decode_batch_kernel", "greedy_advance", "greedy_advance_kernel"]
