"""Alignment: from a pre-trained model to an assistant (lectures 15-17).

* :mod:`lmfs.alignment.tasks`: generated data: verifiable problems (arithmetic, countdown) with
  answer checkers, instructions with responses, preference pairs; a held-out test split.
* :mod:`lmfs.alignment.sft`: the chat template, prompt-masked tokenisation, packing, per-token
  log-probs and entropy, the SFT loss and trainer (micro-batches, gradient accumulation).
* :mod:`lmfs.alignment.preference`: the Bradley-Terry reward model and DPO.
* :mod:`lmfs.alignment.base`: the course's base model and its SFT version, trained once and cached.
* :mod:`lmfs.alignment.pg`: group-normalised advantages, per-token policy-gradient losses (no
  baseline, baseline, GRPO-clip), masked aggregation (Dr. GRPO's among them), KL estimators.
* :mod:`lmfs.alignment.grpo`: the GRPO trainer, with rollouts through :mod:`lmfs.inference`.

``python -m lmfs.alignment data`` rebuilds ``data/alignment/``.
"""

from lmfs.alignment.base import base_model, sft_model
from lmfs.alignment.grpo import GRPOConfig, GRPOTrainer
from lmfs.alignment.pg import (aggregate, clip_fraction, group_advantages, kl_estimate, masked_mean,
                               masked_normalize, pg_loss)
from lmfs.alignment.preference import (RewardModel, bradley_terry_loss, dpo_loss, reward_accuracy,
                                       sequence_logprob, train_dpo, train_reward_model)
from lmfs.alignment.sft import (CHAT_TEMPLATE, encode_example, format_prompt, pack, response_logprobs, sft_loss,
                                train_sft)
from lmfs.alignment.tasks import (Problem, arithmetic_problems, check_answer, countdown_problems, extract_answer,
                                  instruction_examples, load_split, preference_pairs)

__all__ = [
    "CHAT_TEMPLATE", "GRPOConfig", "GRPOTrainer", "Problem", "aggregate", "clip_fraction", "group_advantages",
    "kl_estimate", "masked_mean", "masked_normalize", "pg_loss", "RewardModel", "arithmetic_problems", "base_model", "bradley_terry_loss",
    "check_answer", "countdown_problems", "dpo_loss", "encode_example", "extract_answer", "format_prompt",
    "instruction_examples", "load_split", "pack", "preference_pairs", "response_logprobs", "reward_accuracy",
    "sequence_logprob", "sft_loss", "sft_model", "train_dpo", "train_reward_model", "train_sft",
]
