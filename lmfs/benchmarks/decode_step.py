"""One decode step: the op-by-op forward against the fused one, each replayed from a CUDA graph.

    python -m lmfs.benchmarks decode_step [--json PATH] [--profile] [--cublas] [--batches 1,8,64]

On CUDA the model is the inference benchmark's Llama-shaped 1.04 B model in bf16
(:data:`lmfs.benchmarks.inference.LLAMA_1B`, random weights). For each batch size ``B`` (1, 8 and
64) a paged KV cache (blocks of 16 tokens) holds a 512-token context per sequence, and the step
decodes token 512 of every sequence. Two forwards of the same step:

a. **plain**: :func:`lmfs.inference.paged_forward`, the model's modules op by op;
b. **fused**: :class:`lmfs.kernels.decode.FusedDecode` as the engine runs it: about ten kernels a
   layer, and at batch 1 its GEMV path (six kernels a layer, Triton matrix-vector products fused with
   their neighbours); ``--cublas`` keeps cuBLAS for the projections at every batch size.

Both use the Triton paged attention kernel and are captured in a CUDA graph once; a replay is one
step (the graph launch included, no Python). Printed per batch size: ms per step, tokens/s, the
fraction of the HBM roofline and fused ÷ plain. The **roofline** step reads every weight once
plus the cached keys and values of every sequence's context, at the measured copy bandwidth
(:func:`lmfs.bench.probes.copy_bandwidth`): ``(weight bytes + B · context · KV bytes per token) /
bandwidth``. ``max |Δ logits|`` compares the two forwards' logits of the same step. ``--profile``
prints the longest kernels of a replayed step of each (:func:`lmfs.bench.timing.profile_table`),
µs per step.

Without a GPU the inference benchmark's tiny model runs in float32, batch sizes 1 and 8 with a
24-token context, without graphs and with the Triton kernels interpreted: it exercises the code
(a test does); its numbers say nothing about real hardware.
"""

from __future__ import annotations

import argparse

import torch

from lmfs.bench import save_json
from lmfs.bench.probes import copy_bandwidth
from lmfs.bench.timing import benchmark, profile_table
from lmfs.benchmarks.inference import LLAMA_1B, TINY, build_model
from lmfs.inference import PagedBatch, PagedKVCache, kv_bytes_per_token, paged_forward
from lmfs.batching import capture_graph
from lmfs.inference.quantize import model_weight_bytes
from lmfs.kernels.decode import FusedDecode
from lmfs.kernels.paged_attention import paged_decode_attention


def decode_batch(model, batch_size: int, context: int, block_size: int, seed: int = 0):
    """A paged cache of random keys/values holding ``context - 1`` tokens of each of ``batch_size``
    sequences (each in its own consecutive blocks after the scratch block 0), and the decode batch
    of every sequence's token at position ``context - 1``."""
    cfg, weight = model.config, model.tok_emb.weight
    per_seq = -(-context // block_size)
    cache = PagedKVCache(cfg, 1 + batch_size * per_seq, block_size, device=weight.device, dtype=weight.dtype)
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    for buffer in cache.k + cache.v:
        buffer.normal_(generator=gen)
    tables = (1 + torch.arange(batch_size * per_seq, device=weight.device, dtype=torch.int32)).view(batch_size, per_seq)
    pos = torch.full((batch_size,), context - 1, device=weight.device)
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    tokens = torch.randint(0, cfg.vocab_size, (batch_size,), device=weight.device, generator=gen)
    return cache, PagedBatch(tokens, pos, slots, block_tables=tables, seq_lens=(pos + 1).int())


def captured(step, device: torch.device):
    """``(replay, output)``: ``step`` captured in a CUDA graph (after two warm-up calls on a side
    stream, which compile and autotune the Triton kernels), or on the CPU ``step`` itself."""
    if device.type != "cuda":
        return step, step()
    graph, out = capture_graph(step, device)
    return graph.replay, out


def run(device=None, batches=None, gemv: bool | None = None, profile: bool = False,
        repeats: int | None = None) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    config, dtype = (LLAMA_1B, torch.bfloat16) if cuda else (TINY, torch.float32)
    context, block_size = (512, 16) if cuda else (24, 4)
    batches = batches or ((1, 8, 64) if cuda else (1, 8))
    repeats = repeats or (50 if cuda else 1)
    if not cuda:
        print("no CUDA GPU: the tiny model on the CPU, Triton interpreted, no graphs; the numbers say nothing")
    model = build_model(config, device, dtype)
    fused = FusedDecode(model, gemv=gemv)
    bandwidth = copy_bandwidth(device=device)
    weight_bytes = model_weight_bytes(model)
    kv_token = kv_bytes_per_token(config, dtype)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "dtype": str(dtype).replace("torch.", ""),
              "params": model.num_params(), "context": context, "block_size": block_size, "gemv": fused.gemv,
              "copy_bandwidth": bandwidth, "weight_bytes": weight_bytes, "rows": []}
    print(f"model {result['params'] / 1e9:.3g} B parameters, {result['dtype']} on {result['device']}; copy bandwidth "
          f"{bandwidth / 1e9:,.0f} GB/s; context {context}; fused path "
          f"{'with the GEMV path at batch 1' if fused.gemv else 'with cuBLAS'}")
    print(f"{'batch':>5} {'plain ms':>9} {'fused ms':>9} {'plain tok/s':>12} {'fused tok/s':>12} "
          f"{'plain/roof':>10} {'fused/roof':>10} {'fused / plain':>13} {'max |Δ logits|':>14}")
    profiles = {}
    for B in batches:
        cache, batch = decode_batch(model, B, context, block_size)
        step_bytes = weight_bytes + B * context * kv_token
        roofline_s = step_bytes / bandwidth
        plain = captured(lambda: paged_forward(model, cache, batch, paged_decode_attention), device)
        fast = captured(lambda: fused(model, cache, batch, paged_decode_attention), device)
        if cuda:   # a captured graph's outputs hold nothing until it is replayed
            plain[0](), fast[0]()
        diff = (plain[1].float() - fast[1].float()).abs().max().item()
        times = {name: benchmark(replay, warmup=3 if cuda else 0, repeats=repeats, device=device).median
                 for name, (replay, _) in (("plain", plain), ("fused", fast))}
        row = {"batch": B, "step_bytes": step_bytes, "roofline_ms": roofline_s * 1e3, "max_abs_logit_diff": diff}
        for name, t in times.items():
            row.update({f"{name}_ms": t * 1e3, f"{name}_tokens_per_s": B / t, f"{name}_of_roofline": roofline_s / t})
        row["fused_over_plain"] = row["fused_tokens_per_s"] / row["plain_tokens_per_s"]
        result["rows"].append(row)
        print(f"{B:>5} {row['plain_ms']:>9.3f} {row['fused_ms']:>9.3f} {row['plain_tokens_per_s']:>12,.0f} "
              f"{row['fused_tokens_per_s']:>12,.0f} {row['plain_of_roofline']:>10.3f} "
              f"{row['fused_of_roofline']:>10.3f} "
              f"{row['fused_over_plain']:>13.2f} {diff:>14.3g}", flush=True)
        if profile:
            for name, (replay, _) in (("plain", plain), ("fused", fast)):
                table = profile_table(replay, warmup=1 if cuda else 0, repeats=3 if cuda else 1, row_limit=15)
                profiles[f"{name} B={B}"] = table
                kinds = ", ".join(f"{k} {v:,.0f}" for k, v in table.attrs["kinds_us"].items())
                print(f"\n  {name}, batch {B}: longest {table.attrs['where']}, µs per step (by kind: {kinds})")
                print(table[["name", "calls", "total_us", "mean_us", "share"]].to_string(
                    index=False, max_colwidth=70, float_format=lambda v: f"{v:,.2f}"))
            print()
        del cache, batch, plain, fast
        if cuda:
            torch.cuda.empty_cache()
    if profiles:
        result["profiles"] = {k: t.to_dict(orient="records") for k, t in profiles.items()}
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks decode-step",
                                     description="a decode step, op by op (paged_forward) vs FusedDecode, each "
                                                 "replayed from a CUDA graph: ms/step, tokens/s, roofline fraction")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,64; CPU 1,8)")
    parser.add_argument("--cublas", action="store_true", help="the fused path with cuBLAS at batch 1 too (no GEMV path)")
    parser.add_argument("--repeats", type=int, default=None, help="timed replays (default 50; CPU 1)")
    parser.add_argument("--profile", action="store_true", help="also print the longest kernels of a step of each")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else None
    result = run(args.device, batches, gemv=False if args.cublas else None, profile=args.profile,
                 repeats=args.repeats)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
