"""Running untrusted generated code: a sandboxed candidate, a trusted judge, plain data between them.

A model's program may loop forever, allocate without end, fork, flood stdout, exit early, kill
other processes, read secrets, or try to fake a pass. Two separations handle that.

**The verdict is decided where the candidate cannot reach.** :func:`check_program` runs the
candidate (e.g. a HumanEval prompt plus completion) in a sandboxed child process and the test
harness (HumanEval's ``check(candidate)``) in this, the trusted process. ``check`` receives a
proxy: each call is sent to the child, run there, and its result comes back over a pipe as
JSON-like plain data only (None, bool, int, float, str, list, tuple, dict: :func:`to_plain`,
:func:`from_plain`). An object of the candidate's never reaches the judge, so an ``__eq__`` that
always answers True compares nothing; a value of any other type (a subclass included) is a
failure, even if the harness would have swallowed the exception. No token or secret exists in
the child, and exiting early (``sys.exit(0)``, ``os._exit(0)``) ends the calls, which fails the
harness. A harness that passes the candidate something other than plain data (a function, an
object), relies on the candidate mutating an argument in place, or inspects the candidate object
itself cannot be judged this way and fails; all 164 HumanEval problems work (their canonical
solutions pass).

The operating-system isolation the candidate runs in is :mod:`lmfs.eval.sandbox`'s.
"""

from __future__ import annotations

import builtins
import functools
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from lmfs.eval.sandbox import (ChildEnded, ChildTimeout, SandboxedChild, chosen_isolation, from_plain, to_plain)

# ---------------------------------------------------------------- results


@dataclass
class ExecutionResult:
    """How one run ended.

    ``status``: ``"ok"`` (the harness passed; for :func:`run_python`, the program ran to its end and
    exited 0), ``"error"`` (an exception, a failed test, an early exit, a value that is not plain
    data), ``"timeout"`` (the wall-clock or CPU limit), ``"memory"`` (the memory limit),
    ``"output_limit"`` (more than ``max_output_bytes`` on a stream) or ``"killed"`` (ended by a
    signal). ``stdout``/``stderr``: the child's, first ``max_output_bytes`` bytes, decoded.
    ``detail``: the judge's reason for a failure (``"AssertionError: ..."``).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "ok"


def _status(ok: bool, timed_out: bool, returncode: int | None, stderr: str, detail: str, big: bool) -> str:
    if ok:
        return "ok"
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in detail or "MemoryError" in stderr:
        return "memory"
    if big:
        return "output_limit"
    if returncode is not None and returncode < 0 and returncode != -signal.SIGKILL:
        return "killed"
    return "error"


class _Candidate:
    """The judge's stand-in for the candidate function: each call is sent to the child as plain
    data and its plain-data result returned; an exception the candidate raised is raised here
    (as the built-in exception of that name, else ``RuntimeError``). A result that is not plain
    data is recorded in ``violation`` and fails the run whatever the harness does with it."""

    def __init__(self, child: SandboxedChild, name: str):
        self.child, self.__name__ = child, name
        self.violation = ""

    def __call__(self, *args, **kwargs):
        self.child.send({"a": to_plain(list(args)), "k": to_plain(kwargs)})
        try:
            message = self.child.recv()
            if "r" in message:
                return from_plain(message["r"])
            name, text = message["e"]
        except (ValueError, TypeError, KeyError, RecursionError) as err:
            self.violation = f"the candidate sent something that is not plain data ({type(err).__name__}: {err})"
            raise ChildEnded from None
        if name == "TypeError" and "is not plain data" in text:
            self.violation = f"the candidate returned a value that is not plain data: {text}"
        kind = getattr(builtins, str(name), None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(text)
        raise RuntimeError(f"{name}: {text}")


@functools.lru_cache(maxsize=1024)
def _compiled(harness: str):
    return compile(harness, "<harness>", "exec")


def check_program(program: str, harness: str, entry_point: str, check: str = "check", timeout: float = 5.0,
                  memory_mb: int = 512, max_output_bytes: int = 1_000_000,
                  isolation: str | None = None) -> ExecutionResult:
    """Run ``program`` in the sandbox and the trusted ``harness`` here: ``harness`` is executed in a
    fresh namespace, its ``entry_point`` replaced by a proxy to the program's function of that
    name, and ``check(proxy)`` is called (module docstring). ``status == "ok"`` exactly when
    ``check`` returns, every answer was plain data and the program did not run out of time."""
    start = time.perf_counter()
    mode, _ = chosen_isolation(isolation)
    child = SandboxedChild(mode, timeout, memory_mb, max_output_bytes)
    ok, timed_out, ended, detail, proxy = False, False, False, "", None
    try:
        child.send({"source": program, "name": "candidate", "entry": entry_point})
        ready = child.recv()
        if "ready" not in ready:
            detail = "the program failed before the tests: " + ": ".join(map(str, ready.get("e", ["?"])))
            raise ChildEnded
        namespace = {"__name__": "lmfs_judge", "__builtins__": builtins}
        exec(_compiled(harness), namespace)
        proxy = _Candidate(child, entry_point)
        namespace[entry_point] = proxy
        namespace[check](proxy)
        ok = not proxy.violation
    except ChildTimeout:
        timed_out = True
    except ChildEnded:
        ended = True
    except Exception as err:                 # the harness failed: a test, or an exception of the candidate's
        detail = f"{type(err).__name__}: {str(err)[:500]}"
    finally:
        returncode, stdout, stderr, big = child.close(ended)
    if proxy is not None and proxy.violation:
        ok, detail = False, proxy.violation
    if not ok and not detail:
        detail = "timed out" if timed_out else f"the program stopped answering (exit code {returncode})"
    status = _status(ok, timed_out, returncode, stderr, detail, big)
    return ExecutionResult(status, returncode, stdout, stderr, time.perf_counter() - start, detail)


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 1_000_000,
               isolation: str | None = None) -> ExecutionResult:
    """Run ``code`` as a whole Python program in the sandbox (module docstring); never raises
    because of what the program does. ``"ok"``: it ran to its end and exited 0, which a hostile
    program can fake (it runs in the same process as the report): judge untrusted code with
    :func:`check_program`. ``timeout``: wall-clock seconds; ``memory_mb``: address-space limit;
    ``max_output_bytes``: per stream."""
    start = time.perf_counter()
    mode, _ = chosen_isolation(isolation)
    child = SandboxedChild(mode, timeout, memory_mb, max_output_bytes)
    finished, timed_out, ended, detail = False, False, False, ""
    try:
        child.send({"source": code, "name": "__main__", "entry": None})
        message = child.recv()
        finished = "ready" in message
        detail = "" if finished else ": ".join(map(str, message.get("e", ["?"])))
        ended = True
        if finished:
            child.proc.wait(timeout=child._left())
    except (ChildTimeout, subprocess.TimeoutExpired):
        timed_out = True
    except (ChildEnded, ValueError):
        ended = True
    finally:
        returncode, stdout, stderr, big = child.close(ended and not timed_out)
    ok = finished and not timed_out and returncode == 0
    status = _status(ok, timed_out, returncode, stderr, detail, big)
    return ExecutionResult(status, returncode, stdout, stderr, time.perf_counter() - start, detail)


def default_workers() -> int:
    """Runs at a time: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run_many(codes: Sequence[str], workers: int | None = None, **limits) -> list[ExecutionResult]:
    """:func:`run_python` on every program, ``workers`` at a time (threads that wait on processes;
    default: one per core)."""
    with ThreadPoolExecutor(max_workers=max(1, workers or default_workers())) as pool:
        return list(pool.map(lambda c: run_python(c, **limits), codes))
