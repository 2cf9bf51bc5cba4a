"""Training a byte-level BPE tokenizer.

The algorithm (Sennrich et al. 2016, on bytes as in GPT-2), on a toy corpus::

    pre-tokens and counts    {"low": 5, " lower": 2, " newest": 6, " widest": 3}
    start: every byte is a token, every pre-token a list of byte ids
    repeat until the vocabulary is full:
        count every adjacent pair of tokens, weighted by the pre-token counts
        take the most frequent pair: (b"s", b"t"), 9 times (it ties with (b"e", b"s"), and the
            greater pair of byte strings wins ties)
        give it a new id (its bytes are b"st") and replace the pair everywhere

Counting every pair from scratch after each merge is simple but slow (see the reference in the
tests). :func:`learn_merges` does the same thing incrementally, keeping the counts in a
:class:`PairIndex`: a merge of (a, b) only changes the pre-tokens that contain a followed by b, so
only those are visited and only the counts of the pairs around each merged spot are adjusted.

>>> vocab = {i: bytes([i]) for i in range(256)}
>>> learn_merges({"low": 5, " lower": 2, " newest": 6, " widest": 3}, vocab, 3)
[(b's', b't'), (b'e', b'st'), (b'o', b'w')]
>>> vocab[256], vocab[257], vocab[258]
(b'st', b'est', b'ow')
"""

from __future__ import annotations

import gc
import heapq
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tqdm.auto import tqdm

from lmfs.tokenization.pretokenization import count_pretokens_in_file

Pair = tuple[int, int]


def merge_word(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``ids`` by ``new_id``, scanning left to right.

    >>> merge_word([1, 2, 3, 1, 2], (1, 2), 9)
    [9, 3, 9]
    >>> merge_word([7, 7, 7], (7, 7), 9)  # occurrences do not overlap: the leftmost goes first
    [9, 7]
    """
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def count_pairs(words: Sequence[Sequence[int]], counts: Sequence[int]) -> dict[Pair, int]:
    """How often each adjacent pair of ids occurs, each word weighted by its count.

    >>> count_pairs([[1, 2, 3], [1, 2]], [10, 1])
    {(1, 2): 11, (2, 3): 10}
    """
    pair_counts: dict[Pair, int] = defaultdict(int)
    for word, count in zip(words, counts):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += count
    return dict(pair_counts)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector: the merge loop makes millions of small tuples, and each
    collection would walk all the (long-lived) words and sets for nothing, since none of them
    form reference cycles. Pausing it made the merge loop about 20% faster on the benchmark."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def train_bpe(input_path: str | os.PathLike, vocab_size: int, special_tokens: Sequence[str] = (), *,
              num_workers: int | None = None, progress: bool = False
              ) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE tokenizer on a UTF-8 text file.

    Returns ``(vocab, merges)``: ``vocab[i]`` is the bytes of token ``i`` (0-255 are the single
    bytes, then the special tokens in the given order, then one token per merge) and ``merges``
    lists the merged pairs ``(bytes, bytes)`` in the order they were learned. The most frequent
    pair is merged first; among equally frequent pairs, the lexicographically greatest
    ``(bytes_a, bytes_b)`` wins. Training stops early, with fewer merges than asked for, when
    every pre-token has become a single token.

    Bytes that are not valid UTF-8 are read as U+FFFD (the replacement character, bytes
    ``EF BF BD``), as ``open(path, errors="replace")`` would. A missing file, a directory, or a
    file without any text outside the special tokens raises an error that says so.

    ``num_workers`` processes count the pre-tokens (default: all CPU cores); ``progress`` shows a
    progress bar over the merges.

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.txt")
    >>> _ = open(path, "w").write("low lower<|endoftext|>lowest low")
    >>> vocab, merges = train_bpe(path, 256 + 1 + 2, ["<|endoftext|>"], num_workers=1)
    >>> merges  # (l, o) and (o, w) both occur 4 times: the greater pair, (o, w), goes first
    [(b'o', b'w'), (b'l', b'ow')]
    >>> vocab[256], vocab[257], vocab[258]
    (b'<|endoftext|>', b'ow', b'low')
    """
    special_tokens = list(dict.fromkeys(special_tokens))  # drop repeats, keep the order
    if "" in special_tokens:
        raise ValueError("a special token cannot be the empty string")
    min_size = 256 + len(special_tokens)
    if vocab_size < min_size:
        n = len(special_tokens)
        raise ValueError(f"vocab_size must be at least {min_size} (256 bytes + {n} special "
                         f"token{'' if n == 1 else 's'}), got {vocab_size}")

    # 1. The starting vocabulary: the 256 single bytes, then the special tokens.
    vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
    for token in special_tokens:
        vocab[len(vocab)] = token.encode("utf-8")

    # 2. Pre-token counts (in parallel), then the merges learned from them.
    pretoken_counts = count_pretokens_in_file(input_path, special_tokens, num_workers)
    if not pretoken_counts:
        raise ValueError(f"nothing to train on: {os.fspath(input_path)} is empty"
                         + (" or holds only special tokens" if special_tokens else ""))
    merges = learn_merges(pretoken_counts, vocab, vocab_size - len(vocab), progress=progress)
    return vocab, merges


class PairIndex:
    """The adjacent-pair counts of a list of words, kept up to date as pairs are merged.

    ``words[w]`` is a list of token ids that occurs ``counts[w]`` times. Counting every pair from
    scratch after each merge would visit the whole corpus every time; :meth:`merge` instead
    visits only the words that contain the merged pair and adjusts only the counts of the pairs
    around each merged spot.

    >>> index = PairIndex([[1, 2, 3], [1, 2]], [10, 1])
    >>> index.most_frequent(), index.pair_counts[2, 3]
    ({(1, 2)}, 10)
    >>> index.merge((1, 2), 9); index.words, dict(index.pair_counts)
    ([[9, 3], [9]], {(9, 3): 10})
    """

    def __init__(self, words: list[list[int]], counts: Sequence[int]):
        self.words = words
        self.counts = list(counts)
        #    pair_counts: pair -> weighted count;
        #    where: pair -> indices of the words that contain it. It may hold too many: a word whose
        #           pair was merged away is not removed, it is skipped when visited (removing it
        #           exactly would cost more than the skipped visits).
        #    buckets: count -> set of pairs with exactly that count; `heap` holds every count that
        #           has a bucket (negated, since heapq is a min-heap), so the top count is heap[0].
        self.pair_counts: dict[Pair, int] = defaultdict(int)
        self.where: dict[Pair, set[int]] = defaultdict(set)
        for w, (word, count) in enumerate(zip(words, self.counts)):
            for pair in zip(word, word[1:]):
                self.pair_counts[pair] += count
                self.where[pair].add(w)
        self.buckets: dict[int, set[Pair]] = {}
        for pair, count in self.pair_counts.items():
            self.buckets.setdefault(count, set()).add(pair)
        self.heap = [-count for count in self.buckets]
        heapq.heapify(self.heap)

    def most_frequent(self) -> set[Pair]:
        """The pairs that share the highest count (an empty set when no pair is left).

        No count ever rises above the current top (a pair made with a new token occurs at most as
        often as the merged pair did), so the top of the heap only moves down; buckets that became
        empty are dropped on the way.
        """
        heap, buckets = self.heap, self.buckets
        while heap and not buckets[-heap[0]]:
            del buckets[-heapq.heappop(heap)]
        return buckets[-heap[0]] if heap else set()

    def merge(self, pair: Pair, new_id: int) -> None:
        """Replace ``pair`` by ``new_id`` in every word that contains it, and update the counts."""
        a, b = pair
        words, counts, pair_counts, buckets = self.words, self.counts, self.pair_counts, self.buckets
        # 1. Merge (a, b) in every word that contains it, in place, left to right. Around each
        #    merged spot "left a b right" the pairs (left, a) and (b, right) are lost and
        #    (left, new) and (new, right) are made; nothing else in the word changes.
        lost: dict[Pair, int] = defaultdict(int)
        made: dict[Pair, int] = defaultdict(int)  # every made pair contains new_id: all are new
        made_where: dict[Pair, set[int]] = defaultdict(set)
        for w in self.where.pop(pair):
            word = words[w]
            if a not in word:
                continue  # a stale entry of `where`
            count = counts[w]
            i = word.index(a)
            last = len(word) - 1
            while i < last:
                if word[i + 1] == b:
                    if i:
                        left = word[i - 1]
                        if left == new_id:
                            # "a b a b": this spot's left pair (new, a) was only just made by
                            # the previous spot, so take it back instead of losing it.
                            made[new_id, a] -= count
                        else:
                            lost[left, a] += count
                        p = (left, new_id)
                        made[p] += count
                        made_where[p].add(w)
                    if i + 1 < last:
                        right = word[i + 2]
                        lost[b, right] += count
                        p = (new_id, right)
                        made[p] += count
                        made_where[p].add(w)
                    word[i] = new_id
                    del word[i + 1]
                    last -= 1
                i += 1
                # Jump to the next a, if there is one that could start a pair.
                if i < last and word[i] != a:
                    if a not in word[i:last]:
                        break
                    i = word.index(a, i)

        # 2. Update the counts: the merged pair is gone, lost pairs move down, made pairs enter.
        lost[pair] = pair_counts[pair]
        changed = []
        for p, change in lost.items():
            old = pair_counts[p]
            buckets[old].discard(p)
            if old == change:
                del pair_counts[p]
                self.where.pop(p, None)
            else:
                changed.append((p, old - change))
        changed.extend((p, count) for p, count in made.items() if count)
        for p, count in changed:
            pair_counts[p] = count
            bucket = buckets.get(count)
            if bucket is None:  # the first pair with this count: a new bucket
                buckets[count] = {p}
                heapq.heappush(self.heap, -count)
            else:
                bucket.add(p)
        self.where.update(made_where)


@_gc_paused()
def learn_merges(pretoken_counts: dict[str, int], vocab: dict[int, bytes], n_merges: int, *,
                 progress: bool = False) -> list[tuple[bytes, bytes]]:
    """Learn up to ``n_merges`` merges from pre-token counts; new tokens are added to ``vocab``.

    ``vocab`` must already hold the single bytes at ids 0-255 (and any special tokens); each
    merge adds one entry at id ``len(vocab)``. Among equally frequent pairs, the greatest pair of
    byte strings ``(vocab[id_a], vocab[id_b])`` wins. Stops early when no pair is left.
    """
    # Every pre-token starts as the list of its byte ids (byte i has id i).
    index = PairIndex([list(token.encode("utf-8")) for token in pretoken_counts],
                      list(pretoken_counts.values()))
    merges: list[tuple[bytes, bytes]] = []
    for _ in tqdm(range(n_merges), desc="BPE merges", unit="merge", disable=not progress):
        # 1. The most frequent pair; ties go to the greatest pair of byte strings.
        top = index.most_frequent()
        if not top:
            break  # every pre-token is a single token: nothing left to merge
        a, b = max(top, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        # 2. A new token for it, and the pair replaced by that token everywhere.
        new_id = len(vocab)
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        index.merge((a, b), new_id)
    return merges
