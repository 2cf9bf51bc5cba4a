"""Choosing the next token from the logits: the knobs of :class:`SamplingParams` and :func:`sample`.

The logits of a row pass through, in this order (the order vLLM and Hugging Face use):

1. **repetition penalty** ``r`` (CTRL, Keskar et al. 2019): the logit ``z`` of every token already in
   the sequence becomes ``z/r`` if positive, ``z·r`` if not, so ``r > 1`` makes repeats less likely;
2. **temperature** ``T``: ``z/T``; ``T = 0`` means greedy (argmax) and skips the rest;
3. **top-k**: keep the ``k`` largest logits (:func:`lmfs.nn.generate.top_k_filter`);
4. **top-p** (nucleus): keep the most likely tokens until their mass reaches ``p``
   (:func:`lmfs.nn.generate.top_p_filter`);
5. **min-p**: keep tokens whose probability is at least ``min_p`` times the largest one's.

Seeds: each request may carry its own ``torch.Generator``; its token is drawn with that generator
alone (one uniform number per step, inverse-CDF sampling), so a seeded request samples the same
tokens whether it runs alone or in a batch with others.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmfs.nn.generate import top_k_filter, top_p_filter


def _is_int(x) -> bool:
    """An integer and not a bool (numpy's and torch's integer scalars count)."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _is_number(x) -> bool:
    """A finite real number and not a bool."""
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Invalid values raise ``ValueError`` naming the field.

    ``max_tokens``: new tokens at most; ``temperature``: 0 is greedy; ``top_k``: None for no top-k;
    ``top_p`` in (0, 1]; ``min_p`` in [0, 1]; ``repetition_penalty`` > 0 (1: none);
    ``stop_token_ids``: ids that end the request (the id is kept in the output);
    ``stop``: strings that end it (cut from the text; needs a tokenizer); ``seed``: a private
    generator for this request; ``logprobs``: report the log-probability of each chosen token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self):
        # Accept lists and a single stop string; store tuples so the params stay hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        problems = []
        # Numbers must be numbers: True is not a token count, "5" not a token id, and a NaN
        # temperature would sample garbage without an error.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                problems.append(f"{name}={value!r} must be a finite number")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        ids = tuple(self.stop_token_ids) if not isinstance(self.stop_token_ids, (str, int)) else (self.stop_token_ids,)
        if not all(_is_int(t) for t in ids):
            problems.append(f"stop_token_ids={self.stop_token_ids!r} must hold integer token ids")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids if _is_int(t)))
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            problems.append(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if self.seed is not None and not _is_int(self.seed):
            problems.append(f"seed={self.seed!r} must be an integer, or None")
        if not isinstance(self.logprobs, bool):
            problems.append(f"logprobs={self.logprobs!r} must be True or False")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            problems.append(f"top_k={self.top_k!r} must be a positive integer, or None for no top-k")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p={self.top_p} must be in (0, 1] (1 switches it off)")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p={self.min_p} must be in [0, 1] (0 switches it off)")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 switches it off)")
        if any(not isinstance(s, str) or not s for s in stop):
            problems.append(f"stop={stop!r} must hold non-empty strings")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Greedy or temperature only (no penalty, top-k, top-p or min-p): the engine samples such
        requests on the device inside its decode step (:func:`sample_scaled`)."""
        return (self.repetition_penalty == 1.0 and self.top_k is None and self.top_p == 1.0
                and self.min_p == 0.0)

    def generator(self, device) -> torch.Generator | None:
        """A fresh generator seeded with ``seed`` on ``device`` (None without a seed)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


def _penalise(logits: torch.Tensor, params: Sequence[SamplingParams], previous_tokens) -> torch.Tensor:
    """Step 1 (module docstring) on the rows whose ``repetition_penalty`` is not 1."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    if previous_tokens is None:
        raise ValueError("repetition_penalty needs previous_tokens (the ids each row has seen)")
    logits = logits.clone()
    for i in rows:
        seen = torch.as_tensor(list(previous_tokens[i]), dtype=torch.long, device=logits.device).unique()
        z, r = logits[i, seen], params[i].repetition_penalty
        logits[i, seen] = torch.where(z > 0, z / r, z * r)
    return logits


def _by_value(values: Sequence) -> dict:
    """``{value: [rows]}``, so a filter runs once per distinct setting instead of once per row."""
    groups: dict = {}
    for i, v in enumerate(values):
        groups.setdefault(v, []).append(i)
    return groups


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   previous_tokens: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Steps 1-5 of the module docstring on ``logits`` ``(B, V)``, row ``i`` by ``params[i]``:
    float32 logits of the distribution each row samples from (``-inf`` where filtered out).
    Greedy rows get step 1 only."""
    logits = _penalise(logits.float(), params, previous_tokens)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return logits
    logits = logits.clone()
    temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
    logits[sampled] = logits[sampled] / temps[:, None]
    for k, rows in _by_value([params[i].top_k for i in sampled]).items():
        if k is not None:
            rows = [sampled[r] for r in rows]
            logits[rows] = top_k_filter(logits[rows], k)
    for p, rows in _by_value([params[i].top_p for i in sampled]).items():
        if p < 1.0:
            rows = [sampled[r] for r in rows]
            logits[rows] = top_p_filter(logits[rows], p)
    if any(params[i].min_p > 0 for i in sampled):      # decided on the host: no device sync
        min_p = torch.tensor([params[i].min_p for i in sampled], device=logits.device)
        probs = torch.softmax(logits[sampled], dim=-1)
        too_small = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits[sampled] = logits[sampled].masked_fill(too_small, float("-inf"))
    return logits


def draw_uniforms(params: Sequence[SamplingParams], generators, device,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """One uniform number in [0, 1) per row: from the row's own generator if it has one. ``out``: a
    ``(len(params),)`` float32 tensor to draw into (the same numbers as a fresh one would get)."""
    # the global generator, for unseeded rows
    u = torch.rand(len(params), device=device) if out is None else out.uniform_()
    if generators is not None:
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand((), generator=g, device=device)
    return u


def sample_scaled(processed: torch.Tensor, greedy: torch.Tensor | None,
                  uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw itself, on the device and without a host sync: ``processed`` ``(B, V)`` float32 logits
    of the distributions to sample from (:func:`process_logits`); ``greedy`` ``(B,)`` bool, the rows
    that take the argmax (None: every row samples); ``uniforms`` ``(B,)``, one number in [0, 1) per
    row (None when every row is greedy). Returns ``(next_ids (B,) long, logprobs (B,) float32)``,
    the log-probs under ``processed``."""
    log_probs = torch.log_softmax(processed, dim=-1)
    next_ids = processed.argmax(dim=-1)
    if uniforms is not None:
        # Inverse-CDF sampling: the first token whose cumulative probability exceeds u·total.
        # Tokens filtered out have probability 0 and never widen the CDF, so they are never chosen.
        cdf = log_probs.exp().cumsum(dim=-1)
        total = cdf[:, -1]
        u = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))  # stay below the
        drawn = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp(max=processed.shape[-1] - 1)  # top
        next_ids = drawn if greedy is None else torch.where(greedy, next_ids, drawn)
    return next_ids, log_probs.gather(-1, next_ids[:, None])[:, 0]


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None,
           previous_tokens: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row of ``logits`` ``(B, V)``; row ``i`` follows ``params[i]``.

    ``generators[i]`` (optional) draws row ``i``'s random number, so the row's choice does not
    depend on the other rows; ``previous_tokens[i]`` (the prompt and the tokens generated so far)
    is needed only for a repetition penalty. Returns ``(next_ids (B,) long, logprobs (B,) float32)``.

    Log-probs are those of the distribution actually sampled from: after the penalty, the
    temperature and the filters (:func:`process_logits`), so a token the filters kept gets more
    mass than under the raw model. Greedy rows report the log-probability under the (penalised)
    model distribution at temperature 1.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be (B, V) with B = len(params) = {len(params)}, got {tuple(logits.shape)}")
    processed = process_logits(logits, params, previous_tokens)
    if all(p.greedy for p in params):
        return sample_scaled(processed, None, None)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    return sample_scaled(processed, greedy, draw_uniforms(params, generators, logits.device))
