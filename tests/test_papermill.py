"""A lecturer's rerun: papermill executes a lecture with changed parameters, as the README shows."""

import json

import pytest

from lmfs.lectures import LECTURE_DIR, run_lecture

LECTURE = LECTURE_DIR / "01_overview_tokenization.ipynb"


@pytest.mark.slow
def test_rerun_lecture_01_with_other_parameters(tmp_path):
    result = run_lecture(LECTURE, tmp_path, scale="smoke", device="cpu", timeout=600,
                         extra_parameters={"CORPUS": "stories", "SEED": 1})
    assert result.status == "ok", result.error
    nb = json.loads((tmp_path / LECTURE.name).read_text())
    injected = [c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1 and 'CORPUS = "stories"' in "".join(injected[0]["source"])
    printed = "".join(
        "".join(out.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for out in c["outputs"]
    )
    assert "corpus 'stories'" in printed  # the changed parameter reached the lecture's code
    assert "scale: smoke" in printed
