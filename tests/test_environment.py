"""environment.yml (conda) and pyproject.toml (pip) must describe the same environment."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _names(reqs):
    return {re.sub(r"[-_.]+", "-", r.strip()).lower() for r in reqs}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = set(project["dependencies"])
    for extra in ("test", "lab"):
        expected |= set(project["optional-dependencies"][extra])
    pip_lines = []
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.strip()
        if stripped == "- pip:":
            in_pip = True
            continue
        if in_pip and stripped.startswith("- "):
            pip_lines.append(stripped[2:].strip())
        elif in_pip and stripped and not stripped.startswith("#"):
            break
    assert "-e ." in pip_lines, "environment.yml must install the package itself (-e .)"
    pip_reqs = [line for line in pip_lines if line != "-e ."]
    assert len(pip_reqs) == len(set(pip_reqs)), "duplicate requirement in environment.yml"
    missing, extra = _names(expected) - _names(pip_reqs), _names(pip_reqs) - _names(expected)
    assert not missing and not extra, f"only in pyproject: {sorted(missing)}; only in environment.yml: {sorted(extra)}"
