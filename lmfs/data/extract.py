"""HTML to text: a small extractor written here, two established ones, and a way to score them.

A crawled page is mostly not its content: menus, cookie notices, sidebars, footers, scripts and
styles surround a few paragraphs. An extractor has two jobs: turn markup into text (drop tags,
decode entities, keep block structure as line breaks) and find the *main content*.
:func:`html_to_text` does the first job exactly and the second with the simplest rule that works
on many sites: skip the elements HTML5 names as navigation and page furniture (``nav``, ``header``,
``footer``, ``aside``, ``form``) and elements whose class or id says so (``cookie``, ``menu``, ...).
``resiliparse`` (Bevendorff et al., 2018; what FineWeb-style pipelines use) and ``trafilatura``
(Barbaresi, 2021; what RefinedWeb and FineWeb used) use richer rules and scoring of text density.
:func:`score_extraction` compares any of them with the page's true main text, word by word.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from html.parser import HTMLParser

from lmfs.data import Doc, Stage

_SKIP = {"script", "style", "noscript", "template", "head", "svg", "iframe", "object", "canvas"}
_FURNITURE = {"nav", "header", "footer", "aside", "form", "button", "select"}
_BOILERPLATE_WORDS = re.compile(r"cookie|consent|banner|menu|\bnav|sidebar|footer|breadcrumb|share|social|comment",
                                re.IGNORECASE)
_BLOCK = {"p", "div", "section", "article", "main", "br", "hr", "li", "ul", "ol", "dl", "dt", "dd", "tr",
          "table", "pre", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "figcaption", "caption",
          "title", "body", "td", "th"}
_VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


class TextCollector(HTMLParser):
    """Collects text outside skipped elements; block elements end a line."""

    def __init__(self, main_content: bool) -> None:
        super().__init__(convert_charrefs=True)
        self.main_content = main_content
        self.skip_depth = 0          # > 0 while inside an element whose text is dropped
        self.stack: list[tuple[str, bool]] = []  # open elements: (tag, did it start a skip?)
        self.pre = 0
        self.parts: list[str] = []

    def _skips(self, tag: str, attrs) -> bool:
        if tag in _SKIP:
            return True
        if not self.main_content:
            return False
        if tag in _FURNITURE:
            return True
        names = " ".join(v for k, v in attrs if k in ("class", "id", "role") and v)
        return bool(names and _BOILERPLATE_WORDS.search(names))

    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            if tag in _BLOCK and not self.skip_depth:
                self.parts.append("\n")
            return
        skips = self._skips(tag, attrs)
        self.stack.append((tag, skips))
        self.skip_depth += skips
        self.pre += tag == "pre"
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        # Close up to the matching open tag: real pages leave <p>, <li> and friends unclosed.
        if not any(t == tag for t, _ in self.stack):
            return
        while self.stack:
            t, skips = self.stack.pop()
            self.skip_depth -= skips
            self.pre -= t == "pre"
            if t == tag:
                break
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip_depth:
            # Inside <pre> the line breaks and indentation are the content: protect them from the
            # per-line stripping below by a placeholder for the newline.
            if self.pre:
                self.parts.append(data.replace("\n", "\x00"))
                return
            text = re.sub(r"\s+", " ", data)
            if text.startswith(" ") and self.parts and self.parts[-1].endswith((" ", "\n")):
                text = text[1:]  # "a <!-- c --> b": one space between a and b, not two
            self.parts.append(text)

    def text(self) -> str:
        lines = (line.strip() for line in "".join(self.parts).split("\n"))
        return "\n".join(line for line in lines if line).replace("\x00", "\n")


def html_to_text(html: str, main_content: bool = True) -> str:
    """The visible text of ``html``, one line per block element.

    ``main_content=True`` also drops page furniture: ``nav``/``header``/``footer``/``aside``/
    ``form`` elements and elements whose class, id or role names a menu, cookie notice, sidebar, ...

        >>> html_to_text("<nav>Home</nav><p>Hello &amp; <b>welcome</b></p><script>x=1</script><p>Bye</p>")
        'Hello & welcome\\nBye'
    """
    parser = TextCollector(main_content)
    parser.feed(html)
    parser.close()
    return parser.text()


def resiliparse_text(html: str) -> str:
    """Resiliparse's plain-text extraction with its main-content heuristics."""
    from resiliparse.extract.html2text import extract_plain_text
    return extract_plain_text(html, main_content=True, alt_texts=False)


def trafilatura_text(html: str) -> str:
    """Trafilatura's main-text extraction (``""`` where it finds none)."""
    import trafilatura
    return trafilatura.extract(html, include_comments=False, include_tables=True) or ""


EXTRACTORS: dict[str, Callable[[str], str]] = {
    "lmfs": html_to_text, "resiliparse": resiliparse_text, "trafilatura": trafilatura_text}

_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


def decode_html(payload: bytes, content_type: str = "", max_bad: float = 0.01) -> str:
    """Decode an HTTP payload: the charset of the ``Content-Type`` header, else of a ``<meta>`` tag
    in the first 2 KB, else UTF-8. Bytes invalid in that encoding become U+FFFD; more than
    ``max_bad`` of them (a fraction of the characters) raises ``ValueError``: the page is not text
    in the encoding it claims.
    """
    match = re.search(r"charset\s*=\s*[\"']?([A-Za-z0-9_.:-]+)", content_type, re.IGNORECASE)
    charset = match.group(1) if match else None
    if charset is None:
        meta = _META_CHARSET.search(payload[:2048])
        charset = meta.group(1).decode("ascii") if meta else "utf-8"
    try:
        text = payload.decode(charset, errors="replace")
    except LookupError:  # an unknown encoding name: try the web's default
        charset, text = "utf-8", payload.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > max_bad * max(len(text), 1):
        raise ValueError(f"{bad} of {len(text)} characters are not valid {charset}")
    return text


class Extract(Stage):
    """``Doc.html`` -> ``Doc.text`` with one of :data:`EXTRACTORS`; the raw bytes are dropped.

    Removes documents whose bytes do not decode (``undecodable bytes``) and those left with fewer
    than ``min_chars`` characters (``empty text``). Documents that arrive with text (WET) pass.
    """
    name = "extract"

    def __init__(self, method: str = "lmfs", min_chars: int = 1) -> None:
        super().__init__()
        if method not in EXTRACTORS:
            raise ValueError(f"unknown extractor {method!r}; choose one of {sorted(EXTRACTORS)}")
        self.extract, self.min_chars = EXTRACTORS[method], min_chars

    def apply(self, doc: Doc) -> Doc | str:
        if doc.html is not None:
            try:
                html = decode_html(doc.html, doc.content_type)
            except ValueError:
                return "undecodable bytes"
            doc.text, doc.html = self.extract(html), None
        if len(doc.text.strip()) < self.min_chars:
            return "empty text"
        return doc


_WORD = re.compile(r"\w+")


def score_extraction(extracted: str, truth: str) -> tuple[float, float, float]:
    """Word-level (precision, recall, F1) of ``extracted`` against the true main text.

    Words are compared as multisets, so order is ignored but repetitions count: boilerplate kept
    lowers precision, content lost lowers recall.
    """
    got, want = Counter(_WORD.findall(extracted.lower())), Counter(_WORD.findall(truth.lower()))
    overlap = sum((got & want).values())
    precision = overlap / max(sum(got.values()), 1)
    recall = overlap / max(sum(want.values()), 1)
    f1 = 2 * precision * recall / (precision + recall) if overlap else 0.0
    return precision, recall, f1


def compare_extractors(pages: Sequence[tuple[str, str]], methods: Sequence[str] = tuple(EXTRACTORS)):
    """Run each extractor on ``(html, true main text)`` pairs: a pandas table of mean precision,
    recall, F1 and pages per second (one process)."""
    import pandas as pd
    rows = []
    for method in methods:
        extract = EXTRACTORS[method]
        start = time.perf_counter()
        outputs = [extract(html) for html, _ in pages]
        seconds = time.perf_counter() - start
        scores = [score_extraction(out, truth) for out, (_, truth) in zip(outputs, pages)]
        p, r, f = (sum(s[i] for s in scores) / len(scores) for i in range(3))
        rows.append(dict(extractor=method, precision=p, recall=r, f1=f, pages_per_s=len(pages) / seconds))
    return pd.DataFrame(rows).set_index("extractor")
