"""Inference: the lmfs engine against the HBM roofline and Hugging Face ``generate``.

    python -m lmfs.benchmarks inference [--json results/h200/inference.json] [--tiny]
                                        [--parts decode,trace,paged,speculative] [--skip hf]

On CUDA the model is Llama-shaped with random weights, in bf16: d_model 2048, 16 layers, 32 query
and 8 KV heads (head_dim 64), SwiGLU width 8192, vocabulary 32,000, tied embeddings: 1.04 B
parameters. Hugging Face gets the same weights as ``LlamaForCausalLM`` (:func:`lmfs.nn.to_hf_llama`,
SDPA attention). Four parts, chosen with ``--parts`` (all by default), each on its own: a peer
that fails prints an error row and the rest goes on. Every row is printed as soon as it is
measured, and with ``--json`` the file is rewritten after every part, so a run cut short keeps
what it measured. On an H200 the four parts take at most about 14 minutes, up to 8 of them
Hugging Face's static batches in part b (their budget, below):

a. **Batch-1 decode.** Greedy decoding of one request (prompt 128 tokens, 256 new tokens). Decode
   tokens/s = ``N / (t(N + 1) - t(1))``, where ``t(n)`` is the median wall time of a ``generate``
   call producing ``n`` tokens: the prefill and the first token cancel out. The **roofline**: every
   decode step must read every weight once and the cached K/V of every earlier token, so at the
   measured copy bandwidth ``bw`` (:func:`lmfs.bench.probes.copy_bandwidth`, a device-to-device
   copy: read and write counted) no implementation can beat ``bw / (weight bytes + KV bytes per
   token × mean context)`` tokens/s. Peers: the lmfs engine (:func:`lmfs.fast.fast_engine`: its
   decode step captured in CUDA graphs on a GPU, overlapped with the host's work, through the
   fused decode forward where it supports the model; each engine row prints which of these ran,
   and the device seconds of its decode steps against their wall seconds) and Hugging Face ``generate`` with
   a static cache (which ``generate`` compiles with ``torch.compile`` on a GPU: its fastest
   setting) and, on the CPU only, with its default dynamic cache (eager; on an H200 it ran 6×
   slower than the static cache, so the GPU run leaves it out to save time); the faster counts.
   The engine is built once for this part and the next (its CUDA graphs, captured on first use,
   are not timed). A row **lmfs plain runner** runs the same engine with the plain model runner
   (:class:`lmfs.inference.LLM` without :func:`lmfs.fast.fast_engine`: the forward op by op, the
   batch built on the host, every step read before the next) and reports its tokens/s as a
   fraction of the fast engine's.
b. **Throughput on a request trace.** 512 requests, seeded: prompt lengths uniform in 128-1024,
   output lengths uniform in 64-512, EOS ignored (each request produces exactly its length). The
   engine gets all requests at once (continuous batching over a paged KV cache). Hugging Face runs
   static batches with left padding: a batch lasts as long as its longest output, and only the
   tokens each request asked for count. To bound the time, each batch size tried runs **one batch**
   (the trace's first B requests) and its useful tokens/s stands for the whole trace (each row
   says so); the best batch size counts. Batch sizes are tried smallest first while the time
   spent on them, plus the last one's time again (a larger batch takes at least as long), stays
   within a budget: on a GPU 8 minutes, so that batches of 128 and 256 are measured too and the
   best batch size is found rather than assumed. The plain runner runs the trace too (its
   tokens/s as a fraction of the fast engine's; goal ≥ 0.5).
c. **Paged KV memory.** The engine's KV memory in use (whole blocks) ÷ the bytes of the tokens
   actually cached, averaged over the decode steps of the trace (from ``llm.stats``); measured by
   the engine's trace run (alone, without the Hugging Face rows, when ``trace`` is not asked for).
d. **Speculative decoding at batch 1.** Lecture 10's target and smaller draft (its full-scale sizes
   from :func:`lmfs.scales.lecture_config`), both trained here for a few hundred steps on the same
   tokens of the generated stories corpus (:func:`lmfs.train.prepare_tokens`), then
   :class:`lmfs.inference.SpeculativeDecoder` (a whole round, ``k`` draft steps, the target's check
   and the acceptance rule, replayed from one CUDA graph) against plain decoding of the target
   through the same decoder without a draft (``k = 0``), sampling at temperature 1: tokens/s ratio
   and acceptance rate (over the drafts the target checked) for a few draft lengths ``k``. Next to the
   measured speed-up it prints the one predicted from the acceptance rate ``α`` and the draft's
   cost per token relative to the target's, ``c`` (both decoding alone):
   ``(1 − α^(k+1)) / ((1 − α)(k·c + 1))`` (Leviathan et al.): the speed-up is bounded by how
   often the draft agrees and how cheap it is.

Without a GPU (or with ``--tiny``) every section runs on a tiny model and a short trace, to
exercise the code (a test does); those numbers say nothing about real hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lmfs.bench import error_line, save_json
from lmfs.bench.probes import copy_bandwidth
from lmfs.benchmarks.hf_generate import decode_rate, hf_batch, hf_decode, wall
from lmfs.inference import kv_bytes_per_token
from lmfs.inference.quantize import model_weight_bytes
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.scales import lecture_config

LLAMA_1B = TransformerConfig(vocab_size=32_000, context_length=2048, d_model=2048, n_layers=16, n_heads=32,
                             n_kv_heads=8, d_ff=8192)
TINY = TransformerConfig(vocab_size=256, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    decode_prompt: int            # (a) prompt tokens of the batch-1 request
    decode_tokens: int            # (a) new tokens timed
    repeats: int                  # (a) timed generate calls per length
    trace_requests: int           # (b) requests in the trace
    prompt_range: tuple[int, int]  # (b) prompt lengths, inclusive
    output_range: tuple[int, int]  # (b) output lengths, inclusive
    hf_batch_sizes: tuple[int, ...]  # (b) static batch sizes tried for Hugging Face, smallest first
    hf_seconds: float             # (b) time budget of the Hugging Face batch sizes
    scale: str                    # (d) the target/draft pair and its training: lecture 10 at this scale


GPU_SIZES = Sizes(decode_prompt=128, decode_tokens=256, repeats=3, trace_requests=512,
                  prompt_range=(128, 1024), output_range=(64, 512), hf_batch_sizes=(32, 64, 128, 256),
                  hf_seconds=480.0, scale="full")
CPU_SIZES = Sizes(decode_prompt=8, decode_tokens=8, repeats=2, trace_requests=12,
                  prompt_range=(4, 24), output_range=(2, 12), hf_batch_sizes=(2, 4), hf_seconds=20.0,
                  scale="smoke")


# ------------------------------------------------------------------------------------ helpers

def build_model(config: TransformerConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> TransformerLM:
    """``TransformerLM(config)`` with seeded random weights, initialised directly on ``device``."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = TransformerLM(config)
    return model.to(dtype).eval()


def request_trace(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` requests ``(prompt token ids, output length)``, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    outputs = rng.integers(output_range[0], output_range[1] + 1, n)
    return [(rng.integers(1, vocab_size, int(p)).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _section(result: dict, name: str, fn: Callable[[], dict]) -> None:
    """Run one section into ``result[name]``; an exception becomes an error row, the rest goes on."""
    print(f"\n== {name}", flush=True)
    started = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as err:  # one failing section must not cost the others
        result[name] = {"error": error_line(err)}
        print(f"  ERROR: {result[name]['error']}", flush=True)
    result[name]["seconds"] = time.perf_counter() - started


def _peer(rows: dict, name: str, fn: Callable[[], dict]) -> None:
    """One peer of a section: its row, or an error row."""
    try:
        rows[name] = fn()
    except Exception as err:
        rows[name] = {"error": error_line(err)}
    row = rows[name]
    text = row.get("error") or ", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in row.items())
    print(f"  {name:<28} {text}", flush=True)


# ---------------------------------------------------------------------------- (a) batch-1 decode

def batch1_decode(model: TransformerLM, sizes: Sizes, device: torch.device, hf: bool,
                  engine: Callable[[str], object]) -> dict:
    config = model.config
    prompt = request_trace(1, (sizes.decode_prompt,) * 2, (1, 1), config.vocab_size, seed=1)[0][0]
    bandwidth = copy_bandwidth(device=device)
    mean_context = sizes.decode_prompt + sizes.decode_tokens / 2
    per_token = model_weight_bytes(model) + kv_bytes_per_token(config, model.tok_emb.weight.dtype) * mean_context
    roofline = bandwidth / per_token
    out = {"copy_bandwidth": bandwidth, "weight_bytes": model_weight_bytes(model), "bytes_per_token": per_token,
           "roofline_tokens_per_s": roofline, "rows": {}}
    print(f"  copy bandwidth {bandwidth / 1e9:,.0f} GB/s; {per_token / 1e9:.3f} GB read per token "
          f"(weights + KV at mean context {mean_context:.0f}) -> roofline {roofline:,.1f} tokens/s")
    rows, greedy = out["rows"], {}

    def lmfs_engine(kind: str):
        from lmfs.inference import SamplingParams

        llm = engine(kind)

        def generate(n):
            result = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0]
            if result.error:
                raise RuntimeError(result.error)
            return result.token_ids

        rate = decode_rate(generate, sizes.decode_tokens, sizes.repeats, device)
        greedy["lmfs" if kind == "fast" else "lmfs plain runner"] = list(generate(sizes.decode_tokens))
        return {"tokens_per_s": rate, "of_roofline": rate / roofline, **engine_flags(llm.stats)}

    _peer(rows, "lmfs engine", lambda: lmfs_engine("fast"))
    _free(device)
    _peer(rows, "lmfs plain runner", lambda: lmfs_engine("plain"))
    _free(device)
    plain_vs_fast(rows, out)
    if hf:
        static = "HF static cache" + (" + compile" if device.type == "cuda" else "")
        peers = [(static, dict(cache_implementation="static"))]
        if device.type != "cuda":  # on an H200 the eager dynamic cache ran 6x slower (59 vs 349 tokens/s): left out
            peers.append(("HF dynamic cache", dict(disable_compile=True)))
        for name, kwargs in peers:
            _peer(rows, name, lambda name=name, kwargs=kwargs: hf_decode(model, prompt, sizes, device, roofline,
                                                                       kwargs, greedy, name))
            _free(device)
    hf_rates = {k: r["tokens_per_s"] for k, r in rows.items() if k.startswith("HF") and "tokens_per_s" in r}
    if hf_rates:
        out["hf_best"] = max(hf_rates, key=hf_rates.get)
        if "tokens_per_s" in rows["lmfs engine"]:
            out["lmfs_vs_hf_best"] = rows["lmfs engine"]["tokens_per_s"] / hf_rates[out["hf_best"]]
    if "tokens_per_s" in rows["lmfs engine"]:
        out["lmfs_of_roofline"] = rows["lmfs engine"]["of_roofline"]
    for name, tokens in greedy.items():  # same weights, greedy: the tokens should mostly agree
        if name != "lmfs" and "lmfs" in greedy:
            same = sum(a == b for a, b in zip(tokens, greedy["lmfs"]))
            rows[name]["greedy_tokens_equal_lmfs"] = f"{same}/{len(greedy['lmfs'])}"
    return out


def plain_vs_fast(rows: dict, out: dict) -> None:
    """The plain runner's tokens/s as a fraction of the fast engine's, into ``out`` (when both ran)."""
    fast, plain = rows.get("lmfs engine", {}), rows.get("lmfs plain runner", {})
    if "tokens_per_s" in fast and "tokens_per_s" in plain:
        out["plain_vs_fast"] = plain["tokens_per_s"] / fast["tokens_per_s"]


# ---------------------------------------------------------------------- (b, c) trace throughput

def trace_throughput(model: TransformerLM, sizes: Sizes, device: torch.device, hf: bool, result: dict,
                     engine: Callable[[str], object], plain: bool = True) -> dict:
    trace = request_trace(sizes.trace_requests, sizes.prompt_range, sizes.output_range, model.config.vocab_size)
    useful = sum(o for _, o in trace)
    out = {"requests": len(trace), "prompt_tokens": sum(len(p) for p, _ in trace), "output_tokens": useful,
           "rows": {}}
    print(f"  {len(trace)} requests, {out['prompt_tokens']:,} prompt + {useful:,} output tokens")
    rows = out["rows"]

    def lmfs_engine(kind: str):
        from lmfs.inference import SamplingParams

        llm = engine(kind)
        warm_up(llm)
        params = [SamplingParams(max_tokens=o, temperature=0.0) for _, o in trace]
        outs = []
        seconds = wall(lambda: outs.extend(llm.generate([p for p, _ in trace], params)), device)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
        produced = sum(len(o.token_ids) for o in outs)
        if produced != useful:
            raise RuntimeError(f"the engine produced {produced} tokens, the trace asked for {useful}")
        flags = engine_flags(llm.stats)
        if kind == "plain":
            return {"seconds": seconds, "tokens_per_s": useful / seconds, **flags}
        result["paged_kv"] = paged_memory(llm.stats)  # the statistics of the last generate call
        print(f"  paged KV in use / cached bytes: {result['paged_kv']['kv_in_use_over_cached']:.3f} "
              f"({result['paged_kv']['preemptions']} preemptions)", flush=True)
        print(f"  engine: {flags['prefill_steps']} prefill steps {flags['prefill_seconds']:.2f} s, "
              f"{flags['decode_steps']} decode steps {flags['decode_seconds']:.2f} s "
              f"(mean batch {flags['mean_decode_batch']:.0f})", flush=True)
        return {"seconds": seconds, "tokens_per_s": useful / seconds, **flags}

    _peer(rows, "lmfs engine", lambda: lmfs_engine("fast"))
    _free(device)
    if plain:
        _peer(rows, "lmfs plain runner", lambda: lmfs_engine("plain"))
        _free(device)
        plain_vs_fast(rows, out)
    if hf:
        started, last = time.perf_counter(), 0.0
        for batch in sizes.hf_batch_sizes:
            if time.perf_counter() - started + last > sizes.hf_seconds:
                rows[f"HF static batch {batch}"] = {"error": f"left out: would exceed the {sizes.hf_seconds:.0f} s "
                                                             "budget of the HF batch sizes"}
                print(f"  {'HF static batch ' + str(batch):<28} {rows[f'HF static batch {batch}']['error']}")
                continue
            _peer(rows, f"HF static batch {batch}", lambda batch=batch: hf_batch(model, trace[:batch], device))
            last = rows[f"HF static batch {batch}"].get("seconds", last)
            _free(device)
    hf_rates = {k: r["tokens_per_s"] for k, r in rows.items() if k.startswith("HF") and "tokens_per_s" in r}
    if hf_rates:
        out["hf_best"] = max(hf_rates, key=hf_rates.get)
        out["hf_note"] = "one batch of the trace's first B requests per batch size, tokens/s extrapolated"
        if "tokens_per_s" in rows["lmfs engine"]:
            out["lmfs_vs_hf_best"] = rows["lmfs engine"]["tokens_per_s"] / hf_rates[out["hf_best"]]
    return out


def engine_flags(stats: dict) -> dict:
    """How the engine's last ``generate`` decoded (``llm.stats``): CUDA graphs, the fused decode
    forward, steps overlapped with the host's work, and the device seconds of its decode steps
    against their wall seconds (the rest: the device waiting for the host)."""
    out = {k: stats[k] for k in ("cuda_graphs", "fused_decode")}
    out["overlapped_steps"] = f"{stats['overlapped_steps']}/{stats['decode_steps']}"
    if stats["decode_device_seconds"] is not None and stats["decode_seconds"] > 0:
        out["decode_device_over_wall"] = stats["decode_device_seconds"] / stats["decode_seconds"]
    # where the wall time went: prefill steps (host work included) against decode steps
    out.update({k: stats[k] for k in ("prefill_seconds", "prefill_steps", "decode_seconds", "decode_steps")})
    out["mean_decode_batch"] = stats["decode_tokens"] / max(stats["decode_steps"], 1)
    return out


def warm_up(llm) -> None:
    """One request per batch size up to the engine's ``max_batch_size`` finishing one step apart, so
    the decode batch passes through every size: each CUDA graph is captured before timing starts."""
    from lmfs.inference import SamplingParams

    graphs = getattr(llm.runner, "cuda_graphs", False)   # (the plain runner has none)
    n = llm.scheduler.max_batch_size if graphs else 2  # without graphs one short run warms up enough
    llm.generate([[1 + i % 7] * 4 for i in range(n)], [SamplingParams(max_tokens=i + 1, temperature=0.0)
                                                       for i in range(n)])


def paged_memory(stats: dict) -> dict:
    """KV memory the engine held (whole blocks) against the bytes of the tokens it cached, both summed
    over its decode steps (``llm.stats`` of the trace's ``generate`` call), so the ratio is an average
    over the run."""
    return {"kv_in_use_over_cached": stats["kv_bytes_in_use"] / max(stats["kv_bytes_of_tokens"], 1),
            "preemptions": stats["preemptions"], "decode_steps": stats["decode_steps"],
            "prefill_steps": stats["prefill_steps"]}


# ------------------------------------------------------------------------ (d) speculative decoding

def train_pair(cfg, device: torch.device, seed: int = 0):
    """Lecture 10's target and draft (sizes and training from ``cfg``, its
    :func:`~lmfs.scales.lecture_config`), trained on the same tokens of the stories corpus; returns
    both in eval mode and the tokens."""
    from lmfs.train import TrainConfig, prepare_tokens, train

    tokens = prepare_tokens("stories", n_bytes=cfg.corpus_bytes, vocab_size=cfg.vocab_size, seed=seed)
    run = TrainConfig(steps=cfg.target_steps, batch_size=cfg.batch_size, context_length=cfg.train_context,
                      lr=cfg.lr, warmup_steps=cfg.warmup_steps, eval_batches=cfg.eval_batches, seed=seed)
    models = {}
    for name, fields, steps in (("target", cfg.target, cfg.target_steps), ("draft", cfg.draft, cfg.draft_steps)):
        torch.manual_seed(seed)
        model = TransformerLM(TransformerConfig(vocab_size=tokens.vocab_size, **fields))
        history = train(model, tokens.train, dataclasses.replace(run, steps=steps), val_data=tokens.val,
                        device=device, progress=False)
        models[name] = model.eval()
        print(f"  {name}: {model.num_params() / 1e6:.2f} M parameters, val loss {history.val_loss[-1]:.3f}",
              flush=True)
    return models["target"], models["draft"], tokens


def speculative(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Speculative decoding of lecture 10's trained pair against plain decoding of the target, both
    through :class:`~lmfs.inference.speculative.SpeculativeDecoder` (plain: no draft, ``k = 0``), so
    both run on the same captured steps; each decoder is built once and warmed up (its graph
    captured) before it is timed. ``c``: the draft's plain decoding time over the target's."""
    from lmfs.inference.speculative import SpeculativeDecoder

    cfg = lecture_config("10", sizes.scale)
    target, draft, tokens = train_pair(cfg, device)
    target, draft = target.to(dtype), draft.to(dtype)
    prompt = torch.from_numpy(np.asarray(tokens.val[:16], dtype=np.int64))[None].to(device)
    n, temperature = cfg.spec_tokens, 1.0
    max_len = prompt.shape[1] + n
    gen = torch.Generator(device=device)
    gen.manual_seed(0)

    def timed(decoder) -> tuple[float, list[dict]]:
        """Median seconds of ``n`` new tokens over 3 calls, and each call's stats."""
        decoder.generate(prompt, 8, gen)  # warm-up: captures the graph on a GPU
        stats = []
        seconds = statistics.median(wall(lambda: stats.append(decoder.generate(prompt, n, gen)[1]), device)
                                    for _ in range(3))
        return seconds, stats

    seconds = {name: timed(SpeculativeDecoder(model, None, k=0, max_len=max_len, temperature=temperature))[0]
               for name, model in (("target", target), ("draft", draft))}
    plain, cost = seconds["target"], seconds["draft"] / seconds["target"]
    out = {"target_params": target.num_params(), "draft_params": draft.num_params(),
           "plain_tokens_per_s": n / plain, "draft_cost_ratio": cost, "rows": {}}
    print(f"  plain decoding: target {n / plain:,.1f} tokens/s, draft {n / seconds['draft']:,.1f} tokens/s "
          f"(draft cost per token c = {cost:.2f} of the target's)")
    for k in cfg.spec_k:
        def run_k(k=k):
            t, stats = timed(SpeculativeDecoder(target, draft, k=k, max_len=max_len, temperature=temperature))
            alpha = float(statistics.mean(s["acceptance_rate"] for s in stats))
            return {"tokens_per_s": n / t, "speedup": plain / t, "acceptance_rate": alpha,
                    "tokens_per_target_call": float(statistics.mean(s["tokens_per_target_call"] for s in stats)),
                    "predicted_speedup": predicted_speedup(alpha, k, cost)}

        _peer(out["rows"], f"k={k}", run_k)
    speedups = {name: r["speedup"] for name, r in out["rows"].items() if "speedup" in r}
    if speedups:
        out["best"] = max(speedups, key=speedups.get)
        out["best_speedup"] = speedups[out["best"]]
    return out


def predicted_speedup(alpha: float, k: int, cost: float) -> float:
    """Speed-up of speculative decoding over plain decoding when each draft is accepted with
    probability ``alpha`` independently, ``k`` drafts per target call, and a draft token costs
    ``cost`` target tokens: ``E[tokens per call] / (k·cost + 1)``, ``E = (1 − α^(k+1)) / (1 − α)``."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * cost + 1)


# ----------------------------------------------------------------------------------------- run

PARTS = ("decode", "trace", "paged", "speculative")

def run(device=None, tiny: bool = False, hf: bool = True, parts=PARTS, json_path: str | None = None) -> dict:
    """Run the chosen ``parts`` (of :data:`PARTS`); print each row as it comes, each part's ratios
    when it ends and a summary; rewrite ``json_path`` (if given) after every part; return the numbers."""
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    tiny = tiny or not cuda
    config, sizes = (TINY, CPU_SIZES) if tiny else (LLAMA_1B, GPU_SIZES)
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        print("no CUDA GPU: a tiny model on the CPU, to exercise the code; real numbers need a CUDA GPU")
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "tiny": tiny, "parts": list(parts),
              "model": dataclasses.asdict(config), "sizes": dataclasses.asdict(sizes)}
    if hf:
        try:
            import transformers
            result["transformers"] = transformers.__version__
        except ImportError as err:
            result["hf_note"] = f"Hugging Face transformers not importable ({err}): HF rows left out"
            print(result["hf_note"])
            hf = False
    started = time.perf_counter()

    def part_done():
        result["total_seconds"] = time.perf_counter() - started
        new = {k: v for k, v in ratios(result).items() if k not in result.get("ratios", {})}
        result["ratios"] = ratios(result)
        for name, value in new.items():
            print(f"  -> {name}: {value:.3f} (goal {GOALS.get(name, GOALS['speculative'])})", flush=True)
        save_json(result, json_path)

    model = build_model(config, device, dtype)
    result["params"] = model.num_params()
    engines = {}

    def engine(kind: str):
        """One engine of each ``kind`` for the decode and trace parts: ``"fast"``
        (:func:`lmfs.fast.fast_engine`, its CUDA graphs captured once) or ``"plain"`` (the plain runner)."""
        from lmfs.fast import fast_engine
        from lmfs.inference import LLM

        if kind not in engines:
            engines[kind] = (fast_engine if kind == "fast" else LLM)(model, progress=False)
        return engines[kind]

    print(f"model: {result['params'] / 1e9:.3g} B parameters, {result['dtype']} on {result['device']}")
    if "decode" in parts:
        _section(result, "decode_batch1", lambda: batch1_decode(model, sizes, device, hf, engine))
        _free(device)
        part_done()
    if "trace" in parts or "paged" in parts:  # the paged KV figure comes from the engine's trace run
        _section(result, "trace", lambda: trace_throughput(model, sizes, device, hf and "trace" in parts, result,
                                                           engine, plain="trace" in parts))
        result.setdefault("paged_kv", {"error": "the engine's trace run did not finish"})
        part_done()
    del model
    engines.clear()
    _free(device)
    if "speculative" in parts:
        _section(result, "speculative", lambda: speculative(sizes, device, dtype))
        part_done()
    result["total_seconds"] = time.perf_counter() - started
    result["ratios"] = ratios(result)
    print_summary(result)
    save_json(result, json_path)
    return result


GOALS = {"decode: lmfs / HBM roofline": "≥ 0.70", "decode: lmfs / fastest HF": "≥ 2",
         "trace: lmfs / best static-batch HF": "≥ 10", "paged KV in use / cached bytes": "≤ 1.1",
         "decode: plain runner / fast": "reported", "trace: plain runner / fast": "≥ 0.5",
         "speculative": "≥ 1.8"}


def ratios(result: dict) -> dict:
    """The figures the performance goals are stated in (those that were measured)."""
    out = {}
    decode, trace = result.get("decode_batch1", {}), result.get("trace", {})
    for key, name in (("lmfs_of_roofline", "decode: lmfs / HBM roofline"),
                      ("lmfs_vs_hf_best", "decode: lmfs / fastest HF")):
        if key in decode:
            out[name] = decode[key]
    if "lmfs_vs_hf_best" in trace:
        out["trace: lmfs / best static-batch HF"] = trace["lmfs_vs_hf_best"]
    for part, name in ((decode, "decode"), (trace, "trace")):
        if "plain_vs_fast" in part:
            out[f"{name}: plain runner / fast"] = part["plain_vs_fast"]
    if "kv_in_use_over_cached" in result.get("paged_kv", {}):
        out["paged KV in use / cached bytes"] = result["paged_kv"]["kv_in_use_over_cached"]
    spec = result.get("speculative", {})
    if "best_speedup" in spec:
        out[f"speculative ({spec['best']}) / plain"] = spec["best_speedup"]
    return out


def print_summary(result: dict) -> None:
    print(f"\nsummary ({result['dtype']} on {result['device']}, {result['params'] / 1e9:.3g} B parameters, "
          f"{result['total_seconds']:.0f} s):")
    for name, value in result["ratios"].items():
        print(f"  {name:<40} {value:8.3f}   goal {GOALS.get(name, GOALS['speculative'])}")
    decode = result.get("decode_batch1", {})
    if "hf_best" in decode:
        agree = ", ".join(f"{name} {row['greedy_tokens_equal_lmfs']}" for name, row in decode["rows"].items()
                          if "greedy_tokens_equal_lmfs" in row)
        print(f"  (fastest HF decode: {decode['hf_best']}; greedy tokens equal to lmfs's: {agree})")
    trace = result.get("trace", {})
    if "hf_best" in trace:
        print(f"  (best HF static batching: {trace['hf_best']}; {trace['hf_note']})")
    spec = result.get("speculative", {})
    if "best" in spec:
        row = spec["rows"][spec["best"]]
        print(f"  (speculative: acceptance {row['acceptance_rate']:.2f} at {spec['best']}, predicted speed-up "
              f"{row['predicted_speedup']:.2f} at draft cost c = {spec['draft_cost_ratio']:.2f}; target "
              f"{spec['target_params'] / 1e6:.1f} M, draft {spec['draft_params'] / 1e6:.2f} M parameters)")
    for name in ("decode_batch1", "trace", "paged_kv", "speculative"):
        if "error" in result.get(name, {}):
            print(f"  {name}: ERROR {result[name]['error']}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks inference",
                                     description="batch-1 decode vs the HBM roofline and HF generate; "
                                                 "trace throughput vs HF static batching; paged KV memory; "
                                                 "speculative decoding")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model and trace, also on a GPU")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default: all): {', '.join(PARTS)}")
    parser.add_argument("--skip", default="", help="comma-separated: hf (no Hugging Face rows), spec "
                                                   "(no speculative decoding, as leaving it out of --parts)")
    parser.add_argument("--json", default=None, help="write the results here (rewritten after every part)")
    args = parser.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - {"hf", "spec"}:
        parser.error(f"--skip takes hf and/or spec, got {sorted(skip - {'hf', 'spec'})}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(parts) - set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}, got {sorted(set(parts) - set(PARTS))}")
    if "spec" in skip:
        parts = [p for p in parts if p != "speculative"]
    return run(args.device, tiny=args.tiny, hf="hf" not in skip, parts=tuple(parts), json_path=args.json)
