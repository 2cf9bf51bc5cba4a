"""Speculative decoding: a small draft model proposes, the target model verifies, nothing is lost.

Decoding one token costs the target model a full read of its weights, however few tokens it
processes; checking ``k`` proposed tokens in one forward costs about the same as generating one.
So a cheap draft model guesses ``k`` tokens ahead, and the target scores all of them in one call.
The verification (Leviathan et al. 2023, Chen et al. 2023) keeps the output distributed *exactly*
as if the target had sampled alone:

1. the draft samples ``x_1 .. x_k`` one at a time, ``x_i ~ q_i`` (its distribution at step ``i``);
2. the target runs once on the pending tokens and the ``k`` drafts, giving ``p_1 .. p_{k+1}``;
3. for ``i = 1 .. k``: accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
   rejection emit a token from the residual ``norm(max(0, p_i − q_i))`` instead and stop;
4. if all ``k`` were accepted, emit one more token from ``p_{k+1}`` (free: the target computed it).

Why the emitted token at a step has distribution ``p`` (:func:`speculative_step_distribution` does the
sum): it is ``x`` accepted with probability ``q(x) · min(1, p(x)/q(x)) = min(p(x), q(x))``, plus the
rejection mass ``1 − Σ min(p, q)`` times the residual ``max(0, p − q) / Σ max(0, p − q)``; since
``Σ max(0, p − q) = 1 − Σ min(p, q)`` the two add up to ``min(p, q) + max(0, p − q) = p``. A step
accepts on average ``Σ min(p, q) = 1 − TV(p, q)`` (:func:`acceptance_probability`), so every
target call yields between 1 and ``k + 1`` tokens. Greedy decoding is the special case of one-hot
``p`` and ``q``: a draft is accepted exactly when it is the target's argmax, and the output equals the
target's own greedy decoding token for token.

Both models keep a :class:`~lmfs.inference.KVCache`; after a rejection each cache is cut back
(:meth:`~lmfs.inference.KVCache.truncate`) to the tokens actually kept. This implementation
decodes one sequence (batch size 1): in a batch, rows accept different numbers of tokens and the
caches would need per-row lengths.
"""

from __future__ import annotations

import torch

from lmfs.inference.kv_cache import KVCache
from lmfs.inference.runner import forward_cached
from lmfs.inference.sampling import SamplingParams, process_logits


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that a draft ``x ~ q`` is accepted against the target ``p``: ``Σ min(p, q)``
    over the last dimension (``1 −`` their total-variation distance). ``p``, ``q``: (..., V)."""
    return torch.minimum(p, q).sum(dim=-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p − q))`` over the last dimension: where rejected tokens are drawn from.

    When ``p == q`` there is no residual mass, but then no draft is ever rejected either; ``p`` is
    returned for such rows so that the result is always a distribution."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p)


def speculative_step(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify draft tokens: ``p``, ``q`` (N, V) target and draft distributions, ``x`` (N,) tokens drawn
    from ``q``. Returns ``(accepted, token)``, both (N,): ``accepted[n]`` with probability
    ``min(1, p(x)/q(x))``, and ``token[n]`` = ``x[n]`` if accepted, else a draw from
    :func:`residual_distribution`. Each row's ``token`` is distributed as ``p`` (rows independent)."""
    px = p.gather(-1, x[:, None]).squeeze(-1)
    qx = q.gather(-1, x[:, None]).squeeze(-1)
    u = torch.rand(px.shape, generator=generator, device=p.device, dtype=px.dtype)
    accepted = u * qx < px  # u < p(x)/q(x) without dividing; q(x) > 0 since x was drawn from q
    resampled = torch.multinomial(residual_distribution(p, q), 1, generator=generator).squeeze(-1)
    return accepted, torch.where(accepted, x, resampled)


def speculative_step_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact distribution (..., V) of the token one :func:`speculative_step` emits, summed term
    by term: accepted drafts ``q(y)·min(1, p(y)/q(y))`` plus rejected mass times the residual. It
    equals ``p`` (the module docstring's argument); a test or a lecture can check that it does."""
    accepted = q * torch.where(q > 0, (p / q.clamp(min=torch.finfo(q.dtype).tiny)).clamp(max=1), 0)
    rejected = 1 - accepted.sum(dim=-1, keepdim=True)
    return accepted + rejected * residual_distribution(p, q)


def _distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 probabilities (N, V) that ``params`` samples from, given logits (N, V): temperature,
    top-k and top-p as in :func:`lmfs.inference.sampling.process_logits`; greedy is one-hot."""
    logits = process_logits(logits, [params] * logits.shape[0])
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.softmax(logits, dim=-1)


def _check(target, draft, idx: torch.Tensor, max_new_tokens: int, k: int) -> None:
    if idx.dim() != 2 or idx.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one sequence: idx must be (1, T), got {tuple(idx.shape)}; "
                         "call it once per prompt")
    if idx.shape[1] == 0:
        raise ValueError("speculative_generate: the prompt is empty; give at least one token (e.g. a BOS id)")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"speculative_generate: k (draft tokens per step) must be an int >= 1, got {k!r}")
    if max_new_tokens < 0:
        raise ValueError(f"speculative_generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"speculative_generate: the draft's vocabulary ({draft.config.vocab_size} tokens) differs "
                         f"from the target's ({target.config.vocab_size}); both models must share one tokenizer")
    total = idx.shape[1] + max_new_tokens
    for name, model in (("target", target), ("draft", draft)):
        if total > model.config.context_length:
            raise ValueError(f"speculative_generate: prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) = "
                             f"{total} tokens exceed the {name}'s context_length {model.config.context_length}")


@torch.no_grad()
def speculative_generate(target, draft, idx: torch.Tensor, max_new_tokens: int, k: int = 4,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Extend ``idx`` (1, T) by ``max_new_tokens`` tokens distributed as the ``target``'s samples,
    with ``draft`` proposing ``k`` tokens per target call. Returns ``(ids, stats)``: ``ids``
    (1, T + max_new_tokens), and ``stats`` with ``proposed`` and ``accepted`` draft tokens,
    ``acceptance_rate``, ``target_calls``, ``draft_calls`` and ``tokens_per_target_call``.

    ``temperature`` (0: greedy), ``top_k`` and ``top_p`` shape both models' distributions alike
    (the guarantee is about the target's distribution *after* them). ``generator`` seeds every
    draw. Both models need the same vocabulary and a context of at least ``T + max_new_tokens``;
    put them in eval mode first. Batch size 1 only (see the module docstring).
    """
    _check(target, draft, idx, max_new_tokens, k)
    params = SamplingParams(max_tokens=max(max_new_tokens, 1), temperature=temperature, top_k=top_k,
                            top_p=1.0 if top_p is None else top_p)
    total = idx.shape[1] + max_new_tokens
    target_cache = KVCache.for_model(target, batch_size=1, max_len=total)
    draft_cache = KVCache.for_model(draft, batch_size=1, max_len=total)
    stats = dict(proposed=0, accepted=0, target_calls=0, draft_calls=0)
    ids = idx
    while ids.shape[1] < total:
        # Never propose past the end: the k' drafts plus the target's own token make at most k' + 1.
        n_draft = min(k, total - ids.shape[1] - 1)
        # 1. Draft: first catch up on the tokens its cache lacks (the prompt, or the last step's
        #    last one or two), then one token per call.
        drafts, q = [], []
        new = ids[:, draft_cache.length:]
        for _ in range(n_draft):
            q.append(_distribution(forward_cached(draft, new, draft_cache)[:, -1], params))
            new = torch.multinomial(q[-1], 1, generator=generator)  # (1, 1)
            drafts.append(new)
            stats["draft_calls"] += 1
        # 2. Target: the tokens it lacks and all drafts in one call; p_1 .. p_{n_draft + 1}.
        logits = forward_cached(target, torch.cat([ids[:, target_cache.length:], *drafts], dim=1), target_cache)
        p = _distribution(logits[0, -(n_draft + 1):], params)  # (n_draft + 1, V)
        stats["target_calls"] += 1
        # 3. Verify all drafts at once; only those before the first rejection count.
        if n_draft:
            x = torch.cat(drafts, dim=1)[0]  # (n_draft,)
            accepted, token = speculative_step(p[:n_draft], torch.cat(q), x, generator)
            n_ok = int(accepted.long().cumprod(dim=0).sum())
        else:
            x, n_ok = ids.new_empty(0), 0
        # 4. The step's own token: the residual draw at the first rejection, or the bonus from p.
        if n_ok < n_draft:
            last = token[n_ok:n_ok + 1]
        else:
            last = torch.multinomial(p[n_draft:], 1, generator=generator)[0]
        ids = torch.cat([ids, x[:n_ok][None], last[None]], dim=1)
        stats["proposed"] += n_draft
        stats["accepted"] += n_ok
        # Both caches keep only kept tokens; the last emitted token is fed at the next step.
        target_cache.truncate(ids.shape[1] - 1)
        draft_cache.truncate(min(draft_cache.length, ids.shape[1] - 1))
    stats["acceptance_rate"] = stats["accepted"] / max(stats["proposed"], 1)
    stats["tokens_per_target_call"] = max_new_tokens / max(stats["target_calls"], 1)
    return ids, stats


__all__ = ["speculative_generate", "speculative_step", "speculative_step_distribution", "acceptance_probability",
           "residual_distribution"]
