"""Inference: KV caches, cached forward passes, sampling, and a continuous-batching engine.

* :mod:`lmfs.inference.kv_cache`: the contiguous :class:`KVCache`, the paged :class:`PagedKVCache`
  with its :class:`BlockAllocator` (prefix sharing), :func:`paged_attention_reference`.
* :mod:`lmfs.inference.runner`: :func:`forward_cached`, the engine's :func:`paged_forward` and its
  :class:`ModelRunner` (a scheduled step's forward and sampling).
* :mod:`lmfs.inference.sampling`: :class:`SamplingParams` and :func:`sample`.
* :mod:`lmfs.inference.scheduler`: :class:`Scheduler` (admission, prefix sharing, preemption,
  finishing; plain Python) and its :class:`Request`.
* :mod:`lmfs.inference.engine`: :class:`LLM` (continuous batching over the paged cache: the loop
  schedule → runner step → accept). Faster runners come from outside: :func:`lmfs.fast.fast_engine`.
* :mod:`lmfs.inference.static`: :func:`generate_static` (batched generation with the contiguous
  cache: static batching).
* :mod:`lmfs.inference.quantize`: weight-only int8/int4 group-wise quantisation, AWQ scaling.
* :mod:`lmfs.inference.speculative`: speculative decoding with a draft model, exact acceptance rule
  (:class:`SpeculativeDecoder`: whole rounds replayed from a CUDA graph).
"""

from lmfs.inference.engine import LLM, Generation
from lmfs.inference.kv_cache import (BlockAllocator, KVCache, PagedKVCache, kv_bytes_per_token,
                                     paged_attention_reference)
from lmfs.batching import PagedBatch, gathered_batch
from lmfs.inference.runner import ModelRunner, forward_cached, paged_forward
from lmfs.inference.scheduler import Request, RequestFailed, RequestOutput, ScheduledBatch, Scheduler
from lmfs.inference.static import generate_static
from lmfs.inference.quantize import (QuantizedWeight, QuantLinear, dequantize_weight, model_weight_bytes,
                                     quantize_model, quantize_weight)
from lmfs.inference.sampling import SamplingParams, process_logits, sample
from lmfs.inference.speculative import (SpeculativeDecoder, acceptance_probability, speculative_generate,
                                        speculative_step, speculative_step_distribution)

__all__ = [
    "BlockAllocator", "Generation", "KVCache", "LLM", "ModelRunner", "Request", "RequestFailed", "RequestOutput", "ScheduledBatch",
    "Scheduler", "generate_static", "PagedBatch", "PagedKVCache", "forward_cached", "gathered_batch",
    "kv_bytes_per_token", "paged_attention_reference", "paged_forward", "process_logits", "sample",
    "SamplingParams", "QuantizedWeight", "QuantLinear", "dequantize_weight", "model_weight_bytes", "quantize_model",
    "quantize_weight", "acceptance_probability", "speculative_generate", "speculative_step",
    "speculative_step_distribution", "SpeculativeDecoder",
]
