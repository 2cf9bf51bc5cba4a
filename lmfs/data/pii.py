"""Masking personal information: e-mail addresses, phone numbers, IP addresses.

Web text is full of contact details. Pipelines such as Dolma's replace them with placeholder
tokens (``|||EMAIL_ADDRESS|||``, ...) rather than dropping the documents, so the model learns that
an address goes here without learning anyone's address. Regular expressions are the usual tool:
cheap, and good on these well-formed kinds (names and street addresses need a trained tagger).
Each pattern below is written to reject its common look-alikes, which the lecture tests at the
boundaries: version numbers and dates are not IPs, ``256.1.1.1`` is not an IPv4 address, a year or
a price is not a phone number.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter

from lmfs.data import Doc, Stage

MASKS = {"email": "|||EMAIL_ADDRESS|||", "phone": "|||PHONE_NUMBER|||",
         "ipv4": "|||IP_ADDRESS|||", "ipv6": "|||IP_ADDRESS|||"}

# local@domain.tld: the local part allows the characters real addresses use; the domain needs a dot
# and a top-level label of two or more letters.
EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![\w-])")

# Four dot-separated numbers 0-255 (no leading zeros beyond "0"), not part of a longer dotted run:
# "1.2.3.4.5" is a version, not an address; a sentence's final dot is allowed after it.
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)(?![\w])")

# Candidate IPv6 text: hex groups and colons with at least two colons; ipaddress validates it.
IPV6_CANDIDATE = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")

# North American numbers ((555) 123-4567, (555)-123-4567, 555-123-4567, 555.123.4567, optional +1,
# and a bare run of 10 digits whose first is 2-9: area codes never start with 0 or 1, so Unix times
# and zero-padded ids stay) and international ones (+ country code, then 6-12 more digits in groups
# of 2-4 separated by space, dot or dash).
PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"(?:\+1[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-])\d{3}[ .-]\d{4}"
    r"|(?:\+1[ .-]?)?[2-9]\d{9}"
    r"|\+(?!1[ .-]?\(?\d{3}\)?[ .-]?\d{3}[ .-]\d{4})\d{1,3}(?:[ .-]\d{2,4}){2,4}"
    r")(?![\w])")

KINDS = ("email", "ipv4", "ipv6", "phone")  # the order mask_pii applies them in


def mask_ipv6(text: str) -> tuple[str, int]:
    """Replace every valid IPv6 address by ``|||IP_ADDRESS|||``: ``(masked text, count)``.

    Candidates are runs of hex groups and colons; :mod:`ipaddress` decides. Times (``12:30:45``),
    slices (``x[::2]``) and ``::``/``::1`` stay.

        >>> mask_ipv6("from 2001:db8::1 at 12:30:45")
        ('from |||IP_ADDRESS||| at 12:30:45', 1)
    """
    count = 0

    def replace(match: re.Match) -> str:
        nonlocal count
        found = match.group(0)
        if sum(1 for group in found.split(":") if group) < 2:  # "::", "::1", slices like x[::2]
            return found
        try:
            ipaddress.IPv6Address(found)
        except ValueError:  # "12:30:45" and other colon-separated things
            return found
        count += 1
        return MASKS["ipv6"]
    return IPV6_CANDIDATE.sub(replace, text), count


_PATTERNS = {"email": EMAIL, "ipv4": IPV4, "phone": PHONE}


def mask_pii(text: str, kinds: tuple[str, ...] | list[str] = KINDS) -> tuple[str, Counter]:
    """Replace e-mail addresses, phone numbers and IPv4/IPv6 addresses by :data:`MASKS` tokens.

    Returns the masked text and a Counter of what was masked (keys ``email``, ``phone``, ``ipv4``,
    ``ipv6``). ``kinds`` picks which to mask (``kinds=("phone",)`` masks phone numbers only); they
    are applied in the order of :data:`KINDS` whatever the order given: e-mails first (their domains
    hold digits and dots), IPs before phones (a dotted address must not be read as a phone number).

        >>> mask_pii("Mail a.b@example.org or call (555) 201-3344 from 192.0.2.7.")
        ('Mail |||EMAIL_ADDRESS||| or call |||PHONE_NUMBER||| from |||IP_ADDRESS|||.', Counter({'email': 1, 'ipv4': 1, 'phone': 1}))
    """
    if isinstance(kinds, str) or not set(kinds) <= set(KINDS):
        raise ValueError(f"kinds must be a collection of {KINDS}, got {kinds!r}")
    counts: Counter = Counter()
    for kind in KINDS:
        if kind not in kinds:
            continue
        if kind == "ipv6":
            text, n = mask_ipv6(text)
        else:
            text, n = _PATTERNS[kind].subn(MASKS[kind], text)
        if n:
            counts[kind] += n
    return text, counts


class MaskPII(Stage):
    """Masks PII of ``kinds`` (default: all) in ``Doc.text``; never removes a document.
    ``stats.counts`` holds the masked counts per kind and ``documents with PII``."""
    name = "pii"

    def __init__(self, kinds: tuple[str, ...] | list[str] = KINDS) -> None:
        super().__init__()
        mask_pii("", kinds)  # refuse unknown kinds here, not at the first document
        self.kinds = tuple(kinds)

    def apply(self, doc: Doc) -> Doc:
        doc.text, counts = mask_pii(doc.text, self.kinds)
        if counts:
            self.stats.counts.update(counts)
            self.stats.counts["documents with PII"] += 1
        return doc
