"""Speculative decoding: a small draft model proposes, the target model verifies, nothing is lost.

Decoding one token costs the target model a full read of its weights, however few tokens it
processes; checking ``k`` proposed tokens in one forward costs about the same as generating one.
So a cheap draft model guesses ``k`` tokens ahead, and the target scores all of them in one call.
The verification (Leviathan et al. 2023, Chen et al. 2023) keeps the output distributed *exactly*
as if the target had sampled alone:

1. the draft samples ``x_1 .. x_k`` one at a time, ``x_i ~ q_i`` (its distribution at step ``i``);
2. the target runs once on the pending token and the ``k`` drafts, giving ``p_1 .. p_{k+1}``;
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

**Making it fast.** The draft is worth its cost only if a draft step is much cheaper than a target
step. For small models on a GPU the time of a step is mostly the launching of its few hundred small
kernels, not their work, so :class:`SpeculativeDecoder` runs a whole round (``k`` draft steps, the
target's verification, the acceptance rule, the bookkeeping) as one CUDA graph replay, with no
host sync inside it:

* both models keep their keys and values in a :class:`~lmfs.inference.PagedKVCache` and run
  through :func:`~lmfs.inference.paged_forward`. Verifying the pending token and ``k`` drafts is
  one call on ``k + 1`` rows at positions ``p .. p + k``: all their keys are written first, then each
  row attends to the positions up to its own, which is exactly the causal forward;
* the sequence, the position ``p`` of the pending token and the random numbers of a round (drawn
  beforehand from the caller's generator) live in device tensors; the round reads and advances
  them there. Rejected drafts need no clean-up: their cache entries lie past the new ``p`` and are
  never attended to before the next round overwrites them;
* a round has fixed shapes (``k`` is fixed), so it is captured once and replayed. The host reads
  the position back only when the sequence could be complete: after ``ceil(remaining / (k + 1))``
  rounds, the fewest that could produce the remaining tokens.

Plain decoding of the target is the same machinery with no draft and ``k = 0`` (one target step
and one draw per round): the baseline a speed-up is measured against. On the CPU the same rounds
run eagerly. This implementation decodes one sequence (batch size 1): in a batch, rows accept
different numbers of tokens.
"""

from __future__ import annotations

import math

import torch

from lmfs.inference.kv_cache import PagedKVCache
from lmfs.batching import PagedBatch, capture_graph
from lmfs.inference.runner import paged_forward
from lmfs.inference.sampling import SamplingParams, sample_scaled
from lmfs.nn.generate import top_k_filter, top_p_filter


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


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (N, V), by inverse-CDF sampling with ``uniforms`` (N,) in [0, 1)."""
    return sample_scaled(probs.log(), None, uniforms)[0]


def speculative_step(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, generator: torch.Generator | None = None,
                     uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify draft tokens: ``p``, ``q`` (N, V) target and draft distributions, ``x`` (N,) tokens drawn
    from ``q``. Returns ``(accepted, token)``, both (N,): ``accepted[n]`` with probability
    ``min(1, p(x)/q(x))``, and ``token[n]`` = ``x[n]`` if accepted, else a draw from
    :func:`residual_distribution`. Each row's ``token`` is distributed as ``p`` (rows independent).

    The random numbers: ``uniforms`` (2, N) in [0, 1) (row 0 decides acceptance, row 1 draws from
    the residual), or, if None, drawn with ``generator``. Only tensor operations, no host sync."""
    if uniforms is None:
        uniforms = torch.rand(2, x.shape[0], generator=generator, device=p.device, dtype=p.dtype)
    px = p.gather(-1, x[:, None]).squeeze(-1)
    qx = q.gather(-1, x[:, None]).squeeze(-1)
    accepted = uniforms[0] * qx < px  # u < p(x)/q(x) without dividing; q(x) > 0 since x was drawn from q
    resampled = _draw(residual_distribution(p, q), uniforms[1].to(p.dtype))
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
    top-k and top-p in the order of :func:`lmfs.inference.sampling.process_logits`; greedy is
    one-hot. Tensor operations only (capturable in a CUDA graph)."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k is not None:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    return torch.softmax(logits, dim=-1)


class SpeculativeDecoder:
    """Speculative decoding of one sequence at a time, one CUDA graph replay per round on a GPU
    (the module docstring). Build it once and call :meth:`generate` for each prompt: the caches and
    the captured round are reused.

    ``target``, ``draft``: :class:`~lmfs.nn.TransformerLM` models in eval mode, on one device, with
    one vocabulary; ``draft=None`` and ``k=0`` decode the target alone (the baseline).
    ``k``: drafts per round; ``max_len``: the longest prompt + new tokens to serve (default: the
    smaller context length); ``temperature`` (0: greedy), ``top_k``, ``top_p``: shape both models'
    distributions alike (exactness is about the target's distribution *after* them);
    ``cuda_graphs``: ``"auto"`` (on for CUDA models without MoE, whose routing syncs with the
    host), True or False. The captured round keeps the addresses of the weights: build a new
    decoder after moving the models or changing their dtype.
    """

    def __init__(self, target, draft=None, k: int = 4, max_len: int | None = None, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, cuda_graphs="auto"):
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=1.0 if top_p is None else top_p)
        if not isinstance(k, int) or k < (0 if draft is None else 1) or (draft is None and k):
            raise ValueError(f"k={k!r}: the number of draft tokens per round must be an int >= 1 with a draft, "
                             "and 0 without one (plain decoding)")
        models = {"target": target} if draft is None else {"target": target, "draft": draft}
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                             f"({target.config.vocab_size}); both models must share one tokenizer")
        self.max_len = max_len or min(m.config.context_length for m in models.values())
        for name, model in models.items():
            if self.max_len > model.config.context_length:
                raise ValueError(f"max_len={self.max_len} exceeds the {name}'s context_length "
                                 f"{model.config.context_length}")
        self.target, self.draft, self.k = target, draft, k
        self.device = next(target.parameters()).device
        # A round starts with its pending token at most at position max_len - 2 and writes up to
        # k + 1 positions further (the rounds the host runs without reading are all needed).
        n = self.max_len + k + 1
        self.caches = {name: PagedKVCache.for_model(m, n) for name, m in models.items()}
        self.tokens = torch.zeros(n, dtype=torch.long, device=self.device)   # the sequence, drafts included
        self.pos = torch.zeros((), dtype=torch.long, device=self.device)     # position of the pending token
        self.rejections = torch.zeros((), dtype=torch.long, device=self.device)   # rounds ending in one
        self.uniforms = torch.zeros(3 * k + 1, device=self.device)           # a round's random numbers
        self.key_positions = torch.arange(n, device=self.device)
        self.offsets = torch.arange(k + 1, device=self.device)
        if cuda_graphs not in ("auto", True, False):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: use 'auto', True or False")
        capturable = self.device.type == "cuda" and all(m.config.moe_experts == 0 for m in models.values())
        if cuda_graphs is True and not capturable:
            raise ValueError("cuda_graphs=True needs models on a CUDA device without MoE; use cuda_graphs='auto'")
        self.cuda_graphs = cuda_graphs is not False and capturable
        self.graph = None

    def _forward(self, role: str, positions: torch.Tensor) -> torch.Tensor:
        """Logits (N, V) of the tokens at ``positions`` (N,) of the sequence, for the model ``role``:
        their keys and values are written into its cache first, then each attends to every position
        up to its own (and within the window, if any).

        One sequence owns the whole cache: position ``i`` lives in slot ``block_size + i`` (block 0 is
        the cache's scratch block), and every slot is a key, masked by position, so the shapes do not
        change from call to call. Positions past the context (only in rows whose tokens a round
        throws away) are clamped for the position embedding."""
        model, cache = (self.target, self.caches["target"]) if role == "target" else (self.draft, self.caches["draft"])
        cfg = model.config
        keys = self.key_positions
        allowed = keys[None, :] <= positions[:, None]
        if cfg.window is not None:
            allowed &= (positions[:, None] - keys[None, :]) < cfg.window
        last = cfg.context_length - 1
        batch = PagedBatch(self.tokens[positions], positions.clamp(max=last), cache.block_size + positions,
                           key_slots=cache.block_size + keys, key_positions=keys.clamp(max=last), allowed=allowed)
        return paged_forward(model, cache, batch)

    def decode_round(self) -> None:
        """One round on the device, no host sync: ``k`` draft steps, the target's verification of the
        pending token and the drafts, the acceptance rule, and the accepted tokens plus one more
        written after the pending one; the position advances past them. Random numbers come from
        ``self.uniforms``: ``k`` draft draws, ``k`` acceptance tests, ``k`` residual draws, one bonus."""
        p, k, u, params = self.pos, self.k, self.uniforms, self.params
        if k:
            # The first draft step also re-feeds the token before the pending one: after a round that
            # accepted every draft, the draft model has not seen its own last draft yet (feeding a
            # token it has seen again rewrites the same keys).
            rows, q = torch.stack([(p - 1).clamp(min=0), p]), []
            for i in range(k):
                q.append(_distribution(self._forward("draft", rows)[-1:], params))
                rows = (p + i + 1).view(1)
                self.tokens.index_copy_(0, rows, _draw(q[-1], u[i:i + 1]))
        probs = _distribution(self._forward("target", p + self.offsets), params)  # (k + 1, V): p_1 .. p_{k+1}
        bonus = _draw(probs[k:], u[3 * k:])                                       # from p_{k+1}
        if k:
            drafts = self.tokens[p + 1 + self.offsets[:k]]
            accepted, token = speculative_step(probs[:k], torch.cat(q), drafts, uniforms=u[k:3 * k].view(2, k))
            n = accepted.long().cumprod(dim=0).sum()            # drafts accepted before the first rejection
            self.rejections += n < k
            # the residual draw at the first rejection, or the bonus token if every draft was accepted
            last = torch.cat([token, bonus]).gather(0, n.view(1))
        else:
            n, last = torch.zeros_like(p), bonus
        self.tokens.index_copy_(0, (p + n + 1).view(1), last)
        self.pos += n + 1

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture :meth:`decode_round` after two warm-up rounds on a side stream (kernel selection, the
        allocator's pool); they write into the caches, which :meth:`generate` refills anyway."""
        def warmup():
            self.pos.zero_()
            self.decode_round()

        return capture_graph(self.decode_round, self.device, warmup=warmup)[0]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
        """Extend ``idx`` (1, T) by ``max_new_tokens`` tokens distributed as the target's samples.
        Returns ``(ids, stats)``: ``ids`` (1, T + max_new_tokens), and ``stats`` with ``proposed`` and
        ``accepted`` draft tokens, ``acceptance_rate`` (accepted over the drafts the target checked:
        those up to a round's first rejection), ``target_calls``, ``draft_calls`` and
        ``tokens_per_target_call``. ``generator`` (on the models' device) seeds every draw."""
        if idx.dim() != 2 or idx.shape[0] != 1:
            raise ValueError(f"speculative decoding handles one sequence: idx must be (1, T), got {tuple(idx.shape)}; "
                             "call it once per prompt")
        T = idx.shape[1]
        if T == 0:
            raise ValueError("the prompt is empty; give at least one token (e.g. a BOS id)")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if T + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} tokens exceed "
                             f"max_len={self.max_len} (at most the models' context_length)")
        if max_new_tokens == 0:
            return idx, dict(proposed=0, accepted=0, target_calls=0, draft_calls=0, acceptance_rate=0.0,
                             tokens_per_target_call=0.0)
        if self.cuda_graphs and self.graph is None:
            self.graph = self._capture()
        self.tokens[:T].copy_(idx[0])
        if T > 1:   # prefill: both caches get the prompt but its last token, which the first round feeds
            for role in self.caches:
                self._forward(role, self.key_positions[:T - 1])
        self.pos.fill_(T - 1)
        self.rejections.zero_()
        rounds, done = 0, 0
        while done < max_new_tokens:
            for _ in range(math.ceil((max_new_tokens - done) / (self.k + 1))):
                self.uniforms.uniform_(generator=generator)
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self.decode_round()
                rounds += 1
            done = int(self.pos) - (T - 1)   # the host's one read of these rounds
        accepted, proposed = done - rounds, self.k * rounds   # a round emits its accepted drafts + one token
        # The drafts after a rejection are never checked: the rate is over those checked (the α of the
        # speed-up formula), not over all proposed, which would count those as rejected.
        checked = accepted + int(self.rejections)
        stats = dict(proposed=proposed, accepted=accepted, target_calls=rounds, draft_calls=proposed,
                     acceptance_rate=accepted / max(checked, 1), tokens_per_target_call=done / rounds)
        return self.tokens[:T + max_new_tokens][None].to(idx.device, copy=True), stats


@torch.no_grad()
def speculative_generate(target, draft, idx: torch.Tensor, max_new_tokens: int, k: int = 4,
                         temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Extend ``idx`` (1, T) by ``max_new_tokens`` tokens distributed as the ``target``'s samples,
    with ``draft`` proposing ``k`` tokens per target call: :meth:`SpeculativeDecoder.generate` of a
    decoder made for this call (build a :class:`SpeculativeDecoder` once to decode many prompts: each
    new decoder captures its CUDA graph again). Returns ``(ids, stats)`` as that method does.

    ``temperature`` (0: greedy), ``top_k`` and ``top_p`` shape both models' distributions alike
    (the guarantee is about the target's distribution *after* them). ``generator`` seeds every
    draw. Both models need the same vocabulary and a context of at least ``T + max_new_tokens``;
    put them in eval mode first. Batch size 1 only (see the module docstring).
    """
    if draft is None:
        raise ValueError("speculative_generate needs a draft model; SpeculativeDecoder(target, None, k=0) "
                         "decodes the target alone")
    decoder = SpeculativeDecoder(target, draft, k, max_len=idx.shape[-1] + max(max_new_tokens, 0),
                                 temperature=temperature, top_k=top_k, top_p=top_p)
    return decoder.generate(idx, max_new_tokens, generator)


__all__ = ["SpeculativeDecoder", "speculative_generate", "speculative_step", "speculative_step_distribution",
           "acceptance_probability", "residual_distribution"]
