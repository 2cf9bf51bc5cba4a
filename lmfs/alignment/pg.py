"""Policy gradients for language models: advantages, per-token losses, masks, aggregation, KL.

Pure tensor functions (no model, no sampling) that the GRPO loop of lecture 16 and the trainer of
lecture 17 (:mod:`lmfs.alignment.grpo`) are assembled from. Shapes used throughout:

* ``N`` rollouts, grouped consecutively: rollouts ``g*G .. g*G+G-1`` answer the same prompt
  (``G`` = ``group_size``);
* ``(B, T)`` per-token tensors over a padded batch of responses: ``logp[i, t]`` is the policy's
  log-probability of response ``i``'s token ``t``; ``mask[i, t]`` is True on real response tokens
  and False on padding (and on prompt tokens, if the tensor covers them).

The pieces, in the order one RL step uses them::

    adv = group_advantages(rewards, G)                         # (N,)   GRPO's group z-score
    per_token = pg_loss(logp, adv, "grpo_clip", old_logp=old)  # (B, T) clipped surrogate
    per_token = per_token + beta * kl_estimate(logp, ref_logp, "k3")   # optional KL penalty
    loss = aggregate(per_token, mask, "sequence_mean")         # scalar to backpropagate

Every function is safe on the degenerate inputs RL produces: groups whose rewards are all equal
(zero advantage, no division by a zero std) and responses without tokens (no contribution, no NaN).
"""

from __future__ import annotations

import torch

PG_LOSSES = ("no_baseline", "baseline", "grpo_clip")
AGGREGATIONS = ("sequence_mean", "token_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``N`` rollouts from their group's statistics (GRPO, Shao et al. 2024).

    ``rewards``: ``(N,)``, grouped consecutively in groups of ``group_size`` (the ``G`` samples of one
    prompt). Returns ``(N,)``::

        A_i = r_i - mean(group)                              normalize_std=False (Dr. GRPO)
        A_i = (r_i - mean(group)) / (std(group) + eps)       normalize_std=True  (GRPO)

    The group mean is a baseline that costs nothing: no value model, and it adapts to each prompt's
    difficulty. ``std`` is the sample standard deviation (Bessel's ``G - 1``). A group whose rewards
    are all equal gets zero advantages (nothing to learn from it), never NaN. Dividing by the std
    rescales each prompt's signal to unit size, which up-weights prompts that are almost always
    right or almost always wrong (small std): Dr. GRPO's "question-level difficulty bias".

        >>> group_advantages(torch.tensor([1., 0., 0., 0.]), 2, normalize_std=False)
        tensor([ 0.5000, -0.5000,  0.0000,  0.0000])
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}: flatten the groups")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 samples for its mean to be a "
                         "baseline (with 1 every advantage is 0); sample G >= 2 responses per prompt")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}: pass "
                         f"prompts x group_size rewards, grouped consecutively")
    groups = rewards.float().view(-1, group_size)                   # (N/G, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)  # all-equal group: 0 / eps = 0
    return centred.view(-1)


def pg_loss(logp: torch.Tensor, advantages: torch.Tensor, kind: str = "grpo_clip",
            old_logp: torch.Tensor | None = None, clip: float = 0.2, raw_rewards: torch.Tensor | None = None,
            baseline: torch.Tensor | float | None = None) -> torch.Tensor:
    """Per-token policy-gradient losses ``(B, T)``: minimising them ascends the expected reward.

    ``logp``: ``(B, T)`` log-probabilities of the sampled tokens under the policy being trained (with
    gradient); ``advantages``: ``(B,)`` one per response (broadcast over its tokens) or ``(B, T)``.

    * ``"no_baseline"`` (REINFORCE): ``-R_i * logp[i, t]`` with ``R`` = ``raw_rewards`` (or, when
      that is None, ``advantages`` taken as the raw rewards). Unbiased but high variance: every
      sample pushes its tokens up by its whole reward, even when all rewards are equal.
    * ``"baseline"``: ``-(R_i - b) * logp[i, t]``: ``advantages`` as given, or ``raw_rewards -
      baseline`` when ``baseline`` is given. A baseline ``b`` that does not depend on the sampled
      response leaves the expected gradient unchanged (``E[grad log pi] = 0``) and can cut the variance.
    * ``"grpo_clip"`` (PPO's clipped surrogate, as GRPO uses it): with the probability ratio
      ``rho = exp(logp - old_logp)`` to the policy that sampled the rollouts,
      ``-min(rho * A, clamp(rho, 1 - clip, 1 + clip) * A)``. At ``rho = 1`` (the first pass over fresh
      rollouts) its gradient equals ``"baseline"``'s; on later passes over the same rollouts the
      ``min`` stops the gradient once the ratio has moved past ``1 ± clip`` in the direction the
      advantage favours, which keeps the update near the sampling policy.

    ``old_logp`` ``(B, T)``, ``advantages``, ``raw_rewards`` and ``baseline`` are treated as constants
    (detached): the gradient flows through ``logp`` only. Mask the result with
    :func:`aggregate`; padding positions hold meaningless values.
    """
    if kind not in PG_LOSSES:
        raise ValueError(f"kind={kind!r}: use one of {PG_LOSSES}")
    if advantages.dim() == 1:
        advantages = advantages[:, None]                            # (B, 1): one value per response
    if advantages.shape[0] != logp.shape[0]:
        raise ValueError(f"advantages {tuple(advantages.shape)} and logp {tuple(logp.shape)} disagree on B")
    advantages = advantages.to(logp.dtype).detach()
    if kind == "no_baseline":
        rewards = advantages if raw_rewards is None else raw_rewards.detach().reshape(len(logp), -1).to(logp.dtype)
        return -rewards * logp
    if kind == "baseline":
        if baseline is not None:
            if raw_rewards is None:
                raise ValueError("kind='baseline' with a baseline needs raw_rewards (the advantage is R - b)")
            advantages = (raw_rewards.detach().reshape(len(logp), -1) - baseline).to(logp.dtype).detach()
        return -advantages * logp
    if old_logp is None:
        raise ValueError("kind='grpo_clip' needs old_logp: the log-probs of the policy that sampled the "
                         "rollouts (computed once, without gradient, before the first update)")
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantages
    return -torch.minimum(unclipped, clipped)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is True, over ``dim`` (None: all of them).

    ``x`` and ``mask`` have the same shape (``mask`` bool or 0/1). Where no position is True the mean
    is 0, not NaN, and values under False positions (even inf or NaN) never leak into the result.
    """
    mask = mask.bool()
    masked = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return masked.sum() / mask.sum().clamp(min=1)
    return masked.sum(dim) / mask.sum(dim).clamp(min=1)


def masked_normalize(x: torch.Tensor, mask: torch.Tensor, constant: float,
                     dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is True, over ``dim`` (None: all), divided by a fixed ``constant``.

    Dr. GRPO's replacement for the per-response mean: dividing every response by the same number
    (e.g. the maximum generation length) instead of its own length keeps the gradient an unbiased
    policy gradient, up to a fixed scale.
    """
    if constant <= 0:
        raise ValueError(f"constant={constant} must be positive (e.g. the maximum response length)")
    mask = mask.bool()
    masked = torch.where(mask, x, torch.zeros_like(x))
    return (masked.sum() if dim is None else masked.sum(dim)) / constant


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str = "sequence_mean",
              constant: float | None = None) -> torch.Tensor:
    """Reduce per-token losses ``(B, T)`` over the response tokens (``mask`` ``(B, T)``) to a scalar.

    With ``L_i`` tokens in response ``i`` (``L_i = mask[i].sum()``), ``l_it`` its per-token losses:

    * ``"sequence_mean"`` (GRPO): ``mean_i (1/L_i) sum_t l_it`` over the responses with ``L_i > 0``.
      Each response weighs the same whatever its length, so each token of a long response weighs
      less: a long wrong answer is pushed down less per token than a short one (Dr. GRPO's
      "response-level length bias").
    * ``"token_mean"`` (DAPO): ``sum_it l_it / sum_i L_i``: every token weighs the same; the scale
      still depends on the batch's total length.
    * ``"constant"`` (Dr. GRPO): ``sum_it l_it / (B * constant)``, ``constant`` defaulting to ``T``
      (the padded length, normally the generation limit): a fixed normaliser, so the gradient is the
      plain policy gradient, unbiased in length.

    A response without tokens (mask all False) contributes nothing, and an all-empty batch gives 0.
    """
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token {tuple(per_token.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if how == "sequence_mean":
        per_response = masked_mean(per_token, mask, dim=-1)            # (B,), 0 for empty responses
        return masked_mean(per_response, mask.bool().any(dim=-1))
    if how == "token_mean":
        return masked_mean(per_token, mask)
    if how == "constant":
        constant = per_token.shape[-1] if constant is None else constant
        return masked_normalize(per_token, mask, constant, dim=-1).mean()
    raise ValueError(f"how={how!r}: use one of {AGGREGATIONS}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from tokens sampled by the policy.

    ``logp``, ``ref_logp``: ``(..., T)`` log-probabilities of the *sampled* tokens under the policy and
    the frozen reference. Computing the exact KL needs both full distributions over the vocabulary at
    every position; these estimators need only the sampled token's two log-probs. With
    ``log_r = ref_logp - logp`` (``r = pi_ref / pi``, so ``E_pi[r] = 1``), after J. Schulman,
    "Approximating KL Divergence" (2020):

    * ``"k1"``: ``-log_r``. Unbiased; high variance, and negative on many samples although the
      KL is never negative.
    * ``"k2"``: ``log_r**2 / 2``. Never negative, low variance; biased (it estimates a different
      f-divergence, close to the KL only when the two policies are close).
    * ``"k3"``: ``(r - 1) - log_r``. Unbiased (the added ``r - 1`` has mean 0), never negative
      (``x - 1 >= log x``), and of lower variance than ``k1`` when the policies are close. The
      estimator GRPO adds to its loss.

    The per-token values are summed or averaged over a response with :func:`aggregate` like the
    policy-gradient loss.
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r ** 2
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kind={kind!r}: use one of {KL_ESTIMATORS}")


def clip_fraction(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  clip: float = 0.2) -> torch.Tensor:
    """Share of response tokens whose ``grpo_clip`` loss is clipped (zero gradient): a scalar.

    A token is clipped when its ratio ``rho = exp(logp - old_logp)`` has left ``[1 - clip, 1 + clip]``
    in the direction its advantage pushes (``rho > 1 + clip`` with ``A > 0``, ``rho < 1 - clip`` with
    ``A < 0``). Zero on the first pass over fresh rollouts; it grows with more passes over the same
    batch, and a large value says the policy has moved far from the one that sampled it.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp).detach()
    clipped = ((ratio > 1 + clip) & (advantages > 0)) | ((ratio < 1 - clip) & (advantages < 0))
    return masked_mean(clipped.float(), mask)
