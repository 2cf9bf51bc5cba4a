"""μP (lmfs.scaling.mup) and WSD branches: the base width is the standard model, the per-layer
rules are the ones of Tensor Programs V, coordinates stay flat with width, a decay branched off a
checkpoint is the uninterrupted WSD run."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from lmfs.nn import TransformerConfig, TransformerLM
from lmfs.nn.attention import causal_mask
from lmfs.scaling.mup import (MuAttention, MuTransformerLM, build_at_width, config_at_width, coordinate_check,
                              coordinate_slopes, mup_model, mup_optimizer, mup_param_groups, mup_rules,
                              optimizer_for, wsd_branches)
from lmfs.train import TrainConfig, make_optimizer, train

BASE = TransformerConfig(vocab_size=64, context_length=16, d_model=32, n_layers=2, n_heads=4)


def tokens(n=20_000, vocab=64, seed=0):
    # A random walk over the vocabulary: enough structure that the loss can fall.
    return (np.cumsum(np.random.default_rng(seed).integers(0, 5, n)) % vocab).astype(np.int64)


def steps_of(model, optimizer, steps=5, seed=1):
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=generator)
        loss = model(x, torch.roll(x, -1, 1))[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fields", [{}, dict(tie_embeddings=False, positions="learned", bias=True, ffn="gelu",
                                             attn_impl="reference", attn_softcap=30.0, logit_softcap=20.0,
                                             qk_norm=True)])
def test_base_width_is_the_standard_model(fields):
    config = dataclasses.replace(BASE, **fields)
    train_config = TrainConfig(steps=5, batch_size=4, context_length=16, lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    standard = TransformerLM(config)
    torch.manual_seed(0)
    mup = mup_model(config, base_width=config.d_model)
    assert isinstance(mup, MuTransformerLM) and all(isinstance(b.attn, MuAttention) for b in mup.blocks)
    for (name, p), q in zip(standard.named_parameters(), mup.parameters()):
        assert torch.equal(p, q), name  # the same draws, unscaled
    # Same losses step by step and the same weights after 5 AdamW steps (decay included).
    want = steps_of(standard, make_optimizer(standard, train_config))
    got = steps_of(mup, mup_optimizer(mup, train_config))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for (name, p), q in zip(standard.named_parameters(), mup.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)


def test_rules_groups_and_first_adam_step():
    wide = config_at_width(BASE, 128)  # 4 x the base width; d_ff 384 vs 128 (rounded to 64s)
    torch.manual_seed(0)
    model = mup_model(wide, base_width=32)
    ratio_ff = wide.ffn_dim / BASE.ffn_dim
    expected_lr = {"tok_emb.weight": 1.0, "final_norm.weight": 1.0}
    for i in range(wide.n_layers):
        for proj in "qkvo":
            expected_lr[f"blocks.{i}.attn.{proj}_proj.weight"] = 1 / 4
        expected_lr.update({f"blocks.{i}.mlp.gate.weight": 1 / 4, f"blocks.{i}.mlp.up.weight": 1 / 4,
                            f"blocks.{i}.mlp.down.weight": 1 / ratio_ff,
                            f"blocks.{i}.norms.0.weight": 1.0, f"blocks.{i}.norms.1.weight": 1.0})
    rules = mup_rules(wide, 32)
    assert set(rules) == set(expected_lr)
    assert {n: r.lr_mult for n, r in rules.items()} == pytest.approx(expected_lr)
    assert rules["tok_emb.weight"].role == "output" and rules["blocks.0.attn.q_proj.weight"].role == "hidden"

    # Groups: every parameter once, with its multiplier; decay λ·m on hidden matrices, none on vectors.
    groups = mup_param_groups(model, lr=1e-2, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    seen = [names[id(p)] for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(expected_lr)
    for g in groups:
        for p in g["params"]:
            name = names[id(p)]
            assert g["lr_mult"] == pytest.approx(expected_lr[name])
            want_decay = 0.0 if p.dim() < 2 else 0.1 / expected_lr[name]
            assert g["weight_decay"] == pytest.approx(want_decay)

    # Multipliers: output base/width; attention √(d_base/d_head) (head_dim 8 -> 32).
    assert model.output_mult == pytest.approx(1 / 4)
    assert model.blocks[0].attn.attn_mult == pytest.approx(math.sqrt(8 / 32))
    # Init: hidden std 0.02/√4 (residual writes also / √(2 n_layers)); embedding keeps 0.02.
    q = model.blocks[0].attn.q_proj.weight
    assert q.std().item() == pytest.approx(0.01, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)

    # Adam's first step moves every entry by lr · sign(g) (eps aside): the step is the group's rate.
    optimizer = mup_optimizer(model, TrainConfig(steps=1, batch_size=4, context_length=16, lr=1e-2,
                                                 weight_decay=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps_of(model, optimizer, steps=1)
    for name, p in model.named_parameters():
        step = (p.detach() - before[name]).abs()
        moved = step[step > 0]
        assert moved.max().item() == pytest.approx(1e-2 * expected_lr[name], rel=1e-3), name


def test_mu_attention_is_q_k_over_d():
    # The μP attention against softmax(q·kᵀ · √d_base / d) v written here.
    model = mup_model(config_at_width(BASE, 128), base_width=32)
    attn = model.blocks[0].attn
    d = attn.q_proj.weight.shape[0] // attn.n_heads
    q, k, v = torch.randn(3, 2, attn.n_heads, 16, d).unbind(0)
    scores = q @ k.transpose(-2, -1) * math.sqrt(8) / d + causal_mask(16)
    torch.testing.assert_close(attn.attend(q, k, v), torch.softmax(scores, -1) @ v, atol=1e-5, rtol=1e-5)


def test_clear_errors():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        config_at_width(BASE, 30)
    with pytest.raises(ValueError, match="dense models"):
        mup_model(dataclasses.replace(BASE, moe_experts=4), 16)
    with pytest.raises(TypeError, match="mup_model"):
        mup_param_groups(TransformerLM(BASE), 1e-3)
    assert isinstance(optimizer_for(TransformerLM(BASE), TrainConfig(steps=1, batch_size=1, context_length=4)),
                      torch.optim.Optimizer)


def test_coordinate_check_flat_under_mup_growing_under_sp():
    data = tokens()
    config = dataclasses.replace(BASE, d_model=16)
    train_config = TrainConfig(steps=1, batch_size=8, context_length=16, lr=1e-2, weight_decay=0.0)
    widths = (16, 32, 64, 128)
    slopes = {}
    for name, base in [("sp", None), ("mup", 16)]:
        def build(width):
            model = build_at_width(config, width, base)
            return model, optimizer_for(model, train_config)
        frame = coordinate_check(build, widths, data, steps=3, batch_size=8, context_length=16, seeds=(0, 1))
        assert set(frame.width) == set(widths) and set(frame.step) == {0, 1, 2, 3}
        slopes[name] = coordinate_slopes(frame)
    hidden = ["attention q", "attention out", "MLP hidden", "MLP out", "residual"]
    for kind in hidden:
        assert abs(slopes["mup"][kind]) < 0.35, (kind, slopes)
        assert slopes["sp"][kind] > slopes["mup"][kind] + 0.3, (kind, slopes)
    assert slopes["mup"]["logits"] < 0.2 and slopes["sp"]["logits"] > 0.4, slopes
    assert max(slopes["sp"].values()) > 1.0, slopes


def test_wsd_branch_equals_uninterrupted_run(tmp_path):
    data = tokens()
    base = TrainConfig(steps=20, batch_size=4, context_length=16, lr=3e-3, warmup_steps=2, weight_decay=0.1,
                       min_lr=3e-4)
    torch.manual_seed(0)
    model = TransformerLM(BASE)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    branches = wsd_branches(model, data, base, decay_starts=[6, 10], decay_steps=4, workdir=tmp_path)
    assert set(branches) == {6, 10}
    for start, history in branches.items():
        whole = dataclasses.replace(base, steps=start + 4, schedule="wsd", decay_fraction=4 / (start + 4))
        fresh = TransformerLM(BASE)
        fresh.load_state_dict(initial)
        direct = train(fresh, data, whole, progress=False)
        assert history.step == direct.step and history.lr == pytest.approx(direct.lr, rel=1e-12)
        assert history.lr[start - 1] == 3e-3 and history.lr[-1] == pytest.approx(3e-4)  # stable, then decayed
        np.testing.assert_allclose(history.loss, direct.loss, rtol=1e-6)
