"""Sizes per lecture and scale. Notebooks never hard-code sizes: they ask for their config here.

The sizes live by unit in :mod:`lmfs.scales.basics`, :mod:`~lmfs.scales.systems`,
:mod:`~lmfs.scales.scaling`, :mod:`~lmfs.scales.data` and :mod:`~lmfs.scales.alignment`.

    cfg = lecture_config("01", ctx.scale)
    cfg.corpus_bytes, cfg.vocab_size

``smoke`` sizes finish a notebook in about a minute on a 2-core CPU; ``full`` sizes give the real
result on one H200 within a two-minute budget (five minutes for sweep and RL lectures).
"""

from __future__ import annotations

from types import SimpleNamespace

from lmfs.env import resolve_scale
from lmfs.scales.alignment import CONFIGS as _ALIGNMENT
from lmfs.scales.basics import CONFIGS as _BASICS
from lmfs.scales.data import CONFIGS as _DATA
from lmfs.scales.scaling import CONFIGS as _SCALING
from lmfs.scales.systems import CONFIGS as _SYSTEMS

# One table, keyed by lecture; each unit's sizes live in its own module beside this one.
CONFIGS: dict[str, dict[str, dict]] = dict(sorted({**_BASICS, **_SYSTEMS, **_SCALING, **_DATA, **_ALIGNMENT}.items()))


def lecture_config(lecture: str, scale: str = "auto") -> SimpleNamespace:
    """The sizes of ``lecture`` ("01".."17") at ``scale`` ("smoke", "full" or "auto")."""
    lecture = f"{int(lecture):02d}"
    if lecture not in CONFIGS:
        raise KeyError(f"lecture {lecture} has no config yet; known: {', '.join(sorted(CONFIGS))}")
    return SimpleNamespace(**CONFIGS[lecture][resolve_scale(scale)])
