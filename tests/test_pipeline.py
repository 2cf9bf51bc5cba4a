"""The sharded pipeline (lecture 14): outputs, statistics, several processes, resuming."""

import json
import os

import numpy as np
import pytest

from lmfs.data import Doc, Stage
from lmfs.data.dedup import jaccard, planted_corpus, shingle_sets
from lmfs.data.pipeline import is_done, read_docs, run_pipeline


class DropShort(Stage):
    """A stub stage: removes documents of fewer than 5 words."""
    name = "short"

    def apply(self, doc):
        return "too short" if len(doc.text.split()) < 5 else doc


class Upper(Stage):
    """A stub stage that changes the text (the change must reach the output)."""
    name = "upper"

    def apply(self, doc):
        doc.text = doc.text.upper()
        return doc


def _shards(tmp_path, n_shards=3, per_shard=30):
    docs, source = planted_corpus(n_shards * per_shard, words_per_doc=150, copy_fraction=0.3, max_edit=0.02, seed=5)
    docs[3] = "tiny doc"
    docs[40] = docs[7]                                   # an exact copy across shards
    paths = []
    for k in range(n_shards):
        path = tmp_path / "in" / f"part{k}.jsonl"
        path.parent.mkdir(exist_ok=True)
        lines = [json.dumps(Doc(f"d{i}", docs[i]).to_json()) for i in range(k * per_shard, (k + 1) * per_shard)]
        if k == 1:
            lines.insert(5, "{this is not json")
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths, docs, source


def _texts(report):
    return [json.loads(line)["text"] for f in report.outputs for line in open(f)]


def test_pipeline_filters_dedups_and_reports(tmp_path):
    paths, docs, source = _shards(tmp_path)
    report = run_pipeline(paths, tmp_path / "out", [DropShort(), Upper()], threshold=0.7, bands=32, rows=4,
                          workers=2, progress=False)
    stats = {s.name: s for s in report.stats}
    assert stats["read"].removed["bad json line"] == 1 and stats["read"].kept == 90
    assert stats["short"].removed["too short"] == 1 and stats["upper"].kept == 89
    seen, copies = set(), 0
    for i, text in enumerate(docs):                      # brute force: texts met before, in shard order
        copies += i != 3 and text in seen
        seen.add(text)
    assert stats["exact dedup"].removed["exact duplicate"] == copies >= 1
    out = _texts(report)
    assert len(out) == len(set(out)) == report.docs_out == stats["near dedup"].kept
    assert all(t == t.upper() for t in out)
    # Every original that passed the filters is kept, every close copy is gone.
    originals = {docs[i].upper() for i in np.flatnonzero(source < 0) if i not in (3, 40)}
    assert originals <= set(out)
    sets = shingle_sets(docs)
    close = [i for i in np.flatnonzero(source >= 0)      # copies at Jaccard >= 0.9 of their source ...
             if i not in (3, 40) and source[i] not in (3, 40) and jaccard(sets[i], sets[source[i]]) >= 0.9]
    assert len(close) >= 5
    for i in close:                                      # ... survive only as the first copy of their text
        assert docs[i].upper() not in out or docs[i] == docs[source[i]]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [s["name"] for s in saved["stats"]] == ["read", "short", "upper", "exact dedup", "near dedup"]
    assert "near dedup" in str(report) and report.table().loc["near dedup", "kept"] == report.docs_out


def test_pipeline_resumes_and_redoes_only_unfinished_shards(tmp_path):
    paths, _, _ = _shards(tmp_path)
    stages = [DropShort()]
    first = run_pipeline(paths, tmp_path / "out", stages, workers=1, progress=False)
    again = run_pipeline(paths, tmp_path / "out", stages, workers=1, progress=False)
    assert again.skipped == dict(filter=3, sign=3, write=3)
    assert _texts(again) == _texts(first) and again.table().equals(first.table())

    # A shard killed half-way: its output exists but its marker does not; a temporary file lies beside it.
    final = tmp_path / "out" / "final" / "part1.jsonl"
    os.remove(str(final) + ".done.json")
    final.write_text(final.read_text()[:50])
    (final.parent / ".part1.jsonl.tmp123").write_text("half")
    resumed = run_pipeline(paths, tmp_path / "out", stages, workers=1, progress=False)
    assert resumed.skipped == dict(filter=3, sign=3, write=2)
    assert _texts(resumed) == _texts(first)

    # A changed input invalidates that shard's work (and the dedup decisions that depend on it).
    paths[2].write_text(paths[2].read_text() + json.dumps(Doc("new", "a brand new document with many words").to_json()) + "\n")
    changed = run_pipeline(paths, tmp_path / "out", stages, workers=1, progress=False)
    assert changed.skipped["filter"] == 2 and changed.docs_out == first.docs_out + 1


def test_read_docs_and_markers(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(Doc("u", "hello").to_json()) + "\n\n{bad\n")
    from lmfs.data import StageStats

    stats = StageStats("read")
    assert [d.text for d in read_docs(path, stats)] == ["hello"]
    assert stats.seen == 2 and stats.removed["bad json line"] == 1
    assert is_done(path, {}) is None
    with pytest.raises(FileNotFoundError, match="not found"):
        run_pipeline([tmp_path / "missing.jsonl"], tmp_path / "out", progress=False)


def test_pipeline_reads_warc(tmp_path):
    warc = pytest.importorskip("lmfs.data.warc")
    if not hasattr(warc, "write_warc"):
        pytest.skip("lmfs.data.warc.write_warc is not there yet")

    class Text(Stage):  # extraction stand-in: the page's bytes as text
        name = "text"

        def apply(self, doc):
            doc.text = (doc.html or b"").decode("utf-8", "replace")
            return doc

    page = b"<html><body>" + b"some words " * 30 + b"</body></html>"
    path = warc.write_warc([("http://a/1", page), ("http://a/2", page), ("http://a/3", b"<p>other text here</p>")],
                           tmp_path / "crawl.warc.gz")
    report = run_pipeline([path], tmp_path / "out", [Text()], workers=1, progress=False)
    stats = {s.name: s for s in report.stats}
    assert stats["read"].kept == 3 and stats["exact dedup"].removed["exact duplicate"] == 1 and report.docs_out == 2


def test_dedup_benchmark_runs_tiny(tmp_path, capsys):
    from lmfs.benchmarks.dedup import main

    out = tmp_path / "dedup.json"
    main(["--compare-docs", "200", "--docs", "1500", "--shard-docs", "500", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["compare"]["speedup"] > 1 and result["compare"]["true_pairs"] > 0
    assert result["stage"]["docs"] == 1500 and result["stage"]["shards"] == 3
    assert "ratio lmfs / datasketch" in capsys.readouterr().out
