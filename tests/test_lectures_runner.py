"""The lecture table for the README and the HTML book, from run reports and executed notebooks."""

import json
import re

import nbformat
import pytest

from lmfs.lectures import (LECTURES, TABLE_END, TABLE_START, build_book, format_seconds, lecture_table,
                           load_runs, main, replace_block, run_lecture)


def _lecture_notebook(path, body: str):
    """A tiny stand-in for a lecture: a parameters cell and one code cell."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("SCALE = 'auto'\nDEVICE = 'auto'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# A lecture"), params, nbformat.v4.new_code_cell(body)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Lecture 01 (ok, with a plot) and lecture 02 (failing) executed by the runner into one folder."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("build")
    _lecture_notebook(src / LECTURES[0].filename,
                      "import matplotlib.pyplot as plt\nplt.plot([0, 1, 4])\nplt.show()\nprint('scale is', SCALE)")
    _lecture_notebook(src / LECTURES[1].filename, "raise RuntimeError('lecture two broke')")
    results = [run_lecture(src / lec.filename, out, scale="smoke", device="cpu", timeout=120) for lec in LECTURES[:2]]
    report = {"scale": "smoke", "device": "cpu", "results": [r.__dict__ for r in results]}
    (out / "lectures.json").write_text(json.dumps(report))
    return out, results


def test_runner_keeps_the_kernels_transport_warning_out(executed, capfd):
    # ipykernel logs an unencrypted-transport warning to stderr at each start over TCP.
    out, _ = executed
    run_lecture(out / LECTURES[0].filename, out / "again", scale="smoke", device="cpu", timeout=120)
    assert "without encryption" not in capfd.readouterr().err


def test_book_renders_pages_and_index(executed, tmp_path):
    out, results = executed
    assert [r.status for r in results] == ["ok", "failed"]
    entries = build_book(out, tmp_path / "book")
    by_number = {e.lecture.number: e for e in entries}
    assert len(entries) == len(LECTURES)
    first, second = by_number["01"], by_number["02"]
    assert (first.scale, first.status, second.status) == ("smoke", "ok", "failed")
    assert first.seconds == pytest.approx(results[0].seconds, abs=5)
    page = (tmp_path / "book" / first.page).read_text()
    assert "scale is smoke" in page  # the executed output, not just the source
    assert re.search(r'<img[^>]+src="data:image/png;base64,', page)  # the plot, embedded
    assert 'href="index.html"' in page
    assert "lecture two broke" in (tmp_path / "book" / second.page).read_text()
    index = (tmp_path / "book" / "index.html").read_text()
    rows = re.findall(r"<tr><td>(.*?)</td>.*?<td>(\w*)</td><td class=\"[\w-]+\">([\w ]+)</td>", index)
    assert len(rows) == len(LECTURES)
    assert rows[0] == (f'<a href="{first.page}">01 {LECTURES[0].title}</a>', "smoke", "ok")
    assert rows[1][2] == "failed"
    planned = [lec for lec in LECTURES if lec.status == "planned"]
    assert sum(r[2] == "planned" for r in rows) == len(planned)
    assert {r[2] for r in rows[2:]} <= {"planned", "not run"}


def test_book_without_notebooks_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="make lectures"):
        build_book(tmp_path, tmp_path / "book")


def test_table_from_runs(tmp_path):
    smoke = {"scale": "smoke", "device": "cpu", "results": [
        {"lecture": LECTURES[0].stem, "status": "ok", "seconds": 21.4},
        {"lecture": LECTURES[1].stem, "status": "failed", "seconds": 65.0},
        {"lecture": "nb", "status": "ok", "seconds": 1.0}]}  # not a lecture: ignored
    full = {"scale": "full", "device": "cuda", "results": [{"lecture": LECTURES[0].stem, "status": "ok", "seconds": 185,
                                                            "peak_gpu_gib": 3.14}]}
    paths = [tmp_path / "smoke.json", tmp_path / "full.json"]
    for path, report in zip(paths, (smoke, full)):
        path.write_text(json.dumps(report))
    table = lecture_table(load_runs(paths)).splitlines()
    assert len(table) == 2 + len(LECTURES)
    assert table[2] == f"| 01 {LECTURES[0].title} | {LECTURES[0].builds} | runs | 21 s (cpu) | 3 min 05 s (cuda) | 3.1 GiB |"
    assert table[3].endswith("| fails at smoke | 1 min 05 s (cpu), failed |  |  |")
    for lec, row in zip(LECTURES, table[2:]):
        if lec.status == "planned":
            assert "| planned |" in row
        elif lec.number not in ("01", "02"):
            assert "| not run |" in row
    assert (format_seconds(59.6), format_seconds(60)) == ("1 min 00 s", "1 min 00 s")


def test_table_update_replaces_only_the_block(tmp_path, capsys):
    report = tmp_path / "lectures.json"
    report.write_text(json.dumps({"scale": "smoke", "device": "cpu", "results": []}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\ntext before\n{TABLE_START}\nold table\n{TABLE_END}\ntext after\n")
    assert main(["table", "--from", str(report), "--update", str(readme)]) == 0
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# Title\n\ntext before\n")
    assert text.endswith(f"{TABLE_END}\ntext after\n")
    assert lecture_table({}) in text
    main(["table", "--from", str(report), "--update", str(readme)])
    assert readme.read_text() == text  # idempotent
    with pytest.raises(ValueError, match="lectures:start"):
        replace_block("no markers here", "x")


def test_only_names_unknown_lectures_and_suggests_the_number(capsys):
    from lmfs.lectures import lecture_paths

    with pytest.raises(ValueError, match=r"no lecture '99'"):
        lecture_paths(["16", "99"])
    with pytest.raises(ValueError, match=r"no lecture '1' \(did you mean 01\?\)"):
        lecture_paths(["1"])
    assert [p.name for p in lecture_paths(["01"])] == [LECTURES[0].filename]
    for args, wanted in ((["--only", "16", "99"], "--only (make: ONLY=): no lecture '99'"),
                         (["--scale", "huge"], "--scale huge (make: SCALE=) is not one of smoke, full, auto"),
                         (["--device", "tpu"], "--device (make: DEVICE=): unknown device 'tpu'")):
        with pytest.raises(SystemExit) as exit_info:
            main(["run", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and wanted in err, err  # one line


@pytest.mark.skipif(__import__("shutil").which("make") is None, reason="no make")
def test_make_lectures_with_a_bad_scale_stops_with_one_line():
    import subprocess

    from lmfs.lectures import REPO

    # make stops while reading the Makefile, before it would set up .venv or start a kernel.
    done = subprocess.run(["make", "-s", "-C", str(REPO), "lectures", "SCALE=huge"], capture_output=True, text=True)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "SCALE=huge is not a scale" in done.stderr, done.stderr


def test_run_lectures_says_where_it_wrote_the_notebooks(tmp_path, monkeypatch, capsys):
    import lmfs.lectures as lectures

    def fake_run(path, out_dir, scale, device, timeout, extra_parameters=None):
        return lectures.RunResult(path.stem, "ok", 1.0, str(out_dir / path.name))

    monkeypatch.setattr(lectures, "run_lecture", fake_run)
    lectures.run_lectures(["01"], "smoke", "cpu", tmp_path / "build")
    printed = capsys.readouterr().out
    assert f"executed notebooks, lectures.md and lectures.json in {(tmp_path / 'build').resolve()}/" in printed


def test_side_by_side_groups_keep_the_alignment_chain_in_order():
    from lmfs.lectures import _chains, lecture_paths

    groups = [[p.stem[:2] for p in g] for g in _chains(lecture_paths(["17", "05", "15", "16", "07"]))]
    assert groups == [["15", "16", "17"], ["05"], ["07"]]   # the chain first, then the rest in order


def test_jobs_must_be_positive(capsys):
    from lmfs.lectures import main

    with pytest.raises(SystemExit) as stop:
        main(["run", "--only", "05", "--scale", "smoke", "--device", "cpu", "--jobs", "0"])
    assert stop.value.code == 2 and "--jobs (make: JOBS=) must be at least 1" in capsys.readouterr().err
