"""Language identification: a hashed character-n-gram linear classifier, and a pre-trained one.

Which language a page is in shows in its short character sequences: "the ", "sch", "ção", "ий ".
fastText's language identifier (Joulin et al., 2017; used by CCNet, RefinedWeb, FineWeb) and
langid.py (Lui & Baldwin, 2012; ``py3langid`` ships its model in the wheel) are both linear models
over such n-grams. The version here:

1. **features**: every character 1- to 4-gram of the text (with a space added at each end, so word
   starts and ends are n-grams too), *hashed* into one of ``n_buckets`` ids — no vocabulary to
   store, unseen n-grams still land somewhere, collisions cost little accuracy.
2. **model**: fastText's, :class:`lmfs.data.classifier.HashedLinearClassifier` (the quality
   filter of lecture 14 is the same model over word n-grams): the mean of the embeddings of the
   text's n-grams (the mean, so long and short texts look alike), a linear layer, softmax over
   languages, trained with cross-entropy.

Hashing is vectorised with numpy over the code points, so a page costs a few array operations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from lmfs.data import Doc, Stage
from lmfs.data.classifier import HashedLinearClassifier

_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant (golden ratio): mixes code points well


def char_ngram_buckets(text: str, n_buckets: int, orders: Sequence[int] = (1, 2, 3, 4)) -> np.ndarray:
    """The hashed character n-grams of ``text``: one bucket id per n-gram occurrence, ``(k,)`` int64.

    Deterministic across processes and machines (no Python ``hash``); empty for an empty text.
    """
    codes = np.frombuffer((" " + text.lower() + " ").encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    hashes = []
    for n in orders:
        if len(codes) < n:
            continue
        h = np.full(len(codes) - n + 1, np.uint64(n))  # the order is hashed in: "a" and "a " differ
        for j in range(n):
            h = (h ^ codes[j:len(codes) - n + 1 + j]) * _MULT
        hashes.append(h ^ (h >> np.uint64(29)))
    if not hashes:
        return np.zeros(0, np.int64)
    return (np.concatenate(hashes) % np.uint64(n_buckets)).astype(np.int64)


def char_ngram_features(texts: Sequence[str], n_buckets: int,
                        orders: Sequence[int] = (1, 2, 3, 4)) -> tuple[np.ndarray, np.ndarray]:
    """:func:`char_ngram_buckets` of each text laid out as ``(ids (F,), offsets (D+1,))``, the
    feature layout of :class:`~lmfs.data.classifier.HashedLinearClassifier`."""
    buckets = [char_ngram_buckets(t, n_buckets, orders) for t in texts]
    offsets = np.concatenate(([0], np.cumsum([len(b) for b in buckets]))).astype(np.int64)
    return (np.concatenate(buckets) if buckets else np.zeros(0, np.int64)), offsets


class HashedLangID:
    """A trained language identifier: a :class:`~lmfs.data.classifier.HashedLinearClassifier`
    over hashed character n-grams, asked one text at a time."""

    def __init__(self, classifier: HashedLinearClassifier):
        self.classifier = classifier

    @property
    def languages(self) -> list[str]:
        return self.classifier.classes_

    def probabilities(self, text: str) -> np.ndarray:
        """Softmax over :attr:`languages`, ``(n_languages,)``."""
        return self.classifier.predict_proba([text])[0]

    def predict(self, text: str) -> tuple[str, float]:
        """``(language, probability)`` of the most likely language."""
        p = self.probabilities(text)
        best = int(p.argmax())
        return self.languages[best], float(p[best])


def train_langid(texts: Sequence[str], labels: Sequence[str], n_buckets: int = 1 << 16, epochs: int = 30,
                 lr: float = 0.05, batch_size: int = 64, seed: int = 0, dim: int = 16,
                 orders: Sequence[int] = (1, 2, 3, 4)) -> HashedLangID:
    """Fit a :class:`HashedLangID` to ``texts`` labelled with language codes."""
    classifier = HashedLinearClassifier(n_buckets, dim, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                                        features=functools.partial(char_ngram_features, orders=tuple(orders)))
    return HashedLangID(classifier.fit(texts, labels))


def _py3langid(languages: tuple[str, ...] | None = None):
    """The ``py3langid`` identifier, loaded once per process; restricted to ``languages`` if given
    (a shallow copy of the loaded one, so the full model is shared)."""
    import copy

    from py3langid.langid import MODEL_FILE, LanguageIdentifier
    if None not in _PY3LANGID:  # loading the model takes a moment: once per process
        _PY3LANGID[None] = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    if languages not in _PY3LANGID:
        restricted = copy.copy(_PY3LANGID[None])
        restricted.set_languages(list(languages))
        _PY3LANGID[languages] = restricted
    return _PY3LANGID[languages]


def py3langid_predict(text: str, languages: Sequence[str] | None = None) -> tuple[str, float]:
    """``py3langid``'s answer (its model ships in the wheel: :func:`py3langid_languages`), probability
    normalised; ``languages`` restricts the choice to those codes."""
    lang, prob = _py3langid(None if languages is None else tuple(sorted(languages))).classify(text)
    return lang, float(prob)


def py3langid_languages() -> list[str]:
    """The distinct language codes ``py3langid``'s model can answer."""
    return sorted(set(_py3langid().nb_classes))


_PY3LANGID: dict = {}


class LanguageFilter(Stage):
    """Sets ``Doc.lang``/``lang_score`` with ``identify`` (text -> (language, probability)) and
    removes documents not in ``keep`` (``language xx``) or identified with probability below
    ``min_score`` (``low confidence``). ``stats.counts`` counts every language seen."""
    name = "langid"

    def __init__(self, identify: Callable[[str], tuple[str, float]], keep: Sequence[str] = ("en",),
                 min_score: float = 0.5) -> None:
        super().__init__()
        self.identify, self.keep, self.min_score = identify, tuple(keep), min_score

    def apply(self, doc: Doc) -> Doc | str:
        doc.lang, doc.lang_score = self.identify(doc.text)
        self.stats.counts[f"lang {doc.lang}"] += 1
        if doc.lang not in self.keep:
            return f"language {doc.lang}"
        if doc.lang_score < self.min_score:
            return "low confidence"
        return doc
