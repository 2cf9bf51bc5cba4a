"""Explorers of lectures 09-11: compute-optimal allocation, sampling filters and the KV cache, μP."""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import torch

from lmfs.explore._core import Explorer, View, gigabytes, new_figure, slider, table


# --- 09: compute budget -> IsoFLOP curve, N*, D* ---------------------------------------------------

def default_laws() -> dict:
    """The published Chinchilla fits: ``name -> ChinchillaLaw``."""
    from lmfs.scaling import BESIROGLU_2024, HOFFMANN_2022

    return {"Hoffmann et al. 2022": HOFFMANN_2022, "Besiroglu et al. 2024": BESIROGLU_2024}


def compute_optimal_view(log10_flops: float, laws: dict | None = None, allocations: dict | None = None) -> View:
    """At ``C = 10^log10_flops``: each law's IsoFLOP curve ``L(N, C/6N)``
    (:meth:`lmfs.scaling.ChinchillaLaw.isoflop_loss`) with its optimum ``N*, D*``
    (:meth:`~lmfs.scaling.ChinchillaLaw.compute_optimal`), and any further ``allocations``
    (``name -> lmfs.scaling.Allocation``, e.g. the lecture's own fits) as their ``N_opt(C)``."""
    laws = default_laws() if laws is None else laws
    allocations = allocations or {}
    C = 10.0 ** log10_flops
    fig, ax = new_figure(size=(6.4, 3.2))
    rows, values = {}, {}
    for i, (name, law) in enumerate(laws.items()):
        n_star, d_star = (float(v) for v in law.compute_optimal(C))
        N = n_star * np.logspace(-1.2, 1.2, 100)
        ax.semilogx(N, law.isoflop_loss(N, C), color=f"C{i}", label=name)
        ax.plot([n_star], [float(law.isoflop_loss(n_star, C))], "o", color=f"C{i}")
        rows[name] = f"N* = {n_star:.3g}, D* = {d_star:.3g}, D*/N* = {d_star / n_star:.1f}"
        values[name] = (n_star, d_star)
    for j, (name, allocation) in enumerate(allocations.items()):
        n_opt, d_opt = float(allocation.N_opt(C)), float(allocation.D_opt(C))
        ax.axvline(n_opt, color=f"C{len(laws) + j}", ls="--", lw=1, label=f"{name}: N_opt")
        rows[name] = f"N_opt = {n_opt:.3g}, D_opt = {d_opt:.3g}, D/N = {d_opt / n_opt:.1f}"
        values[name] = (n_opt, d_opt)
    ax.set(xlabel="parameters N (D = C / 6N tokens)", ylabel="predicted loss", title=f"IsoFLOP curve at C = {C:.2g} FLOPs")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return View(table(rows), fig, dict(C=C, optimum=values))


def explore_compute_optimal(laws: dict | None = None, allocations: dict | None = None) -> Explorer:
    """Slide the compute budget: the IsoFLOP curve and ``N*``, ``D*`` under each fit."""
    controls = {"log10_flops": slider(23.8, 18.0, 26.0, step=0.1, integer=False, description="log10 C (FLOPs)")}
    return Explorer("Compute-optimal model size", compute_optimal_view, controls,
                    dict(laws=laws, allocations=allocations))


# --- 10: sampling filters and the KV cache ----------------------------------------------------------

def zipf_logits(vocab_size: int = 64, exponent: float = 1.1) -> torch.Tensor:
    """Logits of a Zipf-like next-token distribution (``p_i ∝ 1/i^exponent``), a stand-in for a model's."""
    return -exponent * torch.log(torch.arange(1, vocab_size + 1, dtype=torch.float32))


def sampling_view(temperature: float, top_k: int, top_p: float, min_p: float, logits: torch.Tensor | None = None,
                  labels=None, show: int = 24) -> View:
    """The distribution a sampler draws from after :func:`lmfs.inference.process_logits` with these
    :class:`lmfs.inference.SamplingParams` (``top_k = 0`` switches top-k off), against the model's own."""
    from lmfs.inference import SamplingParams, process_logits

    logits = zipf_logits() if logits is None else logits.detach().float().reshape(-1).cpu()
    params = SamplingParams(temperature=temperature, top_k=top_k or None, top_p=top_p, min_p=min_p)
    processed = process_logits(logits[None], [params])[0]
    if params.greedy:   # temperature 0: all the mass on the argmax
        probs = torch.zeros_like(logits)
        probs[logits.argmax()] = 1.0
    else:
        probs = torch.softmax(processed, dim=-1)
    before = torch.softmax(logits, dim=-1)
    order = torch.argsort(before, descending=True)[:show]
    labels = [str(i) for i in range(len(logits))] if labels is None else list(labels)
    fig, ax = new_figure(size=(7.2, 2.9))
    x = np.arange(len(order))
    ax.bar(x - 0.2, before[order].numpy(), width=0.4, color="0.7", label="model (T = 1)")
    ax.bar(x + 0.2, probs[order].numpy(), width=0.4, color="C0", label="sampled from")
    ax.set_xticks(x)
    ax.set_xticklabels([labels[i] for i in order.tolist()], rotation=90, fontsize=7)
    ax.set(ylabel="probability", title="next-token distribution, most likely first")
    ax.legend(fontsize=7)
    kept = int((probs > 0).sum())
    entropy = float(-(probs[probs > 0] * probs[probs > 0].log()).sum())
    rows = {"tokens that can be drawn": f"{kept} of {len(logits)}", "entropy (nats)": entropy,
            "most likely token's probability": float(probs.max())}
    return View(table(rows), fig, dict(probs=probs, kept=kept, entropy=entropy))


def explore_sampling(logits: torch.Tensor | None = None, labels=None) -> Explorer:
    """Temperature, top-k, top-p and min-p on a next-token distribution (``logits`` ``(V,)``, e.g. a
    model's last position; default :func:`zipf_logits`); ``labels``: the tokens' text."""
    vocab = len(zipf_logits()) if logits is None else logits.numel()
    controls = {
        "temperature": slider(1.0, 0.0, 2.0, step=0.05, integer=False, description="temperature"),
        "top_k": slider(0, 0, min(vocab, 100), description="top-k (0: off)"),
        "top_p": slider(1.0, 0.05, 1.0, step=0.05, integer=False, description="top-p"),
        "min_p": slider(0.0, 0.0, 0.5, step=0.01, integer=False, description="min-p"),
    }
    return Explorer("Sampling filters", sampling_view, controls, dict(logits=logits, labels=labels))


def kv_cache_view(context: int, batch_size: int, n_kv_heads: int, n_layers: int = 32, n_heads: int = 32,
                  d_model: int = 4096, dtype: str = "bf16", memory_GB: float = 80.0) -> View:
    """KV-cache bytes of a batch by :func:`lmfs.inference.kv_cache.kv_bytes_per_token` for a model of
    this shape (``n_kv_heads`` K/V heads: ``n_heads`` is MHA, 1 is MQA, in between GQA)."""
    from lmfs.inference.kv_cache import kv_bytes_per_token
    from lmfs.nn import TransformerConfig

    if n_heads % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[dtype]
    variants = sorted({n_heads, n_kv_heads, 8 if n_heads % 8 == 0 else n_kv_heads, 1})
    per_token = {}
    for kv in variants:
        config = TransformerConfig(vocab_size=256, context_length=context, d_model=d_model, n_layers=n_layers,
                                   n_heads=n_heads, n_kv_heads=kv)
        per_token[kv] = kv_bytes_per_token(config, torch_dtype)
    total = per_token[n_kv_heads] * context * batch_size
    fig, ax = new_figure(size=(6.4, 2.9))
    contexts = np.geomspace(256, 131072, 40)
    for i, kv in enumerate(variants):
        ax.loglog(contexts, per_token[kv] * contexts * batch_size / 1e9, color=f"C{i}",
                  lw=2.5 if kv == n_kv_heads else 1, label=f"{kv} K/V heads")
    ax.axhline(memory_GB, color="k", ls="--", lw=1, label=f"{memory_GB:g} GB")
    ax.axvline(context, color="k", ls=":", lw=1)
    ax.set(xlabel="context (tokens)", ylabel="KV cache (GB)", title=f"batch {batch_size}, {n_layers} layers, {dtype}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    rows = {"per token": gigabytes(per_token[n_kv_heads]), "whole batch": gigabytes(total),
            f"sequences of this length in {memory_GB:g} GB": int(memory_GB * 1e9 // (per_token[n_kv_heads] * context))}
    return View(table(rows), fig, dict(bytes_per_token=per_token[n_kv_heads], total=total))


def explore_kv_cache() -> Explorer:
    """KV-cache size against context, batch and GQA groups (a Llama-3-8B-like shape)."""
    controls = {
        "context": widgets.SelectionSlider(options=[2 ** i for i in range(8, 18)], value=8192, description="context",
                                           continuous_update=False),
        "batch_size": slider(16, 1, 256, description="batch"),
        "n_kv_heads": widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=8, description="K/V heads",
                                              continuous_update=False),
        "dtype": widgets.Dropdown(options=("bf16", "fp8", "fp32"), value="bf16", description="dtype"),
    }
    return Explorer("KV-cache size", kv_cache_view, controls)


# --- 11: μP ----------------------------------------------------------------------------------------

_RULES: dict = {}


def _rules(config, width: int, base_width: int) -> dict:
    """:func:`lmfs.scaling.mup.mup_rules` at ``width``, computed once per shape (it builds two
    models on the meta device, tens of milliseconds each)."""
    from lmfs.scaling.mup import config_at_width, mup_rules

    key = (repr(config), width, base_width)   # the config is a mutable dataclass: key on its fields
    if key not in _RULES:
        _RULES[key] = mup_rules(config_at_width(config, width), base_width)
    return _RULES[key]


def mup_view(width: int, lr: float, base_width: int = 64, config=None) -> View:
    """Adam learning rate and initial std per parameter role at ``width``, standard
    parametrisation (one learning rate for all) against μP (:func:`lmfs.scaling.mup.mup_rules`)."""
    from lmfs.nn import TransformerConfig

    config = config or TransformerConfig(vocab_size=256, context_length=64, d_model=base_width, n_layers=2, n_heads=4)
    widths = [w for w in (base_width * 2 ** i for i in range(6)) if w % config.n_heads == 0]
    if width not in widths:
        widths = sorted(set(widths) | {width})
    by_role = {}
    for w in widths:
        rules = _rules(config, w, base_width)
        for role in ("input", "hidden", "output", "vector"):
            mults = [r.lr_mult for r in rules.values() if r.role == role]
            if mults:   # at the base width nothing grows, so no matrix counts as hidden there
                by_role.setdefault(role, []).append((w, min(mults)))
    fig, ax = new_figure(size=(6.4, 2.9))
    ax.loglog(widths, [lr] * len(widths), "k--", lw=1, label="standard: every parameter")
    for i, (role, points) in enumerate(by_role.items()):
        ax.loglog([w for w, _ in points], [lr * m for _, m in points], "o-", color=f"C{i}", ms=3, label=f"μP: {role}")
    ax.axvline(width, color="k", ls=":", lw=1)
    ax.set(xlabel="width (d_model)", ylabel="Adam learning rate", title=f"base width {base_width}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    rules = _rules(config, width, base_width)
    groups: dict = {}   # the parameters that share a role and a width multiplier share their rule
    for name, rule in rules.items():
        groups.setdefault((rule.role, rule.width_mult), []).append(name)
    rows = {f"{role} (fan-in ×{mult:g}): {len(names)} tensors, e.g. {names[0]}":
            f"lr {lr * rules[names[0]].lr_mult:.3g}, init ×{rules[names[0]].init_mult:.3g}"
            for (role, mult), names in sorted(groups.items())}
    return View(f"width {width} = {width / base_width:g} × base; standard parametrisation: lr {lr:g} everywhere"
                + table(rows), fig, dict(lr={n: lr * r.lr_mult for n, r in rules.items()}))


def explore_mup(config=None, base_width: int | None = None) -> Explorer:
    """Widen the model: the learning rate and initialisation μP gives each parameter.
    ``config``: a dense :class:`lmfs.nn.TransformerConfig` at the base width (default: a tiny one)."""
    base_width = base_width or (config.d_model if config is not None else 64)
    controls = {
        "width": widgets.SelectionSlider(options=[base_width * 2 ** i for i in range(6)], value=base_width * 4,
                                         description="width", continuous_update=False),
        "lr": slider(1e-2, -4, -1, step=0.25, log=True, description="base lr"),
    }
    return Explorer("μP: learning rate and init per parameter", mup_view, controls,
                    dict(base_width=base_width, config=config))
