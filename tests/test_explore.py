"""lmfs.explore: each explorer's view function against the lmfs function or closed form it shows,
a moved parameter changes the view, and the widget follows its controls without a frontend."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lmfs.explore as ex


@pytest.fixture(scope="module")
def bpe():
    return ex.small_bpe(n_merges=60, n_bytes=20_000)


def test_merges_view_matches_a_tokenizer_with_the_same_merges(bpe):
    from lmfs.tokenization import Tokenizer

    vocab, merges = bpe
    view = ex.merges_view("the for statement", 30, vocab, merges)
    keep = {i: b for i, b in vocab.items() if i < 256 + 1 + 30}
    reference = Tokenizer(keep, merges[:30], special_tokens=["<|endoftext|>"]).encode("the for statement")
    assert view.values["ids"] == reference
    assert "".join(view.values["pieces"]) == "the for statement"
    assert view.values["curve"][0] == len("the for statement".encode())   # no merges: one token per byte
    assert ex.merges_view("the for statement", 60, vocab, merges).values["n_tokens"] < len(reference)
    with pytest.raises(ValueError, match="n_merges"):
        ex.merges_view("x", 61, vocab, merges)


def test_training_step_view_against_accounting():
    from lmfs.accounting import param_count, training_flops
    from lmfs.nn import TransformerConfig

    kw = dict(d_model=512, n_layers=4, seq_len=256, batch_size=2, precision="fp32 (weights, grads, 2 moments)")
    view = ex.training_step_view(**kw)
    config = TransformerConfig(vocab_size=32_000, context_length=256, d_model=512, n_layers=4, n_heads=4)
    assert view.values["n_params"] == param_count(config)
    assert view.values["flops"] == training_flops(config, 2 * 256, 256)
    n = param_count(config)
    assert view.values["GB"]["params"] == pytest.approx(4 * n / 1e9)        # fp32 weights
    assert view.values["GB"]["optimizer"] == pytest.approx(8 * n / 1e9)     # two fp32 moments
    doubled = ex.training_step_view(**{**kw, "batch_size": 4})
    assert doubled.values["GB"]["activations"] == pytest.approx(2 * view.values["GB"]["activations"])
    assert doubled.values["seconds"] == pytest.approx(2 * view.values["seconds"])


def test_routing_view_load_capacity_and_loss():
    from lmfs.nn.moe import capacity

    even = ex.routing_view(skew=0.0, top_k=2, capacity_factor=1.0, n_tokens=128)
    skewed = ex.routing_view(skew=8.0, top_k=2, capacity_factor=1.0, n_tokens=128)
    assert sum(even.values["load"]) == sum(skewed.values["load"]) == 2 * 128
    assert even.values["capacity"] == capacity(128, 2, 8, 1.0) == 32
    assert skewed.values["load"][0] == 128               # every token sends one choice to expert 0
    dropped = sum(max(0, l - 32) for l in skewed.values["load"])
    assert skewed.values["dropped"] == dropped > even.values["dropped"]
    assert skewed.values["switch_loss"] > even.values["switch_loss"] >= 1 - 1e-6
    chosen = ex.routing_view(skew=8.0, top_k=2, capacity_factor=1.0, n_tokens=128, kind="expert_choice")
    assert chosen.values["load"] == [32] * 8              # experts pick their capacity: perfectly even


def test_runs_view_overlays_the_chosen_runs():
    from types import SimpleNamespace

    def run(losses):
        return SimpleNamespace(history=SimpleNamespace(step=list(range(len(losses))), loss=losses, val_step=[],
                                                       val_loss=[]), model_config=SimpleNamespace(vocab_size=64))
    runs = {"a": run([4.0, 3.0, 2.5]), "b": run([4.0, 3.5, 3.2])}
    view = ex.runs_view(("a", "b"), runs)
    assert view.values["final_loss"] == {"a": 2.5, "b": 3.2}
    assert len(view.figure.axes[0].lines) == 4           # a smoothed curve and a legend entry per run
    assert ex.runs_view(("b",), runs).values["final_loss"] == {"b": 3.2}
    with pytest.raises(ValueError, match="at least one"):
        ex.runs_view((), runs)


def test_roofline_view_against_the_roofline():
    from lmfs.bench.roofline import attainable_flops, tile_waves
    from lmfs.hardware import gpu

    h100 = gpu("H100")
    one_wave = ex.roofline_view("matmul n×n×n", 1792, gpu="H100")
    assert one_wave.values["intensity"] == pytest.approx(2 * 1792 ** 3 / (3 * 1792 ** 2 * 2))
    tw = tile_waves(1792, 1792, (256, 128), h100.sm_count)
    assert one_wave.values["rate"] == pytest.approx(h100.peak("bf16") * tw.efficiency)
    add = ex.roofline_view("elementwise add of n×n", 4096, gpu="H100")
    assert add.values["intensity"] == pytest.approx(1 / 6)                  # 1 FLOP per 3 bf16 elements
    assert add.values["rate"] == pytest.approx(float(attainable_flops(1 / 6, h100.peak("bf16"), h100.hbm_bandwidth)))
    assert add.values["bound"] == "memory-bound" and one_wave.values["bound"] == "compute-bound"
    assert ex.roofline_view("matmul n×n×n", 1793, gpu="H100").values["rate"] != one_wave.values["rate"]


def test_kernel_grid_view_counts_programs_and_waves():
    view = ex.kernel_grid_view(block_m=128, seq_len=4096, batch_heads=16, gpu="H100")
    assert view.values["programs"] == 32 * 16
    assert view.values["waves"] == math.ceil(512 / 132)
    assert view.values["efficiency"] == pytest.approx(512 / (4 * 132))
    assert ex.kernel_grid_view(block_m=64, seq_len=4096, batch_heads=16).values["programs"] == 64 * 16


def test_parallelism_view_is_strategy_costs():
    from lmfs.parallel.costs import llama_70b, strategy_costs

    view = ex.parallelism_view("zero3", 8, batch_size=64, seq_len=4096)
    for s in ("ddp", "zero3", "pp"):
        assert view.values["costs"][s] == strategy_costs(llama_70b(), s, 8, 64, 4096, 8)
    more = ex.parallelism_view("zero3", 16, batch_size=64, seq_len=4096)
    assert more.values["costs"]["zero3"]["params_GB"] < view.values["costs"]["zero3"]["params_GB"]
    with pytest.raises(ValueError, match="not among"):
        ex.parallelism_view("ep", 8, strategies=("ddp",))


def test_compute_optimal_view_against_the_closed_form():
    from lmfs.scaling import HOFFMANN_2022

    view = ex.compute_optimal_view(24.0, {"H": HOFFMANN_2022})
    a, b = HOFFMANN_2022.a, HOFFMANN_2022.b
    G = (HOFFMANN_2022.alpha * HOFFMANN_2022.A / (HOFFMANN_2022.beta * HOFFMANN_2022.B)) ** (1 / (HOFFMANN_2022.alpha + HOFFMANN_2022.beta))
    n_star, d_star = view.values["optimum"]["H"]
    assert n_star == pytest.approx(G * (1e24 / 6) ** a)
    assert 6 * n_star * d_star == pytest.approx(1e24)
    bigger = ex.compute_optimal_view(25.0, {"H": HOFFMANN_2022}).values["optimum"]["H"][0]
    assert bigger / n_star == pytest.approx(10 ** a)


def test_sampling_view_against_the_filters_by_hand():
    logits = ex.zipf_logits(32)
    p = torch.softmax(logits, -1)
    top3 = ex.sampling_view(1.0, 3, 1.0, 0.0, logits).values["probs"]
    expected = torch.zeros(32)
    expected[:3] = p[:3] / p[:3].sum()
    torch.testing.assert_close(top3, expected)
    hot = ex.sampling_view(2.0, 0, 1.0, 0.0, logits).values
    torch.testing.assert_close(hot["probs"], torch.softmax(logits / 2, -1))
    minp = ex.sampling_view(1.0, 0, 1.0, 0.2, logits).values
    assert minp["kept"] == int((p >= 0.2 * p.max()).sum())
    nucleus = ex.sampling_view(1.0, 0, 0.5, 0.0, logits).values
    assert nucleus["kept"] == int((torch.cumsum(p, 0) < 0.5).sum()) + 1   # the smallest prefix reaching 0.5
    greedy = ex.sampling_view(0.0, 0, 1.0, 0.0, logits).values
    assert greedy["kept"] == 1 and greedy["probs"][0] == 1


def test_kv_cache_view_closed_form():
    view = ex.kv_cache_view(context=8192, batch_size=4, n_kv_heads=8, n_layers=32, n_heads=32, d_model=4096)
    per_token = 2 * 32 * 8 * 128 * 2                   # K and V, layers, K/V heads, head_dim, bf16 bytes
    assert view.values["bytes_per_token"] == per_token
    assert view.values["total"] == per_token * 8192 * 4
    mqa = ex.kv_cache_view(context=8192, batch_size=4, n_kv_heads=1, n_layers=32, n_heads=32, d_model=4096)
    assert mqa.values["total"] * 8 == view.values["total"]
    with pytest.raises(ValueError, match="divide"):
        ex.kv_cache_view(context=8, batch_size=1, n_kv_heads=3)


def test_mup_view_scales_hidden_learning_rates():
    view = ex.mup_view(width=256, lr=0.01, base_width=64)
    lrs = view.values["lr"]
    assert lrs["blocks.0.attn.q_proj.weight"] == pytest.approx(0.01 / 4)   # hidden: lr / (width / base)
    assert lrs["tok_emb.weight"] == pytest.approx(0.01)
    wider = ex.mup_view(width=512, lr=0.01, base_width=64).values["lr"]
    assert wider["blocks.0.attn.q_proj.weight"] == pytest.approx(0.01 / 8)


def test_pass_at_k_view_against_brute_force_and_the_binomial():
    import itertools

    view = ex.pass_at_k_view(n=6, c=2, items=100)
    for k in range(1, 7):
        subsets = list(itertools.combinations([1, 1, 0, 0, 0, 0], k))
        assert view.values["pass_at_k"][k - 1] == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    narrow = ex.pass_at_k_view(n=6, c=2, items=3000).values["interval"]
    wide = view.values["interval"]
    assert narrow.high - narrow.low < wide.high - wide.low
    assert narrow.high - narrow.low == pytest.approx(2 * 1.96 * math.sqrt(0.6 * 0.4 / 3000), rel=0.25)


def test_extraction_view_applies_the_rules():
    from lmfs.data.rules import gopher_reasons

    from lmfs.explore.eval_data_alignment import SAMPLE_HTML

    view = ex.extraction_view(SAMPLE_HTML)
    assert "Home" not in view.values["text"] and "cookies" not in view.values["text"]
    assert "river reopened on Monday" in view.values["text"]
    assert view.values["gopher"] == gopher_reasons(view.values["text"]) == ["fewer than 50 words"]
    assert not view.values["kept"]
    from lmfs.data.rules import c4_clean

    everything = ex.extraction_view(SAMPLE_HTML, main_content=False).values
    assert "Home" in everything["text"] and "cookies" in everything["text"]
    assert everything["c4_page"] == c4_clean(everything["text"])[2]
    assert everything["c4_lines"] == dict(c4_clean(everything["text"])[1])


def test_minhash_view_measured_pairs_follow_the_s_curve():
    from lmfs.data.dedup import s_curve

    view = ex.minhash_view(bands=16, rows=8)
    assert view.values["threshold"] == pytest.approx((1 / 16) ** (1 / 8))
    sims, cand = view.values["sims"], view.values["candidate"]
    assert cand[sims > 0.9].all() and not cand[sims < 0.4].any()
    expected = s_curve(sims, 16, 8).sum()
    assert abs(cand.sum() - expected) < 4 * math.sqrt(expected)
    assert ex.minhash_view(bands=4, rows=8).values["candidate"].sum() < cand.sum()
    with pytest.raises(ValueError, match="MinHash values"):
        ex.minhash_view(bands=64, rows=4)


def test_dpo_view_closed_form():
    view = ex.dpo_view(beta=0.1, log_ratio_margin=3.0)
    assert view.values["loss"] == pytest.approx(math.log1p(math.exp(-0.3)), rel=1e-5)
    assert view.values["reward_margin"] == pytest.approx(0.3)
    m = view.values["margins"]
    torch.testing.assert_close(view.values["weight"], torch.sigmoid(-0.1 * m))
    assert ex.dpo_view(beta=0.5, log_ratio_margin=3.0).values["loss"] < view.values["loss"]


def test_group_advantages_view_by_hand():
    view = ex.group_advantages_view(right=1, group_size=4)
    r = np.array([1.0, 0, 0, 0])
    np.testing.assert_allclose(view.values["dr_grpo"].numpy(), r - r.mean(), atol=1e-6)
    np.testing.assert_allclose(view.values["grpo"].numpy(), (r - r.mean()) / (r.std(ddof=1) + 1e-6), atol=1e-5)
    all_right = ex.group_advantages_view(right=4, group_size=4)
    assert all_right.values["grpo"].abs().max() == 0


def test_clipped_objective_view_clips_where_ppo_says():
    view = ex.clipped_objective_view(advantage=1.0, clip=0.2, ratio=1.5)
    r, obj, grad = view.values["ratios"], view.values["objective"], view.values["grad"]
    torch.testing.assert_close(obj, torch.minimum(r, r.clamp(0.8, 1.2)))    # A = 1: min(ρ, clip(ρ))
    assert view.values["here"] == pytest.approx(1.2)
    assert (grad[r > 1.21] == 0).all() and torch.allclose(grad[r < 1.19], torch.ones(1))
    negative = ex.clipped_objective_view(advantage=-1.0, clip=0.2, ratio=0.5).values
    assert negative["here"] == pytest.approx(-0.8)
    assert (negative["grad"][r < 0.79] == 0).all()


def test_explorer_widget_follows_its_controls_and_shows_its_view_headless():
    explorer = ex.explore_kv_cache()
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "data:image/png;base64," in bundle["text/html"]
    before = explorer.view.values["total"]
    explorer.controls["batch_size"].value = 2 * explorer.controls["batch_size"].value
    assert explorer.view.values["total"] == 2 * before
    assert explorer.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    explorer.controls["n_kv_heads"].value = 32
    assert explorer.view.values["total"] == 8 * before
    bad = ex.explore_group_advantages(group_size=4)
    bad.controls["right"].max = 9
    bad.controls["right"].value = 9                     # a ValueError is shown, not raised
    assert bad.view is None and "between 0" in bad.text.value
