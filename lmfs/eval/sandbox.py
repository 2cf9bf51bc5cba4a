"""The sandbox that :mod:`lmfs.eval.execution` runs a candidate in: a child process, its limits, and
the plain data that crosses to and from it.

**Operating-system isolation**, chosen at run time (:func:`sandbox_status` says what this machine
gives; ``LMFS_SANDBOX=bwrap|none`` or ``isolation=`` forces one):

* ``"bwrap"`` (bubblewrap, Linux namespaces): no network (its own empty network namespace, where
  127.0.0.1 is not the host's); a read-only view of ``/usr`` and the Python installation and
  nothing else of the host's files (no home folders, no project, no ``/etc``); a fresh writable
  ``/tmp`` (a size-limited tmpfs) as the only writable folder, gone with the sandbox; its own PID
  namespace, so it cannot see or signal the evaluator, and every process it starts (``setsid``,
  double fork, ignoring SIGTERM) dies with it; no inherited environment.
* ``"none"`` (the fallback: macOS, containers without namespaces): the child runs as a plain
  process in a scratch folder, in a session of its own, with a guard against accidents (process
  creation, signals and file deletion removed from ``os``, ``shutil`` and ``subprocess``: Python
  code can reach around it through ``posix`` or ``ctypes``). It shares the host's network and file
  view (read access as its user); a warning says so once.

In both modes the child gets limits set before the candidate runs (``resource.setrlimit``):
address space (memory), CPU seconds, file size (stdout and stderr go to files, so a flood stops
at the limit), process count, no core dumps; the parent enforces a wall-clock timeout. When the
evaluator runs as root, the child first switches to a user id no other process has (per run), so
the process limit holds (Linux does not apply ``RLIMIT_NPROC`` to root) and the limits cannot be
raised again; leftover processes of that user are killed at the end. Under bubblewrap it always
does; in the fallback only where every user can read the interpreter (not a pyenv under
``/root``), and then the evaluator's processes and files (``/proc/PID/environ``, ``~``) are out of
its reach too. Otherwise the fallback's child runs as the evaluator's user: it can signal the
evaluator, read its files, raise its limits if that user is root, and leave detached processes
behind. A non-root evaluator's sandbox counts the process limit over all of that user's processes.

Why bubblewrap and not ``unshare`` alone: util-linux's ``unshare`` makes the namespaces, but a
read-only view of the files needs a script of mounts after it, and a root evaluator's child keeps
root's power over the host's files unless it can switch user (not where the interpreter lives in
root's home); bubblewrap does both in one checked step, so without it the sandbox falls back, and
says so, rather than half-isolating.

What no mode gives: protection against kernel exploits (use a VM or gVisor for that), a limit on
the tmpfs's pages beyond its size, or isolation of the CPU time of sibling processes from one
another (there is no cgroup). :func:`run_python` runs a whole program without a judge; its
``"ok"`` means the program reached its end and exited 0, which the program itself can fake:
use :func:`check_program` where a pass matters.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import math
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
MAX_DEPTH = 100                 # nesting of plain data
MAX_MESSAGE_BYTES = 16 << 20    # one message over the channel
ISOLATIONS = ("auto", "bwrap", "none")


# ---------------------------------------------------------------- plain data over the channel


def to_plain(value, depth: int = 0):
    """``value`` as JSON-able data: None, bool, int, str, finite floats and lists as themselves,
    tuples as ``{"t": [...]}``, dicts as ``{"d": [[key, value], ...]}``, non-finite floats as
    ``{"f": "nan"}``. Anything else, a subclass of these included, raises ``TypeError``: the
    type is checked exactly, so no object with its own ``__eq__`` passes."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise ValueError(f"plain data nested deeper than {MAX_DEPTH}")
    if value is None or kind is bool or kind is int or kind is str:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    if kind is list:
        return [to_plain(v, depth + 1) for v in value]
    if kind is tuple:
        return {"t": [to_plain(v, depth + 1) for v in value]}
    if kind is dict:
        return {"d": [[to_plain(k, depth + 1), to_plain(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"{kind.__module__}.{kind.__qualname__} is not plain data "
                    "(None, bool, int, float, str, list, tuple, dict)")


def from_plain(data, depth: int = 0):
    """The inverse of :func:`to_plain` on parsed JSON; anything it does not produce raises
    ``ValueError`` (or ``TypeError`` for an unhashable dict key)."""
    kind = type(data)
    if depth > MAX_DEPTH:
        raise ValueError(f"plain data nested deeper than {MAX_DEPTH}")
    if data is None or kind is bool or kind is int or kind is float or kind is str:
        return data
    if kind is list:
        return [from_plain(v, depth + 1) for v in data]
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "t" and type(body) is list:
            return tuple(from_plain(v, depth + 1) for v in body)
        if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {from_plain(k, depth + 1): from_plain(v, depth + 1) for k, v in body}
        if tag == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
    raise ValueError(f"not plain data: {str(data)[:80]}")


def _reject_constant(name):
    raise ValueError(f"{name} is sent as {{'f': ...}}, not as a JSON constant")


def _decode(payload: bytes):
    """Plain data from one message's bytes (the judge's side: strict JSON, then :func:`from_plain`)."""
    return json.loads(payload, parse_constant=_reject_constant)


# ---------------------------------------------------------------- the child's side

# Runs in the sandbox as `python -I -S -c`: limits, then (as root) a user id of its own, then the
# program; in "judge" mode it then answers calls. Framing: 4-byte big-endian length, then the text.
# The judge writes Python literals (its own repr of to_plain's output; eval'd here without builtins);
# the child answers in JSON that _dump writes, so that no parser module (json, re: tens of
# milliseconds at start-up) is imported here, and the judge reads it with json.loads + from_plain.
_CHILD = r'''
import math, os, resource, struct, sys
MAX_DEPTH = 100
REQ, RESP, UID, MEMORY, CPU, FSIZE, NPROC, GUARD = map(int, sys.argv[1:9])
del sys.argv[1:]
for _limit, _value in ((resource.RLIMIT_AS, MEMORY), (resource.RLIMIT_CPU, CPU), (resource.RLIMIT_FSIZE, FSIZE),
                       (resource.RLIMIT_NPROC, NPROC), (resource.RLIMIT_CORE, 0)):
    _hard = resource.getrlimit(_limit)[1]
    _value = _value if _hard == resource.RLIM_INFINITY else min(_value, _hard)
    resource.setrlimit(_limit, (_value, _value))
if UID >= 0 and os.getuid() == 0:
    os.setgroups([])
    os.setgid(UID)
    os.setuid(UID)     # also drops every capability: the limits above cannot be raised again
if GUARD:              # the fallback's guard against accidents (Python code can reach around it)
    import shutil, subprocess
    def _blocked(*args, **kwargs):
        raise PermissionError("blocked by the lmfs.eval sandbox's guard")
    for _name in ("fork", "forkpty", "system", "popen", "kill", "killpg", "setsid", "putenv", "execv", "execve",
                  "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
                  "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "remove",
                  "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown",
                  "lchown", "fchmod", "fchown", "chroot"):
        if hasattr(os, _name):
            setattr(os, _name, _blocked)
    shutil.rmtree = shutil.move = shutil.chown = _blocked
    subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_call = subprocess.check_output = _blocked
{codec}
_ESCAPES = {{c: "\\u%04x" % c for c in [*range(32), *range(0xD800, 0xE000)]}}
_ESCAPES.update({{ord('"'): '\\"', ord("\\"): "\\\\"}})
def _dump(x):
    if x is None:
        return "null"
    if x is True or x is False:
        return "true" if x else "false"
    if type(x) is int or type(x) is float:
        return repr(x)
    if type(x) is str:
        return '"' + x.translate(_ESCAPES) + '"'
    if type(x) is list:
        return "[" + ",".join(map(_dump, x)) + "]"
    return "{{" + ",".join(_dump(k) + ":" + _dump(v) for k, v in x.items()) + "}}"
def _read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(REQ, n - len(data))
        if not chunk:
            os._exit(0)                     # the judge is done
        data += chunk
    return data
def _recv():
    return eval(_read(struct.unpack(">I", _read(4))[0]).decode(), {{"__builtins__": {{}}}})
def _send(message):
    data = _dump(message).encode("utf-8")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(RESP, data):]
def _error(err):
    return {{"e": [type(err).__name__, str(err)[:2000]]}}
_job = _recv()
_ns = {{"__name__": _job["name"], "__builtins__": __builtins__}}
try:
    exec(compile(_job["source"], "program.py", "exec"), _ns)
    _fn = _ns[_job["entry"]] if _job["entry"] else None
except BaseException as _err:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    _send(_error(_err))
    os._exit(1)
sys.stdout.flush()
_send({{"ready": True}})
while _fn is not None:
    _req = _recv()
    try:
        _out = {{"r": to_plain(_fn(*from_plain(_req["a"]), **from_plain(_req["k"])))}}
    except BaseException as _err:
        _out = _error(_err)
    sys.stdout.flush()
    _send(_out)
'''


@functools.lru_cache(maxsize=1)
def _child_source() -> str:
    codec = "\n".join(inspect.getsource(f) for f in (to_plain, from_plain))
    codec = codec.replace("def to_plain(value, depth: int = 0):", "def to_plain(value, depth=0):")
    codec = codec.replace("def from_plain(data, depth: int = 0):", "def from_plain(data, depth=0):")
    return _CHILD.format(codec=codec)


# ---------------------------------------------------------------- what the machine gives


@dataclass
class SandboxStatus:
    """What :func:`sandbox_status` found: ``mode`` (``"bwrap"`` or ``"none"``), the reasons, and
    per property whether it holds (``isolated``)."""

    mode: str
    bwrap: str | None
    bwrap_error: str | None
    root: bool
    own_user: bool
    forced: str | None
    isolated: dict = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"sandbox mode: {self.mode}" + (f" (forced by {self.forced})" if self.forced else ""),
                 f"bubblewrap: {self.bwrap or 'not installed'}" + (f" (unusable: {self.bwrap_error})"
                                                                    if self.bwrap_error else ""),
                 f"evaluator runs as root: {self.root}; child runs as a user id of its own: {self.own_user}"]
        lines += [f"  {'yes' if ok else 'NO '}  {what}" for what, ok in self.isolated.items()]
        return "\n".join(lines)


def _python_in_sandbox() -> tuple[str, list[str]]:
    """The interpreter the sandbox runs (the base one, not a virtualenv's link) and the bind
    arguments that make it visible: ``/usr`` is bound anyway; another prefix is bound read-only
    at ``/python`` (a home folder's pyenv, conda), so no folder above it shows."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if exe.startswith("/usr/") and prefix.startswith("/usr"):
        return exe, []
    if not exe.startswith(prefix + os.sep):
        raise RuntimeError(f"the interpreter {exe} is not under its prefix {prefix}")
    return "/python/" + os.path.relpath(exe, prefix), ["--ro-bind", prefix, "/python"]


def _bwrap_command(bwrap: str, scratch_mb: int) -> list[str]:
    exe, binds = _python_in_sandbox()
    cmd = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    if os.geteuid() == 0:
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]   # for the child's switch of user
    else:
        cmd += ["--unshare-user"]
    cmd += binds + ["--proc", "/proc", "--dev", "/dev", "--size", str(scratch_mb << 20), "--perms", "1777",
                    "--tmpfs", "/tmp", "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                    "--setenv", "HOME", "/tmp", "--setenv", "PYTHONHASHSEED", "0", "--", exe]
    return cmd


@functools.lru_cache(maxsize=1)
def _bwrap_probe() -> tuple[str | None, str | None]:
    """(path of bwrap, None) when a sandbox starts and runs Python here, else (path or None, why not)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        switch = f"os.setgroups([]); os.setgid({_UID_BASE}); os.setuid({_UID_BASE}); " if os.geteuid() == 0 else ""
        cmd = _bwrap_command(bwrap, 1) + ["-I", "-S", "-c", f"import os, socket; {switch}os.listdir('/tmp')"]
        done = subprocess.run(cmd, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        return bwrap, f"{type(err).__name__}: {err}"
    if done.returncode != 0:
        return bwrap, done.stderr.decode(errors="replace").strip()[-300:] or f"exit code {done.returncode}"
    return bwrap, None


def chosen_isolation(isolation: str | None) -> tuple[str, str | None]:
    """The mode to run in and what forced it (None: chosen automatically)."""
    forced = None
    if isolation is None:
        isolation = os.environ.get("LMFS_SANDBOX", "auto") or "auto"
        forced = "LMFS_SANDBOX" if isolation != "auto" else None
    elif isolation != "auto":
        forced = "isolation="
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation={isolation!r}: use one of {ISOLATIONS} (or LMFS_SANDBOX)")
    if isolation == "none":
        return "none", forced
    bwrap, error = _bwrap_probe()
    if error is None:
        return "bwrap", forced
    if isolation == "bwrap":
        raise RuntimeError(f"isolation 'bwrap' was asked for but is not available: {error}")
    return "none", None


def sandbox_status(isolation: str | None = None) -> SandboxStatus:
    """What the sandbox gives on this machine (print it for a table of yes/no lines)."""
    mode, forced = chosen_isolation(isolation)
    bwrap, error = _bwrap_probe()
    root = os.geteuid() == 0
    boxed, own_user = mode == "bwrap", _switches_user(mode)
    isolated = {
        "verdict decided in the judge; only plain data crosses (no token, no foreign objects)": True,
        "memory, CPU-time and output limits the program cannot raise": own_user or not root,
        "process-count limit that holds (a user id per run)": own_user,
        "no network (own network namespace)": boxed,
        "read-only system view; no home folders, project or /etc": boxed,
        "only writable folder: a fresh, size-limited /tmp": boxed,
        "own PID namespace: cannot signal the evaluator; all its processes die with it": boxed,
        "evaluator's environment and files unreadable": boxed or own_user,
        "cannot signal the evaluator's processes": boxed or own_user,
        "no process outlives the run (setsid, double fork)": boxed or own_user,
    }
    return SandboxStatus(mode, bwrap, error, root, own_user, forced, isolated)


@functools.lru_cache(maxsize=1)
def _python_open_to_all() -> bool:
    """Whether any user can reach the interpreter's files (every folder above its prefix searchable
    by others): the fallback's switch of user needs it, bubblewrap's binds do not."""
    path = os.path.realpath(sys.base_prefix)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        if path == os.path.dirname(path):
            return True
        path = os.path.dirname(path)


def _switches_user(mode: str) -> bool:
    """Whether the child runs as a user id of its own: when the evaluator is root, with bubblewrap
    always, in the fallback where the interpreter is open to all users."""
    return os.geteuid() == 0 and (mode == "bwrap" or _python_open_to_all())


_warned = threading.Event()


def _warn_fallback() -> None:
    """Say once per process, as a ``RuntimeWarning``, what the fallback does not isolate."""
    if not _warned.is_set():
        _warned.set()
        why = _bwrap_probe()[1] or "isolation 'none' was asked for"
        missing = "; ".join(what for what, ok in sandbox_status("none").isolated.items() if not ok)
        warnings.warn(f"lmfs.eval runs untrusted code WITHOUT operating-system isolation ({why}). Not given: "
                      f"{missing}. The verdict still comes from the judge. Install bubblewrap for isolation "
                      "(lmfs.eval.sandbox_status() tells what holds).", RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------- one sandboxed child

_UID_COUNTER = itertools.count()
_UID_BASE = 1_600_000_000      # user ids far above any account's


def _fresh_uid() -> int:
    """A user id no other process has: per evaluator process and per run (1000 in flight at most)."""
    return _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_UID_COUNTER) % 1000


def _kill_user(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (the fallback's stray processes)."""
    for _ in range(100):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
            except (OSError, StopIteration):
                continue
            if str(uid) in uids:
                found = True
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if not found:
            return
        time.sleep(0.01)


class ChildTimeout(BaseException):
    """The wall-clock limit passed (a BaseException: a harness's ``except Exception`` does not stop it)."""


class ChildEnded(BaseException):
    """The child stopped answering: it exited or was killed."""


class SandboxedChild:
    """One sandboxed child process and its two pipes; :meth:`close` kills it and removes its files."""

    def __init__(self, mode: str, timeout: float, memory_mb: int, max_output_bytes: int, scratch_mb: int = 64):
        self.deadline = time.monotonic() + timeout
        self.mode, self.max_output_bytes = mode, max_output_bytes
        self.root = tempfile.mkdtemp(prefix="lmfs-exec-")
        self.uid = _fresh_uid() if _switches_user(mode) else -1
        self.proc = None
        fds = []
        try:
            req_r, self.req_w = os.pipe()
            self.resp_r, resp_w = os.pipe()
            fds = [req_r, resp_w]
            for fd in (self.req_w, self.resp_r):
                os.set_blocking(fd, False)
            self.out_path, self.err_path = os.path.join(self.root, "stdout"), os.path.join(self.root, "stderr")
            args = ["-I", "-S", "-c", _child_source(), str(req_r), str(resp_w), str(self.uid), str(memory_mb << 20),
                    str(int(timeout) + 1), str(max_output_bytes), "64", str(int(mode == "none"))]
            if mode == "bwrap":
                cmd, cwd = _bwrap_command(_bwrap_probe()[0], scratch_mb) + args, None
                env = {"PATH": "/usr/bin:/bin"}
            else:
                _warn_fallback()
                cwd = os.path.join(self.root, "scratch")
                os.mkdir(cwd)
                if self.uid >= 0:
                    os.chown(cwd, self.uid, self.uid)
                cmd = [os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)] + args
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"}
            with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
                self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             pass_fds=tuple(fds), start_new_session=True, env=env)
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ChildTimeout
        return left

    def send(self, message) -> None:
        """Send ``message`` (plain data of the judge's, already through :func:`to_plain`) as a literal."""
        data = repr(message).encode()
        data = struct.pack(">I", len(data)) + data
        poll = select.poll()
        poll.register(self.req_w, select.POLLOUT)
        while data:
            if not poll.poll(self._left() * 1000):
                continue
            try:
                data = data[os.write(self.req_w, data):]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise ChildEnded from None

    def _read(self, n: int) -> bytes:
        poll = select.poll()
        poll.register(self.resp_r, select.POLLIN)
        chunks, got = [], 0
        while got < n:
            if not poll.poll(self._left() * 1000):
                continue
            try:
                chunk = os.read(self.resp_r, min(n - got, 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise ChildEnded
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def recv(self):
        """The child's next message, decoded and checked (``ValueError`` if it is not plain data)."""
        (size,) = struct.unpack(">I", self._read(4))
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"a message of {size:,} bytes (more than {MAX_MESSAGE_BYTES:,})")
        message = _decode(self._read(size))
        if type(message) is not dict:
            raise ValueError("a message that is not a JSON object")
        return message

    def close(self, ended: bool = False) -> tuple[int | None, str, str, bool]:
        """Kill the child and everything it started, remove its files: (returncode, stdout, stderr, over the
        output limit). ``ended``: the child stopped answering, so it is given a moment to exit by itself
        and the returncode says how it ended (``-signal`` as :mod:`subprocess` reports it, also for
        bubblewrap's ``128 + signal``)."""
        returncode, stdout, stderr, big = None, "", "", False
        try:
            for fd in ("req_w", "resp_r"):
                if getattr(self, fd, -1) >= 0:
                    os.close(getattr(self, fd))
                    setattr(self, fd, -1)
            if self.proc is not None:
                if ended:
                    try:
                        self.proc.wait(timeout=min(0.25, max(self.deadline - time.monotonic(), 0)))
                    except subprocess.TimeoutExpired:
                        pass
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                returncode = self.proc.wait()
                if self.mode == "bwrap" and returncode > 128:
                    returncode = 128 - returncode
                if self.uid >= 0:
                    _kill_user(self.uid)
                limit = self.max_output_bytes
                with open(self.out_path, "rb") as out, open(self.err_path, "rb") as err:
                    stdout, stderr = (f.read(limit).decode(errors="replace") for f in (out, err))
                big = max(os.path.getsize(self.out_path), os.path.getsize(self.err_path)) >= limit
        finally:
            _remove_tree(self.root)
        return returncode, stdout, stderr, big


def _remove_tree(path: str) -> None:
    """Remove ``path`` even where the program took away permissions inside it."""
    def make_writable(func, name, _):
        try:
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700)
            func(name)
        except OSError:
            pass
    shutil.rmtree(path, onerror=make_writable)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
