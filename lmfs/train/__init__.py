"""Training: token data and batches, the loop, checkpoints, and experiments that compare runs.

>>> from lmfs.train import TrainConfig, prepare_tokens, train          # doctest: +SKIP
>>> data = prepare_tokens("stories", n_bytes=1_000_000, vocab_size=1_000)   # doctest: +SKIP
>>> model = TransformerLM(TransformerConfig(vocab_size=data.vocab_size))   # doctest: +SKIP
>>> history = train(model, data.train, TrainConfig(steps=200, batch_size=16, context_length=128),
...                 val_data=data.val)                                   # doctest: +SKIP

* :mod:`lmfs.train.data`: ``get_batch``, ``tokenize_to_memmap``, ``prepare_tokens``.
* :mod:`lmfs.train.loop`: ``TrainConfig``, ``train``, ``History`` and the pieces of a step.
* :mod:`lmfs.train.checkpoint`: ``save_checkpoint``, ``load_checkpoint`` (atomic, resumable).
* :mod:`lmfs.train.experiments`: ``ablate`` (train variants of one model), ``smooth``, ``plot_runs``,
  ``compare_runs``, ``results_table``, ``check_trained``, ``unigram_loss``.

``python -m lmfs.train --help`` trains a small model from the command line.
"""

from lmfs.train.checkpoint import load_checkpoint, restore_rng_state, rng_state, save_checkpoint
from lmfs.train.data import TokenData, get_batch, prepare_tokens, tokenize_to_memmap
from lmfs.train.experiments import (Run, ablate, check_trained, compare_runs, plot_runs, results_table,
                                    smooth, split_changes, unigram_loss)
from lmfs.train.loop import (History, TrainConfig, accumulate_gradients, activation_checkpointing,
                             estimate_loss, make_optimizer, resolve_autocast, train)

__all__ = [
    "History", "Run", "TokenData", "TrainConfig", "ablate", "accumulate_gradients",
    "activation_checkpointing", "check_trained", "compare_runs", "estimate_loss", "get_batch",
    "load_checkpoint", "make_optimizer", "plot_runs", "prepare_tokens", "resolve_autocast",
    "restore_rng_state", "results_table", "rng_state", "save_checkpoint", "smooth", "split_changes",
    "tokenize_to_memmap", "train", "unigram_loss",
]
