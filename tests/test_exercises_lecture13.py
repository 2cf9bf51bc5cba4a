"""The checkers of lecture 13's exercises accept right answers and reject wrong ones."""

import re

import pytest

from lmfs.exercises.lecture13 import check_gopher_basic, check_mask_ipv4

OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"


def mask_ipv4(text):
    return re.subn(rf"(?<![\w.]){OCTET}(?:\.{OCTET}){{3}}(?!\.?\d)(?!\w)", "|||IP_ADDRESS|||", text)


STOP = {"the", "be", "to", "of", "and", "that", "have", "with"}


def gopher_basic(text):
    words = text.split()
    if not 50 <= len(words) <= 100_000 or not 3 <= sum(map(len, words)) / len(words) <= 10:
        return False
    return len(STOP & {w.lower().strip(".,;:!?\"'()") for w in words}) >= 2


def test_mask_ipv4_checker():
    assert check_mask_ipv4(mask_ipv4) == 7
    with pytest.raises(AssertionError, match="mask_ipv4: wrong result"):  # any 1-3 digits: 256.1.1.1 too
        check_mask_ipv4(lambda t: re.subn(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?!\.?\d)(?!\w)", "|||IP_ADDRESS|||", t))
    with pytest.raises(AssertionError, match="mask_ipv4: wrong result"):  # no guard: masks inside 1.2.3.4.5
        check_mask_ipv4(lambda t: re.subn(rf"{OCTET}(?:\.{OCTET}){{3}}", "|||IP_ADDRESS|||", t))


def test_gopher_basic_checker():
    assert check_gopher_basic(gopher_basic) == 8
    with pytest.raises(AssertionError, match="gopher_basic: wrong result"):  # strict bounds: 50 words fails
        check_gopher_basic(lambda t: 50 < len(t.split()) and gopher_basic(t))
    with pytest.raises(AssertionError, match="gopher_basic: wrong result"):  # case-sensitive stop words
        check_gopher_basic(lambda t: gopher_basic(t) and len(STOP & set(t.split())) >= 2)
