"""lmfs.alignment.pg against direct computations: numpy loops, brute-force definitions, closed forms."""

import math

import numpy as np
import pytest
import torch

from lmfs.alignment.pg import (aggregate, clip_fraction, group_advantages, kl_estimate, masked_mean,
                               masked_normalize, pg_loss)


def _group_advantages_loop(rewards, G, normalize_std, eps=1e-6):
    # One group at a time, in float64 numpy: mean and sample std (ddof=1) of the group's rewards.
    out = []
    for start in range(0, len(rewards), G):
        group = np.asarray(rewards[start:start + G], dtype=np.float64)
        for r in group:
            a = r - group.mean()
            out.append(a / (group.std(ddof=1) + eps) if normalize_std else a)
    return np.array(out)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_group_advantages_equal_a_loop(G, normalize_std):
    gen = torch.Generator().manual_seed(G)
    for rewards in (torch.randint(0, 2, (6 * G,), generator=gen).float(),   # binary, as from a verifier
                    torch.randn(6 * G, generator=gen) * 3 + 1):               # continuous
        got = group_advantages(rewards, G, normalize_std=normalize_std)
        want = _group_advantages_loop(rewards.tolist(), G, normalize_std)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
        # Every group's advantages sum to zero: the baseline is the group mean.
        assert torch.allclose(got.view(-1, G).sum(1), torch.zeros(6), atol=1e-4)


def test_group_advantages_all_equal_rewards_are_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    for normalize_std in (True, False):
        adv = group_advantages(rewards, 4, normalize_std=normalize_std)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:8], torch.zeros(8))
        assert (adv[8:] != 0).all()


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(torch.ones(10), 4)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.ones(2, 4), 4)


def _batch(B=5, T=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4   # ratios well beyond 1 +- 0.2
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) < 0.7
    return logp, old, adv, mask


def test_grpo_clip_equals_its_definition_elementwise():
    logp, old, adv, _ = _batch()
    got = pg_loss(logp, adv, "grpo_clip", old_logp=old, clip=0.2)
    B, T = logp.shape
    clipped_any = False
    for i in range(B):
        for t in range(T):
            rho = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i].item()
            want = -min(rho * a, min(max(rho, 0.8), 1.2) * a)
            clipped_any |= (rho > 1.2 and a > 0) or (rho < 0.8 and a < 0)
            assert got[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert clipped_any, "the batch must exercise the clipped branch"


def test_grpo_clip_gradient():
    # On fresh rollouts (ratio 1) the clipped loss has the gradient of the baseline loss; a clipped
    # token has no gradient at all.
    logp, old, adv, mask = _batch()
    x = logp.clone().requires_grad_()
    pg_loss(x, adv, "grpo_clip", old_logp=logp).sum().backward()
    torch.testing.assert_close(x.grad, (-adv[:, None]).expand_as(logp))
    x.grad = None
    pg_loss(x, adv, "grpo_clip", old_logp=old).sum().backward()
    rho = torch.exp(logp - old)
    a = adv[:, None].expand_as(logp)
    clipped = ((rho > 1.2) & (a > 0)) | ((rho < 0.8) & (a < 0))
    torch.testing.assert_close(x.grad, torch.where(clipped, 0.0, -a * rho))
    assert clip_fraction(logp, old, adv, mask).item() == pytest.approx(clipped[mask].double().mean().item())


def test_no_baseline_and_baseline_losses():
    logp, _, _, _ = _batch()
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(pg_loss(logp, rewards, "no_baseline"), -rewards[:, None] * logp)
    torch.testing.assert_close(pg_loss(logp, torch.zeros(5), "no_baseline", raw_rewards=rewards),
                               -rewards[:, None] * logp)
    torch.testing.assert_close(pg_loss(logp, torch.zeros(5), "baseline", raw_rewards=rewards, baseline=0.6),
                               -(rewards[:, None] - 0.6) * logp)
    adv = rewards - rewards.mean()
    torch.testing.assert_close(pg_loss(logp, adv, "baseline"), -adv[:, None] * logp)
    with pytest.raises(ValueError, match="needs old_logp"):
        pg_loss(logp, adv, "grpo_clip")
    with pytest.raises(ValueError, match="kind="):
        pg_loss(logp, adv, "ppo")


def test_raw_rewards_carry_no_gradient():
    """Rewards are constants of the policy gradient: a raw_rewards tensor that requires grad (say, a
    learned reward model's output) gets none from the no-baseline or the baseline loss."""
    logp, _, _, _ = _batch()
    logp = logp.clone().requires_grad_()
    for kind, extra in (("no_baseline", {}), ("baseline", dict(baseline=0.5))):
        rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64, requires_grad=True)
        pg_loss(logp, torch.zeros(5), kind, raw_rewards=rewards, **extra).sum().backward()
        assert rewards.grad is None and logp.grad is not None, kind


def test_masked_mean_and_normalize_against_loops():
    logp, _, _, mask = _batch()
    x = logp.clone()
    x[~mask] = float("nan")                         # padding may hold anything: it must not leak
    rows = [sum(x[i, t].item() for t in range(x.shape[1]) if mask[i, t]) for i in range(len(x))]
    counts = mask.sum(1).tolist()
    want_rows = torch.tensor([r / c if c else 0.0 for r, c in zip(rows, counts)], dtype=torch.float64)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), want_rows)
    assert masked_mean(x, mask).item() == pytest.approx(sum(rows) / sum(counts))
    torch.testing.assert_close(masked_normalize(x, mask, 10.0, dim=1),
                               torch.tensor(rows, dtype=torch.float64) / 10)
    assert masked_normalize(x, mask, 4.0).item() == pytest.approx(sum(rows) / 4)
    with pytest.raises(ValueError, match="positive"):
        masked_normalize(x, mask, 0.0)


def test_aggregations_against_formulas():
    logp, _, adv, mask = _batch()
    mask[0, :3] = True                              # no empty row here
    per_token = pg_loss(logp, adv, "baseline")
    L = mask.sum(1).double()
    sums = torch.where(mask, per_token, 0.0).sum(1)
    B, T = per_token.shape
    assert aggregate(per_token, mask, "sequence_mean").item() == pytest.approx((sums / L).mean().item())
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx((sums.sum() / L.sum()).item())
    assert aggregate(per_token, mask, "constant").item() == pytest.approx((sums.sum() / (B * T)).item())
    assert aggregate(per_token, mask, "constant", constant=50).item() == pytest.approx((sums.sum() / (B * 50)).item())
    # The length bias in the gradient: d loss / d logp_it = -A_i / (B L_i) under sequence_mean,
    # -A_i / (B C) under the constant normaliser.
    for how, weight in (("sequence_mean", -adv / (B * L)), ("constant", -adv / (B * T))):
        x = logp.clone().requires_grad_()
        aggregate(pg_loss(x, adv, "baseline"), mask, how).backward()
        torch.testing.assert_close(x.grad, torch.where(mask, weight[:, None], 0.0))
    with pytest.raises(ValueError, match="how="):
        aggregate(per_token, mask, "mean")
    with pytest.raises(ValueError, match="same shape"):
        aggregate(per_token, mask[:, :-1], "token_mean")


@pytest.mark.parametrize("how", ["sequence_mean", "token_mean", "constant"])
def test_empty_response_contributes_nothing(how):
    logp, old, adv, mask = _batch()
    mask[:, 0] = True
    mask[2] = False                                 # response 2 has no tokens
    x = logp.clone().requires_grad_()
    loss = aggregate(pg_loss(x, adv, "grpo_clip", old_logp=old), mask, how)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[2], torch.zeros_like(x.grad[2]))
    if how != "constant":                          # the constant normaliser counts every rollout in B
        keep = torch.tensor([0, 1, 3, 4])
        alone = aggregate(pg_loss(logp[keep], adv[keep], "grpo_clip", old_logp=old[keep]), mask[keep], how)
        assert loss.item() == pytest.approx(alone.item())
    # A batch of nothing but empty responses: a zero loss that still backpropagates.
    x.grad = None
    empty = aggregate(pg_loss(x, adv, "baseline"), torch.zeros_like(mask), how)
    empty.backward()
    assert empty.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x))


def test_kl_estimators_against_closed_form():
    # A small vocabulary: the exact KL(pi || ref) = sum_v pi_v (log pi_v - log ref_v) against the
    # Monte-Carlo mean of each estimator over tokens sampled from pi.
    gen = torch.Generator().manual_seed(0)
    V, n = 12, 400_000
    for scale in (0.3, 1.0):                        # close policies and far ones
        logits = torch.randn(V, generator=gen, dtype=torch.float64)
        logp_all = torch.log_softmax(logits, -1)
        ref_all = torch.log_softmax(logits + scale * torch.randn(V, generator=gen, dtype=torch.float64), -1)
        exact = (logp_all.exp() * (logp_all - ref_all)).sum().item()
        tokens = torch.multinomial(logp_all.exp(), n, replacement=True, generator=gen)
        k = {kind: kl_estimate(logp_all[tokens], ref_all[tokens], kind) for kind in ("k1", "k2", "k3")}
        for kind in ("k1", "k3"):                   # the unbiased ones: within 5 standard errors
            stderr = k[kind].std().item() / math.sqrt(n)
            assert abs(k[kind].mean().item() - exact) < 5 * stderr, (scale, kind, k[kind].mean().item(), exact)
        assert (k["k3"] >= 0).all() and (k["k2"] >= 0).all()
        assert (k["k1"] < 0).any(), "k1 is negative on some samples"
        # k2's expectation in closed form: sum_v pi_v (log pi_v - log ref_v)^2 / 2 — biased, not the KL.
        k2_expected = (logp_all.exp() * 0.5 * (logp_all - ref_all) ** 2).sum().item()
        assert k["k2"].mean().item() == pytest.approx(k2_expected, rel=0.02)
        if scale < 0.5:                             # close policies: k3 has the lower variance
            assert k["k3"].var() < k["k1"].var()
    with pytest.raises(ValueError, match="kind="):
        kl_estimate(logp_all, ref_all, "k4")


def test_exercise_checkers_accept_right_and_reject_wrong_answers():
    from lmfs.exercises.lecture16 import check_grpo_clip_loss, check_group_advantages, check_kl_k3

    assert check_group_advantages(lambda r, G, norm: group_advantages(r, G, normalize_std=norm)) == 6
    with pytest.raises(AssertionError, match="group_advantages: wrong result"):   # population std (ddof 0)
        check_group_advantages(lambda r, G, norm: (lambda g: ((g - g.mean(1, keepdim=True)) /
                               (g.std(1, unbiased=False, keepdim=True) + 1e-6) if norm else
                               g - g.mean(1, keepdim=True)).view(-1))(r.view(-1, G)))
    with pytest.raises(AssertionError, match="group_advantages: wrong result"):   # batch mean, not group mean
        check_group_advantages(lambda r, G, norm: r - r.mean())

    assert check_grpo_clip_loss(lambda lp, old, a, c: pg_loss(lp, a, "grpo_clip", old_logp=old, clip=c)) == 4
    with pytest.raises(AssertionError, match="grpo_clip_loss: wrong result"):     # max instead of min
        check_grpo_clip_loss(lambda lp, old, a, c: -torch.maximum(torch.exp(lp - old) * a[:, None],
                             torch.exp(lp - old).clamp(1 - c, 1 + c) * a[:, None]))
    with pytest.raises(AssertionError, match="grpo_clip_loss: wrong result"):     # ratio the wrong way up
        check_grpo_clip_loss(lambda lp, old, a, c: pg_loss(old, a, "grpo_clip", old_logp=lp, clip=c))

    assert check_kl_k3(lambda lp, ref: kl_estimate(lp, ref, "k3")) == 4
    with pytest.raises(AssertionError, match="kl_k3: wrong result"):              # k1
        check_kl_k3(lambda lp, ref: kl_estimate(lp, ref, "k1"))
    with pytest.raises(AssertionError, match="kl_k3: wrong result"):              # r the wrong way up
        check_kl_k3(lambda lp, ref: kl_estimate(ref, lp, "k3"))
