"""Reading, extraction and language-id throughput: lmfs vs the libraries it is compared with.

    python -m lmfs.benchmarks extraction [--pages 2000] [--warc PATH] [--repeats 3] [--json out.json]

One process, on the crawl of lecture 13 (installed Debian documentation, else the generated site;
``--warc`` reads any WARC file instead). Each measurement is the best of ``--repeats`` runs:

a. **read**: records/s of :func:`lmfs.data.warc.read_warc` (the record framing checked and
   resynchronised, the HTTP parsing and bad-record bookkeeping) vs a plain ``warcio`` loop over
   the same file;
b. **extract**: pages/s and MB/s of HTML of :func:`lmfs.data.extract.html_to_text` vs
   ``resiliparse`` and ``trafilatura``, on the same decoded pages;
c. **langid**: documents/s of the lmfs hashed character-n-gram classifier (trained on the
   generated multilingual text first, not timed) vs ``py3langid``, on the extracted texts, and
   how often the two agree.

Ratios are lmfs ÷ library (above 1: lmfs is faster).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lmfs.bench import save_json


def best_time(fn, repeats: int) -> float:
    """Fastest of ``repeats`` calls of ``fn()``, seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m lmfs.benchmarks extraction", description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=2000, help="pages packed into the crawl (default 2000)")
    p.add_argument("--warc", type=Path, help="read this WARC file instead of packing a crawl")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)

    from warcio.archiveiterator import ArchiveIterator

    from lmfs.data.extract import EXTRACTORS, decode_html
    from lmfs.data.langid import py3langid_predict, train_langid
    from lmfs.data.sample import sample_texts
    from lmfs.data.warc import pack_crawl, read_warc

    if args.warc:
        path, source = args.warc, str(args.warc)
    else:
        from lmfs.env import scratch_dir  # the packed crawl is removed when the benchmark ends

        path, source = pack_crawl(scratch_dir("lmfs-bench-extract-") / "crawl.warc.gz", args.pages)
    print(f"crawl: {source} ({path.stat().st_size / 1e6:.1f} MB)")
    rows = []

    docs = list(read_warc(path))

    def warcio_loop():
        with open(path, "rb") as f:
            for record in ArchiveIterator(f):
                if record.rec_type == "response":
                    record.content_stream().read()
    t_lmfs, t_warcio = best_time(lambda: list(read_warc(path)), args.repeats), best_time(warcio_loop, args.repeats)
    rows.append(dict(part="read", impl="lmfs read_warc", per_s=len(docs) / t_lmfs, unit="records/s",
                     ratio=t_warcio / t_lmfs))
    rows.append(dict(part="read", impl="warcio", per_s=len(docs) / t_warcio, unit="records/s", ratio=None))

    pages = []
    for doc in docs:
        try:
            pages.append(decode_html(doc.html, doc.content_type))
        except ValueError:  # not text: nothing to extract
            continue
    mb = sum(len(h.encode()) for h in pages) / 1e6
    seconds = {name: best_time(lambda f=f: [f(h) for h in pages], args.repeats) for name, f in EXTRACTORS.items()}
    for name, s in seconds.items():
        rows.append(dict(part="extract", impl=name, per_s=len(pages) / s, unit="pages/s", mb_per_s=mb / s,
                         ratio=None if name == "lmfs" else s / seconds["lmfs"]))

    texts = [t for t in (EXTRACTORS["lmfs"](h) for h in pages) if t]
    train_texts, train_labels = sample_texts(300, seed=0)
    model = train_langid(train_texts, train_labels)
    py3langid_predict("warm up: load the model")
    t_ours = best_time(lambda: [model.predict(t) for t in texts], args.repeats)
    t_theirs = best_time(lambda: [py3langid_predict(t) for t in texts], args.repeats)
    agree = sum(model.predict(t)[0] == py3langid_predict(t)[0] for t in texts) / max(len(texts), 1)
    rows.append(dict(part="langid", impl="lmfs hashed n-grams", per_s=len(texts) / t_ours, unit="docs/s",
                     ratio=t_theirs / t_ours, agreement=agree))
    rows.append(dict(part="langid", impl="py3langid", per_s=len(texts) / t_theirs, unit="docs/s", ratio=None))

    print(f"\n{'part':<8} {'implementation':<28} {'throughput':>16} {'MB/s':>7} {'lmfs ÷ it':>10}")
    for r in rows:
        mbs = f"{r['mb_per_s']:.2f}" if "mb_per_s" in r else ""
        # The ratio is printed on the library's line for extraction and on lmfs's line otherwise.
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else ""
        print(f"{r['part']:<8} {r['impl']:<28} {r['per_s']:>10.0f} {r['unit']:<9} {mbs:>7} {ratio:>10}")
    print(f"\nlangid agreement lmfs vs py3langid on {len(texts)} crawl texts: {agree:.1%}")
    result = dict(source=source, records=len(docs), pages=len(pages), html_mb=mb, rows=rows)
    save_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
