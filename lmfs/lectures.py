"""The lecture list, notebook hygiene, running lectures with papermill, the lecture table, the book.

Command line (what make lectures, book, clean-notebooks and check-notebooks run):

    python -m lmfs.lectures run   [--scale smoke|full|auto] [--device auto|cpu|cuda] [--only 01 06]
                                  [--out build] [--timeout 900]
    python -m lmfs.lectures table --from build/lectures.json [build/gpu/lectures.json]
                                  [--update README.md]
    python -m lmfs.lectures book  --from build --out build/book
    python -m lmfs.lectures clean  # strip outputs/execution counts from lectures/*.ipynb
    python -m lmfs.lectures check  # report hygiene problems, exit 1 if any

The run command writes lectures.json (scale, device, and per lecture: status and seconds) beside
the executed notebooks. The table command turns one or more of those files (say a smoke run on a
CPU and a full run on a GPU) into the README's markdown lecture table; --update replaces the lines
between <!-- lectures:start --> and <!-- lectures:end --> in the given file. The book command
renders the executed notebooks of a folder to HTML pages with an index.html, so the results of a
full-scale run can be read without a GPU.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from lmfs.data.pipeline import write_atomic
from lmfs.results import replace_between

REPO = Path(__file__).resolve().parent.parent
LECTURE_DIR = REPO / "lectures"


@dataclass(frozen=True)
class Lecture:
    number: str
    stem: str
    title: str
    builds: str
    status: str = "ready"  # "ready": the notebook is in lectures/; "planned": not written yet

    @property
    def filename(self) -> str:
        return f"{self.stem}.ipynb"


# The seventeen lectures of the course, in order.
LECTURES = [
    Lecture("01", "01_overview_tokenization", "Overview and tokenization", "lmfs.tokenization: byte-level BPE trainer and tokenizer"),
    Lecture("02", "02_pytorch_resource_accounting", "PyTorch and resource accounting", "lmfs.accounting, lmfs.bench.memory, lmfs.optim, lmfs.train: FLOPs, memory, optimizers, the loop"),
    Lecture("03", "03_architectures_hyperparameters", "Architectures and hyperparameters", "lmfs.nn: configurable Transformer LM, HF Llama conversion; lmfs.train.experiments"),
    Lecture("04", "04_mixture_of_experts", "Mixture of experts", "lmfs.nn.moe: routers, experts, balancing, capacity, grouped dispatch, upcycling"),
    Lecture("05", "05_gpus", "GPUs", "lmfs.bench, lmfs.hardware: timers, bandwidth/matmul probes, roofline, wave quantisation"),
    Lecture("06", "06_kernels_triton", "Kernels and Triton", "lmfs.kernels: Triton GeLU, softmax, RMSNorm, FlashAttention-2; fuse_model"),
    Lecture("07", "07_parallelism_1", "Parallelism 1", "lmfs.parallel: launcher, collectives, bandwidth, cost calculator"),
    Lecture("08", "08_parallelism_2", "Parallelism 2", "lmfs.parallel: DDP, ZeRO/FSDP, tensor, pipeline, expert, ring attention"),
    Lecture("09", "09_scaling_laws_1", "Scaling laws 1", "lmfs.scaling: power-law and Chinchilla fits, IsoFLOP sweeps, critical batch size"),
    Lecture("10", "10_inference", "Inference", "lmfs.inference: KV cache, paged continuous batching, sampling, quantisation, speculative decoding"),
    Lecture("11", "11_scaling_laws_2", "Scaling laws 2", "lmfs.scaling.mup: μP, coordinate checks, learning-rate transfer, WSD from checkpoints"),
    Lecture("12", "12_evaluation", "Evaluation", "lmfs.eval: perplexity, harnesses, sandboxed code execution, pass@k, contamination, lm-eval adapter"),
    Lecture("13", "13_data_1", "Data 1", "lmfs.data: WARC, extraction, language id, PII, Gopher and C4 rules"),
    Lecture("14", "14_data_2", "Data 2", "lmfs.data: Kneser-Ney n-gram LM, quality classifier, DSIR, Bloom filter, MinHash dedup, sharded pipeline"),
    Lecture("15", "15_alignment_sft_rlhf", "Alignment: SFT and RLHF", "lmfs.alignment: SFT, reward model, DPO"),
    Lecture("16", "16_alignment_rl_1", "Alignment: RL 1", "lmfs.alignment: policy gradients, GRPO"),
    Lecture("17", "17_alignment_rl_2", "Alignment: RL 2", "lmfs.alignment: full GRPO trainer with the inference engine"),
]
LECTURE_FILENAMES = {lec.filename for lec in LECTURES}


def lecture_paths(only: list[str] | None = None) -> list[Path]:
    """The notebooks present in ``lectures/``, in order; ``only`` filters by number or stem.

    A key of ``only`` that names no lecture raises ``ValueError`` saying so (with the lecture it
    probably means: ``1`` -> ``01``), instead of being skipped.
    """
    unknown = [key for key in (only or []) if not any(key in (lec.number, lec.stem, lec.filename) for lec in LECTURES)]
    if unknown:
        hints = []
        for key in unknown:
            guess = key.zfill(2) if key.isdigit() else None
            hint = f"{key!r}" + (f" (did you mean {guess}?)" if guess in {lec.number for lec in LECTURES} else "")
            hints.append(hint)
        raise ValueError(f"no lecture {', '.join(hints)}: name lectures by number, "
                         f"{LECTURES[0].number} to {LECTURES[-1].number}, or by notebook name")
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
        problems.append(f"{path.name}: not a lecture name (see lmfs.lectures.LECTURES)")
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
    peak_gpu_gib: float | None = None   # GPU memory reserved at the peak, all the run's processes added up


# Arguments for the kernel's command line. ipykernel logs "Kernel is running over TCP without
# encryption ..." at every start (its own log, not a Python warning, so no warning filter reaches
# it), which buries the lecture table of ``make lectures``. Its log at ERROR level drops that line
# and keeps real errors; what the notebook's cells print or warn still goes to their outputs.
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=ERROR"]


def run_lecture(path: Path, out_dir: Path, scale: str, device: str, timeout: int,
                extra_parameters: dict | None = None) -> RunResult:
    """Execute one notebook with papermill into ``out_dir``; never raises for a failing notebook.

    The kernel starts in the environment the user started Python with (:func:`lmfs.env.kernel_environment`),
    not with the switches ``import lmfs`` set in this process, as a kernel in JupyterLab would."""
    import papermill

    from lmfs.env import PEAK_DIR_VAR, kernel_environment, read_peak_memory

    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    params = {"SCALE": scale, "DEVICE": device, **(extra_parameters or {})}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmfs-peaks-") as peaks:
        try:
            # Each process of the run (the kernel, and workers it starts) writes its peak GPU memory
            # into ``peaks`` when it exits (lmfs.env).
            with kernel_environment(), mock.patch.dict(os.environ, {PEAK_DIR_VAR: peaks}):
                papermill.execute_notebook(
                    str(path), str(output), parameters=params, kernel_name="python3",
                    cwd=str(path.parent), execution_timeout=timeout, progress_bar=False,
                    extra_arguments=KERNEL_ARGUMENTS,
                )
            status, error = "ok", ""
        except Exception as err:  # papermill raises PapermillExecutionError; keep going with the rest
            printed = failing_cell_output(output)
            status, error = "failed", (f"{type(err).__name__}: {str(err)[-2000:]}"
                                       + (f"\nthe failing cell printed: {printed}" if printed else ""))
        seconds = time.perf_counter() - start
        if device.startswith("cuda"):   # the kernel may still be writing as it shuts down
            for _ in range(20):
                if read_peak_memory(peaks)[1]:
                    break
                time.sleep(0.25)
        peak, _ = read_peak_memory(peaks)
    return RunResult(path.stem, status, seconds, str(output), error, peak)


def failing_cell_output(path: Path, limit: int = 800) -> str:
    """The end of what the cell that raised printed before it raised (its stdout/stderr streams), read
    from the executed notebook at ``path``; "" if there is none. A failed check's numbers are
    usually printed just before its assert, and the traceback alone does not show them."""
    try:
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError):
        return ""
    for cell in cells:
        outputs = cell.get("outputs", [])
        if any(o.get("output_type") == "error" for o in outputs):
            text = "".join("".join(o.get("text", "")) for o in outputs if o.get("output_type") == "stream")
            return text.strip()[-limit:]
    return ""


def format_table(results: list[RunResult]) -> str:
    gpu = any(r.peak_gpu_gib is not None for r in results)
    lines = ["| lecture | status | seconds |" + (" peak GPU GiB |" if gpu else ""),
             "| --- | --- | ---: |" + (" ---: |" if gpu else "")]
    for r in results:
        peak = "" if r.peak_gpu_gib is None else f"{r.peak_gpu_gib:.1f}"
        lines.append(f"| {r.lecture} | {r.status} | {r.seconds:.1f} |" + (f" {peak} |" if gpu else ""))
    total = sum(r.seconds for r in results)
    lines.append(f"| total ({sum(r.status == 'ok' for r in results)}/{len(results)} ok) | | {total:.1f} |"
                 + (" |" if gpu else ""))
    return "\n".join(lines)


# Lectures that must run one after another, in this order, when lectures run side by side: 16 and
# 17 reuse the base and SFT models that 15 trains and caches (lmfs.alignment), and would each train
# them at the same time otherwise.
CHAINS = (("15", "16", "17"),)


def _chains(paths: list[Path]) -> list[list[Path]]:
    """``paths`` grouped into the runs that go one after another (:data:`CHAINS`), longest first."""
    number = {lec.stem: lec.number for lec in LECTURES}
    groups: list[list[Path]] = []
    placed: dict[tuple[str, ...], list[Path]] = {}
    for path in paths:
        chain = next((c for c in CHAINS if number.get(path.stem) in c), None)
        if chain is None:
            groups.append([path])
        elif chain in placed:
            placed[chain].append(path)
        else:
            placed[chain] = [path]
            groups.append(placed[chain])
    return sorted(groups, key=len, reverse=True)   # (a stable sort: otherwise in the order given)


def _write_reports(out: Path, scale: str, device: str, results: list[RunResult]) -> str:
    """Rewrite ``out``'s lectures.md and .json whole (run --jobs reads them as they change); return the table."""
    table = format_table(results)
    write_atomic(out / "lectures.md", [f"scale={scale} device={device}\n\n{table}\n"])
    write_atomic(out / "lectures.json", [json.dumps(
        {"scale": scale, "device": device, "results": [r.__dict__ for r in results]}, indent=1)])
    return table


def run_lectures(only=None, scale="auto", device="auto", out_dir="build", timeout=900, jobs=1) -> list[RunResult]:
    """Run the lectures present (or ``only`` those), print a status/duration table, write reports.

    ``jobs`` > 1 runs that many lectures at a time, each group in its own process (on one GPU they
    share it, so their times are longer than alone); the lectures of a :data:`CHAINS` entry run one
    after another in one group. The reports are rewritten as each lecture finishes, so a run
    stopped part-way keeps what finished."""
    from lmfs.env import resolve_device, resolve_scale

    scale = resolve_scale(scale)
    device = str(resolve_device(device))
    out = Path(out_dir)
    paths = lecture_paths(only)
    if not paths:
        raise SystemExit(f"no lecture notebooks matched {only!r} in {LECTURE_DIR}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    out.mkdir(parents=True, exist_ok=True)
    order = {path.stem: i for i, path in enumerate(paths)}
    results: dict[str, RunResult] = {}

    def finished(res: RunResult) -> None:
        results[res.lecture] = res
        _write_reports(out, scale, device, sorted(results.values(), key=lambda r: order[r.lecture]))

    if jobs == 1:
        for path in paths:
            print(f"running {path.name} (scale={scale}, device={device}) ...", flush=True)
            res = run_lecture(path, out, scale, device, timeout)
            finished(res)   # (before the line below: a parent process reads the report when it sees it)
            print(f"  {res.status} in {res.seconds:.1f} s" + (f"\n  {res.error[-600:]}" if res.error else ""), flush=True)
    else:
        _run_side_by_side(_chains(paths), out, scale, device, timeout, jobs, finished)
    ordered = sorted(results.values(), key=lambda r: order[r.lecture])
    print(_write_reports(out, scale, device, ordered))
    print(f"executed notebooks, lectures.md and lectures.json in {out.resolve()}/ "
          "(`make book` turns them into HTML pages)")
    return ordered


def _run_side_by_side(groups: list[list[Path]], out: Path, scale: str, device: str, timeout: int, jobs: int,
                      finished) -> None:
    """Each group of lectures by a ``python -m lmfs.lectures run`` of its own, ``jobs`` at a time,
    into ``out/.jobs/<first lecture>/``; each executed notebook is moved to ``out`` and its result
    handed to ``finished`` as soon as its process reports it. The processes start in the environment
    the user started Python with (:func:`lmfs.env.kernel_environment`), as their kernels must."""
    import shutil
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lmfs.env import kernel_environment

    with kernel_environment():
        env = dict(os.environ)
    # The cores shared out among the groups (unless the user chose): torch's default of one thread
    # per core in each of several kernels slows them all down.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    lock = threading.Lock()

    def run_group(group: list[Path]) -> None:
        folder = out / ".jobs" / group[0].stem
        shutil.rmtree(folder, ignore_errors=True)
        cmd = [sys.executable, "-m", "lmfs.lectures", "run", "--scale", scale, "--device", device,
               "--timeout", str(timeout), "--out", str(folder), "--only", *(p.stem for p in group)]
        seen: set[str] = set()

        def collect() -> None:
            report = folder / "lectures.json"
            if not report.is_file():
                return
            for r in json.loads(report.read_text())["results"]:
                if r["lecture"] in seen:
                    continue
                seen.add(r["lecture"])
                notebook = folder / f"{r['lecture']}.ipynb"
                if notebook.is_file():
                    shutil.move(str(notebook), out / notebook.name)
                    r["output"] = str(out / notebook.name)
                with lock:
                    finished(RunResult(**r))

        tag = f"[{group[0].stem[:2]}]"
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                print(f"{tag} {line}", end="", flush=True)
                if line.startswith("  ") and (" ok in " in line or " failed in " in line):
                    collect()
        collect()
        for path in group:   # a lecture its process never reported (it was killed, or failed to start)
            if path.stem not in seen:
                with lock:
                    finished(RunResult(path.stem, "failed", 0.0, "",
                                       f"its process (python -m lmfs.lectures run) exited with code {proc.returncode} "
                                       "before reporting it"))
        shutil.rmtree(folder, ignore_errors=True)   # its notebooks moved, its results handed on

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in [pool.submit(run_group, group) for group in groups]:
            future.result()


# ---------------------------------------------------------------- the README's lecture table

TABLE_START, TABLE_END = "<!-- lectures:start -->", "<!-- lectures:end -->"


def format_seconds(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``: durations as the lecture table shows them."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"


def load_runs(paths) -> dict[str, dict[str, dict]]:
    """Read ``lectures.json`` files of ``run``: ``{scale: {lecture number: result}}``.

    A later file overrides an earlier one for the same scale and lecture.
    """
    by_stem = {lec.stem: lec.number for lec in LECTURES}
    runs: dict[str, dict[str, dict]] = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        scale = report["scale"]
        for result in report["results"]:
            number = by_stem.get(result["lecture"])
            if number is not None:  # a notebook that is no lecture (a test's) has no row
                runs.setdefault(scale, {})[number] = {**result, "device": report.get("device", "")}
    return runs


def _time_cell(result: dict | None) -> str:
    if result is None:
        return ""
    text = f"{format_seconds(result['seconds'])} ({result['device']})"
    return text if result["status"] == "ok" else f"{text}, failed"


def _peak_cell(result: dict | None) -> str:
    peak = (result or {}).get("peak_gpu_gib")
    return "" if peak is None else f"{peak:.1f} GiB"


def lecture_table(runs: dict[str, dict[str, dict]]) -> str:
    """The markdown lecture table: lecture, what it builds in lmfs, status, smoke and full times.

    Status is ``planned`` for a lecture not written yet; otherwise ``runs`` when every run of it in
    ``runs`` passed, ``fails at <scale>`` when one failed, and ``not run`` without any run.
    A time cell says the device it was measured on (``15 s (cpu)``).
    """
    lines = ["| lecture | builds | status | smoke | full | peak GPU memory (full) |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    for lec in LECTURES:
        smoke, full = (runs.get(scale, {}).get(lec.number) for scale in ("smoke", "full"))
        failed = [scale for scale, r in (("smoke", smoke), ("full", full)) if r and r["status"] != "ok"]
        if lec.status == "planned":
            status = "planned"
        elif smoke is None and full is None:
            status = "not run"
        else:
            status = f"fails at {' and '.join(failed)}" if failed else "runs"
        lines.append(f"| {lec.number} {lec.title} | {lec.builds} | {status} | "
                     f"{_time_cell(smoke)} | {_time_cell(full)} | {_peak_cell(full)} |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """Put ``block`` between the lecture-table markers of ``text`` (the markers stay)."""
    return replace_between(text, TABLE_START, TABLE_END, block)


# ---------------------------------------------------------------- the book

@dataclass
class BookEntry:
    lecture: Lecture
    page: str  # the HTML file name, "" when there is no executed notebook
    scale: str
    status: str
    seconds: float | None


def _papermill_facts(nb) -> tuple[str, str, float | None]:
    """Scale, status and duration of an executed notebook, read from papermill's metadata."""
    meta = nb.metadata.get("papermill", {})
    scale = str(meta.get("parameters", {}).get("SCALE", "?"))
    if "exception" not in meta:
        return scale, "executed", meta.get("duration")
    return scale, "failed" if meta["exception"] else "ok", meta.get("duration")


_BOOK_CSS = """body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: .3rem .6rem; text-align: left; }
td.num { text-align: right; } .failed { color: #b00; font-weight: bold; } .planned, .not-run { color: #777; }"""


def build_book(from_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[BookEntry]:
    """Render the executed lecture notebooks in ``from_dir`` to ``out_dir``: one HTML page per
    lecture (outputs and plots embedded) and ``index.html`` with the lecture table.

    Scale, status and duration come from the metadata papermill stores in each executed
    notebook, so the book needs nothing but the notebooks. Lectures without one are listed as
    ``planned`` or ``not run``.
    """
    import nbformat
    from nbconvert import HTMLExporter

    src, out = Path(from_dir), Path(out_dir)
    found = [lec for lec in LECTURES if (src / lec.filename).exists()]
    if not found:
        raise SystemExit(f"no executed lecture notebooks in {src}/: run `make lectures` (or the GPU "
                         "suite) first, or point --from at their folder")
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    back = '<p style="margin:1rem"><a href="index.html">&larr; all lectures</a></p>'
    entries = []
    for lec in LECTURES:
        if lec not in found:
            entries.append(BookEntry(lec, "", "", lec.status if lec.status == "planned" else "not run", None))
            continue
        nb = nbformat.read(src / lec.filename, as_version=4)
        scale, status, seconds = _papermill_facts(nb)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": f"{lec.number} {lec.title}"}})
        # A link back to the index, right after the opening <body ...> tag.
        body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + back, body, count=1)
        page = f"{lec.stem}.html"
        (out / page).write_text(body, encoding="utf-8")
        entries.append(BookEntry(lec, page, scale, status, seconds))

    rows = []
    for e in entries:
        name = f"{e.lecture.number} {html.escape(e.lecture.title)}"
        link = f'<a href="{e.page}">{name}</a>' if e.page else name
        duration = format_seconds(e.seconds) if e.seconds is not None else ""
        rows.append(f'<tr><td>{link}</td><td>{html.escape(e.lecture.builds)}</td><td>{html.escape(e.scale)}</td>'
                    f'<td class="{e.status.replace(" ", "-")}">{e.status}</td><td class="num">{duration}</td></tr>')
    index = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>lmfs: the executed lectures</title>
<style>{_BOOK_CSS}</style></head>
<body>
<h1>lmfs: the executed lectures</h1>
<p>Each page is a lecture notebook as it ran, outputs and plots included; the scale says whether it
ran at <code>smoke</code> (a minute on a CPU) or <code>full</code> scale (the real results, on a GPU).</p>
<table>
<tr><th>lecture</th><th>builds</th><th>scale</th><th>status</th><th>duration</th></tr>
{chr(10).join(rows)}
</table>
</body></html>
"""
    (out / "index.html").write_text(index, encoding="utf-8")
    return entries


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
    run.add_argument("--jobs", type=int, default=1,
                     help="lectures run at a time, each in its own kernel (15, 16, 17 still one after another)")
    table = sub.add_parser("table", help="the markdown lecture table from run reports")
    table.add_argument("--from", dest="reports", nargs="+", required=True, metavar="LECTURES_JSON",
                       help="lectures.json files written by `run` (e.g. a smoke and a full run)")
    table.add_argument("--update", metavar="FILE",
                       help=f"replace the lines between {TABLE_START} and {TABLE_END} in FILE")
    book = sub.add_parser("book", help="executed notebooks -> HTML pages and index.html")
    book.add_argument("--from", dest="src", default="build", help="folder of executed notebooks")
    book.add_argument("--out", default="build/book")
    sub.add_parser("clean", help="strip outputs from lectures/*.ipynb")
    sub.add_parser("check", help="list hygiene problems")
    args = parser.parse_args(argv)
    if args.cmd == "run":
        from lmfs.env import SCALES, resolve_device

        # Bad arguments get one line naming the option (and the make variable that sets it), not a traceback.
        if args.scale.strip().lower() not in (*SCALES, "auto"):
            run.exit(2, f"{run.prog}: error: --scale {args.scale} (make: SCALE=) is not one of "
                        f"{', '.join(SCALES)}, auto\n")
        try:
            resolve_device(args.device)
            lecture_paths(args.only)
        except (ValueError, RuntimeError) as err:
            option = "--device (make: DEVICE=)" if "device" in str(err) else "--only (make: ONLY=)"
            run.exit(2, f"{run.prog}: error: {option}: {err}\n")
        if args.jobs < 1:
            run.exit(2, f"{run.prog}: error: --jobs (make: JOBS=) must be at least 1, got {args.jobs}\n")
        results = run_lectures(args.only, args.scale, args.device, args.out, args.timeout, args.jobs)
        return 0 if all(r.status == "ok" for r in results) else 1
    if args.cmd == "table":
        block = lecture_table(load_runs(args.reports))
        if args.update:
            target = Path(args.update)
            target.write_text(replace_block(target.read_text(encoding="utf-8"), block), encoding="utf-8")
            print(f"lecture table written into {target}")
        else:
            print(block)
        return 0
    if args.cmd == "book":
        # The book shows failed lectures too (their error output is the point); it is the run
        # that fails on them, not the rendering.
        pages = [e for e in build_book(args.src, args.out) if e.page]
        for e in pages:
            print(f"  {e.page}: {e.status} at scale {e.scale}")
        print(f"{len(pages)} lecture pages and index.html in {args.out}/")
        return 0
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
