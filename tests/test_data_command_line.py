"""`python -m lmfs.data ... --out PATH` with a path it cannot write: one line naming --out, before any
work, and no half-written file left."""

from pathlib import Path

import pytest

from lmfs.data.__main__ import main


def _error(argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = exit_info.value.code
    # sys.exit(str) prints the string to stderr, exit status 1: one line, no traceback
    assert isinstance(message, str) and "\n" not in message, message
    return message


def test_crawl_out_that_is_a_folder(tmp_path):
    for out in (str(tmp_path), str(tmp_path / "new") + "/"):
        message = _error(["crawl", "--out", out, "--max-pages", "3"])
        assert message.startswith("python -m lmfs.data: error: --out ") and "is a folder" in message
    assert not (tmp_path / "new").exists()  # a trailing separator names a folder: no file called "new"


def test_crawl_out_where_no_file_can_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    message = _error(["crawl", "--out", str(blocker / "crawl.warc.gz"), "--max-pages", "3"])
    assert f"cannot write --out {blocker / 'crawl.warc.gz'}" in message and str(blocker) in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]   # no .part file left behind
    message = _error(["stories", "--out", str(blocker / "stories.txt"), "--mb", "0.01"])
    assert "cannot write --out" in message


def test_crawl_out_that_works(tmp_path):
    main(["crawl", "--out", str(tmp_path / "deep" / "crawl.warc.gz"), "--max-pages", "3", "--roots",
          str(_site(tmp_path))])
    assert (tmp_path / "deep" / "crawl.warc.gz").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["crawl.warc.gz"]  # the write probe is gone


def _site(tmp_path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<html><body><p>A page.</p></body></html>")
    return site
