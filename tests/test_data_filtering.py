"""Filtering (lecture 14): Kneser-Ney n-gram LM, hashed features, the fastText-style classifier, DSIR."""

import math
from collections import Counter

import numpy as np
import pytest

from lmfs.data import Doc
from lmfs.data.classifier import HashedLinearClassifier, QualityFilter, precision_recall
from lmfs.data.corpora import generate_stories, pydoc_text
from lmfs.data.dsir import DSIR, kl_divergence
from lmfs.data.ngram import (EOS, UNK, KneserNeyLM, PerplexityFilter, bucket_counts, hashed_features,
                             tokenize)

STORIES = generate_stories(150_000, seed=0).split("<|endoftext|>")
PYDOC = [t for t in pydoc_text().split("<|endoftext|>") if len(t) > 200]  # about 80 topics


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_kneser_ney_sums_to_one_over_the_vocabulary(order):
    lm = KneserNeyLM(order).fit(STORIES[:60])
    contexts = [(), ("the",), ("lily", "went"), ("once", "upon", "a"), ("zzz", "qqq", "xxx"), ("<s>", "<s>", "<s>")]
    for ctx in contexts:
        assert abs(sum(lm.prob(w, ctx) for w in lm.vocab) - 1) < 1e-9, ctx
    assert EOS in lm.vocab and UNK in lm.vocab and lm.prob("never-seen-word", ("the",)) > 0


def test_kneser_ney_unigram_closed_form():
    # Order 1: P(w) = (max(c(w) - D, 0) + D * types / V) / N, straight from the counts.
    texts = ["a a a b", "b c", "a d"]
    lm = KneserNeyLM(1).fit(texts)
    counts = Counter(w for t in texts for w in tokenize(t) + [EOS])
    N, V = sum(counts.values()), len(counts) + 1          # + <unk>
    n1 = sum(c == 1 for c in counts.values())
    n2 = sum(c == 2 for c in counts.values())
    D = n1 / (n1 + 2 * n2)
    for w in ["a", "b", "c", EOS, UNK]:
        want = (max(counts[w] - D, 0) + D * len(counts) / V) / N
        assert abs(lm.prob(w) - want) < 1e-12, w


def test_kneser_ney_continuation_counts():
    # "francisco" is frequent but follows only "san": as a back-off (unseen context) it is rarer
    # than "glasses", which follows many different words, though counted less often.
    texts = ["san francisco"] * 6 + [f"{w} glasses" for w in ["reading", "sun", "wine", "safety"]]
    lm = KneserNeyLM(2).fit(texts)
    assert lm.prob("francisco", ("new",)) < lm.prob("glasses", ("new",))


def test_perplexity_filter_prefers_in_domain_text():
    lm = KneserNeyLM(3).fit(STORIES[:80])
    held_out = STORIES[80:100]
    assert np.median([lm.perplexity(t) for t in held_out]) < np.median([lm.perplexity(t) for t in PYDOC[:20]])
    stage = PerplexityFilter(lm, max_perplexity=float(np.median([lm.perplexity(t) for t in held_out])) * 2)
    kept = [stage(Doc(f"s{i}", t)) for i, t in enumerate(held_out)] + [stage(Doc(f"p{i}", t)) for i, t in enumerate(PYDOC[:20])]
    assert sum(k is not None for k in kept[:20]) >= 18 and sum(k is not None for k in kept[20:]) <= 2
    assert stage.stats.seen == 40 and stage.stats.removed["perplexity"] == 40 - stage.stats.kept
    assert stage(Doc("empty", "")) is None and stage.stats.removed["no words"] == 1


def test_hashed_features_layout():
    docs = ["The cat sat", "", "a"]
    ids, offsets = hashed_features(docs, 64, ngrams=(1, 2))
    assert offsets.tolist() == [0, 5, 5, 6] and ids.min() >= 0 and ids.max() < 64
    # Lower-casing: "The cat sat" and "the CAT sat" have the same features.
    again, _ = hashed_features(["the CAT sat"], 64)
    assert again.tolist() == ids[:5].tolist()
    counts = bucket_counts(ids, offsets, 64)
    assert counts.shape == (3, 64) and np.asarray(counts.sum(axis=1)).ravel().tolist() == [5, 0, 1]


def test_classifier_precision_recall():
    texts = STORIES[:76] + PYDOC[:76]
    labels = [1] * 76 + [0] * 76
    clf = HashedLinearClassifier(n_buckets=1 << 14, dim=8, epochs=4, seed=0).fit(texts[::2], labels[::2])
    scores = clf.score(texts[1::2])
    truth = np.array(labels[1::2]) == 1
    pr = precision_recall(scores, truth, [0.5])
    assert pr["precision"][0] > 0.95 and pr["recall"][0] > 0.95
    # Brute force of the counting, at several thresholds.
    t = np.array([0.0, 0.3, 0.9, 1.1])
    pr = precision_recall(scores, truth, t)
    for k, th in enumerate(t):
        kept = scores >= th
        assert pr["kept"][k] == kept.sum()
        assert pr["recall"][k] == (kept & truth).sum() / truth.sum()
        assert pr["precision"][k] == ((kept & truth).sum() / kept.sum() if kept.any() else 1.0)
    stage = QualityFilter(clf, 0.5)
    assert stage(Doc("s", STORIES[1])) is not None and stage(Doc("p", PYDOC[1])) is None
    assert stage.stats.removed["low quality"] == 1


def test_dsir_weights_and_resampling():
    target, raw = STORIES[100:160], STORIES[:50] + PYDOC[:76]
    dsir = DSIR(n_buckets=4096).fit(target, raw)
    logw = dsir.log_importance(raw)
    # Brute force: sum over each document's n-gram buckets of log p - log q.
    ids, offsets = hashed_features(raw, 4096)
    brute = [sum(dsir.log_ratio[ids[offsets[d]:offsets[d + 1]]]) for d in range(len(raw))]
    np.testing.assert_allclose(logw, brute, rtol=1e-9, atol=1e-9)
    chosen = dsir.resample(raw, 40, seed=0)
    assert len(set(chosen.tolist())) == 40 and (chosen < 50).mean() > 0.9  # mostly the stories
    random_pick = np.random.default_rng(0).choice(len(raw), 40, replace=False)
    assert (kl_divergence(dsir.p, dsir.distribution([raw[i] for i in chosen]))
            < kl_divergence(dsir.p, dsir.distribution([raw[i] for i in random_pick])))
    assert math.isclose(kl_divergence(dsir.p, dsir.p), 0.0, abs_tol=1e-12)


# ------------------------------------------------------------------ hard negatives and average precision

def test_average_precision_and_curve_match_sklearn():
    from sklearn.metrics import average_precision_score, precision_recall_curve

    from lmfs.data.classifier import average_precision

    rng = np.random.default_rng(0)
    for case in range(60):
        n = int(rng.integers(2, 80))
        # Half the cases with many ties (scores on a coarse grid), where the step curve's shape matters.
        scores = rng.integers(0, 5, n) / 4 if case % 2 else rng.random(n)
        truth = rng.random(n) < 0.4
        if not truth.any():
            continue
        assert math.isclose(average_precision(scores, truth), average_precision_score(truth, scores), rel_tol=1e-12)
        precision, recall, thresholds = precision_recall_curve(truth, scores)
        ours = precision_recall(scores, truth, thresholds)
        np.testing.assert_allclose(ours["precision"], precision[:-1], rtol=1e-12)
        np.testing.assert_allclose(ours["recall"], recall[:-1], rtol=1e-12)
    assert average_precision([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    with pytest.raises(ValueError, match="positive"):
        average_precision([0.1, 0.2], [False, False])


def test_bigram_sampler_draws_seen_pairs_at_their_frequencies():
    from lmfs.data.negatives import BigramSampler

    source = STORIES[:40]
    sampler = BigramSampler(source)
    texts = sampler.sample([30, 1, 120], np.random.default_rng(0))
    assert [len(t.split()) for t in texts] == [30, 1, 120]
    words = " ".join(source).split()
    pairs = set(zip(words, words[1:]))                  # brute force over the stream
    assert all(set(zip(t.split(), t.split()[1:])) <= pairs for t in texts)
    assert texts == sampler.sample([30, 1, 120], np.random.default_rng(0))      # a seed fixes the text
    # "a" is followed by "b" three times and by "c" once: P(b | a) = 3/4.
    toy = BigramSampler(["a b a b a b a c z"])
    follow = Counter()
    for text in toy.sample([400] * 20, np.random.default_rng(1)):
        w = text.split()
        follow.update(nxt for cur, nxt in zip(w, w[1:]) if cur == "a")
    n = follow["b"] + follow["c"]
    assert set(follow) == {"b", "c"} and abs(follow["b"] / n - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)


def test_near_misses_keep_most_of_the_good_text():
    from lmfs.data.negatives import BOILERPLATE, near_miss, split_sentences

    story, rng = STORIES[3], np.random.default_rng(0)
    shuffled = near_miss(story, "shuffled", rng)
    assert Counter(shuffled.split()) == Counter(story.split()) and shuffled.count("\n\n") == story.count("\n\n")
    assert sorted(s for p in shuffled.split("\n\n") for s in split_sentences(p)) == \
        sorted(s for p in story.split("\n\n") for s in split_sentences(p))
    boiler = near_miss(story, "boilerplate", rng).split("\n\n")
    assert [p for p in boiler if p not in BOILERPLATE] == story.split("\n\n") and 3 <= len(boiler) - 2 <= 6
    truncated = near_miss(story, "truncated", rng)
    assert story.startswith(truncated) and 0.1 < len(truncated.split()) / len(story.split()) < 0.5
    lines = near_miss(story, "repeated", rng).split("\n")
    assert lines[0] == story.split("\n\n")[0] and 5 <= len(lines) - 1 <= 12 and len(set(lines[1:])) == 1
    assert lines[1] in split_sentences(lines[0])
    with pytest.raises(ValueError, match="near-miss kind"):
        near_miss(story, "rotated", rng)


def test_negatives_mix():
    from lmfs.data.negatives import KINDS, negatives

    texts, kinds = negatives(STORIES[:30], {"bigram salad": 5, "shuffled": 3, "word salad": 2},
                             np.random.default_rng(0))
    assert Counter(kinds) == {"bigram salad": 5, "shuffled": 3, "word salad": 2} and len(texts) == 10
    texts, kinds = negatives(STORIES[:30], 2, np.random.default_rng(0))
    assert Counter(kinds) == {k: 2 for k in KINDS} and all(t.strip() for t in texts)
    with pytest.raises(ValueError, match="unknown kinds"):
        negatives(STORIES[:30], {"gibberish": 1}, np.random.default_rng(0))
