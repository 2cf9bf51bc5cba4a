"""Checkers for the exercises of lecture 01 (tokenization).

* :func:`check_count_pairs`: ``fn(words, counts)``, how often each adjacent pair of ids occurs,
  each word weighted by its count; checked against :func:`lmfs.tokenization.count_pairs`.
* :func:`check_best_pair`: ``fn(pretoken_counts)``, the first merge BPE training makes (the most
  frequent pair of bytes, ties to the greatest pair of byte strings); checked against
  :func:`lmfs.tokenization.learn_merges`.
* :func:`check_encode_pretoken`: ``fn(piece, merges)``, the tokens (as bytes) of one pre-token,
  merged in rank order; checked against :meth:`lmfs.tokenization.Tokenizer.encode_pretoken`.
"""

from __future__ import annotations

from collections.abc import Callable

from lmfs.exercises import check
from lmfs.tokenization import Tokenizer, count_pairs, learn_merges

# Pre-token counts with ties and overlapping pairs ("aaa" holds (a, a) twice), shared by the cases.
_PRETOKEN_CASES = [
    {"low": 5, " lower": 2, " newest": 6, " widest": 3},  # (e, s) and (s, t) tie at 9: (s, t) wins
    {"ab": 1, "ba": 1},                                  # a plain tie: (b, a) > (a, b)
    {"aaa": 2, "ab": 3},                                  # (a, a) counts 4 in "aaa" x 2
    {"the cat": 1, "the": 4, " the": 3, "then": 2},
    {"héllo": 3, "hello": 2, "🙂🙂": 1},                  # multi-byte characters: pairs of bytes
]


def _first_merge(pretoken_counts: dict[str, int]) -> tuple[bytes, bytes]:
    vocab = {i: bytes([i]) for i in range(256)}
    return learn_merges(pretoken_counts, vocab, 1)[0]


def check_count_pairs(fn: Callable[[list[list[int]], list[int]], dict]) -> int:
    """``fn(words, counts)`` -> ``{(id_a, id_b): weighted count}`` against ``count_pairs``."""
    cases = [
        ([[1, 2, 3], [1, 2]], [10, 1]),
        ([[7, 7, 7]], [2]),                      # overlapping occurrences both count
        ([[5], []], [3, 4]),                     # no pairs at all
        ([list(b"banana"), list(b"band")], [2, 5]),
    ]
    cases += [([list(w.encode()) for w in c], list(c.values())) for c in _PRETOKEN_CASES]
    return check("count pairs", fn, count_pairs, cases)


def check_best_pair(fn: Callable[[dict[str, int]], tuple[bytes, bytes]]) -> int:
    """``fn(pretoken_counts)`` -> the first merge ``(bytes_a, bytes_b)`` against ``learn_merges``."""
    return check("best pair", fn, _first_merge, [(c,) for c in _PRETOKEN_CASES])


def check_encode_pretoken(fn: Callable[[str, list[tuple[bytes, bytes]]], list[bytes]]) -> int:
    """``fn(piece, merges)`` -> the tokens of ``piece`` as bytes, against ``Tokenizer.encode_pretoken``.

    The merges include orders where merging left to right gives a different answer from merging
    by rank (e.g. ``(b, c)`` learned before ``(a, b)``: "abc" is "a" + "bc", then "abc").
    """
    def reference(piece, merges):
        vocab = {i: bytes([i]) for i in range(256)}
        for a, b in merges:
            vocab[len(vocab)] = a + b
        tok = Tokenizer(vocab, merges)
        return [tok.vocab[i] for i in tok.encode_pretoken(piece)]

    vocab = {i: bytes([i]) for i in range(256)}
    learned = learn_merges({" the": 9, " there": 4, " then": 3, " other": 2, "the": 5}, vocab, 8)
    by_rank = [(b"b", b"c"), (b"a", b"b"), (b"a", b"bc")]
    cases = [(" there", learned), (" theme", learned), ("the", learned), (" other", learned),
             ("x", learned), ("abc", by_rank), ("abcabc", by_rank), ("aab", by_rank),
             ("héé", [(b"\xc3", b"\xa9"), (b"h", b"\xc3\xa9")])]
    return check("encode pre-token", fn, reference, cases)
