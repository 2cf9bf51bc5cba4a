"""Low-quality text for testing filters: easy junk, bigram salad and near misses of good text.

A quality filter is only as well measured as its negatives are hard. Word salad (good words in
random order) and lists of fragments are removed by every filter, so a test set made of them says
every filter is perfect. Real raw data also holds text that is wrong in ways a bag of n-grams or a
short-context language model cannot see. Made here from good documents (the ``source``):

* easy junk: ``word salad`` (words drawn independently from the good text's words, as
  keyword-stuffed pages are) and ``fragments`` (lines of one to three such words);
* ``bigram salad``: text sampled from a word bigram model of the good text (:class:`BigramSampler`):
  every pair of neighbouring words occurs in good text, the whole means nothing (spun and
  machine-generated spam reads like this);
* near misses, good documents lightly corrupted: ``shuffled`` (sentences in random order),
  ``boilerplate`` (navigation, sharing and comment lines mixed in), ``truncated`` (the first
  15-45 % of the words, cut mid-sentence) and ``repeated`` (a paragraph, then one sentence of it
  over and over, each on its own line).

:func:`negatives` draws any mix of them. Every function takes a :class:`numpy.random.Generator`,
so a seed fixes the text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

EASY = ("word salad", "fragments")
NEAR_MISSES = ("shuffled", "boilerplate", "truncated", "repeated")
KINDS = EASY + ("bigram salad",) + NEAR_MISSES

# Page furniture a site wraps around its stories; every line is written for this module.
BOILERPLATE = [
    "Home | Stories | Authors | About us | Contact",
    "Share this story: Facebook Twitter Email",
    "Subscribe to our newsletter and get a new story every week!",
    "Posted by admin on 3 March 2024 in Bedtime stories",
    "Tags: friendship, animals, kids, short stories",
    "<< Previous story | Next story >>",
    "Comments (0) | Leave a comment",
    "Click here to download the free PDF version",
    "Copyright 2024 Story Corner. All rights reserved.",
    "Related: The brave fox | The lost kite | A day at the beach",
    "Rate this story: 1 2 3 4 5",
    "Skip to main content",
]

_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=["A-Z])|(?<=[.!?]")\s+(?=["A-Z])')


def split_sentences(paragraph: str) -> list[str]:
    """The sentences of an English paragraph: cut after ``. ! ?`` (or one followed by a closing
    quote) where a capital letter or an opening quote follows.

    >>> split_sentences('"Can I play?" asked Tom. "Yes!" said Mia. It was 3.5 km away.')
    ['"Can I play?" asked Tom.', '"Yes!" said Mia.', 'It was 3.5 km away.']
    """
    return [s for s in _SENTENCE_END.split(paragraph.strip()) if s]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


class BigramSampler:
    """A word bigram model of some texts, fitted by counting, and sampled from.

    Words are the texts' whitespace-separated tokens (punctuation stays on its word, so "park."
    ends sentences). Sampling follows the chain: the next word is drawn from the words that
    followed the current one in the texts, as often as they did (the maximum-likelihood bigram
    model). The documents are joined in one stream, so the chain runs across their boundaries;
    a word never followed by anything (the stream's last) restarts the chain at a random position.

    >>> sampler = BigramSampler(["the cat sat on the mat", "the dog sat on the cat"])
    >>> text = sampler.sample([8], np.random.default_rng(0))[0]
    >>> len(text.split()), set(zip(text.split(), text.split()[1:])) <= sampler.pairs()
    (8, True)
    """

    def __init__(self, texts: Sequence[str]):
        words = " ".join(texts).split()
        if len(words) < 2:
            raise ValueError("a bigram model needs at least two words of text")
        self.vocab, self.ids = np.unique(np.array(words), return_inverse=True)
        order = np.argsort(self.ids[:-1], kind="stable")
        # successors[starts[w]:starts[w + 1]]: every word that followed word w, with repeats.
        self.successors = self.ids[1:][order]
        self.starts = np.searchsorted(self.ids[:-1][order], np.arange(len(self.vocab) + 1))

    def pairs(self) -> set[tuple[str, str]]:
        """Every pair of neighbouring words in the training stream."""
        return set(zip(self.vocab[self.ids[:-1]].tolist(), self.vocab[self.ids[1:]].tolist()))

    def sample(self, lengths: Sequence[int], rng: np.random.Generator) -> list[str]:
        """One document of ``lengths[i]`` words for each ``i``, all chains advanced together."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if not len(lengths):
            return []
        out = np.empty((len(lengths), max(int(lengths.max()), 1)), dtype=np.int64)
        current = self.ids[rng.integers(len(self.ids), size=len(lengths))]
        for step in range(out.shape[1]):
            out[:, step] = current
            n_next = self.starts[current + 1] - self.starts[current]
            pick = self.starts[current] + (rng.random(len(current)) * n_next).astype(np.int64)
            restart = self.ids[rng.integers(len(self.ids), size=len(current))]
            current = np.where(n_next > 0, self.successors[np.minimum(pick, len(self.successors) - 1)], restart)
        return [" ".join(self.vocab[row[:n]].tolist()) for row, n in zip(out, lengths)]


def word_salad(source: Sequence[str], lengths: Sequence[int], rng: np.random.Generator) -> list[str]:
    """Documents of ``lengths[i]`` words drawn independently from the words of ``source``."""
    words = np.array(" ".join(source).split())
    return [" ".join(rng.choice(words, size=int(n)).tolist()) for n in lengths]


def fragments(source: Sequence[str], n_docs: int, rng: np.random.Generator, lines: int = 30) -> list[str]:
    """Documents of ``lines`` lines of one to three words of ``source`` each (lists of links, tag clouds)."""
    words = np.array(" ".join(source).split())
    return ["\n".join(" ".join(rng.choice(words, size=int(rng.integers(1, 4))).tolist()) for _ in range(lines))
            for _ in range(n_docs)]


def near_miss(text: str, kind: str, rng: np.random.Generator) -> str:
    """``text`` (paragraphs separated by blank lines) corrupted in one of the :data:`NEAR_MISSES` ways."""
    paragraphs = _paragraphs(text)
    if kind == "shuffled":  # the same sentences, in another order, in paragraphs of the same sizes
        per = [split_sentences(p) for p in paragraphs]
        flat = [s for sents in per for s in sents]
        flat = [flat[i] for i in rng.permutation(len(flat))]
        cuts = np.cumsum([0] + [len(s) for s in per])
        return "\n\n".join(" ".join(flat[a:b]) for a, b in zip(cuts[:-1], cuts[1:]))
    if kind == "boilerplate":  # 3 to 6 furniture lines around and between the paragraphs
        lines = list(paragraphs)
        for line in rng.choice(BOILERPLATE, size=int(rng.integers(3, 7)), replace=False).tolist():
            lines.insert(int(rng.integers(len(lines) + 1)), line)
        return "\n\n".join(lines)
    if kind == "truncated":  # the first 15-45 % of the words, cut mid-sentence
        words = text.split(" ")
        return " ".join(words[:max(3, int(len(words) * rng.uniform(0.15, 0.45)))])
    if kind == "repeated":  # the first paragraph, then one of its sentences 5 to 12 times
        first = split_sentences(paragraphs[0])
        line = first[int(rng.integers(len(first)))]
        return paragraphs[0] + "\n" + "\n".join([line] * int(rng.integers(5, 13)))
    raise ValueError(f"unknown near-miss kind {kind!r}: one of {', '.join(NEAR_MISSES)}")


def negatives(source: Sequence[str], counts: int | Mapping[str, int], rng: np.random.Generator,
              kinds: Sequence[str] = KINDS) -> tuple[list[str], list[str]]:
    """Low-quality documents made from the good documents ``source``: ``(texts, kinds)``.

    ``counts``: documents per kind (one number for every kind in ``kinds``, or a mapping). Salads
    take their lengths from the word counts of ``source`` documents, so length gives them away
    less; near misses corrupt ``source`` documents drawn without replacement where there are enough.
    """
    counts = {k: counts for k in kinds} if isinstance(counts, int) else dict(counts)
    unknown = set(counts) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")
    lengths = np.array([len(t.split()) for t in source])
    texts: list[str] = []
    labels: list[str] = []
    sampler = BigramSampler(source) if counts.get("bigram salad") else None
    for kind, n in counts.items():
        if kind == "word salad":
            made = word_salad(source, rng.choice(lengths, size=n), rng)
        elif kind == "fragments":
            made = fragments(source, n, rng)
        elif kind == "bigram salad":
            made = sampler.sample(rng.choice(lengths, size=n), rng)
        else:
            picks = rng.choice(len(source), size=n, replace=n > len(source))
            made = [near_miss(source[i], kind, rng) for i in picks]
        texts += made
        labels += [kind] * len(made)
    return texts, labels
