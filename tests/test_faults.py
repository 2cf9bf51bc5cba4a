"""The planted-fault list (lmfs.faults): every entry applies to today's code, and planting works
on a copy without touching the working tree. Running the lectures is `make check-lectures`."""

import pytest

from lmfs.faults import FAULTS, Fault, fault_source, plant, select
from lmfs.lectures import LECTURES


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.lecture}-{f.path}")
def test_every_fault_applies_exactly_once(fault):
    assert fault.lecture in {lec.number for lec in LECTURES}
    assert fault_source(fault) != (fault_source.__globals__["REPO"] / fault.path).read_text(encoding="utf-8")


def test_a_fault_whose_text_is_missing_or_repeated_is_refused():
    missing = Fault("01", "lmfs/faults.py", "no such text anywhere" * 3, "x", "missing")
    with pytest.raises(ValueError, match="occurs 0 times"):
        fault_source(missing)
    repeated = Fault("01", "lmfs/faults.py", "import", "x", "repeated")
    with pytest.raises(ValueError, match=r"occurs ([2-9]|\d\d+) times"):
        fault_source(repeated)
    with pytest.raises(ValueError, match="under lmfs/"):
        fault_source(Fault("01", "README.md", "lmfs", "x", "outside"))


def test_plant_changes_only_the_copy(tmp_path):
    fault = FAULTS[0]
    root = plant(fault, tmp_path / "repo")
    original = (fault_source.__globals__["REPO"] / fault.path).read_text(encoding="utf-8")
    assert fault.old in original and fault.new not in original
    assert (root / fault.path).read_text(encoding="utf-8") == fault_source(fault)
    assert (root / "lectures").is_symlink() and not (root / "lmfs").is_symlink()


def test_select_by_lecture_number():
    assert {f.lecture for f in select(["1", "02"])} <= {"01", "02"}
    with pytest.raises(SystemExit, match="no planted fault"):
        select(["99"])
