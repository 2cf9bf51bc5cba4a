"""WARC files: the format of a web crawl, written and read.

A WARC file (ISO 28500; Common Crawl publishes WARC/1.0 and WARC/1.1) is a sequence of records.
Each record is a block of ``WARC/1.0`` headers (type, id, date, target URI, ``Content-Length``), an
empty line, ``Content-Length`` bytes of content, and two line breaks. Common Crawl's three
products are all this format:

* **WARC**: ``request`` / ``response`` records, the response content being the whole HTTP reply
  (status line, HTTP headers, body) as the crawler received it;
* **WAT**: ``metadata`` records, JSON about each response (links, headers);
* **WET**: ``conversion`` records, the plain text Common Crawl extracted from each page.

Every record is gzip-compressed on its own and the members concatenated, so a reader can seek to
any record by its byte offset (the CDX index stores them) and a damaged record spoils only itself.

:func:`pack_html` turns folders of HTML pages (Debian's documentation packages, any folder) into
such a file with :func:`write_warc`, so the pipeline reads real people-written pages in the format a
crawl download has; :func:`read_warc` reads it, or a Common Crawl WARC/WET file. A record whose
``Content-Length`` is wrong costs that record only: the reader checks that each record's content is
followed by the next ``WARC/1.`` header and otherwise resumes at the next one it finds.
"""

from __future__ import annotations

import base64
import datetime as dt
import glob
import gzip
import hashlib
import itertools
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from lmfs.data import Doc, StageStats

# Where Debian installs people-written HTML: CPython's manual (python3-doc links to python3.X-doc's
# folder) and the Debian Reference in a dozen languages (debian-reference-de, -fr, -ja, ... all put
# their pages, named ch01.de.html etc., in one folder).
DOC_GLOBS = ("/usr/share/doc/python3*-doc/html", "/usr/share/debian-reference")
# Folders to read instead, separated by ':' (e.g. the same pages unpacked on a machine without the
# packages: the GPU suite unpacks the copy `make wheelhouse` packs).
DOC_ROOTS_VAR = "LMFS_DOC_ROOTS"

CRLF = b"\r\n"


def find_doc_roots() -> list[Path]:
    """Installed documentation folders that hold HTML pages, in a fixed order (may be empty).

    Install them on Debian/Ubuntu with ``apt-get install python3-doc debian-reference`` (the second
    pulls every translation; ``debian-reference-de`` etc. pick one). ``$LMFS_DOC_ROOTS`` names
    the folders instead (an error if one holds no pages).
    """
    roots: list[Path] = []
    chosen = os.environ.get(DOC_ROOTS_VAR, "").strip()
    if chosen:
        for folder in chosen.split(":"):
            real = Path(folder).resolve()
            if not real.is_dir() or next(real.rglob("*.html"), None) is None:
                raise FileNotFoundError(f"{DOC_ROOTS_VAR}: {folder} is not a folder of HTML pages")
            roots.append(real)
        return roots
    for pattern in DOC_GLOBS:
        for path in sorted(glob.glob(pattern)):
            real = Path(path).resolve()  # python3-doc's folder is a link to python3.X's
            if real.is_dir() and real not in roots and next(real.rglob("*.html"), None) is not None:
                roots.append(real)
    return roots


def _record(headers: list[tuple[str, str]], content: bytes) -> bytes:
    """One record, uncompressed: ``WARC/1.0`` header lines, blank line, content, two CRLFs."""
    lines = [b"WARC/1.0"] + [f"{k}: {v}".encode() for k, v in headers]
    lines.append(f"Content-Length: {len(content)}".encode())
    return CRLF.join(lines) + CRLF + CRLF + content + CRLF + CRLF


def _gzip(record: bytes) -> bytes:
    return gzip.compress(record, compresslevel=6, mtime=0)  # mtime=0: the same pages give the same bytes


def response_record(url: str, payload: bytes, content_type: str = "text/html; charset=utf-8",
                    stamp: str = "2026-01-01T00:00:00Z") -> bytes:
    """A ``response`` record (uncompressed): an HTTP/1.1 reply with ``payload`` for ``url``, with the
    block and payload SHA-1 digests crawlers write."""
    http = (b"HTTP/1.1 200 OK\r\n" + f"Content-Type: {content_type}\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return _record([("WARC-Type", "response"), ("WARC-Date", stamp),
                    ("WARC-Record-ID", f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>"),
                    ("WARC-Target-URI", url),
                    ("WARC-Block-Digest", _sha1(http)), ("WARC-Payload-Digest", _sha1(payload)),
                    ("Content-Type", "application/http; msgtype=response")], http)


def _sha1(data: bytes) -> str:
    return "sha1:" + base64.b32encode(hashlib.sha1(data).digest()).decode()  # the digest form crawls use


def write_warc(pages: Iterable[tuple[str, bytes]], path: str | os.PathLike,
               content_type: str = "text/html; charset=utf-8",
               date: dt.datetime | None = None) -> Path:
    """Write ``(url, payload)`` pairs as a WARC/1.0 file, one gzip member per record.

    The file starts with a ``warcinfo`` record; each page becomes a ``response`` record whose
    content is an HTTP/1.1 reply (status line, ``Content-Type``, ``Content-Length``, payload), with
    block and payload SHA-1 digests as crawlers write them. ``content_type`` may be a string or a
    callable ``url -> str`` (packed folders hold non-HTML files too). Record ids derive from the
    URL, and the date is fixed, so the same pages always give the same file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    date = date or dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    stamp = date.strftime("%Y-%m-%dT%H:%M:%SZ")
    tmp = path.with_name(path.name + ".part")  # a half-written file never carries the final name
    with open(tmp, "wb") as f:
        info = b"software: lmfs\r\nformat: WARC File Format 1.0\r\n"
        f.write(_gzip(_record([("WARC-Type", "warcinfo"), ("WARC-Date", stamp), ("WARC-Filename", path.name),
                               ("WARC-Record-ID", f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, path.name)}>"),
                               ("Content-Type", "application/warc-fields")], info)))
        for url, payload in pages:
            kind = content_type(url) if callable(content_type) else content_type
            f.write(_gzip(response_record(url, payload, kind, stamp)))
    os.replace(tmp, path)
    return path


_TYPES = {".html": "text/html", ".htm": "text/html", ".xhtml": "application/xhtml+xml",
          ".txt": "text/plain", ".css": "text/css", ".js": "application/javascript",
          ".png": "image/png", ".svg": "image/svg+xml", ".json": "application/json"}


def pack_html(roots: Sequence[str | os.PathLike], path: str | os.PathLike, max_pages: int | None = None,
              base_url: str = "http://docs.localhost") -> Path:
    """Pack every ``.html`` page under ``roots`` into one WARC file at ``path``.

    Pages are taken in sorted order, from each folder in turn (``max_pages`` caps the count), and get the URL
    ``{base_url}/{root name}/{relative path}``. The payload is the file's bytes as they are: the
    reader, not the packer, deals with their encoding.
    """
    files = []
    for root in map(Path, roots):
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a folder of HTML pages")
        files.append([(root, f) for f in sorted(root.rglob("*")) if f.suffix in (".html", ".htm") and f.is_file()])
    # Take the folders' pages in turn, so a cap on the count still samples every folder.
    chosen = [pair for group in itertools.zip_longest(*files) for pair in group if pair is not None][:max_pages]

    def pages() -> Iterator[tuple[str, bytes]]:
        for root, file in chosen:
            yield f"{base_url}/{root.name}/{file.relative_to(root).as_posix()}", file.read_bytes()
    return write_warc(pages(), path)


HTML_TYPES = ("text/html", "application/xhtml+xml")


class _Stream:
    """A byte stream read by lines and blocks, with bytes pushed back in front (to resynchronise)."""

    def __init__(self, raw) -> None:
        self.raw, self.front = raw, b""

    def readline(self, limit: int = 1 << 16) -> bytes:
        if self.front:
            cut = self.front.find(b"\n") + 1
            if cut:
                line, self.front = self.front[:cut], self.front[cut:]
                return line
            line, self.front = self.front, b""
            return line + self.raw.readline(limit)
        return self.raw.readline(limit)

    def read(self, n: int) -> bytes:
        head, self.front = self.front[:n], self.front[n:]
        return head + self.raw.read(n - len(head)) if len(head) < n else head

    def unread(self, data: bytes) -> None:
        self.front = data + self.front

    def skip_to(self, marker: bytes, chunk: int = 1 << 16) -> int:
        """Drop bytes up to the next ``marker`` (left unread, at the front) or the end; the count dropped."""
        dropped, buf = 0, b""
        while True:
            more = self.read(chunk)
            buf += more
            at = buf.find(marker)
            if at >= 0:
                self.unread(buf[at:])
                return dropped + at
            if not more:
                return dropped + len(buf)
            keep = len(marker) - 1             # a marker may straddle two chunks
            dropped += len(buf) - keep
            buf = buf[-keep:]


_RECORD_START = b"WARC/1."


def _warc_records(path: Path, stats: StageStats):
    """``(headers, content or None, note)`` per WARC record of ``path``, resynchronising on damage.

    A record whose ``Content-Length`` is wrong (its content is not followed by the blank lines and
    the next ``WARC/1.`` header, or the end of the file) is given as ``(headers, None, why)`` and
    reading goes on at the next record's header; so do bytes that are not a record at all. A file
    that does not begin with a WARC record raises ``ValueError``.
    """
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")
    with raw:
        stream, first = _Stream(raw), True
        while True:
            line = stream.readline()
            while line in (b"\r\n", b"\n"):       # the blank lines after a record
                line = stream.readline()
            if not line:
                if first:
                    raise ValueError(f"{path} holds no WARC record: it is empty")
                return
            if not line.startswith(_RECORD_START):
                if first:
                    raise ValueError(f"{path} is not a WARC/WET file: it begins with {line[:60]!r}, not "
                                     f"'WARC/1.0' (is it a compressed archive of another kind, or text?)")
                stream.unread(line)
                skipped = stream.skip_to(b"\n" + _RECORD_START)
                stream.read(1)
                yield None, None, f"{skipped:,} bytes that are not a WARC record, skipped to the next header"
                continue
            first = False
            headers: dict[str, str] = {}
            while True:
                line = stream.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                key, _, value = line.decode("utf-8", "replace").partition(":")
                headers[key.strip().lower()] = value.strip()
            try:
                length = int(headers.get("content-length", ""))
            except ValueError:
                length = -1
            if length < 0:
                skipped = stream.skip_to(b"\n" + _RECORD_START)
                stream.read(1)
                yield headers, None, (f"no valid Content-Length ({headers.get('content-length')!r}); "
                                      f"skipped {skipped:,} bytes")
                continue
            content = stream.read(length)
            if len(content) < length:
                yield headers, content, "truncated"
                return
            tail = stream.read(4 + len(_RECORD_START))
            if tail.startswith(b"\r\n\r\n") or b"\r\n\r\n".startswith(tail):  # the record's end, or the file's
                stream.unread(tail[4:])
                yield headers, content, None
                continue
            # The length is wrong: the record really ends where the next header begins.
            data = content + tail
            at = data.find(b"\r\n\r\n" + _RECORD_START)
            if at >= 0:
                stream.unread(data[at + 4:])
            else:
                stream.unread(tail)
                stream.skip_to(b"\n" + _RECORD_START)
                stream.read(1)
            yield headers, None, f"Content-Length {length:,} does not end the record"


def read_warc(path: str | os.PathLike, stats: StageStats | None = None) -> Iterator[Doc]:
    """Yield a :class:`Doc` per HTML ``response`` record (WARC) or ``conversion`` record (WET).

    Plain or gzipped files (one gzip member per record, or the whole file), Common Crawl's included.
    Records that cannot become a document are skipped and counted in ``stats`` (a
    ``StageStats("read")`` if none is given) with a reason: ``truncated record`` (the file ends
    inside it, or its gzip member is cut), ``wrong Content-Length`` (its content is not followed by
    the next record: reading resumes at the next ``WARC/1.`` header, so the records after it are
    kept), ``non-HTML payload`` (an image, a PDF, ...), ``empty payload``, ``HTTP status NNN``,
    ``malformed HTTP response``, ``unreadable record`` (bytes that are not a record, skipped to the
    next header; or a corrupt gzip stream, where reading stops and the records before are kept).
    Records of other types (``request``, ``metadata``, ``warcinfo``) are counted in
    ``stats.counts``, not as documents. A file that does not begin with a WARC record (random
    bytes, plain text, another archive format) raises ``ValueError``.
    """
    stats = stats if stats is not None else StageStats("read")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such WARC/WET file (pack one with `python -m lmfs.data crawl`)")
    records = _warc_records(path, stats)
    while True:
        try:
            headers, content, note = next(records)
        except StopIteration:
            return
        except (OSError, EOFError, zlib.error) as err:
            # A corrupt or cut gzip stream: the records after this point cannot be located.
            stats.seen += 1
            reason = "truncated record" if isinstance(err, EOFError) else "unreadable record"
            stats.remove(reason, None, f"{type(err).__name__}: {err}")
            return
        if headers is None:
            stats.seen += 1
            stats.remove("unreadable record", None, note)
            continue
        rtype = headers.get("warc-type", "").lower()
        if rtype not in ("response", "conversion"):
            stats.counts[f"{rtype or 'untyped'} records"] += 1
            continue
        stats.seen += 1
        doc = Doc(url=headers.get("warc-target-uri", ""),
                  meta={"record_id": headers.get("warc-record-id", ""), "date": headers.get("warc-date", "")})
        if note == "truncated":
            stats.remove("truncated record", doc, f"{len(content)} of {headers['content-length']} bytes")
            continue
        if content is None:
            stats.remove("wrong Content-Length", doc, note)
            continue
        if rtype == "conversion":  # WET: the text is the content
            doc.text = content.decode("utf-8", "replace")
            if not doc.text.strip():
                stats.remove("empty payload", doc)
                continue
        else:
            head, sep, body = content.partition(b"\r\n\r\n")
            status, http = _http_head(head)
            if not sep or status is None:
                stats.remove("malformed HTTP response", doc, head[:200].decode("latin-1"))
                continue
            if status != 200:
                stats.remove(f"HTTP status {status}", doc, head[:200].decode("latin-1"))
                continue
            doc.content_type = http.get("content-type", "")
            mime = doc.content_type.split(";")[0].strip().lower()
            if mime not in HTML_TYPES:
                stats.remove("non-HTML payload", doc, f"Content-Type: {doc.content_type or '(none)'}")
                continue
            if not body.strip():
                stats.remove("empty payload", doc, "")
                continue
            doc.html = body
        stats.kept += 1
        yield doc


def _http_head(head: bytes) -> tuple[int | None, dict[str, str]]:
    """Parse ``HTTP/1.1 200 OK`` and the header lines; ``(None, {})`` when there is no status line."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return None, {}
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


def write_sample_warc(path: str | os.PathLike, n_pages: int, seed: int = 0,
                      truncate_last: bool = True) -> Path:
    """The generated site of :mod:`lmfs.data.sample` as a WARC file; with ``truncate_last``, one more
    record follows, cut in half, as when a crawler's download breaks off."""
    from lmfs.data.sample import generate_site

    pages = generate_site(n_pages, seed)
    types = {p.url: p.content_type for p in pages}
    path = write_warc(((p.url, p.html) for p in pages), path, content_type=types.__getitem__)
    if truncate_last:  # one more record, its gzip member holding only the first half of it
        record = response_record("http://town.example.org/article/cut.html", pages[0].html)
        with open(path, "ab") as f:
            f.write(gzip.compress(record[:len(record) // 2], mtime=0))
    return path


def pack_crawl(path: str | os.PathLike, max_pages: int, roots: Sequence[str | os.PathLike] | None = None,
               seed: int = 0, installed_docs: bool = True) -> tuple[Path, str]:
    """The crawl the data lectures read: ``(WARC path, what it holds)``.

    The HTML pages under ``roots`` (default: the installed Debian documentation of
    :func:`find_doc_roots`, unless ``installed_docs`` is False), up to ``max_pages``; where there
    are none, the generated site of :mod:`lmfs.data.sample` with ``max_pages`` pages, and the
    description says so.
    """
    roots = [Path(r) for r in roots] if roots else find_doc_roots() if installed_docs else []
    if roots:
        path = pack_html(roots, path, max_pages=max_pages)
        return path, f"HTML pages from {', '.join(map(str, roots))}"
    path = write_sample_warc(path, max_pages, seed=seed)
    why = ("no Debian documentation is installed (apt-get install python3-doc debian-reference for real pages)"
           if installed_docs else "installed documentation not asked for")
    return path, f"the generated sample site ({max_pages} pages): {why}"
