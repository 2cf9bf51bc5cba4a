"""Learning from preferences: a Bradley-Terry reward model, and DPO against a frozen reference.

Data are triples ``(prompt, chosen, rejected)``: for the same prompt, a person (here: the
generator of :mod:`lmfs.alignment.tasks`) preferred one response over the other.

**Bradley-Terry.** Give every response a scalar score ``r(x, y)`` and model the probability that
``y_c`` is preferred to ``y_r`` as ``sigmoid(r(x, y_c) - r(x, y_r))``. Maximum likelihood is the
logistic loss on the score difference, ``-log sigmoid(r_c - r_r)``. The score comes from a
language model with a linear head on the hidden state of the response's last token
(:class:`RewardModel`); only differences matter, so its scale is free.

**DPO** (Rafailov et al. 2023). RLHF maximises ``E[r(x, y)] - beta * KL(pi || pi_ref)``; its optimum
is ``pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x)``, so any policy defines an *implicit*
reward ``beta * log(pi(y|x) / pi_ref(y|x))`` (up to ``beta log Z(x)``, which cancels in a
difference). Putting it into the Bradley-Terry likelihood gives a loss on the policy itself:

    loss = -log sigmoid(beta * [(log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x))])

with no reward model and no sampling. ``log pi(y|x)`` is the sum of the response tokens'
log-probabilities (:func:`sequence_logprob`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from lmfs.alignment.sft import encode_example, make_run, optimizer_step, pad_batch, response_logprobs, shuffled_batches
from lmfs.data.corpora import EOT


class RewardModel(nn.Module):
    """A scalar score per sequence: ``base_model``'s final hidden state at the last real token,
    through a linear head ``d_model -> 1`` (initialised at zero, so every score starts at 0).

    ``forward(input_ids (B, T), lengths (B,))`` returns scores ``(B,)``; ``lengths[b]`` counts the
    real tokens of row ``b`` (right padding after them cannot change them: attention is causal).
    The base model is used as it is, not copied: pass a copy to keep the original.
    """

    def __init__(self, base_model: nn.Module):
        super().__init__()
        self.body = base_model
        self.head = nn.Linear(base_model.config.d_model, 1, device=next(base_model.parameters()).device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def config(self):
        return self.body.config

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if (lengths < 1).any() or (lengths > input_ids.shape[1]).any():
            raise ValueError(f"lengths must lie in 1..{input_ids.shape[1]} (the real tokens of each row), "
                             f"got {lengths.tolist()}")
        hidden = self.body.hidden(input_ids)                                   # (B, T, d_model)
        last = hidden[torch.arange(len(lengths), device=hidden.device), lengths.to(hidden.device) - 1]
        return self.head(last.float()).squeeze(-1)                             # (B,)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """``-log sigmoid(r_chosen - r_rejected)``, averaged: the negative log-likelihood of the
    observed preferences under the Bradley-Terry model."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def reward_accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> float:
    """The share of pairs whose chosen response scores strictly higher (a tie counts as wrong)."""
    return (r_chosen > r_rejected).float().mean().item()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's loss and the implicit rewards, from summed response log-probs ``(B,)``.

    Returns ``(loss, chosen_rewards, rejected_rewards)``: the mean of
    ``-log sigmoid(chosen_reward - rejected_reward)`` where ``chosen_reward = beta *
    (policy_chosen - ref_chosen)`` (likewise for the rejected); the rewards are detached, for
    logging (their difference is the *margin*).
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0: it weighs the KL to the reference (0.1 is usual)")
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected).mean(), chosen.detach(), rejected.detach()


def sequence_logprob(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi(response | prompt)`` per row ``(B,)``: the sum of the response tokens' log-probs."""
    return response_logprobs(model, input_ids, mask)[0].sum(-1)


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str, str]],
                 context_length: int | None = None) -> list[tuple[tuple, tuple]]:
    """Each ``(prompt, chosen, rejected)`` as two encoded examples (:func:`~lmfs.alignment.sft.encode_example`)."""
    return [(encode_example(tokenizer, p, c, context_length), encode_example(tokenizer, p, r, context_length))
            for p, c, r in pairs]


def _pair_batch(encoded: Sequence[tuple[tuple, tuple]], pad_id: int, device) -> tuple:
    """Chosen rows then rejected rows in one padded batch: ``input_ids (2B, T)``, ``mask``, ``lengths``."""
    rows = [c for c, _ in encoded] + [r for _, r in encoded]
    input_ids, mask = pad_batch(rows, pad_id)
    lengths = torch.tensor([len(ids) for ids, _ in rows])
    return input_ids.to(device), mask.to(device), lengths.to(device)


@torch.no_grad()
def score_pairs(reward_model: RewardModel, tokenizer, pairs: Sequence[tuple[str, str, str]],
                batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward model's scores ``(r_chosen, r_rejected)``, each ``(N,)`` on the CPU, in eval mode."""
    was_training = reward_model.training
    reward_model.eval()
    device = next(reward_model.parameters()).device
    encoded = encode_pairs(tokenizer, pairs, reward_model.config.context_length)
    chosen, rejected = [], []
    for start in range(0, len(encoded), batch_size):
        part = encoded[start:start + batch_size]
        input_ids, _, lengths = _pair_batch(part, tokenizer.special_ids[EOT], device)
        scores = reward_model(input_ids, lengths).float().cpu()
        chosen.append(scores[:len(part)])
        rejected.append(scores[len(part):])
    reward_model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


def train_reward_model(reward_model: RewardModel, pairs: Sequence[tuple[str, str, str]], tokenizer, steps: int,
                       batch_size: int, lr: float = 1e-4, *, val_pairs: Sequence[tuple[str, str, str]] | None = None,
                       eval_every: int = 0, warmup_steps: int = 0, weight_decay: float = 0.0,
                       grad_clip: float = 1.0, seed: int = 0, autocast: str = "auto",
                       progress: bool = True) -> dict[str, list]:
    """Fit ``reward_model`` to the preferences by :func:`bradley_terry_loss` with AdamW.

    Returns a history dict: per step ``step``, ``loss``, ``accuracy`` (on the step's batch);
    per evaluation (every ``eval_every`` steps and at the end, with ``val_pairs``) ``val_step``,
    ``val_loss`` and ``val_accuracy``.
    """
    device = next(reward_model.parameters()).device
    pad = tokenizer.special_ids[EOT]
    encoded = encode_pairs(tokenizer, pairs, reward_model.config.context_length)
    config, optimizer, dtype = make_run(reward_model, steps, batch_size, lr,
                                        context_length=reward_model.config.context_length,
                                        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip,
                                        seed=seed, autocast=autocast)
    history = {k: [] for k in ("step", "loss", "accuracy", "seconds", "val_step", "val_loss", "val_accuracy")}
    reward_model.train()
    started = time.perf_counter()
    batches = shuffled_batches(len(encoded), batch_size, steps, torch.Generator().manual_seed(seed))
    bar = tqdm(enumerate(batches), total=steps, disable=not progress, desc="reward model")
    for step, index in bar:
        input_ids, _, lengths = _pair_batch([encoded[i] for i in index], pad, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            scores = reward_model(input_ids, lengths)
        r_chosen, r_rejected = scores.float().chunk(2)
        loss = bradley_terry_loss(r_chosen, r_rejected)
        loss.backward()
        value = loss.item()
        optimizer_step(reward_model, optimizer, config, step, value)
        history["step"].append(step + 1)
        history["loss"].append(value)
        history["accuracy"].append(reward_accuracy(r_chosen, r_rejected))
        history["seconds"].append(time.perf_counter() - started)
        bar.set_postfix(loss=f"{value:.3f}", refresh=False)
        if val_pairs and (step + 1 == steps or (eval_every and (step + 1) % eval_every == 0)):
            vc, vr = score_pairs(reward_model, tokenizer, val_pairs)
            history["val_step"].append(step + 1)
            history["val_loss"].append(bradley_terry_loss(vc, vr).item())
            history["val_accuracy"].append(reward_accuracy(vc, vr))
    reward_model.eval()
    return history


def _pair_logprobs(model, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs of the chosen and the rejected rows of a :func:`_pair_batch`."""
    input_ids, mask, _ = batch
    return sequence_logprob(model, input_ids, mask).chunk(2)


@torch.no_grad()
def dpo_metrics(policy, reference, tokenizer, pairs: Sequence[tuple[str, str, str]], beta: float,
                batch_size: int = 32) -> dict[str, float]:
    """DPO loss, mean implicit rewards, margin and accuracy (share of positive margins) on ``pairs``."""
    was_training = policy.training
    policy.eval()
    device = next(policy.parameters()).device
    encoded = encode_pairs(tokenizer, pairs, policy.config.context_length)
    parts = []
    for start in range(0, len(encoded), batch_size):
        batch = _pair_batch(encoded[start:start + batch_size], tokenizer.special_ids[EOT], device)
        parts.append(torch.stack([*_pair_logprobs(policy, batch), *_pair_logprobs(reference, batch)]).cpu())
    policy.train(was_training)
    return _dpo_summary(*dpo_loss(*torch.cat(parts, dim=1), beta))


def _dpo_summary(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """The numbers DPO reports: loss, mean implicit rewards, mean margin, share of positive margins."""
    margin = chosen - rejected
    return dict(loss=loss.item(), chosen_reward=chosen.mean().item(), rejected_reward=rejected.mean().item(),
                margin=margin.mean().item(), accuracy=(margin > 0).float().mean().item())


def train_dpo(policy, reference, pairs: Sequence[tuple[str, str, str]], tokenizer, steps: int, batch_size: int,
              beta: float = 0.1, lr: float = 1e-5, *, val_pairs: Sequence[tuple[str, str, str]] | None = None,
              eval_every: int = 0, warmup_steps: int = 0, weight_decay: float = 0.0, grad_clip: float = 1.0,
              seed: int = 0, autocast: str = "auto", progress: bool = True) -> dict[str, list]:
    """Train ``policy`` with :func:`dpo_loss` against ``reference`` (frozen: never updated, run
    without gradients; usually a copy of the SFT model the policy starts from).

    Returns a history dict: per step ``step``, ``loss``, ``chosen_reward``, ``rejected_reward``,
    ``margin`` (their difference) and ``accuracy`` (share of pairs with a positive margin), means
    over the step's batch; per evaluation on ``val_pairs`` the same names prefixed ``val_``.
    """
    if policy is reference:
        raise ValueError("policy and reference are the same model: pass a frozen copy as the reference "
                         "(copy.deepcopy(policy) before training)")
    device = next(policy.parameters()).device
    pad = tokenizer.special_ids[EOT]
    reference.eval().requires_grad_(False)
    encoded = encode_pairs(tokenizer, pairs, policy.config.context_length)
    config, optimizer, dtype = make_run(policy, steps, batch_size, lr, context_length=policy.config.context_length,
                                        warmup_steps=warmup_steps, weight_decay=weight_decay, grad_clip=grad_clip,
                                        seed=seed, autocast=autocast)
    names = ("loss", "chosen_reward", "rejected_reward", "margin", "accuracy")
    history = {"step": [], "seconds": [], **{k: [] for k in names},
               "val_step": [], **{f"val_{k}": [] for k in names}}
    policy.train()
    started = time.perf_counter()
    batches = shuffled_batches(len(encoded), batch_size, steps, torch.Generator().manual_seed(seed))
    bar = tqdm(enumerate(batches), total=steps, disable=not progress, desc="dpo")
    for step, index in bar:
        batch = _pair_batch([encoded[i] for i in index], pad, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            with torch.no_grad():
                ref_chosen, ref_rejected = _pair_logprobs(reference, batch)
            policy_chosen, policy_rejected = _pair_logprobs(policy, batch)
        loss, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
        loss.backward()
        optimizer_step(policy, optimizer, config, step, loss.item())
        values = _dpo_summary(loss, chosen, rejected)
        history["step"].append(step + 1)
        history["seconds"].append(time.perf_counter() - started)
        for k, v in values.items():
            history[k].append(v)
        bar.set_postfix(loss=f"{values['loss']:.3f}", margin=f"{values['margin']:.2f}", refresh=False)
        if val_pairs and (step + 1 == steps or (eval_every and (step + 1) % eval_every == 0)):
            history["val_step"].append(step + 1)
            for k, v in dpo_metrics(policy, reference, tokenizer, val_pairs, beta).items():
                history[f"val_{k}"].append(v)
    policy.eval()
    return history
