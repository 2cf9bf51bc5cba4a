"""The GRPO trainer: rollouts through the inference engine, rewards, reference, update.

One step of :class:`GRPOTrainer` (Shao et al. 2024, DeepSeekMath; the loss variants of Dr. GRPO,
Liu et al. 2025) runs four phases, one after the other, each a public method:

1. **rollout** (:meth:`GRPOTrainer.rollout`): ``prompts_per_step`` problems, each asked
   ``group_size`` times, are answered by :class:`lmfs.inference.LLM` (continuous batching over a
   paged KV cache; the group's copies of a prompt share its full KV blocks). The engine returns the
   sampled tokens and their log-probs.
2. **reward** (:meth:`GRPOTrainer.score`, :meth:`GRPOTrainer.micro_batches`): ``reward_fn(problem,
   response_text)`` per response, turned into group-normalised advantages
   (:func:`lmfs.alignment.pg.group_advantages`), and the padded micro-batches (sequences sorted by
   length, so each micro-batch pads little). The true checker
   (:func:`lmfs.alignment.tasks.check_answer`) is also recorded as ``accuracy``, so a reward that
   can be gamed shows up as reward rising while accuracy does not.
3. **reference** (:meth:`GRPOTrainer.reference_logprobs`): with a KL penalty (or a ``reference``
   passed in to watch the KL), the frozen reference model's log-probs of the same tokens; with
   neither, no reference model exists.
4. **update** (:meth:`GRPOTrainer.update`): ``epochs_per_batch`` optimizer steps over the rollout
   batch, each accumulating the gradient over micro-batches of ``micro_batch_size`` sequences.

Each phase is timed by a :class:`~lmfs.train.phases.PhaseTimer`, which waits for the device at its ends, so a phase's
seconds hold its device work. On a GPU the update runs under bfloat16 autocast on the float32
master weights, and so do the rollouts (the engine's ``autocast``): the sampler's log-probs come
from the same arithmetic as the update's.

The *old* log-probs (the denominator of the importance ratio) need no forward pass of their own:
an epoch is one optimizer step, so the whole first epoch runs on the policy that sampled the batch,
and its log-probs, detached, are the old ones (the ratio is exactly 1 there); later epochs reuse them.

Sequences are ``prompt + response``; the loss mask is True on the positions that predict a response
token (the end-of-turn token included), so prompt tokens carry no loss. Bad input has defined
behaviour: a group of one is refused (it has no baseline), groups with equal rewards get zero
advantages, a response with no tokens contributes nothing, and a prompt that does not fit the
context is left out with a warning; a non-finite loss stops training with an error.

:class:`lmfs.fast.grpo.PipelinedGRPOTrainer` runs the same algorithm with its phases overlapped
and the update's forward fused, packed or compiled: the same losses and weights, faster.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lmfs.alignment.pg import (AGGREGATIONS, KL_ESTIMATORS, PG_LOSSES, aggregate, clip_fraction, group_advantages,
                               kl_estimate, pg_loss)
from lmfs.alignment.sft import format_prompt, padding_id, response_logprobs
from lmfs.alignment.tasks import check_answer
from lmfs.eval import Interval, bootstrap_ci, pass_at_k
from lmfs.inference import LLM, SamplingParams
from lmfs.optim import AdamW, clip_grad_norm
from lmfs.train import load_checkpoint, resolve_autocast, restore_rng_state, save_checkpoint
from lmfs.train.phases import PhaseTimer

PHASES = ("rollout", "reward", "reference", "update")


@dataclass
class GRPOConfig:
    """How to run GRPO. Invalid values raise ``ValueError`` naming every problem.

    ``group_size`` answers per prompt (≥ 2: the group's mean is the baseline); ``prompts_per_step``
    prompts per rollout batch, so a step has ``group_size · prompts_per_step`` sequences;
    ``loss`` one of :data:`~lmfs.alignment.pg.PG_LOSSES`; ``aggregation`` how per-token losses become
    one number (``"constant"``: Dr. GRPO's sum over tokens divided by ``max_new_tokens``);
    ``kl_coef`` the weight of the per-token KL estimate ``kl_estimator`` to the reference (0: no
    reference model runs); ``epochs_per_batch`` optimizer steps per rollout batch (each over the
    whole batch); ``autocast``: ``"auto"`` (bfloat16 on CUDA, off elsewhere), ``"bf16"`` or
    ``"off"``: the dtype the update and the rollouts compute in (the weights stay float32);
    ``max_batch_size``: sequences the engine decodes at once; ``checkpoint_dir``: where ``grpo.pt``
    is written every ``checkpoint_every`` steps and at the end, and read back on start;
    ``eval_every``: pass@1 on ``eval_problems`` every that many steps (0: never), with
    ``eval_samples`` answers per problem.
    """

    group_size: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 1e-5
    epochs_per_batch: int = 1
    micro_batch_size: int = 32
    clip: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss: str = "grpo_clip"
    normalize_std: bool = True
    aggregation: str = "sequence_mean"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = 1.0
    eval_every: int = 0
    eval_samples: int = 4
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    max_batch_size: int = 512
    autocast: str = "auto"
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        self.betas = tuple(self.betas)
        problems = []
        if self.group_size < 2:
            problems.append(f"group_size={self.group_size}: a group of one has no baseline (its advantage is "
                            "always 0 and nothing is learned); use group_size >= 2")
        for name in ("prompts_per_step", "max_new_tokens", "epochs_per_batch", "micro_batch_size",
                     "eval_samples", "checkpoint_every", "max_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.eval_every < 0:
            problems.append(f"eval_every={self.eval_every} must be >= 0 (0: never)")
        if self.temperature <= 0:
            problems.append(f"temperature={self.temperature} must be > 0: RL samples its answers (greedy "
                            "answers of a group are all the same, so every advantage would be 0)")
        if self.lr <= 0 or self.clip <= 0 or self.kl_coef < 0 or self.weight_decay < 0:
            problems.append(f"need lr > 0, clip > 0, kl_coef >= 0, weight_decay >= 0; got lr={self.lr}, "
                            f"clip={self.clip}, kl_coef={self.kl_coef}, weight_decay={self.weight_decay}")
        for name, allowed in (("autocast", ("auto", "bf16", "off")), ("loss", PG_LOSSES),
                              ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {allowed}")
        if problems:
            raise ValueError("invalid GRPOConfig:\n  - " + "\n  - ".join(problems))

    @property
    def batch_size(self) -> int:
        """Sequences per step: ``prompts_per_step · group_size``."""
        return self.prompts_per_step * self.group_size


@dataclass
class GRPOHistory:
    """Per step (``step`` counts steps done: 1, 2, ...): mean ``reward`` (from ``reward_fn``),
    ``accuracy`` (from :func:`~lmfs.alignment.tasks.check_answer`), per response token the ``kl``
    to the reference (``k3``, before the update; NaN without a reference) and the ``entropy``,
    ``loss`` and ``clip_fraction`` (share of response tokens whose clipped loss had no gradient) of
    the last epoch, mean ``response_length`` in tokens, ``informative_groups`` (share of groups
    with unequal rewards: the only ones that teach anything), and wall seconds per phase
    (``rollout_s`` ... ``update_s``, see :data:`PHASES`). ``eval_step``/``eval_pass1``: the periodic evaluations."""

    step: list[int] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    clip_fraction: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    response_length: list[float] = field(default_factory=list)
    informative_groups: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    reward_s: list[float] = field(default_factory=list)
    reference_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_pass1: list[float] = field(default_factory=list)

    def to_frame(self):
        """A pandas DataFrame, one row per step (the evaluations merged in where they ran)."""
        import pandas as pd

        steps = {name: values for name, values in asdict(self).items() if not name.startswith("eval_")}
        frame = pd.DataFrame(steps)
        evals = pd.DataFrame({"step": self.eval_step, "eval_pass1": self.eval_pass1})
        return frame.merge(evals, on="step", how="left")

    def phase_seconds(self) -> dict[str, float]:
        """Total wall seconds per phase over the run."""
        return {phase: float(sum(getattr(self, f"{phase}_s"))) for phase in PHASES}


@dataclass
class Evaluation:
    """pass@k on a set of problems: ``samples`` answers each, ``correct[i]`` of them right for problem
    ``i``; ``pass_at[k]`` the mean over problems with a bootstrap interval over problems, and
    ``per_problem[k]`` the per-problem estimates (for a paired comparison of two models)."""

    samples: int
    correct: list[int]
    pass_at: dict[int, Interval]
    per_problem: dict[int, list[float]]

    def __repr__(self) -> str:
        return ", ".join(f"pass@{k} {ci}" for k, ci in self.pass_at.items()) + f" ({len(self.correct)} problems)"


@dataclass
class Rollout:
    """One rollout batch of ``N`` sequences (``N = prompts_per_step · group_size``, groups consecutive):
    token ids of each prompt and response, the response's text (without its closing special token;
    None where :meth:`GRPOTrainer.score` is left to decode it), the log-prob the sampler gave each
    response token, and per sequence its reward, the true checker's verdict and its advantage (all
    three None until :meth:`GRPOTrainer.score`). A request the engine refused has an empty response."""

    problems: list
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str | None]
    sampler_logprobs: list[list[float]]
    rewards: torch.Tensor | None = None         # (N,) from reward_fn
    correct: torch.Tensor | None = None         # (N,) from check_answer
    advantages: torch.Tensor | None = None      # (N,) group-normalised


def batch_tensors(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                  device=None, *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (B, L), mask (B, L-1))`` for sequences ``prompt + response``, right-padded with
    ``pad_id`` (:func:`lmfs.alignment.sft.padding_id`).

    ``mask[i, t]`` is True exactly where token ``t + 1`` of sequence ``i`` belongs to its response, so
    the log-prob the model gives at position ``t`` is that of a response token. A response with no
    tokens has an all-False row (it contributes nothing to any loss).

    >>> ids, mask = batch_tensors([[5, 6], [7]], [[8, 9], []], pad_id=99)
    >>> ids.tolist(), mask.int().tolist()
    ([[5, 6, 8, 9], [7, 99, 99, 99]], [[0, 1, 1], [0, 0, 0]])
    """
    lengths = np.array([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)])
    L = max(lengths.max(), 2)
    # every token read into one flat array (numpy's fromiter, faster than nested lists), then
    # scattered into the padded rows in one step
    ids = np.full((len(lengths), L), pad_id, dtype=np.int64)
    tokens = itertools.chain.from_iterable(itertools.chain(p, r) for p, r in zip(prompt_ids, response_ids))
    ids[np.arange(L) < lengths[:, None]] = np.fromiter(tokens, dtype=np.int64, count=int(lengths.sum()))
    start = np.array([len(p) - 1 for p in prompt_ids])[:, None]       # predicts the first response token
    end = start + np.array([len(r) for r in response_ids])[:, None]
    t = np.arange(L - 1)
    mask = (t >= start) & (t < end)
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def encode_problems(tokenizer, problems: Sequence, context_length: int, what: str) -> tuple[list, list[list[int]]]:
    """The problems whose chat-formatted prompt leaves room for an answer in ``context_length``
    tokens, and their token ids; the others are left out with a warning (all of them: ``ValueError``)."""
    if not problems:
        raise ValueError(f"{what} is empty: give at least one problem")
    kept = [(p, ids) for p in problems if len(ids := tokenizer.encode(format_prompt(p.prompt))) < context_length]
    if not kept:
        raise ValueError(f"every prompt of {what} is at least context_length={context_length} tokens "
                         "long, leaving no room for an answer: shorten the prompts or use a model with "
                         "a longer context")
    if len(kept) < len(problems):
        warnings.warn(f"{len(problems) - len(kept)} of {len(problems)} prompts in {what} leave no room for an "
                      f"answer in context_length={context_length} tokens; they are left out", stacklevel=4)
    return [p for p, _ in kept], [ids for _, ids in kept]


def loss_weights(rollout: Rollout, batches, aggregation: str) -> list[float]:
    """The share of the whole batch's loss each micro-batch carries, so that the gradients accumulated
    over the micro-batches are those of one pass over the batch: its share of sequences (sequence
    mean, Dr. GRPO's constant) or of response tokens (token mean)."""
    lengths = [len(r) for r in rollout.response_ids]
    if aggregation == "token_mean":
        counts = [sum(lengths[i] for i in rows) for rows, _, _ in batches]
    elif aggregation == "sequence_mean":   # the mean runs over responses that have tokens
        counts = [sum(lengths[i] > 0 for i in rows) for rows, _, _ in batches]
    else:                                  # "constant": over every response
        counts = [len(rows) for rows, _, _ in batches]
    return [n / max(sum(counts), 1) for n in counts]


class GRPOTrainer:
    """GRPO on ``train_problems`` (:class:`~lmfs.alignment.tasks.Problem`) with ``reward_fn``.

    ``policy``: the :class:`~lmfs.nn.TransformerLM` to train, in place (pass the *starting* model:
    a checkpoint in ``config.checkpoint_dir`` is loaded into it, and the reference is copied from it
    first); ``tokenizer``: with the chat template's special tokens (any special token ends a
    response); ``reference``: the frozen model of the KL penalty (default: a copy of ``policy`` when
    ``config.kl_coef > 0``; none otherwise: no copy is kept and no reference forward runs. Pass one
    with ``kl_coef=0`` to record the KL without penalising it); ``eval_problems``: the held-out set
    of ``eval_every``. The engine comes from :meth:`make_engine` and the optimizer from
    :meth:`make_optimizer`, which a subclass may replace.
    """

    def __init__(self, policy, tokenizer, train_problems: Sequence, reward_fn: Callable = check_answer,
                 config: GRPOConfig | None = None, reference=None, eval_problems: Sequence | None = None):
        self.config = config = config or GRPOConfig()
        self.policy, self.tokenizer, self.reward_fn = policy, tokenizer, reward_fn
        self.device = next(policy.parameters()).device
        self.autocast = resolve_autocast(config.autocast, self.device)
        self.context_length = policy.config.context_length
        self.pad_id = padding_id(tokenizer)
        self.stop_ids = tuple(sorted(set(getattr(tokenizer, "special_ids", {}).values())))
        self.problems, self.prompts = encode_problems(tokenizer, train_problems, self.context_length, "train_problems")
        self.eval_problems = list(eval_problems) if eval_problems is not None else None
        if reference is None and config.kl_coef > 0:
            reference = copy.deepcopy(policy)
        if reference is not None:
            reference.eval().requires_grad_(False)
        self.reference = reference
        policy.eval()   # no dropout: the log-probs of the update must be those the sampler used
        self.optimizer = self.make_optimizer(policy)
        self.llm = self.make_engine(policy)
        self.timer = PhaseTimer(PHASES, self.device)
        self.step = 0                          # steps done
        self.history = GRPOHistory()
        self.rollout_stats: dict = {}          # the engine's statistics of the last rollout
        self.last_rollout: Rollout | None = None
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self.step, self.history = resume(self.checkpoint_path, policy, self.optimizer, config)

    def make_optimizer(self, policy) -> torch.optim.Optimizer:
        """:class:`lmfs.optim.AdamW` over the policy's parameters. It updates them in place
        (``p.addcdiv_``), so the engine, which holds the policy itself, samples from the new weights."""
        c = self.config
        return AdamW(policy.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay)

    def make_engine(self, policy) -> LLM:
        """The engine of the rollouts and evaluations: :class:`lmfs.inference.LLM` over ``policy``
        itself (no copy), computing under the update's autocast, with KV blocks for
        ``max_batch_size`` sequences of the longest prompt and answer. Token ids in and out: the
        engine needs no tokenizer (:meth:`response_text` decodes)."""
        return LLM(policy, None, **self.engine_options())

    def engine_options(self) -> dict:
        """The engine's sizes: rows for ``max_batch_size`` sequences, KV blocks for that many of the
        longest prompt and answer, the update's autocast, no progress bar."""
        longest = max(len(p) for p in self.prompts)
        per_seq = min(self.context_length, longest + self.config.max_new_tokens) + 16
        return dict(max_batch_size=self.config.max_batch_size, kv_cache_tokens=self.config.max_batch_size * per_seq,
                    progress=False, autocast=self.autocast)

    @property
    def checkpoint_path(self) -> Path | None:
        """``checkpoint_dir/grpo.pt``, or None without a ``checkpoint_dir``."""
        return Path(self.config.checkpoint_dir) / "grpo.pt" if self.config.checkpoint_dir else None

    def save(self) -> Path:
        """Write ``grpo.pt`` to ``config.checkpoint_dir`` (atomically: a crash keeps the previous one)."""
        if self.checkpoint_path is None:
            raise ValueError("no config.checkpoint_dir: set one to save checkpoints")
        return save_checkpoint(self.checkpoint_path, self.policy, self.optimizer, self.step, self.config,
                               extra={"history": asdict(self.history)})

    def sample_problems(self, step: int) -> list[int]:
        """Indices of the problems of ``step``: drawn with a generator seeded by ``(seed, step)``, so a
        resumed run asks the same questions as one that never stopped."""
        rng = np.random.default_rng([self.config.seed, step])
        n = self.config.prompts_per_step
        return rng.choice(len(self.problems), size=n, replace=n > len(self.problems)).tolist()

    def sampling(self, max_new_tokens: int | None = None, temperature: float | None = None) -> SamplingParams:
        """The rollouts' sampling: the training temperature, stopping at a special token, with log-probs."""
        c = self.config
        return SamplingParams(max_tokens=max_new_tokens or c.max_new_tokens,
                              temperature=c.temperature if temperature is None else temperature,
                              stop_token_ids=self.stop_ids, logprobs=True)

    def response_text(self, token_ids: Sequence[int]) -> str:
        """The text of a response, without its closing special token."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def group_prompts(self, indices: Sequence[int]) -> list[list[int]]:
        """The prompts of ``indices``, each ``group_size`` times in a row (a group)."""
        return [self.prompts[i] for i in indices for _ in range(self.config.group_size)]

    @torch.no_grad()
    def rollout(self, indices: Sequence[int]) -> Rollout:
        """Phase 1: answer each problem of ``indices`` ``group_size`` times through the engine."""
        outputs = self.llm.generate(self.group_prompts(indices), self.sampling(), progress=False)
        return self.rollout_of(indices, outputs)

    def rollout_of(self, indices: Sequence[int], outputs, texts: bool = True) -> Rollout:
        """The :class:`Rollout` of the engine's ``outputs`` for ``indices``; their texts decoded, or
        with ``texts=False`` left for :meth:`score`. A request the engine refused (an error) gets an
        empty response: no tokens, reward 0."""
        G, ok = self.config.group_size, [o.finish_reason != "error" for o in outputs]
        self.rollout_stats = dict(self.llm.stats)
        responses = [o.token_ids if fine else [] for o, fine in zip(outputs, ok)]
        return Rollout(problems=[self.problems[i] for i in indices for _ in range(G)],
                       prompt_ids=self.group_prompts(indices), response_ids=responses,
                       texts=[self.response_text(r) if texts else None for r in responses],
                       sampler_logprobs=[o.logprobs or [] for o in outputs])

    def score(self, rollout: Rollout) -> Rollout:
        """Phase 2: rewards, the true checker's verdicts and the group-normalised advantages (and the
        texts the rollout left undecoded)."""
        rewards, correct = [], []
        for i, (problem, text, ids) in enumerate(zip(rollout.problems, rollout.texts, rollout.response_ids)):
            if text is None:
                text = rollout.texts[i] = self.response_text(ids)
            r = float(self.reward_fn(problem, text)) if ids else 0.0
            if not math.isfinite(r):
                raise ValueError(f"reward_fn returned {r} for the response {text!r}: rewards must be finite")
            rewards.append(r)
            if self.reward_fn is check_answer:        # the reward is the true checker: no second call
                correct.append(r)
            else:
                correct.append(float(check_answer(problem, text)) if ids else 0.0)
        rollout.rewards, rollout.correct = torch.tensor(rewards), torch.tensor(correct)
        rollout.advantages = group_advantages(rollout.rewards, self.config.group_size,
                                              normalize_std=self.config.normalize_std)
        return rollout

    def micro_batches(self, rollout: Rollout) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """``(rows, input_ids, mask)`` per micro-batch of at most ``micro_batch_size`` sequences, ``rows``
        the indices of its sequences in ``rollout`` (:func:`batch_tensors`). The sequences are sorted
        by length, longest first, so each micro-batch, padded to its own longest sequence, carries
        little padding (and the first one needs the most memory, so a batch that does not fit fails
        at once). Only the tokens are needed: the batches can be built before the rollout is scored."""
        m = self.config.micro_batch_size
        lengths = [len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        return [(rows, *batch_tensors([rollout.prompt_ids[i] for i in rows], [rollout.response_ids[i] for i in rows],
                                      self.device, pad_id=self.pad_id))
                for rows in (order[s:s + m] for s in range(0, len(order), m))]

    def autocast_context(self):
        """The update's autocast (bfloat16 on CUDA by default), or nothing when it is off."""
        return torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()

    def logprobs(self, model, rollout: Rollout | None, rows, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, entropy)`` ``(b, L-1)`` of one micro-batch under ``model``, in the update's autocast
        (:func:`~lmfs.alignment.sft.response_logprobs`); with gradient where it is enabled."""
        with self.autocast_context():
            return response_logprobs(model, ids, mask)

    @torch.no_grad()
    def logprobs_of(self, model, batches, rollout: Rollout | None = None) -> list[torch.Tensor]:
        """``model``'s per-token log-probs ``(b, L-1)`` of every micro-batch, without gradient."""
        return [self.logprobs(model, rollout, rows, ids, mask)[0].float() for rows, ids, mask in batches]

    def reference_logprobs(self, rollout: Rollout, batches) -> list[torch.Tensor] | None:
        """Phase 3: the reference model's log-probs of every micro-batch; None without a reference."""
        return None if self.reference is None else self.logprobs_of(self.reference, batches, rollout)

    def to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A host tensor of the rollout (advantages, rewards) on the training device."""
        return values.to(self.device, non_blocking=True)

    def update(self, rollout: Rollout, batches, ref_logps: list[torch.Tensor] | None = None) -> dict:
        """Phase 4: ``epochs_per_batch`` optimizer steps over the scored rollout batch. Returns the last
        epoch's loss and clip fraction, and the first epoch's entropy and KL to the reference (per
        response token, measured before any update: the policy that sampled the batch).

        The old log-probs come from the first epoch's own forward passes, detached: the optimizer
        steps only after the whole epoch, so every micro-batch of it sees the sampling policy. Each
        micro-batch's loss is weighted by its share of the batch (:func:`loss_weights`), so the
        accumulated gradient is that of one pass over the whole batch."""
        c = self.config
        weights, tokens = loss_weights(rollout, batches, c.aggregation), max(sum(map(len, rollout.response_ids)), 1)
        # Running sums stay on the device: reading each micro-batch's numbers (.item()) would make the
        # host wait for the device every time instead of queueing the next micro-batch's work.
        zero = torch.zeros((), device=self.device)
        old_logps, advantages, rewards, entropy_sum, kl_sum = [], [], [], zero, zero
        for epoch in range(c.epochs_per_batch):
            loss_sum, clipped = zero, zero
            for j, ((rows, ids, mask), w) in enumerate(zip(batches, weights)):
                logp, entropy = self.logprobs(self.policy, rollout, rows, ids, mask)
                logp = logp.float()
                if epoch == 0:
                    if rollout.advantages is None:
                        raise ValueError("the rollout has no advantages: score it (GRPOTrainer.score) first")
                    old_logps.append(logp.detach())
                    advantages.append(self.to_device(rollout.advantages[rows]))
                    rewards.append(self.to_device(rollout.rewards[rows]))
                    entropy_sum = entropy_sum + (entropy.detach().float() * mask).sum()
                per_token = pg_loss(logp, advantages[j], kind=c.loss, old_logp=old_logps[j], clip=c.clip,
                                    raw_rewards=rewards[j])
                if ref_logps is not None:
                    kl = kl_estimate(logp, ref_logps[j], kind=c.kl_estimator)
                    if c.kl_coef > 0:
                        per_token = per_token + c.kl_coef * kl
                    if epoch == 0:
                        kl_sum = kl_sum + (kl.detach() * mask).sum()
                loss = aggregate(per_token, mask, how=c.aggregation, constant=c.max_new_tokens)
                (loss * w).backward()
                loss_sum = loss_sum + loss.detach() * w
                clipped = clipped + clip_fraction(logp, old_logps[j], advantages[j], mask, c.clip) * mask.sum()
            loss_value = self.optimizer_step(loss_sum)
        return dict(loss=loss_value, clip_fraction=clipped.item() / tokens, entropy=entropy_sum.item() / tokens,
                    kl=kl_sum.item() / tokens if ref_logps is not None else float("nan"))

    def optimizer_step(self, loss: torch.Tensor) -> float:
        """Read the epoch's loss (a wait for the device; a non-finite one raises before it reaches the
        weights), clip the gradient, step the optimizer and clear the gradient; return the loss."""
        value = self.checked_loss(loss)
        if self.config.grad_clip:
            clip_grad_norm([p for p in self.policy.parameters() if p.grad is not None], self.config.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def checked_loss(self, loss: torch.Tensor) -> float:
        """The loss's value (a wait for the device); a non-finite one raises ``FloatingPointError``."""
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the GRPO loss is {value} at step {self.step + 1}: training diverged. "
                                     f"Lower the learning rate (lr={self.config.lr:g}) or keep grad_clip on")
        return value

    def train_step(self) -> dict:
        """One GRPO step: its four phases in order, each timed; returns its record (see
        :class:`GRPOHistory`). The counter ``step`` moves on in :meth:`train`."""
        self.timer.reset()
        with self.timer.phase("rollout"):
            rollout = self.rollout(self.sample_problems(self.step))
        with self.timer.phase("reward"):
            self.score(rollout)
            batches = self.micro_batches(rollout)
        with self.timer.phase("reference"):
            ref_logps = self.reference_logprobs(rollout, batches)
        with self.timer.phase("update"):
            stats = self.update(rollout, batches, ref_logps)
        return self.record(rollout, stats)

    def record(self, rollout: Rollout, stats: dict) -> dict:
        """A step's record: the rollout's numbers, the update's, and the phases' seconds."""
        self.last_rollout = rollout
        grouped = rollout.rewards.view(-1, self.config.group_size)
        return dict(step=self.step + 1, reward=rollout.rewards.mean().item(), accuracy=rollout.correct.mean().item(),
                    **stats, response_length=float(np.mean([len(r) for r in rollout.response_ids])),
                    informative_groups=(grouped.max(1).values > grouped.min(1).values).float().mean().item(),
                    **{f"{name}_s": s for name, s in self.timer.reset().items()})

    def train(self, steps: int) -> GRPOHistory:
        """Run until ``steps`` steps are done in all (a resumed trainer continues from its step);
        returns the history. Checkpoints every ``checkpoint_every`` steps and at the end."""
        c = self.config
        bar = tqdm(range(self.step, steps), initial=self.step, total=steps, desc="GRPO", disable=not c.progress)
        for _ in bar:
            record = self.train_step()
            self.step += 1
            for name, value in record.items():
                getattr(self.history, name).append(value)
            bar.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record['accuracy']:.3f}",
                            len=f"{record['response_length']:.1f}", refresh=False)
            if c.eval_every and self.eval_problems and self.step % c.eval_every == 0:
                result = self.evaluate(self.eval_problems, k=(1,), samples=c.eval_samples)
                self.history.eval_step.append(self.step)
                self.history.eval_pass1.append(result.pass_at[1].estimate)
            if self.checkpoint_path and (self.step % c.checkpoint_every == 0 or self.step == steps):
                self.save()
        bar.close()
        return self.history

    @torch.no_grad()
    def evaluate(self, problems: Sequence, k: Sequence[int] = (1, 4), samples: int | None = None,
                 temperature: float | None = None, max_new_tokens: int | None = None, seed: int = 0) -> Evaluation:
        """pass@k of the current policy on ``problems``: ``samples`` answers each (default ``max(k)``)
        at ``temperature`` (default the training one), judged by :func:`~lmfs.alignment.tasks.check_answer`;
        the unbiased estimator of :func:`lmfs.eval.pass_at_k` per problem and a bootstrap interval
        over problems. Seeded with ``seed``; the training run's random streams are left as they were."""
        k, samples = tuple(k), samples or max(k)
        if max(k) > samples:
            raise ValueError(f"pass@{max(k)} needs at least {max(k)} samples per problem, got samples={samples}")
        problems, prompts = encode_problems(self.tokenizer, problems, self.context_length, "problems")
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            outputs = self.llm.generate([p for p in prompts for _ in range(samples)],
                                        self.sampling(max_new_tokens, temperature), progress=False)
        correct = [int(sum(check_answer(problem, self.response_text(o.token_ids))
                           for o in outputs[i * samples:(i + 1) * samples] if o.finish_reason != "error"))
                   for i, problem in enumerate(problems)]
        per_problem = {j: [pass_at_k(samples, c, j) for c in correct] for j in k}
        return Evaluation(samples, correct, {j: bootstrap_ci(v) for j, v in per_problem.items()}, per_problem)


def resume(path: Path, policy, optimizer, config: GRPOConfig) -> tuple[int, GRPOHistory]:
    """Load a GRPO checkpoint into ``policy`` and ``optimizer`` and restore the random generators;
    return its step and history. A checkpoint of a run with another :class:`GRPOConfig` is refused
    (``ValueError`` listing the differences); settings that do not change what is trained are not
    compared, nor settings the checkpoint's version did not have."""
    ckpt = load_checkpoint(path, policy, optimizer)
    stored, current = ckpt["train_config"], asdict(config)
    ignored = {"progress", "eval_every", "eval_samples", "checkpoint_every", "checkpoint_dir"}
    differing = [f"{k}: checkpoint {stored.get(k)!r} vs now {current[k]!r}" for k in current
                 if k not in ignored and k in stored and stored[k] != current[k]
                 and not (isinstance(current[k], tuple) and list(current[k]) == stored[k])]
    if differing:
        raise ValueError(f"{path} was written by a run with another GRPOConfig (" + "; ".join(differing)
                         + "): use the same config, or another checkpoint_dir")
    known = {f.name for f in fields(GRPOHistory)}
    history = GRPOHistory(**{k: v for k, v in ckpt["extra"]["history"].items() if k in known})
    restore_rng_state(ckpt["rng"])
    if config.progress:
        print(f"resumed from {path} at step {ckpt['step']}")
    return ckpt["step"], history
