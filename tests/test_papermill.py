"""A lecturer's rerun: papermill executes a lecture with changed parameters, with the README's command."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lmfs.lectures import LECTURE_DIR, LECTURE_FILENAMES

ROOT = LECTURE_DIR.parent


def readme_papermill_command() -> str:
    """The README's papermill line (it reruns lecture 01 at full scale into build/)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return next(line for line in readme.splitlines() if "papermill " in line and "lectures/" in line)


@pytest.mark.slow
def test_readme_rerun_of_lecture_01_works_from_a_fresh_clone(tmp_path):
    # A fresh clone: lectures/ and no build/. The command runs as the README gives it, at smoke
    # scale (full is the reader's choice) and with two more parameters changed.
    (tmp_path / "lectures").symlink_to(LECTURE_DIR)
    command = readme_papermill_command()
    assert "-p SCALE full" in command and ".venv/bin/papermill" in command
    command = command.replace(".venv/bin/papermill", f"{sys.executable} -m papermill --no-progress-bar")
    command = command.replace("-p SCALE full", "-p SCALE smoke -p DEVICE cpu -p CORPUS stories -p SEED 1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    output = Path(tmp_path / re.search(r" (\S+\.ipynb) -p", command).group(1))
    assert output.parent == tmp_path / "build" and output.name in LECTURE_FILENAMES  # where `make book` reads
    nb = json.loads(output.read_text())
    injected = [c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert len(injected) == 1 and 'CORPUS = "stories"' in "".join(injected[0]["source"])
    printed = "".join(
        "".join(out.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for out in c["outputs"]
    )
    assert "corpus 'stories'" in printed  # the changed parameter reached the lecture's code
    assert "scale: smoke" in printed
