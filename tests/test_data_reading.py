"""lmfs.data's reading and cleaning side: WARC, extraction, language id, PII, quality rules, stages."""

import gzip
import random
from collections import Counter

import pytest

from lmfs.data import Doc, Stage, StageStats, run_stages, stats_table
from lmfs.data.extract import Extract, decode_html, html_to_text, resiliparse_text, score_extraction
from lmfs.data.langid import LanguageFilter, char_ngram_buckets, train_langid
from lmfs.data.pii import MaskPII, mask_pii
from lmfs.data.rules import (C4Rules, C4Thresholds, GopherRules, c4_clean, dup_ngram_char_fraction,
                             gopher_reasons, top_ngram_char_fraction)
from lmfs.data.sample import LANGUAGES, generate_site, sample_texts
from lmfs.data.warc import _record, find_doc_roots, pack_crawl, pack_html, read_warc, write_sample_warc, write_warc

PAGE = b"<html><body><p>" + b"A page with enough words to keep around. " * 5 + b"</p></body></html>"


# ------------------------------------------------------------------ WARC

def test_warc_round_trip_and_warcio_reads_it(tmp_path):
    from warcio.archiveiterator import ArchiveIterator
    pages = [(f"http://x.example/{i}.html", PAGE + str(i).encode()) for i in range(20)]
    path = write_warc(pages, tmp_path / "a.warc.gz")
    assert [(d.url, d.html) for d in read_warc(path)] == pages
    with open(path, "rb") as f:
        records = [(r.rec_headers.get_header("WARC-Target-URI"), r.content_stream().read(), r.digest_checker.passed)
                   for r in ArchiveIterator(f, check_digests=True) if r.rec_type == "response"]
    assert [(u, p) for u, p, _ in records] == pages and all(ok for *_, ok in records)
    assert write_warc(pages, tmp_path / "copy" / "a.warc.gz").read_bytes() == path.read_bytes()  # deterministic


def test_bad_records_are_counted_and_skipped(tmp_path):
    path = write_warc([("http://a/1.html", PAGE), ("http://a/img.png", b"\x89PNG...."), ("http://a/e.html", b""),
                       ("http://a/2.html", PAGE)], tmp_path / "bad.warc.gz",
                      content_type=lambda u: "image/png" if u.endswith(".png") else "text/html")
    whole = path.read_bytes()
    path.write_bytes(whole[:-40])  # cut the last record's gzip member
    stats = StageStats("read")
    assert [d.url for d in read_warc(path, stats)] == ["http://a/1.html"]
    assert stats.removed == Counter({"non-HTML payload": 1, "empty payload": 1, "truncated record": 1})
    assert stats.seen == 4 and stats.kept == 1 and stats.counts["warcinfo records"] == 1

    plain = tmp_path / "cut.warc"   # uncompressed, cut inside a record's content
    plain.write_bytes(gzip.decompress(whole)[:-100])
    stats = StageStats("read")
    assert len(list(read_warc(plain, stats))) == 1 and stats.removed["truncated record"] == 1

    corrupt = bytearray(whole)       # garbage in the middle: the records before it survive
    middle = len(corrupt) // 2
    corrupt[middle:middle + 50] = b"x" * 50
    path.write_bytes(bytes(corrupt))
    stats = StageStats("read")
    docs = list(read_warc(path, stats))
    assert docs and docs[0].url == "http://a/1.html" and stats.removed["unreadable record"] == 1


def test_wet_conversion_records_arrive_as_text(tmp_path):
    record = _record([("WARC-Type", "conversion"), ("WARC-Target-URI", "http://w/1"),
                      ("Content-Type", "text/plain")], "Plain text of a page. Zwei Wörter.".encode())
    path = tmp_path / "x.warc.wet.gz"
    path.write_bytes(gzip.compress(record))
    (doc,) = read_warc(path)
    assert doc.url == "http://w/1" and doc.text == "Plain text of a page. Zwei Wörter." and doc.html is None


def test_pack_html_and_crawl_command(tmp_path, monkeypatch, capsys):
    root = tmp_path / "site"
    (root / "sub").mkdir(parents=True)
    (root / "index.html").write_bytes(PAGE)
    (root / "sub" / "page.html").write_bytes(b"<p>second</p>")
    (root / "style.css").write_bytes(b"p {}")
    path = pack_html([root], tmp_path / "docs.warc.gz")
    assert [(d.url, d.html) for d in read_warc(path)] == [("http://docs.localhost/site/index.html", PAGE),
                                                         ("http://docs.localhost/site/sub/page.html", b"<p>second</p>")]
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.html").write_bytes(b"<p>other</p>")
    capped = pack_html([root, other], tmp_path / "capped.warc.gz", max_pages=2)  # one page of each folder
    assert [d.url for d in read_warc(capped)] == ["http://docs.localhost/site/index.html",
                                                  "http://docs.localhost/other/a.html"]
    with pytest.raises(FileNotFoundError, match="not a folder"):
        pack_html([tmp_path / "missing"], tmp_path / "x.warc.gz")

    monkeypatch.setattr("lmfs.data.warc.find_doc_roots", lambda: [])  # as on a machine without the docs
    path, source = pack_crawl(tmp_path / "c.warc.gz", 40)
    assert "generated sample" in source and len(list(read_warc(path))) > 20
    monkeypatch.setattr("lmfs.data.warc.find_doc_roots", lambda: [root])  # as on a machine with them
    assert "HTML pages from" in pack_crawl(tmp_path / "d.warc.gz", 40)[1]
    assert "not asked for" in pack_crawl(tmp_path / "e.warc.gz", 40, installed_docs=False)[1]
    monkeypatch.undo()
    monkeypatch.setenv("LMFS_DOC_ROOTS", f"{root}:{other}")   # folders named instead of the installed ones
    assert find_doc_roots() == [root.resolve(), other.resolve()]
    monkeypatch.setenv("LMFS_DOC_ROOTS", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="LMFS_DOC_ROOTS"):
        find_doc_roots()
    monkeypatch.delenv("LMFS_DOC_ROOTS")

    from lmfs.data.__main__ import main
    main(["crawl", "--roots", str(root), "--out", str(tmp_path / "cli.warc.gz")])
    assert "wrote" in capsys.readouterr().out and len(list(read_warc(tmp_path / "cli.warc.gz"))) == 2


def test_sample_site_is_deterministic_and_complete(tmp_path):
    a, b = generate_site(120, seed=3), generate_site(120, seed=3)
    assert [(p.url, p.html) for p in a] == [(p.url, p.html) for p in b]
    assert generate_site(120, seed=4)[5].html != a[5].html
    kinds = Counter(p.kind for p in generate_site(400))
    assert set(kinds) >= {"article", "foreign", "duplicate", "near-duplicate", "pii", "spam", "non-html", "empty",
                          "undecodable", "latin-1", "code", "lorem", "bullets", "short", "symbols"}
    path = write_sample_warc(tmp_path / "s.warc.gz", 50)
    stats = StageStats("read")
    list(read_warc(path, stats))
    assert stats.removed["truncated record"] == 1


# ------------------------------------------------------------------ extraction

@pytest.mark.parametrize("html, want", [
    ("<p>Fish &amp; chips</p><script>x = '<p>'</script>", "Fish & chips"),
    ("<nav>Menu</nav><article><h1>T</h1><p>Body.</p></article><footer>f</footer>", "T\n\nBody."),
    ("<div id='cookie-consent'>Accept</div><p>a<br>b</p>", "a\nb"),
    ("<div class='related' role='navigation'>next | previous</div><p>x</p>", "x"),
    ("<ul><li>one<li>two</ul>", "one\ntwo"),
    ("<pre>x = 1\n    y</pre>", "x = 1\n    y"),
    ("<p>a <!-- c --> b</p>", "a b"),
])
def test_html_to_text(html, want):
    assert html_to_text(html) == want


def test_decode_html_follows_the_declared_charset():
    text = "Café à côté"
    assert decode_html(text.encode("latin-1"), "text/html; charset=ISO-8859-1") == text
    assert decode_html(b'<meta charset="windows-1252">' + text.encode("cp1252")).endswith(text)
    assert decode_html(text.encode()) == text                                   # default UTF-8
    assert decode_html(text.encode(), "text/html; charset=no-such-codec") == text
    with pytest.raises(ValueError, match="not valid utf-8"):
        decode_html(bytes(range(128, 256)) * 10)


def test_extract_stage_and_scores():
    stage = Extract()
    assert stage(Doc("u", html=b"<p>hello</p>")).text == "hello"
    assert stage(Doc("u", html=b"<script>1</script>")) is None
    assert stage(Doc("u", html=bytes(range(128, 256)) * 5, content_type="text/html; charset=utf-8")) is None
    assert stage(Doc("u", text="already text")).text == "already text"      # WET passes
    assert stage.stats.removed == Counter({"empty text": 1, "undecodable bytes": 1}) and stage.stats.kept == 2
    with pytest.raises(ValueError, match="unknown extractor"):
        Extract("nope")
    assert score_extraction("a b c", "a b c") == (1.0, 1.0, 1.0)
    p, r, f = score_extraction("menu a b", "a b c d")
    assert (p, r) == (2 / 3, 2 / 4) and f == pytest.approx(2 * p * r / (p + r))
    # On a plain page (no furniture) the lmfs extractor and resiliparse keep the same words.
    page = generate_site(1, seed=0)[0]
    html = "<html><body>" + "".join(f"<p>{x}</p>" for x in page.main_text.split("\n")) + "</body></html>"
    assert score_extraction(html_to_text(html), resiliparse_text(html))[2] > 0.99


# ------------------------------------------------------------------ language id

def test_char_ngram_buckets():
    ids = char_ngram_buckets("abc", 1000)
    assert len(ids) == 5 + 4 + 3 + 2 and ids.max() < 1000           # " abc ": 5 unigrams ... 2 four-grams
    assert (char_ngram_buckets("ABC", 1000) == ids).all()          # lower-cased
    assert len(char_ngram_buckets("", 1000, orders=(3,))) == 0
    # Code points, not bytes: a two-byte character is one unigram.
    assert len(char_ngram_buckets("ß", 64, orders=(1,))) == 3


def test_langid_learns_the_sample_languages():
    texts, labels = sample_texts(30, seed=0)
    model = train_langid(texts, labels, n_buckets=1 << 12, epochs=4)
    test_texts, test_labels = sample_texts(10, seed=1)
    accuracy = sum(model.predict(t)[0] == y for t, y in zip(test_texts, test_labels)) / len(test_texts)
    assert model.languages == sorted(LANGUAGES) and accuracy >= 0.95
    probs = model.probabilities(test_texts[0])
    assert probs.shape == (len(LANGUAGES),) and abs(probs.sum() - 1) < 1e-6

    stage = LanguageFilter(lambda text: ("en", 0.9) if "the" in text else ("de", 0.3) if "der" in text else ("en", 0.2))
    assert stage(Doc("a", text="the cat")).lang == "en"
    assert stage(Doc("b", text="der Hund")) is None and stage(Doc("c", text="x")) is None
    assert stage.stats.removed == Counter({"language de": 1, "low confidence": 1})



def test_phrase_halves_are_disjoint_and_the_site_keeps_its_languages():
    from lmfs.data.sample import PHRASES, SITE_FOREIGN, sentence

    for lang, lists in PHRASES.items():
        odd_subjects = lists["subj"][1::2]
        rng = random.Random(0)
        for _ in range(200):
            text = sentence(rng, lang, half=0)
            # Every even-half sentence starts with an even-half subject (or an even-half opener).
            assert any(text.startswith(p) or text.lower().startswith(p.lower())
                       for p in lists["subj"][0::2] + lists["open"][0::2]), (lang, text)
            assert not any(subj in text for subj in odd_subjects if all(subj not in e for e in lists["subj"][0::2]))
    site = generate_site(300, seed=0)
    assert {p.lang for p in site if p.kind == "foreign"} == set(SITE_FOREIGN)


def test_langid_challenge_categories():
    from lmfs.data.sample import CODE_SNIPPETS, LANGID_CATEGORIES, langid_challenge

    texts, labels, kinds = langid_challenge(5, seed=3)
    assert Counter(zip(kinds, labels)) == {(k, lang): 5 for k in LANGID_CATEGORIES for lang in LANGUAGES}
    for text, lang, kind in zip(texts, labels, kinds):
        cjk = sum("\u4e00" <= c <= "\u9fff" for c in text)
        if kind == "short":
            # Chinese: characters, maybe one comma of an opener; others: words.
            assert (3 <= len(text) <= 6 and cjk >= len(text) - 1) if lang == "zh" else 2 <= len(text.split()) <= 4
        if kind == "code":
            assert any(snippet in text for snippet in CODE_SNIPPETS)
        if lang == "zh" and kind == "paragraph":
            assert cjk + text.count("，") + text.count("。") == len(text)
        if lang == "zh" and kind == "mixed":  # Chinese holds at least two thirds of the characters
            assert 2 / 3 * len(text) <= cjk + text.count("，") + text.count("。") < len(text)
    assert langid_challenge(5, seed=3) == (texts, labels, kinds)


def test_py3langid_restricted_to_languages():
    from lmfs.data.langid import py3langid_languages, py3langid_predict

    assert {"en", "de", "zh", "ja"} <= set(py3langid_languages())
    for text in ["garden near", "Der Stadtrat", "市议会每年春天建设一个新公园。", "x = 1"]:
        assert py3langid_predict(text, ["en", "nl"])[0] in ("en", "nl")
    assert py3langid_predict("市议会在清晨修理火车时刻表。")[0] == "zh"


# ------------------------------------------------------------------ PII

@pytest.mark.parametrize("text, want", [
    ("a.b+c@mail.example.org", {"email": 1}),
    ("user@localhost", {}),
    ("0.0.0.0 255.255.255.255", {"ipv4": 2}),
    ("256.0.0.1 1.2.3 1.2.3.4.5 01.1.1.1", {}),
    ("at 10.0.0.1.", {"ipv4": 1}),
    ("2001:db8::1 and 2001:0db8:0000:0000:0000:ff00:0042:8329", {"ipv6": 2}),
    ("12:30:45 x[::2] ::1", {}),
    ("(555) 123-4567 555.123.4567 +1 555 123 4567 +49 30 1234 5678", {"phone": 4}),
    ("(555)-123-4567, 5551234567 and +1 5551234567", {"phone": 3}),
    ("year 2024, 1,000,000, Unix time 1733450000, id 0123456789, 55512345678", {}),
])
def test_mask_pii_cases(text, want):
    masked, counts = mask_pii(text)
    assert counts == Counter(want), masked
    assert ("|||" in masked) == bool(want)


def test_mask_pii_stage_counts():
    stage = MaskPII()
    doc = stage(Doc("u", text="mail x@example.org, x@example.com or 192.0.2.1"))
    assert doc.text == "mail |||EMAIL_ADDRESS|||, |||EMAIL_ADDRESS||| or |||IP_ADDRESS|||"
    stage(Doc("v", text="nothing here"))
    assert stage.stats.counts == Counter({"email": 2, "ipv4": 1, "documents with PII": 1}) and stage.stats.kept == 2


# ------------------------------------------------------------------ quality rules

def _words(n, start=("the", "and")):
    return list(start) + [f"word{i:03d}" for i in range(n - len(start))]


def test_gopher_boundaries():
    assert gopher_reasons(" ".join(_words(50))) == []
    assert gopher_reasons(" ".join(_words(49))) == ["fewer than 50 words"]
    assert "too few stop words" in gopher_reasons(" ".join(_words(60, ("the", "cat"))))
    assert "symbol-to-word ratio" not in gopher_reasons(" ".join(_words(60)[:54] + ["#a"] * 6))
    assert "symbol-to-word ratio" in gopher_reasons(" ".join(_words(60)[:53] + ["#a"] * 7))
    # two ratios, each bounded on its own (Gopher): 6 hashes and 6 ellipses in 60 words pass, 7 of either fails
    assert "symbol-to-word ratio" not in gopher_reasons(" ".join(_words(60)[:48] + ["#a"] * 6 + ["b..."] * 6))
    assert "symbol-to-word ratio" in gopher_reasons(" ".join(_words(60)[:47] + ["#a"] * 6 + ["b..."] * 7))
    assert "words without letters" not in gopher_reasons(" ".join(_words(60)[:48] + ["42"] * 12))
    assert "words without letters" in gopher_reasons(" ".join(_words(60)[:47] + ["42"] * 13))
    spam = " ".join(["cheap watches"] * 40 + _words(20))
    assert "top 2-gram" in gopher_reasons(spam)


def _brute_top(words, n):
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    if not grams or max(grams.values()) < 2:
        return 0.0
    most = max(grams.values())
    return max(sum(map(len, g)) * c for g, c in grams.items() if c == most) / sum(map(len, words))


def _brute_dup(words, n):
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    covered = {j for i in range(len(words) - n + 1) if grams[tuple(words[i:i + n])] > 1 for j in range(i, i + n)}
    return sum(len(words[j]) for j in covered) / max(sum(map(len, words)), 1)


def test_ngram_fractions_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        vocab = ["a", "bb", "ccc", "dddd", "e"][: rng.randint(1, 5)]
        words = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        for n in range(2, 11):
            assert top_ngram_char_fraction(words, n) == pytest.approx(_brute_top(words, n), abs=1e-12)
            assert dup_ngram_char_fraction(words, n) == pytest.approx(_brute_dup(words, n), abs=1e-12)


def test_c4_rules():
    s = "The river is high after the rain."
    assert c4_clean("Two words.") == ("", Counter({"line: too few words": 1}), "fewer than 5 sentences")
    assert c4_clean("\n".join([s] * 5))[2] is None and c4_clean("\n".join([s] * 4))[2] == "fewer than 5 sentences"
    text, dropped, reason = c4_clean("\n".join([s] * 5 + ["Menu", "Enable JavaScript now.", "See our Terms of Use."]))
    assert text == "\n".join([s] * 5) and reason is None
    assert dropped == Counter({"line: no terminal punctuation": 1, "line: javascript": 1,
                               "line: policy boilerplate": 1})
    assert c4_clean(s + "\nLorem ipsum dolor sit amet.")[2] == "lorem ipsum"
    assert c4_clean("A {curly} line is code.")[2] == "curly bracket (code)"
    assert c4_clean("Code without a full stop {")[2] == "fewer than 5 sentences"   # dropped line: no page rule
    assert c4_clean(s, C4Thresholds(blocklist=("rain",)))[2] == "blocklisted word"
    stage = C4Rules()
    assert stage(Doc("u", text="\n".join([s] * 5 + ["Home"]))).text == "\n".join([s] * 5)
    assert stage(Doc("v", text="short.")) is None and stage.stats.counts["line: too few words"] == 1


# ------------------------------------------------------------------ stages

def test_stages_chain_and_stats_merge():
    class Even(Stage):
        name = "even"

        def apply(self, doc):
            return doc if int(doc.url) % 2 == 0 else "odd"

    stages = [Even(), GopherRules()]
    docs = [Doc(str(i), text=" ".join(_words(60))) for i in range(10)]
    assert [d.url for d in run_stages(docs, stages)] == ["0", "2", "4", "6", "8"]
    assert (stages[0].stats.seen, stages[0].stats.kept, stages[1].stats.seen) == (10, 5, 5)
    assert stages[0].stats.examples["odd"][0][0] == "1" and len(stages[0].stats.examples["odd"]) == 3

    other = StageStats("even", seen=4, kept=1, removed=Counter(odd=3))
    stages[0].stats.merge(other)
    assert (stages[0].stats.seen, stages[0].stats.kept, stages[0].stats.removed["odd"]) == (14, 6, 8)
    with pytest.raises(ValueError, match="cannot merge"):
        stages[0].stats.merge(StageStats("other"))
    table = stats_table([s.stats for s in stages])
    assert list(table.index) == ["even", "gopher"] and table.loc["gopher", "keep_rate"] == 1.0

    doc = Doc("u", text="t", lang="en", lang_score=0.5, meta={"k": 1}, html=b"<p>")
    assert Doc.from_json(doc.to_json()) == Doc("u", text="t", lang="en", lang_score=0.5, meta={"k": 1})
