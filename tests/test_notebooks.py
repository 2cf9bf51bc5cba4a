"""Notebook hygiene and the lecture runner (nbval executes the notebooks themselves)."""

import json
import re
from pathlib import Path

import pytest

from lmfs.lectures import LECTURE_DIR, LECTURES, clean_notebook, format_table, notebook_problems, run_lecture

NOTEBOOKS = sorted(LECTURE_DIR.glob("*.ipynb"))
SYLLABUS = Path(__file__).resolve().parents[2] / "shared" / "SYLLABUS.md"


def test_lecture_list_is_the_syllabus():
    assert [lec.number for lec in LECTURES] == [f"{i:02d}" for i in range(1, 18)]
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", lec.stem) for lec in LECTURES)
    if SYLLABUS.exists():  # shared/ lies beside the checkout in CI and on development machines
        named = re.findall(r"`(\d\d_[a-z0-9_]+)\.ipynb`", SYLLABUS.read_text())
        assert named == [lec.stem for lec in LECTURES]


def test_there_are_notebooks():
    assert NOTEBOOKS, "lectures/ holds no notebooks"


def test_lecture_status_matches_the_notebooks():
    # "ready" exactly for the lectures whose notebook is in lectures/: the README's table says so.
    present = {p.name for p in NOTEBOOKS}
    wrong = [(lec.filename, lec.status) for lec in LECTURES
             if (lec.status == "ready") != (lec.filename in present) or lec.status not in ("ready", "planned")]
    assert not wrong, f"set status in lmfs/lectures.py LECTURES: {wrong}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_clean(path):
    problems = notebook_problems(path)
    assert not problems, "\n".join(problems) + "\nrun `make clean-notebooks`"


def _dirty_notebook(path, n_params=1):
    cells = [
        {"cell_type": "code", "metadata": {"tags": ["parameters"] if i < n_params else []},
         "source": f"x = {i}", "execution_count": 3, "id": f"c{i}",
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "3\n"}]}
        for i in range(2)
    ]
    nb = {"nbformat": 4, "nbformat_minor": 5, "cells": cells,
          "metadata": {"kernelspec": {"name": "other", "display_name": "x", "language": "python"}}}
    path.write_text(json.dumps(nb))


def test_hygiene_finds_problems_and_clean_fixes_them(tmp_path):
    path = tmp_path / LECTURES[0].filename
    _dirty_notebook(path)
    problems = notebook_problems(path)
    assert any("kernel" in p for p in problems) and sum("outputs" in p for p in problems) == 2
    assert clean_notebook(path) is True
    assert notebook_problems(path) == []
    assert clean_notebook(path) is False  # idempotent
    assert json.loads(path.read_text())["cells"][0]["metadata"]["tags"] == ["parameters"]


def test_hygiene_counts_parameter_cells(tmp_path):
    path = tmp_path / "99_unknown.ipynb"
    _dirty_notebook(path, n_params=0)
    clean_notebook(path)
    problems = notebook_problems(path)
    assert any("not a lecture name" in p for p in problems)
    assert any("0 cells tagged 'parameters'" in p for p in problems)


def test_runner_reports_a_failing_notebook(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("SCALE = 'auto'\nDEVICE = 'auto'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("assert SCALE == 'smoke', SCALE\nprint('reward 0.42')\nraise ValueError('boom')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src = tmp_path / "nb.ipynb"
    nbformat.write(nb, src)
    result = run_lecture(src, tmp_path / "out", scale="smoke", device="cpu", timeout=60)
    assert result.status == "failed" and "boom" in result.error
    assert result.error.endswith("the failing cell printed: reward 0.42")   # the numbers before the assert
    assert (tmp_path / "out" / "nb.ipynb").exists()  # the executed copy is kept for inspection
    assert "| nb | failed |" in format_table([result])
