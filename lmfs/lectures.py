"""The lecture list, notebook hygiene, and running lectures with papermill.

Command line (the Makefile's ``lectures``, ``clean-notebooks`` and ``check-notebooks`` targets)::

    python -m lmfs.lectures run   [--scale smoke|full|auto] [--device auto|cpu|cuda] [--only 01 06]
                                  [--out build] [--timeout 900]
    python -m lmfs.lectures clean  # strip outputs/execution counts from lectures/*.ipynb
    python -m lmfs.lectures check  # report hygiene problems, exit 1 if any
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LECTURE_DIR = REPO / "lectures"


@dataclass(frozen=True)
class Lecture:
    number: str
    stem: str
    title: str
    builds: str

    @property
    def filename(self) -> str:
        return f"{self.stem}.ipynb"


# The seventeen lectures, named as in SYLLABUS.md.
LECTURES = [
    Lecture("01", "01_overview_tokenization", "Overview and tokenization", "lmfs.tokenization: byte-level BPE trainer and tokenizer"),
    Lecture("02", "02_pytorch_resource_accounting", "PyTorch and resource accounting", "lmfs.accounting, lmfs.optim, training-loop pieces"),
    Lecture("03", "03_architectures_hyperparameters", "Architectures and hyperparameters", "lmfs.nn: configurable Transformer LM, HF Llama conversion"),
    Lecture("04", "04_mixture_of_experts", "Mixture of experts", "lmfs.nn.moe: routers, experts, balancing losses"),
    Lecture("05", "05_gpus", "GPUs", "lmfs.bench: timers, bandwidth/matmul probes, roofline, wave quantisation"),
    Lecture("06", "06_kernels_triton", "Kernels and Triton", "lmfs.kernels: Triton GeLU, softmax, RMSNorm, FlashAttention-2"),
    Lecture("07", "07_parallelism_1", "Parallelism 1", "lmfs.parallel: launcher, collectives, bandwidth, cost calculator"),
    Lecture("08", "08_parallelism_2", "Parallelism 2", "lmfs.parallel: DDP, ZeRO/FSDP, tensor, pipeline, expert, ring attention"),
    Lecture("09", "09_scaling_laws_1", "Scaling laws 1", "lmfs.scaling: power-law and Chinchilla fits, IsoFLOP sweeps"),
    Lecture("10", "10_inference", "Inference", "lmfs.inference: KV cache, sampling, quantisation, speculative decoding, batching"),
    Lecture("11", "11_scaling_laws_2", "Scaling laws 2", "lmfs.scaling.mup, WSD schedule"),
    Lecture("12", "12_evaluation", "Evaluation", "lmfs.eval: perplexity, harnesses, pass@k, contamination"),
    Lecture("13", "13_data_1", "Data 1", "lmfs.data: WARC, extraction, language id, PII, quality rules"),
    Lecture("14", "14_data_2", "Data 2", "lmfs.data: n-gram LM, classifiers, DSIR, Bloom filter, MinHash dedup"),
    Lecture("15", "15_alignment_sft_rlhf", "Alignment: SFT and RLHF", "lmfs.alignment: SFT, reward model, DPO"),
    Lecture("16", "16_alignment_rl_1", "Alignment: RL 1", "lmfs.alignment: policy gradients, GRPO"),
    Lecture("17", "17_alignment_rl_2", "Alignment: RL 2", "lmfs.alignment: full GRPO trainer with the inference engine"),
]
LECTURE_FILENAMES = {lec.filename for lec in LECTURES}


def lecture_paths(only: list[str] | None = None) -> list[Path]:
    """The notebooks present in ``lectures/``, in order; ``only`` filters by number or stem."""
    paths = []
    for lec in LECTURES:
        path = LECTURE_DIR / lec.filename
        if not path.exists():
            continue
        if only and not any(key in (lec.number, lec.stem, lec.filename) for key in only):
            continue
        paths.append(path)
    return paths


# ---------------------------------------------------------------- hygiene

def notebook_problems(path: str | os.PathLike) -> list[str]:
    """Why a notebook is not stored clean (empty list when it is).

    Clean means: a known lecture name, valid nbformat 4 JSON, kernel ``python3``, no outputs and
    no execution counts, exactly one cell tagged ``parameters``.
    """
    path = Path(path)
    problems = []
    if path.name not in LECTURE_FILENAMES:
        problems.append(f"{path.name}: not a lecture name from SYLLABUS.md")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        return problems + [f"{path.name}: not readable JSON ({err})"]
    if nb.get("nbformat") != 4:
        problems.append(f"{path.name}: nbformat {nb.get('nbformat')} (expected 4)")
    kernel = nb.get("metadata", {}).get("kernelspec", {}).get("name")
    if kernel != "python3":
        problems.append(f"{path.name}: kernel {kernel!r} (expected 'python3')")
    cells = nb.get("cells", [])
    for i, cell in enumerate(cells):
        if cell.get("cell_type") == "code" and (cell.get("outputs") or cell.get("execution_count") is not None):
            problems.append(f"{path.name}: cell {i} has outputs or an execution count")
    n_params = sum("parameters" in c.get("metadata", {}).get("tags", []) for c in cells)
    if n_params != 1:
        problems.append(f"{path.name}: {n_params} cells tagged 'parameters' (expected exactly 1)")
    return problems


def clean_notebook(path: str | os.PathLike) -> bool:
    """Strip outputs, execution counts and volatile metadata; set kernel python3. True if changed."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {})
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime", "papermill"):
            meta.pop(key, None)
        cell["metadata"] = meta
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
    nb_meta = nb.setdefault("metadata", {})
    for key in ("papermill", "widgets", "toc", "vscode"):
        nb_meta.pop(key, None)
    nb_meta["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb_meta["language_info"] = {"name": "python"}
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if new != raw:
        path.write_text(new, encoding="utf-8")
        return True
    return False


# ---------------------------------------------------------------- running

@dataclass
class RunResult:
    lecture: str
    status: str  # "ok" or "failed"
    seconds: float
    output: str
    error: str = ""


def run_lecture(path: Path, out_dir: Path, scale: str, device: str, timeout: int,
                extra_parameters: dict | None = None) -> RunResult:
    """Execute one notebook with papermill into ``out_dir``; never raises for a failing notebook."""
    import papermill

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    params = {"SCALE": scale, "DEVICE": device, **(extra_parameters or {})}
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(path), str(output), parameters=params, kernel_name="python3",
            cwd=str(path.parent), execution_timeout=timeout, progress_bar=False,
        )
        status, error = "ok", ""
    except Exception as err:  # papermill raises PapermillExecutionError; keep going with the rest
        status, error = "failed", f"{type(err).__name__}: {str(err)[-2000:]}"
    return RunResult(path.stem, status, time.perf_counter() - start, str(output), error)


def format_table(results: list[RunResult]) -> str:
    lines = ["| lecture | status | seconds |", "| --- | --- | ---: |"]
    lines += [f"| {r.lecture} | {r.status} | {r.seconds:.1f} |" for r in results]
    total = sum(r.seconds for r in results)
    lines.append(f"| total ({sum(r.status == 'ok' for r in results)}/{len(results)} ok) | | {total:.1f} |")
    return "\n".join(lines)


def run_lectures(only=None, scale="auto", device="auto", out_dir="build", timeout=900) -> list[RunResult]:
    """Run the lectures present (or ``only`` those), print a status/duration table, write reports."""
    from lmfs.env import resolve_device, resolve_scale

    scale = resolve_scale(scale)
    device = str(resolve_device(device))
    out = Path(out_dir)
    paths = lecture_paths(only)
    if not paths:
        raise SystemExit(f"no lecture notebooks matched {only!r} in {LECTURE_DIR}")
    results = []
    for path in paths:
        print(f"running {path.name} (scale={scale}, device={device}) ...", flush=True)
        res = run_lecture(path, out, scale, device, timeout)
        print(f"  {res.status} in {res.seconds:.1f} s" + (f"\n  {res.error[-600:]}" if res.error else ""), flush=True)
        results.append(res)
    table = format_table(results)
    print(table)
    (out / "lectures.md").write_text(f"scale={scale} device={device}\n\n{table}\n")
    (out / "lectures.json").write_text(json.dumps(
        {"scale": scale, "device": device, "results": [r.__dict__ for r in results]}, indent=1))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmfs.lectures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute lectures with papermill")
    run.add_argument("--scale", default="auto")
    run.add_argument("--device", default="auto")
    run.add_argument("--only", nargs="*", help="lecture numbers or names (default: all present)")
    run.add_argument("--out", default="build")
    run.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    sub.add_parser("clean", help="strip outputs from lectures/*.ipynb")
    sub.add_parser("check", help="list hygiene problems")
    args = parser.parse_args(argv)
    if args.cmd == "run":
        results = run_lectures(args.only, args.scale, args.device, args.out, args.timeout)
        return 0 if all(r.status == "ok" for r in results) else 1
    notebooks = sorted(LECTURE_DIR.glob("*.ipynb"))
    if args.cmd == "clean":
        for path in notebooks:
            if clean_notebook(path):
                print(f"cleaned {path.relative_to(REPO)}")
        return 0
    problems = [p for path in notebooks for p in notebook_problems(path)]
    print("\n".join(problems) if problems else f"{len(notebooks)} notebooks clean")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
