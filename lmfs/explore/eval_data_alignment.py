"""Explorers of lectures 12-17: pass@k and bootstrap intervals, HTML extraction and quality rules,
the MinHash S-curve, DPO's β, group advantages and the clipped objective."""

from __future__ import annotations

import html
import math

import ipywidgets as widgets
import numpy as np
import torch

from lmfs.explore._core import Explorer, View, new_figure, slider, table


# --- 12: pass@k and the bootstrap --------------------------------------------------------------------

_CURVES: dict = {}


def _bootstrap_curve(accuracy: float, seed: int):
    """``(sizes, {size: Interval}, outcomes)``: :func:`lmfs.eval.bootstrap_ci` (500 resamples) over
    the first ``size`` of 3000 simulated right/wrong items, computed once per ``accuracy``."""
    from lmfs.eval import bootstrap_ci

    key = (round(accuracy, 6), seed)
    if key not in _CURVES:
        rng = np.random.default_rng(seed)
        sizes = np.unique(np.geomspace(10, 3000, 10).astype(int))
        outcomes = (rng.random(sizes.max()) < accuracy).astype(float)
        _CURVES[key] = sizes, {int(m): bootstrap_ci(outcomes[:m], n_resamples=500, seed=seed) for m in sizes}, outcomes
    return _CURVES[key]


def pass_at_k_view(n: int, c: int, items: int, accuracy: float = 0.6, seed: int = 0) -> View:
    """:func:`lmfs.eval.pass_at_k` for every ``k`` with ``c`` of ``n`` samples right, beside the
    plug-in ``1 - (1 - c/n)^k``; and the width of :func:`lmfs.eval.bootstrap_ci` over ``items``
    benchmark items answered right with probability ``accuracy``."""
    from lmfs.eval import bootstrap_ci, pass_at_k

    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples must be between 0 and n={n}")
    ks = np.arange(1, n + 1)
    unbiased = [pass_at_k(n, c, int(k)) for k in ks]
    plug_in = 1 - (1 - c / n) ** ks
    sizes, intervals, outcomes = _bootstrap_curve(accuracy, seed)
    chosen = bootstrap_ci(outcomes[:items], n_resamples=1000, seed=seed)
    fig, (ax, ax2) = new_figure(2, size=(9, 3.0))
    ax.plot(ks, unbiased, "o-", ms=3, label="pass@k (unbiased)")
    ax.plot(ks, plug_in, "--", label="1 − (1 − c/n)^k")
    ax.set(xlabel="k", ylabel="pass@k", title=f"{c} of {n} samples right", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax2.semilogx(sizes, [intervals[int(m)].high - intervals[int(m)].low for m in sizes], "o-", ms=3, label="bootstrap 95 %")
    ax2.semilogx(sizes, 2 * 1.96 * np.sqrt(accuracy * (1 - accuracy) / sizes), "--", label="2·1.96·√(p(1−p)/n)")
    ax2.axvline(items, color="k", ls=":", lw=1)
    ax2.set(xlabel="benchmark items", ylabel="interval width", title=f"accuracy {accuracy:.0%}")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, which="both")
    rows = {"pass@1": unbiased[0], f"pass@{n}": unbiased[-1],
            f"bootstrap interval, {items} items": f"{chosen.estimate:.3f} [{chosen.low:.3f}, {chosen.high:.3f}]"}
    return View(table(rows), fig, dict(pass_at_k=unbiased, interval=chosen))


def explore_pass_at_k() -> Explorer:
    """pass@k against n and c; the bootstrap interval against the number of items."""
    controls = {
        "c": slider(3, 0, 20, description="c right"),
        "n": slider(20, 1, 50, description="n samples"),
        "items": widgets.SelectionSlider(options=[10, 30, 100, 300, 1000, 3000], value=100,
                                         description="items", continuous_update=False),
        "accuracy": slider(0.6, 0.05, 0.95, step=0.05, integer=False, description="accuracy"),
    }
    return Explorer("pass@k and confidence intervals", pass_at_k_view, controls)


# --- 13: a page's HTML, its text, and the rules -------------------------------------------------------

SAMPLE_HTML = """<html><head><title>Town notes</title></head><body>
<nav><a href="/">Home</a> | <a href="/news">News</a></nav>
<h1>The bridge reopens</h1>
<p>The old stone bridge over the river reopened on Monday after two years of repairs.</p>
<p>Engineers replaced the worn arches and added a path for bicycles on the north side.</p>
<div class="cookie-banner">We use cookies. Accept all</div>
<footer>Contact: mail@example.org</footer></body></html>"""


def extraction_view(page: str, main_content: bool = True) -> View:
    """``page`` through :func:`lmfs.data.extract.html_to_text`, then Gopher's rules
    (:func:`lmfs.data.rules.gopher_reasons`) and C4's (:func:`lmfs.data.rules.c4_clean`): the text,
    what each rule set drops, and why."""
    from lmfs.data.extract import html_to_text
    from lmfs.data.rules import c4_clean, gopher_reasons

    text = html_to_text(page, main_content=main_content)
    gopher = gopher_reasons(text)
    kept, dropped_lines, c4_page = c4_clean(text)
    verdict = "kept" if not gopher and c4_page is None else "dropped"
    lines = "".join(f"<li>{html.escape(reason)}: {count}</li>" for reason, count in dropped_lines.items())
    text_html = (f"<b>extracted text</b> ({len(text.split())} words):"
                 f"<pre style='white-space:pre-wrap;background:#f6f6f6;padding:4px'>{html.escape(text) or '(empty)'}</pre>"
                 f"<b>Gopher</b>: {html.escape(', '.join(gopher) or 'passes')}<br>"
                 f"<b>C4</b>: page {html.escape(c4_page or 'passes')}; lines dropped: <ul>{lines or '<li>none</li>'}</ul>"
                 f"<b>verdict: {verdict}</b>")
    return View(text_html, None, dict(text=text, gopher=gopher, c4_page=c4_page, c4_lines=dict(dropped_lines),
                                      kept=verdict == "kept"))


def explore_extraction(page: str | bytes | None = None) -> Explorer:
    """Edit a page's HTML: its extracted text and which rule drops it (default: a short news page;
    pass one of the lecture's, e.g. ``generate_site(...)[i].html``)."""
    if isinstance(page, bytes):
        from lmfs.data.extract import decode_html

        page = decode_html(page)
    controls = {
        "main_content": widgets.Checkbox(value=True, description="drop menus, footers, cookie notices"),
        "page": widgets.Textarea(value=page or SAMPLE_HTML, description="HTML", continuous_update=False,
                                 layout=widgets.Layout(width="95%", height="10em")),
    }
    return Explorer("HTML to text, and the quality rules", extraction_view, controls)


# --- 14: MinHash bands × rows -> the S-curve -----------------------------------------------------------

_PAIRS: dict = {}


def measured_pairs(n_pairs: int = 300, num_perm: int = 128, seed: int = 0):
    """``(similarities, signature pairs)`` of document pairs of known Jaccard similarity, signed once
    by :class:`lmfs.data.dedup.MinHasher` (cached): each pair shares a random part of 200 shingles."""
    key = (n_pairs, num_perm, seed)
    if key not in _PAIRS:
        from lmfs.data.dedup import MinHasher, jaccard

        rng = np.random.default_rng(seed)
        hasher = MinHasher(num_perm=num_perm, ngram=1)
        docs, sims = [], []
        for i in range(n_pairs):
            shared = int(rng.integers(0, 201))
            common = [f"w{i}_{j}" for j in range(shared)]
            a = common + [f"a{i}_{j}" for j in range(200 - shared)]
            b = common + [f"b{i}_{j}" for j in range(200 - shared)]
            docs += [" ".join(a), " ".join(b)]
            sims.append(jaccard(set(a), set(b)))
        sigs = hasher.signatures(docs)
        _PAIRS[key] = (np.array(sims), sigs[0::2], sigs[1::2])
    return _PAIRS[key]


def minhash_view(bands: int, rows: int, num_perm: int = 128) -> View:
    """The LSH S-curve :func:`lmfs.data.dedup.s_curve` for ``bands × rows``, its threshold
    ``(1/b)^(1/r)``, and the measured fraction of :func:`measured_pairs` that share a band key
    (:func:`lmfs.data.dedup.band_keys`)."""
    from lmfs.data.dedup import band_keys, s_curve

    if bands * rows > num_perm:
        raise ValueError(f"{bands} bands × {rows} rows need {bands * rows} MinHash values; "
                         f"the signatures have {num_perm}")
    sims, sig_a, sig_b = measured_pairs(num_perm=num_perm)
    candidate = (band_keys(sig_a, bands, rows) == band_keys(sig_b, bands, rows)).any(axis=1)
    s = np.linspace(0, 1, 201)
    threshold = (1 / bands) ** (1 / rows)
    fig, ax = new_figure(size=(6.4, 3.0))
    ax.plot(s, s_curve(s, bands, rows), label="1 − (1 − s^r)^b")
    edges = np.linspace(0, 1, 11)
    which = np.clip(np.digitize(sims, edges) - 1, 0, 9)
    centres = [(edges[i] + edges[i + 1]) / 2 for i in range(10) if (which == i).any()]
    measured = [candidate[which == i].mean() for i in range(10) if (which == i).any()]
    ax.plot(centres, measured, "o", color="C3", label="measured pairs")
    ax.axvline(threshold, color="k", ls=":", lw=1, label=f"(1/b)^(1/r) = {threshold:.2f}")
    ax.set(xlabel="Jaccard similarity s", ylabel="P(candidate pair)", title=f"{bands} bands × {rows} rows")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    rows_shown = {"MinHash values used": f"{bands * rows} of {num_perm}", "threshold (1/b)^(1/r)": threshold,
                  "P(candidate) at s = 0.5": float(s_curve(0.5, bands, rows)),
                  "P(candidate) at s = 0.8": float(s_curve(0.8, bands, rows)),
                  "measured pairs that are candidates": f"{int(candidate.sum())} of {len(candidate)}"}
    return View(table(rows_shown), fig, dict(threshold=threshold, candidate=candidate, sims=sims))


def explore_minhash() -> Explorer:
    """MinHash LSH: bands × rows -> the S-curve, with measured pairs on it."""
    measured_pairs()
    controls = {"bands": slider(20, 1, 64, description="bands b"), "rows": slider(5, 1, 32, description="rows r")}
    return Explorer("LSH banding: the S-curve", minhash_view, controls)


# --- 15: DPO's β ----------------------------------------------------------------------------------------

def dpo_view(beta: float, log_ratio_margin: float) -> View:
    """:func:`lmfs.alignment.dpo_loss` against the policy's log-ratio margin
    ``(log π/π_ref)(chosen) − (log π/π_ref)(rejected)``: the loss, the implicit reward margin
    ``β·margin``, and the gradient's weight on the pair, ``σ(−β·margin)`` (by autograd)."""
    from lmfs.alignment import dpo_loss

    margins = torch.linspace(-20, 20, 161)
    policy_chosen = margins.clone().requires_grad_(True)
    zeros = torch.zeros_like(margins)
    # One pair per margin; dpo_loss averages, so the per-pair loss is the mean times the batch size.
    loss, chosen, rejected = dpo_loss(policy_chosen, zeros, zeros, zeros, beta)
    (loss * len(margins)).backward()
    weight = -policy_chosen.grad / beta                      # d loss / d margin = -β σ(-β m)
    per_pair = [float(dpo_loss(m[None], zeros[:1], zeros[:1], zeros[:1], beta)[0]) for m in margins]
    here_loss, here_c, here_r = dpo_loss(torch.tensor([log_ratio_margin]), torch.zeros(1), torch.zeros(1),
                                         torch.zeros(1), beta)
    fig, (ax, ax2) = new_figure(2, size=(9, 3.0))
    ax.plot(margins, per_pair, label=f"β = {beta:g}")
    ax.plot([log_ratio_margin], [float(here_loss)], "o", color="C3")
    ax.axhline(math.log(2), color="0.6", ls=":", lw=1, label="log 2 (start)")
    ax.set(xlabel="log-ratio margin (nats)", ylabel="DPO loss")
    ax.legend(fontsize=7)
    ax2.plot(margins, weight.numpy(), color="C1")
    ax2.axvline(log_ratio_margin, color="k", ls=":", lw=1)
    ax2.set(xlabel="log-ratio margin (nats)", ylabel="σ(−β·margin)", title="the gradient's weight on a pair")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    reward_margin = float(here_c - here_r)
    rows = {"implicit reward margin β·margin": reward_margin, "loss": float(here_loss),
            "gradient weight σ(−β·margin)": 1 / (1 + math.exp(reward_margin))}
    return View(table(rows), fig, dict(loss=float(here_loss), reward_margin=reward_margin, weight=weight, margins=margins))


def explore_dpo() -> Explorer:
    """DPO's β against the implicit reward margin and the weight of a pair's gradient."""
    controls = {"beta": slider(0.1, -2, 0.5, step=0.1, log=True, description="β"),
                "log_ratio_margin": slider(5.0, -20.0, 20.0, step=0.5, integer=False, description="log-ratio margin")}
    return Explorer("DPO: β and the implicit reward", dpo_view, controls)


# --- 16: group advantages ------------------------------------------------------------------------------

def group_advantages_view(right: int, group_size: int, partial: float = 0.0) -> View:
    """A group of ``group_size`` rewards, ``right`` of them 1 and the rest ``partial``, through
    :func:`lmfs.alignment.group_advantages` with (GRPO) and without (Dr. GRPO) the std division."""
    from lmfs.alignment import group_advantages

    if not 0 <= right <= group_size:
        raise ValueError(f"right={right} must be between 0 and the group size {group_size}")
    rewards = torch.tensor([1.0] * right + [partial] * (group_size - right))
    grpo = group_advantages(rewards, group_size, normalize_std=True)
    dr = group_advantages(rewards, group_size, normalize_std=False)
    fig, (ax, ax2) = new_figure(2, size=(9, 2.9))
    x = np.arange(group_size)
    ax.bar(x - 0.2, grpo.numpy(), width=0.4, label="GRPO: (r − mean) / std")
    ax.bar(x + 0.2, dr.numpy(), width=0.4, label="Dr. GRPO: r − mean")
    ax.set(xlabel="sample", ylabel="advantage", title=f"rewards {rewards.tolist()}"[:60])
    ax.legend(fontsize=7)
    ks = np.arange(group_size + 1)
    def total(k, normalize):
        r = torch.tensor([1.0] * int(k) + [partial] * (group_size - int(k)))
        return float(group_advantages(r, group_size, normalize_std=normalize).abs().sum())
    ax2.plot(ks, [total(k, True) for k in ks], "o-", ms=3, label="GRPO")
    ax2.plot(ks, [total(k, False) for k in ks], "o-", ms=3, label="Dr. GRPO")
    ax2.axvline(right, color="k", ls=":", lw=1)
    ax2.set(xlabel="right answers in the group", ylabel="Σ |advantage|", title="signal per prompt by difficulty")
    ax2.legend(fontsize=7)
    rows = {"GRPO advantages": ", ".join(f"{a:+.2f}" for a in grpo.tolist()),
            "Dr. GRPO advantages": ", ".join(f"{a:+.2f}" for a in dr.tolist())}
    return View(table(rows), fig, dict(grpo=grpo, dr_grpo=dr, rewards=rewards))


def explore_group_advantages(group_size: int = 8) -> Explorer:
    """A group of rewards -> advantages, with and without the std (Dr. GRPO)."""
    controls = {"right": slider(2, 0, group_size, description="right answers"),
                "partial": slider(0.0, 0.0, 0.9, step=0.1, integer=False, description="reward of a wrong one")}
    return Explorer("Group advantages (GRPO, Dr. GRPO)", group_advantages_view, controls, dict(group_size=group_size))


# --- 17: the clipped objective ---------------------------------------------------------------------------

def clipped_objective_view(advantage: float, clip: float, ratio: float = 1.0) -> View:
    """The per-token objective ``-pg_loss(kind="grpo_clip")`` of :func:`lmfs.alignment.pg_loss`
    against the probability ratio ``π/π_old``, and its gradient by autograd (zero where the clip
    has taken over), next to the ``k3`` KL estimate :func:`lmfs.alignment.kl_estimate` of the same
    ratio against the old policy as reference."""
    from lmfs.alignment import kl_estimate, pg_loss

    if clip <= 0:
        raise ValueError(f"clip={clip} must be > 0")
    ratios = torch.linspace(0.2, 2.5, 231)
    logp = ratios.log()[:, None].clone().requires_grad_(True)
    old = torch.zeros_like(logp)
    objective = -pg_loss(logp, torch.full((len(ratios),), advantage), "grpo_clip", old_logp=old, clip=clip)
    objective.sum().backward()
    grad = (logp.grad[:, 0] / ratios).detach()          # d objective / d ratio
    kl = {k: kl_estimate(logp.detach()[:, 0], old[:, 0], k) for k in ("k1", "k3")}
    here = -pg_loss(torch.tensor([[math.log(ratio)]]), torch.tensor([advantage]), "grpo_clip",
                    old_logp=torch.zeros(1, 1), clip=clip)
    fig, (ax, ax2) = new_figure(2, size=(9, 3.0))
    ax.plot(ratios, objective.detach()[:, 0], label="clipped objective")
    ax.plot(ratios, ratios * advantage, ":", color="0.5", label="ρ·A (unclipped)")
    ax.plot(ratios, grad, color="C2", lw=1, label="d objective / dρ")
    ax.plot([ratio], [float(here)], "o", color="C3")
    for edge in (1 - clip, 1 + clip):
        ax.axvline(edge, color="k", ls=":", lw=1)
    ax.set(xlabel="ratio ρ = π / π_old", title=f"A = {advantage:+g}, clip {clip:g}")
    ax.legend(fontsize=7)
    for k, v in kl.items():
        ax2.plot(ratios, v, label=f"KL estimate {k}")
    ax2.set(xlabel="ratio π / π_ref", ylabel="per-token KL estimate", title="the KL penalty's estimators")
    ax2.legend(fontsize=7)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    inside = 1 - clip <= ratio <= 1 + clip
    rows = {"advantage A, clip ε, ratio ρ": f"{advantage:+g}, {clip:g}, {ratio:g}",
            "objective at this ratio": float(here), "clipped (no gradient)": "no" if inside else
            ("yes" if (ratio > 1 + clip and advantage > 0) or (ratio < 1 - clip and advantage < 0) else "no: min keeps ρ·A")}
    return View(table(rows), fig, dict(objective=objective.detach()[:, 0], grad=grad, ratios=ratios, here=float(here)))


def explore_clipped_objective() -> Explorer:
    """The clipped surrogate against the probability ratio, for any advantage and clip range."""
    controls = {"clip": slider(0.2, 0.05, 0.5, step=0.05, integer=False, description="clip ε"),
                "advantage": slider(1.0, -2.0, 2.0, step=0.25, integer=False, description="advantage A"),
                "ratio": slider(1.0, 0.2, 2.5, step=0.05, integer=False, description="ratio ρ")}
    return Explorer("The clipped objective (PPO/GRPO)", clipped_objective_view, controls)
