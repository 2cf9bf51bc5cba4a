"""N-grams: stable hashes of words and n-grams, and an n-gram language model with Kneser-Ney smoothing.

Two kinds of n-gram machinery serve the filters and the deduplication of lecture 14:

* **Hashed n-grams** (:func:`word_hashes`, :func:`ngram_hashes`, :func:`hashed_features`): every
  whitespace-separated word of a batch of documents gets a 64-bit hash, computed with numpy over
  the documents' bytes at once (no Python loop per word), and ``n`` consecutive word hashes combine
  into one n-gram hash. The fastText-style classifier and DSIR reduce them to buckets (the hashing
  trick); MinHash uses word 5-grams as its shingles. The hashes are the same in every process and
  on every machine (Python's own ``hash`` of a string is salted per process: useless for sharding).
* **A Kneser-Ney language model** (:class:`KneserNeyLM`): the smoothing KenLM uses, here in plain
  Python dictionaries, and a :class:`PerplexityFilter` stage that keeps documents the model finds
  likely (CCNet, Wenzek et al. 2020, keeps the head of Common Crawl by a Wikipedia-trained KenLM).

>>> h, offsets = word_hashes(["a b c", "a b"])
>>> offsets.tolist(), bool(h[0] == h[3]), bool(h[1] == h[4])
([0, 3, 5], True, True)
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from lmfs.data import Doc, Stage

# ---------------------------------------------------------------- stable 64-bit hashes with numpy

_U64 = np.uint64
_BASE = 0x100000001B3           # an odd multiplier for the polynomial hash of a word's bytes
_BASE_INV = pow(_BASE, -1, 2**64)  # its inverse modulo 2^64 (exists because the base is odd)
_MIX = 0x9E3779B97F4A7C15        # combines word hashes into n-gram hashes
_powers: dict[int, tuple[np.ndarray, np.ndarray]] = {}


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, elementwise on a ``uint64`` array (returns a new array).

    Every input bit flips each output bit with probability about 1/2, which repairs the weak low
    bits of a polynomial hash modulo 2^64 before they are used as buckets or MinHash inputs.
    """
    h = np.asarray(h, dtype=_U64).copy()
    with np.errstate(over="ignore"):
        h ^= h >> _U64(33)
        h *= _U64(0xFF51AFD7ED558CCD)
        h ^= h >> _U64(33)
        h *= _U64(0xC4CEB93FE1A85A53)
        h ^= h >> _U64(33)
    return h


def _base_powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(B^j, B^-j)`` modulo 2^64 for ``j < n``, cached and grown by doubling."""
    size = max((k for k in _powers if k >= n), default=None)
    if size is None:
        size = 1 << max(16, (n - 1).bit_length())
        _powers.clear()
        _powers[size] = (_cumpow(_BASE, size), _cumpow(_BASE_INV, size))
    return _powers[size]


def _cumpow(base: int, n: int) -> np.ndarray:
    """``[1, base, base^2, ...]`` (``n`` values) modulo 2^64."""
    out = np.full(n, base, dtype=_U64)
    out[0] = 1
    with np.errstate(over="ignore"):
        return np.cumprod(out, dtype=_U64)


def word_hashes(docs: Sequence[str], lower: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of the whitespace-separated words of ``docs``: ``(hashes (W,), offsets (D+1,))``.

    The words of document ``d`` are ``hashes[offsets[d]:offsets[d + 1]]``, in order. Words are runs
    of bytes above 32 (space, tabs, newlines and the other control characters separate words), as
    ``str.split()`` cuts ordinary ASCII text. ``lower`` lower-cases
    first. How: the documents' UTF-8 bytes are joined with spaces into one array; a prefix sum of
    ``byte_j · B^j`` gives the polynomial hash of any span ``[s, e)`` as
    ``(H[e] - H[s]) · B^-s`` (modulo 2^64), and :func:`fmix64` mixes it. Equal words, equal hashes,
    whichever document and position they come from.
    """
    encoded = [(d.lower() if lower else d).encode("utf-8", "surrogatepass") for d in docs]
    data = np.frombuffer(b" ".join(encoded) + b" ", dtype=np.uint8)
    space = data <= 32  # space and the control characters (tab, newlines, ...): one SIMD compare
    # A word starts at a non-space byte after a space (or at 0) and ends before the next space.
    starts = np.flatnonzero(~space & np.concatenate(([True], space[:-1])))
    ends = np.flatnonzero(~space[:-1] & space[1:]) + 1
    power, inverse = _base_powers(len(data) + 1)
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(data) + 1, dtype=_U64)
        np.cumsum(np.multiply(data, power[:len(data)], dtype=_U64), out=prefix[1:])
        hashes = fmix64((prefix[ends] - prefix[starts]) * inverse[starts])
    # Which document each word belongs to: documents start where their bytes start.
    doc_starts = np.cumsum([0] + [len(e) + 1 for e in encoded[:-1]]) if encoded else np.zeros(0, np.int64)
    offsets = np.searchsorted(starts, np.append(doc_starts, len(data))).astype(np.int64)
    offsets[-1] = len(starts)
    return hashes, offsets


def ngram_hashes(hashes: np.ndarray, offsets: np.ndarray, n: int,
                 short: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the ``n`` consecutive words starting at each position, within each document.

    ``hashes``/``offsets`` as from :func:`word_hashes`; returns the same layout for n-grams. A
    document of ``L >= n`` words has ``L - n + 1`` n-grams; one with ``1 <= L < n`` words gets one
    n-gram of all its words when ``short`` (so two identical short documents still share a shingle),
    none otherwise. The hash is order-sensitive: ``h = (...(w_1·M + w_2)·M + ...) + w_n``, mixed.
    """
    if n < 1:
        raise ValueError(f"n-gram length must be >= 1, got {n}")
    lengths = np.diff(offsets)
    if n == 1:
        return hashes.copy(), offsets.copy()
    W = len(hashes)
    padded = np.concatenate((hashes, np.zeros(n - 1, _U64)))
    # Every position's n-gram over the flat array (contiguous slices, no gathers) ...
    h = padded[:W].copy()
    with np.errstate(over="ignore"):
        for k in range(1, n):
            h *= _U64(_MIX)
            h += padded[k:W + k]
    # ... of which the n-grams that stay inside their document are kept.
    doc = np.repeat(np.arange(len(lengths)), lengths)
    inside = np.arange(W) + n <= offsets[1:][doc]
    counts = np.maximum(lengths - n + 1, 0)
    if short and ((lengths > 0) & (lengths < n)).any():
        # A short document's one n-gram: its words, then zeros where the n-gram runs past its end.
        few = np.flatnonzero((lengths > 0) & (lengths < n))
        pos = offsets[few][:, None] + np.arange(n)
        tail = np.where(pos < offsets[few + 1][:, None], padded[np.minimum(pos, W)], _U64(0))
        short_h = tail[:, 0].copy()
        with np.errstate(over="ignore"):
            for k in range(1, n):
                short_h = short_h * _U64(_MIX) + tail[:, k]
        h[offsets[few]] = short_h
        inside[offsets[few]] = True
        counts[few] = 1
    new_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    return fmix64(h[inside]), new_offsets


def hashed_features(docs: Sequence[str], n_buckets: int, ngrams: Iterable[int] = (1, 2),
                    lower: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The hashing trick: bucket ids of every word n-gram (``n`` in ``ngrams``) of each document.

    Returns ``(ids (F,), offsets (D+1,))``, the ids of document ``d`` being
    ``ids[offsets[d]:offsets[d + 1]]`` (unigrams first, then bigrams, ...). An n-gram's bucket is
    its hash modulo ``n_buckets``: the vocabulary never has to be stored, at the price of a few
    n-grams sharing a bucket. This layout is what ``torch.nn.EmbeddingBag`` takes.
    """
    words, offsets = word_hashes(docs, lower=lower)
    parts = [ngram_hashes(words, offsets, n, short=False) for n in ngrams]
    counts = sum(np.diff(o) for _, o in parts)
    out_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    ids = np.empty(out_offsets[-1], dtype=np.int64)
    filled = out_offsets[:-1].copy()
    for h, o in parts:  # place each n-gram order's block after the previous orders' blocks
        lengths = np.diff(o)
        doc = np.repeat(np.arange(len(lengths)), lengths)
        ids[filled[doc] + np.arange(len(h)) - o[doc]] = (h % _U64(n_buckets)).astype(np.int64)
        filled += lengths
    return ids, out_offsets


def bucket_counts(ids: np.ndarray, offsets: np.ndarray, n_buckets: int):
    """The documents as a sparse count matrix ``(D, n_buckets)`` (``scipy.sparse.csr_matrix``)."""
    from scipy.sparse import csr_matrix

    doc = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return csr_matrix((np.ones(len(ids), np.float64), (doc, ids)), shape=(len(offsets) - 1, n_buckets))


# ---------------------------------------------------------------- the Kneser-Ney language model

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks: ``"Hi, there!"`` -> ``['hi', ',', 'there', '!']``."""
    return _WORD.findall(text.lower())


def _discount(counts: Iterable[int]) -> float:
    """Ney's estimate of the absolute discount, ``D = n1 / (n1 + 2·n2)`` (``n_k``: n-grams seen k times)."""
    freq = Counter(counts)
    n1, n2 = freq.get(1, 0), freq.get(2, 0)
    return n1 / (n1 + 2 * n2) if n1 and n2 else 0.75


class KneserNeyLM:
    """An interpolated Kneser-Ney n-gram language model over words (Chen and Goodman's form).

    At the highest order ``N`` the probability of word ``w`` after the ``N-1`` words ``h`` is

        P(w | h) = max(c(h w) - D, 0) / c(h·)  +  D · N1+(h ·) / c(h·) · P_lower(w | h')

    with ``c`` the counts, ``h'`` the context without its first word, ``N1+(h ·)`` the number of
    distinct words seen after ``h``: the mass taken by the discount ``D`` from every seen word is
    handed to the lower order. The lower orders use the same formula with **continuation counts**
    ``N1+(· h w)`` (in how many distinct contexts the n-gram appeared) in place of ``c``: "Francisco"
    is frequent but only ever after "San", so as a back-off it should be rare. The unigram level
    interpolates with the uniform distribution over the vocabulary, so every word, even an unseen
    one (``<unk>``), gets some probability. An unseen context passes straight to the lower order.

    Sentences are the documents' lines, padded with ``N-1`` ``<s>`` and ended by ``</s>``;
    ``<s>`` is never predicted. The vocabulary is the training words, ``</s>`` and ``<unk>``.

    >>> lm = KneserNeyLM(order=2).fit(["the cat sat", "the dog sat"])
    >>> round(sum(lm.prob(w, ("the",)) for w in lm.vocab), 6)
    1.0
    """

    def __init__(self, order: int = 3):
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        self.order = order

    def sentences(self, text: str) -> list[list[str]]:
        """The padded sentences of a document: one per non-empty line."""
        pad = [BOS] * (self.order - 1)
        return [pad + words + [EOS] for words in map(tokenize, text.splitlines()) if words]

    def fit(self, texts: Iterable[str]) -> KneserNeyLM:
        """Count n-grams of every order in ``texts`` and derive the smoothed model."""
        N = self.order
        top: Counter = Counter()
        for text in texts:
            for sent in self.sentences(text):
                top.update(tuple(sent[i:i + N]) for i in range(len(sent) - N + 1))
        if not top:
            raise ValueError("the training texts hold no words: give the model some text")
        # counts[k] maps a (k+1)-gram to its count: raw counts at the top order, continuation counts
        # (distinct left extensions) below it.
        counts: list[Counter] = [Counter() for _ in range(N)]
        counts[N - 1] = top
        for k in range(N - 1, 0, -1):
            for gram in counts[k]:
                counts[k - 1][gram[1:]] += 1
        self.vocab = sorted({g[-1] for g in counts[0]} | {EOS, UNK})
        self._index = set(self.vocab)
        self.discounts = [_discount(c.values()) for c in counts]
        # Per order and context: the total count and the number of distinct followers.
        self._total: list[dict] = []
        self._types: list[dict] = []
        for c in counts:
            total, types = defaultdict(int), defaultdict(int)
            for gram, n in c.items():
                total[gram[:-1]] += n
                types[gram[:-1]] += 1
            self._total.append(dict(total))
            self._types.append(dict(types))
        self._counts = [dict(c) for c in counts]
        self._cache: dict = {}
        return self

    def prob(self, word: str, context: Sequence[str] = ()) -> float:
        """``P(word | context)``; only the last ``order - 1`` words of ``context`` matter."""
        if not hasattr(self, "vocab"):
            raise RuntimeError("the model is not trained: call fit(texts) first")
        word = word if word in self._index else UNK
        context = tuple(context)[len(context) - self.order + 1:] if self.order > 1 else ()
        if len(context) < self.order - 1:  # a short context is padded as at a sentence start
            context = (BOS,) * (self.order - 1 - len(context)) + context
        return self.interpolated_prob(word, context)

    def interpolated_prob(self, word: str, context: tuple) -> float:
        """Interpolated Kneser-Ney: the discounted count of ``context + word`` plus the mass the
        discounts freed, ``D · types(context) / total``, spread by the next lower order's probability
        (at the lowest order: uniform). ``context`` is exactly ``order - 1`` words (BOS-padded)."""
        key = (word, context)
        if key in self._cache:
            return self._cache[key]
        k = len(context)  # order index: counts[k] holds (k+1)-grams
        lower = self.interpolated_prob(word, context[1:]) if k else 1.0 / len(self.vocab)
        total = self._total[k].get(context, 0)
        if total == 0:  # never seen this context: all the mass goes to the lower order
            p = lower
        else:
            D = self.discounts[k]
            n = self._counts[k].get(context + (word,), 0)
            p = (max(n - D, 0.0) + D * self._types[k][context] * lower) / total
        if len(self._cache) < 2_000_000:
            self._cache[key] = p
        return p

    def logprob(self, text: str) -> tuple[float, int]:
        """``(sum of natural-log probabilities, number of predicted tokens)`` of a document."""
        total, n = 0.0, 0
        N = self.order
        for sent in self.sentences(text):
            for i in range(N - 1, len(sent)):
                total += math.log(self.prob(sent[i], sent[i - N + 1:i]))
                n += 1
        return total, n

    def perplexity(self, text: str) -> float:
        """``exp(-mean log-probability)`` per token (``</s>`` included); ``inf`` for an empty text."""
        total, n = self.logprob(text)
        return math.exp(-total / n) if n else math.inf


class PerplexityFilter(Stage):
    """Keep documents whose perplexity under ``lm`` is at most ``max_perplexity``.

    ``lm`` is trained on the target data (say, Wikipedia-like text); raw web text that reads like
    it scores low. The perplexity is stored in ``doc.meta["perplexity"]``. Removal reasons:
    ``"perplexity"`` and ``"no words"``.
    """
    name = "perplexity"

    def __init__(self, lm: KneserNeyLM, max_perplexity: float):
        super().__init__()
        self.lm, self.max_perplexity = lm, max_perplexity

    def apply(self, doc: Doc) -> Doc | str:
        ppl = self.lm.perplexity(doc.text)
        if not math.isfinite(ppl):
            return "no words"
        doc.meta["perplexity"] = round(ppl, 2)
        self.stats.counts["scored"] += 1
        return doc if ppl <= self.max_perplexity else "perplexity"
