"""Where lmfs writes: caches in the user's cache folder, temporary folders removed when done.

Nothing is left in the temporary folder by a lecture or a test (``make test`` runs with a private
``TMPDIR`` and fails if anything but pytest's and torch.compile's caches remains in it); caches
live in ``$LMFS_CACHE`` or the user's XDG cache folder, where other users cannot plant files.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmfs.env import cache_dir, scratch_dir
from lmfs.lectures import LECTURE_DIR

ROOT = Path(__file__).resolve().parent.parent


def test_cache_dir_follows_lmfs_cache_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("tokens") == tmp_path / "mine" / "tokens" and (tmp_path / "mine" / "tokens").is_dir()
    monkeypatch.delenv("LMFS_CACHE")
    assert cache_dir("alignment") == tmp_path / "xdg" / "lmfs" / "alignment"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # the XDG rule ignores a relative path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir("tokens") == tmp_path / "home" / ".cache" / "lmfs" / "tokens"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir("tokens") == tmp_path / "home" / ".cache" / "lmfs" / "tokens"


def test_token_and_alignment_caches_are_not_in_the_temporary_folder(tmp_path, monkeypatch):
    from lmfs.alignment.base import cache_root
    from lmfs.train import prepare_tokens

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    monkeypatch.setenv("LMFS_CACHE", str(tmp_path / "cache"))
    prepare_tokens("stories", n_bytes=20_000, vocab_size=280)
    assert [p.parent.name for p in (tmp_path / "cache").glob("*/*")] == ["tokens"]
    assert cache_root() == tmp_path / "cache" / "alignment"
    assert not list(tmp.iterdir())  # the staging folder is made in the cache and renamed there


def _python(code: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def _gone(folder: Path, seconds: float = 30.0) -> bool:
    """Whether ``folder`` disappears within ``seconds`` (a killed process's remover runs on its own)."""
    deadline = time.monotonic() + seconds
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not folder.exists()


@pytest.mark.slow  # a Python process that imports torch: a few seconds on a busy 2-core machine
def test_scratch_dir_is_removed_when_its_process_exits_or_is_killed(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = _python("""
        import os, signal
        from lmfs.env import scratch_dir
        kept = scratch_dir("lmfs-exits-")
        (kept / "sub").mkdir()
        (kept / "sub" / "file.txt").write_text("x")
        child = os.fork()
        if child == 0:              # a forked child makes its own folder and is killed:
            killed = scratch_dir("lmfs-killed-")     # no atexit, no finally, as a preempted job ends
            (killed / "file.txt").write_text("x")
            print(killed, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(child, 0)
        assert (kept / "sub" / "file.txt").exists()  # the parent's folder outlives the child
        print(kept, flush=True)
    """, tmp)
    assert done.returncode == 0, done.stderr
    killed, kept = map(Path, done.stdout.split())
    assert killed.parent == kept.parent == tmp
    assert not kept.exists()          # removed at the normal exit, before the process ended
    assert _gone(killed) and not list(tmp.iterdir())


@pytest.mark.slow  # starts a Jupyter kernel (a few seconds)
def test_scratch_dir_is_removed_when_nbval_kills_the_notebook_kernel(tmp_path, monkeypatch):
    """nbval ends its kernels with shutdown_kernel(now=True), a SIGKILL (papermill shuts them down:
    a normal exit, as in the test above)."""
    from jupyter_client.manager import start_new_kernel

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))            # the kernel inherits the environment
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    km, kc = start_new_kernel(kernel_name="python3")
    printed = []
    try:
        reply = kc.execute_interactive(
            "from lmfs.env import scratch_dir\nwork = scratch_dir('lmfs-nb-')\n"
            "(work / 'crawl.bin').write_bytes(b'x' * 1000)\nprint(work)", timeout=120,
            output_hook=lambda msg: printed.append(msg["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    folder = Path("".join(printed).strip())
    assert folder.parent == tmp
    assert _gone(folder) and not list(tmp.iterdir())


def _lecture_sources() -> dict[str, str]:
    return {path.stem: "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                                 if c["cell_type"] == "code")
            for path in sorted(LECTURE_DIR.glob("*.ipynb"))}


def test_lectures_remove_the_temporary_folders_they_make():
    """A lecture makes its working folder with lmfs.env.scratch_dir or tempfile.TemporaryDirectory
    (both removed when the kernel exits), or removes a tempfile.mkdtemp folder itself with
    shutil.rmtree; a bare mkdtemp is left behind on every run."""
    problems = []
    for stem, code in _lecture_sources().items():
        for match in re.finditer(r"^(\w+)\s*=\s*.*tempfile\.mkdtemp\(", code, re.M):
            name = match.group(1)
            if not re.search(rf"shutil\.rmtree\(\s*{name}\b", code):
                problems.append(f"{stem}: {name} = tempfile.mkdtemp(...) is never removed")
        if re.search(r"tempfile\.mkdtemp\(", code) and not re.search(r"^\w+\s*=\s*.*tempfile\.mkdtemp\(", code, re.M):
            problems.append(f"{stem}: a tempfile.mkdtemp(...) result is not kept to be removed")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_test_fails_when_something_is_left_in_its_private_tmpdir(tmp_path):
    """`make test` runs pytest with a private TMPDIR and lists what is left there; a stand-in for
    the virtual environment's python plays pytest (leaving its own cache, and maybe a folder)."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\necho "tmp=$TMPDIR"\nmkdir -p "$TMPDIR/pytest-of-me" "$TMPDIR/torchinductor_me"\n'
                    '[ -n "$LEAVE" ] && mkdir "$TMPDIR/$LEAVE"\nexit 0\n')
    fake.chmod(0o755)
    (bin_dir / ".installed").touch()
    outer = tmp_path / "outer"
    outer.mkdir()
    env = {**os.environ, "TMPDIR": str(outer)}
    run = ["make", "-s", "-C", str(ROOT), "test", f"VENV={tmp_path / 'venv'}"]
    clean = subprocess.run(run, env=env, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    private = Path(re.search(r"tmp=(\S+)", clean.stdout).group(1))
    assert private.parent == outer and not private.exists()   # a private folder, removed afterwards
    left = subprocess.run(run, env={**env, "LEAVE": "lmfs-isoflop-abc"}, capture_output=True, text=True)
    assert left.returncode != 0
    assert "make test left these in its private TMPDIR" in left.stdout and "  lmfs-isoflop-abc" in left.stdout
    assert "pytest-of-me" not in left.stdout and not list(outer.iterdir())
