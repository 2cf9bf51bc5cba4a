"""Decode attention over a paged KV cache: the Triton kernel's GB/s against the copy bandwidth.

    python -m lmfs.benchmarks paged-attention [--json PATH] [--batches 1 64 256] [--contexts 256 512 1024] [--sweep]

For each head layout (MHA: 8 query and 8 KV heads; GQA: 32 query heads on 8 KV heads; head_dim 64,
bf16, blocks of 16 tokens scattered over the pool in a random order), batch size ``B`` and context
``C`` (every sequence ``C`` tokens long, the table ``C`` tokens wide), plus the rollout shape (256
sequences of 1 .. 280 tokens in a 512-token table), it times:

a. **triton**: :func:`lmfs.kernels.paged_attention.paged_decode_attention` with the splits and tile
   it chooses from the shapes (printed);
b. **reference**: :func:`lmfs.inference.paged_attention_reference` (gather the blocks, einsum);
c. **sdpa**: ``F.scaled_dot_product_attention`` on the same keys and values stored contiguously,
   ``(B, KV, C, head_dim)``: what dense attention costs without a page table.

Each is captured 20 times in a CUDA graph and replayed, so launch gaps of the host do not count (the
engine replays graphs too). **GB/s** counts the bytes the kernel must read, the cached keys and
values of every sequence's tokens; the ceiling is the measured copy bandwidth
(:func:`lmfs.bench.probes.copy_bandwidth`). ``max |Δ|`` compares the kernel with the reference.
``--sweep`` also times every tile ``(BLOCK_S, warps, stages)`` of a list and several split counts
per shape and prints the fastest, to check :func:`~lmfs.kernels.paged_attention.choose_config`.

Without a GPU tiny sizes run through Triton's interpreter, once each: the code is exercised, the
numbers say nothing about hardware.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from lmfs.bench import save_json
from lmfs.bench.probes import copy_bandwidth
from lmfs.bench.timing import benchmark
from lmfs.inference.kv_cache import paged_attention_reference
from lmfs.kernels.paged_attention import choose_config, choose_splits, paged_decode_attention

LAYOUTS = {"MHA 8/8x64": (8, 8, 64), "GQA 32/8x64": (32, 8, 64)}   # query heads, KV heads, head_dim
SWEEP_TILES = [(16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (256, 8, 2)]
BLOCK = 16


def make_case(B: int, lengths: list[int], width: int, layout: tuple[int, int, int], device, dtype, seed: int = 0):
    """q, a pool holding every sequence's tokens in randomly placed blocks (block 0 left unused, as the
    engine's scratch block), the block tables ``width`` tokens wide and the lengths."""
    n_heads, n_kv, d = layout
    g = torch.Generator().manual_seed(seed)
    per_seq = math.ceil(width / BLOCK)
    need = [math.ceil(n / BLOCK) for n in lengths]
    order = 1 + torch.randperm(sum(need), generator=g)
    tables = torch.zeros(B, per_seq, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n].int()
        used += n
    k = torch.randn(1 + sum(need), BLOCK, n_kv, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(B, n_heads, d, device=device, dtype=dtype)
    return q, k, v, tables.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def time_call(fn, device, calls: int = 20) -> float:
    """Seconds per call of ``fn``: on a GPU from a CUDA graph of ``calls`` calls, replayed; on the
    CPU one call."""
    if device.type != "cuda":
        return benchmark(fn, warmup=0, repeats=1, device=device).median
    for _ in range(2):
        fn()   # compile before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return benchmark(graph.replay, warmup=3, repeats=20, device=device).median / calls


def dense_sdpa(q, k, v, tables, lens):
    """The same keys and values as one contiguous (B, KV, C, d) tensor per K and V (all rows as long
    as the longest), for SDPA."""
    width = int(lens.max())
    kd = k[tables.long()].flatten(1, 2)[:, :width].transpose(1, 2).contiguous()
    vd = v[tables.long()].flatten(1, 2)[:, :width].transpose(1, 2).contiguous()
    return lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=q.shape[1] != k.shape[2])


def run_case(name, layout, B, lengths, width, device, dtype, copy_bw, sweep: bool) -> dict:
    q, k, v, tables, lens = make_case(B, lengths, width, layout, device, dtype)
    n_kv, d = layout[1], layout[2]
    nbytes = 2 * sum(lengths) * n_kv * d * k.element_size()   # keys and values of every cached token
    splits = choose_splits(B, n_kv, tables.shape[1] * BLOCK, device)
    config = choose_config(d, tables.shape[1] * BLOCK, splits)
    out = paged_decode_attention(q, k, v, tables, lens)
    reference = paged_attention_reference(q, k, v, tables, lens)
    row = dict(layout=name, batch=B, context=max(lengths), splits=splits, config=list(config),
               max_err=(out.float() - reference.float()).abs().max().item(), bytes=nbytes,
               triton_us=1e6 * time_call(lambda: paged_decode_attention(q, k, v, tables, lens), device),
               reference_us=1e6 * time_call(lambda: paged_attention_reference(q, k, v, tables, lens), device),
               sdpa_us=1e6 * time_call(dense_sdpa(q, k, v, tables, lens), device) if len(set(lengths)) == 1 else None)
    row["gb_s"] = nbytes / row["triton_us"] / 1e3
    row["of_copy"] = nbytes / (row["triton_us"] * 1e-6) / copy_bw
    if sweep:
        tried = []
        for s in sorted({splits, 1, 2, 4, 8}):
            for tile in SWEEP_TILES:
                us = 1e6 * time_call(lambda: paged_decode_attention(q, k, v, tables, lens, num_splits=s, config=tile),
                                     device)
                tried.append((us, s, tile))
        tried.sort()
        row["sweep_best"] = [dict(us=us, splits=s, config=list(tile)) for us, s, tile in tried[:3]]
    return row


def run(batches=None, contexts=None, sweep: bool = False) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = batches or ([1, 64, 256] if cuda else [1, 4])
    contexts = contexts or ([256, 512, 1024] if cuda else [24])
    copy_bw = copy_bandwidth(device=device)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); {device}, {dtype}")
    rows = []
    for name, layout in LAYOUTS.items():
        shapes = [(B, [C] * B, C) for B in batches for C in contexts]
        rollout_batch = 256 if cuda else 4
        rollout = [1 + (37 * i) % (280 if cuda else 20) for i in range(rollout_batch)]
        shapes.append((rollout_batch, rollout, 512 if cuda else 32))   # rollouts: ragged lengths, a wider table
        for B, lengths, width in shapes:
            rows.append(run_case(name, layout, B, lengths, width, device, dtype, copy_bw, sweep))
            r = rows[-1]
            sdpa = f"{r['sdpa_us']:8.1f}" if r["sdpa_us"] is not None else "       -"
            best = ""
            if sweep:
                b = r["sweep_best"][0]
                best = f"  best: {b['us']:.1f} us splits={b['splits']} tile={tuple(b['config'])}"
            print(f"{name:12} B={B:<4} ctx={r['context']:<5} splits={r['splits']:<2} tile={tuple(r['config'])!s:13} "
                  f"{r['triton_us']:8.1f} us {r['gb_s']:7.0f} GB/s {r['of_copy']:6.1%} of copy | reference "
                  f"{r['reference_us']:8.1f} us | sdpa {sdpa} us | max|Δ| {r['max_err']:.1e}{best}", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, dtype=str(dtype), copy_bandwidth=copy_bw, rows=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="paged decode attention: Triton kernel GB/s vs copy bandwidth")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 64 256")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="default 256 512 1024")
    parser.add_argument("--sweep", action="store_true", help="also time a list of tiles and split counts per shape")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.batches, args.contexts, sweep=args.sweep)
    save_json(result, args.json)
    return result
