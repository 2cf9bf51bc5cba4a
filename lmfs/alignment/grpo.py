"""The full GRPO trainer: rollouts through the inference engine, rewards, reference, update.

One step of :class:`GRPOTrainer` (Shao et al. 2024, DeepSeekMath; the loss variants of Dr. GRPO,
Liu et al. 2025) runs four phases, each timed on its own:

1. **rollout**: ``prompts_per_step`` problems, each asked ``group_size`` times, are answered by
   :class:`lmfs.inference.LLM` (continuous batching over a paged KV cache; the group's copies of a
   prompt share its full KV blocks). The engine returns the sampled tokens and their log-probs.
2. **reward**: ``reward_fn(problem, response_text)`` per response, turned into group-normalised
   advantages (:func:`lmfs.alignment.pg.group_advantages`); the padded micro-batches are built
   (sequences sorted by length, so each micro-batch pads little). The true checker
   (:func:`lmfs.alignment.tasks.check_answer`) is also recorded as ``accuracy``, so a reward that
   can be gamed shows up as reward rising while accuracy does not. The forward passes need only the
   tokens, and the advantages enter only the loss: a training step scores on the host while the
   device computes the update's first forward, and this phase's time is the host's.
3. **reference**: with a KL penalty (or a ``reference`` passed in to watch the KL), the frozen
   reference model's log-probs of the same tokens; with neither, no reference model exists.
4. **update**: ``epochs_per_batch`` optimizer steps over the rollout batch, each accumulating the
   gradient over micro-batches of ``micro_batch_size`` sequences.

Numerics: on a GPU the update runs under bfloat16 autocast on the float32 master weights, and so
do the rollouts (the engine's ``autocast``): the sampler's log-probs come from the same arithmetic
as the update's, and the decode step's projections are bfloat16 matmuls instead of float32 ones,
several times faster. With ``fused_update`` the policy's attention and gated MLPs compute through
:func:`lmfs.kernels.fused.fuse_model` (q/k/v and gate/up as one matmul each, Triton RoPE and SwiGLU
under autocast on CUDA, an embedding lookup with a parallel backward) and on CUDA steps torch's
fused AdamW (the same update rule as :class:`lmfs.optim.AdamW`): the same parameters and state
dict, the same function up to rounding. With ``packed_update`` as well, the update's forward runs on
the batch's sequences packed into one row instead of right-padded to the longest.

The *old* log-probs (the denominator of the importance ratio) need no forward pass of their own:
an epoch is one optimizer step, so the whole first epoch runs on the policy that sampled the batch,
and its log-probs, detached, are the old ones (the ratio is exactly 1 there); later epochs reuse them.

Sequences are ``prompt + response``; the loss mask is True on the positions that predict a response
token (the end-of-turn token included), so prompt tokens carry no loss. Bad input has defined
behaviour: a group of one is refused (it has no baseline), groups with equal rewards get zero
advantages, a response with no tokens contributes nothing, and a prompt that does not fit the
context is left out with a warning; a non-finite loss stops training with an error.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lmfs.alignment.pg import (AGGREGATIONS, KL_ESTIMATORS, PG_LOSSES, aggregate, clip_fraction, group_advantages,
                               kl_estimate, pg_loss)
from lmfs.alignment.sft import format_prompt, packed_response_logprobs, response_logprobs
from lmfs.alignment.tasks import check_answer
from lmfs.bench import error_line
from lmfs.bench.timing import synchronize
from lmfs.eval import Interval, bootstrap_ci, pass_at_k
from lmfs.inference import LLM, SamplingParams
from lmfs.inference.runner import right_padded, upload
from lmfs.optim import AdamW, clip_grad_norm
from lmfs.train import load_checkpoint, resolve_autocast, restore_rng_state, save_checkpoint

PHASES = ("rollout", "reward", "reference", "update")


@dataclass
class GRPOConfig:
    """How to run GRPO. Invalid values raise ``ValueError`` naming every problem.

    ``group_size`` answers per prompt (≥ 2: the group's mean is the baseline); ``prompts_per_step``
    prompts per rollout batch, so a step has ``group_size · prompts_per_step`` sequences;
    ``loss`` one of :data:`~lmfs.alignment.pg.PG_LOSSES`; ``aggregation`` how per-token losses become one number
    (``"constant"``: Dr. GRPO's sum over tokens divided by ``max_new_tokens``); ``kl_coef`` the
    weight of the per-token KL estimate ``kl_estimator`` to the reference (0: no reference model
    runs); ``epochs_per_batch`` optimizer steps per rollout batch (each over the whole batch);
    ``autocast``: ``"auto"`` (bfloat16 on CUDA, off elsewhere), ``"bf16"`` or ``"off"``: the dtype the
    update and the rollouts compute in (the weights stay float32); ``fused_update``: compute the
    policy through :func:`lmfs.kernels.fused.fuse_model`
    (``chunked_loss=False, norms=True, embedding=True``: one matmul for q/k/v and for gate/up, Triton
    RoPE, SwiGLU and RMSNorm on CUDA, ``F.embedding``'s lookup; its modules change class, its
    parameters and state dict stay) and, on CUDA, step torch's fused AdamW and foreach clipping;
    ``packed_update`` (needs ``fused_update``): the update's forward runs on the batch's sequences
    packed into one row, each attending only to itself, instead of right-padded to the longest
    (:func:`~lmfs.alignment.sft.packed_response_logprobs`: the same log-probs, without computing the
    padding; variable-length flash attention on a GPU, elsewhere a block-diagonal mask, for micro-batches
    of at most :data:`~lmfs.kernels.fused.MASKED_PACKING_TOKENS` tokens); ``overlap_steps``: start a
    step's rollout while the device still runs the update of the step before, when nothing runs in
    between (:meth:`GRPOTrainer.train_step`; the same samples, since the rollout's random draws
    come after the update's either way); ``compile_update``: the update's forward, log-probs and
    entropy run through ``torch.compile`` (dynamic shapes, so one compilation serves every batch
    length; the first update waits for it, tens of seconds on a GPU; if compiling fails, a warning
    says why and the update runs without it), not with ``packed_update``;
    ``checkpoint_dir``: where ``grpo.pt`` is written every ``checkpoint_every`` steps and at the end,
    and read back on start; ``eval_every``: pass@1 on ``eval_problems`` every that many steps
    (0: never), with ``eval_samples`` answers per problem.
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
    max_batch_size: int = 512            # sequences the engine decodes at once
    autocast: str = "auto"
    fused_update: bool = True
    packed_update: bool = False
    overlap_steps: bool = True
    compile_update: bool = False
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
        if self.packed_update and not self.fused_update:
            problems.append("packed_update=True needs fused_update=True: the fused model's attention is what "
                            "keeps the packed sequences apart")
        if self.packed_update and self.compile_update:
            problems.append("packed_update=True and compile_update=True do not go together: the packed forward "
                            "runs on the host's lists of sequence lengths, which torch.compile cannot trace")
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
    token ids of each prompt and response, the response's text (without its closing special token),
    the log-prob the sampler gave each response token, and per sequence its reward, the true
    checker's verdict and (after :meth:`GRPOTrainer.score`) its advantage. A request the engine
    refused has an empty response. A text is None until :meth:`GRPOTrainer.score` decodes it where
    the rollout left it for later (``GRPOTrainer.rollout(..., texts=False)``)."""

    problems: list
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str | None]
    sampler_logprobs: list[list[float]]
    rewards: torch.Tensor          # (N,) from reward_fn
    correct: torch.Tensor          # (N,) from check_answer
    advantages: torch.Tensor | None = None


def batch_tensors(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]],
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids (B, L), mask (B, L-1))`` for sequences ``prompt + response``, right-padded with 0.

    ``mask[i, t]`` is True exactly where token ``t + 1`` of sequence ``i`` belongs to its response, so
    the log-prob the model gives at position ``t`` is that of a response token. A response with no
    tokens has an all-False row (it contributes nothing to any loss).

    >>> ids, mask = batch_tensors([[5, 6], [7]], [[8, 9], []])
    >>> ids.tolist(), mask.int().tolist()
    ([[5, 6, 8, 9], [7, 0, 0, 0]], [[0, 1, 1], [0, 0, 0]])
    """
    lengths = np.array([len(p) + len(r) for p, r in zip(prompt_ids, response_ids)])
    L = max(lengths.max(), 2)
    # the padded rows and the mask in numpy (a third of torch's time on the CPU), uploaded once each
    ids = right_padded((itertools.chain(p, r) for p, r in zip(prompt_ids, response_ids)), lengths, L)
    start = np.array([len(p) - 1 for p in prompt_ids])[:, None]       # predicts the first response token
    end = start + np.array([len(r) for r in response_ids])[:, None]
    t = np.arange(L - 1)
    mask = (t >= start) & (t < end)
    return upload(ids, device), upload(mask, device, torch.bool)


class GRPOTrainer:
    """GRPO on ``train_problems`` (:class:`~lmfs.alignment.tasks.Problem`) with ``reward_fn``.

    ``policy``: the :class:`~lmfs.nn.TransformerLM` to train, in place (pass the *starting* model:
    a checkpoint in ``config.checkpoint_dir`` is loaded into it, and the reference is copied from it
    first); ``tokenizer``: with the chat template's special tokens (any special token ends a
    response); ``reference``: the frozen model of the KL penalty (default: a copy of ``policy`` when
    ``config.kl_coef > 0``; none otherwise: no copy is kept and no reference forward runs. Pass one
    with ``kl_coef=0`` to record the KL without penalising it); ``eval_problems``: the held-out set
    of ``eval_every``.
    """

    def __init__(self, policy, tokenizer, train_problems: Sequence, reward_fn: Callable = check_answer,
                 config: GRPOConfig | None = None, reference=None, eval_problems: Sequence | None = None):
        self.config = config = config or GRPOConfig()
        self.policy, self.tokenizer, self.reward_fn = policy, tokenizer, reward_fn
        self.device = next(policy.parameters()).device
        self.autocast = resolve_autocast(config.autocast, self.device)
        if config.fused_update:   # before the reference is copied from it, so that the copy is fused too
            from lmfs.kernels.fused import fuse_model
            # the log-probs need the logits, so no chunked loss; norms: the Triton RMSNorm in the update;
            # embedding: a lookup whose backward suits a small vocabulary's many repeated ids. Compiled
            # (compile_update), no Triton kernels: torch.compile writes its own for the norms, RoPE and SwiGLU.
            fuse_model(policy, chunked_loss=False, norms=not config.compile_update, embedding=True,
                       triton=not config.compile_update)
        # compile_update: the policy's log-probs in the update through torch.compile. Dynamic shapes, since
        # the batch's length is its longest answer's and changes from step to step.
        self._update_logprobs = (torch.compile(response_logprobs, dynamic=True) if config.compile_update
                                 else response_logprobs)
        self.context_length = policy.config.context_length
        self.problems, self.prompts = self._encode(train_problems, "train_problems")
        self.eval_problems = list(eval_problems) if eval_problems is not None else None
        if reference is None and config.kl_coef > 0:
            reference = copy.deepcopy(policy)
        if reference is not None:
            reference.eval().requires_grad_(False)
        self.reference = reference
        policy.eval()   # no dropout: the log-probs of the update must be those the sampler used
        # The update rule is lmfs.optim.AdamW's. On a GPU the fused update steps torch's fused AdamW,
        # the same rule (tests/test_optim.py compares the two) in a few kernels per step instead of
        # six per parameter, and clips with torch's foreach norm: an H200 took 12.5 ms for the
        # benchmark model's clip and step written out, 1.2 ms with foreach clipping and the fused
        # AdamW (0.41 ms of it the step; torch's foreach AdamW took 1.5-2.2 ms). The fused kernel
        # leaves the parameters' version counters alone, and the engine's 16-bit weight copies
        # follow those counters, so _optimizer_step bumps them. Checkpoints of either optimizer
        # resume with the other (lmfs.optim.adam_state_for).
        self._torch_optimizer = config.fused_update and self.device.type == "cuda"
        hyper = dict(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self.optimizer = (torch.optim.AdamW(policy.parameters(), **hyper, fused=True) if self._torch_optimizer
                          else AdamW(policy.parameters(), **hyper))
        self.stop_ids = tuple(sorted(set(getattr(tokenizer, "special_ids", {}).values())))
        # The engine holds `policy` itself, not a copy: its forward passes read the parameters' own
        # storage. On a GPU the decode step is captured in CUDA graphs, whose replays read from the
        # addresses seen at capture; the updates therefore write *into* the same tensors: lmfs's
        # AdamW (p.addcdiv_, p.mul_) and load_state_dict (copy_) do, and the graphs stay valid.
        # (Replacing a parameter tensor would make the engine notice the new addresses and capture
        # its graphs again.) The engine computes under the update's autocast; its fused decode
        # forward keeps 16-bit copies of the projection weights, which the engine brings up to date
        # from the parameters updated in place at the start of each rollout (lmfs.kernels.decode).
        longest = max(len(p) for p in self.prompts)
        per_seq = min(self.context_length, longest + config.max_new_tokens) + 16
        # token ids in and out: the engine needs no tokenizer (with one, it would decode every
        # response's text, and response_text decodes it again without the closing token)
        self.llm = LLM(policy, None, max_batch_size=config.max_batch_size,
                       kv_cache_tokens=config.max_batch_size * per_seq, progress=False, autocast=self.autocast)
        self.step = 0
        self.history = GRPOHistory()
        self.rollout_stats: dict = {}          # the engine's statistics of the last rollout
        self.last_rollout: Rollout | None = None
        self._next_rollout: tuple[int, Callable[[], Rollout]] | None = None   # (its step, finish) if started
        self._resume()

    # ------------------------------------------------------------------------------------------
    # Set-up and checkpoints

    def _encode(self, problems: Sequence, what: str) -> tuple[list, list[list[int]]]:
        """The problems whose chat-formatted prompt leaves room in the context, and their token ids."""
        if not problems:
            raise ValueError(f"{what} is empty: give at least one problem")
        kept, ids = [], []
        for p in problems:
            tokens = self.tokenizer.encode(format_prompt(p.prompt))
            if len(tokens) < self.context_length:
                kept.append(p)
                ids.append(tokens)
        dropped = len(problems) - len(kept)
        if not kept:
            raise ValueError(f"every prompt of {what} is at least context_length={self.context_length} tokens "
                             "long, leaving no room for an answer: shorten the prompts or use a model with "
                             "a longer context")
        if dropped:
            warnings.warn(f"{dropped} of {len(problems)} prompts in {what} leave no room for an answer in "
                          f"context_length={self.context_length} tokens; they are left out", stacklevel=3)
        return kept, ids

    @property
    def checkpoint_path(self) -> Path | None:
        return Path(self.config.checkpoint_dir) / "grpo.pt" if self.config.checkpoint_dir else None

    def _resume(self) -> None:
        path = self.checkpoint_path
        if path is None or not path.exists():
            return
        ckpt = load_checkpoint(path, self.policy, self.optimizer)
        stored, current = ckpt["train_config"], asdict(self.config)
        # settings that do not change what is trained; settings of older versions, and settings a
        # checkpoint predates, are not compared
        ignored = {"progress", "eval_every", "eval_samples", "checkpoint_every", "checkpoint_dir", "fused_update",
                   "packed_update", "overlap_steps", "compile_update"}
        differing = [f"{k}: checkpoint {stored.get(k)!r} vs now {current[k]!r}" for k in current
                     if k not in ignored and k in stored and stored[k] != current[k] and not (
                         isinstance(current[k], tuple) and list(current[k]) == stored.get(k))]
        if differing:
            raise ValueError(f"{path} was written by a run with another GRPOConfig ("
                             + "; ".join(differing) + "): use the same config, or another checkpoint_dir")
        self.step = ckpt["step"]
        known = {f.name for f in fields(GRPOHistory)}     # older versions also timed an "old_logprob" phase
        self.history = GRPOHistory(**{k: v for k, v in ckpt["extra"]["history"].items() if k in known})
        restore_rng_state(ckpt["rng"])
        if self.config.progress:
            print(f"resumed from {path} at step {self.step}")

    def save(self) -> Path:
        """Write ``grpo.pt`` to ``config.checkpoint_dir`` (atomically: a crash keeps the previous one)."""
        if self.checkpoint_path is None:
            raise ValueError("no config.checkpoint_dir: set one to save checkpoints")
        return save_checkpoint(self.checkpoint_path, self.policy, self.optimizer, self.step, self.config,
                               extra={"history": asdict(self.history)})

    # ------------------------------------------------------------------------------------------
    # The phases of a step

    def sample_problems(self, step: int) -> list[int]:
        """Indices of the problems of ``step``: drawn with a generator seeded by ``(seed, step)``, so a
        resumed run asks the same questions as one that never stopped."""
        rng = np.random.default_rng([self.config.seed, step])
        n = self.config.prompts_per_step
        return rng.choice(len(self.problems), size=n, replace=n > len(self.problems)).tolist()

    def _sampling(self, max_new_tokens: int | None = None, temperature: float | None = None) -> SamplingParams:
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

    def rollout(self, indices: Sequence[int], texts: bool = True) -> Rollout:
        """Answer each problem of ``indices`` ``group_size`` times through the engine (phase 1).
        A request the engine refuses gets an empty response (no tokens, reward 0).

        Each answer's text is decoded as it finishes, while the engine computes the others on the
        device. With ``texts=False``, the answers handed over while no decode step is in flight (the
        last ones, when nothing is left to compute) keep ``None`` for :meth:`score` to decode: the
        training step scores while the device runs the update's first forward (:meth:`update`), so
        that their decoding waits for nothing."""
        return self.start_rollout(indices, texts)()

    @torch.no_grad()
    def start_rollout(self, indices: Sequence[int], texts: bool = True) -> Callable[[], Rollout]:
        """:meth:`rollout` in two halves (:meth:`lmfs.inference.LLM.start`): admits the requests and
        launches their prefill without waiting for the device, and returns the function that
        finishes the rollout and returns it (its ``generation`` attribute is the engine's
        :class:`~lmfs.inference.Generation`, for closing a rollout that will not be finished)."""
        G = self.config.group_size
        prompts = [self.prompts[i] for i in indices for _ in range(G)]
        decoded: list[str | None] = [None] * len(prompts)

        def decode(out):
            if out.finish_reason == "error":
                decoded[out.index] = ""
            elif texts or self.llm.step_in_flight:
                decoded[out.index] = self.response_text(out.token_ids)

        generation = self.llm.start(prompts, self._sampling(), progress=False, on_finish=decode)

        @torch.no_grad()
        def finish() -> Rollout:
            outputs = generation.result()
            self.rollout_stats = dict(self.llm.stats)
            return Rollout(problems=[self.problems[i] for i in indices for _ in range(G)], prompt_ids=prompts,
                           response_ids=[o.token_ids if o.finish_reason != "error" else [] for o in outputs],
                           texts=decoded, sampler_logprobs=[o.logprobs or [] for o in outputs],
                           rewards=torch.zeros(len(prompts)), correct=torch.zeros(len(prompts)))

        finish.generation = generation
        return finish

    def score(self, rollout: Rollout) -> Rollout:
        """Rewards, the true checker's verdicts and the group-normalised advantages (phase 2), and the
        texts the rollout left undecoded."""
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
        the indices of its sequences in ``rollout``. The sequences are sorted by length, longest first,
        so each micro-batch, padded to its own longest sequence, carries little padding (and the first
        one needs the most memory, so a batch that does not fit fails at once)."""
        m = self.config.micro_batch_size
        lengths = [len(p) + len(r) for p, r in zip(rollout.prompt_ids, rollout.response_ids)]
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out = []
        for start in range(0, len(order), m):
            rows = order[start:start + m]
            ids, mask = batch_tensors([rollout.prompt_ids[i] for i in rows],
                                      [rollout.response_ids[i] for i in rows], self.device)
            out.append((rows, ids, mask))
        return out

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()

    @torch.no_grad()
    def logprobs_of(self, model, batches, rollout: Rollout | None = None) -> list[torch.Tensor]:
        """``model``'s per-token log-probs ``(b, L-1)`` of every micro-batch (phase 3); packed as the
        update is (``packed_update``) when given the ``rollout`` the batches came from."""
        out = []
        for rows, ids, mask in batches:
            with self._autocast():
                out.append(self._response_logprobs(model, rollout, rows, ids, mask)[0].float())
        return out

    def _response_logprobs(self, model, rollout: Rollout | None, rows, ids, mask):
        """:func:`~lmfs.alignment.sft.response_logprobs` of one micro-batch, or with ``packed_update``
        (and the ``rollout``, for the sequences' lengths) the packed computation of the same, where
        ``model``'s attention can keep packed sequences apart (a reference passed in may be plain)."""
        if self.config.packed_update and rollout is not None:
            from lmfs.kernels.fused import keeps_sequences_apart

            if keeps_sequences_apart(model):
                lengths = [len(rollout.prompt_ids[i]) + len(rollout.response_ids[i]) for i in rows]
                return packed_response_logprobs(model, ids, mask, lengths)
        if model is self.policy and torch.is_grad_enabled() and self._update_logprobs is not response_logprobs:
            try:
                return self._update_logprobs(model, ids, mask)
            except torch._dynamo.exc.BackendCompilerFailed as err:   # (Inductor's errors included)
                warnings.warn(f"compile_update: torch.compile failed ({error_line(err)}); the update runs "
                              "without it from here", RuntimeWarning, stacklevel=2)
                self._update_logprobs = response_logprobs
        return response_logprobs(model, ids, mask)

    def _weights(self, rollout: Rollout, batches) -> list[float]:
        """The share of the whole batch's loss each micro-batch carries, so the accumulated gradient
        equals that of one pass over the batch: its share of sequences (sequence means, Dr. GRPO's
        constant) or of response tokens (token mean). Counted from the token lists on the host."""
        how, lengths = self.config.aggregation, [len(r) for r in rollout.response_ids]
        if how == "token_mean":
            counts = [sum(lengths[i] for i in rows) for rows, _, _ in batches]
        elif how == "sequence_mean":   # the mean runs over responses that have tokens
            counts = [sum(lengths[i] > 0 for i in rows) for rows, _, _ in batches]
        else:                          # "constant": over every response
            counts = [len(rows) for rows, _, _ in batches]
        return [n / max(sum(counts), 1) for n in counts]

    def update(self, rollout: Rollout, batches, ref_logps=None, then: Callable[[], None] | None = None) -> dict:
        """``epochs_per_batch`` optimizer steps over the rollout batch (phase 4). Returns the last
        epoch's loss and clip fraction, and the first epoch's entropy and KL to the reference (per
        response token, measured before any update: the policy that sampled the batch).

        ``then``, if given, is called once the last optimizer step is queued, before the host waits
        for the device (:meth:`train_step` starts the next rollout there). With torch's fused AdamW
        (``fused_update`` on CUDA) the host does not wait for the loss before the step: the step is
        skipped on the device when the loss is not finite (the optimizer's ``found_inf``), and the
        loss is read afterwards, so the weights never take a step from a non-finite loss either way.

        The old log-probs come from the first epoch's own forward passes, detached: the optimizer
        steps only after the whole epoch, so every micro-batch of it sees the sampling policy.

        A rollout not scored yet (no advantages) is scored (:meth:`score`) once the first forward is
        queued: the host computes the rewards while the device computes that forward, which needs
        only the tokens. ``score_seconds`` in the result is the host's time in it (0 if it was scored)."""
        c = self.config
        weights = self._weights(rollout, batches)
        tokens = max(sum(len(r) for r in rollout.response_ids), 1)
        advantages = raw_rewards = None
        score_seconds = 0.0
        # Running sums stay on the device: reading each micro-batch's numbers (.item()) would make the
        # host wait for the GPU every time instead of queueing the next micro-batch's work.
        zero = torch.zeros((), device=self.device)
        old_logps, entropy_sum, kl_sum = [], zero, zero
        for epoch in range(c.epochs_per_batch):
            loss_sum, clipped = zero, zero
            for j, ((rows, ids, mask), w) in enumerate(zip(batches, weights)):
                with self._autocast():
                    logp, entropy = self._response_logprobs(self.policy, rollout, rows, ids, mask)
                logp = logp.float()
                if advantages is None:        # the forward is queued: score while the device computes
                    if rollout.advantages is None:
                        start = time.perf_counter()
                        self.score(rollout)
                        score_seconds = time.perf_counter() - start
                    # (uploaded without waiting for the forward, as a plain .to(device) would)
                    advantages, raw_rewards = ([upload(values[rows].numpy(), self.device, torch.float32)
                                                for rows, _, _ in batches]
                                               for values in (rollout.advantages, rollout.rewards))
                if epoch == 0:
                    old_logps.append(logp.detach())
                    entropy_sum = entropy_sum + (entropy.detach().float() * mask).sum()
                per_token = pg_loss(logp, advantages[j], kind=c.loss, old_logp=old_logps[j], clip=c.clip,
                                    raw_rewards=raw_rewards[j])
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
            if self._torch_optimizer:        # the step is skipped on the device if the loss is not finite
                self.optimizer.found_inf = (~torch.isfinite(loss_sum)).float()
            else:                            # one wait per epoch: a non-finite loss must not reach the weights
                loss_value = self._checked_loss(loss_sum)
            self._optimizer_step()
            if then is not None and epoch == c.epochs_per_batch - 1:
                then()
            if self._torch_optimizer:
                loss_value = self._checked_loss(loss_sum)
        return dict(loss=loss_value, clip_fraction=clipped.item() / tokens, entropy=entropy_sum.item() / tokens,
                    kl=kl_sum.item() / tokens if ref_logps is not None else float("nan"),
                    score_seconds=score_seconds)

    def _checked_loss(self, loss: torch.Tensor) -> float:
        """The loss's value (a wait for the device); a non-finite one raises."""
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the GRPO loss is {value} at step {self.step + 1}: training diverged. "
                                     f"Lower the learning rate (lr={self.config.lr:g}) or keep grad_clip on")
        return value

    def _optimizer_step(self) -> None:
        """Clip the gradient, step the optimizer (in place: the engine reads the new weights, see
        ``__init__``) and clear the gradient. Torch's fused AdamW writes the parameters without
        bumping their version counters, so they are bumped here: the engine copies a parameter
        into its 16-bit decode weights only when its counter moved."""
        params, clip = [p for p in self.policy.parameters() if p.grad is not None], self.config.grad_clip
        if clip and self._torch_optimizer:
            torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        elif clip:
            clip_grad_norm(params, clip)
        self.optimizer.step()
        if self._torch_optimizer:
            torch.autograd.graph.increment_version(params)
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, start_next: bool = False) -> dict:
        """One GRPO step (rollout, reward, reference, update); returns its record. With
        ``start_next``, the next step's rollout is started (:meth:`start_rollout`) as soon as this
        step's optimizer step is queued, so that the host admits and prefills its requests while the
        device finishes the update; the next call finishes that rollout. Its start-up is then timed
        in this step's update phase."""
        c, dev, seconds = self.config, self.device, {}

        def phase(name, fn):
            synchronize(dev)
            start = time.perf_counter()
            out = fn()
            synchronize(dev)
            seconds[name] = time.perf_counter() - start
            return out

        started, self._next_rollout = self._next_rollout, None
        if started is not None and started[0] != self.step:   # (not this step's: a step was skipped)
            started[1].generation.close()
            started = None
        if started:
            finish = started[1]
        else:
            finish = functools.partial(self.rollout, self.sample_problems(self.step), texts=False)
        rollout = phase("rollout", finish)
        # The batches need only the tokens. The rollout is scored inside the update, on the host while
        # the device runs the first forward (update): the reward phase is the host's time in both.
        start = time.perf_counter()
        batches = self.micro_batches(rollout)
        seconds["reward"] = time.perf_counter() - start
        ref = phase("reference", lambda: self.logprobs_of(self.reference, batches, rollout) if self.reference else None)

        def next_rollout():
            self._next_rollout = (self.step + 1, self.start_rollout(self.sample_problems(self.step + 1), texts=False))

        try:
            then = next_rollout if start_next else None
            stats = phase("update", lambda: self.update(rollout, batches, ref, then=then))
        except BaseException:
            self.close()
            raise
        scoring = stats.pop("score_seconds")
        seconds["reward"] += scoring
        seconds["update"] -= scoring
        grouped = rollout.rewards.view(-1, c.group_size)
        self.last_rollout = rollout
        return dict(step=self.step + 1, reward=rollout.rewards.mean().item(), accuracy=rollout.correct.mean().item(),
                    **stats, response_length=float(np.mean([len(r) for r in rollout.response_ids])),
                    informative_groups=(grouped.max(1).values > grouped.min(1).values).float().mean().item(),
                    **{f"{name}_s": seconds[name] for name in PHASES})

    def train(self, steps: int) -> GRPOHistory:
        """Run until ``steps`` steps are done in all (a resumed trainer continues from its step);
        returns the history. Checkpoints every ``checkpoint_every`` steps and at the end."""
        c = self.config
        bar = tqdm(range(self.step, steps), initial=self.step, total=steps, desc="GRPO", disable=not c.progress)
        for _ in bar:
            # the next rollout may start during this step's update if nothing else uses the engine or
            # the random state in between (an evaluation, a checkpoint: it holds the RNG's state)
            after = self.step + 1
            start_next = (c.overlap_steps and after < steps and not (c.eval_every and after % c.eval_every == 0)
                          and not (self.checkpoint_path and after % c.checkpoint_every == 0))
            record = self.train_step(start_next)
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
        self.close()    # (nothing is left started: the last step starts no rollout)
        return self.history

    def close(self) -> None:
        """Abandon a rollout started for a step that will not run (its KV blocks are freed)."""
        if self._next_rollout is not None:
            self._next_rollout[1].generation.close()
            self._next_rollout = None

    # ------------------------------------------------------------------------------------------
    # Evaluation

    @torch.no_grad()
    def evaluate(self, problems: Sequence, k: Sequence[int] = (1, 4), samples: int | None = None,
                 temperature: float | None = None, max_new_tokens: int | None = None, seed: int = 0) -> Evaluation:
        """pass@k of the current policy on ``problems``: ``samples`` answers each (default ``max(k)``)
        sampled at ``temperature`` (default the training one), judged by
        :func:`~lmfs.alignment.tasks.check_answer`; the unbiased estimator of :func:`lmfs.eval.pass_at_k`
        per problem and a bootstrap interval over problems. The sampling is seeded with ``seed`` and
        leaves the training run's random streams as they were."""
        k = tuple(k)
        samples = samples or max(k)
        if max(k) > samples:
            raise ValueError(f"pass@{max(k)} needs at least {max(k)} samples per problem, got samples={samples}")
        problems, prompts = self._encode(problems, "problems")
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            outputs = self.llm.generate([p for p in prompts for _ in range(samples)],
                                        self._sampling(max_new_tokens, temperature), progress=False)
        correct = []
        for i, problem in enumerate(problems):
            outs = outputs[i * samples:(i + 1) * samples]
            correct.append(int(sum(check_answer(problem, self.response_text(o.token_ids))
                                   for o in outs if o.finish_reason != "error")))
        per_problem = {j: [pass_at_k(samples, c, j) for c in correct] for j in k}
        return Evaluation(samples, correct, {j: bootstrap_ci(v) for j, v in per_problem.items()}, per_problem)
