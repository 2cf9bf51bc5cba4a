"""What the README promises a newcomer: the lists it shows are generated, the commands it gives work
from a fresh clone and say what they do, and the licence it names is there."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from lmfs.benchmarks.__main__ import BENCHMARKS, LIST_END, LIST_START, markdown_list

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _between(text: str, start: str, end: str) -> str:
    assert text.count(start) == 1 and text.count(end) == 1, f"README needs one {start} and one {end} line"
    return text.split(start)[1].split(end)[0].strip()


def test_benchmark_list_is_generated_from_the_registry():
    listed = _between(README, LIST_START, LIST_END)
    assert listed == markdown_list(), "run: python -m lmfs.benchmarks --update README.md"
    assert re.findall(r"^- `([\w-]+)`", listed, re.M) == list(BENCHMARKS)


def test_license_file_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n") and "Permission is hereby granted, free of charge" in text


def _make_recipe(target: str) -> str:
    text = (ROOT / "Makefile").read_text()
    return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.M).group(1)


def test_make_lab_is_described_as_it_behaves():
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    assert "--no-browser" in _make_recipe("lab")
    assert "opens JupyterLab" not in quick
    assert "does not open a browser" in quick and "URL" in quick


def test_readme_states_the_setup_costs():
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    size = re.search(r"`\.venv` takes about ([\d.]+) GB", quick)
    assert size, "the quick start says how much disk .venv takes"
    assert re.search(r"`make test`.*\d+\s+minutes", quick, re.S), "and how long make test runs"
    venv = ROOT / ".venv"
    if venv.is_dir() and shutil.which("du"):  # CI has built it: the figure must still be right
        used = int(subprocess.run(["du", "-sk", str(venv)], capture_output=True, text=True).stdout.split()[0]) / 1e6
        assert 0.7 * float(size.group(1)) <= used * 1.024 <= 1.3 * float(size.group(1)), f".venv is {used:.1f} GB"


def test_papermill_example_writes_where_make_book_reads():
    """The README's papermill command creates its output folder, and keeps the lecture's file name
    (the book finds executed notebooks by that name); tests/test_papermill.py runs it."""
    from lmfs.lectures import LECTURES

    line = next(l for l in README.splitlines() if "papermill " in l and "lectures/" in l)
    match = re.fullmatch(r"mkdir -p (\S+) && \.venv/bin/papermill --cwd lectures lectures/(\S+) (\S+) -p SCALE full", line)
    assert match, line
    folder, source, output = match.groups()
    assert output == f"{folder}/{source}" and source in {lec.filename for lec in LECTURES}
    assert "make book" in README and "-p SCALE full` on a CPU" in README


@pytest.mark.parametrize("module", ["lmfs.alignment", "lmfs.lectures", "lmfs.train", "lmfs.data"])
def test_help_texts_are_plain(module, capsys):
    """--help shows text, not reStructuredText markup (``literal``, :func:`role`, a trailing ::)."""
    import importlib

    main = importlib.import_module(f"{module}.__main__" if module != "lmfs.lectures" else module).main
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert "usage:" in shown
    assert not re.search(r"``|:(func|class|mod|data|meth):`|::\s*$", shown, re.M), shown
