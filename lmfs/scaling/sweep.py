"""A sweep runner: train a grid of small models (sizes × FLOP budgets) and keep every result.

>>> runs = plan_sweep(sizes, budgets, base, tokens_per_step=4096)        # doctest: +SKIP
>>> records = run_sweep(runs, "sweeps/isoflop", data, options)           # doctest: +SKIP
>>> frame = sweep_frame(records)                                          # doctest: +SKIP

* :func:`plan_sweep` turns model sizes and budgets ``C`` into runs: with ``C = 6·N·D``, a model of
  ``N`` parameters gets ``D = C / 6N`` tokens, so ``steps = D / tokens_per_step``.
* :func:`run_sweep` trains the runs that are not finished yet and writes one JSON record per
  run into a folder: the loss curve (compute against smoothed training loss), the final
  validation loss, sizes and time. Each record is written to a temporary name and renamed, so a
  record file is always complete; a run killed half-way leaves no record and is trained again,
  and a damaged record (one that does not parse) is treated the same way. Rerunning an
  interrupted sweep therefore redoes only what is missing.
* With ``workers > 1`` the runs go to that many processes. Small models leave a GPU mostly idle
  (each step is a few tiny kernels and a lot of Python), so several processes issuing kernels at
  once keep it busier. On a CPU one worker is the sensible choice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lmfs.accounting import param_count
from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.train import TrainConfig, smooth, train


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """How every run of a sweep trains (all runs share them, so they differ only in size and budget)."""

    batch_size: int = 16
    context_length: int = 64
    lr: float = 3e-3
    warmup_fraction: float = 0.05     # of each run's steps
    eval_batches: int = 8             # final validation loss: mean over this many fixed batches
    curve_points: int = 40            # points kept per loss curve
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length


def run_key(model: dict, budget: float) -> str:
    """A file-safe name for one run, e.g. ``d64-l2-h4-C3.00e+12``."""
    name = f"d{model['d_model']}-l{model['n_layers']}-h{model['n_heads']}-C{budget:.2e}"
    return re.sub(r"[^A-Za-z0-9.+-]", "_", name)


def plan_sweep(sizes: list[dict], budgets: list[float], base: TransformerConfig, options: SweepOptions,
               min_steps: int = 10, max_steps: int | None = None) -> list[dict]:
    """The runs of a sizes × budgets grid: one dict per run with its ``key``, ``model`` fields,
    ``params`` ``N``, ``budget`` ``C``, ``tokens`` ``D = C / 6N`` and ``steps``.

    ``sizes`` are changes to ``base`` (``dict(d_model=64, n_layers=2, n_heads=4)``). ``N`` counts
    every parameter of the model (Chinchilla's convention; Kaplan et al. left out the embeddings).
    A run with fewer than ``min_steps`` steps is left out with a note: its loss would say more
    about warmup than about the model. A run with more than ``max_steps`` steps (a small model at a
    large budget, far below that budget's optimum and the costliest run of the grid) is left out
    with a note too, when ``max_steps`` is given.
    """
    runs = []
    for budget in budgets:
        for size in sizes:
            config = dataclasses.replace(base, **size)
            model = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
            n = param_count(config)
            steps = int(round(budget / (6 * n * options.tokens_per_step)))
            if steps < min_steps:
                print(f"left out: {run_key(model, budget)} would train {steps} steps (< {min_steps})")
                continue
            if max_steps is not None and steps > max_steps:
                print(f"left out: {run_key(model, budget)} would train {steps} steps (> {max_steps})")
                continue
            runs.append(dict(key=run_key(model, budget), model=model, params=n, budget=float(budget),
                             tokens=steps * options.tokens_per_step, steps=steps))
    if not runs:
        raise ValueError("every run of the grid is shorter than min_steps: raise the budgets or shrink "
                         "the models or the batch")
    return runs


def _record_path(out_dir: Path, key: str) -> Path:
    return out_dir / f"run-{key}.json"


def write_record(out_dir: str | os.PathLike, record: dict) -> Path:
    """Write ``record`` to ``out_dir/run-<key>.json`` atomically (temporary file, then rename)."""
    path = _record_path(Path(out_dir), record["key"])
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old state or the whole new file
    return path


def load_records(out_dir: str | os.PathLike) -> dict[str, dict]:
    """Finished runs in ``out_dir``: ``{key: record}``. Temporary files are skipped, and so is a
    record that does not parse or lacks its final loss (a damaged file is not a finished run)."""
    records = {}
    for path in sorted(Path(out_dir).glob("run-*.json")):
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and "final_loss" in record and "key" in record:
            records[record["key"]] = record
    return records


def train_run(run: dict, train_data: np.ndarray, val_data: np.ndarray, options: SweepOptions,
              device: torch.device | str) -> dict:
    """Train one planned run and return its record (the run's fields plus what was measured).

    ``curve``: ``flops`` (``6·N·tokens`` so far) against the training loss smoothed over a
    twentieth of the run, at ``options.curve_points`` points; ``final_loss``: the validation loss
    at the end, on ``options.eval_batches`` fixed batches.
    """
    config = TransformerConfig(**run["model"])
    torch.manual_seed(options.seed)
    model = TransformerLM(config)
    train_config = TrainConfig(steps=run["steps"], batch_size=options.batch_size,
                               context_length=options.context_length, lr=options.lr,
                               warmup_steps=max(1, int(options.warmup_fraction * run["steps"])),
                               eval_batches=options.eval_batches, seed=options.seed)
    started = time.perf_counter()
    history = train(model, train_data, train_config, val_data=val_data, device=device, progress=False)
    seconds = time.perf_counter() - started
    smoothed = smooth(history.loss, max(1, run["steps"] // 20))
    keep = np.unique(np.linspace(0, len(smoothed) - 1, options.curve_points).round().astype(int))
    flops = 6.0 * run["params"] * np.asarray(history.tokens, dtype=np.float64)
    return {**run, "final_loss": history.val_loss[-1], "final_train_loss": float(np.mean(history.loss[-10:])),
            "curve": {"flops": flops[keep].tolist(), "loss": smoothed[keep].tolist()},
            "seconds": seconds, "device": str(device)}


def _worker(run: dict, data_files: tuple, options: SweepOptions, device: str, out_dir: str) -> str:
    """Train one run in a worker process and write its record; returns the run's key."""
    torch.set_num_threads(1)  # several workers share the host's cores
    (train_path, val_path, dtype) = data_files
    train_data = np.memmap(train_path, dtype=dtype, mode="r")
    val_data = np.memmap(val_path, dtype=dtype, mode="r")
    write_record(out_dir, train_run(run, train_data, val_data, options, device))
    return run["key"]


def run_sweep(runs: list[dict], out_dir: str | os.PathLike, train_data: np.ndarray, val_data: np.ndarray,
              options: SweepOptions, device: torch.device | str = "cpu", workers: int = 1,
              progress: bool = True) -> list[dict]:
    """Train every run of ``runs`` that ``out_dir`` has no finished record of; return all records.

    ``workers > 1`` trains that many runs at once in separate processes (the data must then be
    on-disk memmaps, as :func:`lmfs.train.prepare_tokens` makes them, so each process maps the
    same files instead of receiving a copy). The longest runs start first, so the last worker
    to finish is not the one that drew the biggest job at the end.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = load_records(out_dir)
    todo = sorted((r for r in runs if r["key"] not in done), key=lambda r: -r["steps"] * r["params"])
    if progress and done:
        print(f"{len(runs) - len(todo)} of {len(runs)} runs already finished in {out_dir}: skipped")
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="sweep", disable=not progress)
    device = str(device)
    if workers <= 1:
        for run in todo:
            bar.set_postfix_str(run["key"])
            write_record(out_dir, train_run(run, train_data, val_data, options, device))
            bar.update()
    else:
        files = []
        for array in (train_data, val_data):
            if not isinstance(array, np.memmap) or array.filename is None:
                raise ValueError("workers > 1 needs the data as np.memmap files (lmfs.train.prepare_tokens "
                                 "returns them); or use workers=1")
            files.append(array.filename)
        data_files = (files[0], files[1], train_data.dtype.name)
        if val_data.dtype != train_data.dtype:
            raise ValueError("train and validation memmaps must share a dtype")
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used after a fork
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [pool.submit(_worker, run, data_files, options, device, str(out_dir)) for run in todo]
            for future in as_completed(futures):
                bar.set_postfix_str(future.result())
                bar.update()
    bar.close()
    records = load_records(out_dir)
    return [records[r["key"]] for r in runs if r["key"] in records]


def sweep_frame(records: list[dict]):
    """A DataFrame, one row per run: ``key``, ``N`` (params), ``C`` (budget), ``D`` (tokens),
    ``steps``, ``loss`` (final validation loss), ``train_loss``, ``seconds``, ``tokens_per_param``."""
    import pandas as pd

    frame = pd.DataFrame([dict(key=r["key"], d_model=r["model"]["d_model"], n_layers=r["model"]["n_layers"],
                               N=r["params"], C=r["budget"], D=r["tokens"], steps=r["steps"],
                               loss=r["final_loss"], train_loss=r["final_train_loss"], seconds=r["seconds"])
                          for r in records])
    frame["tokens_per_param"] = frame.D / frame.N
    return frame


def sweep_curves(records: list[dict]) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """``(N, flops, loss)`` per run, the input of :func:`lmfs.scaling.chinchilla.envelope_method`."""
    return [(r["params"], np.array(r["curve"]["flops"]), np.array(r["curve"]["loss"])) for r in records]
