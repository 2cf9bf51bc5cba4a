
import pytest

from lmfs.data.corpora import (EOT, generate_stories, iter_stories, pydoc_text, read_text_files,
                               write_stdlib_source, write_stories)


def test_stories_are_deterministic_and_seeded():
    assert generate_stories(5_000, seed=0) == generate_stories(5_000, seed=0)
    assert generate_stories(5_000, seed=0) != generate_stories(5_000, seed=1)
    # A longer request extends the shorter one: story i depends only on (seed, i).
    short, long = generate_stories(3_000, seed=2), generate_stories(9_000, seed=2)
    assert long.startswith(short)


def test_stories_size_and_separator():
    text = generate_stories(20_000, seed=0)
    n = len(text.encode())
    assert 20_000 <= n < 20_000 + 2_000
    docs = text.split(EOT)
    assert len(docs) > 10 and all(doc.strip() for doc in docs)
    assert generate_stories(0) == ""
    with pytest.raises(ValueError):
        generate_stories(-1)


def test_write_stories_streams_the_same_text(tmp_path):
    path = write_stories(tmp_path / "sub" / "s.txt", 10_000, seed=4)
    assert path.read_text(encoding="utf-8") == generate_stories(10_000, seed=4)


def test_first_story_matches_iterator():
    first = next(iter_stories(7))
    assert generate_stories(1, seed=7) == first


def test_pydoc_text_is_real_english():
    text = pydoc_text()
    assert len(text) > 100_000 and "the" in text and EOT in text


def test_stdlib_source(tmp_path):
    path = write_stdlib_source(tmp_path / "std.txt", 200_000)
    text = path.read_text(encoding="utf-8")
    assert len(text.encode()) >= 200_000 and "def " in text and EOT in text


def test_read_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    assert read_text_files([tmp_path / "a.txt", tmp_path / "b.txt"]) == "alpha" + EOT + "beta"
    assert read_text_files(tmp_path / "a.txt", max_bytes=3) == "alp"
    with pytest.raises(FileNotFoundError, match="data/README.md"):
        read_text_files(tmp_path / "missing.txt")


def test_load_corpus(tmp_path):
    from lmfs.data.corpora import load_corpus

    assert load_corpus("stories", 4_000, seed=5) == generate_stories(4_000, seed=5)
    assert len(load_corpus("pydoc", 1_000).encode()) <= 1_000
    assert "def " in load_corpus("stdlib", 50_000)
    (tmp_path / "my.txt").write_text("héllo wörld")
    assert load_corpus(str(tmp_path / "my.txt"), 100) == "héllo wörld"
    with pytest.raises(FileNotFoundError, match="stories"):
        load_corpus("tinystories", 100)
