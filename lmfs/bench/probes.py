"""Measure the device's two ceilings: memory bandwidth and matmul rate.

    python -m lmfs.benchmarks probes [--json out.json]

Datasheet figures are upper bounds; what a kernel can reach is what the simplest kernel that
does nothing else reaches. So we measure:

* **copy bandwidth**: ``dst.copy_(src)`` on a buffer much larger than the caches (1 GiB on a GPU;
  an H200's L2 holds 50 MB), counting the bytes read *and* the bytes written, 2 × size;
* **strided copy**: copying every ``stride``-th element. Memory moves whole 32-byte sectors (and
  128-byte lines per warp), so with 4-byte elements a stride of 8 already fetches 8 times what is
  used: useful bandwidth collapses. This is why coalesced access matters;
* **matmul rate**: ``a @ b`` for square ``n × n`` matrices, ``2·n³`` FLOPs, per dtype.

All timings are medians of :func:`lmfs.bench.timing.benchmark` after warm-up.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from lmfs import hardware
from lmfs.bench import save_json
from lmfs.bench.timing import benchmark

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device(device) -> torch.device:
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def copy_bandwidth(n_bytes: int | None = None, device=None, repeats: int = 20) -> float:
    """Bytes per second of ``dst.copy_(src)``, counting read + write (2 × ``n_bytes``).

    Default size: 1 GiB on a GPU (far beyond the L2 cache), 64 MiB on a CPU.
    """
    device = _device(device)
    n_bytes = n_bytes or (2**30 if device.type == "cuda" else 2**26)
    src = torch.empty(n_bytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    timing = benchmark(lambda: dst.copy_(src), warmup=3, repeats=repeats, device=device)
    return timing.rate(2 * src.numel() * src.element_size())


def strided_copy_bandwidth(stride: int, n_elements: int | None = None, device=None, repeats: int = 20) -> float:
    """Useful bytes per second when copying every ``stride``-th float32 of a larger buffer.

    Counts only the ``n_elements`` values read and written (8 bytes each), not the sectors the
    hardware actually fetched around them: the drop with growing ``stride`` is the waste.
    """
    device = _device(device)
    n_elements = n_elements or (2**26 if device.type == "cuda" else 2**18)
    src = torch.ones(n_elements * stride, device=device, dtype=torch.float32)
    dst = torch.empty(n_elements, device=device, dtype=torch.float32)
    timing = benchmark(lambda: dst.copy_(src[::stride]), warmup=3, repeats=repeats, device=device)
    return timing.rate(2 * n_elements * 4)


def matmul_rate(n: int, dtype: str = "bf16", device=None, repeats: int = 20) -> float:
    """FLOP/s of an ``n × n`` by ``n × n`` matmul (``2·n³`` FLOPs) in ``dtype``.

    ``dtype``: one of fp32, tf32 (fp32 inputs, tensor cores at reduced mantissa), bf16, fp16.
    """
    if dtype not in DTYPES:
        raise ValueError(f"matmul_rate: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    device = _device(device)
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        timing = benchmark(lambda: a @ b, warmup=3, repeats=repeats, device=device)
    finally:
        torch.set_float32_matmul_precision(before)
    return timing.rate(2 * n**3)


def run(device=None) -> dict:
    """Measure and print every probe; return the numbers (with the date and the device)."""
    device = _device(device)
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    if not cuda:
        print("on the CPU with small sizes, to exercise the code; real numbers need a CUDA GPU")
    result = {"date": datetime.date.today().isoformat(), "device": name, "torch": torch.__version__}
    chip = hardware.for_device(device)  # datasheet figures; None on a CPU or an unlisted GPU

    copy = copy_bandwidth(device=device)
    sheet_bw = chip.hbm_bandwidth if chip else None
    result.update(copy_bandwidth=copy, datasheet_bandwidth=sheet_bw)
    print(f"copy bandwidth (read + write): {copy / 1e9:,.0f} GB/s"
          + (f" = {copy / sheet_bw:.0%} of the datasheet's {sheet_bw / 1e12:.2f} TB/s" if sheet_bw else ""))

    print("\nstrided copy (useful bytes only):")
    result["strided"] = {}
    for stride in (1, 2, 4, 8, 16, 32):
        rate = strided_copy_bandwidth(stride, device=device)
        result["strided"][stride] = rate
        print(f"  stride {stride:>2}: {rate / 1e9:8,.0f} GB/s  ({rate / result['strided'][1]:.0%} of stride 1)")

    n = 8192 if cuda else 512
    print(f"\nmatmul {n}×{n}×{n}:")
    result["matmul_n"], result["matmul"] = n, {}
    for dtype in (DTYPES if cuda else ("fp32",)):
        rate = matmul_rate(n, dtype, device=device)
        peak = chip.flops.get(dtype) if chip else None
        result["matmul"][dtype] = {"flops": rate, "datasheet": peak}
        print(f"  {dtype:>5}: {rate / 1e12:8.1f} TFLOP/s" + (f" = {rate / peak:.0%} of datasheet "
                                                            f"{peak / 1e12:.0f}" if peak else ""))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m lmfs.benchmarks probes", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.device)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
