"""Checkers for the exercises of lecture 13 (data 1: from crawl to clean text).

Each ``check_*`` takes the learner's function, calls it on hand-made cases at the boundaries of
the rule, and compares the result with :mod:`lmfs.data.pii` or :mod:`lmfs.data.rules`.
"""

from __future__ import annotations

from collections.abc import Callable

from lmfs.data.pii import IPV4, MASKS
from lmfs.data.rules import gopher_reasons
from lmfs.exercises import check

_IPV4_CASES = [
    "The server at 192.0.2.17 answers.",
    "Octets end at 255: 255.255.255.255 is one, 256.1.1.1 is not.",
    "Zero is fine: 0.0.0.0 and 10.0.0.1, but 01.2.3.4 has a leading zero.",
    "Versions are not addresses: 3.11.7 and 1.2.3.4.5.",
    "Two in a row: 198.51.100.1,203.0.113.9 and a date 12.05.2024.",
    "The address ends the sentence: 192.0.2.254.",
    "No digits here at all.",
]


def _mask_ipv4_reference(text: str) -> tuple[str, int]:
    return IPV4.subn(MASKS["ipv4"], text)


def check_mask_ipv4(answer: Callable[[str], tuple[str, int]]) -> int:
    """``mask_ipv4(text) -> (masked text, count)``: every IPv4 address (four numbers 0-255, no
    leading zeros, not part of a longer dotted number) replaced by ``|||IP_ADDRESS|||``. Compared
    with :data:`lmfs.data.pii.IPV4`."""
    return check("mask_ipv4", answer, _mask_ipv4_reference, [(t,) for t in _IPV4_CASES])


_BASIC_RULES = ("fewer than 50 words", "more than 100000 words", "mean word length", "too few stop words")


def _gopher_basic_reference(text: str) -> bool:
    return not any(r in _BASIC_RULES for r in gopher_reasons(text))


def _words(n: int, start: tuple = ("the", "of")) -> str:
    """``n`` words: ``start``, then distinct made-up words of 6-9 letters."""
    filler = ["river", "bridge", "garden", "market", "school", "window", "harbour", "museum"]
    return " ".join(list(start) + [f"{filler[i % len(filler)]}{i}" for i in range(n - len(start))])


def _gopher_cases():
    yield (_words(50),)                                     # exactly 50 words: kept
    yield (_words(49),)                                     # 49: removed
    yield (_words(60, start=("the",)),)                     # one stop word: removed
    yield (_words(60, start=("The", "and.")),)              # case and punctuation do not hide stop words
    yield (" ".join(["the", "of"] + ["abc"] * 58),)         # mean word length 179/60 < 3: removed
    yield (" ".join(["the", "and"] + ["abc"] * 58),)        # exactly 3.0: kept
    yield (" ".join(["the", "and"] + ["abcdefghijk"] * 58),)  # 644/60 > 10: removed
    yield (" ".join(["the", "and"] + ["abcdefghij"] * 58),)   # 586/60 <= 10: kept


def check_gopher_basic(answer: Callable[[str], bool]) -> int:
    """``gopher_basic(text) -> bool``: True when ``text`` passes Gopher's word-count (50 to 100,000),
    mean-word-length (3 to 10 characters) and stop-word (at least 2 of the, be, to, of, and, that,
    have, with) rules. Compared with :func:`lmfs.data.rules.gopher_reasons`."""
    return check("gopher_basic", answer, _gopher_basic_reference, _gopher_cases())
