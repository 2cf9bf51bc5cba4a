"""Explorers of lectures 01-04: BPE merges, memory and FLOPs of a training step, ablation runs,
and an MoE router's load."""

from __future__ import annotations

import html
import math
import os
import tempfile

import ipywidgets as widgets
import numpy as np
import torch

from lmfs.explore._core import Explorer, View, new_figure, slider, table

SENTENCE = "The for statement is used to iterate over the elements of a sequence, such as a string."
_COLORS = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1e6", "#e8e8e4", "#f0efeb"]


# --- 01: BPE merges on typed text ------------------------------------------------------------

def _prefix_tokenizer(vocab: dict[int, bytes], merges, special_tokens, n_merges: int):
    """The tokenizer that knows only the bytes, the special tokens and the first ``n_merges`` merges
    (``train_bpe`` numbers them in that order, so they are the lowest ids)."""
    from lmfs.tokenization import Tokenizer

    first_merge = 256 + len(special_tokens)
    keep = {i: b for i, b in vocab.items() if i < first_merge + n_merges}
    return Tokenizer(keep, merges[:n_merges], special_tokens=list(special_tokens))


def merges_view(text: str, n_merges: int, vocab: dict[int, bytes], merges, special_tokens=("<|endoftext|>",),
                curve_points: int = 12) -> View:
    """``text`` cut by the first ``n_merges`` merges, and the compression (bytes per token) of
    ``text`` against the number of merges (the vocabulary size less 256 bytes and the specials)."""
    if not text:
        raise ValueError("type some text to tokenize")
    if not 0 <= n_merges <= len(merges):
        raise ValueError(f"n_merges={n_merges} must be between 0 and {len(merges)} (the merges learned)")
    tok = _prefix_tokenizer(vocab, merges, special_tokens, n_merges)
    ids = tok.encode(text)
    pieces = [tok.decode_bytes([i]).decode("utf-8", errors="replace") for i in ids]
    n_bytes = len(text.encode("utf-8"))
    steps = sorted(set(np.linspace(0, len(merges), curve_points).astype(int).tolist()) | {n_merges})
    counts = [len(_prefix_tokenizer(vocab, merges, special_tokens, n).encode(text)) for n in steps]
    fig, ax = new_figure(size=(6.4, 2.8))
    ax.plot(steps, [n_bytes / c for c in counts], "o-", ms=3)
    ax.plot([n_merges], [n_bytes / len(ids)], "o", color="C3", ms=8)
    ax.set(xlabel="merges learned (vocabulary size − 256 − specials)", ylabel="bytes per token",
           title="compression of this text")
    ax.grid(alpha=0.3)
    spans = "".join(f'<span style="background:{_COLORS[i % len(_COLORS)]};padding:1px;margin:1px;'
                    f'font-family:monospace;white-space:pre">{html.escape(p)}</span>' for i, p in enumerate(pieces))
    text_html = (f"<b>{n_merges} merges → {len(ids)} tokens for {n_bytes} bytes "
                 f"({n_bytes / len(ids):.2f} bytes per token)</b><br>{spans}")
    return View(text_html, fig, dict(ids=ids, pieces=pieces, n_tokens=len(ids), bytes_per_token=n_bytes / len(ids),
                                     curve=dict(zip(steps, counts))))


def small_bpe(n_merges: int = 300, n_bytes: int = 100_000):
    """``(vocab, merges)`` of a BPE trained on ``n_bytes`` of CPython's documentation (a few seconds),
    for using :func:`explore_tokenizer` outside lecture 01."""
    from lmfs.data.corpora import pydoc_text
    from lmfs.tokenization import train_bpe

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "pydoc.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(pydoc_text()[:n_bytes])
        return train_bpe(path, 256 + 1 + n_merges, ["<|endoftext|>"], num_workers=1)


def explore_tokenizer(vocab: dict[int, bytes] | None = None, merges=None, text: str = SENTENCE,
                      special_tokens=("<|endoftext|>",)) -> Explorer:
    """Type a sentence, step through the merges: the tokens it becomes and the compression curve.

    ``vocab``, ``merges``: a trained BPE (:func:`lmfs.tokenization.train_bpe`); default
    :func:`small_bpe`.
    """
    if vocab is None or merges is None:
        vocab, merges = small_bpe()
    controls = {
        "n_merges": slider(min(50, len(merges)), 0, len(merges), description="merges",
                           layout=widgets.Layout(width="60%")),
        "text": widgets.Text(value=text, description="text", continuous_update=False,
                             layout=widgets.Layout(width="95%")),
    }
    return Explorer("BPE merges on your text", merges_view, controls,
                    dict(vocab=vocab, merges=merges, special_tokens=tuple(special_tokens)))


# --- 02: memory and FLOPs of a training step -------------------------------------------------

PRECISIONS = {  # bytes per parameter of (weights, gradients, optimizer state) for AdamW
    "fp32 (weights, grads, 2 moments)": (4, 4, 8),
    "mixed bf16 (+ fp32 master weights)": (2, 2, 12),
    "pure bf16 (bf16 moments)": (2, 2, 4),
}


def training_step_view(d_model: int, n_layers: int, seq_len: int, batch_size: int, precision: str,
                       gpu: str = "H100", mfu: float = 0.4, vocab_size: int = 32_000,
                       measured: dict | None = None) -> View:
    """Memory and time of one AdamW step of a Llama-style model on one GPU.

    Memory by :func:`lmfs.parallel.costs.strategy_costs` (``"ddp"`` at ``n = 1``: one GPU holds
    everything), FLOPs by :func:`lmfs.accounting.training_flops`, time at ``mfu`` of the GPU's
    bf16 (or fp32) peak from :mod:`lmfs.hardware`. ``measured``: an optional point to show beside
    the prediction, ``{"label": ..., "GB": ..., "seconds": ...}``.
    """
    from lmfs.accounting import param_count, training_flops
    from lmfs.hardware import gpu as find_gpu
    from lmfs.nn import TransformerConfig
    from lmfs.parallel.costs import strategy_costs

    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {list(PRECISIONS)}")
    n_heads = max(1, d_model // 128)
    config = TransformerConfig(vocab_size=vocab_size, context_length=seq_len, d_model=d_model,
                               n_layers=n_layers, n_heads=n_heads)
    p, g, o = PRECISIONS[precision]
    act = 4 if precision.startswith("fp32") else 2
    cost = strategy_costs(config, "ddp", 1, batch_size, seq_len, param_bytes=p, grad_bytes=g,
                          optimizer_bytes=o, activation_bytes=act)
    flops = training_flops(config, batch_size * seq_len, seq_len)
    device = find_gpu(gpu)
    peak = device.peak("fp32" if precision.startswith("fp32") else "bf16")
    seconds = flops / (peak * mfu)
    parts = {k: cost[f"{k}_GB"] for k in ("params", "grads", "optimizer", "activations")}
    fig, (ax, ax2) = new_figure(2, size=(7.5, 2.8))
    left = 0.0
    for i, (name, gb) in enumerate(parts.items()):
        ax.barh([0], [gb], left=left, color=f"C{i}", label=name)
        left += gb
    ax.axvline(device.memory_bytes / 1e9, color="k", ls="--", lw=1, label=f"{gpu} memory")
    if measured:
        ax.plot([measured["GB"]], [0], "k*", ms=12, label=f"measured: {measured.get('label', '')}")
    ax.set(yticks=[], xlabel="GB", title="memory of one step")
    ax.legend(fontsize=7, loc="upper right")
    tokens = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256]) * seq_len
    ax2.loglog(tokens, [training_flops(config, t, seq_len) / (peak * mfu) for t in tokens], "-", color="C4")
    ax2.plot([batch_size * seq_len], [seconds], "o", color="C3")
    if measured and "seconds" in measured:
        ax2.plot([batch_size * seq_len], [measured["seconds"]], "k*", ms=12)
    ax2.set(xlabel="tokens per step", ylabel="seconds", title=f"step time at {mfu:.0%} MFU")
    ax2.grid(alpha=0.3, which="both")
    n_params = param_count(config)
    rows = {"parameters": f"{n_params / 1e6:,.1f} M", "heads (d_model/128)": n_heads,
            **{f"{k} memory": f"{gb:.3g} GB" for k, gb in parts.items()},
            "total": f"{cost['total_GB']:.3g} GB" + (" — does not fit" if cost["total_GB"] > device.memory_bytes / 1e9 else ""),
            "FLOPs per step (6·N·D + attention)": f"{flops:.3g}", f"time on one {gpu}": f"{seconds * 1e3:.3g} ms"}
    return View(table(rows), fig, dict(n_params=n_params, flops=flops, seconds=seconds, total_GB=cost["total_GB"], GB=parts))


def explore_training_step(gpu: str = "H100", measured: dict | None = None) -> Explorer:
    """Model shape, batch and precision -> memory (parameters, gradients, optimizer, activations)
    and FLOPs and time of one training step; ``measured`` as in :func:`training_step_view`."""
    controls = {
        "d_model": widgets.SelectionSlider(options=[256, 512, 768, 1024, 2048, 4096, 8192], value=1024,
                                           description="d_model", continuous_update=False),
        "n_layers": slider(24, 1, 96, description="layers"),
        "seq_len": widgets.SelectionSlider(options=[256, 512, 1024, 2048, 4096, 8192], value=2048,
                                           description="seq_len", continuous_update=False),
        "batch_size": slider(8, 1, 64, description="batch"),
        "precision": widgets.Dropdown(options=list(PRECISIONS), value="mixed bf16 (+ fp32 master weights)",
                                      description="precision"),
        "mfu": slider(0.4, 0.05, 1.0, step=0.05, integer=False, description="MFU"),
    }
    return Explorer("Memory and FLOPs of one training step", training_step_view, controls,
                    dict(gpu=gpu, measured=measured))


# --- 03: ablation runs overlaid ---------------------------------------------------------------

def runs_view(names, runs) -> View:
    """The chosen ``runs`` (``{name: lmfs.train.Run}``) overlaid by :func:`lmfs.train.plot_runs`,
    with their final losses."""
    from lmfs.train import plot_runs

    names = list(names)
    if not names:
        raise ValueError("choose at least one run")
    fig, ax = new_figure(size=(6.4, 3.4))
    plot_runs(runs, names, ax=ax)
    finals = {n: (runs[n].history.val_loss or runs[n].history.loss)[-1] for n in names}
    rows = {n: f"{v:.4f}" for n, v in sorted(finals.items(), key=lambda kv: kv[1])}
    return View("final loss, best first:" + table(rows), fig, dict(final_loss=finals))


def explore_runs(runs) -> Explorer:
    """Overlay any of the lecture's ablation runs (``{name: Run}`` from :func:`lmfs.train.ablate`)."""
    if not runs:
        raise ValueError("explore_runs needs at least one run (the dict lmfs.train.ablate returns)")
    names = list(runs)
    controls = {"names": widgets.SelectMultiple(options=names, value=tuple(names[:2]), description="runs",
                                                rows=min(8, len(names)), layout=widgets.Layout(width="50%"))}
    return Explorer("Ablation runs, overlaid", runs_view, controls, dict(runs=runs))


# --- 04: the router's load ----------------------------------------------------------------------

ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid", "expert_choice")


def routing_view(skew: float, top_k: int, capacity_factor: float, kind: str = "softmax_topk",
                 n_experts: int = 8, n_tokens: int = 256, d_model: int = 32, seed: int = 0) -> View:
    """Load per expert of an :class:`lmfs.nn.moe.Router` on random tokens, with one expert's logit
    raised by ``skew`` (a router that has started to prefer it), the tokens over
    :func:`lmfs.nn.moe.capacity` dropped, and :func:`lmfs.nn.moe.switch_loss`."""
    from lmfs.nn.moe import Router, bin_counts, capacity, switch_loss

    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
    gen = torch.Generator().manual_seed(seed)
    router = Router(d_model, n_experts, top_k, kind=kind)
    with torch.no_grad():
        router.proj.weight.copy_(torch.randn(n_experts, d_model, generator=gen) / math.sqrt(d_model))
        x = torch.randn(n_tokens, d_model, generator=gen)
        # A common direction in every token, which the router maps to expert 0 with weight `skew`.
        direction = router.proj.weight[0] / router.proj.weight[0].norm() ** 2
        x = x + skew * direction
        routing = router(x, capacity_factor=capacity_factor)
    load = bin_counts(routing.expert, n_experts)
    cap = capacity(n_tokens, top_k, n_experts, capacity_factor)
    kept = load.clamp(max=cap) if cap is not None and kind != "expert_choice" else load
    loss = float(switch_loss(routing.probs, load)) if routing.probs is not None else float("nan")
    fig, ax = new_figure(size=(6.4, 2.8))
    e = np.arange(n_experts)
    ax.bar(e, load.numpy(), color="C1", label="routed")
    ax.bar(e, kept.numpy(), color="C0", label="processed")
    if cap is not None:
        ax.axhline(cap, color="k", ls="--", lw=1, label=f"capacity {cap}")
    ax.axhline(n_tokens * top_k / n_experts, color="C2", lw=1, label="uniform")
    ax.set(xlabel="expert", ylabel="assignments", title=f"{kind}, top-{top_k}, skew {skew:g}")
    ax.legend(fontsize=7)
    dropped = int((load - kept).sum())
    rows = {"assignments": int(load.sum()), "largest load / uniform": float(load.max()) / (n_tokens * top_k / n_experts),
            "capacity per expert": cap if cap is not None else "none", "dropped assignments": dropped,
            "switch (balancing) loss, 1 = uniform": loss}
    return View(table(rows), fig, dict(load=load.tolist(), capacity=cap, dropped=dropped, switch_loss=loss))


def explore_routing(n_experts: int = 8, n_tokens: int = 256) -> Explorer:
    """Skew a router toward one expert and watch the load, the dropped tokens and the balancing loss."""
    controls = {
        "skew": slider(0.0, 0.0, 8.0, step=0.5, integer=False, description="skew toward expert 0"),
        "top_k": slider(2, 1, n_experts, description="top-k"),
        "capacity_factor": slider(1.25, 0.5, 3.0, step=0.25, integer=False, description="capacity factor"),
        "kind": widgets.Dropdown(options=ROUTER_KINDS, value="softmax_topk", description="router"),
    }
    return Explorer("Routing tokens to experts", routing_view, controls,
                    dict(n_experts=n_experts, n_tokens=n_tokens))
