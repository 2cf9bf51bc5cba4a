"""A fastText-style classifier: hashed word n-grams, averaged embeddings, one linear layer.

fastText (Joulin et al., 2017) classifies a document by averaging the embeddings of its words and
word n-grams and applying a linear layer and a softmax: a linear model of bag-of-n-gram features,
factored through a small dimension ``dim``. There is no vocabulary: every n-gram is hashed into
one of ``n_buckets`` rows (the hashing trick, :func:`lmfs.data.ngram.hashed_features`), so the model
has a fixed size and trains and runs at millions of documents per CPU-hour. Quality filters
(GPT-3's, DCLM's), language identifiers and toxicity filters are all this model with other labels.

Filtering recipe (lecture 14): positives from the target data T (well-edited text), negatives
from the raw data R; keep the raw documents the classifier scores as T-like. How good the filter
is: :func:`precision_recall` at each threshold.

>>> clf = HashedLinearClassifier(n_buckets=1 << 12, dim=8, epochs=30, seed=0)
>>> clf = clf.fit(["good text here", "spam spam buy now"] * 8, [1, 0] * 8)
>>> clf.predict(["good text", "buy spam now"]).tolist()
[1, 0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from lmfs.data import Doc, Stage
from lmfs.data.ngram import hashed_features


class HashedLinearClassifier:
    """Bag of hashed word n-grams -> mean embedding (``dim``) -> linear -> softmax over the labels.

    ``fit(texts, labels)`` trains with AdamW on mini-batches; labels are any hashable values
    (``classes_`` keeps their sorted order). ``predict_proba`` returns ``(len(texts), n_classes)``.
    """

    def __init__(self, n_buckets: int = 1 << 18, dim: int = 16, ngrams: Sequence[int] = (1, 2),
                 epochs: int = 5, lr: float = 0.05, batch_size: int = 64, seed: int = 0,
                 features: Callable[[Sequence[str], int], tuple[np.ndarray, np.ndarray]] | None = None):
        self.n_buckets, self.dim, self.ngrams = n_buckets, dim, tuple(ngrams)
        self.epochs, self.lr, self.batch_size, self.seed = epochs, lr, batch_size, seed
        # features(texts, n_buckets) -> (ids, offsets): hashed word n-grams unless told otherwise
        # (the language identifier passes character n-grams, lmfs.data.langid).
        self.features = features

    def _features(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.features is None:
            ids, offsets = hashed_features(texts, self.n_buckets, self.ngrams)
        else:
            ids, offsets = self.features(texts, self.n_buckets)
        return torch.from_numpy(ids), torch.from_numpy(offsets)

    def logits(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``(D, n_classes)`` from hashed features; ``offsets`` has ``D + 1`` cut points.

        The EmbeddingBag takes the mean of each document's (ragged) list of bucket rows in one
        call; an empty document averages to zeros and gets the bias alone.
        """
        return self.linear(self.embedding(ids, offsets))

    def fit(self, texts: Sequence[str], labels: Sequence) -> HashedLinearClassifier:
        if len(texts) != len(labels) or not len(texts):
            raise ValueError(f"need as many labels as texts (and some of each), got {len(texts)} and {len(labels)}")
        self.classes_ = sorted(set(labels))
        if len(self.classes_) < 2:
            raise ValueError(f"need at least two classes to tell apart, got only {self.classes_}")
        index = {c: i for i, c in enumerate(self.classes_)}
        y = torch.tensor([index[v] for v in labels])
        generator = torch.Generator().manual_seed(self.seed)
        torch.manual_seed(self.seed)
        self.embedding = torch.nn.EmbeddingBag(self.n_buckets, self.dim, mode="mean", include_last_offset=True)
        torch.nn.init.uniform_(self.embedding.weight, -1 / self.dim, 1 / self.dim)
        self.linear = torch.nn.Linear(self.dim, len(self.classes_))
        params = list(self.embedding.parameters()) + list(self.linear.parameters())
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.0)
        ids, offsets = self._features(texts)
        for _ in range(self.epochs):
            for batch in torch.randperm(len(texts), generator=generator).split(self.batch_size):
                b_ids, b_offsets = _select(ids, offsets, batch)
                loss = torch.nn.functional.cross_entropy(self.logits(b_ids, b_offsets), y[batch])
                opt.zero_grad()
                loss.backward()
                opt.step()
        return self

    @torch.no_grad()
    def predict_proba(self, texts: Sequence[str]) -> np.ndarray:
        if not hasattr(self, "classes_"):
            raise RuntimeError("the classifier is not trained: call fit(texts, labels) first")
        ids, offsets = self._features(texts)
        return torch.softmax(self.logits(ids, offsets), dim=-1).numpy()

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        return np.array(self.classes_)[self.predict_proba(texts).argmax(axis=1)]

    def score(self, texts: Sequence[str], positive=1) -> np.ndarray:
        """The probability of the ``positive`` class for each text."""
        return self.predict_proba(texts)[:, self.classes_.index(positive)]


def _select(ids: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The features of documents ``rows`` as a new ``(ids, offsets)`` pair (offsets has D+1 entries)."""
    starts, ends = offsets[rows], offsets[rows + 1]
    lengths = ends - starts
    new_offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    new_offsets[1:] = torch.cumsum(lengths, 0)
    doc = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    return ids[starts[doc] + torch.arange(int(new_offsets[-1])) - new_offsets[doc]], new_offsets


def precision_recall(scores: np.ndarray, positive: np.ndarray, thresholds) -> dict[str, np.ndarray]:
    """Precision and recall of "keep if score >= t" for each threshold ``t``.

    ``positive``: True where a document truly belongs to the target. Precision: kept documents that
    are positive / kept (1.0 when nothing is kept); recall: kept positives / all positives.
    """
    scores, positive = np.asarray(scores), np.asarray(positive, dtype=bool)
    t = np.asarray(thresholds, dtype=np.float64)
    kept = scores[None, :] >= t[:, None]
    tp = (kept & positive).sum(1)
    n_kept = kept.sum(1)
    precision = np.where(n_kept > 0, tp / np.maximum(n_kept, 1), 1.0)
    recall = tp / max(int(positive.sum()), 1)
    return dict(threshold=t, precision=precision, recall=recall, kept=n_kept)


def average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    """The area under the step-shaped precision-recall curve: ``Σ_k (R_k - R_{k-1}) · P_k``.

    ``k`` runs over the distinct scores from the highest down, ``P_k`` and ``R_k`` being the
    precision and recall of "keep if score >= the k-th score" (``R_0 = 0``). 1.0 for a ranking that
    puts every positive first; about the share of positives for a random one.
    """
    scores, positive = np.asarray(scores, dtype=np.float64), np.asarray(positive, dtype=bool)
    if not positive.any():
        raise ValueError("average precision needs at least one positive document")
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], positive[order]
    last = np.append(s[1:] != s[:-1], True)  # the last document of each run of equal scores
    tp, kept = np.cumsum(y)[last], np.flatnonzero(last) + 1
    recall = tp / y.sum()
    return float(np.sum(np.diff(recall, prepend=0.0) * tp / kept))


class QualityFilter(Stage):
    """Keep documents whose classifier probability of ``positive`` is at least ``threshold``.

    The score goes to ``doc.meta["quality"]``; the removal reason is ``"low quality"``.
    """
    name = "quality"

    def __init__(self, classifier: HashedLinearClassifier, threshold: float = 0.5, positive=1):
        super().__init__()
        self.classifier, self.threshold, self.positive = classifier, threshold, positive

    def apply(self, doc: Doc) -> Doc | str:
        score = float(self.classifier.score([doc.text], self.positive)[0])
        doc.meta["quality"] = round(score, 4)
        return doc if score >= self.threshold else "low quality"
