"""Pre-tokenization: cut text into the pieces that BPE works inside.

BPE never merges across the edges of a pre-token, so " dog" and "dog." can share the token
" dog" but a merge can never glue the end of one word to the start of the next. GPT-2 cuts
text with one regular expression (:data:`GPT2_PATTERN`), and special tokens such as
``<|endoftext|>`` are cut out before that, so they are never split or merged with anything.

>>> pretokenize("Hi there!<|endoftext|>It's 2024", ["<|endoftext|>"])
['Hi', ' there', '!', '<|endoftext|>', 'It', "'s", ' 2024']

Training only needs how often each pre-token occurs (:func:`count_pretokens`). On a large file
that counting is the slow part, so :func:`count_pretokens_in_file` cuts the file into chunks at
special tokens (:func:`find_chunk_boundaries`) and counts the chunks in parallel processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Sequence

import regex

# GPT-2's pre-tokenizer, in words: an English contraction ('s 'd 'm 't 'll 've 're), or an
# optional space followed by a run of letters, or of digits, or of other symbols; then runs of
# whitespace. "\s+(?!\S)" takes a whitespace run but leaves its last space behind when a word
# follows, so that space becomes the start of the next word (" world", not " " + "world").
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PRETOKEN_RE = regex.compile(GPT2_PATTERN)

# A speed-up, not a different rule: on pure-ASCII text the same pattern can be written with
# plain character classes, and the standard `re` engine runs it about 1.7x faster than `regex`
# runs the Unicode one. Among ASCII characters the letters (\p{L}) are exactly A-Z a-z, the
# numbers (\p{N}) exactly 0-9, and the whitespace (\s) exactly tab, \n, \v, \f, \r and space,
# so the two patterns cut every ASCII string identically (the tests check this).
_WS = r"\t\n\x0b\x0c\r "
_ASCII_RE = re.compile(rf"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+"""
                       rf"""|[{_WS}]+(?![^{_WS}])|[{_WS}]+""")

# Positions where text can be cut without changing its pre-tokens: right after a newline that has
# a printable ASCII character on both sides. The character before the newline ends its pre-token
# (no pattern runs from a visible character into a newline), the newline is a pre-token of its
# own on either side of the cut ("\s+(?!\S)" at the end of a piece, "\s+" inside the text), and
# the next pre-token starts fresh after it.
_SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def find_pretokens(text: str) -> list[str]:
    """The GPT-2 pre-tokens of ``text`` (no special-token handling), as ``PRETOKEN_RE.findall``.

    Pure-ASCII text takes the fast ASCII pattern. Other text is first cut at safe newlines so that
    its ASCII stretches still can; only the pieces that hold non-ASCII characters use ``regex``.
    """
    if text.isascii():  # O(1) in CPython: a str knows whether it is ASCII
        return _ASCII_RE.findall(text)
    pieces: list[str] = []
    for part in _SAFE_CUT.split(text):
        pieces += _ASCII_RE.findall(part) if part.isascii() else PRETOKEN_RE.findall(part)
    return pieces


def special_token_regex(special_tokens: Iterable[str]) -> regex.Pattern | None:
    """A pattern that matches any special token, or None when there are none.

    The alternatives are ordered longest first: the regex engine takes the first alternative that
    matches, so "<|endoftext|><|endoftext|>" (if it is a special token) wins over
    "<|endoftext|>" at the same position.
    """
    tokens = sorted(set(special_tokens), key=len, reverse=True)
    if not tokens:
        return None
    return regex.compile("(" + "|".join(regex.escape(t) for t in tokens) + ")")


def split_on_special_tokens(text: str, special_tokens: Iterable[str]) -> list[str]:
    """Split ``text`` around special tokens, keeping them: text pieces and specials alternate.

    >>> split_on_special_tokens("a<|endoftext|>b", ["<|endoftext|>"])
    ['a', '<|endoftext|>', 'b']

    Even positions hold ordinary text (possibly ""), odd positions hold special tokens.
    """
    pattern = special_token_regex(special_tokens)
    return [text] if pattern is None else pattern.split(text)


def pretokenize(text: str, special_tokens: Iterable[str] = ()) -> list[str]:
    """The pre-tokens of ``text`` in order; each special token is kept as one piece."""
    pieces: list[str] = []
    for i, part in enumerate(split_on_special_tokens(text, special_tokens)):
        if i % 2:  # a special token: one piece, never looked into
            pieces.append(part)
        else:
            pieces.extend(find_pretokens(part))
    return pieces


def count_pretokens(text: str, special_tokens: Iterable[str] = ()) -> Counter[str]:
    """How often each pre-token occurs in ``text``; special tokens are left out.

    Training works on these counts, not on the text: a pre-token that occurs a million times is
    one entry with count 1,000,000, which is what makes BPE training affordable.

    >>> count_pretokens("the cat<|endoftext|>the dog", ["<|endoftext|>"])
    Counter({'the': 2, ' cat': 1, ' dog': 1})
    """
    counts: Counter[str] = Counter()
    # Only the ordinary-text pieces (even positions) are counted: specials are separators here.
    for part in split_on_special_tokens(text, special_tokens)[::2]:
        counts.update(find_pretokens(part))  # Counter.update(list) counts in C
    return counts


# ----------------------------------------------------------------------------------------------
# Counting a whole file in parallel


# The chunk boundary used when there are no special tokens: the same safe newline as `_SAFE_CUT`,
# found in bytes.
_SAFE_NEWLINE = regex.compile(rb"[\x21-\x7e]\n[\x21-\x7e]")


def find_chunk_boundaries(path: str | os.PathLike, n_chunks: int,
                          special_tokens: Sequence[str] = (), block_size: int = 1 << 16) -> list[int]:
    """Byte offsets ``[0, b1, ..., size]`` that cut the file into at most ``n_chunks`` pieces.

    Each inner boundary starts from the even guess ``i * size / n_chunks`` and moves forward to
    the start of the next special token, so every chunk holds whole documents and can be
    pre-tokenized on its own with exactly the same result as the whole file. Without special
    tokens it moves to the next "safe" newline instead (see ``_SAFE_NEWLINE``). The file is read
    only in small blocks around each guess, so this works on files of any size.
    """
    size = os.path.getsize(path)
    if size == 0 or n_chunks <= 1:
        return [0, size]
    if special_tokens:
        finder = regex.compile(b"|".join(regex.escape(t.encode("utf-8")) for t in special_tokens))
        overlap, offset = max(len(t.encode("utf-8")) for t in special_tokens) - 1, 0
    else:
        finder, overlap, offset = _SAFE_NEWLINE, 2, 2  # cut after "x\n", before the next char
    boundaries = [0]
    with open(path, "rb") as f:
        for i in range(1, n_chunks):
            pos = max(i * size // n_chunks, boundaries[-1])
            cut = size  # when no separator is found the rest of the file is one chunk
            while pos < size:
                f.seek(pos)
                block = f.read(block_size + overlap)
                match = finder.search(block)
                if match:
                    cut = pos + match.start() + offset
                    break
                # Step forward, keeping `overlap` bytes so a separator cut by the block edge is
                # still found in the next block.
                pos += block_size
            boundaries.append(cut)
    boundaries.append(size)
    # Guesses that moved to the same separator give empty chunks: drop the duplicates.
    return sorted(set(boundaries))


def count_chunk(args: tuple[str, int, int, tuple[str, ...]]) -> Counter[str]:
    """One worker's share of :func:`count_pretokens_in_file`: read bytes ``[start, end)`` of the
    file (``args = (path, start, end, special_tokens)``) and count the pre-tokens of that chunk.

    A chunk starts at a special token (or at the start of the file), so its pre-tokens are exactly
    those the whole file has there, and the counts of all chunks add up to the file's counts."""
    path, start, end, special_tokens = args
    with open(path, "rb") as f:
        f.seek(start)
        # Invalid UTF-8 becomes U+FFFD. Chunks are cut before a special token or after an ASCII
        # newline, never inside a character, so this equals decoding the whole file at once.
        text = f.read(end - start).decode("utf-8", errors="replace")
    return count_pretokens(text, special_tokens)


def _pool_context():
    """'fork' where it is safe and cheap (Linux): workers start instantly and inherit the code.

    Elsewhere (macOS, Windows) the platform default ('spawn') is used; it re-imports lmfs in
    each worker, which costs a second or so but is otherwise the same.
    """
    if sys.platform.startswith("linux"):
        return mp.get_context("fork")
    return mp.get_context()


def count_pretokens_in_file(path: str | os.PathLike, special_tokens: Sequence[str] = (),
                            num_workers: int | None = None,
                            chunk_bytes: int = 8 << 20) -> Counter[str]:
    """Pre-token counts of a whole file, counted by ``num_workers`` processes.

    The file is cut into chunks of about ``chunk_bytes`` (at least one per worker), so no process
    ever holds more than one chunk in memory; each worker returns a Counter and the Counters are
    added up here. ``num_workers=1`` counts in this process, without a pool. Bytes that are not
    valid UTF-8 are read as U+FFFD, the replacement character.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"training file {path} is a directory: pass one text file "
                                "(concatenate several files into one, e.g. with `cat`)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training file not found: {path}")
    num_workers = max(1, num_workers or os.cpu_count() or 1)
    size = os.path.getsize(path)
    n_chunks = max(num_workers, -(-size // chunk_bytes))
    bounds = find_chunk_boundaries(path, n_chunks, special_tokens)
    jobs = [(path, a, b, tuple(special_tokens)) for a, b in zip(bounds, bounds[1:])]
    total: Counter[str] = Counter()
    if num_workers == 1 or len(jobs) == 1:
        for job in jobs:
            total.update(count_chunk(job))
        return total
    with _pool_context().Pool(min(num_workers, len(jobs))) as pool:
        # Unordered: whichever chunk is done first is added first; addition does not care.
        for counts in pool.imap_unordered(count_chunk, jobs):
            total.update(counts)
    return total
