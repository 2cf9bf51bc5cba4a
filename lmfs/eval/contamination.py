"""Train-test contamination: was a benchmark item in the training data?

Two ways to ask, one needing the training data and one needing only the model:

* **n-gram overlap** (what GPT-3 and later reports ran on their training sets): cut the training
  text into word n-grams (lower case, punctuation dropped, so trivial formatting does not hide a
  copy), and for each benchmark item measure the fraction of its own n-grams found there. A long
  n-gram (8-13 words) almost never repeats by chance in natural text, so a high fraction means
  the item, or a near copy, was in training.
* **min-k% probability** (Shi et al. 2023): without the training data, score an item by the mean
  log-probability of its ``k``% *least* likely tokens. Text the model has seen has few
  surprising tokens, so its lowest log-probabilities are less low than those of unseen text of
  the same kind. It is a membership score: compare items against each other (e.g. with
  :func:`roc_auc` on items known to be in or out), not against a universal threshold.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from lmfs.eval.perplexity import bos_id, target_logprobs

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words: punctuation and spacing do not matter for overlap."""
    return _WORD.findall(text.lower())


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The set of word ``n``-grams of ``text`` (empty when it has fewer than ``n`` words).

    >>> sorted(word_ngrams("The cat sat. The cat!", 2))
    [('cat', 'sat'), ('sat', 'the'), ('the', 'cat')]
    """
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


class NgramIndex:
    """All word ``n``-grams of the training texts, to look benchmark items up in.

    Memory grows with the training text (one set entry per distinct n-gram); at course scale that
    is a few MB. At web scale one would hash n-grams into a Bloom filter instead.
    """

    def __init__(self, texts: Iterable[str], n: int = 8):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.ngrams: set[tuple[str, ...]] = set()
        for text in texts:
            self.ngrams |= word_ngrams(text, n)

    def overlap(self, text: str) -> float:
        """Fraction of ``text``'s n-grams present in the training texts (0 for a text shorter than n words)."""
        grams = word_ngrams(text, self.n)
        return len(grams & self.ngrams) / len(grams) if grams else 0.0

    def contaminated(self, text: str, threshold: float = 0.5) -> bool:
        return self.overlap(text) >= threshold


def ngram_overlap(items: Sequence[str], train_texts: Iterable[str], n: int = 8) -> np.ndarray:
    """Per benchmark item (its text), the fraction of its word n-grams found in ``train_texts``."""
    index = NgramIndex(train_texts, n)
    return np.array([index.overlap(t) for t in items])


def min_k_prob(model, tokenizer, texts: Sequence[str], k: float = 0.2, batch_size: int = 32) -> np.ndarray:
    """Min-k% probability of each text (Shi et al. 2023); higher means more likely seen in training.

    Every token of a text is scored given the ones before it (``<|endoftext|>`` in front, when the
    tokenizer has it); the score is the mean of the lowest ``ceil(k · n)`` token log-probabilities.
    A text longer than the context keeps its first ``context_length + 1`` tokens.
    """
    if not 0 < k <= 1:
        raise ValueError(f"k is a fraction in (0, 1], got {k}")
    bos = bos_id(tokenizer)
    ctx = model.config.context_length
    sequences = [(([bos] if bos is not None else []) + tokenizer.encode(t))[:ctx + 1] for t in texts]
    scores = target_logprobs(model, sequences, [1] * len(sequences), batch_size)
    out = []
    for s in scores:
        lp = np.sort(s.logprobs.double().numpy())
        out.append(lp[:max(1, int(np.ceil(k * len(lp))))].mean())
    return np.array(out)


def roc_auc(member_scores, nonmember_scores) -> float:
    """Area under the ROC curve of a membership score: the probability that a random member
    scores above a random non-member (ties count half). 0.5 is chance, 1.0 perfect separation."""
    m, o = np.asarray(member_scores, float)[:, None], np.asarray(nonmember_scores, float)[None, :]
    if m.size == 0 or o.size == 0:
        raise ValueError("roc_auc needs at least one member and one non-member score")
    return float(np.mean((m > o) + 0.5 * (m == o)))
