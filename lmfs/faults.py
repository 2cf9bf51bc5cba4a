"""Planted faults: each lecture must fail when the lmfs function it teaches is broken.

A notebook's ``assert`` cells are only worth something if they can fail. :data:`FAULTS` lists, for
each lecture, one small edit of lmfs's source that breaks the idea the lecture teaches (a BPE
tie-break flipped, RMSNorm without its square root, ...). The runner copies ``lmfs/`` into a
temporary folder, applies one edit there (the working tree is never touched), runs the lecture at
smoke scale with papermill with that copy first on ``PYTHONPATH``, and expects the lecture to fail::

    python -m lmfs.faults [--only 01 04] [--timeout 300]     # or: make check-lectures ONLY="01 04"

It prints one row per fault: lecture, fault, caught (yes/no), seconds and the error that stopped the
lecture (so one can tell an assert that caught the fault from an unrelated crash). The exit status
is 0 when every fault was caught.

Adding a fault: append a :class:`Fault` to :data:`FAULTS`. ``old`` must occur exactly once in
``path`` (``tests/test_faults.py`` checks that for every entry, so a fault whose code moved is noticed
without running any lecture); ``new`` is what replaces it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Fault:
    """One planted fault: in ``path`` (relative to the repository root, under ``lmfs/``), the text
    ``old`` (which must occur exactly once) becomes ``new``; ``lecture`` (its number) must then fail."""

    lecture: str
    path: str
    old: str
    new: str
    what: str


FAULTS: list[Fault] = [
    Fault("01", "lmfs/tokenization/train.py",
          "a, b = max(top, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))",
          "a, b = min(top, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))",
          "BPE tie-break flipped (the least pair wins)"),
    Fault("02", "lmfs/optim/optimizers.py",
          "denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)\n        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))",
          "denom = v.sqrt().add_(eps)\n        p.addcdiv_(m, denom, value=-lr)",
          "AdamW without bias correction"),
    Fault("03", "lmfs/nn/layers.py",
          "x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)",
          "x32 = x32 / (x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)",
          "RMSNorm without the square root"),
    Fault("04", "lmfs/nn/moe.py",
          "return probs.shape[-1] * (f * P).sum()",
          "return (f * P).sum()",
          "Switch balancing loss without the factor E"),
    Fault("05", "lmfs/bench/roofline.py",
          "waves = math.ceil(tiles / n_sm)",
          "waves = round(tiles / n_sm)",
          "waves rounded to nearest (a small partial last wave not counted)"),
    Fault("06", "lmfs/kernels/flash_attention.py",
          "visible = offs_m[:, None] >= offs_n[None, :]",
          "visible = offs_m[:, None] > offs_n[None, :]",
          "Triton FlashAttention forward: causal mask off by one (the diagonal masked)"),
    Fault("07", "lmfs/parallel/collectives.py",
          'BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,',
          'BUS_FACTOR = {"all_reduce": lambda n: (n - 1) / n,',
          "all-reduce bus factor (n-1)/n instead of 2(n-1)/n"),
    Fault("08", "lmfs/parallel/ddp.py",
          "comm.all_reduce(p.grad, group=self.group)\n            p.grad.div_(n)",
          "comm.all_reduce(p.grad, group=self.group)",
          "DDP all-reduce without the division by the world size"),
    Fault("09", "lmfs/scaling/fits.py",
          "    log_n, log_d, log_l = np.log(N), np.log(D), np.log(L)",
          "    log_n, log_d, log_l = np.log(D), np.log(N), np.log(L)",
          "Chinchilla fit with N and D swapped"),
    Fault("10", "lmfs/inference/runner.py",
          "        positions, key_positions = i, j",
          "        positions, key_positions = i + 1, j",
          "KV-cache decoding: the new tokens' positions off by one"),
    Fault("11", "lmfs/scaling/mup.py",
          '        return 1 / self.width_mult if self.role == "hidden" else 1.0',
          '        return 1 / math.sqrt(self.width_mult) if self.role == "hidden" else 1.0',
          "μP hidden learning rate 1/√m instead of 1/m"),
    Fault("12", "lmfs/eval/metrics.py",
          "    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))",
          "    return 1.0 - (1.0 - c / n) ** k",
          "pass@k: the biased estimator 1 - (1 - c/n)^k"),
    Fault("13", "lmfs/data/rules.py",
          "    if n < t.min_words:",
          "    if n > t.min_words:",
          "Gopher minimum-word rule inverted"),
    Fault("14", "lmfs/data/dedup.py",
          "            for col in range(j * rows, (j + 1) * rows):",
          "            for col in range(j * rows, (j + 1) * rows - 1):",
          "MinHash LSH: each band hashes one row too few"),
    Fault("15", "lmfs/alignment/preference.py",
          "-F.logsigmoid(chosen - rejected).mean()",
          "-F.logsigmoid(rejected - chosen).mean()",
          "DPO with the margin's sign flipped"),
    Fault("16", "lmfs/alignment/pg.py",
          "    centred = groups - groups.mean(dim=1, keepdim=True)",
          "    centred = groups",
          "GRPO advantage without the group mean"),
    Fault("17", "lmfs/alignment/grpo.py",
          "per_token = per_token + c.kl_coef * kl",
          "per_token = per_token - c.kl_coef * kl",
          "GRPO trainer adds the KL penalty with the wrong sign"),
]


def fault_source(fault: Fault, root: Path = REPO) -> str:
    """The text of ``fault.path`` under ``root`` with the fault applied; errors if ``old`` does not
    occur exactly once or the path is not inside ``lmfs/``."""
    if not fault.path.startswith("lmfs/") or ".." in Path(fault.path).parts:
        raise ValueError(f"fault {fault.what!r}: path {fault.path!r} must be a file under lmfs/")
    file = root / fault.path
    if not file.is_file():
        raise FileNotFoundError(f"fault {fault.what!r}: {fault.path} does not exist")
    text = file.read_text(encoding="utf-8")
    count = text.count(fault.old)
    if count != 1:
        raise ValueError(f"fault {fault.what!r}: the text to replace occurs {count} times in {fault.path} "
                         f"(it must occur exactly once; has the code changed?):\n{fault.old}")
    if fault.new == fault.old:
        raise ValueError(f"fault {fault.what!r}: new text equals old text")
    return text.replace(fault.old, fault.new)


def plant(fault: Fault, dest: Path) -> Path:
    """A copy of the repository in ``dest`` with ``fault`` applied: ``lmfs/`` copied, every other
    top-level entry (lectures, data, results, ...) linked. Returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    faulty = fault_source(fault)
    shutil.copytree(REPO / "lmfs", dest / "lmfs", ignore=shutil.ignore_patterns("__pycache__"))
    for entry in REPO.iterdir():
        if entry.name not in ("lmfs", ".git", ".venv", "build") and not (dest / entry.name).exists():
            (dest / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (dest / fault.path).write_text(faulty, encoding="utf-8")
    return dest


@contextlib.contextmanager
def _python_path_first(folder: Path):
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(folder) + (os.pathsep + previous if previous else "")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


def _failing_line(traceback: list[str]) -> str:
    """The notebook line that raised (IPython marks it ``---->``), without terminal colours."""
    for entry in traceback or []:
        for line in re.sub(r"\x1b\[[0-9;]*m", "", entry).splitlines():
            if line.lstrip().startswith("---->") or line.lstrip().startswith("--->"):
                return f" at `{line.split('>', 1)[1].strip().lstrip('0123456789').strip()}`"
    return ""


@dataclass
class FaultResult:
    fault: Fault
    caught: bool
    seconds: float
    error: str  # the exception that stopped the lecture ("" when it ran to the end)


def run_fault(fault: Fault, timeout: int = 300) -> FaultResult:
    """Run ``fault.lecture`` at smoke scale on the CPU against a copy of lmfs with ``fault`` planted."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    from lmfs.env import kernel_environment
    from lmfs.lectures import KERNEL_ARGUMENTS, LECTURES

    lecture = next((lec for lec in LECTURES if lec.number == fault.lecture), None)
    if lecture is None:
        raise ValueError(f"fault {fault.what!r}: no lecture numbered {fault.lecture!r}")
    with tempfile.TemporaryDirectory(prefix="lmfs-fault-") as tmp:
        root = plant(fault, Path(tmp) / "repo")
        notebook = root / "lectures" / lecture.filename
        start = time.perf_counter()
        error = ""
        with kernel_environment(), _python_path_first(root):
            try:
                papermill.execute_notebook(
                    str(notebook), str(Path(tmp) / lecture.filename), parameters={"SCALE": "smoke", "DEVICE": "cpu"},
                    kernel_name="python3", cwd=str(notebook.parent), execution_timeout=timeout,
                    progress_bar=False, extra_arguments=KERNEL_ARGUMENTS)
            except PapermillExecutionError as err:
                error = f"cell {err.exec_count}: {err.ename}: {err.evalue}{_failing_line(err.traceback)}"
            except Exception as err:  # a cell past its timeout, a dead kernel: the lecture failed too
                error = f"{type(err).__name__}: {err}"
        seconds = time.perf_counter() - start
    return FaultResult(fault, bool(error), seconds, " ".join(error.split()))


def format_results(results: list[FaultResult], width: int = 110) -> str:
    lines = ["| lecture | fault | caught | seconds | what stopped the lecture |", "| --- | --- | --- | ---: | --- |"]
    for r in results:
        error = r.error if len(r.error) <= width else r.error[:width - 1] + "…"
        lines.append(f"| {r.fault.lecture} | {r.fault.what} | {'yes' if r.caught else 'NO'} | {r.seconds:.0f} | "
                     f"{error.replace('|', '/')} |")
    lines.append(f"| {sum(r.caught for r in results)}/{len(results)} caught | | | "
                 f"{sum(r.seconds for r in results):.0f} | |")
    return "\n".join(lines)


def select(only: list[str] | None) -> list[Fault]:
    """The faults of the lectures in ``only`` (numbers such as ``"01"`` or ``"1"``), or all."""
    if not only:
        return list(FAULTS)
    wanted = {w.zfill(2) for item in only for w in item.replace(",", " ").split()}
    chosen = [f for f in FAULTS if f.lecture in wanted]
    missing = wanted - {f.lecture for f in chosen}
    if missing:
        raise SystemExit(f"no planted fault for lecture(s) {', '.join(sorted(missing))}; "
                         f"faults exist for {', '.join(sorted({f.lecture for f in FAULTS}))}")
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmfs.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="lecture numbers (default: every lecture with a fault)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    args = parser.parse_args(argv)
    faults = select(args.only)
    for fault in faults:  # every edit must apply before anything runs
        fault_source(fault)
    results = []
    for fault in faults:
        print(f"lecture {fault.lecture}: {fault.what} ...", flush=True)
        res = run_fault(fault, args.timeout)
        print(f"  {'caught' if res.caught else 'NOT CAUGHT'} in {res.seconds:.0f} s"
              + (f": {res.error[:300]}" if res.error else ""), flush=True)
        results.append(res)
    print(format_results(results))
    return 0 if all(r.caught for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
