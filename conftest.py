"""Repository-wide pytest set-up: notebook kernels in a learner's environment, and a per-file
duration table.

nbval reports each notebook cell as its own test, so pytest's ``--durations`` lists cells; this
table adds them up per notebook (and per test file), which is the number the README records.
"""

from collections import defaultdict

import pytest

from lmfs.env import kernel_environment

_seconds: dict[str, float] = defaultdict(float)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel while setting up its first cell, and the kernel inherits
    this process's environment, where ``import lmfs`` set TRITON_INTERPRET=1. A learner's kernel
    in JupyterLab has no such variable, so the kernel starts without it (unless the user set it)."""
    if type(item).__module__.startswith("nbval"):
        with kernel_environment():
            yield
    else:
        yield


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.write_sep("=", "seconds per file (setup + call + teardown)")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
