"""Evaluation harnesses: multiple choice scored by log-likelihood, and generate-then-score.

**Multiple choice by log-likelihood.** An item is a context and a few choices. Each choice is
appended to the context as a continuation and scored by ``log p(choice | context)``; the
prediction is the best-scoring choice. The raw sum favours short choices (every token costs
log-probability), so harnesses also report the sum divided by the choice's number of tokens
(depends on the tokenizer) or of UTF-8 bytes (does not): ``acc``, ``acc_token``, ``acc_byte``
(the last is ``lm-eval``'s ``acc_bytes``: bytes of the choice itself, without the space before it).
Formats follow ``lm-eval``: the continuation is ``" " + choice``, few-shot examples are
``context + " " + answer`` joined by blank lines before the question.

**Generate then score.** The model writes an answer (greedy, or ``n`` samples for pass@k);
an extractor pulls the answer out of the text, and a scorer compares it with the reference:
normalised exact match, a numeric verifier (``0.5 == 1/2``), or running code against tests.
Generation goes through :func:`generate`, which uses the batching engine
:class:`lmfs.inference.LLM` and falls back to the model's own sampling loop
(:func:`lmfs.nn.generate`) where the engine is not available.
"""

from __future__ import annotations

import random
import re
import string
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fractions import Fraction

import numpy as np
import torch

from lmfs.eval.execution import check_program, default_workers
from lmfs.eval.metrics import pass_at_k
from lmfs.eval.perplexity import bos_id, target_logprobs, target_logprobs_one_at_a_time

# ----------------------------------------------------------------------------------------------
# Scoring continuations


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``context`` and of ``continuation`` as they are tokenized *together*.

    BPE may merge across the boundary, so the pair is encoded whole and the continuation is what
    follows the context's own encoding (the rule of ``lm-eval``'s Hugging Face backend). Spaces
    at the end of the context move to the continuation first, since GPT-2-style pre-tokenization
    attaches a space to the word after it. An empty context becomes ``<|endoftext|>``.
    """
    if not continuation:
        raise ValueError("the continuation to score is empty: give at least one character")
    if context == "":
        bos = bos_id(tokenizer)
        if bos is None:
            raise ValueError("an empty context needs a beginning-of-text token: the tokenizer has no <|endoftext|>")
        return [bos], tokenizer.encode(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


@dataclass
class ContinuationScore:
    """``logprob``: ``log p(continuation | context)`` (nats, summed over ``n_tokens`` tokens);
    ``n_bytes``: the continuation's UTF-8 length; ``greedy``: every token is the argmax."""

    logprob: float
    n_tokens: int
    n_bytes: int
    greedy: bool


def _pair_sequences(model, tokenizer, pairs) -> tuple[list[list[int]], list[int]]:
    """Each (context, continuation) -> one id sequence and the index where the continuation starts,
    keeping the last ``context_length + 1`` tokens when the pair is too long (the context's start goes)."""
    ctx_len = model.config.context_length
    sequences, starts = [], []
    for context, continuation in pairs:
        ctx, cont = encode_pair(tokenizer, context, continuation)
        if len(cont) > ctx_len:
            raise ValueError(f"a continuation of {len(cont)} tokens does not fit context_length={ctx_len}")
        seq = (ctx + cont)[-(ctx_len + 1):]
        sequences.append(seq)
        starts.append(len(seq) - len(cont))
    return sequences, starts


def _to_scores(pairs, results) -> list[ContinuationScore]:
    return [ContinuationScore(float(r.logprobs.double().sum()), len(r.logprobs), len(cont.encode("utf-8")),
                              bool(r.greedy.all())) for (_, cont), r in zip(pairs, results)]


def score_continuations(model, tokenizer, pairs: Sequence[tuple[str, str]],
                        batch_size: int = 64) -> list[ContinuationScore]:
    """Score ``(context, continuation)`` pairs, batched and sorted by length (:func:`target_logprobs`)."""
    sequences, starts = _pair_sequences(model, tokenizer, pairs)
    return _to_scores(pairs, target_logprobs(model, sequences, starts, batch_size))


def score_continuations_one_at_a_time(model, tokenizer, pairs: Sequence[tuple[str, str]]) -> list[ContinuationScore]:
    """The same scores, one forward per pair: the reference and the baseline of the batched path."""
    sequences, starts = _pair_sequences(model, tokenizer, pairs)
    return _to_scores(pairs, target_logprobs_one_at_a_time(model, sequences, starts))


# ----------------------------------------------------------------------------------------------
# Multiple choice


@dataclass
class MCItem:
    """A multiple-choice item: ``context`` (the question or text to continue), ``choices`` (their
    text without the leading space), ``answer`` (index of the right choice), ``id`` (stable name)."""

    context: str
    choices: list[str]
    answer: int
    id: str = ""

    def __post_init__(self):
        if not 0 <= self.answer < len(self.choices):
            raise ValueError(f"item {self.id!r}: answer={self.answer} is not an index into {len(self.choices)} choices")


def _shots(item, pool: Sequence, n_shot: int, seed: int, key: str) -> list:
    """``n_shot`` examples from ``pool`` other than ``item``, the same for the same (seed, item)."""
    if n_shot == 0:
        return []
    others = [p for p in pool if p is not item and (not item.id or p.id != item.id)]
    if len(others) < n_shot:
        raise ValueError(f"{n_shot}-shot needs {n_shot} examples besides the item, the pool has {len(others)}")
    return random.Random(f"{seed}:{key}").sample(others, n_shot)


def few_shot_context(item: MCItem, pool: Sequence[MCItem] = (), n_shot: int = 0, seed: int = 0,
                     delimiter: str = "\n\n", key: str | None = None) -> str:
    """The prompt for ``item``: ``n_shot`` solved examples drawn from ``pool`` (seeded by ``seed``
    and the item's id, so every run and every model sees the same shots), then its context.

    >>> a, b = MCItem("2 + 2 =", ["4", "5"], 0, "a"), MCItem("1 + 2 =", ["3", "4"], 0, "b")
    >>> few_shot_context(a, [a, b], n_shot=1)
    '1 + 2 = 3\\n\\n2 + 2 ='
    """
    shots = _shots(item, pool, n_shot, seed, key or item.id or item.context)
    return "".join(f"{s.context} {s.choices[s.answer]}{delimiter}" for s in shots) + item.context


NORMALISATIONS = ("raw", "token", "byte")


@dataclass
class MCResult:
    """Accuracy under each length normalisation, with what it came from.

    ``correct[norm]``: bool ``(n_items,)`` per normalisation in :data:`NORMALISATIONS`;
    ``scores[i][j]``: the :class:`ContinuationScore` of choice ``j`` of item ``i`` (``n_bytes``: of the
    choice without its leading space);
    ``tokens_scored``: tokens that went through the model (context and choices); ``seconds``.
    """

    correct: dict[str, np.ndarray]
    scores: list[list[ContinuationScore]]
    tokens_scored: int = 0
    seconds: float = 0.0

    @property
    def acc(self) -> float:
        return float(self.correct["raw"].mean())

    @property
    def acc_token(self) -> float:
        return float(self.correct["token"].mean())

    @property
    def acc_byte(self) -> float:
        return float(self.correct["byte"].mean())

    @property
    def n_items(self) -> int:
        return len(self.scores)

    def __repr__(self) -> str:
        return (f"MCResult(n={self.n_items}, acc={self.acc:.3f}, acc_token={self.acc_token:.3f}, "
                f"acc_byte={self.acc_byte:.3f})")


def choice_predictions(scores: Sequence[ContinuationScore], norm: str = "raw") -> int:
    """The chosen index among one item's choice scores under a normalisation (first wins a tie)."""
    if norm == "raw":
        values = [s.logprob for s in scores]
    elif norm == "token":
        values = [s.logprob / s.n_tokens for s in scores]
    elif norm == "byte":
        values = [s.logprob / s.n_bytes for s in scores]
    else:
        raise ValueError(f"norm={norm!r}: use one of {NORMALISATIONS}")
    return int(np.argmax(values))


def evaluate_multiple_choice(model, tokenizer, items: Sequence[MCItem], n_shot: int = 0,
                             pool: Sequence[MCItem] | None = None, seed: int = 0, batch_size: int = 64,
                             one_at_a_time: bool = False) -> MCResult:
    """Score every choice of every item in one batched, length-sorted pass; accuracy three ways.

    ``pool``: where few-shot examples come from (default: the items themselves, never an item's own
    shot). ``one_at_a_time=True`` uses the unbatched reference scorer (same numbers, slower).
    """
    pool = items if pool is None else pool
    pairs, owner = [], []
    for i, item in enumerate(items):
        context = few_shot_context(item, pool, n_shot, seed, key=item.id or str(i))
        for choice in item.choices:
            pairs.append((context, " " + choice))
            owner.append(i)
    start = time.perf_counter()
    if one_at_a_time:
        flat = score_continuations_one_at_a_time(model, tokenizer, pairs)
    else:
        flat = score_continuations(model, tokenizer, pairs, batch_size)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    scores: list[list[ContinuationScore]] = [[] for _ in items]
    for i, s in zip(owner, flat):
        # Per-byte normalisation counts the choice's own bytes, not the delimiter (as lm-eval does).
        choice = items[i].choices[len(scores[i])]
        scores[i].append(replace(s, n_bytes=len(choice.encode("utf-8"))))
    correct = {norm: np.array([choice_predictions(sc, norm) == item.answer for sc, item in zip(scores, items)])
               for norm in NORMALISATIONS}
    tokens = sum(len(encode_pair(tokenizer, *p)[0]) + s.n_tokens for p, s in zip(pairs, flat))
    return MCResult(correct, scores, tokens, seconds)


# ----------------------------------------------------------------------------------------------
# Generation


def _inference_llm():
    """:class:`lmfs.inference.LLM`, or None where the engine cannot be imported."""
    try:
        from lmfs.inference import LLM
    except ImportError:
        return None
    return LLM


@torch.inference_mode()
def generate(model, tokenizer, prompts: Sequence[str], max_tokens: int = 32, temperature: float = 0.0,
             stop: Sequence[str] = ("\n",), n: int = 1, seed: int = 0, top_p: float = 1.0,
             backend: str = "auto") -> list[list[str]]:
    """``n`` completions of each prompt (text after the prompt, cut before the first ``stop`` string).

    ``backend``: ``"auto"`` (the :class:`lmfs.inference.LLM` engine when importable, else the
    model's own loop), ``"engine"`` or ``"nn"`` (:func:`lmfs.nn.generate`, one prompt at a time,
    no KV cache). Sample ``j`` of prompt ``i`` is seeded with ``seed + i·n + j``: results repeat, and
    no two samples share their random numbers (which would correlate them across prompts). A
    prompt longer than the context keeps its last ``context_length - max_tokens`` tokens; an empty
    one starts from ``<|endoftext|>``.
    """
    if backend not in ("auto", "engine", "nn"):
        raise ValueError(f"backend={backend!r}: use 'auto', 'engine' or 'nn'")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: the number of completions per prompt must be a positive integer")
    LLM = _inference_llm() if backend in ("auto", "engine") else None
    if backend == "engine" and LLM is None:
        raise ImportError("backend='engine' needs lmfs.inference, which could not be imported")
    ctx = model.config.context_length
    if not 1 <= max_tokens < ctx:
        raise ValueError(f"max_tokens must be in 1..{ctx - 1} (the context holds {ctx} tokens), got {max_tokens}")
    keep, bos = ctx - max_tokens, bos_id(tokenizer)
    # An empty prompt starts from <|endoftext|>, like a fresh document.
    token_prompts = [(tokenizer.encode(p) or ([bos] if bos is not None else []))[-keep:] for p in prompts]
    stop = tuple(stop)
    if LLM is not None:
        from lmfs.inference import SamplingParams
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                                 seed=seed + i * n + j, logprobs=False)
                  for i in range(len(token_prompts)) for j in range(n)]
        outputs = LLM(model, tokenizer, progress=False).generate(
            [p for p in token_prompts for _ in range(n)], params)
        texts = [o.text if o.error is None else "" for o in outputs]
    else:
        from lmfs.nn import generate as nn_generate
        device = next(model.parameters()).device
        texts = []
        for i, p in enumerate(token_prompts):
            for j in range(n):
                g = torch.Generator(device=device).manual_seed(seed + i * n + j)
                idx = torch.tensor([p], device=device)
                out = nn_generate(model, idx, max_tokens, temperature=temperature,
                                  top_p=top_p if top_p < 1 else None, generator=g)
                text = tokenizer.decode(out[0, len(p):].tolist())
                cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
                texts.append(text[:min(cuts)] if cuts else text)
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def extract_answer(text: str, kind: str = "number") -> str | None:
    """Pull the answer out of a completion.

    ``kind="number"``: the text after ``####`` if present (the GSM8K convention), else the *last*
    number in the text (a worked solution ends with its result); ``"line"``: the first non-empty
    line, stripped. None when there is nothing to extract.

    >>> extract_answer("12 + 7 is 19."), extract_answer("so #### 1,024"), extract_answer("  Tom\\nnext", "line")
    ('19', '1,024', 'Tom')
    """
    if kind == "number":
        if "####" in text:
            text = text.split("####", 1)[1]
        found = _NUMBER_RE.findall(text)
        return found[-1].strip() if found else None
    if kind == "line":
        for line in text.splitlines():
            if line.strip():
                return line.strip()
        return None
    raise ValueError(f"kind={kind!r}: use 'number' or 'line'")


# A chosen letter, capital, not part of a word: after "answer" ("The answer is (B)", "Answer: C"),
# opening the reply ("B) the park", "(C)", "D."), or alone in brackets anywhere ("... so (A)").
_ANSWER_LETTER = re.compile(r"(?i:\banswer\b(?:\s+is)?\s*[:\-]?\s*)\(?([A-Z])(?![A-Za-z])")
_LEADING_LETTER = re.compile(r"^\s*\(?([A-Z])(?:[.):]|\s*$|\s)")
_BRACKETED_LETTER = re.compile(r"\(([A-Z])\)")


def extract_choice(text: str, n_choices: int) -> int | None:
    """The choice a generated reply picks by its letter (``A`` = 0), for multiple choice by generation
    beside :func:`evaluate_multiple_choice`'s log-likelihoods: the letter after the last
    ``answer``/``Answer:``, else the letter that opens the reply, else the last bracketed one.
    Letters are capitals standing alone, so the article in "a cat" or "A cat sat" picks nothing;
    None when no letter of the first ``n_choices`` is found.

    >>> extract_choice("The answer is (C).", 4), extract_choice("B) the park", 4), extract_choice("A cat sat.", 4)
    (2, 1, None)
    """
    if not 1 <= n_choices <= 26:
        raise ValueError(f"n_choices={n_choices}: letters A-Z name 1 to 26 choices")
    found = _ANSWER_LETTER.findall(text)
    letter = found[-1] if found else None
    if letter is None and (m := _LEADING_LETTER.match(text)) and not re.match(r"\s*A\s+[a-z]", text):
        letter = m.group(1)
    if letter is None and (found := _BRACKETED_LETTER.findall(text)):
        letter = found[-1]
    index = None if letter is None else ord(letter) - ord("A")
    return index if index is not None and index < n_choices else None


_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _normalise(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD normalisation)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(prediction: str | None, reference: str) -> bool:
    """Equal after normalisation (case, punctuation, articles, whitespace)."""
    return prediction is not None and _normalise(prediction) == _normalise(reference)


def parse_number(text: str | None) -> Fraction | None:
    """``"1,024"``, ``"-3.5"``, ``"1/2"``, ``"$7"`` -> an exact :class:`~fractions.Fraction`; None if not a number."""
    if text is None:
        return None
    text = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_match(prediction: str | None, reference: str, rel_tol: float = 1e-6) -> bool:
    """Numeric verifier: equal as numbers (``0.5 == 1/2 == .50``), within ``rel_tol`` of the reference."""
    p, r = parse_number(prediction), parse_number(reference)
    if p is None or r is None:
        return False
    return p == r or abs(float(p - r)) <= rel_tol * abs(float(r))


@dataclass
class GenItem:
    """A generation item: the ``prompt``, the reference ``answer`` (text), a stable ``id``."""

    prompt: str
    answer: str
    id: str = ""


@dataclass
class GenResult:
    """``correct``: bool ``(n_items, n_samples)``; ``completions[i][j]``: sample ``j`` of item ``i``;
    ``extracted`` likewise. ``accuracy``: mean over items of the first sample (greedy when
    temperature is 0); :meth:`pass_at` from all samples."""

    correct: np.ndarray
    completions: list[list[str]]
    extracted: list[list[str | None]] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return float(self.correct[:, 0].mean())

    def pass_at(self, k: int) -> float:
        n = self.correct.shape[1]
        return float(np.mean([pass_at_k(n, int(c), k) for c in self.correct.sum(axis=1)]))

    def __repr__(self) -> str:
        return f"GenResult(n={len(self.correct)}, samples={self.correct.shape[1]}, accuracy={self.accuracy:.3f})"


def evaluate_generation(model, tokenizer, items: Sequence[GenItem], n_shot: int = 0,
                        pool: Sequence[GenItem] | None = None, seed: int = 0, max_tokens: int = 16,
                        scorer: str = "number", n: int = 1, temperature: float = 0.0,
                        stop: Sequence[str] = ("\n",), backend: str = "auto") -> GenResult:
    """Generate ``n`` answers per item (after ``n_shot`` solved examples) and score them.

    ``scorer``: ``"number"`` (:func:`extract_answer` then :func:`numbers_match`) or ``"exact"``
    (first line, :func:`exact_match`).
    """
    if scorer not in ("number", "exact"):
        raise ValueError(f"scorer={scorer!r}: use 'number' or 'exact'")
    pool = items if pool is None else pool
    prompts = ["".join(f"{s.prompt} {s.answer}\n\n" for s in _shots(item, pool, n_shot, seed, item.id or str(i)))
               + item.prompt for i, item in enumerate(items)]
    completions = generate(model, tokenizer, prompts, max_tokens, temperature, stop, n, seed, backend=backend)
    kind = "number" if scorer == "number" else "line"
    verify = numbers_match if scorer == "number" else exact_match
    extracted = [[extract_answer(c, kind) for c in cs] for cs in completions]
    correct = np.array([[verify(e, item.answer) for e in es] for es, item in zip(extracted, items)], dtype=bool)
    return GenResult(correct.reshape(len(items), n), completions, extracted)


def check_code(problems: Sequence, completions: Sequence[Sequence[str]], timeout: float = 5.0,
               memory_mb: int = 512, workers: int | None = None, isolation: str | None = None) -> np.ndarray:
    """Judge each completion against its problem's tests; bool ``(n_problems, n_samples)``.

    A problem has ``prompt``, ``test`` and ``entry_point`` (HumanEval's fields, e.g.
    :func:`lmfs.eval.tasks.humaneval`). The candidate, prompt plus completion, runs in the sandbox;
    the harness, prompt plus test (trusted: from the data set), runs here and calls the candidate's
    ``entry_point`` through :func:`lmfs.eval.execution.check_program`, so the verdict cannot be
    written by the completion. ``workers`` runs at a time (default: one per core). The harness's
    use of the global ``random`` module does not change this process's random state.
    """
    jobs = [(f"{p.prompt}{c}", f"{p.prompt}\n\n{p.test}\n", p.entry_point)
            for p, cs in zip(problems, completions, strict=True) for c in cs]
    state = random.getstate()
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers or default_workers())) as pool:
            results = list(pool.map(lambda job: check_program(*job, timeout=timeout, memory_mb=memory_mb,
                                                              isolation=isolation), jobs))
    finally:
        random.setstate(state)
    width = len(completions[0]) if completions else 0
    return np.array([r.passed for r in results], dtype=bool).reshape(len(problems), width)
