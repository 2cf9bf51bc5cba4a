"""μP, the maximal update parametrisation, for :class:`lmfs.nn.TransformerLM`, applied from outside.

In the standard parametrisation (SP) every width trains with the same initial std and the same
Adam learning rate. Adam's update of a weight entry is about ``±lr`` whatever the width, and a
``d``-wide matrix sums ``d`` such aligned changes, so the change of a layer's output after a step
grows like ``d``: the wider model needs a smaller rate, and the best rate found on a small model
is wrong for a large one. μP (Yang et al. 2022, *Tensor Programs V*) scales initialisation,
learning rates and two multipliers with width so that every layer's activations *and their
updates* stay the same size as the model widens; then the best hyperparameters of a small model
carry over to a wide one ("μTransfer").

The rules, for Adam (Tensor Programs V, Table 3), written for a base model at ``base_width`` and a
target at ``width``; ``m = fan_in / base fan_in`` is each matrix's width multiplier (``width /
base_width`` for a ``d_model``-wide input; the MLP's ``d_ff`` grows in step):

==========================  ==============================  ===================  =============================
parameter                   initial std                     Adam learning rate   forward
==========================  ==============================  ===================  =============================
input: token (and learned   unchanged                       unchanged
position) embeddings
hidden matrices: q, k, v,   ``× 1/√m`` (so ∝ 1/√fan_in)     ``× 1/m``
o, MLP gate/up/down
vectors: norm gains, biases unchanged                       unchanged
output head (tied: the      unchanged                       unchanged            logits ``× 1/m``, ``m =
embedding)                                                                       width / base_width``
attention                                                                        ``q·k / d_head`` instead of
                                                                                 ``q·k / √d_head``
==========================  ==============================  ===================  =============================

Which variant this is: Table 3 states the output layer's rule as initial variance ``∝ 1/fan_in²``
and Adam rate ``∝ 1/fan_in``. We use the equivalent form with an *output multiplier* (the
``mup`` package's ``MuReadout``, and Cerebras-GPT): the head keeps its standard init and rate and
the logits are multiplied by ``base_width / width``. With Adam the two forms train identically
(Adam's step ignores the gradient's scale, up to ``eps``), and only the multiplier form works for
a tied embedding, which is both input and output. Every constant is anchored at the base width:
there every multiplier is 1 and the attention scale ``√d_base / d_head`` equals ``1/√d_head``, so
**μP at the base width is exactly the standard model** (same initial weights from the same seed,
same losses, same updates). Weight decay is AdamW's decoupled ``p ← p·(1 − lr·λ)``; a hidden
matrix's ``λ`` is multiplied by ``m`` so that its per-step shrink ``lr·λ`` does not change with
width (as the ``mup`` package does by default). Not done here: the optional zero initialisation
of the query and head weights that the paper also allows (it would break the base-width
identity).

How it is applied without touching :mod:`lmfs.nn`: :func:`mup_model` builds a standard model,
multiplies the hidden weights by their init factor (the same random draws, rescaled), and swaps
two classes, as :func:`lmfs.kernels.fused.fuse_model` does: each attention module becomes a
:class:`MuAttention`, which multiplies the rotated (and QK-normed) queries by ``√(d_base/d_head)``
before the usual ``1/√d_head`` attention, and the model becomes a :class:`MuTransformerLM`,
whose head multiplies its input by ``base_width / width``. The per-matrix rates need an optimizer
that keeps a multiplier per parameter group, because :func:`lmfs.train.train` sets every group's
``lr`` from the schedule each step: :class:`MuAdamW` multiplies it by the group's ``lr_mult``.

The tools of the lecture live here too: :func:`coordinate_check` (activation size per layer kind
vs width, a few steps into training), :func:`lr_sweep` (final loss per width and learning rate,
SP vs μP) and :func:`wsd_branches` (one constant-rate run, decays branched off its checkpoints).
Dense models only: an MoE router maps ``d_model`` to a fixed number of experts, an output-like
layer that would need its own multiplier. Do not combine with :func:`lmfs.kernels.fused.fuse_model`:
it swaps the same classes, and its chunked loss reads the head weight without the multiplier.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lmfs.nn import CausalSelfAttention, TransformerConfig, TransformerLM
from lmfs.optim import AdamW
from lmfs.train import History, TrainConfig, get_batch, make_optimizer, train

# ----------------------------------------------------------------------------------------------
# The parametrisation


def config_at_width(config: TransformerConfig, width: int) -> TransformerConfig:
    """``config`` with ``d_model = width``, everything else scaled along or kept.

    The number of heads stays, so ``head_dim`` grows with width (the case μP's ``1/d_head``
    attention is about); an explicit ``d_ff`` or ``kv_latent_dim`` grows in proportion (``None``
    keeps the default rule, :func:`lmfs.nn.layers.default_d_ff`).
    """
    if width < 1 or width % config.n_heads:
        raise ValueError(f"width={width} must be a positive multiple of n_heads={config.n_heads} "
                         "(the number of heads stays fixed as the model widens)")
    scale = width / config.d_model
    return dataclasses.replace(
        config, d_model=width,
        d_ff=None if config.d_ff is None else max(1, round(config.d_ff * scale)),
        kv_latent_dim=None if config.kv_latent_dim is None else max(1, round(config.kv_latent_dim * scale)))


@dataclass(frozen=True)
class Rule:
    """How μP treats one parameter: its ``role`` ("input", "hidden", "vector" or "output"), its
    width multiplier ``m = fan_in / base fan_in`` (1 except for hidden matrices), and the factors
    on its standard initial std and on Adam's learning rate and weight decay."""

    role: str
    width_mult: float

    @property
    def init_mult(self) -> float:
        return 1 / math.sqrt(self.width_mult) if self.role == "hidden" else 1.0

    @property
    def lr_mult(self) -> float:
        return 1 / self.width_mult if self.role == "hidden" else 1.0

    @property
    def weight_decay_mult(self) -> float:
        return self.width_mult if self.role == "hidden" else 1.0  # keeps lr·λ fixed


def _shapes(config: TransformerConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (kind of the owning module, shape)`` of every parameter, built on the meta device
    (no memory, no arithmetic)."""
    with torch.device("meta"):
        model = TransformerLM(config)
    owner = {f"{prefix}.{name}" if prefix else name: type(module).__name__
             for prefix, module in model.named_modules() for name, _ in module.named_parameters(recurse=False)}
    return {name: (owner[name], tuple(p.shape)) for name, p in model.named_parameters()}


def mup_rules(config: TransformerConfig, base_width: int) -> dict[str, Rule]:
    """The μP :class:`Rule` of every parameter of ``TransformerLM(config)`` against a base model of
    ``d_model = base_width`` (:func:`config_at_width`), found by comparing shapes as the ``mup``
    package's ``set_base_shapes`` does: a dimension that differs from the base grows with width.

    A linear weight ``(out, in)`` whose both dimensions grow is *hidden*; one whose input grows but
    output does not reads out of the width: the head (``lm_head``), or, tied, ``tok_emb``, is the
    *output*; an embedding ``(vocab, d)`` is an *input*; norm gains and biases are *vectors*.
    """
    if config.moe_experts:
        raise ValueError("mup_rules covers dense models: an MoE router reads out of the width into a "
                         "fixed number of experts and would need its own output multiplier; use moe_experts=0")
    base, target = _shapes(config_at_width(config, base_width)), _shapes(config)
    head = "tok_emb.weight" if config.tie_embeddings else "lm_head.weight"
    rules = {}
    for name, (kind, shape) in target.items():
        base_shape = base[name][1]
        grows = [a != b for a, b in zip(shape, base_shape)]
        if name == head:
            rules[name] = Rule("output", 1.0)
        elif kind == "Linear" and len(shape) == 2 and all(grows):
            rules[name] = Rule("hidden", shape[1] / base_shape[1])  # weight is (out, in): fan_in is dim 1
        elif kind == "Linear" and len(shape) == 2 and grows[1]:
            raise ValueError(f"{name} {shape} maps the growing width to a fixed size, a second output layer "
                             "that these rules do not cover")
        elif kind in ("Embedding", "LearnedPositions"):
            rules[name] = Rule("input", 1.0)
        else:  # norm gains, biases, and anything that does not grow
            rules[name] = Rule("vector", 1.0)
    return rules


class MuAttention(CausalSelfAttention):
    """:class:`~lmfs.nn.CausalSelfAttention` with μP's attention scale: the logits are
    ``q·k · √d_base / d_head`` instead of ``q·k / √d_head``.

    The queries reach :meth:`attend` already normalised (QK-norm) and rotated (RoPE), so scaling
    them by ``attn_mult = √(d_base / d_head)`` here scales exactly the logits, on both the SDPA
    and the written-out path. Made from a built module by :func:`mup_model`."""

    attn_mult: float = 1.0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return super().attend(q * self.attn_mult, k, v)


class MuTransformerLM(TransformerLM):
    """:class:`~lmfs.nn.TransformerLM` whose logits are multiplied by ``output_mult = base_width /
    width`` (before any soft-cap): μP's output layer. Made by :func:`mup_model`, which also keeps
    the per-parameter rules in ``mup_rules``."""

    output_mult: float = 1.0
    mup_rules: dict[str, Rule]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        # Scaling the (B, T, d) input is the same as scaling the logits, and touches V/d fewer numbers.
        return super().head(x * self.output_mult)


def mup_model(config: TransformerConfig, base_width: int) -> MuTransformerLM:
    """Build ``TransformerLM(config)`` in μP relative to ``d_model = base_width`` (module docstring).

    The standard initialisation runs first, from the global random stream, and the hidden matrices
    are then rescaled by ``√(base fan_in / fan_in)``: with the same seed, a μP model and a standard
    one hold the same random draws, and at ``d_model == base_width`` the same weights. Train it
    with :func:`mup_optimizer` (or :class:`MuAdamW` on :func:`mup_param_groups`).
    """
    rules = mup_rules(config, base_width)
    model = TransformerLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.mul_(rules[name].init_mult)
    attn_mult = math.sqrt(config_at_width(config, base_width).head_dim / config.head_dim)
    for module in model.modules():
        if type(module) is CausalSelfAttention:
            module.__class__ = MuAttention
            module.attn_mult = attn_mult
    model.__class__ = MuTransformerLM
    model.output_mult = base_width / config.d_model
    model.mup_rules = rules
    return model


def mup_param_groups(model: MuTransformerLM, lr: float, weight_decay: float = 0.1) -> list[dict]:
    """AdamW parameter groups for a :func:`mup_model`: one per (learning-rate multiplier, decayed).

    Each group carries ``lr`` (the global rate, which the schedule overwrites every step) and
    ``lr_mult`` (its μP factor, which :class:`MuAdamW` applies). As in
    :func:`lmfs.train.make_optimizer`, matrices are decayed and vectors (norm gains, biases) are
    not; a hidden matrix's decay is ``weight_decay · m`` (module docstring).
    """
    rules = getattr(model, "mup_rules", None)
    if rules is None:
        raise TypeError(f"{type(model).__name__} has no μP rules: build it with mup_model(config, base_width)")
    groups: dict[tuple[float, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        rule, decayed = rules[name], p.dim() >= 2
        group = groups.setdefault((rule.lr_mult, decayed), {
            "params": [], "lr": lr, "lr_mult": rule.lr_mult,
            "weight_decay": weight_decay * rule.weight_decay_mult if decayed else 0.0})
        group["params"].append(p)
    return list(groups.values())


class MuAdamW(AdamW):
    """:class:`lmfs.optim.AdamW` whose parameter groups may carry ``lr_mult``: a group steps with
    ``lr · lr_mult``. The training loop sets every group's ``lr`` to the schedule's value, so the
    per-layer μP factor has to live in a key of its own."""

    def update(self, p, g, group, state):
        mult = group.get("lr_mult", 1.0)
        super().update(p, g, group if mult == 1.0 else {**group, "lr": group["lr"] * mult}, state)


def mup_optimizer(model: MuTransformerLM, config: TrainConfig) -> MuAdamW:
    """The μP counterpart of :func:`lmfs.train.make_optimizer`: :class:`MuAdamW` on
    :func:`mup_param_groups` with ``config``'s rate, decay and betas."""
    return MuAdamW(mup_param_groups(model, config.lr, config.weight_decay), lr=config.lr, betas=config.betas)


def build_at_width(config: TransformerConfig, width: int, base_width: int | None = None) -> TransformerLM:
    """The model of :func:`config_at_width`: standard with ``base_width=None``, else μP."""
    wide = config_at_width(config, width)
    return TransformerLM(wide) if base_width is None else mup_model(wide, base_width)


def optimizer_for(model: TransformerLM, config: TrainConfig) -> torch.optim.Optimizer:
    """:func:`mup_optimizer` for a μP model, :func:`lmfs.train.make_optimizer` for a standard one."""
    return mup_optimizer(model, config) if isinstance(model, MuTransformerLM) else make_optimizer(model, config)


# ----------------------------------------------------------------------------------------------
# Coordinate checks

LAYER_KINDS = ("embedding", "attention q", "attention out", "MLP hidden", "MLP out", "residual", "logits")


def _record_activations(model: TransformerLM, sizes: dict[str, list[float]]) -> list:
    """Forward hooks that append ``mean |x|`` of each layer kind's activations to ``sizes[kind]``;
    returns the hook handles (remove them when done)."""
    def keep(kind, pick):
        def hook(module, args, output):
            sizes[kind].append(pick(args, output).detach().float().abs().mean().item())
        return hook

    out, inp = (lambda args, output: output), (lambda args, output: args[0])
    hooks = [model.tok_emb.register_forward_hook(keep("embedding", out))]
    for block in model.blocks:
        hooks += [block.attn.q_proj.register_forward_hook(keep("attention q", out)),
                  block.attn.o_proj.register_forward_hook(keep("attention out", out)),
                  block.mlp.down.register_forward_hook(keep("MLP hidden", inp)),
                  block.mlp.down.register_forward_hook(keep("MLP out", out)),
                  block.register_forward_hook(keep("residual", out))]
    hooks.append(model.register_forward_hook(keep("logits", lambda args, output: output[0])))
    return hooks


def coordinate_check(build: Callable[[int], tuple[TransformerLM, torch.optim.Optimizer]], widths: Sequence[int],
                     data: np.ndarray, *, steps: int = 4, batch_size: int = 8, context_length: int = 32,
                     seeds: Sequence[int] = (0,), device: torch.device | str = "cpu"):
    """Train each width a few steps and record the typical size of every layer kind's activations.

    ``build(width)`` returns ``(model, optimizer)`` (e.g. a standard or a :func:`mup_model` with
    its optimizer). Before training (step 0) and after each of ``steps`` Adam steps on random
    batches of ``data``, the model runs on one fixed batch and :data:`LAYER_KINDS` hooks record
    ``mean |x|`` of each kind's activations (averaged over layers). In a healthy parametrisation
    these coordinates stay the same size as width grows, at every step; the updates of SP make
    them grow. Returns a DataFrame with columns ``width, seed, step, kind, mean_abs``.
    """
    import pandas as pd

    rows = []
    probe = get_batch(data, batch_size, context_length, device, torch.Generator().manual_seed(12345))
    for width in widths:
        for seed in seeds:
            torch.manual_seed(seed)
            model, optimizer = build(width)
            model.to(device).train()
            batches = torch.Generator().manual_seed(seed)
            for step in range(steps + 1):
                if step:
                    x, y = get_batch(data, batch_size, context_length, device, batches)
                    model(x, y)[1].backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                sizes = {kind: [] for kind in LAYER_KINDS}
                hooks = _record_activations(model, sizes)
                with torch.no_grad():
                    model(probe[0])
                for hook in hooks:
                    hook.remove()
                rows += [dict(width=width, seed=seed, step=step, kind=kind, mean_abs=float(np.mean(v)))
                         for kind, v in sizes.items()]
    return pd.DataFrame(rows)


def coordinate_slopes(frame, step: int | None = None):
    """Per layer kind, the slope of ``log mean|x|`` against ``log width`` at ``step`` (default: the
    last), seeds averaged first. 0 is flat; 1 means the activations grow in proportion to width."""
    step = frame.step.max() if step is None else step
    at = frame[frame.step == step].groupby(["kind", "width"]).mean_abs.mean().reset_index()
    return {kind: float(np.polyfit(np.log(g.width), np.log(g.mean_abs), 1)[0])
            for kind, g in at.groupby("kind", sort=False)}


def plot_coordinate_check(frames: Mapping[str, object], steps: Sequence[int] | None = None):
    """One row of panels per parametrisation (``name -> coordinate_check frame``), one column per
    step shown: ``mean |x|`` against width, a line per layer kind, log-log. Returns the figure."""
    import matplotlib.pyplot as plt

    first = next(iter(frames.values()))
    steps = sorted({0, 1, int(first.step.max())}) if steps is None else list(steps)
    fig, axes = plt.subplots(len(frames), len(steps), figsize=(4 * len(steps), 3.2 * len(frames)),
                             squeeze=False, sharey=True)
    for row, (name, frame) in zip(axes, frames.items()):
        for ax, step in zip(row, steps):
            at = frame[frame.step == step].groupby(["kind", "width"]).mean_abs.mean()
            for i, kind in enumerate(LAYER_KINDS):
                ax.plot(at[kind].index, at[kind].values, "o-", color=f"C{i}", ms=3, label=kind)
            ax.set(xscale="log", yscale="log", title=f"{name}, step {step}", xlabel="width (d_model)")
            ax.minorticks_off()  # label the widths themselves, not log-scale minor ticks
            ax.set_xticks(sorted(frame.width.unique()), [str(w) for w in sorted(frame.width.unique())])
        row[0].set_ylabel("mean |activation|")
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------
# Learning-rate sweeps across widths


def lr_sweep(config: TransformerConfig, widths: Sequence[int], lrs: Sequence[float], data: np.ndarray,
             train_config: TrainConfig, *, base_width: int | None = None, val_data: np.ndarray | None = None,
             device: torch.device | str | None = None, seed: int = 0, last: int = 10, verbose: bool = True):
    """Train ``config`` at every width and learning rate; return a DataFrame of final losses.

    Standard parametrisation with ``base_width=None``, μP (base ``base_width``) otherwise. Every run
    starts from seed ``seed`` and sees the same batches (``train_config.seed``). Columns: ``width,
    lr, loss`` (mean training loss over the ``last`` steps), ``val_loss`` (NaN without
    ``val_data``) and ``diverged``; a run whose loss is not finite counts as diverged with loss
    ``inf``, so it can never be the optimum.
    """
    import pandas as pd

    rows = []
    for width in widths:
        for lr in lrs:
            run_config = dataclasses.replace(train_config, lr=lr)
            torch.manual_seed(seed)
            model = build_at_width(config, width, base_width)
            try:
                history = train(model, data, run_config, val_data=val_data, device=device,
                                optimizer=optimizer_for(model, run_config), progress=False)
                loss = float(np.mean(history.loss[-last:]))
                val = history.val_loss[-1] if history.val_loss else float("nan")
            except FloatingPointError:
                loss = val = float("inf")
            diverged = not math.isfinite(loss)
            rows.append(dict(width=width, lr=lr, loss=loss, val_loss=val, diverged=diverged))
            if verbose:
                print(f"width {width:5d}  lr {lr:<8.2g} loss {loss:.3f}" + ("  (diverged)" if diverged else ""))
    return pd.DataFrame(rows)


def best_lrs(frame, column: str = "loss") -> dict[int, float]:
    """``width -> the learning rate of the lowest ``column`` at that width``."""
    return {int(w): float(g.lr.iloc[int(np.argmin(g[column].to_numpy()))]) for w, g in frame.groupby("width")}


def plot_lr_sweep(frame, ax=None, title: str | None = None, column: str = "loss"):
    """Final loss against learning rate (log x), one line per width, the best rate of each marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        ax = plt.subplots(figsize=(5, 3.5))[1]
    best = best_lrs(frame, column)
    finite = frame[np.isfinite(frame[column])]
    for i, (width, g) in enumerate(finite.groupby("width")):
        ax.plot(g.lr, g[column], "o-", color=f"C{i}", ms=3, label=f"width {width}")
        ax.plot([best[width]], [g[column].min()], "*", color=f"C{i}", ms=12)
    low = finite[column].min()
    ax.set(xscale="log", xlabel="learning rate", ylabel=f"final {column}", title=title,
           ylim=(low - 0.05, min(finite[column].max(), low + 1.5) + 0.05))
    ax.legend(fontsize=8)
    return ax


# ----------------------------------------------------------------------------------------------
# WSD: one constant-rate run, decays branched off its checkpoints


def wsd_branches(model: TransformerLM, data: np.ndarray, train_config: TrainConfig, decay_starts: Sequence[int],
                 decay_steps: int | Callable[[int], int], *, val_data: np.ndarray | None = None,
                 device: torch.device | str | None = None, workdir: str | Path | None = None,
                 make_opt: Callable[[torch.nn.Module, TrainConfig], torch.optim.Optimizer] = optimizer_for,
                 ) -> dict[int, History]:
    """Train ``model`` at a constant rate (after ``train_config``'s warmup) and, from a checkpoint at
    each step ``S`` of ``decay_starts``, branch off a linear decay to ``final_lr`` over
    ``decay_steps`` (a number, or a function of ``S``). Returns ``{S: History}`` of each branch,
    whose curve starts at step 1 (the shared trunk) and ends at ``S + decay_steps``.

    The trunk runs once, in segments that end at each ``S`` and save a checkpoint there (model,
    optimizer, step, history and random streams). A branch resumes a copy of that checkpoint with
    ``schedule="wsd"``, ``steps = S + D`` and ``decay_fraction = D / (S + D)``: up to ``S`` that
    schedule *is* the constant rate, so the branch is the very run one would get by training WSD
    with its decay at ``S`` from the start, at the cost of only its ``D`` decay steps (checked in
    the tests). This is why WSD suits scaling-law sweeps: one trunk gives a loss for every
    training length, where cosine needs a run per length. ``model`` ends at the trunk's last
    checkpoint; each branch trains a deep copy of it. The checkpoints go to ``workdir`` (kept), or
    to a temporary folder that is removed afterwards.
    """
    starts = sorted(set(decay_starts))
    if not starts or starts[0] < max(train_config.warmup_steps, 1):
        raise ValueError(f"decay_starts={list(decay_starts)} must be steps after the warmup "
                         f"(warmup_steps={train_config.warmup_steps})")
    if workdir is None:  # checkpoints in a temporary folder, removed at the end
        with tempfile.TemporaryDirectory(prefix="wsd-") as folder:
            return wsd_branches(model, data, train_config, decay_starts, decay_steps, val_data=val_data,
                                device=device, workdir=folder, make_opt=make_opt)
    length = decay_steps if callable(decay_steps) else (lambda start: decay_steps)
    folder = Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    trunk_path = folder / "trunk.pt"
    trunk_path.unlink(missing_ok=True)
    trunk, original = model, copy.deepcopy(model)
    checkpoints = {}
    for start in starts:
        segment = dataclasses.replace(train_config, steps=start, schedule="constant",
                                      checkpoint_path=str(trunk_path), checkpoint_every=0)
        train(trunk, data, segment, val_data=val_data, device=device, resume=True,
              optimizer=make_opt(trunk, segment), progress=False)
        checkpoints[start] = folder / f"branch-{start}.pt"
        checkpoints[start].write_bytes(trunk_path.read_bytes())
    branches = {}
    for start in starts:
        decay = length(start)
        branch_config = dataclasses.replace(
            train_config, steps=start + decay, schedule="wsd", decay_fraction=decay / (start + decay),
            checkpoint_path=str(checkpoints[start]), checkpoint_every=0)
        assert round(branch_config.decay_fraction * branch_config.steps) == decay  # lr_at decays at `start`
        branch = copy.deepcopy(original)
        branches[start] = train(branch, data, branch_config, val_data=val_data, device=device, resume=True,
                                optimizer=make_opt(branch, branch_config), progress=False)
    return branches
