"""Teaching tools for measuring: timers, profiler tables, bandwidth/matmul probes, the roofline, memory.

* :mod:`lmfs.bench.timing`: warm-up, device events, medians; a profiler table by kernel kind.
* :mod:`lmfs.bench.probes`: the device's measured copy bandwidth and matmul rate.
* :mod:`lmfs.bench.roofline`: the roofline and the tile/wave-quantisation model.
* :mod:`lmfs.bench.memory`: tensors alive, saved activations and the peak of a training step.

The harnesses that compare lmfs with peers live apart, in :mod:`lmfs.benchmarks`.
"""

import json
import sys


def save_json(result: dict, path: str | None) -> None:
    """Write a benchmark's results to ``path`` as JSON (the ``--json`` option); no-op without one.

    The file also records when and with what it was measured (``date``, ``torch``, ``python``,
    unless the result already has them), so a figure read from ``results/`` can be dated.
    """
    if path:
        import datetime
        import platform

        import torch

        stamp = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                 "python": platform.python_version()}
        with open(path, "w") as f:
            json.dump({**stamp, **result}, f, indent=1)
        print(f"results written to {path}", file=sys.stderr)


def error_line(err: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters of it): an error put in a
    result row or a warning in one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
