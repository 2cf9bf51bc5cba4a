"""HTML to text: a small extractor written here, two established ones, and a way to score them.

A crawled page is mostly not its content: menus, cookie notices, sidebars, footers, scripts and
styles surround a few paragraphs. An extractor has two jobs: turn markup into text (drop tags,
decode entities, keep block structure as line breaks and paragraphs as blank lines) and find the
*main content*. :func:`html_to_text` does the first job exactly and the second with the simplest
rule that works on many sites: skip the elements HTML5 names as navigation and page furniture
(``nav``, ``footer``, ``aside``, ``form``; ``header`` outside an ``article`` or ``main``) and
elements whose class or id names a menu, a cookie notice, a sidebar, ... as a whole word.
``resiliparse`` (Bevendorff et al., 2018; what FineWeb-style pipelines use) and ``trafilatura``
(Barbaresi, 2021; what RefinedWeb and FineWeb used) use richer rules and scoring of text density.
:func:`score_extraction` compares any of them with the page's true main text, word by word.

Pages come from strangers, so the extractor's own tokenizer is linear in the page size whatever
the markup (every scan for the end of a tag, comment or script either finds it or consumes the
rest of the page, as the HTML standard does at the end of the file), and :func:`extract_text`, the
bytes-to-text entry point the pipeline uses, caps the page size and the seconds spent on a page.
"""

from __future__ import annotations

import html as _html
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

from lmfs.data import Doc, Stage

_SKIP = {"script", "style", "noscript", "template", "head", "svg", "iframe", "object", "canvas"}
_FURNITURE = {"nav", "footer", "aside", "form", "button", "select"}
# <header> is page furniture at the top of a page, but an article's own title and byline inside
# <article> or <main>.
_CONTENT_ROOTS = {"article", "main"}
# A class or id token is furniture when its last word (words split at "-" and "_") names a kind of
# furniture, optionally followed by layout words: "main-menu", "cookie-banner", "site-footer",
# "share-buttons" are; "menu-item-description", "commentary", "shareholder", "search-results" are not.
_FURNITURE_WORDS = (r"cookies?|consent|gdpr|banner|menu|menubar|nav|navbar|navigation|sidebar|footer|"
                    r"breadcrumbs?|share|sharing|social|comments?|newsletter|popup|advert|ads")
_LAYOUT_WORDS = r"bar|box|container|wrapper|wrap|links?|list|area|section|block|widget|buttons?|notice|panel|items?"
_FURNITURE_TOKEN = re.compile(rf"(?:^|[-_])(?:{_FURNITURE_WORDS})(?:[-_](?:{_LAYOUT_WORDS}))*$", re.IGNORECASE)
_FURNITURE_ROLES = {"navigation", "banner", "contentinfo", "complementary", "menu", "menubar", "search", "dialog"}
# Block elements: a paragraph break (blank line) before and after; line elements: a line break.
_PARAGRAPH = {"p", "div", "section", "article", "main", "header", "footer", "nav", "aside", "form", "hr", "ul",
              "ol", "dl", "table", "pre", "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "figure", "figcaption",
              "caption", "title", "body", "address", "details", "summary", "fieldset", "center", "hgroup", "dialog"}
_LINE = {"br", "li", "tr", "dt", "dd", "td", "th", "option"}
_VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr",
         "param", "keygen"}
# Elements whose content is raw text up to their end tag (no tags inside).
_RAW_TEXT = {"script", "style", "textarea", "title", "xmp", "iframe", "noembed", "noframes", "noscript"}

# The next "<" that can start markup (a tag, an end tag, a comment, a declaration).
_MARKUP = re.compile(r"<[A-Za-z/!?]")
# A start tag: name, then attributes (quoted values may hold ">") up to ">". Possessive
# quantifiers (*+, ++) never give back what they matched, so a tag without its ">" fails after one
# pass over the text instead of retrying every split of it (quadratic).
_START_TAG = re.compile(r"""<([A-Za-z][^\t\n\f\r />]*+)((?:[^>"']++|"[^"]*+"|'[^']*+')*+)>""")
_END_TAG = re.compile(r"</([A-Za-z][^\t\n\f\r />]*+)[^>]*+>")
_ATTR = re.compile(r"""([^\s"'>/=]+)(?:\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]*)))?""")
_SPACE = re.compile(r"\s+")
_RAW_END: dict[str, re.Pattern] = {}

_PARA, _BR = 2, 1  # break strengths


class ExtractionError(ValueError):
    """A page that cannot be turned into text; ``reason`` is the drop reason the pipeline counts."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Verbatim(str):
    """Text inside ``<pre>``: its line breaks and indentation are kept as they are."""


class TextCollector:
    """Collects text outside skipped elements; block elements end a paragraph, line elements a line."""

    def __init__(self, main_content: bool) -> None:
        self.main_content = main_content
        self.skip_depth = 0          # > 0 while inside an element whose text is dropped
        self.content_depth = 0       # > 0 while inside <article> or <main>
        self.pre = 0
        # Open elements and whether each started a skip, as two lists of shared objects (interned
        # names, bools): a page of 100,000 nested tags allocates nothing per tag that lives on.
        self.tags: list[str] = []
        self.skips: list[bool] = []
        self.open = Counter()        # open elements by name: an end tag without an open match costs O(1)
        self.parts: list = []        # str, _Verbatim, or a break strength

    def _skips(self, tag: str, attrs: str) -> bool:
        if tag in _SKIP:
            return True
        if not self.main_content:
            return False
        if tag in _FURNITURE or (tag == "header" and not self.content_depth):
            return True
        if not attrs:
            return False
        for name, v1, v2, v3 in _ATTR.findall(attrs):
            name = name.lower()
            value = v1 or v2 or v3
            if name in ("class", "id") and any(_FURNITURE_TOKEN.search(t) for t in value.split()):
                return True
            if name == "role" and value.strip().lower() in _FURNITURE_ROLES:
                return True
        return False

    def _break(self, strength: int) -> None:
        if not self.skip_depth:
            self.parts.append(strength)

    def start(self, tag: str, attrs: str) -> None:
        if tag in _VOID:
            if tag in _LINE:
                self._break(_BR)
            elif tag in _PARAGRAPH:
                self._break(_PARA)
            return
        skips = self._skips(tag, attrs)
        self.tags.append(tag)
        self.skips.append(skips)
        self.open[tag] += 1
        self.skip_depth += skips
        self.pre += tag == "pre"
        self.content_depth += tag in _CONTENT_ROOTS
        self._break(_PARA if tag in _PARAGRAPH else _BR if tag in _LINE else 0)

    def end(self, tag: str) -> None:
        # Close up to the matching open tag: real pages leave <p>, <li> and friends unclosed.
        if not self.open[tag]:
            return
        while self.tags:
            t, skips = self.tags.pop(), self.skips.pop()
            self.open[t] -= 1
            self._break(_PARA if t in _PARAGRAPH else _BR if t in _LINE else 0)
            self.skip_depth -= skips
            self.pre -= t == "pre"
            self.content_depth -= t in _CONTENT_ROOTS
            if t == tag:
                break

    def data(self, data: str) -> None:
        if self.skip_depth or not data:
            return
        data = _html.unescape(data) if "&" in data else data
        if self.pre:
            self.parts.append(_Verbatim(data))
            return
        text = _SPACE.sub(" ", data)
        if text.startswith(" ") and self.parts and isinstance(self.parts[-1], str) and self.parts[-1].endswith(" "):
            text = text[1:]  # "a <!-- c --> b": one space between a and b, not two
        if text:
            self.parts.append(text)

    def text(self) -> str:
        out: list[str] = []
        line: list[str] = []
        verbatim = False
        pending = 0

        def flush() -> None:
            nonlocal pending, verbatim
            if verbatim:   # <pre>: drop blank lines around it and trailing spaces, keep the rest
                s = re.sub(r"\A(?:[ \t\r\f\v]*+\n)+", "", "".join(line)).rstrip()
            else:
                s = "".join(line).strip(" ")
            line.clear()
            verbatim = False
            if s.strip():
                if out:
                    out.append("\n\n" if pending == _PARA else "\n")
                out.append(s)
                pending = 0

        for part in self.parts:
            if isinstance(part, int):
                if part:
                    flush()
                    pending = max(pending, part)
            else:
                if isinstance(part, _Verbatim) and not verbatim:
                    if "".join(line).strip(" "):
                        flush()
                    else:
                        line.clear()
                    verbatim = True
                line.append(part)
        flush()
        return "".join(out)


def _feed(collector: TextCollector, html: str, deadline: float | None) -> None:
    """Tokenize ``html`` in one left-to-right pass and hand the pieces to ``collector``."""
    pos, n, steps = 0, len(html), 0
    while pos < n:
        steps += 1
        if deadline is not None and steps % 256 == 0 and time.monotonic() > deadline:
            raise TimeoutError
        m = _MARKUP.search(html, pos)
        if m is None:
            collector.data(html[pos:])
            break
        lt = m.start()
        if lt > pos:
            collector.data(html[pos:lt])
        nxt = html[lt + 1]
        if nxt == "!" and html.startswith("<!--", lt):      # a comment, to "-->" or the end of the page
            end = html.find("-->", lt + 4)
            pos = n if end < 0 else end + 3
        elif nxt in "!?":                                      # doctype, CDATA, processing instruction
            end = html.find(">", lt + 2)
            pos = n if end < 0 else end + 1
        elif nxt == "/":
            tag = _END_TAG.match(html, lt)
            if tag is not None:
                collector.end(sys.intern(tag.group(1).lower()))
                pos = tag.end()
            else:                                              # "</ x>", "</>": a bogus comment to ">"
                end = html.find(">", lt + 2)
                pos = n if end < 0 else end + 1
        else:
            tag = _START_TAG.match(html, lt)
            if tag is None:                                    # a tag cut by the end of the page: dropped
                break
            name = sys.intern(tag.group(1).lower())
            collector.start(name, tag.group(2))
            pos = tag.end()
            if name in _RAW_TEXT and not tag.group(2).rstrip().endswith("/"):
                close = _RAW_END.get(name)
                if close is None:
                    close = _RAW_END[name] = re.compile(rf"</{name}(?=[\s/>])", re.IGNORECASE)
                end = close.search(html, pos)
                stop = n if end is None else end.start()
                collector.data(html[pos:stop])
                pos = stop
                if end is None:
                    collector.end(name)


def html_to_text(html: str, main_content: bool = True, time_limit: float | None = None) -> str:
    """The visible text of ``html``: paragraphs separated by a blank line, one line per line element
    (``br``, ``li``, table cells, ...), ``<pre>`` text as it is.

    ``main_content=True`` also drops page furniture: ``nav``/``footer``/``aside``/``form`` elements,
    ``header`` outside ``article``/``main``, and elements whose class or id token names a menu,
    cookie notice, sidebar, ... (or whose ARIA role is navigation, banner, ...). Linear in the size
    of ``html``; ``time_limit`` (seconds) raises :class:`TimeoutError` when it runs out.

        >>> html_to_text("<nav>Home</nav><p>Hello &amp; <b>welcome</b></p><script>x=1</script><p>Bye</p>")
        'Hello & welcome\\n\\nBye'
    """
    collector = TextCollector(main_content)
    _feed(collector, html, None if time_limit is None else time.monotonic() + time_limit)
    return collector.text()


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

_META_CHARSET = re.compile(rb"""<meta[^>]{0,512}?charset\s*=\s*["']?([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
# The labels the WHATWG Encoding Standard (what browsers follow) maps to windows-1252: a page that
# says ISO-8859-1 or ASCII is decoded as windows-1252, whose bytes 0x80-0x9F are “”‘’€… rather than
# invisible control characters.
_WINDOWS_1252_LABELS = {"ansi_x3.4-1968", "ascii", "cp1252", "cp819", "csisolatin1", "ibm819", "iso-8859-1",
                        "iso-ir-100", "iso8859-1", "iso88591", "iso_8859-1", "iso_8859-1:1987", "l1", "latin1",
                        "us-ascii", "windows-1252", "x-cp1252", "latin-1"}
# windows-1252 as the Encoding Standard defines it: Python's cp1252 for 0x80-0x9F, except the five
# bytes cp1252 leaves undefined (0x81, 0x8D, 0x8F, 0x90, 0x9D), which stay the C1 code point.
_WINDOWS_1252 = {b: bytes([b]).decode("cp1252") for b in range(0x80, 0xA0) if b not in (0x81, 0x8D, 0x8F, 0x90, 0x9D)}


def decode_html(payload: bytes, content_type: str = "", max_bad: float = 0.01) -> str:
    """Decode an HTTP payload: the charset of the ``Content-Type`` header, else of a ``<meta>`` tag
    in the first 2 KB, else UTF-8. Labels are read as browsers read them (ISO-8859-1, Latin-1 and
    ASCII mean windows-1252). Bytes invalid in that encoding become U+FFFD; more than ``max_bad`` of
    them (a fraction of the characters) raises ``ValueError``: the page is not text in the encoding
    it claims.
    """
    match = re.search(r"charset\s*=\s*[\"']?([A-Za-z0-9_.:-]+)", content_type, re.IGNORECASE)
    charset = match.group(1) if match else None
    if charset is None:
        meta = _META_CHARSET.search(payload[:2048])
        charset = meta.group(1).decode("ascii") if meta else "utf-8"
    if charset.strip().lower() in _WINDOWS_1252_LABELS:
        charset = "windows-1252"
        text = payload.decode("latin-1").translate(_WINDOWS_1252)
    else:
        try:
            text = payload.decode(charset, errors="replace")
        except LookupError:  # an unknown encoding name: try the web's default
            charset, text = "utf-8", payload.decode("utf-8", errors="replace")
    bad = text.count("\ufffd")
    if bad > max_bad * max(len(text), 1):
        raise ValueError(f"{bad} of {len(text)} characters are not valid {charset}")
    return text


MAX_BYTES = 4 << 20      # larger pages are dropped ("page too large"); Common Crawl cuts payloads at 1 MiB
TIME_LIMIT = 10.0        # seconds per page for the lmfs extractor ("extraction time limit")


def extract_text(payload: bytes, content_type: str = "", *, method: str = "lmfs", main_content: bool = True,
                 max_bytes: int | None = MAX_BYTES, time_limit: float | None = TIME_LIMIT,
                 max_bad: float = 0.01) -> str:
    """An HTTP payload (bytes) to text: :func:`decode_html`, then one of :data:`EXTRACTORS`.

    ``method``: ``"lmfs"`` (:func:`html_to_text` with ``main_content``), ``"resiliparse"`` or
    ``"trafilatura"`` (both always main content). A page over ``max_bytes`` is refused before any
    work; ``time_limit`` bounds the seconds :func:`html_to_text` spends on one page (the two
    libraries are compiled code and run to the end). ``None`` turns a limit off. Raises
    :class:`ExtractionError` with ``reason`` ``"page too large"``, ``"undecodable bytes"`` or
    ``"extraction time limit"``.

        >>> extract_text(b"<p>caf\\xe9</p>", "text/html; charset=ISO-8859-1")
        'café'
    """
    if method not in EXTRACTORS:
        raise ValueError(f"unknown extractor {method!r}; choose one of {sorted(EXTRACTORS)}")
    if not main_content and method != "lmfs":
        raise ValueError(f"main_content=False needs method='lmfs': {method} always extracts the main content")
    if max_bytes is not None and len(payload) > max_bytes:
        raise ExtractionError("page too large", f"{len(payload):,} bytes > max_bytes={max_bytes:,}")
    try:
        html = decode_html(payload, content_type, max_bad)
    except ValueError as err:
        raise ExtractionError("undecodable bytes", str(err)) from None
    if method != "lmfs":
        return EXTRACTORS[method](html)
    try:
        return html_to_text(html, main_content, time_limit)
    except TimeoutError:
        raise ExtractionError("extraction time limit", f"more than {time_limit} s for {len(payload):,} bytes") from None


class Extract(Stage):
    """``Doc.html`` -> ``Doc.text`` with :func:`extract_text`; the raw bytes are dropped.

    Removes documents larger than ``max_bytes`` (``page too large``), whose bytes do not decode
    (``undecodable bytes``), that take the lmfs extractor more than ``time_limit`` seconds
    (``extraction time limit``), and those left with fewer than ``min_chars`` characters
    (``empty text``). Documents that arrive with text (WET) pass.
    """
    name = "extract"

    def __init__(self, method: str = "lmfs", min_chars: int = 1, *, main_content: bool = True,
                 max_bytes: int | None = MAX_BYTES, time_limit: float | None = TIME_LIMIT) -> None:
        super().__init__()
        if method not in EXTRACTORS:
            raise ValueError(f"unknown extractor {method!r}; choose one of {sorted(EXTRACTORS)}")
        self.method, self.min_chars, self.main_content = method, min_chars, main_content
        self.max_bytes, self.time_limit = max_bytes, time_limit

    def apply(self, doc: Doc) -> Doc | str | tuple[str, str]:
        if doc.html is not None:
            try:
                doc.text = extract_text(doc.html, doc.content_type, method=self.method, main_content=self.main_content,
                                        max_bytes=self.max_bytes, time_limit=self.time_limit)
            except ExtractionError as err:
                return err.reason, str(err)
            doc.html = None
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
