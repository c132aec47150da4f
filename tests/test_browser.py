"""The notebooks as a user meets them: JupyterLab in a real Chromium, widgets live.

Run with ``make browser-test`` (it installs Debian's chromium and playwright, no browser download).
Not part of ``make test``: conftest.py deselects the ``browser`` mark unless ``-m browser`` asks
for it. JupyterLab serves a copy of the notebooks (running them in the page saves outputs), with
``WORKBENCH_FAST=1`` for CI sizes but widgets on. Screenshots go to build/browser/.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHOTS = ROOT / "build" / "browser"
NOTEBOOKS = ["01_roberta_position_accumulation", "04_mamba_stale_is_prefilling", "06_graph_doctor"]
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser"))), None)
TOKEN = "workbench-browser-test"
RUN_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (make browser-test installs it)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a loopback port over a copy of notebooks/; yields its base URL."""
    pytest.importorskip("jupyterlab", reason="jupyterlab missing: install the notebooks extra")
    root = tmp_path_factory.mktemp("lab")
    # Every cell in the page (no windowing), so the explorers and errors are there to be read; no
    # news pop-up over the screenshots.
    settings = tmp_path_factory.mktemp("lab-settings")
    for plugin, values in {"notebook-extension/tracker": {"windowingMode": "none"},
                           "apputils-extension/notification": {"fetchNews": "false"}}.items():
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / f"{name}.ipynb", root)
    port = _free_port()
    env = {**os.environ, "WORKBENCH_FAST": "1", "PYTHONPATH": str(ROOT), "JUPYTER_PREFER_ENV_PATH": "1"}
    env.pop("WORKBENCH_HEADLESS", None)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={TOKEN}",
           "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={settings}",
           f"--LabApp.workspaces_dir={settings}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(root / "lab.log", "w")
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, (root / "lab.log").read_text()
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail("JupyterLab did not start in 90 s:\n" + (root / "lab.log").read_text())
    yield url, root
    server.terminate()
    server.wait(30)
    log.close()


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright missing (make browser-test)")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _run_all(page, name: str) -> None:
    """Run every cell of ``name``, wait until it has run (or a cell failed), save it."""
    nb = f"[...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === '{name}.ipynb')"
    page.wait_for_function(f"window.jupyterapp && {nb} && {nb}.sessionContext.session"
                           f" && {nb}.sessionContext.session.kernel.connectionStatus === 'connected'",
                           timeout=180_000, polling=500)
    page.evaluate(f"window.jupyterapp.shell.activateById({nb}.id)")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # Read the notebook model, not the page: done when every code cell has run, or one failed.
    page.wait_for_function(
        f"""() => {{
            const nb = {nb};
            const cells = [...nb.content.model.cells].filter(c => c.type === 'code');
            const failed = cells.some(c => c.outputs.toJSON().some(o => o.output_type === 'error'));
            const done = cells.every(c => c.executionCount !== null);
            return nb.sessionContext.session.kernel.status === 'idle' && (failed || done);
        }}""", timeout=RUN_TIMEOUT_S * 1000, polling=1000)
    page.evaluate(f"{nb}.context.save()")


def _explorer_output(cell) -> str:
    return cell.locator(".widget-output").first.inner_html()


def _changes_output(page, cell, act) -> bool:
    before = _explorer_output(cell)
    act()
    for _ in range(60):
        page.wait_for_timeout(500)
        if _explorer_output(cell) != before:
            return True
    return False


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_jupyterlab_and_its_explorer_responds(lab, browser, name):
    url, root = lab
    page = browser.new_page(viewport={"width": 1366, "height": 768})
    try:
        _check_notebook(page, url, root, name)
    finally:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{name}-page.png"))
        page.close()


def _check_notebook(page, url: str, root: pathlib.Path, name: str) -> None:
    page.goto(f"{url}/lab/tree/{name}.ipynb?reset&token={TOKEN}")       # reset: no other tab restored
    _run_all(page, name)
    saved = json.loads((root / f"{name}.ipynb").read_text())
    errors = [f"{o['ename']}: {o['evalue']}" for c in saved["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{name}: cell errors {errors}"
    assert page.get_by_text("Error displaying widget").count() == 0, f"{name}: a widget did not render"

    cell = page.locator(".jp-Notebook .jp-CodeCell").last
    cell.scroll_into_view_if_needed()
    sliders = cell.locator(".widget-slider .noUi-base")
    dropdowns = cell.locator(".widget-dropdown select")
    assert sliders.count() + dropdowns.count() > 0, f"{name}: the explorer has no control"
    for i in range(sliders.count()):
        box = sliders.nth(i).bounding_box()
        assert any(_changes_output(page, cell, lambda f=f: page.mouse.click(box["x"] + f * box["width"],
                                                                            box["y"] + box["height"] / 2))
                   for f in (0.3, 0.8)), f"{name}: moving slider {i} did not change the output"
    for i in range(dropdowns.count()):
        select = dropdowns.nth(i)
        values = select.locator("option").evaluate_all("os => os.map(o => o.value)")
        other = next(v for v in values if v != select.input_value())
        assert _changes_output(page, cell, lambda: select.select_option(other)), \
            f"{name}: choosing {other!r} in dropdown {i} did not change the output"
    SHOTS.mkdir(parents=True, exist_ok=True)
    cell.screenshot(path=str(SHOTS / f"{name}.png"))
