"""Checkpoints: everything needed to stop a run and continue it as if it had never stopped.

One file holds the model's and the optimizer's state, the step, the training and model configs
(as plain dicts), every random generator's state and whatever ``extra`` the caller adds. It is
read back with ``torch.load(..., weights_only=True)``, which unpickles only tensors and plain
Python values and so cannot run code hidden in a file: hence no numpy arrays or dataclass
objects inside, only tensors, lists, dicts and numbers.
"""

from __future__ import annotations

import os
import random
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np
import torch

from lmfs.optim import adam_state_for

FORMAT = "lmfs-checkpoint-1"


def rng_state() -> dict:
    """The state of Python's, NumPy's and torch's global generators (CPU and every GPU)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(mt), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict) -> None:
    """Put back the generators saved by :func:`rng_state`.

    CUDA states are restored only on a machine with as many GPUs as the one that saved them.
    """
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _config_dict(config) -> dict | None:
    return asdict(config) if is_dataclass(config) else config


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    step: int, config, extra: dict | None = None) -> Path:
    """Write a checkpoint to ``path`` atomically; returns the path.

    The file is written as ``path.tmp``, flushed to disk, then renamed over ``path`` in one step
    (``os.replace``): a crash or an exception mid-save leaves the previous checkpoint intact.
    ``config`` is the run's :class:`~lmfs.train.TrainConfig` (or any dataclass or dict); a
    compiled model is saved as its original module, so the keys never carry ``_orig_mod.``.
    """
    model = getattr(model, "_orig_mod", model)
    payload = {
        "format": FORMAT,
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "train_config": _config_dict(config),
        "model_config": _config_dict(getattr(model, "config", None)),
        "rng": rng_state(),
        "extra": extra or {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename, or a power cut could leave it empty
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint's weights into ``model`` (and state into ``optimizer``); return the checkpoint.

    The returned dict has ``step``, ``train_config``, ``model_config``, ``rng`` (pass it to
    :func:`restore_rng_state` to continue the same random streams) and ``extra``. Raises
    ``ValueError`` naming every field where the checkpoint's model config differs from
    ``model.config``, and ``RuntimeError`` for a truncated or corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: check the path (save one with save_checkpoint)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise RuntimeError(f"{path} cannot be read as a checkpoint; it is truncated or corrupt "
                           f"({type(err).__name__}: {err}). Delete it or load an earlier one.") from err
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise RuntimeError(f"{path} is a torch file but not an lmfs checkpoint (no format {FORMAT!r}); "
                           "write checkpoints with lmfs.train.save_checkpoint")

    model = getattr(model, "_orig_mod", model)
    stored, current = ckpt["model_config"], _config_dict(getattr(model, "config", None))
    if stored is not None and current is not None:
        differing = [f"{key}: checkpoint {stored.get(key)!r} vs model {current.get(key)!r}"
                     for key in sorted(set(stored) | set(current)) if stored.get(key) != current.get(key)]
        if differing:
            raise ValueError(f"{path} holds a model with a different config; differing fields: "
                             + "; ".join(differing)
                             + ". Build the model with TransformerConfig(**checkpoint['model_config']).")
    model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError(f"{path} was saved without optimizer state: load it with optimizer=None")
        optimizer.load_state_dict(adam_state_for(optimizer, ckpt["optimizer"]))   # ours <-> torch.optim's Adam
    return ckpt
