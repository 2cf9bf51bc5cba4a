"""The one place that imports Triton, and decides whether its kernels run compiled or interpreted.

Triton compiles kernels for a GPU. Without one, its *interpreter* runs the very same kernel
source with NumPy, one program at a time: slow, but every line executes, so a CPU machine can
check the kernels against PyTorch at small sizes. The switch is the environment variable
``TRITON_INTERPRET=1``, and Triton reads it when a kernel is *defined* (``@triton.jit``), so it
must be set before any kernel module is imported. Every kernel module imports ``triton`` from
here, which guarantees that order; ``import lmfs`` sets the switch, and if Triton was imported
before it, without the switch, this module imports Triton's Python modules again.

``INTERPRET`` is true without a CUDA GPU, or when the user set ``TRITON_INTERPRET=1`` already.

Two traps. The interpreter does bfloat16 arithmetic wrongly (NumPy has no bfloat16), so our
kernels convert what they load to float32 before computing. On a GPU that upcast is what one
wants anyway for elementwise maths and reductions; matmul operands (``tl.dot``) stay in 16 bits
on a GPU, because the tensor cores take 16-bit inputs and accumulate in float32. And the
interpreter rounds float32 to bfloat16 by truncation, so its bf16 results can be one unit in the
last place further off than a GPU's (which rounds to nearest); tests allow for that.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreted(tl_module) -> bool:
    """Whether Triton's library was built for the interpreter (its ``tl.sum`` is interpreted)."""
    return type(tl_module.sum).__name__ == "InterpretedFunction"


def _reimport_triton_for_the_interpreter() -> None:
    """Import Triton's Python modules afresh, now that TRITON_INTERPRET=1 is set.

    Something imported before lmfs (torch's FLOP counter, torch.compile, a user's ``import
    triton``) may have imported Triton while the switch was off; its library (tl.sum, tl.max, ...)
    was then built for compiling, which the interpreter cannot call, and on a machine without a GPU
    nothing can be compiled anyway. Dropping the Python modules from ``sys.modules`` (the compiled
    extension ``triton._C`` stays loaded: it cannot be loaded twice) and importing again builds the
    library for the interpreter. Objects made before keep pointing at the old modules; lmfs's
    kernels, defined after this, use the new ones.
    """
    stale = [name for name in sys.modules
             if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")]
    for name in stale:
        del sys.modules[name]


try:
    import triton.language as tl

    if INTERPRET and not _interpreted(tl):
        _reimport_triton_for_the_interpreter()
        import triton.language as tl
    import triton
except ImportError as err:  # e.g. macOS or Windows, where no triton wheel exists
    raise ImportError(
        "lmfs.kernels needs the 'triton' package (pip install triton; wheels exist for Linux). "
        "The PyTorch references in lmfs.nn work without it."
    ) from err

if INTERPRET and not _interpreted(tl):
    raise ImportError(
        "lmfs.kernels: no CUDA GPU here, so Triton must run in its interpreter, but triton was already "
        "imported without TRITON_INTERPRET=1 and importing it again did not switch it. Restart Python "
        "(or the notebook kernel) and import lmfs before anything that imports triton, or set "
        "TRITON_INTERPRET=1 in the environment before starting Python."
    )

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

@functools.cache
def pdl_supported() -> bool:
    """Whether kernels may be launched with programmatic dependent launch (PDL): a GPU of compute
    capability 9.0 or newer and a Triton that has ``gdc_wait``. A kernel launched so
    (``launch_pdl=True``) may start while the kernel before it is still running, once that one has
    called ``gdc_launch_dependents``; it must call ``gdc_wait`` before it reads anything that kernel
    wrote. See :func:`lmfs.kernels.decode.layer_gemv_kernel`. Asked on first use, not at import:
    reading the capability starts CUDA."""
    return (not INTERPRET and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")
            and torch.cuda.get_device_capability()[0] >= 9)


def pdl_launch(pdl: bool) -> dict:
    """The launch options of a kernel launched with PDL (``pdl`` true) or without: ``kernel[grid](...,
    **pdl_launch(pdl))``."""
    return {"launch_pdl": True} if pdl else {}


def check_tensors(fn: str, **tensors: torch.Tensor) -> torch.device:
    """Check that the named tensors can go to one of our kernels; return their device.

    They must share one device (a CUDA GPU, or the CPU when Triton interprets) and one dtype out
    of float32, float16 and bfloat16. Errors name the function, the offending tensor and the fix.
    """
    names = list(tensors)
    first = tensors[names[0]]
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != first.device:
            raise ValueError(f"{fn}: {names[0]} is on {first.device} but {name} is on {t.device}; "
                             f"move all inputs to one device, e.g. {name}.to({names[0]}.device)")
        if t.dtype != first.dtype:
            raise TypeError(f"{fn}: {names[0]} is {first.dtype} but {name} is {t.dtype}; "
                            f"cast them to one dtype, e.g. {name}.to({names[0]}.dtype)")
    if first.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: dtype {first.dtype} is not supported; use float32, float16 or bfloat16 "
                        f"(e.g. {names[0]}.float())")
    if not (first.device.type == "cuda" or (INTERPRET and first.device.type == "cpu")):
        where = "the CPU (through Triton's interpreter)" if INTERPRET else "a CUDA GPU"
        fix = f"{names[0]}.cpu()" if INTERPRET else f"{names[0]}.cuda()"
        raise ValueError(f"{fn}: inputs are on {first.device}, but these kernels run on {where}; "
                         f"move them there, e.g. {fix}")
    return first.device


def row_block(fn: str, n: int, limit: int = 32768) -> int:
    """Block size for kernels that keep one whole row in registers: the next power of two of ``n``.

    Above ``limit`` elements a row no longer fits one program's registers and a multi-pass kernel
    would be needed; we raise instead of silently spilling to slow local memory.
    """
    if n > limit:
        raise ValueError(f"{fn}: rows of {n} elements are longer than this one-row-per-program kernel "
                         f"handles ({limit}); use the PyTorch version for such rows")
    return triton.next_power_of_2(n)


def row_warps(block: int) -> int:
    """Warps per program for a row of ``block`` elements: more threads share a longer row."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# ----------------------------------------------------------------------------------------------
# Autotuning helpers (GPU only: the interpreter cannot time anything, so kernels get fixed blocks).


def autotune_bench(kernel_call, quantiles):
    """How ``triton.autotune`` times one candidate: shorter than Triton's default (25 ms warm-up,
    100 ms of repeats per candidate), because a kernel here has up to a dozen candidates for every
    new shape key, and a first call should not take seconds. A handful of repeats is enough to
    separate configurations whose speeds differ by more than a few per cent."""
    from triton.testing import do_bench

    return do_bench(kernel_call, warmup=10, rep=40, quantiles=quantiles)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (4 under the interpreter: its programs run one
    after another anyway, so a few programs suffice to exercise the code)."""
    if INTERPRET or device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def shared_memory_limit(device_index: int | None = None) -> int:
    """Bytes of shared memory one program may use (227 KB on an H100/H200; 99 KB on many others)."""
    if INTERPRET or not torch.cuda.is_available():
        return 227 * 1024
    props = torch.cuda.get_device_properties(device_index if device_index is not None else torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 227 * 1024))


def config_str(config) -> str:
    """A ``triton.Config`` (or a dict of fixed block sizes) as one short line, e.g.
    ``BLOCK_M=128 BLOCK_N=64 warps=8 stages=3``: what the benchmarks print for each shape."""
    if config is None:
        return "-"
    if isinstance(config, dict):
        return " ".join(f"{k}={v}" for k, v in config.items()) + " (fixed)"
    parts = [f"{k}={v}" for k, v in config.kwargs.items()] + [f"warps={config.num_warps}"]
    if "STAGES" not in config.kwargs:  # a kernel that sets its loop's stages itself shows them once
        parts.append(f"stages={config.num_stages}")
    return " ".join(parts)


__all__ = ["INTERPRET", "triton", "tl", "check_tensors", "row_block", "row_warps", "FLOAT_DTYPES", "autotune_bench",
           "sm_count", "shared_memory_limit", "config_str", "n_candidates"]


def n_candidates(fn: str, autotune_candidates: int | None) -> int:
    """The kernels' ``N_CANDIDATES`` argument: how many candidates of each list the autotuner tries
    (the first ones that fit), 0 for all of them. Every candidate is compiled once per shape class
    and dtype (about a second each), so a notebook with a time budget asks for few."""
    if autotune_candidates is None:
        return 0
    if isinstance(autotune_candidates, bool) or not isinstance(autotune_candidates, int) or autotune_candidates < 1:
        raise ValueError(f"{fn}: autotune_candidates must be a positive int (try the first n block-size "
                         f"candidates) or None (try them all), got {autotune_candidates!r}")
    return autotune_candidates
