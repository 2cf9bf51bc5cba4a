"""Repository-wide pytest set-up: Triton's interpreter switch, and a per-file duration table.

nbval reports each notebook cell as its own test, so pytest's ``--durations`` lists cells; this
table adds them up per notebook (and per test file), which is the number the README records.
"""

import os
from collections import defaultdict

import torch

# Triton reads TRITON_INTERPRET when it is first imported, and some torch modules a test imports
# (e.g. the FLOP counter) import it before lmfs can set the switch: set it here, first of all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.write_sep("=", "seconds per file (setup + call + teardown)")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
