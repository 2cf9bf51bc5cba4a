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

# North American numbers ((555) 123-4567, 555-123-4567, 555.123.4567, optional +1) and
# international ones (+ country code, then 6-12 more digits in groups of 2-4 separated by space,
# dot or dash). A bare run of 10 digits is not matched: it is more often an id than a phone.
PHONE = re.compile(
    r"(?<![\w+])(?:"
    r"(?:\+1[ .-]?)?(?:\(\d{3}\)[ ]?|\d{3}[ .-])\d{3}[ .-]\d{4}"
    r"|\+(?!1[ .-]?\(?\d{3}\)?[ .-]\d{3}[ .-]\d{4})\d{1,3}(?:[ .-]\d{2,4}){2,4}"
    r")(?![\w])")


def _mask_ipv6(text: str, counts: Counter) -> str:
    def replace(match: re.Match) -> str:
        found = match.group(0)
        if sum(1 for group in found.split(":") if group) < 2:  # "::", "::1", slices like x[::2]
            return found
        try:
            ipaddress.IPv6Address(found)
        except ValueError:  # "12:30:45" and other colon-separated things
            return found
        counts["ipv6"] += 1
        return MASKS["ipv6"]
    return IPV6_CANDIDATE.sub(replace, text)


def mask_pii(text: str) -> tuple[str, Counter]:
    """Replace e-mail addresses, phone numbers and IPv4/IPv6 addresses by :data:`MASKS` tokens.

    Returns the masked text and a Counter of what was masked (keys ``email``, ``phone``, ``ipv4``,
    ``ipv6``). E-mails go first (their domains hold digits and dots), IPs before phones (a dotted
    address must not be read as a phone number).

        >>> mask_pii("Mail a.b@example.org or call (555) 201-3344 from 192.0.2.7.")
        ('Mail |||EMAIL_ADDRESS||| or call |||PHONE_NUMBER||| from |||IP_ADDRESS|||.', Counter({'email': 1, 'ipv4': 1, 'phone': 1}))
    """
    counts: Counter = Counter()
    for kind, pattern in (("email", EMAIL), ("ipv4", IPV4)):
        text, n = pattern.subn(MASKS[kind], text)
        if n:
            counts[kind] += n
    text = _mask_ipv6(text, counts)
    text, n = PHONE.subn(MASKS["phone"], text)
    if n:
        counts["phone"] += n
    return text, counts


class MaskPII(Stage):
    """Masks PII in ``Doc.text``; never removes a document. ``stats.counts`` holds the masked
    counts per kind and ``documents with PII``."""
    name = "pii"

    def apply(self, doc: Doc) -> Doc:
        doc.text, counts = mask_pii(doc.text)
        if counts:
            self.stats.counts.update(counts)
            self.stats.counts["documents with PII"] += 1
        return doc
