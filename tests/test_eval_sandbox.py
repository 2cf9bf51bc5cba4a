"""lmfs.eval's sandbox attacked as a hostile completion would: every probe is blocked or is a failure.

The isolated probes run wherever bubblewrap is installed (CI installs it) and fail if it is there
but does not work; the fallback (``isolation="none"``) is tested everywhere.
"""

import os
import shutil
import socket
import tempfile
import time
import warnings

import pytest

import lmfs.eval.sandbox as ex
from lmfs.eval import check_code, check_program, from_plain, humaneval, run_python, sandbox_status, to_plain

# Skipped only where bubblewrap is missing and not required (CI sets LMFS_SANDBOX=bwrap: then they fail).
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None and os.environ.get("LMFS_SANDBOX") != "bwrap",
                                 reason="bubblewrap is not installed")

PROMPT = 'def add(a, b):\n    """a + b"""\n'
HARNESS = PROMPT + "\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
RIGHT = "    return a + b\n"


def judged(completion: str, isolation: str = "bwrap", timeout: float = 2.0, **limits):
    return check_program(PROMPT + completion, HARNESS, "add", timeout=timeout, isolation=isolation, **limits)


def own_uids() -> range:
    """The user ids this process gives its sandboxes (when it runs as root)."""
    base = ex._UID_BASE + (os.getpid() % 100_000) * 1000
    return range(base, base + 1000)


def survivors() -> list[int]:
    """Processes still running under one of this process's sandbox user ids."""
    uids, found = own_uids(), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                real = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if real in uids:
            found.append(int(entry))
    return found


@pytest.fixture
def scratch_root(tmp_path, monkeypatch):
    """Sandbox folders go under tmp_path/exec, which must be empty again after each run."""
    root = tmp_path / "exec"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    assert list(root.iterdir()) == [], "a sandbox folder was left behind"
    if os.geteuid() == 0:
        for _ in range(50):           # a killed process leaves /proc within moments
            if not survivors():
                break
            time.sleep(0.02)
        assert survivors() == [], "a sandboxed process outlived its run"


# ------------------------------------------------------------------------------------------------
# Plain data: the only thing that crosses between candidate and judge


def test_plain_data_round_trips_and_everything_else_is_refused():
    value = [None, True, 0, -7, 2 ** 80, 1.5, float("inf"), "é\udc80\"\\\n", (1, (2,)), {"k": [1], 3: (4,)}, []]
    import json
    back = from_plain(json.loads(json.dumps(to_plain(value), allow_nan=False)))
    assert back == value and type(back[8]) is tuple and type(back[9][3]) is tuple and back[2] is not True
    nan = from_plain(to_plain(float("nan")))
    assert nan != nan

    class AlwaysEqual(int):
        def __eq__(self, other):
            return True
    for bad in (AlwaysEqual(1), {1, 2}, b"x", 1j, object(), [print], {"d": AlwaysEqual(0)}):
        with pytest.raises(TypeError, match="not plain data"):
            to_plain(bad)
    for forged in ({"x": 1}, {"f": "1e999"}, {"t": "ab"}, [{"d": [[[1], 2]]}]):
        with pytest.raises((ValueError, TypeError)):
            from_plain(forged)


# ------------------------------------------------------------------------------------------------
# Forged passes


TOKEN_FORGERY = ('    pass\nimport sys as _s, os as _o\n_m=_s.modules["__main__"]\n'
                 '_m.done.write(_m.token); _m.done.flush(); _o._exit(0)\n')
ALWAYS_EQUAL = ("    class _Any:\n        def __eq__(self, other):\n            return True\n"
                "        def __ne__(self, other):\n            return False\n"
                "        def __bool__(self):\n            return True\n    return _Any()\n")


@needs_bwrap
def test_the_token_forgery_of_the_issue_passes_nothing(scratch_root):
    problems = humaneval()
    assert check_code(problems, [[TOKEN_FORGERY]] * len(problems)).sum() == 0


@needs_bwrap
def test_always_equal_objects_pass_nothing(scratch_root):
    problems = humaneval(40)
    assert check_code(problems, [[ALWAYS_EQUAL]] * len(problems)).sum() == 0
    assert check_code(problems[:10], [[p.canonical_solution] for p in problems[:10]]).all()
    result = judged(ALWAYS_EQUAL)
    assert result.status == "error" and "not plain data" in result.detail
    # Swallowing the exception in the harness does not help: a non-plain answer fails the run.
    swallow = (PROMPT + "\n\ndef check(candidate):\n    try:\n        candidate(1, 2)\n"
               "    except Exception:\n        pass\n")
    assert not check_program(PROMPT + ALWAYS_EQUAL, swallow, "add", isolation="bwrap").passed
    subclass = "    class S(int):\n        def __eq__(self, o):\n            return True\n    return S(0)\n"
    assert judged(subclass).status == "error"
    assert judged(RIGHT).passed                       # and the honest answer passes


@needs_bwrap
@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n",
                                       "    import os\n    os._exit(0)\n", "    raise SystemExit(0)\n"])
def test_exiting_before_or_during_the_tests_fails(scratch_root, exit_call):
    completion = RIGHT + exit_call if not exit_call.startswith(" ") else exit_call
    result = judged(completion)
    assert not result.passed and result.status == "error", result


# ------------------------------------------------------------------------------------------------
# Processes and signals


@needs_bwrap
def test_killing_the_parent_is_blocked(scratch_root):
    code = ("import os, posix, signal\nout = []\nfor pid in (os.getppid(), 1, -1, %d):\n    try:\n"
            "        posix.kill(pid, signal.SIGKILL)\n        out.append('killed')\n"
            "    except OSError as e:\n        out.append(e.errno)\nprint(out)\n") % os.getpid()
    result = run_python(code, timeout=2.0, isolation="bwrap")
    assert result.passed and "killed" not in result.stdout, result
    assert judged(RIGHT + code).passed          # the evaluator is still here to judge


@needs_bwrap
def test_a_fork_loop_is_contained(scratch_root):
    code = "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass\n"
    started = time.perf_counter()
    result = run_python(code, timeout=1.0, isolation="bwrap")
    assert result.status == "timeout" and time.perf_counter() - started < 15


@needs_bwrap
def test_detached_children_die_with_the_sandbox(scratch_root):
    # setsid, a double fork, SIGTERM ignored: none of it outlives the run (scratch_root checks).
    code = ("import os, posix, signal, time\n"
            "if posix.fork() == 0:\n    posix.setsid()\n    if posix.fork() == 0:\n"
            "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        time.sleep(60)\n    os._exit(0)\n"
            "time.sleep(0.2)\n")
    assert run_python(code, timeout=2.0, isolation="bwrap").passed
    assert run_python(code + "time.sleep(60)\n", timeout=1.0, isolation="bwrap").status == "timeout"


# ------------------------------------------------------------------------------------------------
# Files, environment, network


@needs_bwrap
def test_files_outside_the_scratch_folder_cannot_be_deleted_or_written(scratch_root, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    code = f"""import ctypes, os, posix
out = []
for attempt in (lambda: ctypes.CDLL(None).unlink({str(victim)!r}.encode()), lambda: posix.unlink({str(victim)!r}),
                lambda: open({str(tmp_path / 'new.txt')!r}, 'w').write('x'), lambda: open('/usr/new.txt', 'w'),
                lambda: open('/python/new.txt', 'w'), lambda: os.mkdir('/opt-new')):
    try:
        out.append(attempt())
    except OSError as e:
        out.append(e.errno)
open('/tmp/scratch.txt', 'w').write('fine')
print(out, open('/tmp/scratch.txt').read())
"""
    result = run_python(code, timeout=2.0, isolation="bwrap")
    assert result.passed, result
    assert victim.read_text() == "keep me" and not (tmp_path / "new.txt").exists()
    assert not os.path.exists("/usr/new.txt") and not os.path.exists("/opt-new")
    outcome, scratch = result.stdout.rsplit(" ", 1)
    assert scratch.strip() == "fine", result.stdout
    errors = eval(outcome)                      # ctypes' unlink returns -1; the others raise OSError
    assert errors[0] == -1 and all(type(e) is int and e > 0 for e in errors[1:]), errors


@needs_bwrap
def test_the_evaluators_environment_and_home_are_unreadable(scratch_root, monkeypatch, tmp_path):
    monkeypatch.setenv("LMFS_SANDBOX_SECRET", "s3cr3t-value")
    home = os.path.expanduser("~")
    code = f"""import os
for path in ('/proc/%d/environ' % os.getppid(), '/proc/1/environ', '/proc/{os.getpid()}/environ',
             '/proc/self/environ', {home!r}, {str(tmp_path)!r}, '/etc/passwd', '/work'):
    try:
        print('READ', path, os.listdir(path) if os.path.isdir(path) else open(path).read())
    except OSError as e:
        print('refused', path, e.errno)
print(dict(os.environ))
"""
    result = run_python(code, timeout=2.0, isolation="bwrap")
    assert result.passed, result
    assert "s3cr3t-value" not in result.stdout and "LMFS_SANDBOX_SECRET" not in result.stdout
    assert "READ" not in result.stdout and result.stdout.count("refused") == 8, result.stdout


@needs_bwrap
def test_no_connection_to_a_local_listener(scratch_root):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.3)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.socket()\ns.settimeout(1)\nprint(s.connect_ex(('127.0.0.1', {port})))\n"
        result = run_python(code, timeout=3.0, isolation="bwrap")
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.passed and result.stdout.strip() != "0", result


# ------------------------------------------------------------------------------------------------
# Limits


@needs_bwrap
@pytest.mark.parametrize("name, code, status", [
    ("8 GB allocation", "x = bytearray(8 * 2**30)\n", "memory"),
    ("100 MB of output", "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n", "output_limit"),
    ("infinite loop", "while True:\n    pass\n", "timeout"),
])
def test_limits_hold(scratch_root, name, code, status):
    result = run_python(code, timeout=1.0, memory_mb=256, max_output_bytes=100_000, isolation="bwrap")
    assert result.status == status, (name, result.status, result.stderr[-300:])
    assert len(result.stdout) <= 100_000
    # The same inside a judged call: the harness sees a failure.
    body = "".join("    " + line + "\n" for line in code.splitlines())
    assert judged(body, timeout=1.0, memory_mb=256, max_output_bytes=100_000).status == status


@needs_bwrap
def test_status_reports_isolation_where_bubblewrap_works():
    status = sandbox_status()
    assert status.mode == "bwrap", status
    assert all(status.isolated.values()) or os.geteuid() != 0, status
    assert "bwrap" in str(status)


# ------------------------------------------------------------------------------------------------
# The fallback (no namespaces), forced


def test_the_fallback_is_chosen_by_name_and_warns_once(monkeypatch, scratch_root):
    monkeypatch.setattr(ex, "_warned", ex.threading.Event())
    monkeypatch.setenv("LMFS_SANDBOX", "none")
    assert sandbox_status().mode == "none" and sandbox_status().forced == "LMFS_SANDBOX"
    assert not sandbox_status().isolated["no network (own network namespace)"]
    with pytest.warns(RuntimeWarning, match="WITHOUT operating-system isolation"):
        assert judged(RIGHT, isolation=None).passed
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # said once only
        assert not judged("    return a - b\n", isolation=None).passed
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="chroot")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_fallback_still_judges(scratch_root):
    problems = humaneval(8)
    passed = check_code(problems, [[TOKEN_FORGERY, ALWAYS_EQUAL, p.canonical_solution] for p in problems],
                        isolation="none")
    assert not passed[:, :2].any() and passed[:, 2].all()
    for completion in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        assert not judged(RIGHT + completion, isolation="none").passed
    assert judged("    while True:\n        pass\n", isolation="none", timeout=1.0).status == "timeout"
    assert judged("    x = bytearray(8 * 2**30)\n", isolation="none", memory_mb=256).status == "memory"
    flood = "    import sys\n    for _ in range(100):\n        sys.stdout.write('x' * 2**20)\n"
    assert judged(flood, isolation="none", max_output_bytes=100_000).status == "output_limit"
    # The guard of the fallback: os.kill and os.fork are removed (posix.* reach around it).
    assert not judged("    import os\n    os.kill(os.getppid(), 9)\n", isolation="none").passed
    assert os.getpid() > 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.skipif(not ex._switches_user("none"), reason="the fallback keeps the evaluator's user here")
def test_the_fallback_as_root_keeps_the_evaluator_out_of_reach(scratch_root):
    result = run_python("import os, posix\nposix.kill(os.getppid(), 9)\n", timeout=2.0, isolation="none")
    assert result.status == "error" and "PermissionError" in result.stderr
