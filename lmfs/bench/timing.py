"""Timing GPU (and CPU) work correctly, and a profiler table of the kernels a function runs.

GPU work is asynchronous: ``y = f(x)`` returns as soon as the kernels are *queued*, so a wall clock
around it measures the launch, not the work. The procedure :func:`benchmark` follows:

1. **Warm up.** The first calls pay for compilation (Triton, ``torch.compile``), autotuning,
   cuDNN/cuBLAS heuristics and memory-allocator growth. Run a few and discard them.
2. **Synchronise**, so no earlier work is still running when the clock starts.
3. **Time on the device.** A CUDA event recorded before and after each call stamps the GPU's own
   timeline; ``start.elapsed_time(end)`` is the time the GPU spent in between, without Python or
   launch jitter on the host side. On a CPU, ``time.perf_counter`` around each call.
4. **Repeat** and report the **median** (robust to the odd slow call from a clock change or
   another process) together with the spread (interquartile range).

>>> t = benchmark(lambda: sum(range(1000)), warmup=1, repeats=5, device="cpu")
>>> t.method, len(t.times)
('perf_counter', 5)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


def synchronize(device) -> None:
    """Wait for the queued work of ``device`` to finish (a no-op off CUDA): call it before reading a
    wall clock around GPU work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one function, from :func:`benchmark`."""

    times: tuple[float, ...]
    method: str  # "cuda events" or "perf_counter"

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def iqr(self) -> float:
        """Interquartile range in seconds: the middle half of the calls lies within it."""
        if len(self.times) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times, n=4)
        return q3 - q1

    @property
    def spread(self) -> float:
        """The interquartile range relative to the median (0.05 = the middle half within 5 %)."""
        return self.iqr / self.median if self.median > 0 else 0.0

    def rate(self, work: float) -> float:
        """``work`` (bytes, FLOPs, tokens, ...) per second at the median time."""
        return work / self.median

    def __str__(self) -> str:
        return f"{self.median * 1e3:.4g} ms (IQR {self.spread:.1%}, n={len(self.times)}, {self.method})"


def benchmark(fn: Callable[[], object], warmup: int = 3, repeats: int = 20,
              device: str | torch.device | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones; see the module doc.

    ``device`` picks the clock: CUDA events on a ``cuda`` device, ``perf_counter`` otherwise; the
    default is CUDA when a GPU is present (timing CPU-only work with CUDA events is still right,
    just indirect).
    """
    if repeats < 1:
        raise ValueError(f"benchmark: repeats must be at least 1, got {repeats}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("benchmark: device 'cuda' asked for but torch sees no CUDA GPU; use device='cpu'")
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return Timing(tuple(times), "perf_counter")
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()  # every event has happened; now their times can be read
    return Timing(tuple(start.elapsed_time(end) / 1e3 for start, end in events), "cuda events")


def profile_table(fn: Callable[[], object], warmup: int = 2, repeats: int = 5, row_limit: int = 15):
    """Run ``fn`` under ``torch.profiler`` and return a pandas DataFrame of where the time went.

    On a GPU the rows are the **kernels** that ran (the GPU's own timeline: one row per kernel
    name, e.g. an eager GeLU shows several elementwise kernels, a fused one shows one); on a CPU
    they are the PyTorch operators. Columns: ``calls`` per call of ``fn``, ``total_us`` and
    ``mean_us`` per call of ``fn`` and per kernel launch, and ``share`` of the table's total time.
    """
    import pandas as pd
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    if cuda:  # kernels (and memcpy/memset) are the events on the GPU's timeline
        # ... and so are user annotations (``record_function`` ranges such as the optimizer's
        # "Optimizer.step#AdamW.step"), which span kernels already listed: leave them out.
        ranges = {e.name for e in prof.events() if getattr(e, "is_user_annotation", False)}
        rows = [(e.key, e.count, e.self_device_time_total) for e in events if e.device_type == DeviceType.CUDA
                and e.key not in ranges and "#" not in e.key and not e.key.startswith("## ")]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]
    table = pd.DataFrame(rows, columns=["name", "calls", "total_us"])
    table["calls"] = table["calls"] / repeats
    table["total_us"] = table["total_us"] / repeats
    table["mean_us"] = table["total_us"] / table["calls"]
    table["share"] = table["total_us"] / table["total_us"].sum()
    table["kind"] = [kernel_kind(name) for name in table["name"]]
    # Totals per kind over every row, before the table is cut to its longest ``row_limit`` rows.
    kinds = table.groupby("kind")["total_us"].sum()
    table = table.sort_values("total_us", ascending=False).head(row_limit).reset_index(drop=True)
    table.attrs["where"] = "GPU kernels" if cuda else "CPU operators"
    table.attrs["kinds_us"] = {kind: float(kinds.get(kind, 0.0)) for kind in KERNEL_KINDS}
    return table


#: What :func:`kernel_kind` sorts kernels into, and the name fragments (lower case) that decide it,
#: tried in this order. Matrix multiplications come from cuBLAS (``nvjet_*`` on Hopper with CUDA
#: 12.8+, ``sm90_xmma_gemm_*``, ``cutlass_*``, ``ampere_*gemm*``) or from Triton templates that
#: ``torch.compile(mode="max-autotune")`` generates (``triton_tem_*mm*``); attention from cuDNN
#: (``*sdpa*``, ``*fmha*``), FlashAttention (``flash``), memory-efficient attention or
#: our Triton kernels (``attention``, ``attn``); the optimizer from torch's foreach/fused kernels
#: (``multi_tensor_apply``, ``adam``). The rest (``other``) is element-wise and reduction work:
#: norms, activations, RoPE, casts, the loss, copies.
KERNEL_KINDS = {
    "attention": ("sdpa", "fmha", "flash", "attention", "attn"),
    "matmul": ("gemm", "nvjet", "xmma", "cutlass", "matmul", "triton_tem", "splitk", "::mm", "addmm", "bmm"),
    "optimizer": ("multi_tensor", "adam", "foreach"),
    "other": (),
}


def kernel_kind(name: str) -> str:
    """``"attention"``, ``"matmul"``, ``"optimizer"`` or ``"other"`` for a GPU kernel's name
    (see :data:`KERNEL_KINDS`).

    >>> kernel_kind("nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNT"), kernel_kind("triton_red_fused_add_0")
    ('matmul', 'other')
    """
    lower = name.lower()
    if lower.startswith(("triton_poi", "triton_red", "triton_per")):  # Inductor's fused element-wise and
        return "other"  # reduction kernels, named after the operators they fuse (even "..._attention_...")
    for kind, fragments in KERNEL_KINDS.items():
        if any(fragment in lower for fragment in fragments):
            return kind
    return "other"
