"""Benchmarks that compare lmfs implementations with reference libraries, and the tools they use.

Run one with ``python -m lmfs.bench NAME`` (see :mod:`lmfs.bench.__main__`):

* ``tokenizer``: BPE training and encoding against Hugging Face ``tokenizers`` and ``tiktoken``
* ``train``: training throughput, MFU and memory against Hugging Face Llama
* ``probes``: the device's measured copy bandwidth and matmul rate (:mod:`lmfs.bench.probes`)
* ``kernels``, ``attention``: the Triton kernels of :mod:`lmfs.kernels` against PyTorch
* ``collectives``, ``data-parallel``: collective bandwidth, and DDP/FSDP training against PyTorch's
  (:mod:`lmfs.parallel.bench`, :mod:`lmfs.parallel.train_bench`)

Tools: :mod:`lmfs.bench.timing` (warm-up, device events, medians; a profiler table) and
:mod:`lmfs.bench.roofline` (the roofline and the tile/wave-quantisation model). Only the
standard library is imported here: each benchmark loads what it needs (Triton only for the kernel
benchmarks).
"""

import json
import sys


def save_json(result: dict, path: str | None) -> None:
    """Write a benchmark's results to ``path`` as JSON (the ``--json`` option); no-op without one."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {path}", file=sys.stderr)
