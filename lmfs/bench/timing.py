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

import bisect
import itertools
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


def device_timeline(fn: Callable[[], object], parts: dict[str, tuple[object, str]] | None = None,
                    gaps: int = 8) -> dict:
    """Run ``fn`` once under ``torch.profiler`` and say where the GPU sat idle, and what the host
    was doing meanwhile: the question to ask of work made of many small steps (a rollout's decode
    loop, a prefill, the bookkeeping between phases), where the host, not the GPU, may set the pace.

    ``parts`` name methods to watch: ``{"prefill": (engine, "_prefill"), ...}``; each is wrapped in
    a ``record_function`` range for the run (the originals are put back afterwards). Returns, in ms:

    * ``wall`` and ``busy``: the run's host time and, within it, the time the GPU ran anything
      (kernels, copies, fills; overlapping ones counted once);
    * ``parts``: per part, ``calls``, ``wall`` (its ranges' host time summed) and ``busy`` (the GPU's
      busy time within them): ``wall - busy`` is what the GPU waited for while that part ran;
    * ``gaps``: the ``gaps`` longest stretches with nothing on the GPU between its first and last
      work of the run: ``at`` (from the start of the run), ``ms``, the innermost watched ``part`` the
      host was in at the middle of the gap, and the host's outermost operators overlapping it
      (``ops``: name -> ms). A host function that launches no operator (pure Python) shows only
      its part.

    Off CUDA there is no device timeline: ``busy`` is None and ``gaps`` empty.

    >>> class Work:
    ...     def step(self): return torch.ones(8).sum()
    >>> w = Work()
    >>> t = device_timeline(lambda: [w.step() for _ in range(3)], {"step": (w, "step")})
    >>> t["parts"]["step"]["calls"], "step" in vars(w)
    (3, False)
    """
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    saved = []
    for name, (obj, attr) in (parts or {}).items():
        method = getattr(obj, attr)

        def ranged(*args, _method=method, _name=f"part/{name}", **kwargs):
            with record_function(_name):
                return _method(*args, **kwargs)

        saved.append((obj, attr, vars(obj).get(attr)))   # an instance attribute to put back, or None
        setattr(obj, attr, ranged)
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof, record_function("part/(run)"):
            fn()
            if cuda:
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as folder:   # (a named temporary file cannot be reopened on Windows)
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
    finally:
        for obj, attr, before in reversed(saved):
            if before is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, before)
    return timeline_of(events, list(parts or {}), gaps, cuda)


def timeline_of(events: list[dict], parts: list[str], gaps: int = 8, cuda: bool = True) -> dict:
    """:func:`device_timeline`'s analysis of a Chrome trace's ``traceEvents`` (what
    ``torch.profiler``'s ``export_chrome_trace`` writes): the host ranges ``part/<name>`` (and
    ``part/(run)`` around everything), the device's work (categories ``kernel``, ``gpu_memcpy``,
    ``gpu_memset``) and the host's operators (``cpu_op``), times in µs."""
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"][5:]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith("part/")]
    run = next(r for r in ranges if r[2] == "(run)")
    device = _merged([(e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")])

    starts, ends = [s for s, _ in device], [e for _, e in device]
    done = list(itertools.accumulate((e - s for s, e in device), initial=0.0))   # busy time before each

    def busy_in(spans) -> float:
        """The device's busy time within the host intervals ``spans`` (disjoint)."""
        total = 0.0
        for a, b in spans:
            i, j = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)   # device[i:j] overlap [a, b]
            if i < j:
                total += done[j] - done[i] - max(0.0, a - starts[i]) - max(0.0, ends[j - 1] - b)
        return total

    out = {"wall": (run[1] - run[0]) / 1e3, "busy": busy_in([run[:2]]) / 1e3 if cuda else None, "parts": {},
           "gaps": []}
    for name in parts:
        spans = _merged([r[:2] for r in ranges if r[2] == name])
        out["parts"][name] = {"calls": sum(r[2] == name for r in ranges),
                              "wall": sum(b - a for a, b in spans) / 1e3,
                              "busy": busy_in(spans) / 1e3 if cuda else None}
    if not cuda or len(device) < 2:
        return out
    ops = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "cpu_op"),
                 key=lambda o: (o[0], -o[1]))
    outermost, end = [], float("-inf")       # operators not inside another one (aten::to, not its copy_)
    for op in ops:
        if op[0] >= end:
            outermost.append(op)
            end = op[1]
    idle = sorted(((a[1], b[0]) for a, b in zip(device, device[1:])), key=lambda g: g[0] - g[1])[:gaps]
    for s, e in sorted(idle):
        mid = (s + e) / 2
        inside = [r for r in ranges if r[0] <= mid <= r[1]]
        part = min(inside, key=lambda r: r[1] - r[0])[2] if inside else "(none)"
        spent: dict[str, float] = {}
        for a, b, name in outermost:
            if a < e and b > s:
                spent[name] = spent.get(name, 0.0) + (min(b, e) - max(a, s)) / 1e3
        top = dict(sorted(spent.items(), key=lambda kv: -kv[1])[:4])
        out["gaps"].append({"at": (s - run[0]) / 1e3, "ms": (e - s) / 1e3, "part": part, "ops": top})
    return out


def _merged(spans) -> list[tuple[float, float]]:
    """Intervals ``(start, end)`` merged where they overlap, in order."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]
