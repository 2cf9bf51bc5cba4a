"""Benchmarks of :mod:`lmfs.kernels` against PyTorch: first check the outputs agree, then time.

    python -m lmfs.benchmarks kernels   [--json out.json] [--no-compile]
    python -m lmfs.benchmarks attention [--json out.json] [--seq-lens 1024 2048 ...] [--head-dims 64 128]

**kernels**: GeLU, softmax and RMSNorm are memory-bound (a few FLOPs per byte), so they are
scored in GB/s of the *fewest* bytes each must move: forward reads x and writes y (2 × size),
backward reads x (or y) and dy and writes dx (3 × size), with the weight and per-row statistics
left out as negligible. The ceiling is the measured copy bandwidth (:mod:`lmfs.bench.probes`).
Peers: the formula written out in eager PyTorch (one kernel per operation), PyTorch's built-in
fused op, ``torch.compile`` of the written-out formula, and for GeLU a CUDA C++ kernel.

**attention**: FlashAttention forward and forward+backward in TFLOP/s, against
``F.scaled_dot_product_attention`` (each of its GPU backends, keeping the fastest) and the
written-out attention of :func:`lmfs.nn.attention.attention_reference`, in bf16, causal and not,
at 16 heads and ``batch × seq_len = 16384`` tokens. FLOPs counted: ``4·B·H·T²·D`` for the forward
(two matmuls), 2.5 times that for the backward (five), halved when causal (the masked half need
not be computed), the same count for every implementation. Forward+backward is timed for each
backward scheme of :func:`lmfs.kernels.flash_attention` (``split``: two kernels, seven matmuls;
``atomic``: one kernel, five matmuls and atomic dQ additions), with the largest gradient
difference from SDPA's. A second table lists the block sizes, warps and pipeline stages the
autotuner chose for every shape, and the seconds the first calls took (compilation and tuning).

Without a GPU both run tiny sizes through Triton's interpreter, to exercise the code; those
numbers say nothing about real hardware.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import warnings

import torch
import torch.nn.functional as F
import triton  # after lmfs itself, which picks Triton's interpreter on a machine without a GPU

from lmfs.bench import save_json
from lmfs.bench.probes import copy_bandwidth
from lmfs.bench.timing import benchmark, synchronize
from lmfs.kernels import INTERPRET, cuda_toolchain_problem, flash_attention, gelu, gelu_cuda, gelu_torch
from lmfs.kernels import rms_norm, softmax
from lmfs.kernels.flash_attention import BACKWARDS, DEFAULT_BACKWARD, autotune_choices
from lmfs.kernels.rmsnorm import backward_choice as rmsnorm_backward_choice
from lmfs.nn.attention import attention_reference, causal_mask
from lmfs.nn.layers import RMSNorm

CPU_NOTE = ("no CUDA GPU: tiny sizes through Triton's interpreter, to exercise the code; "
            "real numbers need a CUDA GPU")


def _device_info(device: torch.device) -> dict:
    """Where and when a run happened: what ``results/`` files need to be quoted with a date."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "interpreter": INTERPRET}


def _fwd_fwdbwd(fn, inputs, grad_out, device, warmup: int, repeats: int, backward: bool = True):
    """Median seconds of ``fn(*inputs)`` alone (no autograd graph) and with its backward."""
    with torch.no_grad():
        fwd = benchmark(lambda: fn(*inputs), warmup, repeats, device).median
    if not backward:
        return fwd, None
    return fwd, _fwdbwd(fn, inputs, grad_out, device, warmup, repeats)


def _fwdbwd(fn, inputs, grad_out, device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn(*inputs)`` followed by its backward."""
    return benchmark(lambda: torch.autograd.grad(fn(*inputs), inputs, grad_out), warmup, repeats, device).median


def _num(x: float) -> str:
    """Thousands separators for big numbers, three significant digits for small (CPU) ones."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------------------------
# Memory-bound kernels


def _memory_bound_ops(device, dtype, rows: int, cols: int, compile_: bool):
    """For GeLU, softmax and RMSNorm: (name, inputs, {implementation: (fn, has backward)}, reference)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen).requires_grad_()

    gelu_impls = {"torch written out": (gelu_torch, True),
                  "torch F.gelu": (lambda t: F.gelu(t, approximate="tanh"), True)}
    if compile_:
        gelu_impls["torch.compile"] = (torch.compile(gelu_torch), True)
    gelu_impls["lmfs triton"] = (gelu, True)
    if not cuda_toolchain_problem():
        try:
            gelu_cuda(x[:1, :8].detach())  # builds the extension: about a minute the first time
            gelu_impls["CUDA load_inline"] = (gelu_cuda, False)
        except Exception as err:  # nvcc failing (e.g. a toolkit that does not match torch's CUDA)
            print(f"CUDA C++ GeLU left out, its build failed: {err}")

    def softmax_written_out(t):
        e = torch.exp(t - t.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)

    softmax_impls = {"torch written out": (softmax_written_out, True),
                     "torch.softmax": (lambda t: torch.softmax(t, dim=-1), True)}
    if compile_:
        softmax_impls["torch.compile"] = (torch.compile(softmax_written_out), True)
    softmax_impls["lmfs triton"] = (softmax, True)

    norm = RMSNorm(cols).to(device=device, dtype=dtype)  # lmfs.nn's written-out RMSNorm
    w = norm.weight
    norm_impls = {"torch written out": (lambda t, _: norm(t), True),
                  "torch F.rms_norm": (lambda t, g: F.rms_norm(t, (cols,), g, eps=norm.eps), True)}
    if compile_:
        compiled_norm = torch.compile(norm)
        norm_impls["torch.compile"] = (lambda t, _: compiled_norm(t), True)
    norm_impls["lmfs triton"] = (lambda t, g: rms_norm(t, g, norm.eps), True)

    return [("GeLU (tanh)", (x,), gelu_impls, "torch F.gelu"),
            ("softmax", (x,), softmax_impls, "torch.softmax"),
            ("RMSNorm", (x, w), norm_impls, "torch F.rms_norm")]


def run_kernels(device=None, compile_: bool | None = None) -> dict:
    """Time GeLU, softmax and RMSNorm implementations; print one table per op; return the numbers."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    compile_ = cuda if compile_ is None else compile_
    # 1 GiB per bf16 tensor: a forward+backward then keeps the GPU busy for over a millisecond, so
    # the few hundred microseconds Python and autograd need to issue it stay hidden behind the
    # kernels (at 256 MiB the host's share showed up in the timings and varied between machines).
    rows, cols = (131072, 4096) if cuda else (64, 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup, repeats = (5, 30) if cuda else (1, 3)
    if not cuda:
        print(CPU_NOTE)
    copy = copy_bandwidth(device=device)
    size = rows * cols * torch.tensor([], dtype=dtype).element_size()
    result = {**_device_info(device), "dtype": str(dtype).replace("torch.", ""), "shape": [rows, cols],
              "copy_bandwidth": copy, "ops": {}}
    print(f"{rows} × {cols} {result['dtype']} ({size / 2**20:.0f} MiB); measured copy bandwidth "
          f"{copy / 1e9:,.0f} GB/s; bytes counted: forward 2 × size, backward 3 × size")
    for name, inputs, impls, reference in _memory_bound_ops(device, dtype, rows, cols, compile_):
        grad_out = torch.randn_like(inputs[0])
        with torch.no_grad():
            expected = impls[reference][0](*inputs)
        table = {}
        for impl, (fn, has_backward) in impls.items():
            with torch.no_grad():
                diff = _max_diff(fn(*inputs), expected)
            fwd, both = _fwd_fwdbwd(fn, inputs, grad_out, device, warmup, repeats, has_backward)
            table[impl] = {"max_abs_diff": diff, "fwd_s": fwd, "fwd_GBps": 2 * size / fwd,
                           "fwdbwd_s": both, "fwdbwd_GBps": 5 * size / both if both else None}
            if name == "RMSNorm" and impl == "lmfs triton":  # the autotuner's choice for the backward
                table[impl]["bwd_config"] = rmsnorm_backward_choice()
        result["ops"][name] = table
        _print_kernel_table(name, table, reference, copy)
        if "bwd_config" in table.get("lmfs triton", {}):
            print(f"lmfs triton RMSNorm backward: {table['lmfs triton']['bwd_config']}")
    return result


def _print_kernel_table(name: str, table: dict, reference: str, copy: float) -> None:
    import pandas as pd

    ref = table[reference]
    rows = []
    for impl, r in table.items():
        rows.append({"implementation": impl, "max |Δ|": f"{r['max_abs_diff']:.1e}",
                     "fwd GB/s": _num(r["fwd_GBps"] / 1e9), "fwd % copy": f"{r['fwd_GBps'] / copy:.0%}",
                     "fwd vs built-in": f"{ref['fwd_s'] / r['fwd_s']:.3g}x",
                     "fwd+bwd GB/s": _num(r["fwdbwd_GBps"] / 1e9) if r["fwdbwd_s"] else "-",
                     "fwd+bwd % copy": f"{r['fwdbwd_GBps'] / copy:.0%}" if r["fwdbwd_s"] else "-",
                     "fwd+bwd vs built-in": f"{ref['fwdbwd_s'] / r['fwdbwd_s']:.3g}x" if r["fwdbwd_s"] else "-"})
    print(f"\n{name}  (max |Δ| against {reference}; 'vs built-in' = speed-up over {reference})")
    print(pd.DataFrame(rows).to_string(index=False))


# ----------------------------------------------------------------------------------------------
# Attention


def _sdpa_backends(cuda: bool) -> dict:
    """SDPA's GPU backends by name (each may refuse a shape); on a CPU, its default choice."""
    if not cuda:
        return {"default": None}
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _time_sdpa(backend, q, k, v, do, causal, device, warmup, repeats):
    """(forward s, forward+backward s) of SDPA pinned to ``backend``, or None if it refuses."""
    from torch.nn.attention import sdpa_kernel

    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    try:
        with warnings.catch_warnings():  # a refusing backend warns why before raising; we report it
            warnings.simplefilter("ignore")
            if backend is None:
                return _fwd_fwdbwd(fn, (q, k, v), do, device, warmup, repeats)
            with sdpa_kernel(backend):
                return _fwd_fwdbwd(fn, (q, k, v), do, device, warmup, repeats)
    except RuntimeError:
        return None


def run_attention(seq_lens=None, head_dims=None, tokens: int | None = None, heads: int | None = None,
                  naive_max_seq: int = 8192, device=None, backwards=None) -> dict:
    """Time FlashAttention against SDPA and naive attention; print the tables; return the numbers.

    ``backwards``: the backward schemes of :func:`flash_attention` to time (default: all of
    them); ``lmfs_fwdbwd`` in each row is the default scheme's if it was timed, else the first's.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    seq_lens = seq_lens or ([1024, 2048, 4096, 8192, 16384] if cuda else [32, 64])
    head_dims = head_dims or ([64, 128] if cuda else [32])
    tokens = tokens or (16384 if cuda else 64)
    heads = heads or (16 if cuda else 2)
    backwards = tuple(backwards or BACKWARDS)
    unknown = set(backwards) - set(BACKWARDS)
    if unknown:
        raise ValueError(f"run_attention: unknown backward scheme(s) {sorted(unknown)}; choose from {BACKWARDS}")
    main_backward = DEFAULT_BACKWARD if DEFAULT_BACKWARD in backwards else backwards[0]
    warmup, repeats = (3, 10) if cuda else (1, 2)
    if not cuda:
        print(CPU_NOTE)
    result = {**_device_info(device), "dtype": str(dtype).replace("torch.", ""), "tokens": tokens,
              "heads": heads, "backwards": list(backwards), "main_backward": main_backward, "rows": []}
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.perf_counter()
    for head_dim in head_dims:
        for causal in (False, True):
            for T in seq_lens:
                B = max(1, tokens // T)
                q, k, v = (torch.randn(B, heads, T, head_dim, device=device, dtype=dtype, generator=gen)
                           .requires_grad_() for _ in range(3))
                do = torch.randn_like(q)
                fwd_flops = 4 * B * heads * T * T * head_dim * (0.5 if causal else 1.0)
                both_flops = 3.5 * fwd_flops
                row = {"causal": causal, "head_dim": head_dim, "seq_len": T, "batch": B}
                sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                # First calls: the forward check, then each backward once (compile and autotune).
                first = time.perf_counter()
                with torch.no_grad():
                    expected = sdpa(q, k, v)
                    row["max_abs_diff"] = _max_diff(flash_attention(q, k, v, causal=causal), expected)
                configs = {"fwd": autotune_choices()["fwd"]}
                expected_grads = torch.autograd.grad(sdpa(q, k, v), (q, k, v), do)
                for scheme in backwards:
                    out = flash_attention(q, k, v, causal=causal, backward=scheme)
                    grads = torch.autograd.grad(out, (q, k, v), do)
                    row[f"grad_max_abs_diff_{scheme}"] = max(map(_max_diff, grads, expected_grads))
                    chosen = autotune_choices()
                    kernels = ("atomic",) if scheme == "atomic" else ("dkdv", "dq")
                    configs.update({name: chosen[name] for name in kernels})
                    del out, grads
                del expected_grads
                synchronize(device)
                row["first_calls_s"] = time.perf_counter() - first
                row["configs"] = configs
                lmfs_fwd, _ = _fwd_fwdbwd(lambda q, k, v: flash_attention(q, k, v, causal=causal), (q, k, v), do,
                                          device, warmup, repeats, backward=False)
                row["lmfs_fwd"] = fwd_flops / lmfs_fwd
                for scheme in backwards:
                    both = _fwdbwd(lambda q, k, v, s=scheme: flash_attention(q, k, v, causal=causal, backward=s),
                                   (q, k, v), do, device, warmup, repeats)
                    row[f"lmfs_fwdbwd_{scheme}"] = both_flops / both
                row["lmfs_fwdbwd"] = row[f"lmfs_fwdbwd_{main_backward}"]
                sdpa_times = {name: t for name, backend in _sdpa_backends(cuda).items()
                              if (t := _time_sdpa(backend, q, k, v, do, causal, device, warmup, repeats))}
                best_fwd = min(sdpa_times, key=lambda name: sdpa_times[name][0])
                best_both = min(sdpa_times, key=lambda name: sdpa_times[name][1])
                row.update(sdpa_fwd=fwd_flops / sdpa_times[best_fwd][0], sdpa_fwd_backend=best_fwd,
                           sdpa_fwdbwd=both_flops / sdpa_times[best_both][1], sdpa_fwdbwd_backend=best_both,
                           naive_fwd=None, naive_fwdbwd=None)
                if T <= naive_max_seq:
                    mask = causal_mask(T, device=device, dtype=dtype) if causal else None
                    try:
                        naive = _fwd_fwdbwd(lambda q, k, v: attention_reference(q, k, v, mask), (q, k, v), do,
                                            device, warmup, repeats)
                        row["naive_fwd"], row["naive_fwdbwd"] = fwd_flops / naive[0], both_flops / naive[1]
                    except torch.cuda.OutOfMemoryError:
                        pass  # the T×T scores did not fit: reported as missing
                    del mask
                result["rows"].append(row)
                print(f"  done: causal={causal} D={head_dim} T={T} ({time.perf_counter() - started:.0f} s so far)",
                      file=sys.stderr, flush=True)
                del q, k, v, do
                if cuda:
                    torch.cuda.empty_cache()
    result["total_s"] = time.perf_counter() - started
    _print_attention_table(result)
    return result


def _print_attention_table(result: dict) -> None:
    import pandas as pd

    def tf(x):
        return "-" if x is None else _num(x / 1e12)

    schemes = result.get("backwards", [])
    rows, tuned = [], []
    for r in result["rows"]:
        row = {"causal": r["causal"], "D": r["head_dim"], "T": r["seq_len"], "B": r["batch"],
               "max |Δ|": f"{r['max_abs_diff']:.1e}",
               "fwd lmfs": tf(r["lmfs_fwd"]), "fwd sdpa": f"{tf(r['sdpa_fwd'])} ({r['sdpa_fwd_backend']})",
               "fwd naive": tf(r["naive_fwd"]), "fwd lmfs/sdpa": f"{r['lmfs_fwd'] / r['sdpa_fwd']:.3g}"}
        for scheme in schemes:
            row[f"f+b {scheme}"] = tf(r[f"lmfs_fwdbwd_{scheme}"])
        row.update({"f+b sdpa": f"{tf(r['sdpa_fwdbwd'])} ({r['sdpa_fwdbwd_backend']})",
                    "f+b naive": tf(r["naive_fwdbwd"])})
        for scheme in schemes:
            row[f"f+b {scheme}/sdpa"] = f"{r[f'lmfs_fwdbwd_{scheme}'] / r['sdpa_fwdbwd']:.3g}"
        rows.append(row)
        tuned.append({"causal": r["causal"], "D": r["head_dim"], "T": r["seq_len"],
                      **{f"grad |Δ| {scheme}": f"{r[f'grad_max_abs_diff_{scheme}']:.1e}" for scheme in schemes},
                      "first calls s": f"{r['first_calls_s']:.1f}", **r["configs"]})
    print(f"\nattention TFLOP/s, {result['dtype']}, {result['heads']} heads, batch × seq_len = "
          f"{result['tokens']} tokens ({result['device']}); f+b = forward + backward with each backward "
          f"scheme (default {DEFAULT_BACKWARD!r}); max |Δ| = lmfs vs SDPA output")
    print(pd.DataFrame(rows).to_string(index=False))
    print("\nautotuner's choices per shape (BLOCK_M, BLOCK_N, warps, pipeline stages), largest gradient "
          "difference from SDPA's, and seconds of the first calls (compilation + autotuning):")
    with pd.option_context("display.max_colwidth", 60):
        print(pd.DataFrame(tuned).to_string(index=False))
    if "total_s" in result:
        print(f"\nattention benchmark: {result['total_s']:.0f} s in all")


# ----------------------------------------------------------------------------------------------
# Command lines


def main_kernels(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="GeLU, softmax and RMSNorm: lmfs Triton vs PyTorch, in GB/s")
    parser.add_argument("--no-compile", action="store_true", help="leave out torch.compile (it takes a while)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run_kernels(compile_=False if args.no_compile else None)
    save_json(result, args.json)
    return result


def main_attention(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="FlashAttention (lmfs Triton) vs SDPA and naive, in TFLOP/s")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 1024 ... 16384")
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, help="default 64 128")
    parser.add_argument("--naive-max-seq", type=int, default=8192,
                        help="skip naive attention above this length (its T×T scores fill memory)")
    parser.add_argument("--backward", nargs="+", choices=BACKWARDS, default=None,
                        help=f"backward schemes to time (default: all; the library default is {DEFAULT_BACKWARD})")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run_attention(args.seq_lens, args.head_dims, naive_max_seq=args.naive_max_seq, backwards=args.backward)
    save_json(result, args.json)
    return result
