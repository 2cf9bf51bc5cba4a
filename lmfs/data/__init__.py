"""Data for the lectures, and the pipeline that turns web pages into training text.

The embedded corpora (:mod:`lmfs.data.corpora`) feed the early lectures. Lectures 13-14 build the
pipeline a web crawl goes through, one module per step:

    warc.py        read WARC/WET files (and pack HTML folders into one)   -> Doc.html
    extract.py     HTML -> text                                           -> Doc.text
    langid.py      language identification                                -> Doc.lang
    pii.py         mask emails, phone numbers, IP addresses
    rules.py       C4 line rules and Gopher quality rules
    ngram.py       n-gram hashes and a Kneser-Ney language model (perplexity filtering)
    classifier.py  a fastText-style quality classifier
    dsir.py        importance resampling toward a target distribution
    negatives.py   low-quality text to test filters on: salads and near misses of good text
    dedup.py       exact, Bloom-filter and MinHash/LSH deduplication
    pipeline.py    the sharded, resumable run of all of it over many files
    sample.py      a generated web site to run all of it on without a network (and language-id tests)

Every step is a :class:`Stage`: called on a :class:`Doc`, it returns the document (kept, maybe
changed) or ``None`` (removed), and records in its :class:`StageStats` how many it saw and kept,
why it removed the others, and a few examples of each reason. :func:`run_stages` chains stages
lazily over a stream of documents; :func:`stats_table` lays the statistics out side by side.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass
class Doc:
    """One web page on its way through the pipeline.

    ``html`` is the raw HTTP payload until extraction replaces it with ``text`` (WET records arrive
    with ``text`` already set). ``url`` identifies the document in statistics and examples.
    """
    url: str
    text: str = ""
    html: bytes | None = None
    content_type: str = ""
    lang: str | None = None
    lang_score: float = 0.0
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The fields worth writing to a JSONL shard (the raw HTML is not)."""
        return dict(url=self.url, text=self.text, lang=self.lang, lang_score=self.lang_score, meta=self.meta)

    @classmethod
    def from_json(cls, record: dict) -> Doc:
        return cls(url=record["url"], text=record.get("text", ""), lang=record.get("lang"),
                   lang_score=record.get("lang_score", 0.0), meta=record.get("meta", {}))


@dataclass
class StageStats:
    """What one stage did: documents seen and kept, removals by reason, other counters, examples.

    Picklable, so shards processed in other processes can send theirs back and :meth:`merge` them.
    """
    name: str
    seen: int = 0
    kept: int = 0
    removed: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    seconds: float = 0.0         # time spent inside the stage
    max_examples: int = 3

    def remove(self, reason: str, doc: Doc | None = None, snippet: str | None = None) -> None:
        """Count one removal for ``reason``; keep the first few as (url, snippet) examples."""
        self.removed[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < self.max_examples:
            if snippet is None and doc is not None:
                snippet = doc.text or (doc.html or b"")[:2000].decode("utf-8", "replace")
            shown.append((doc.url if doc is not None else "", _shorten(snippet or "")))

    def merge(self, other: StageStats) -> None:
        if other.name != self.name:
            raise ValueError(f"cannot merge the stats of stage {other.name!r} into {self.name!r}")
        self.seen += other.seen
        self.kept += other.kept
        self.seconds += other.seconds
        self.removed.update(other.removed)
        self.counts.update(other.counts)
        for reason, shown in other.examples.items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(shown[:self.max_examples - len(mine)])

    def keep_rate(self) -> float:
        return self.kept / self.seen if self.seen else float("nan")

    def table_row(self) -> dict:
        top = ", ".join(f"{reason} ({n})" for reason, n in self.removed.most_common(4))
        return dict(stage=self.name, seen=self.seen, kept=self.kept, keep_rate=round(self.keep_rate(), 4),
                    docs_per_s=round(self.seen / self.seconds) if self.seconds else None, removed_for=top)


def _shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class Stage:
    """A pipeline step: ``stage(doc)`` returns the document (kept, maybe changed) or ``None``.

    Subclasses implement :meth:`apply`, which returns the kept document, or a string saying why the
    document is removed (or a ``(reason, detail)`` pair, the detail shown as the example);
    ``__call__`` does the counting. An exception raised by :meth:`apply` removes that document
    only, with the reason ``error: <exception type>`` and the message as the example (the first
    ones are kept), so one malformed page does not end a shard of thousands.
    """
    name = "stage"

    def __init__(self) -> None:
        self.stats = StageStats(self.name)

    def apply(self, doc: Doc) -> Doc | str | tuple[str, str]:
        raise NotImplementedError

    def __call__(self, doc: Doc) -> Doc | None:
        self.stats.seen += 1
        start = time.perf_counter()
        try:
            result = self.apply(doc)
        except Exception as err:  # noqa: BLE001 - any bug or bad input in one document
            result = (f"error: {type(err).__name__}", f"{type(err).__name__}: {err}")
        self.stats.seconds += time.perf_counter() - start
        if isinstance(result, tuple):
            self.stats.remove(result[0], doc, result[1])
            return None
        if isinstance(result, str):
            self.stats.remove(result, doc)
            return None
        self.stats.kept += 1
        return result


def run_stages(docs: Iterable[Doc], stages: Sequence[Stage]) -> Iterator[Doc]:
    """Pass each document through ``stages`` in order, lazily; yield the ones every stage kept."""
    for doc in docs:
        for stage in stages:
            doc = stage(doc)
            if doc is None:
                break
        else:
            yield doc


def stats_table(stats: Iterable[StageStats]):
    """A pandas table, one row per stage: seen, kept, keep rate, the commonest removal reasons."""
    import pandas as pd
    rows = [s.table_row() for s in stats]
    return pd.DataFrame(rows).set_index("stage")
