"""Where and how big: device, dtype and scale selection, seeding, and the version banner.

Every notebook starts with one call::

    ctx = lmfs.setup(SCALE, DEVICE, seed=0)   # prints the banner, seeds every RNG
    ctx.scale, ctx.device, ctx.dtype            # -> "smoke", device("cpu"), torch.float32

Resolution order for ``"auto"``: the environment variable (``LMFS_SCALE``, ``LMFS_DEVICE``)
first, then the hardware: scale ``full`` with a CUDA GPU and ``smoke`` without one; device
cuda -> mps -> cpu. nbval cannot pass notebook parameters, so the environment variables are how
the test suite chooses a scale; papermill's ``-p SCALE full`` overrides through its injected cell.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__version__ = "0.1.0"   # the package version (pyproject.toml says the same)

# Without a CUDA GPU, Triton kernels run through Triton's interpreter. Triton builds its library
# (tl.sum, tl.max, ...) for one mode when it is first imported, reading TRITON_INTERPRET, so the
# switch is set when lmfs is imported, before any lmfs module imports Triton. (Something imported
# before lmfs may have imported Triton already: lmfs.kernels repairs that case, see
# lmfs.kernels._triton.) The value the user started Python with is kept for kernel_environment.
USER_TRITON_INTERPRET: str | None = os.environ.get("TRITON_INTERPRET")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SCALES = ("smoke", "full")
DEVICES = ("cpu", "cuda", "mps")


@contextmanager
def kernel_environment() -> Iterator[None]:
    """While active, ``os.environ`` is what the user started Python with as far as lmfs's own
    switches go: ``TRITON_INTERPRET`` as it was before lmfs set it (absent if it was absent).

    Notebook kernels (papermill's, nbval's) inherit the environment of the process that starts
    them. Started from a process that imported lmfs, they would get TRITON_INTERPRET=1 for free,
    which a learner's kernel in JupyterLab does not have; a notebook that only works with it would
    then pass its tests and fail for the learner. Start kernels inside this context instead.
    """
    current = os.environ.get("TRITON_INTERPRET")
    _set_env("TRITON_INTERPRET", USER_TRITON_INTERPRET)
    try:
        yield
    finally:
        _set_env("TRITON_INTERPRET", current)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _has_mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_scale(scale: str = "auto") -> str:
    """Return ``"smoke"`` or ``"full"``.

    ``"auto"`` reads ``LMFS_SCALE`` and falls back to ``full`` on a CUDA machine, ``smoke``
    elsewhere. Anything else must be one of :data:`SCALES`.
    """
    if scale is None or scale == "auto":
        scale = os.environ.get("LMFS_SCALE", "auto") or "auto"
        if scale == "auto":
            return "full" if torch.cuda.is_available() else "smoke"
    scale = str(scale).strip().lower()
    if scale not in SCALES:
        raise ValueError(
            f"unknown scale {scale!r}: choose one of {', '.join(SCALES)} or 'auto' "
            "(set it with the notebook's SCALE parameter or the LMFS_SCALE environment variable)"
        )
    return scale


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Return the torch device to use: ``LMFS_DEVICE`` first, then cuda -> mps -> cpu.

    An explicit device that this machine lacks raises an error naming what is available.
    """
    if isinstance(device, torch.device):
        device = str(device)
    if device is None or device == "auto":
        device = os.environ.get("LMFS_DEVICE", "auto") or "auto"
        if device == "auto":
            if torch.cuda.is_available():
                return torch.device("cuda")
            return torch.device("mps") if _has_mps() else torch.device("cpu")
    name = str(device).strip().lower()
    if name.split(":")[0] not in DEVICES:
        raise ValueError(f"unknown device {device!r}: choose one of {', '.join(DEVICES)} or 'auto'")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device 'cuda' was asked for but torch sees no CUDA GPU here; "
            "use DEVICE='auto' or 'cpu' (or unset LMFS_DEVICE)"
        )
    if dev.type == "mps" and not _has_mps():
        raise RuntimeError("device 'mps' was asked for but this machine has no usable MPS backend; use 'cpu'")
    return dev


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The compute dtype a lecture trains in: bf16 on a GPU that supports it, else fp32 (a GPU
    older than Ampere, e.g. a T4 or V100, has no bfloat16: :func:`setup` says so)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return torch.float32


NO_BF16_NOTE = ("note: this GPU has no bfloat16 (it needs compute capability 8.0, Ampere, or newer): "
                "lmfs computes in float32 here, which takes about twice the memory and time of the "
                "bfloat16 figures in the lectures")


# ---------------------------------------------------------------- GPU memory: a cap and the peak

FULL_SCALE_GIB = 22   # GPU memory a lecture at full scale is sized for: checked by runs under LMFS_GPU_MEMORY_GB=22
MEMORY_CAP_VAR = "LMFS_GPU_MEMORY_GB"   # GiB a process may allocate on its GPU (e.g. 22 for a 24 GB card)
PEAK_DIR_VAR = "LMFS_PEAK_MEMORY_DIR"   # where each process writes its peak GPU memory when it exits


def apply_memory_cap(device: torch.device) -> float | None:
    """Cap this process's GPU memory at ``$LMFS_GPU_MEMORY_GB`` GiB (unset: no cap); returns the cap.

    Allocations beyond it fail with torch's out-of-memory error, as on a card of that size: a run
    under a cap of 22 on a big GPU shows whether a lecture fits a 24 GB card (22 GiB of allocations
    leave room for the CUDA context and other processes' memory)."""
    value = os.environ.get(MEMORY_CAP_VAR, "").strip()
    if not value or device.type != "cuda":
        return None
    try:
        gib = float(value)
    except ValueError:
        raise ValueError(f"{MEMORY_CAP_VAR}={value!r}: give the cap in GiB, e.g. 22") from None
    if gib <= 0:
        raise ValueError(f"{MEMORY_CAP_VAR}={value!r}: the cap must be positive")
    index, total = gpu_memory_gib(device)
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib / total), index)
    return min(gib, total)


def gpu_memory_gib(device: torch.device) -> tuple[int, float]:
    """``(index, GiB)``: the CUDA ``device``'s index (the current one for plain ``cuda``) and its memory."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, torch.cuda.get_device_properties(index).total_memory / 2**30


def _record_peak_memory() -> None:
    """At exit: this process's peak GPU memory (the caching allocator's reserved bytes, the most
    on any one GPU) into ``$LMFS_PEAK_MEMORY_DIR/<pid>.json``, if the variable is set and the process
    used CUDA. :func:`read_peak_memory` adds the files up."""
    folder = os.environ.get(PEAK_DIR_VAR)
    if not folder or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    peak = max(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count()))
    try:
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "reserved_bytes": peak}))
    except OSError:  # the folder is gone: whoever asked is no longer reading
        pass


atexit.register(_record_peak_memory)


def _record_after_each_cell() -> None:
    """In a Jupyter kernel, also after every cell: a client that shuts a kernel down kills it if it
    takes more than a few seconds to exit (after torch.compile, say), and its at-exit handlers never run."""
    ipython = sys.modules.get("IPython")   # a kernel has imported it already; nothing else needs it
    if ipython is None or not os.environ.get(PEAK_DIR_VAR):
        return
    shell = ipython.get_ipython()
    if shell is not None:
        shell.events.register("post_run_cell", lambda result: _record_peak_memory())


_record_after_each_cell()


def read_peak_memory(folder: str | os.PathLike) -> tuple[float | None, int]:
    """``(GiB, processes)``: the peak GPU memory the processes that wrote into ``folder`` reserved,
    added up (an upper bound on their peak together, since each one's peak is counted as if they
    coincided), and how many wrote; ``(None, 0)`` if none did. The CUDA context, about half a GiB
    per process, comes on top."""
    peaks = [json.loads(p.read_text())["reserved_bytes"] for p in Path(folder).glob("*.json")]
    return (sum(peaks) / 2**30, len(peaks)) if peaks else (None, 0)


def seed_everything(seed: int = 0) -> None:
    """Seed Python's, NumPy's and torch's (CPU and every GPU) random generators in one call."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def cache_dir(name: str) -> Path:
    """The folder for the cache ``name`` (``"tokens"``, ``"alignment"``), created if missing.

    The root is ``$LMFS_CACHE`` when set, else ``lmfs`` in the user's cache folder as the XDG
    base-directory rule defines it: ``$XDG_CACHE_HOME`` when set to an absolute path, else
    ``~/.cache``. A cache in the user's own folder, not the shared temporary one, cannot be
    planted or read by other users of the machine, and survives the temporary folder's clean-up.
    """
    root = os.environ.get("LMFS_CACHE")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "lmfs"
    folder = base / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# Removes the folder named by argv[1] once its stdin reaches end of file, that is once every process
# holding the pipe's other end (the process that made the folder, and any it forked) has exited.
_REMOVER = "import shutil, sys; sys.stdin.buffer.read(); shutil.rmtree(sys.argv[1], ignore_errors=True)"
_removers: list = []  # the pipes to the removers stay open as long as this process lives


def scratch_dir(prefix: str = "lmfs-") -> Path:
    """A new empty folder in the temporary folder, removed with everything in it when the process
    that made it ends: at a normal exit (a script's end, a notebook kernel's shutdown) and also
    when it is killed (nbval stops its kernels with SIGKILL; a job can be preempted).

    For a notebook's working files (a crawl, a sweep's runs, checkpoints), which the lecture reads
    back in later cells and so cannot put in a ``with`` block; ``shutil.rmtree`` removes it
    sooner. A normal exit removes it at once (``atexit``); for a killed process a small helper
    process started here, which waits on a pipe from this one, removes it when the pipe closes.
    Only the process that made it removes it at exit: a forked child that exits leaves it alone.
    """
    import subprocess

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    owner = os.getpid()

    def remove():
        if os.getpid() == owner:
            shutil.rmtree(folder, ignore_errors=True)

    atexit.register(remove)
    # Its own session, so that a signal to this process's group (a kernel being stopped) spares it.
    _removers.append(subprocess.Popen([sys.executable, "-I", "-c", _REMOVER, str(folder)], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    return folder


def _version(package: str) -> str:
    """An installed package's version, read from its metadata without importing it.

    Importing Triton here would freeze it in compiled mode before ``lmfs.kernels`` can switch it
    to its interpreter on a machine without a GPU.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    if device.type == "mps":
        return "Apple MPS"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def banner(scale: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """One line each: Python, torch, numpy, triton and lmfs versions, the device and the scale."""
    lines = [
        f"python {sys.version.split()[0]} | torch {torch.__version__} | numpy {np.__version__}"
        f" | triton {_version('triton')} | lmfs {__version__}",
        f"device: {device} = {device_name(device)}",
        f"scale: {scale}" + (f" | dtype: {str(dtype).replace('torch.', '')}" if dtype else ""),
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class Session:
    """What a notebook runs with; returned by :func:`setup`."""

    scale: str
    device: torch.device
    dtype: torch.dtype
    seed: int

    @property
    def full(self) -> bool:
        return self.scale == "full"


def setup(scale: str = "auto", device: str = "auto", seed: int = 0, quiet: bool = False) -> Session:
    """Resolve scale, device and dtype, seed every RNG, print the banner; return a :class:`Session`."""
    dev = resolve_device(device)
    session = Session(resolve_scale(scale), dev, default_dtype(dev), seed)
    seed_everything(seed)
    cap = apply_memory_cap(dev)
    if not quiet:
        print(banner(session.scale, session.device, session.dtype))
        if cap is not None:
            print(f"GPU memory capped at {cap:.0f} GiB for this process ({MEMORY_CAP_VAR})")
        if dev.type == "cuda" and session.dtype != torch.bfloat16:
            print(NO_BF16_NOTE)
        if dev.type == "cuda" and session.full:
            _, memory = gpu_memory_gib(dev)
            if memory < FULL_SCALE_GIB:
                print(f"note: full scale is sized to fit {FULL_SCALE_GIB} GiB of GPU memory (a 24 GB card); this GPU "
                      f"has {memory:.0f} GiB: if a lecture runs out of memory, run it with SCALE='smoke'")
    return session
