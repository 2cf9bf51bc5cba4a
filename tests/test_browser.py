"""The learner's real path: JupyterLab in a real browser (`make test-browser`).

JupyterLab is started as `make lab` starts it (on a free port, with a token), headless Chromium
(Debian's package, driven by Playwright without Playwright's own browser download) opens every
lecture, and runs lecture 01 at smoke scale through the menu (Run > Run All Cells). The checks:
every lecture renders all its cells, lecture 01 executes every code cell without an error output,
and its matplotlib plots arrive as images the browser decoded. A small notebook,
tests/browser/explorers.ipynb, builds every ``lmfs.explore`` explorer; the test moves the first
control of each through the UI and checks that its view changes. Screenshots go to build/browser/.

Marked ``browser``: skipped without Chromium or Playwright, except under `make test-browser`
(which sets LMFS_CHROMIUM), where a missing piece is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lmfs.lectures import LECTURE_DIR, REPO, lecture_paths

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("LMFS_CHROMIUM", "/usr/bin/chromium")
REQUIRED = "LMFS_CHROMIUM" in os.environ
SHOTS = REPO / "build" / "browser"
EXPLORERS = Path(__file__).parent / "browser" / "explorers.ipynb"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_S = 900  # lecture 01 at smoke scale takes about a minute on 2 cores; the UI adds little

# JupyterLab settings for the test's server: no autosave (the test serves copies anyway), every
# cell in the DOM (JupyterLab 4 otherwise renders only the cells in view, so a query would miss the
# rest), no news or update pop-ups over the notebook.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def _missing(why: str):
    (pytest.fail if REQUIRED else pytest.skip)(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on copies of the lectures; yields its base URL and token."""
    if not Path(CHROMIUM).exists():
        _missing(f"no Chromium at {CHROMIUM}: apt-get update && apt-get install -y chromium")
    if shutil.which("jupyter", path=str(Path(sys.executable).parent)) is None:
        _missing("JupyterLab is not installed: pip install -e '.[lab]'")
    root = tmp_path_factory.mktemp("lab")
    notebooks, settings = root / "lectures", root / "settings"
    notebooks.mkdir()
    for path in lecture_paths():
        shutil.copy(path, notebooks / path.name)
    shutil.copy(EXPLORERS, notebooks / EXPLORERS.name)
    for name, values in LAB_SETTINGS.items():
        target = settings / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))
    port, token = _free_port(), os.urandom(16).hex()
    env = {**os.environ, "LMFS_SCALE": "smoke", "LMFS_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces")}
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = open(SHOTS / "jupyterlab.log", "w")
    # The flags of `make lab`, plus the port and token the test needs to know.
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "lab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
         f"--notebook-dir={notebooks}", f"--port={port}", "--ServerApp.port_retries=0",
         f"--IdentityProvider.token={token}"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                log.close()
                pytest.fail(f"JupyterLab did not start; its log:\n{(SHOTS / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield url, token
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright is not installed: pip install -e '.[browser]' (or make test-browser)")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _open(browser, lab, name: str, workspace: str):
    """A page showing lecture ``name`` in its own JupyterLab workspace, with a kernel started.

    JupyterLab sometimes asks which kernel to start (a "Select Kernel" dialog); the test answers
    as a learner would, with the proposed Python 3 kernel.
    """
    url, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(120_000)
    page.goto(f"{url}/lab/workspaces/{workspace}/tree/{name}?token={token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell")
    deadline = time.monotonic() + 120
    while not _has_kernel(lab, name):
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count() and accept.first.is_visible():
            accept.first.click()
        assert time.monotonic() < deadline, f"{name}: no kernel started within 120 s"
        page.wait_for_timeout(500)
    return page


def _has_kernel(lab, name: str) -> bool:
    url, token = lab
    with urllib.request.urlopen(f"{url}/api/sessions?token={token}", timeout=10) as response:
        sessions = json.load(response)
    return any(s["path"].endswith(name) and s.get("kernel") for s in sessions)


def _cells(name: str) -> list[dict]:
    path = EXPLORERS if name == EXPLORERS.name else LECTURE_DIR / name
    return json.loads(path.read_text())["cells"]


def test_every_lecture_opens(browser, lab):
    paths = lecture_paths()
    assert paths, "lectures/ holds no notebooks"
    for path in paths:
        page = _open(browser, lab, path.name, f"open-{path.stem[:2]}")
        stored = len(_cells(path.name))
        page.wait_for_function("n => document.querySelectorAll('.jp-NotebookPanel .jp-Cell').length === n",
                               arg=stored, timeout=30_000)
        page.screenshot(path=str(SHOTS / f"open-{path.stem}.png"))
        page.close()


# An error output is rendered as stderr text holding IPython's traceback.
_ERRORS_JS = """() => [...document.querySelectorAll(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")]
    .filter(o => o.textContent.includes('Traceback (most recent call last)'))
    .map(o => o.textContent.slice(0, 1500))"""


def _run_all(page, n_code: int) -> float:
    """Run > Run All Cells; wait until every code cell has run or one failed; return the seconds."""
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    # Done when every code cell shows an execution count ("[12]:"), or when a cell failed (Run All
    # stops there) and nothing is running any more.
    start = time.monotonic()
    page.wait_for_function(
        """([n, errorsJs]) => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
            if (prompts.some(p => p.textContent.includes('*'))) return false;
            const done = prompts.filter(p => /^\\[\\d+\\]:$/.test(p.textContent.trim())).length;
            return done === n || eval(errorsJs)().length > 0;
        }""",
        arg=[n_code, _ERRORS_JS], timeout=RUN_TIMEOUT_S * 1000, polling=1000)
    return time.monotonic() - start


def test_lecture_01_runs_in_the_ui(browser, lab):
    name = "01_overview_tokenization.ipynb"
    if not (LECTURE_DIR / name).exists():
        pytest.fail(f"{name} is missing from lectures/")
    n_code = sum(c["cell_type"] == "code" for c in _cells(name))
    page = _open(browser, lab, name, "run-01")
    seconds = _run_all(page, n_code)
    page.screenshot(path=str(SHOTS / "run-01-end.png"))

    errors = page.evaluate(_ERRORS_JS)
    assert not errors, "error output in lecture 01:\n" + "\n---\n".join(errors)
    prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_text_contents()
    assert sum(p.strip()[1:-2].isdigit() for p in prompts) == n_code, f"not every code cell ran: {prompts}"

    # matplotlib figures arrive as image/png outputs; the browser must have decoded each one.
    images = page.locator(".jp-OutputArea-output[data-mime-type='image/png'] img")
    assert images.count() >= 1, "lecture 01 shows no plot"
    sizes = images.evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
    assert all(ok and w > 0 and h > 0 for ok, w, h in sizes), f"an image did not render: {sizes}"
    images.first.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "run-01-plot.png"))
    print(f"lecture 01 ran through the UI in {seconds:.0f} s, {images.count()} plots shown")
    page.close()


# What a learner does to the first control of an explorer: a slider's handle takes arrow keys, a
# drop-down or list another option, a check box a click, a text field new text. Returns how.
_MOVE_JS = """el => {
    const select = el.querySelector('select');
    if (select) {
        const i = (select.selectedIndex + 1) % select.options.length;
        for (const o of select.options) o.selected = false;
        select.options[i].selected = true;
        select.dispatchEvent(new Event('change', {bubbles: true}));
        return 'select';
    }
    const box = el.querySelector("input[type='checkbox']");
    if (box) { box.click(); return 'checkbox'; }
    return el.querySelector('.noUi-handle') ? 'slider' : 'other';
}"""

_VIEW_JS = """el => {
    const text = el.querySelector('.lmfs-explorer-text');
    const image = el.querySelector('.lmfs-explorer-image');
    const shown = image && image.offsetParent !== null;   // hidden (display: none) without a figure
    return [text ? text.innerHTML : '', shown ? image.getAttribute('src') || '' : ''];
}"""

# The view has changed when its text or its image has (two widgets, updated one after the other).
_CHANGED_JS = """([i, before, viewJs]) => {
    const now = eval(viewJs)(document.querySelectorAll('.lmfs-explorer')[i]);
    return now[0] !== before[0] || now[1] !== before[1];
}"""


def _settled(explorer, page) -> None:
    """Wait until the explorer's view stops changing (its second widget has landed too)."""
    last = explorer.evaluate(_VIEW_JS)
    for _ in range(40):
        page.wait_for_timeout(500)
        now = explorer.evaluate(_VIEW_JS)
        if now == last:
            return
        last = now


def test_every_explorer_responds_in_the_ui(browser, lab):
    """Build every explorer in JupyterLab, move the first control of each, see its view change."""
    name = EXPLORERS.name
    cells = _cells(name)
    n_code = sum(c["cell_type"] == "code" for c in cells)
    expected = sum("explore_" in "".join(c["source"]) for c in cells if c["cell_type"] == "code")
    page = _open(browser, lab, name, "explorers")
    seconds = _run_all(page, n_code)
    errors = page.evaluate(_ERRORS_JS)
    assert not errors, "error output in the explorers notebook:\n" + "\n---\n".join(errors)
    explorers = page.locator(".lmfs-explorer")
    page.wait_for_function("n => document.querySelectorAll('.lmfs-explorer').length === n", arg=expected,
                           timeout=60_000)
    moved = []
    for i in range(expected):
        explorer = explorers.nth(i)
        explorer.scroll_into_view_if_needed()
        title = explorer.locator("b").first.text_content()
        before = explorer.evaluate(_VIEW_JS)
        primary = explorer.locator(".lmfs-explorer-primary").first
        how = primary.evaluate(_MOVE_JS)
        if how == "slider":
            handle = primary.locator(".noUi-handle").first
            handle.focus()
            page.keyboard.press("ArrowRight")   # one step: one update
        assert how != "other", f"explorer {i} ({title}): no control the test knows how to move"
        try:
            page.wait_for_function(_CHANGED_JS, arg=[i, before, _VIEW_JS], timeout=60_000, polling=250)
        except Exception as err:  # a timeout: say which explorer did not respond
            page.screenshot(path=str(SHOTS / f"explorer-{i:02d}-stuck.png"))
            raise AssertionError(f"explorer {i} ({title}) did not change its view after its {how} moved") from err
        _settled(explorer, page)
        explorer.screenshot(path=str(SHOTS / f"explorer-{i:02d}.png"))
        moved.append(f"{title} ({how})")
    print(f"explorers notebook ran in {seconds:.0f} s; {len(moved)} explorers responded: " + "; ".join(moved))
    page.close()
