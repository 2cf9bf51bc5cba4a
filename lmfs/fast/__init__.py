"""Speed handed in from outside: faster runners of what :mod:`lmfs.inference` and the trainers teach.

:mod:`lmfs.fast.engine`: :class:`FastRunner`, the inference engine's model runner with CUDA graphs,
steps in flight, the fused forward and the step kernels, and :func:`fast_engine`, an
:class:`~lmfs.inference.LLM` that uses it. Same scheduler, same tokens; only the speed differs.
:mod:`lmfs.fast.grpo`: :class:`PipelinedGRPOTrainer`, the GRPO trainer with its phases overlapped
and its update fused. Same samples, losses and weights; only the schedule differs.
"""

from lmfs.fast.engine import FastRunner, fast_engine
from lmfs.fast.grpo import PipelineConfig, PipelinedGRPOTrainer

__all__ = ["FastRunner", "fast_engine", "PipelineConfig", "PipelinedGRPOTrainer"]
