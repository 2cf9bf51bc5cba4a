"""Hardware facts: peak FLOP/s, memory, bandwidths and SM counts of the accelerators the course
talks about, each entry with the vendor document it comes from. Every other module and notebook
reads its figures here. Measured figures (what a program really reaches) are dated JSON files in
``results/``, read with :func:`lmfs.results.load_result`.

>>> h200 = gpu("H200")
>>> h200.flops["bf16"] / 1e12, h200.hbm_bandwidth / 1e12, h200.sm_count
(989.5, 4.8, 132)
>>> round(h200.ridge_point())          # bf16 FLOPs per HBM byte
206
>>> gpu("NVIDIA A100-SXM4-80GB").name  # torch.cuda.get_device_name() works too
'A100'

Conventions:

* ``flops``: **dense** peak FLOP/s by dtype. The H100/H200/B200 datasheets print tensor-core
  figures *with* 2:4 structured sparsity, which ordinary training does not use: the entries are
  half of the printed figure. ``"fp32"`` is the plain (non-tensor-core) rate, ``"tf32"`` fp32
  inputs on the tensor cores. ``None`` where the chip has no such mode (no bf16 on a V100, no fp8
  before Hopper).
* Bytes and bytes per second in SI units, as vendors print them (80 GB = 80·10⁹ bytes; a vendor's
  "TB/s" is 10¹² bytes per second). On-chip sizes are powers of two (256 KB = 256·1024 bytes).
* ``interconnect_bandwidth``: NVLink per GPU, both directions added, as NVIDIA prints it; for a
  TPU, its ICI links. ``pcie_bandwidth``: a ×16 link, one direction.
* GPU figures are for the SXM (or HGX) part named in ``source``; PCIe cards of the same chip have
  lower clocks and power, so lower peaks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

KB, MB = 1024, 1024**2  # on-chip memories are sized in powers of two


@dataclass(frozen=True)
class Accelerator:
    """One chip's datasheet figures (see the module doc for units and conventions)."""

    name: str
    year: int
    flops: Mapping[str, float | None]       # dense peak FLOP/s: fp32, tf32, bf16, fp16, fp8
    hbm_bandwidth: float                    # bytes/s
    memory_bytes: float                     # HBM capacity
    interconnect_bandwidth: float | None    # NVLink per GPU (both directions) or TPU ICI, bytes/s
    source: str                             # where the figures come from
    sm_count: int | None = None             # streaming multiprocessors (GPUs only)
    pcie_bandwidth: float | None = None     # ×16, one direction, bytes/s
    l2_bytes: int | None = None             # L2 cache, whole chip
    l1_smem_per_sm: int | None = None       # the L1 + shared-memory pool of one SM
    max_smem_per_sm: int | None = None      # the largest shared-memory carve-out of that pool
    registers_per_sm: int | None = None     # register file of one SM, bytes
    notes: str = field(default="", compare=False)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s in ``dtype``; a clear error where the chip has no such mode."""
        if dtype not in self.flops:
            raise KeyError(f"unknown dtype {dtype!r}: use one of {', '.join(self.flops)}")
        value = self.flops[dtype]
        if value is None:
            raise ValueError(f"the {self.name} has no {dtype} matmul mode; its modes: "
                             + ", ".join(k for k, v in self.flops.items() if v))
        return value

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOPs per HBM byte at which a kernel stops being memory-bound (the roofline's ridge)."""
        return self.peak(dtype) / self.hbm_bandwidth


def _flops(fp32, tf32, bf16, fp16, fp8) -> dict[str, float | None]:
    return {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}


GPUS: dict[str, Accelerator] = {
    "V100": Accelerator(
        "V100", 2017, _flops(15.7e12, None, None, 125e12, None), 900e9, 32e9, 300e9,
        "NVIDIA Tesla V100 datasheet (SXM2 32GB); Volta architecture whitepaper (SMs, L1/shared, L2)",
        sm_count=80, pcie_bandwidth=16e9, l2_bytes=6 * MB, l1_smem_per_sm=128 * KB,
        max_smem_per_sm=96 * KB, registers_per_sm=256 * KB,
        notes="tensor cores take fp16 only"),
    "A100": Accelerator(
        "A100", 2020, _flops(19.5e12, 156e12, 312e12, 312e12, None), 2.039e12, 80e9, 600e9,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB); Ampere architecture whitepaper (SMs, L1/shared, L2)",
        sm_count=108, pcie_bandwidth=32e9, l2_bytes=40 * MB, l1_smem_per_sm=192 * KB,
        max_smem_per_sm=164 * KB, registers_per_sm=256 * KB),
    "H100": Accelerator(
        "H100", 2022, _flops(67e12, 989e12 / 2, 1979e12 / 2, 1979e12 / 2, 3958e12 / 2), 3.35e12, 80e9, 900e9,
        "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM); Hopper architecture whitepaper (SMs, L1/shared, L2)",
        sm_count=132, pcie_bandwidth=64e9, l2_bytes=50 * MB, l1_smem_per_sm=256 * KB,
        max_smem_per_sm=228 * KB, registers_per_sm=256 * KB),
    "H200": Accelerator(
        "H200", 2024, _flops(67e12, 989e12 / 2, 1979e12 / 2, 1979e12 / 2, 3958e12 / 2), 4.8e12, 141e9, 900e9,
        "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM); the H100's Hopper die (SMs, L1/shared, L2)",
        sm_count=132, pcie_bandwidth=64e9, l2_bytes=50 * MB, l1_smem_per_sm=256 * KB,
        max_smem_per_sm=228 * KB, registers_per_sm=256 * KB),
    "B200": Accelerator(
        "B200", 2024, _flops(75e12, 2.2e15 / 2, 4.5e15 / 2, 4.5e15 / 2, 9e15 / 2), 8e12, 180e9, 1.8e12,
        "NVIDIA HGX B200 datasheet (per GPU); Blackwell architecture technical brief (SMs, L1/shared); "
        "L2 size from published microbenchmarks",
        sm_count=148, pcie_bandwidth=64e9, l2_bytes=126 * MB, l1_smem_per_sm=256 * KB,
        max_smem_per_sm=228 * KB, registers_per_sm=256 * KB),
}

# TPUs, for comparison (lecture 05): a TensorCore with MXU systolic arrays instead of SMs.
TPUS: dict[str, Accelerator] = {
    "TPU v4": Accelerator("TPU v4", 2021, _flops(None, None, 275e12, None, None), 1.2e12, 32e9, None,
                          "Google Cloud TPU documentation, 'TPU v4' system architecture"),
    "TPU v5e": Accelerator("TPU v5e", 2023, _flops(None, None, 197e12, None, None), 0.82e12, 16e9, None,
                           "Google Cloud TPU documentation, 'TPU v5e'"),
    "TPU v5p": Accelerator("TPU v5p", 2023, _flops(None, None, 459e12, None, None), 2.76e12, 95e9, None,
                           "Google Cloud TPU documentation, 'TPU v5p'"),
}


def gpu(name: str) -> Accelerator:
    """The entry of :data:`GPUS` whose chip name occurs in ``name``: ``"H200"``, or a device name
    such as ``torch.cuda.get_device_name()``'s ``"NVIDIA H100 80GB HBM3"`` (case ignored)."""
    found = _find(name)
    if found is None:
        raise KeyError(f"no datasheet figures for {name!r}; lmfs.hardware knows {', '.join(GPUS)} "
                       "(add an entry to lmfs.hardware.GPUS, with its source, for another chip)")
    return found


def for_device(device: torch.device | str | None = None) -> Accelerator | None:
    """The datasheet entry of a CUDA ``device`` (default: the current one); ``None`` on a CPU, without
    a GPU, or for a GPU :data:`GPUS` does not list, so callers fall back to measured figures."""
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _find(torch.cuda.get_device_name(device))


def _find(name: str) -> Accelerator | None:
    upper = name.upper()
    return next((entry for chip, entry in GPUS.items() if chip in upper), None)
