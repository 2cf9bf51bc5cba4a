"""Log-probabilities of target tokens, perplexity with a sliding window, and bits-per-byte.

Everything in :mod:`lmfs.eval` that scores text (perplexity, multiple choice, min-k% probability,
the ``lm-eval`` adapter) reduces to one question: *what log-probability does the model give each
token of a sequence, given the tokens before it?* :func:`target_logprobs` answers it for many
sequences at once, which is where evaluation spends its time:

* sequences are **sorted by length** and cut into batches, so a batch holds sequences of similar
  length and little padding;
* each batch is **right-padded** and runs as **one forward**. No attention mask is needed: the
  model is causal, so a real token never attends to the padding that comes after it;
* only the positions whose next token is scored go through the output head (a vocabulary-sized
  matmul), and their target log-probabilities are gathered from a float32 log-softmax.

Perplexity is ``exp`` of the mean negative log-likelihood per token, so it depends on the
tokenizer: a tokenizer with longer tokens has fewer, harder predictions. **Bits-per-byte**
divides the same total by the number of UTF-8 bytes of the text instead, and converts nats to
bits: ``bpb = NLL_total / (ln 2 · n_bytes)``. It is comparable across tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lmfs.data.corpora import EOT


class TargetScores(NamedTuple):
    """Per scored token of one sequence: ``logprobs`` float32 ``(n,)`` and ``greedy`` bool ``(n,)``
    (whether the token is the model's argmax, as greedy decoding would pick it)."""

    logprobs: torch.Tensor
    greedy: torch.Tensor


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _check_sequences(model, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
    if len(sequences) != len(starts):
        raise ValueError(f"got {len(sequences)} sequences but {len(starts)} starts: one start per sequence")
    ctx = model.config.context_length
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        if not 1 <= start < len(seq):
            raise ValueError(f"sequence {i}: start={start} must satisfy 1 <= start < len(sequence)={len(seq)} "
                             "(the first token has nothing before it to be predicted from)")
        if len(seq) > ctx + 1:
            raise ValueError(f"sequence {i} holds {len(seq)} tokens but the model sees at most "
                             f"context_length + 1 = {ctx + 1}: cut it into windows (sliding_windows)")


@torch.inference_mode()
def target_logprobs(model, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                    batch_size: int = 64) -> list[TargetScores]:
    """Log-probabilities of ``seq[start:]`` given what precedes each token, for every sequence.

    ``sequences``: lists of token ids, each at most ``context_length + 1`` long (the model reads
    ``seq[:-1]`` and predicts ``seq[1:]``); ``starts[i]`` (>= 1) is the first scored position of
    sequence ``i``. Returns one :class:`TargetScores` per sequence, in the input order, on the CPU,
    with ``len(seq) - start`` entries. Batched, length-sorted and right-padded (module docstring).

    The model's mode is left as it is (call ``model.eval()`` first). A mixture-of-experts model
    with a capacity limit can route a token differently depending on its batch-mates; dense
    models give the same numbers as :func:`target_logprobs_one_at_a_time` up to float rounding.
    """
    _check_sequences(model, sequences, starts)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = _model_device(model)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))   # longest first
    out: list[TargetScores | None] = [None] * len(sequences)
    for first in range(0, len(order), batch_size):
        batch = order[first:first + batch_size]
        T = len(sequences[batch[0]]) - 1                     # longest input in this batch
        inputs = torch.zeros(len(batch), T, dtype=torch.long)
        targets = torch.zeros(len(batch), T, dtype=torch.long)
        scored = torch.zeros(len(batch), T, dtype=torch.bool)
        for row, i in enumerate(batch):
            seq = torch.as_tensor(sequences[i], dtype=torch.long)
            n = len(seq) - 1
            inputs[row, :n], targets[row, :n] = seq[:-1], seq[1:]
            scored[row, starts[i] - 1:n] = True              # position t predicts seq[t + 1]
        inputs, targets, scored = inputs.to(device), targets.to(device), scored.to(device)
        if hasattr(model, "hidden") and hasattr(model, "head"):
            # Only the scored positions need logits: (N, d_model) -> (N, V) instead of (B, T, V).
            logits = model.head(model.hidden(inputs)[scored])
        else:
            logits = model(inputs)[0][scored]
        logp = F.log_softmax(logits.float(), dim=-1)         # (N, V)
        wanted = targets[scored]                             # (N,)
        token_lp = logp.gather(1, wanted[:, None])[:, 0].cpu()
        greedy = (logits.argmax(dim=-1) == wanted).cpu()
        counts = scored.sum(dim=1).tolist()                  # row-major order matches `[scored]`
        for i, lp, g in zip(batch, token_lp.split(counts), greedy.split(counts)):
            out[i] = TargetScores(lp, g)
    return out


@torch.inference_mode()
def target_logprobs_one_at_a_time(model, sequences: Sequence[Sequence[int]],
                                  starts: Sequence[int]) -> list[TargetScores]:
    """The reference for :func:`target_logprobs`: one full forward ``model(idx)`` per sequence and a
    log-softmax over every position, no sorting, no padding. Same arguments and result."""
    _check_sequences(model, sequences, starts)
    device = _model_device(model)
    out = []
    for seq, start in zip(sequences, starts):
        idx = torch.as_tensor(seq, dtype=torch.long, device=device)[None]   # (1, n)
        logits, _ = model(idx[:, :-1])                                       # (1, n-1, V)
        logp = F.log_softmax(logits[0].float(), dim=-1)
        targets = idx[0, 1:]
        rows = torch.arange(start - 1, len(seq) - 1, device=device)
        out.append(TargetScores(logp[rows, targets[rows]].cpu(),
                                (logits[0, rows].argmax(-1) == targets[rows]).cpu()))
    return out


def sliding_windows(n_tokens: int, context_length: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Cut ``n_tokens`` tokens into windows that score every token but the first exactly once.

    Returns ``(begin, end, start)`` triples: the window is ``tokens[begin:end]`` (at most
    ``context_length + 1`` tokens) and its tokens from ``begin + start`` on are scored. Each new
    window moves the end by ``stride`` tokens and reaches back as far as the context allows, so a
    smaller stride gives each scored token more context (and costs more forwards). ``stride``
    defaults to ``context_length``: windows that touch but do not overlap.

    >>> sliding_windows(10, context_length=4, stride=2)
    [(0, 5, 1), (2, 7, 3), (4, 9, 3), (5, 10, 4)]
    """
    stride = context_length if stride is None else stride
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride must be in 1..context_length={context_length}, got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score one prediction, got {n_tokens}")
    end = min(n_tokens, context_length + 1)
    windows = [(0, end, 1)]
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        begin = max(0, new_end - context_length - 1)
        windows.append((begin, new_end, end - begin))
        end = new_end
    return windows


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Total negative log-likelihood in nats -> bits per UTF-8 byte: ``nll / (ln 2 · n_bytes)``."""
    if n_bytes <= 0:
        raise ValueError(f"n_bytes must be positive, got {n_bytes}")
    return nll_nats / (math.log(2) * n_bytes)


@dataclass
class PerplexityResult:
    """Totals of a perplexity evaluation. ``nll``: summed negative log-likelihood (nats) over
    ``n_tokens`` scored tokens that spell ``n_bytes`` UTF-8 bytes (None when unknown)."""

    nll: float
    n_tokens: int
    n_bytes: int | None = None

    @property
    def loss(self) -> float:
        """Mean cross-entropy, nats per token (what training reports)."""
        return self.nll / self.n_tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss / math.log(2)

    @property
    def bpb(self) -> float:
        if self.n_bytes is None:
            raise ValueError("bits-per-byte needs the byte count: pass n_bytes (or use text_perplexity)")
        return bits_per_byte(self.nll, self.n_bytes)

    def __add__(self, other: PerplexityResult) -> PerplexityResult:
        nb = None if self.n_bytes is None or other.n_bytes is None else self.n_bytes + other.n_bytes
        return PerplexityResult(self.nll + other.nll, self.n_tokens + other.n_tokens, nb)

    def __repr__(self) -> str:
        bpb = f", bpb={self.bpb:.4f}" if self.n_bytes else ""
        return f"PerplexityResult(tokens={self.n_tokens:,}, loss={self.loss:.4f}, ppl={self.ppl:.3f}{bpb})"


def token_perplexity(model, tokens, n_bytes: int | None = None, stride: int | None = None, bos: int | None = None,
               batch_size: int = 16) -> PerplexityResult:
    """Perplexity of one token sequence (list, 1-D array or tensor) under ``model``, by sliding window.

    Every token after the first is scored once (:func:`sliding_windows`); with ``bos`` (a
    beginning-of-sequence id, e.g. ``<|endoftext|>``) put in front, the first token is scored too.
    ``n_bytes``: the UTF-8 bytes the scored tokens spell, for bits-per-byte.
    """
    tokens = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
    if bos is not None:
        tokens = [bos] + tokens
    windows = sliding_windows(len(tokens), model.config.context_length, stride)
    scores = target_logprobs(model, [tokens[b:e] for b, e, _ in windows], [s for _, _, s in windows],
                             batch_size=batch_size)
    nll = -sum(float(s.logprobs.double().sum()) for s in scores)
    return PerplexityResult(nll, sum(len(s.logprobs) for s in scores), n_bytes)


def bos_id(tokenizer) -> int | None:
    """The id of ``<|endoftext|>`` (the course's document separator, used as beginning-of-text), or None."""
    special = getattr(tokenizer, "special_ids", {})
    return special.get(EOT)


def text_perplexity(model, tokenizer, texts: str | Sequence[str], stride: int | None = None,
                    batch_size: int = 16) -> PerplexityResult:
    """Perplexity and bits-per-byte of one text or of several documents (each scored on its own).

    Each document gets ``<|endoftext|>`` in front when the tokenizer has it, so all its tokens are
    scored and ``n_bytes`` is its full UTF-8 length; otherwise its first token is not scored and
    neither are its bytes.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    bos = bos_id(tokenizer)
    total = PerplexityResult(0.0, 0, 0)
    for text in texts:
        ids = tokenizer.encode(text)
        n_bytes = len(text.encode("utf-8")) if bos is not None else len(tokenizer.decode_bytes(ids[1:]))
        total = total + token_perplexity(model, ids, n_bytes, stride, bos, batch_size)
    return total
