"""Training on several devices with ``torch.distributed``, each strategy written out.

* :mod:`lmfs.parallel.launch`: :func:`placement` decides the backend and device for ``n`` ranks
  (NCCL with a GPU each, else gloo on the CPU); :func:`run` starts ranks (spawned, or under
  ``torchrun``); :func:`run_each` runs several rank functions in one launch.
* :mod:`lmfs.parallel.comm`: collectives that count the bytes each rank sends.
* :mod:`lmfs.parallel.collectives`: the eight collectives shown and checked; all-reduce as
  reduce-scatter + all-gather; measuring a collective's algorithm and bus bandwidth.
* :mod:`lmfs.parallel.common`: the test bed (a tiny model, fixed batches, the single-process
  reference every strategy is checked against) and the one training loop every strategy uses.
* :mod:`lmfs.parallel.ddp`: data parallelism, naive and bucketed with overlap.
* :mod:`lmfs.parallel.zero`: ZeRO-1/2 sharded optimizer, ZeRO-3 / FSDP.
* :mod:`lmfs.parallel.tensor`: tensor parallelism (column/row linear, MLP, attention) and
  sequence parallelism.
* :mod:`lmfs.parallel.pipeline`: pipeline stages, naive / GPipe / 1F1B schedules, bubbles.
* :mod:`lmfs.parallel.expert`: expert parallelism with all-to-all.
* :mod:`lmfs.parallel.ring_attention`: context parallelism with ring attention.
* :mod:`lmfs.parallel.costs`: memory and communication per strategy, on paper.

Functions that run on ranks (``train_ddp``, ``demo_collectives``, ...) take ``(rank, world_size,
...)`` and are started with ``run(fn, world_size, ...)``.
"""

from lmfs.parallel.collectives import all_reduce_via_rs_ag, demo_collectives, reference_collectives
from lmfs.parallel.comm import count_bytes
from lmfs.parallel.costs import cost_table, llama_70b, strategy_costs
from lmfs.parallel.common import demo_batches, demo_config, train_on_rank, train_single
from lmfs.parallel.ddp import DDP, NaiveDDP, train_ddp
from lmfs.parallel.expert import ExpertParallelMoE, MoE, train_expert_parallel, train_moe_single
from lmfs.parallel.launch import Placement, RankFailedError, placement, run, run_each
from lmfs.parallel.pipeline import (PipelineStage, bubble, bubble_sweep, plot_timeline, simulate_pipeline,
                                    train_pipeline)
from lmfs.parallel.ring_attention import full_attention, ring_attention
from lmfs.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                                  TensorParallelMLP, tensor_parallel, train_tensor_parallel)
from lmfs.parallel.zero import FullyShardedModel, ZeroOptimizer, train_zero

__all__ = [
    "DDP", "ColumnParallelLinear", "ExpertParallelMoE", "FullyShardedModel", "MoE", "NaiveDDP",
    "PipelineStage", "Placement", "RankFailedError", "RowParallelLinear", "TensorParallelAttention",
    "TensorParallelMLP", "ZeroOptimizer", "all_reduce_via_rs_ag", "bubble", "bubble_sweep", "cost_table",
    "count_bytes", "demo_batches", "demo_collectives", "demo_config", "full_attention", "llama_70b",
    "placement", "plot_timeline", "reference_collectives", "ring_attention", "run", "run_each", "simulate_pipeline",
    "strategy_costs", "tensor_parallel", "train_ddp", "train_expert_parallel", "train_moe_single",
    "train_on_rank", "train_pipeline", "train_single", "train_tensor_parallel", "train_zero",
]
