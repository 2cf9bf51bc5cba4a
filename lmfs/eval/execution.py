"""Running untrusted generated code in a subprocess with time, memory and output limits.

A model's program may loop forever, allocate without end, fork, flood stdout, call ``sys.exit``
or ``os._exit``. None of that may hang or crash the process that evaluates it (a notebook), so
each program runs in its own Python process:

* in a **new session** (its own process group), so on timeout the whole group is killed with
  ``SIGKILL``, children included;
* under **resource limits** set inside the child before the program starts
  (``resource.setrlimit``): address space (memory), CPU seconds (a busy loop dies even if the
  parent is gone), file size (stdout and stderr go to files, so flooding them stops at the
  limit instead of filling a pipe or the disk), process count and core dumps;
* with a **guard** that removes process creation (``os.fork``, ``subprocess``, ``os.system``,
  ``exec*``/``spawn*``) and file deletion from the program's ``os``/``shutil``/``subprocess``,
  in a fresh temporary working directory;
* and the parent waits with a **wall-clock timeout**.

A program *passes* only when it runs to its last line: the wrapper then writes a per-run random
token to a pipe the parent reads. ``sys.exit(0)`` or ``os._exit(0)`` before the tests ran is not
a pass.

This is isolation against accidents and naive hostile code, not a security boundary: Python
code can reach around a Python-level guard (``ctypes``), and ``RLIMIT_NPROC`` does not bind the
root user. Run untrusted code at scale in a container or a separate user account.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# Runs in the child: limits, guard, then the program, then the completion token.
_WRAPPER = r'''
import os, resource, sys
token, done_fd, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
del sys.argv[1:]
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NPROC, 64), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass
done = os.fdopen(done_fd, "w")
def _blocked(*args, **kwargs):
    raise PermissionError("blocked by the lmfs.eval sandbox")
import shutil, subprocess
for _name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "setsid", "putenv",
              "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
              "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
              "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir", "removedirs", "rename",
              "renames", "replace", "truncate", "chmod", "chown", "lchown", "fchmod", "fchown", "chroot"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
shutil.rmtree = shutil.move = shutil.chown = _blocked
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _blocked
source = open("program.py", encoding="utf-8").read()
del _name, limit, value
exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
sys.stdout.flush()
done.write(token)
done.flush()
'''


@dataclass
class ExecutionResult:
    """How one program ended.

    ``status``: ``"ok"`` (ran to its last line), ``"error"`` (an exception, or ``sys.exit``/
    ``os._exit`` before the end), ``"timeout"`` (killed at the wall-clock limit), ``"memory"``
    (hit the memory limit), ``"output_limit"`` (wrote more than ``max_output_bytes``) or
    ``"killed"`` (ended by a signal). ``stdout``/``stderr``: their first ``max_output_bytes``
    bytes, decoded.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "ok"


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512,
               max_output_bytes: int = 1_000_000) -> ExecutionResult:
    """Run ``code`` as a Python program in a sandboxed subprocess (module docstring); never raises
    because of what the program does. ``timeout``: wall-clock seconds; ``memory_mb``: address
    space limit; ``max_output_bytes``: per stream."""
    workdir = tempfile.mkdtemp(prefix="lmfs-exec-")
    token = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    start = time.perf_counter()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(workdir, "wrapper.py"), "w", encoding="utf-8") as f:
            f.write(_WRAPPER)
        out_path, err_path = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            cmd = [sys.executable, "-I", "wrapper.py", token, str(write_fd), str(memory_mb << 20),
                   str(int(timeout) + 1), str(max_output_bytes)]
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    pass_fds=(write_fd,), start_new_session=True,
                                    env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})
            os.close(write_fd)
            write_fd = -1
            try:
                returncode = proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)         # anything the program left behind in its group
            if timed_out:
                returncode = proc.wait()
        seconds = time.perf_counter() - start
        os.set_blocking(read_fd, False)
        try:
            finished = os.read(read_fd, 64).decode(errors="replace") == token
        except BlockingIOError:
            finished = False
        stdout, stderr = (open(p, "rb").read(max_output_bytes).decode(errors="replace") for p in (out_path, err_path))
        big = max(os.path.getsize(out_path), os.path.getsize(err_path)) >= max_output_bytes
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        shutil.rmtree(workdir, ignore_errors=True)

    if timed_out:
        status = "timeout"
    elif finished and returncode == 0:
        status = "ok"
    elif "MemoryError" in stderr:
        status = "memory"
    elif big:
        status = "output_limit"
    elif returncode == -signal.SIGXCPU:
        status = "timeout"           # the CPU-seconds limit fired before the wall clock
    elif returncode is not None and returncode < 0:
        status = "killed"
    else:
        status = "error"
    return ExecutionResult(status, returncode, stdout, stderr, seconds)


def run_many(codes: Sequence[str], workers: int = 2, **limits) -> list[ExecutionResult]:
    """:func:`run_python` on every program, ``workers`` at a time (threads that wait on processes)."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda c: run_python(c, **limits), codes))
