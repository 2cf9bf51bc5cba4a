"""Quality rules: C4's line filters (Raffel et al., 2020) and Gopher's document rules (Rae et al., 2021).

Hand-written rules remove most of what is not prose from extracted web text, cheaply and with
reasons a person can read. Two published sets, with their published thresholds:

**C4** (Raffel et al., 2020, section 2.2) works line by line: keep only lines that end in terminal
punctuation and hold at least 3 words; drop lines mentioning JavaScript and cookie/policy
boilerplate; drop the whole page when it has fewer than 5 sentences, contains "lorem ipsum" or a
curly bracket (code), or a word from a blocklist. (C4 also removed Wikipedia-style citation marks
and deduplicated three-sentence spans; the markers are stripped here, spans are dedup's job.)

**Gopher** (Rae et al., 2021, appendix A.1.1, "MassiveWeb") judges whole documents: 50 to 100,000
words; mean word length 3 to 10 characters; at most 0.1 hash symbols per word, and at most 0.1 ellipses per word (two ratios, each
with its own bound); at most
90% of lines starting with a bullet and 30% ending in an ellipsis; at least 80% of words with a
letter; at least 2 of the stop words *the, be, to, of, and, that, have, with*. And repetition:
duplicate lines at most 30% of lines (20% of characters), duplicate paragraphs likewise; the most
frequent 2-, 3-, 4-gram covering at most 20%, 18%, 16% of the characters; the characters inside
repeated 5- to 10-grams at most 15% down to 10%.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from lmfs.data import Doc, Stage
from lmfs.data.ngram import ngram_hashes


@dataclass(frozen=True)
class GopherThresholds:
    """Rae et al. (2021), appendix A.1.1. A document is removed when a measure is outside its range
    (the bounds themselves pass)."""
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1          # "#" per word, and ("..." / "…") per word: each
    max_bullet_lines: float = 0.9               # fraction of lines starting with a bullet
    max_ellipsis_lines: float = 0.3             # fraction of lines ending with an ellipsis
    min_alpha_words: float = 0.8                # fraction of words holding a letter
    min_stop_words: int = 2
    stop_words: tuple = ("the", "be", "to", "of", "and", "that", "have", "with")
    max_dup_line_fraction: float = 0.3
    max_dup_para_fraction: float = 0.3
    max_dup_line_char_fraction: float = 0.2
    max_dup_para_char_fraction: float = 0.2
    max_top_ngram_char_fraction: dict = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    max_dup_ngram_char_fraction: dict = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10})


BULLETS = ("•", "●", "○", "▪", "■", "-", "*", "‣", "⁃", "◦")
_WORD = re.compile(r"\S+")


def _duplicate_fraction(items: list[str]) -> tuple[float, float]:
    """Fraction of ``items`` (and of their characters) that repeat an earlier item."""
    seen: set[str] = set()
    dup = dup_chars = 0
    for item in items:
        if item in seen:
            dup += 1
            dup_chars += len(item)
        seen.add(item)
    total_chars = sum(len(i) for i in items)
    return dup / max(len(items), 1), dup_chars / max(total_chars, 1)


def _ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """A 64-bit hash of every word ``n``-gram of ``ids`` (word ids), ``(len(ids) - n + 1,)``: one
    document's n-grams by :func:`lmfs.data.ngram.ngram_hashes`."""
    return ngram_hashes(ids.astype(np.uint64), np.array([0, len(ids)]), n, short=False)[0]


def _word_arrays(words: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Word ids (equal words, equal ids; offset so no id is 0) and word lengths in characters."""
    vocab: dict[str, int] = {}
    ids = np.fromiter((vocab.setdefault(w, len(vocab) + 1) for w in words), np.uint64, len(words))
    return ids, np.fromiter(map(len, words), np.int64, len(words))


def top_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters covered by the most frequent word ``n``-gram (its characters times its count)
    over all word characters; 0 when no n-gram occurs twice. Among equally frequent n-grams, the
    longest counts."""
    return _top_ngram_fraction(*_word_arrays(words), n)


def _top_ngram_fraction(ids: np.ndarray, lens: np.ndarray, n: int) -> float:
    if len(ids) < n:
        return 0.0
    _, first, counts = np.unique(_ngram_hashes(ids, n), return_index=True, return_counts=True)
    if counts.max() < 2:
        return 0.0
    gram_chars = np.convolve(lens, np.ones(n, np.int64), "valid")[first]  # characters of each distinct n-gram
    top = np.flatnonzero(counts == counts.max())
    return float((gram_chars[top] * counts[top]).max() / lens.sum())


def dup_ngram_char_fraction(words: list[str], n: int) -> float:
    """Characters of the words inside any word ``n``-gram that occurs more than once (each word
    counted once, however many repeated n-grams cover it) over all word characters."""
    return _dup_ngram_fraction(*_word_arrays(words), n)


def _dup_ngram_fraction(ids: np.ndarray, lens: np.ndarray, n: int) -> float:
    if len(ids) < n:
        return 0.0
    _, inverse, counts = np.unique(_ngram_hashes(ids, n), return_inverse=True, return_counts=True)
    repeated_start = (counts[inverse] > 1).astype(np.int64)
    covered = np.convolve(repeated_start, np.ones(n, np.int64))[:len(ids)] > 0  # word i is in a repeat
    return float(lens[covered].sum() / lens.sum())


def gopher_reasons(text: str, t: GopherThresholds = GopherThresholds()) -> list[str]:
    """Every Gopher rule ``text`` breaks, as short reasons (``[]``: the document is kept).

        >>> gopher_reasons("the cat sat with the dog")
        ['fewer than 50 words']
    """
    words = _WORD.findall(text)
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    reasons = []
    n = len(words)
    if n < t.min_words:
        reasons.append(f"fewer than {t.min_words} words")
    if n > t.max_words:
        reasons.append(f"more than {t.max_words} words")
    if n == 0:
        return reasons
    mean_len = sum(map(len, words)) / n
    if not t.min_mean_word_length <= mean_len <= t.max_mean_word_length:
        reasons.append("mean word length")
    # Gopher bounds each symbol on its own: a page with 0.1 hashes and 0.1 ellipses per word passes.
    hashes, ellipses = text.count("#"), text.count("...") + text.count("…")
    if max(hashes, ellipses) / n > t.max_symbol_word_ratio:
        reasons.append("symbol-to-word ratio")
    if lines and sum(line.startswith(BULLETS) for line in lines) / len(lines) > t.max_bullet_lines:
        reasons.append("bullet lines")
    if lines and sum(line.endswith(("...", "…")) for line in lines) / len(lines) > t.max_ellipsis_lines:
        reasons.append("ellipsis lines")
    if sum(any(c.isalpha() for c in w) for w in words) / n < t.min_alpha_words:
        reasons.append("words without letters")
    lowered = {w.lower().strip(".,;:!?\"'()") for w in words}
    if sum(s in lowered for s in t.stop_words) < t.min_stop_words:
        reasons.append("too few stop words")
    line_frac, line_chars = _duplicate_fraction(lines)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    para_frac, para_chars = _duplicate_fraction(paragraphs)
    if line_frac > t.max_dup_line_fraction or line_chars > t.max_dup_line_char_fraction:
        reasons.append("duplicate lines")
    if para_frac > t.max_dup_para_fraction or para_chars > t.max_dup_para_char_fraction:
        reasons.append("duplicate paragraphs")
    ids, lens = _word_arrays(words)
    for k, limit in t.max_top_ngram_char_fraction.items():
        if _top_ngram_fraction(ids, lens, k) > limit:
            reasons.append(f"top {k}-gram")
            break
    for k, limit in t.max_dup_ngram_char_fraction.items():
        if _dup_ngram_fraction(ids, lens, k) > limit:
            reasons.append(f"duplicate {k}-grams")
            break
    return reasons


class GopherRules(Stage):
    """Removes documents that break a Gopher rule; the reason recorded is the first one broken,
    ``stats.counts`` counts every rule broken."""
    name = "gopher"

    def __init__(self, thresholds: GopherThresholds = GopherThresholds()) -> None:
        super().__init__()
        self.thresholds = thresholds

    def apply(self, doc: Doc) -> Doc | str:
        reasons = gopher_reasons(doc.text, self.thresholds)
        self.stats.counts.update(reasons)
        return reasons[0] if reasons else doc


@dataclass(frozen=True)
class C4Thresholds:
    """Raffel et al. (2020), section 2.2 (the blocklist is empty unless given: C4 used a public list
    of obscene words that is not shipped here)."""
    min_words_per_line: int = 3
    min_sentences: int = 5
    terminal: tuple = (".", "!", "?", '"', "”", "’", "'")
    policy_phrases: tuple = ("terms of use", "privacy policy", "cookie policy", "uses cookies",
                             "use of cookies", "use cookies")
    blocklist: tuple = ()


_CITATION = re.compile(r"\[(?:\d+|citation needed|edit)\]", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)]*(?=\s|$)")


def c4_clean(text: str, t: C4Thresholds = C4Thresholds()) -> tuple[str, Counter, str | None]:
    """C4's rules, line by line in the order of its reference code: ``(kept text, Counter of why
    lines were dropped, why the page is dropped or None)``.

    A line is dropped without terminal punctuation (or ending in an ellipsis), with fewer than
    ``min_words_per_line`` words, mentioning JavaScript or a policy phrase. A kept line containing
    "lorem ipsum", a curly bracket or a blocklisted word drops the page; so do fewer than
    ``min_sentences`` sentences in the kept lines.

        >>> c4_clean("Home | News\\nThe river is high today.\\nPlease enable JavaScript.")
        ('The river is high today.', Counter({'line: no terminal punctuation': 1, 'line: javascript': 1}), 'fewer than 5 sentences')
    """
    kept, dropped, sentences = [], Counter(), 0
    blocked = set(t.blocklist)
    for line in text.split("\n"):
        line = _CITATION.sub("", line).strip()
        if not line:
            continue
        lowered = line.lower()
        if not line.endswith(t.terminal) or line.endswith(("...", "…")):
            dropped["line: no terminal punctuation"] += 1
        elif len(line.split()) < t.min_words_per_line:
            dropped["line: too few words"] += 1
        elif "lorem ipsum" in lowered:
            return "", dropped, "lorem ipsum"
        elif "javascript" in lowered:
            dropped["line: javascript"] += 1
        elif "{" in line:
            return "", dropped, "curly bracket (code)"
        elif any(p in lowered for p in t.policy_phrases):
            dropped["line: policy boilerplate"] += 1
        elif blocked and blocked.intersection(re.findall(r"\w+", lowered)):
            return "", dropped, "blocklisted word"
        else:
            kept.append(line)
            sentences += len(_SENTENCE_END.findall(line))
    if sentences < t.min_sentences:
        return "\n".join(kept), dropped, f"fewer than {t.min_sentences} sentences"
    return "\n".join(kept), dropped, None


class C4Rules(Stage):
    """C4's rules: lines cleaned (``stats.counts`` counts dropped lines by reason), the page removed
    for a page-level reason."""
    name = "c4"

    def __init__(self, thresholds: C4Thresholds = C4Thresholds()) -> None:
        super().__init__()
        self.thresholds = thresholds

    def apply(self, doc: Doc) -> Doc | str:
        text, dropped, reason = c4_clean(doc.text, self.thresholds)
        self.stats.counts.update(dropped)
        if reason:
            return reason
        doc.text = text
        return doc
