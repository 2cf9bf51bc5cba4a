"""Repository-wide pytest hooks: a per-file duration table at the end of every run.

nbval reports each notebook cell as its own test, so pytest's ``--durations`` lists cells; this
table adds them up per notebook (and per test file), which is the number the README records.
"""

from collections import defaultdict

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not _seconds:
        return
    terminalreporter.write_sep("=", "seconds per file (setup + call + teardown)")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
