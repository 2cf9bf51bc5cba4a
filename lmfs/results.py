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


def load_result(name: str, device: str = "h200") -> dict | None:
    """The JSON of ``results/<device>/<name>.json`` as a dict (``name`` without ``.json``).

    When the file is not there, prints a note that names it and the command that writes it, and
    returns ``None``: a notebook cell then says "not measured" instead of failing.
    """
    path = RESULTS_DIR / device / f"{name}.json"
    if not path.is_file():
        kept = sorted(str(p.relative_to(RESULTS_DIR)) for p in RESULTS_DIR.glob("*/*.json"))
        print(f"no measured result {path}: run `python -m lmfs.benchmarks {name} --json "
              f"results/{device}/{name}.json` on a {device.upper()} from the repository root to create it"
              + (f" (kept results: {', '.join(kept)})" if kept else
                 " (no results/ folder here: load_result reads the one of a source checkout of lmfs)"))
        return None
    with open(path) as f:
        return json.load(f)
