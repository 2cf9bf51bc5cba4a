"""Interactive explorers: one or more per lecture, each answering "what happens if I change this?".

Every ``explore_*`` function returns an ipywidgets :class:`Explorer`: controls, and below them the
text and figure of a plain update function (``*_view``) that computes its view from the controls
with the lmfs functions the lecture teaches. Display it in JupyterLab and move a control; the tests
call the ``*_view`` functions directly. Headless (nbval, papermill, the book) the cell shows the
default view as HTML.

=======  ===================================  ==============================================================
lecture  explorer                             what moves, what it shows
=======  ===================================  ==============================================================
01       :func:`explore_tokenizer`            merges learned, typed text -> tokens, bytes per token
02       :func:`explore_training_step`        model shape, batch, precision -> memory, FLOPs, step time
03       :func:`explore_runs`                 which ablation runs -> their loss curves overlaid
04       :func:`explore_routing`              router skew, top-k, capacity -> expert load, drops, aux loss
05       :func:`explore_roofline`             operation and size -> intensity, roofline, tiles and waves
06       :func:`explore_kernel_grid`          BLOCK_M, sequence length -> programs, waves, busy SMs
07-08    :func:`explore_parallelism`          strategy, GPUs, batch -> memory per GPU, bytes sent
09       :func:`explore_compute_optimal`      compute budget -> IsoFLOP curve, N*, D* per fit
10       :func:`explore_sampling`             temperature, top-k/p, min-p -> the distribution sampled
10       :func:`explore_kv_cache`             context, batch, K/V heads -> KV-cache bytes
11       :func:`explore_mup`                  width, learning rate -> μP's per-parameter lr and init
12       :func:`explore_pass_at_k`            n, c, items -> pass@k curve, bootstrap interval width
13       :func:`explore_extraction`           a page's HTML -> extracted text, Gopher and C4 verdicts
14       :func:`explore_minhash`              bands × rows -> S-curve with measured pairs
15       :func:`explore_dpo`                  β, log-ratio margin -> loss, implicit reward, gradient weight
16       :func:`explore_group_advantages`     rewards of a group -> GRPO and Dr. GRPO advantages
17       :func:`explore_clipped_objective`    clip, advantage, ratio -> clipped objective, its gradient
=======  ===================================  ==============================================================
"""

from lmfs.explore._core import Explorer, View
from lmfs.explore.eval_data_alignment import (clipped_objective_view, dpo_view, explore_clipped_objective, explore_dpo,
                                              explore_extraction, explore_group_advantages, explore_minhash,
                                              explore_pass_at_k, extraction_view, group_advantages_view,
                                              measured_pairs, minhash_view, pass_at_k_view)
from lmfs.explore.models import (explore_routing, explore_runs, explore_tokenizer, explore_training_step,
                                 merges_view, routing_view, runs_view, small_bpe, training_step_view)
from lmfs.explore.scaling_inference import (compute_optimal_view, explore_compute_optimal, explore_kv_cache,
                                            explore_mup, explore_sampling, kv_cache_view, mup_view, sampling_view,
                                            zipf_logits)
from lmfs.explore.systems import (explore_kernel_grid, explore_parallelism, explore_roofline, kernel_grid_view,
                                  model_presets, parallelism_view, roofline_view)

__all__ = [
    "Explorer", "View",
    "explore_tokenizer", "merges_view", "small_bpe",
    "explore_training_step", "training_step_view",
    "explore_runs", "runs_view",
    "explore_routing", "routing_view",
    "explore_roofline", "roofline_view",
    "explore_kernel_grid", "kernel_grid_view",
    "explore_parallelism", "parallelism_view", "model_presets",
    "explore_compute_optimal", "compute_optimal_view",
    "explore_sampling", "sampling_view", "zipf_logits",
    "explore_kv_cache", "kv_cache_view",
    "explore_mup", "mup_view",
    "explore_pass_at_k", "pass_at_k_view",
    "explore_extraction", "extraction_view",
    "explore_minhash", "minhash_view", "measured_pairs",
    "explore_dpo", "dpo_view",
    "explore_group_advantages", "group_advantages_view",
    "explore_clipped_objective", "clipped_objective_view",
]
