"""Small training experiments: run a set of variants of one model, then compare them.

An ablation changes one thing at a time and keeps everything else equal: the same data, the
same batches in the same order, the same initial random stream, the same number of steps. That
discipline is what makes two loss curves comparable, so it lives here once:

>>> runs = ablate(base_model, base_train, {"baseline": {}, "ReLU": dict(ffn="relu"),
...                                        "high lr": dict(lr=1e-2)}, data.train,
...               val_data=data.val)                                        # doctest: +SKIP
>>> results_table(runs)                                                     # doctest: +SKIP
>>> plot_runs(runs, ["baseline", "ReLU"])                                   # doctest: +SKIP

* :func:`ablate` trains every variant and returns a :class:`Run` per name.
* :func:`smooth` is a trailing running mean, to see the trend of a noisy training loss.
* :func:`plot_runs` draws runs on one axis; :func:`compare_runs` draws several such panels.
* :func:`results_table` puts the final losses, sizes and times in one DataFrame.
* :func:`check_trained` asserts what must hold for any run that trained at all;
  :func:`unigram_loss` is the loss of a model that ignores context, the bar a trained LM must clear.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.train.loop import History, TrainConfig, train


@dataclass
class Run:
    """One trained variant: what was changed, the configs used, the model and its :class:`History`."""

    name: str
    changes: dict
    model_config: TransformerConfig
    train_config: TrainConfig
    model: torch.nn.Module
    history: History
    params: int
    seconds: float


def split_changes(changes: Mapping, model_config, train_config: TrainConfig) -> tuple[dict, dict]:
    """Sort ``changes`` into ``(model_changes, train_changes)`` by which config has the field.

    A field both configs have (``context_length``) goes to both, so the model is built for the
    sequences it is trained on. A name neither has raises ``ValueError`` listing the valid ones.
    """
    model_fields = {f.name for f in dataclasses.fields(model_config)}
    train_fields = {f.name for f in dataclasses.fields(train_config)}
    unknown = sorted(set(changes) - model_fields - train_fields)
    if unknown:
        raise ValueError(f"{unknown} is not a field of {type(model_config).__name__} or TrainConfig; "
                         f"model fields: {sorted(model_fields)}; training fields: {sorted(train_fields)}")
    return ({k: v for k, v in changes.items() if k in model_fields},
            {k: v for k, v in changes.items() if k in train_fields})


def ablate(base_model, base_train: TrainConfig, variants: Mapping[str, Mapping], data: np.ndarray, *,
           val_data: np.ndarray | None = None, device: torch.device | str | None = None,
           build: Callable[[object], torch.nn.Module] = TransformerLM, seed: int = 0,
           verbose: bool = True) -> dict[str, Run]:
    """Train one model per entry of ``variants`` (name -> changed fields); return ``{name: Run}``.

    Each variant is ``base_model`` and ``base_train`` with its changes applied (see
    :func:`split_changes`: ``dict(lr=1e-2, norm_position="post")`` changes one field of each);
    ``{}`` is the base itself. Before each model is built the global seed is reset to ``seed``,
    and the batches come from ``base_train.seed``, so runs differ only by their changes.
    ``build`` turns a model config into a module (``TransformerLM``, or any model class whose
    config is a dataclass). ``device`` defaults to the CPU; with ``verbose`` each run prints a line.
    """
    runs = {}
    for name, changes in variants.items():
        model_changes, train_changes = split_changes(changes, base_model, base_train)
        model_config = dataclasses.replace(base_model, **model_changes)
        train_config = dataclasses.replace(base_train, **train_changes)
        torch.manual_seed(seed)  # every variant starts from the same random stream
        model = build(model_config)
        started = time.perf_counter()
        history = train(model, data, train_config, val_data=val_data, device=device, progress=False)
        seconds = time.perf_counter() - started
        params = sum(p.numel() for p in model.parameters())
        runs[name] = Run(name, dict(changes), model_config, train_config, model, history, params, seconds)
        if verbose:
            kind, losses = ("val", history.val_loss) if history.val_loss else ("train", history.loss)
            print(f"{name:28s} {params:>11,} params  lr {train_config.lr:<7g} final {kind} loss "
                  f"{losses[-1]:.3f}  ({seconds:.1f} s)")
    return runs


def smooth(values: Sequence[float], k: int | None = None) -> np.ndarray:
    """Trailing running mean: ``out[i]`` is the mean of ``values[max(0, i - k + 1) : i + 1]``.

    The result has the length of ``values``, so it plots against the same steps; the first
    ``k - 1`` points average over what exists so far. ``k`` defaults to a 25th of the run.

    >>> smooth([1.0, 2.0, 3.0, 4.0, 5.0], 2).tolist()
    [1.0, 1.5, 2.5, 3.5, 4.5]
    """
    values = np.asarray(values, dtype=np.float64)
    k = k or max(1, len(values) // 25)
    if k < 1:
        raise ValueError(f"smoothing window k={k} must be a positive number of steps")
    totals = np.concatenate([[0.0], np.cumsum(values)])  # totals[i] = sum of the first i values
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - k, 0)
    return (totals[end] - totals[start]) / (end - start)


def plot_runs(runs: Mapping[str, Run], names: Sequence[str] | None = None, title: str | None = None,
              ax=None, k: int | None = None):
    """Training loss (thin, :func:`smooth`-ed over ``k`` steps) and validation loss (dots) per run.

    ``names`` picks and orders the runs (default: all). The y-axis starts just below the best
    final validation loss and is cut at the loss of a uniform guess, ``log(vocab_size)``, so the
    first steps do not flatten the curves. Returns ``ax``.
    """
    import matplotlib.pyplot as plt

    names = list(runs) if names is None else list(names)
    missing = [n for n in names if n not in runs]
    if missing:
        raise KeyError(f"no run named {missing}; the runs are {list(runs)}")
    if ax is None:
        ax = plt.subplots(figsize=(6, 3.5))[1]
    for i, name in enumerate(names):
        h = runs[name].history
        ax.plot(h.step, smooth(h.loss, k), color=f"C{i}", lw=1, alpha=0.5)
        if h.val_step:
            ax.plot(h.val_step, h.val_loss, "o-", color=f"C{i}", ms=3, label=f"{name} (val)")
        else:
            ax.plot([], [], color=f"C{i}", label=name)
    finals = [(runs[n].history.val_loss or runs[n].history.loss)[-1] for n in names]
    top = max(max(runs[n].history.val_loss or runs[n].history.loss) for n in names) + 0.1
    vocab = [getattr(runs[n].model_config, "vocab_size", None) for n in names]
    if all(vocab):
        top = min(top, math.log(min(vocab)) + 0.2)
    ax.set_ylim(min(finals) - 0.15, top)
    ax.set(title=title, xlabel="step", ylabel="loss (nats/token)")
    ax.legend(fontsize=8)
    return ax


def compare_runs(runs: Mapping[str, Run], panels: Mapping[str, Sequence[str]], ncols: int = 2,
                 k: int | None = None):
    """Several :func:`plot_runs` panels side by side, one per ``title -> names``; returns the figure."""
    import matplotlib.pyplot as plt

    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.5 * nrows), squeeze=False)
    for ax, (title, names) in zip(axes.flat, panels.items()):
        plot_runs(runs, names, title, ax, k)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def results_table(runs: Mapping[str, Run], last: int = 10):
    """A DataFrame, one row per run: its changes, lr, parameters, final losses and seconds.

    ``final_train_loss`` is the mean over the ``last`` steps (one step's loss is noisy);
    ``final_val_loss`` is the last evaluation (NaN for a run without validation data).
    """
    import pandas as pd

    return pd.DataFrame([
        dict(run=name, change=", ".join(f"{k}={v}" for k, v in r.changes.items()) or "—",
             lr=r.train_config.lr, params=r.params,
             final_train_loss=float(np.mean(r.history.loss[-last:])),
             final_val_loss=r.history.val_loss[-1] if r.history.val_loss else float("nan"),
             seconds=r.seconds)
        for name, r in runs.items()
    ]).set_index("run")


def unigram_loss(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy on ``val`` (nats per token) of a unigram model: each token's frequency in
    ``train`` (plus one, so no token has probability 0). A language model that has learned only how
    common each token is reaches this loss; anything that uses context must go below it."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1
    if len(counts) != vocab_size:
        raise ValueError(f"unigram_loss: token ids reach {len(counts) - 1}, beyond vocab_size={vocab_size}")
    log_p = np.log(counts / counts.sum())
    return float(-log_p[np.asarray(val, dtype=np.int64)].mean())


def check_trained(runs: Mapping[str, Run], names: Sequence[str] | None = None, drop: float = 0.5,
                  below: float | None = None) -> None:
    """Assert that each run learned something: every loss finite, and both the mean of the last
    five training losses and the final validation loss at least ``drop`` nats below the first loss.
    With ``below`` (e.g. :func:`unigram_loss`), the final validation loss must also be under it.

    The drop holds at any scale, however short the run; which variant wins is a separate question.
    """
    for name in (list(runs) if names is None else names):
        h = runs[name].history
        assert all(math.isfinite(v) for v in h.loss + h.val_loss), f"{name}: a loss is not finite"
        first = h.loss[0]
        assert np.mean(h.loss[-5:]) < first - drop, \
            f"{name}: training loss did not go down by {drop} from {first:.2f} (lower the lr or train longer)"
        if h.val_loss:
            assert h.val_loss[-1] < first - drop, \
                f"{name}: validation loss did not go down by {drop} from {first:.2f}"
        if below is not None:
            assert h.val_loss, f"{name}: no validation loss to compare with {below:.3f}"
            assert h.val_loss[-1] < below, \
                f"{name}: final validation loss {h.val_loss[-1]:.3f} is not below {below:.3f}"
