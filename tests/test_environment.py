"""The install files agree with each other and with the code: pyproject.toml (pip), environment.yml
(conda), the imports of the lectures and of lmfs, and the Makefile's help."""

import ast
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    """The normalised distribution name of a requirement line (``Foo_bar>=1; marker`` -> foo-bar)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)).lower()


def _env_yml() -> tuple[list[str], list[str]]:
    """environment.yml's conda dependencies and its pip section, as lists of lines."""
    conda, pip = [], []
    section = None
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.strip()
        if stripped == "dependencies:":
            section = conda
        elif stripped == "- pip:":
            section = pip
        elif section is not None and stripped.startswith("- "):
            section.append(stripped[2:].strip())
    return conda, pip


def test_environment_yml_matches_pyproject():
    expected = set(PROJECT["dependencies"])
    for extra in ("test", "lab"):
        expected |= set(PROJECT["optional-dependencies"][extra])
    conda, pip_lines = _env_yml()
    assert "-e ." in pip_lines, "environment.yml must install the package itself (-e .)"
    # torch comes from conda-forge's `pytorch` (CPU or CUDA build chosen by conda), not from pip.
    assert any(_name(c) == "pytorch" for c in conda), "environment.yml must take torch from conda (pytorch)"
    expected = {e for e in expected if _name(e) != "torch"}
    pip_reqs = [line for line in pip_lines if line != "-e ."]
    assert len(pip_reqs) == len(set(pip_reqs)), "duplicate requirement in environment.yml"
    missing = {_name(r) for r in expected} - {_name(r) for r in pip_reqs}
    extra = {_name(r) for r in pip_reqs} - {_name(r) for r in expected}
    assert not missing and not extra, f"only in pyproject: {sorted(missing)}; only in environment.yml: {sorted(extra)}"
    # The same versions too: every bound and cap (ipykernel<7) and platform marker, not just the names.
    wanted = {_name(r): _requirement(r) for r in expected}
    differing = [f"{_name(r)}: environment.yml {r!r}, pyproject {wanted[_name(r)][3]!r}"
                 for r in pip_reqs if _requirement(r)[:3] != wanted[_name(r)][:3]]
    assert not differing, "version requirements differ:\n" + "\n".join(differing)


def _requirement(line: str) -> tuple:
    """A requirement line as (extras, version specifiers, marker, the line), compared by meaning:
    ``ipykernel>=6.25,<7`` equals ``ipykernel <7, >=6.25``."""
    from packaging.requirements import Requirement

    req = Requirement(line)
    return (frozenset(req.extras), req.specifier, str(req.marker) if req.marker else None, line)


def test_requirement_comparison_sees_versions():
    assert _requirement("ipykernel>=6.25,<7")[:3] == _requirement("ipykernel <7, >=6.25")[:3]
    assert _requirement("ipykernel>=6.25")[:3] != _requirement("ipykernel>=6.25,<7")[:3]
    assert _requirement("triton>=3.0; sys_platform == 'linux'")[:3] != _requirement("triton>=3.0")[:3]


def test_python_versions_agree():
    minimum = re.fullmatch(r">=\s*3\.(\d+)", PROJECT["requires-python"])
    assert minimum, "requires-python should be a lower bound like '>=3.11'"
    conda, _ = _env_yml()
    pinned = next(c for c in conda if c.startswith("python"))
    assert int(re.search(r"3\.(\d+)", pinned).group(1)) >= int(minimum.group(1)), (pinned, PROJECT["requires-python"])
    # The tests read pyproject.toml with tomllib: the floor must have it.
    assert int(minimum.group(1)) >= 11


def _top_level_imports(source: str) -> set[str]:
    """Absolute top-level module names imported anywhere in ``source`` (IPython magics skipped)."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _code_imports() -> dict[str, set[str]]:
    """Third-party module -> the notebooks and lmfs modules that import it."""
    sources = {}
    for nb_path in sorted((ROOT / "lectures").glob("*.ipynb")):
        cells = json.loads(nb_path.read_text())["cells"]
        sources[nb_path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for py in sorted((ROOT / "lmfs").rglob("*.py")):
        sources[str(py.relative_to(ROOT))] = py.read_text()
    users: dict[str, set[str]] = {}
    for where, source in sources.items():
        for module in _top_level_imports(source) - set(sys.stdlib_module_names) - {"lmfs", "__future__"}:
            users.setdefault(module, set()).add(where)
    return users


def test_lab_extra_covers_every_import():
    """`pip install -e ".[lab]"` must be enough to run every lecture: each third-party module a
    notebook or an lmfs module imports belongs to a distribution listed in the dependencies or in
    the `lab` extra (the distribution found from the installed packages' metadata)."""
    listed = {_name(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["lab"]}
    owners = packages_distributions()
    problems = []
    for module, users in sorted(_code_imports().items()):
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported by {sorted(users)}) is not installed: which distribution provides it?")
        elif not dists & listed:
            problems.append(f"{module} (imported by {sorted(users)}) comes from {sorted(dists)}, "
                            "not in pyproject's dependencies or `lab` extra")
    assert not problems, "\n".join(problems)


def test_import_scan_finds_imports():
    found = _top_level_imports("import a.b as c\nfrom d.e import f\nfrom . import g\n%matplotlib inline\n"
                               "def h():\n    import i\n")
    assert found == {"a", "d", "i"}


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([a-z][a-z0-9-]*):(?!=)", text, re.M)}


@pytest.mark.skipif(subprocess.run(["which", "make"], capture_output=True).returncode != 0, reason="no make")
def test_make_help_lists_every_target():
    targets = _make_targets()
    assert {"help", "lab", "test", "lectures", "book", "test-browser", "clean"} <= targets
    shown = subprocess.run(["make", "-s", "-C", str(ROOT), "help"], capture_output=True, text=True, check=True).stdout
    listed = set(re.findall(r"^make ([a-z][a-z0-9-]*)", shown, re.M))
    assert targets - {"help"} <= listed, f"targets missing from `make help`: {sorted(targets - {'help'} - listed)}"
    assert listed <= targets, f"`make help` names targets that do not exist: {sorted(listed - targets)}"
