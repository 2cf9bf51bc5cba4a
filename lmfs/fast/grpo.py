"""GRPO on a faster schedule: :class:`PipelinedGRPOTrainer`, the algorithm of
:class:`lmfs.alignment.grpo.GRPOTrainer` with its phases overlapped and its update fused.

It computes what the sequential trainer computes (the same rollouts, losses and weights for the
same seed, up to floating-point rounding; a test compares the two) and differs only in when and
with which kernels:

* **Scoring during the update.** The micro-batches need only the tokens, and the advantages enter
  only the loss, so the rollout is scored on the host once the update's first forward is queued,
  while the device computes it. The texts of the answers are decoded there too.
* **The next rollout during the update.** Once the step's last optimizer step is queued, the next
  step's requests are admitted and their prefill queued behind it (:meth:`lmfs.inference.LLM.start`),
  so the host's start-up hides behind the device's update. The update draws no random numbers, so
  the rollout samples what it would have sampled after it. Not when something else uses the engine
  or the random state in between: an evaluation, a checkpoint (it holds the random state), or the
  end of the run.
* **Torch's fused AdamW** (on CUDA; ``torch_adamw``): the update rule of :class:`lmfs.optim.AdamW`
  (``tests/test_optim.py`` compares the two) in a few kernels per step instead of several per
  parameter, with foreach gradient clipping, stepped without waiting for the loss: a non-finite
  loss skips the step on the device (the optimizer's ``found_inf``) and raises once it is read, so
  the weights never take a step from it. The fused kernel leaves the parameters' version counters
  as they were, and an engine that keeps 16-bit copies of the weights follows those counters, so
  each step bumps them. Checkpoints of either optimizer resume with the other.
* **The fused policy** (``fused_model``): the policy computes through
  :func:`lmfs.kernels.fused.fuse_model` (one matmul for q/k/v and one for gate/up, Triton RoPE,
  SwiGLU and RMSNorm on CUDA, an embedding lookup whose backward suits a small vocabulary's many
  repeated ids); its parameters and state dict stay those of the plain modules.
* **Packed** (``packed_update``, needs ``fused_model``): the update's and the reference's forwards
  run on the batch's sequences packed into one row, each attending only to itself
  (:func:`packed_response_logprobs`), instead of right-padded to the longest.
* **Compiled** (``compile_update``, not with ``packed_update``): the update's forward, log-probs and
  entropy run through ``torch.compile`` with dynamic shapes (one compilation serves every batch
  length; the first update waits for it). If compiling fails, a warning says why and the update
  runs without it.

Every second of a step is timed once (:class:`~lmfs.train.phases.PhaseTimer`): the scoring inside
the update counts as the reward phase, the next rollout's start-up as the rollout phase.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmfs.alignment.grpo import GRPOConfig, GRPOTrainer, Rollout
from lmfs.alignment.sft import response_logprobs, token_logprobs
from lmfs.alignment.tasks import check_answer
from lmfs.bench import error_line
from lmfs.batching import upload
from lmfs.fast.engine import fast_engine
from lmfs.inference import LLM, Generation
from lmfs.kernels.fused import fuse_model, keeps_sequences_apart, packed_documents


@dataclass
class PipelineConfig:
    """What :class:`PipelinedGRPOTrainer` changes, each on its own: ``overlap_steps`` (the next
    rollout starts during the update), ``fused_model``, ``packed_update``, ``compile_update``, and
    ``torch_adamw`` (None: on CUDA). See the module's description."""

    overlap_steps: bool = True
    fused_model: bool = True
    packed_update: bool = False
    compile_update: bool = False
    torch_adamw: bool | None = None

    def __post_init__(self):
        problems = []
        if self.packed_update and not self.fused_model:
            problems.append("packed_update=True needs fused_model=True: the fused model's attention is what "
                            "keeps the packed sequences apart")
        if self.packed_update and self.compile_update:
            problems.append("packed_update=True and compile_update=True do not go together: the packed forward "
                            "runs on the host's lists of sequence lengths, which torch.compile cannot trace")
        if problems:
            raise ValueError("invalid PipelineConfig:\n  - " + "\n  - ".join(problems))


class PipelinedGRPOTrainer(GRPOTrainer):
    """:class:`~lmfs.alignment.grpo.GRPOTrainer` with the speed-ups of ``pipeline``
    (:class:`PipelineConfig`); the other arguments are the sequential trainer's."""

    def __init__(self, policy, tokenizer, train_problems: Sequence, reward_fn: Callable = check_answer,
                 config: GRPOConfig | None = None, reference=None, eval_problems: Sequence | None = None,
                 pipeline: PipelineConfig | None = None):
        self.pipeline = p = pipeline or PipelineConfig()
        cuda = next(policy.parameters()).device.type == "cuda"
        self.torch_adamw = cuda if p.torch_adamw is None else p.torch_adamw
        if p.fused_model:   # before the reference is copied from it, so that the copy is fused too
            # the log-probs need the logits, so no chunked loss. Compiled: no Triton kernels, since
            # torch.compile writes its own for the norms, RoPE and SwiGLU.
            fuse_model(policy, chunked_loss=False, norms=not p.compile_update, embedding=True,
                       triton=not p.compile_update)
        self.update_logprobs = (torch.compile(response_logprobs, dynamic=True) if p.compile_update
                                else response_logprobs)
        self.started: tuple[int, Generation] | None = None     # (its step, the rollout started for it)
        self._until: int | None = None                          # the step train() runs to
        self._steps_left = 0                                    # optimizer steps left in this update
        super().__init__(policy, tokenizer, train_problems, reward_fn, config, reference, eval_problems)

    def make_engine(self, policy) -> LLM:
        """The sequential trainer's engine with :class:`~lmfs.fast.engine.FastRunner` handed in
        (:func:`~lmfs.fast.engine.fast_engine`: CUDA graphs, steps in flight, the fused forward on a
        GPU): the same scheduler, the same samples."""
        return fast_engine(policy, None, **self.engine_options())

    def make_optimizer(self, policy) -> torch.optim.Optimizer:
        """Torch's fused AdamW with ``torch_adamw``, else the sequential trainer's."""
        if not self.torch_adamw:
            return super().make_optimizer(policy)
        c = self.config
        return torch.optim.AdamW(policy.parameters(), lr=c.lr, betas=c.betas, weight_decay=c.weight_decay, fused=True)

    @torch.no_grad()
    def start_rollout(self, indices: Sequence[int]) -> Generation:
        """Phase 1, started: the requests admitted and their prefill queued, without waiting for the
        device; ``result()`` of what it returns finishes it."""
        return self.llm.start(self.group_prompts(indices), self.sampling(), progress=False)

    @torch.no_grad()
    def finish_rollout(self) -> Rollout:
        """This step's rollout: the one started during the update before, or a new one. Its texts
        are left for :meth:`score`, which runs during the update."""
        indices, started, self.started = self.sample_problems(self.step), self.started, None
        if started is not None and started[0] != self.step:     # (not this step's: a step was skipped)
            started[1].close()
            started = None
        generation = started[1] if started else self.start_rollout(indices)
        return self.rollout_of(indices, generation.result(), texts=False)

    def logprobs(self, model, rollout: Rollout | None, rows, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequential trainer's log-probs, packed (``packed_update``, where ``model`` keeps packed
        sequences apart) or compiled (``compile_update``, the policy's with gradient). Once the
        policy's first forward of an unscored rollout is queued, the rollout is scored (timed as the
        reward phase) while the device computes."""
        training = model is self.policy and torch.is_grad_enabled()
        if self.pipeline.packed_update and rollout is not None and keeps_sequences_apart(model):
            lengths = [len(rollout.prompt_ids[i]) + len(rollout.response_ids[i]) for i in rows]
            with self.autocast_context():
                out = packed_response_logprobs(model, ids, mask, lengths)
        elif training and self.update_logprobs is not response_logprobs:
            out = self._compiled_logprobs(model, ids, mask)
        else:
            out = super().logprobs(model, rollout, rows, ids, mask)
        if training and rollout is not None and rollout.advantages is None:
            with self.timer.phase("reward", sync=False):
                self.score(rollout)
        return out

    def _compiled_logprobs(self, model, ids, mask):
        with self.autocast_context():
            try:
                return self.update_logprobs(model, ids, mask)
            except torch._dynamo.exc.BackendCompilerFailed as err:   # (Inductor's errors included)
                warnings.warn(f"compile_update: torch.compile failed ({error_line(err)}); the update runs "
                              "without it from here", RuntimeWarning, stacklevel=3)
                self.update_logprobs = response_logprobs
                return response_logprobs(model, ids, mask)

    def to_device(self, values: torch.Tensor) -> torch.Tensor:
        """Through pinned memory on CUDA, without waiting for the work queued before (the forward)."""
        return upload(values, self.device, values.dtype)

    def update(self, rollout: Rollout, batches, ref_logps: list[torch.Tensor] | None = None) -> dict:
        """The sequential trainer's update; its last optimizer step starts the next rollout."""
        self._steps_left = self.config.epochs_per_batch
        return super().update(rollout, batches, ref_logps)

    def optimizer_step(self, loss: torch.Tensor) -> float:
        """With torch's fused AdamW, queued without waiting for the loss (a non-finite one skips the
        step on the device, then raises once read); after the update's last step, the next step's
        rollout is started (:meth:`start_next`) before the loss is read."""
        if self.torch_adamw:
            self.optimizer.found_inf = (~torch.isfinite(loss)).float()
            params = [p for p in self.policy.parameters() if p.grad is not None]
            if self.config.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip, foreach=True)
            self.optimizer.step()
            torch.autograd.graph.increment_version(params)   # (the fused step does not)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            value = super().optimizer_step(loss)
        self._steps_left -= 1
        if self._steps_left == 0 and self.start_next():
            with self.timer.phase("rollout", sync=False):
                self.started = (self.step + 1, self.start_rollout(self.sample_problems(self.step + 1)))
        return self.checked_loss(loss) if self.torch_adamw else value

    def start_next(self) -> bool:
        """Whether the next step's rollout may start during this step's update: ``overlap_steps`` is
        on, :meth:`train` runs that step, and nothing uses the engine or the random state between
        the two (an evaluation, a checkpoint)."""
        c, after = self.config, self.step + 1
        return (self.pipeline.overlap_steps and self._until is not None and after < self._until
                and not (c.eval_every and after % c.eval_every == 0)
                and not (self.checkpoint_path and after % c.checkpoint_every == 0))

    def train_step(self) -> dict:
        """The sequential trainer's four phases, overlapped: the reward phase builds the batches only;
        the update scores the rollout and starts the next one."""
        self.timer.reset()
        with self.timer.phase("rollout"):
            rollout = self.finish_rollout()
        with self.timer.phase("reward"):
            batches = self.micro_batches(rollout)
        with self.timer.phase("reference"):
            ref_logps = self.reference_logprobs(rollout, batches)
        with self.timer.phase("update"):
            stats = self.update(rollout, batches, ref_logps)
        return self.record(rollout, stats)

    def train(self, steps: int):
        """The sequential trainer's run; a rollout started for a step that does not run is closed."""
        self._until = steps
        try:
            return super().train(steps)
        finally:
            self._until = None
            self.close()

    def close(self) -> None:
        """Abandon a rollout started for a step that will not run (its KV blocks are freed)."""
        if self.started is not None:
            self.started[1].close()
            self.started = None


def packed_response_logprobs(model, input_ids: torch.Tensor, mask: torch.Tensor,
                             lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~lmfs.alignment.sft.response_logprobs` of right-padded ``input_ids`` ``(B, T)`` whose rows
    hold ``lengths`` tokens, computed without the padding: the sequences run packed one after
    another in a single row of ``sum(lengths)`` tokens, each at positions from 0 and attending only
    to itself (:func:`lmfs.kernels.fused.packed_documents`), and the results are laid back out as
    ``(B, T-1)``.

    The same numbers as :func:`~lmfs.alignment.sft.response_logprobs` up to rounding, with fewer
    tokens computed when the lengths differ. ``model`` must be made by
    :func:`lmfs.kernels.fused.fuse_model` (its attention is what keeps the sequences apart); a plain
    model is refused (``TypeError``), since it would let each sequence read the ones before it.
    ``mask`` as for :func:`~lmfs.alignment.sft.response_logprobs`.
    """
    B, T = input_ids.shape
    lengths = [int(n) for n in lengths]
    if len(lengths) != B or min(lengths, default=0) < 1 or max(lengths) > T:
        raise ValueError(f"lengths must give 1..{T} tokens for each of the {B} rows, got {lengths[:8]}"
                         + ("..." if len(lengths) > 8 else ""))
    if max(lengths) > model.config.context_length:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds context_length={model.config.context_length}")
    if mask.shape == input_ids.shape:
        mask = mask[:, 1:]
    if mask.shape != (B, T - 1):
        raise ValueError(f"mask must be (B, T) like input_ids {tuple(input_ids.shape)} or (B, T-1), "
                         f"got {tuple(mask.shape)}")
    # Where each packed token sits in the padded batch (flat index b·T + t), worked out on the host
    # from the lengths: a boolean mask would make the device report its count (a host sync).
    n = np.asarray(lengths)
    position = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)           # (N,) restarting at 0
    device = input_ids.device
    where = upload(np.repeat(np.arange(B) * T, n) + position, device)
    flat = input_ids.reshape(-1)[where]                                        # (N,) the sequences, in order
    with packed_documents(model, lengths):
        # hidden + head, not forward: the row is longer than the context, each sequence in it is not
        logits = model.head(model.hidden(flat[None], upload(position, device))).squeeze(0)     # (N, V)
    # Token i predicts token i + 1; each sequence's last token "predicts" the next one's first, which
    # no mask selects.
    logp_flat, entropy_flat = token_logprobs(logits, flat.roll(-1))
    logp, entropy = (logp_flat.new_zeros(B * T).index_copy(0, where, x).view(B, T)[:, :-1]
                     for x in (logp_flat, entropy_flat))
    mask = mask.to(device)
    return logp * mask, entropy * mask
