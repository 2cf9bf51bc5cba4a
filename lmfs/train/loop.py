"""The training loop: sample a batch, forward, backward, clip, step, log; repeat.

Around that core sit the pieces real runs need, each small enough to read on its own:
:func:`make_optimizer` (AdamW with weight-decay groups), :func:`accumulate_gradients` (one
optimizer step over several micro-batches), :func:`activation_checkpointing` (trade compute for
memory), :func:`estimate_loss` (a fixed validation estimate), and checkpoints for resuming.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from lmfs.env import NO_BF16_NOTE, default_dtype, resolve_device
from lmfs.optim import AdamW, clip_grad_norm, cosine_with_warmup, warmup_stable_decay
from lmfs.train.checkpoint import load_checkpoint, restore_rng_state, save_checkpoint
from lmfs.train.data import get_batch

SCHEDULES = ("cosine", "wsd", "constant")
AUTOCAST = ("auto", "bf16", "off")


@dataclass
class TrainConfig:
    """How to train: steps, batch shape, optimizer, schedule and the memory/speed switches.

    ``batch_size`` counts sequences per optimizer step; with ``grad_accum > 1`` each step runs
    ``grad_accum`` micro-batches of ``batch_size // grad_accum`` sequences, so accumulation
    changes memory, not the optimisation. ``autocast="auto"`` is bf16 on CUDA and off elsewhere.
    """

    steps: int
    batch_size: int
    context_length: int
    lr: float = 3e-4
    min_lr: float | None = None          # None: lr / 10
    warmup_steps: int = 0
    schedule: str = "cosine"             # "cosine" | "wsd" | "constant"
    decay_fraction: float = 0.2          # wsd: the share of steps spent decaying
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0        # max global gradient norm; None or 0 switches it off
    grad_accum: int = 1
    eval_every: int = 0                  # 0: evaluate only at the end
    eval_batches: int = 8
    activation_checkpointing: bool = False
    compile: bool = False
    autocast: str = "auto"               # "auto" | "bf16" | "off"
    seed: int = 0
    checkpoint_path: str | None = None
    checkpoint_every: int = 0            # 0: save only at the end (when checkpoint_path is set)

    def __post_init__(self):
        problems = []
        for name in ("steps", "batch_size", "context_length", "grad_accum", "eval_batches"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be a positive integer")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.autocast not in AUTOCAST:
            problems.append(f"autocast={self.autocast!r} is not one of {AUTOCAST} "
                            "(fp16 would need a gradient scaler: use bf16)")
        if self.batch_size % max(self.grad_accum, 1):
            problems.append(f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}: "
                            "the micro-batches must be equal for the accumulated gradient to be exact")
        if self.warmup_steps > self.steps:
            problems.append(f"warmup_steps={self.warmup_steps} exceeds steps={self.steps}")
        if not 0 <= self.decay_fraction <= 1:
            problems.append(f"decay_fraction={self.decay_fraction} must lie in [0, 1]")
        if self.lr <= 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            problems.append(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if problems:
            raise ValueError("invalid TrainConfig:\n  - " + "\n  - ".join(problems))

    @property
    def final_lr(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length

    def lr_at(self, step: int) -> float:
        """Learning rate of update ``step`` (0-based), from :mod:`lmfs.optim.schedules`.

        Update ``i`` uses the schedule's value at ``i + 1``: the first update then has a non-zero
        rate after warmup ``lr / warmup_steps``, and the last lands exactly on ``final_lr``.
        """
        t, warm = step + 1, self.warmup_steps
        if self.schedule == "cosine":
            return cosine_with_warmup(t, self.lr, self.final_lr, warm, self.steps - warm)
        if self.schedule == "wsd":
            decay = round(self.decay_fraction * self.steps)
            return warmup_stable_decay(t, self.lr, self.final_lr, warm, self.steps - warm - decay, decay)
        return self.lr if t >= warm else self.lr * t / warm


@dataclass
class History:
    """What a run measured: per step ``loss``, ``lr``, cumulative ``tokens`` and wall ``seconds``;
    per evaluation ``val_step`` and ``val_loss``. ``step`` counts optimizer updates done (1, 2, ...)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    val_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)

    def to_frame(self):
        """A pandas DataFrame, one row per step, with ``val_loss`` where an evaluation ran."""
        import pandas as pd

        frame = pd.DataFrame({"step": self.step, "loss": self.loss, "lr": self.lr,
                              "tokens": self.tokens, "seconds": self.seconds})
        val = pd.DataFrame({"step": self.val_step, "val_loss": self.val_loss})
        return frame.merge(val, on="step", how="outer").sort_values("step", ignore_index=True)

    def plot(self, ax=None):
        """Training loss per step (and validation loss as points) on ``ax`` or a new figure."""
        import matplotlib.pyplot as plt

        if ax is None:
            ax = plt.subplots(figsize=(6, 3.5))[1]
        ax.plot(self.step, self.loss, lw=1, label="train")
        if self.val_step:
            ax.plot(self.val_step, self.val_loss, "o-", label="validation")
        ax.set(xlabel="step", ylabel="loss")
        ax.legend()
        return ax


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> AdamW:
    """:class:`lmfs.optim.AdamW` with two groups: weight decay on matrices, none on vectors.

    Decayed: every parameter with two or more dimensions, i.e. the linear weights and the
    embedding (which, tied, is also the output head: decay keeps the logits' scale in check).
    Not decayed: norm gains and biases. Decay pulls a parameter towards 0, but a norm gain's
    natural value is 1, and a bias only shifts, so decaying them hurts and buys nothing.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return AdamW(groups, lr=config.lr, betas=config.betas)


def resolve_autocast(mode: str, device: torch.device) -> torch.dtype | None:
    """The dtype ``TrainConfig.autocast`` asks for on ``device``; ``None`` means full precision."""
    bf16 = default_dtype(device) == torch.bfloat16
    if mode == "auto":
        mode = "bf16" if bf16 else "off"   # a GPU without bfloat16 trains in float32
    elif mode == "bf16" and device.type == "cuda" and not bf16:
        raise ValueError(f"autocast='bf16' on {torch.cuda.get_device_name(device)}: {NO_BF16_NOTE}; "
                         "use autocast='auto' or 'off'")
    return torch.bfloat16 if mode == "bf16" else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s type, or nothing when ``dtype`` is ``None``."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def accumulate_gradients(model: torch.nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward and backward every ``(x, y)`` micro-batch, adding up gradients; return the mean loss.

    Each loss is divided by the number of micro-batches before its backward pass, so the summed
    ``.grad`` is the gradient of the mean loss: with micro-batches of equal size, exactly the
    gradient one pass over the whole batch would give, in ``1/n`` of the activation memory.
    Gradients are added to whatever ``.grad`` holds: zero them before a new step.
    """
    micro_batches = list(micro_batches)
    total = 0.0
    for x, y in micro_batches:
        with _autocast(x.device, autocast_dtype):
            loss = model(x, y)[1]  # drop the logits at once: they are large and not needed
        (loss / len(micro_batches)).backward()  # outside autocast, as torch recommends
        total = total + loss.detach()
    return total / len(micro_batches)


@contextlib.contextmanager
def activation_checkpointing(model: torch.nn.Module):
    """Within this context, each of ``model.blocks`` stores only its input for the backward pass.

    Each block's ``forward`` is replaced by one that runs it under ``torch.utils.checkpoint``:
    the block's intermediate activations are dropped after the forward pass and recomputed
    during the backward pass, one block at a time. Memory for activations falls from
    ``n_layers`` blocks' worth to their inputs plus one block; compute rises by about one forward
    pass (4 instead of 3). The gradients are the same. The original ``forward`` comes back on exit.
    """
    model = getattr(model, "_orig_mod", model)
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"activation checkpointing wraps model.blocks, which {type(model).__name__} "
                         "does not have (use an lmfs TransformerLM)")
    if any("forward" in vars(block) for block in blocks):
        raise RuntimeError("these blocks are already checkpointed: do not nest activation_checkpointing")

    def recomputed(forward):
        def run(*args, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    for block in blocks:
        block.forward = recomputed(block.forward)  # an instance attribute hides the class's method
    try:
        yield model
    finally:
        for block in blocks:
            del block.forward


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, data: np.ndarray, batches: int, batch_size: int,
                  context_length: int, device: torch.device | str, *,
                  autocast_dtype: torch.dtype | None = None, seed: int = 0) -> float:
    """Mean loss over ``batches`` random batches of ``data``, in eval mode and without gradients.

    The batches come from a generator seeded with ``seed``, so every call with the same
    arguments sees the same windows: differences between calls are the model's, not sampling
    noise. The model's train/eval mode is restored afterwards.
    """
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(batches):
        x, y = get_batch(data, batch_size, context_length, device, generator)
        with _autocast(device, autocast_dtype):
            losses.append(model(x, y)[1].float())
    model.train(was_training)
    return torch.stack(losses).mean().item()


def _every(done: int, period: int) -> bool:
    """Whether ``done`` steps complete a period of ``period`` steps (0: never)."""
    return period > 0 and done % period == 0


def train(model: torch.nn.Module, data: np.ndarray, config: TrainConfig, *,
          val_data: np.ndarray | None = None, device: torch.device | str | None = None,
          optimizer: torch.optim.Optimizer | None = None, progress: bool = True,
          resume: bool = False, checkpoint_extra: dict | None = None) -> History:
    """Train ``model`` on token ids ``data`` as ``config`` says; return the :class:`History`.

    ``device`` defaults to where the model's parameters are (pass ``"auto"`` or a device to
    move it). ``optimizer`` defaults to :func:`make_optimizer`. The batches come from a
    generator seeded with ``config.seed``, so the same seed and model see the same batches. On a
    CPU with one torch thread (``torch.set_num_threads(1)``) two such runs are identical, bit for
    bit; with several threads, reductions split across threads may add up in another order from
    one run to the next, and the losses drift apart in their last digits after a dozen or more steps.
    With ``config.checkpoint_path`` a checkpoint is written every ``checkpoint_every`` steps and
    at the end, holding ``checkpoint_extra`` beside the history; ``resume=True`` continues from it
    (model, optimizer, step, history, batch order and random generators all as they were), or
    starts afresh if there is none yet. The resumed run follows ``config``, which may differ from
    the checkpoint's on purpose (:func:`lmfs.scaling.mup.wsd_branches` continues a constant-rate
    trunk with a decaying schedule); ``python -m lmfs.train --resume`` refuses such differences.
    """
    device = next(model.parameters()).device if device is None else resolve_device(device)
    model.to(device)
    model.train()
    optimizer = make_optimizer(model, config) if optimizer is None else optimizer
    dtype = resolve_autocast(config.autocast, device)
    batches = torch.Generator().manual_seed(config.seed)
    history, start = History(), 0

    if resume:
        if not config.checkpoint_path:
            raise ValueError("resume=True needs config.checkpoint_path: the checkpoint to continue from")
        if Path(config.checkpoint_path).exists():
            ckpt = load_checkpoint(config.checkpoint_path, model, optimizer)
            start = ckpt["step"]
            restore_rng_state(ckpt["rng"])
            batches.set_state(ckpt["extra"]["batch_rng"])
            history = History(**ckpt["extra"]["history"])
            print(f"resumed from {config.checkpoint_path} at step {start}")
        else:
            print(f"no checkpoint at {config.checkpoint_path} yet: starting from step 0")

    if progress:
        n_params = sum(p.numel() for p in model.parameters())
        decayed = sum(p.numel() for g in optimizer.param_groups if g["weight_decay"] for p in g["params"])
        print(f"training {n_params / 1e6:.2f}M parameters on {device} "
              f"(autocast {str(dtype).replace('torch.', '') if dtype else 'off'}): {config.steps} steps x "
              f"{config.batch_size} sequences x {config.context_length} tokens = "
              f"{config.tokens_per_step:,} tokens/step, {config.steps * config.tokens_per_step:,} in all")
        print(f"lr {config.lr:g} -> {config.final_lr:g} ({config.schedule}, {config.warmup_steps} warmup "
              f"steps); weight decay {config.weight_decay:g} on {decayed:,} parameters, none on the other "
              f"{n_params - decayed:,}; grad_accum {config.grad_accum}, activation checkpointing "
              f"{config.activation_checkpointing}, compile {config.compile}")

    forward = torch.compile(model) if config.compile else model
    with activation_checkpointing(model) if config.activation_checkpointing else contextlib.nullcontext():
        bar = tqdm(range(start, config.steps), initial=start, total=config.steps, disable=not progress,
                   desc="train")
        started = time.perf_counter() - (history.seconds[-1] if history.seconds else 0.0)
        for step in bar:
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(data, config.batch_size, config.context_length, device, batches)
            micro = zip(x.chunk(config.grad_accum), y.chunk(config.grad_accum))
            loss = accumulate_gradients(forward, micro, dtype).item()
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"the loss is {loss} at step {step + 1} (lr={lr:.3g}): training diverged. Lower the "
                    f"learning rate (e.g. lr={config.lr / 3:.2g}), add warmup_steps or keep grad_clip on")
            if config.grad_clip:
                clip_grad_norm(model.parameters(), config.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if hasattr(model, "update_moe_biases"):  # auxiliary-loss-free balancing (sigmoid routers)
                model.update_moe_biases()

            done = step + 1
            history.step.append(done)
            history.loss.append(loss)
            history.lr.append(lr)
            history.tokens.append(done * config.tokens_per_step)
            history.seconds.append(time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)

            last = done == config.steps
            if val_data is not None and (last or _every(done, config.eval_every)):
                val = estimate_loss(forward, val_data, config.eval_batches, config.micro_batch_size,
                                    config.context_length, device, autocast_dtype=dtype, seed=config.seed)
                history.val_step.append(done)
                history.val_loss.append(val)
                if progress:
                    bar.write(f"step {done}: train loss {loss:.4f}, val loss {val:.4f}")
            if config.checkpoint_path and (last or _every(done, config.checkpoint_every)):
                save_checkpoint(config.checkpoint_path, model, optimizer, done, config,
                                extra={**(checkpoint_extra or {}), "history": asdict(history),
                                       "batch_rng": batches.get_state()})
        bar.close()
    return history
