"""The UI in a real browser: JupyterLab served from this environment, driven by headless Chromium.

A real ``jupyter lab`` server serves a temporary copy of ``notebooks/`` plus a one-cell notebook that
shows a ``RunDashboard``. Playwright drives Debian's Chromium (``/usr/bin/chromium``; Playwright's own
browser download is not used) and, for that notebook and for each tutorial that shows a dashboard:
opens it, runs the cells (Shift+Enter, and the Run menu for the cells above), checks that the widget view
renders (Launch/Stop buttons, progress bar and plotly graphs: the ipywidgets and plotly labextensions
must load), clicks Launch and waits until the run succeeds, the progress bar is full and every rank's
curve has one point per step. Screenshots go to each test's tmp_path (``*-rendered.png``,
``*-finished.png``).

Skipped, with the reason, where Chromium or Playwright is missing (``make test`` installs Chromium;
``WORKBENCH_CHROMIUM`` points elsewhere). ``WORKBENCH_BROWSER_TUTORIALS=all`` drives every tutorial's
dashboard, not only the first tutorial's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from helpers import wait_for_server  # tests/helpers.py

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",  # runs as root in containers
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
STEPS = 3
SERVER_START_S = 60
# Another environment's python to serve JupyterLab (e.g. an older JupyterLab to check the extension with);
# it must reach this checkout and its dependencies, and find the extension through JUPYTER_PATH.
LAB_PYTHON = os.environ.get("WORKBENCH_LAB_PYTHON") or sys.executable
DASHBOARD_NOTEBOOK = "dashboard_smoke.ipynb"
# Tutorials whose dashboard is also driven here ("all" for every one). One keeps this file near a minute;
# test_notebooks.py executes every tutorial headlessly anyway.
BROWSER_TUTORIALS = os.environ.get("WORKBENCH_BROWSER_TUTORIALS", "01_first_parallel_run.ipynb")

# No toast asking about news, no request to a website, no extension manager polling PyPI.
LAB_OVERRIDES = {
    "@jupyterlab/apputils-extension:notification": {"checkForUpdates": False, "fetchNews": "false"},
}
PAGE_CONFIG = {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


def _dashboard_source(out_root: Path) -> str:
    return ("from workbench.widgets import RunDashboard\n"
            f"d = RunDashboard(preset=\"tiny\", nproc=1, steps={STEPS}, out_root={str(out_root)!r})\n"
            "d")


def _tutorial_dashboard_cells() -> list[tuple[str, int]]:
    """(notebook, cell index) of the first cell that creates and shows a RunDashboard, per chosen tutorial."""
    found = []
    paths = sorted((REPO / "notebooks").glob("[0-9]*.ipynb"))
    if BROWSER_TUTORIALS != "all":
        paths = [p for p in paths if p.name in BROWSER_TUTORIALS.split(",")]
    for path in paths:
        try:
            cells = json.loads(path.read_text())["cells"]
        except (OSError, ValueError, KeyError):
            continue
        for i, c in enumerate(cells):
            src = "".join(c["source"]).strip()
            last = src.splitlines()[-1].strip() if src else ""
            if c["cell_type"] == "code" and "RunDashboard(" in src and last.isidentifier():
                found.append((path.name, i))
                break
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live process under ``pid``: kernels, and the torchrun jobs they launch."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(stat.parent.name), fields[19]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _kill(procs: list[tuple[int, str]]) -> None:
    """SIGKILL each process that is still the one recorded (same start time), never a reused pid."""
    for pid, started in procs:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] != started:
                continue
            os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass


def _notebook(source: str) -> dict:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "dashboard", "metadata": {},
                   "outputs": [], "source": source}],
        "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                    "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


class LabServer:
    def __init__(self, url: str, token: str, root: Path, proc: subprocess.Popen, log: Path):
        self.url, self.token, self.root, self.proc, self.log = url, token, root, proc, log

    def api(self, path: str, method: str = "GET", timeout: float = 10) -> tuple[int, object]:
        req = urllib.request.Request(f"{self.url}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
                return resp.status, json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            return e.code, None

    def shutdown_kernels(self) -> None:
        """End every kernel (and so the runs it launched) so the next test starts on a quiet machine."""
        status, kernels = self.api("/api/kernels")
        for k in kernels if status == 200 and kernels else []:
            self.api(f"/api/kernels/{k['id']}", method="DELETE", timeout=30)

    def lab_url(self, notebook: str) -> str:
        # ``reset``: a fresh workspace, so tabs opened by an earlier test are not restored behind this one.
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> LabServer:
    """A JupyterLab server on a free port with a fresh token; stopped (with its kernels) afterwards."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "notebooks"
    src = REPO / "notebooks"
    if src.is_dir():
        shutil.copytree(src, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "runs"))
    root.mkdir(exist_ok=True)
    (base / "runs").mkdir()
    (root / DASHBOARD_NOTEBOOK).write_text(json.dumps(_notebook(_dashboard_source(base / "runs")), indent=1))
    settings = base / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(json.dumps(LAB_OVERRIDES))
    (settings / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    for d in ("config", "data", "runtime", "ipython", "user-settings", "workspaces", "tmp"):
        (base / d).mkdir()

    env = dict(os.environ)
    # Isolated from the user's Jupyter config and state. Labextensions still come from sys.prefix.
    env.update(JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), IPYTHONDIR=str(base / "ipython"),
               JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1",
               TMPDIR=str(base / "tmp"))  # run directories the notebooks create land here, not in /tmp
    env.setdefault("OMP_NUM_THREADS", "1")
    with start_lab(root, base, settings, env) as server:
        yield server


@contextlib.contextmanager
def start_lab(root: Path, base: Path, settings: Path, env: dict, extra: tuple[str, ...] = ()):
    """A real ``jupyter lab`` on a free port with a fresh token, serving ``root``; its log in ``base``.
    Yields the :class:`LabServer` once it answers, and stops it (with its kernels) afterwards."""
    port, token = _free_port(), uuid.uuid4().hex
    cmd = [
        LAB_PYTHON, "-m", "jupyterlab",
        "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--ServerApp.allow_root=True",
        "--ServerApp.terminals_enabled=False",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly", f"--LabApp.app_settings_dir={settings}",
        f"--LabApp.user_settings_dir={base / 'user-settings'}", f"--LabApp.workspaces_dir={base / 'workspaces'}",
        *extra,
    ]
    log = base / "jupyter-lab.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=root, start_new_session=True)
    server = LabServer(f"http://127.0.0.1:{port}", token, root, proc, log)
    try:
        wait_for_server(proc, lambda: server.api("/api/status", timeout=2)[0] == 200, "jupyter lab", server.log_tail,
                        SERVER_START_S)
        yield server
    finally:
        _stop_server(server)


@contextlib.contextmanager
def start_files_lab(root: Path, base: Path, extra: tuple[str, ...] = ()):
    """A JupyterLab serving ``root`` (files for the Workbench tabs) with the workbench server extension, its
    settings and state under ``base``, and ``extra`` command-line options; yields the :class:`LabServer`."""
    settings = base / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(json.dumps(LAB_OVERRIDES))
    (settings / "page_config.json").write_text(json.dumps(PAGE_CONFIG))
    for d in ("config", "data", "runtime", "user-settings", "workspaces"):
        (base / d).mkdir()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(base / "config"), JUPYTER_DATA_DIR=str(base / "data"),
               JUPYTER_RUNTIME_DIR=str(base / "runtime"), JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1",
               XDG_CACHE_HOME=str(base / "cache"))  # the parsed-snapshot cache, not the user's
    with start_lab(root, base, settings, env, ("--ServerApp.jpserver_extensions={'workbench.jupyter': True}", *extra)) as server:
        yield server


@contextlib.contextmanager
def lab_page(browser, server: LabServer, width: int = 1400, height: int = 900, query: str = "",
             ready: str = ".jp-DirListing-item"):
    """A fresh browser context on ``server``'s JupyterLab (``query``: e.g. ``reset&``), once ``ready`` shows."""
    context = browser.new_context(viewport={"width": width, "height": height})
    pg = context.new_page()
    try:
        pg.goto(f"{server.url}/lab?{query}token={server.token}", timeout=60_000)
        pg.wait_for_selector(ready, timeout=60_000)
        yield pg
    finally:
        context.close()


def write_notebook(path: Path, cells: list[str]) -> None:
    """A notebook of code cells, no outputs, for the python3 kernel."""
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                     "source": src} for i, src in enumerate(cells)],
          "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
                       "language_info": {"name": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))


def menu(page, menu_name: str, item: "re.Pattern") -> None:
    """Click ``item`` in JupyterLab's ``menu_name`` menu (File, Run, Kernel...)."""
    page.get_by_role("menuitem", name=menu_name, exact=True).click()
    page.get_by_role("menuitem", name=item).click()


def restart_and_run_all(page) -> None:
    """Kernel > Restart Kernel and Run All Cells, confirmed."""
    from playwright.sync_api import expect

    menu(page, "Kernel", re.compile(r"^Restart Kernel and Run All Cells"))
    dialog = page.locator(".jp-Dialog")
    expect(dialog).to_be_visible(timeout=10_000)
    dialog.locator("button.jp-mod-accept").click()


def _stop_server(server: LabServer) -> None:
    """Ask the server to shut down its kernels and exit; then make sure nothing of it is left."""
    proc = server.proc
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        try:
            server.api("/api/shutdown", method="POST", timeout=5)
        except OSError:
            pass
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)
    _kill(tree)


@pytest.fixture(scope="module")
def browser():
    """Headless Debian Chromium under Playwright; closed afterwards."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not found: install Debian's chromium (`make browser`, or apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[dev]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, lab, tmp_path):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    page.console_log = console  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        try:
            page.screenshot(path=str(tmp_path / "final.png"))
        except Exception:
            pass
        (tmp_path / "console.log").write_text("\n".join(console))
        context.close()
        lab.shutdown_kernels()


def _run_cell(page, cell) -> None:
    """Shift+Enter in ``cell``. If JupyterLab still asks which kernel to use, accept its preferred one."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    started = cell.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    try:
        started.or_(dialog).first.wait_for(timeout=30_000)
    except PlaywrightTimeout:
        raise AssertionError("the cell did not start executing within 30 s") from None
    if dialog.is_visible():
        print("JupyterLab asked for a kernel; accepting its preferred one")
        dialog.get_by_role("button", name="Select").click()
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        started.wait_for(timeout=30_000)


def test_server_lists_tutorial_notebooks(lab):
    status, body = lab.api("/api/status")
    assert status == 200 and "started" in body
    status, listing = lab.api("/api/contents")
    assert status == 200
    names = {item["name"] for item in listing["content"] if item["type"] == "notebook"}
    expected = {p.name for p in (REPO / "notebooks").glob("*.ipynb")} | {DASHBOARD_NOTEBOOK}
    assert expected <= names, f"missing from /api/contents: {sorted(expected - names)}"
    status, nb = lab.api(f"/api/contents/{DASHBOARD_NOTEBOOK}")
    assert status == 200 and nb["type"] == "notebook" and "RunDashboard" in nb["content"]["cells"][0]["source"]


def _open_notebook(page, lab: LabServer, name: str):
    """Open ``name`` in JupyterLab and wait until its kernel is connected and idle; returns its cells.

    Running a cell before the kernel is connected makes JupyterLab ask which kernel to start instead.
    """
    from playwright.sync_api import expect

    page.goto(lab.lab_url(name), timeout=60_000)
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")  # the notebook on show, not other tabs
    expect(panel).to_have_count(1, timeout=60_000)
    cells = panel.locator(".jp-Cell")
    expect(cells.first).to_be_visible(timeout=60_000)
    kernel_status = page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"Python 3.*\|\s*Idle"))
    expect(kernel_status).to_be_visible(timeout=60_000)
    return cells


def _check_dashboard(page, output, tmp_path: Path, label: str) -> None:
    """The dashboard in ``output`` renders, and Launch trains to the last step with the plots filling in."""
    from playwright.sync_api import expect

    # The widget view, rendered by the ipywidgets and plotly labextensions (not a text fallback).
    launch = output.locator("button.jupyter-button", has_text="Launch")
    expect(launch).to_be_visible(timeout=60_000)
    expect(launch).to_be_enabled()
    expect(output.locator("button.jupyter-button", has_text="Stop")).to_be_disabled()
    plots = {title: output.locator(".js-plotly-plot").filter(has_text=title)
             for title in ("Loss per step", "Throughput per step")}
    for plot in plots.values():
        expect(plot).to_be_visible(timeout=30_000)
    bar = output.locator(".widget-hprogress .progress-bar")
    expect(bar).to_have_count(1)
    assert not output.get_by_text("Error displaying widget").count(), "a widget failed to render"
    steps = int(output.locator(".widget-text", has_text="steps").locator("input").input_value())
    nproc = int(output.locator(".widget-text", has_text="nproc").locator("input").input_value())
    launch.scroll_into_view_if_needed()  # Shift+Enter moved on to the next cell; show the dashboard
    page.screenshot(path=str(tmp_path / f"{label}-rendered.png"))

    # A real run, started from the button and followed to its end.
    launch.click()
    expect(output.get_by_text(re.compile(r"succeeded after"))).to_be_visible(timeout=90_000)
    expect(output.get_by_text(f"step {steps}/{steps}")).to_be_visible()
    expect(bar).to_have_attribute("style", re.compile(r"width:\s*100%"))
    expect(bar).to_have_class(re.compile(r"progress-bar-success"))
    # Loss: one trace per rank; throughput (global tokens/s, the same on every rank): one per run; one point
    # per step each.
    for title, plot in plots.items():
        n = nproc if title.startswith("Loss") else 1
        traces = plot.locator(".scatterlayer .trace")
        expect(traces).to_have_count(n, timeout=10_000)
        for k in range(n):
            expect(traces.nth(k).locator(".point")).to_have_count(steps)
    expect(launch).to_be_enabled()
    launch.scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / f"{label}-finished.png"))


def _dump_on_failure(page, lab: LabServer) -> None:
    log = "\n".join(page.console_log[-40:])  # type: ignore[attr-defined]
    print(f"--- browser console ---\n{log}\n--- jupyter lab log ---\n{lab.log_tail()}")


# A RunDashboard rendering, launching and finishing in JupyterLab is checked on the tutorial's own dashboard
# (below), as a reader meets it; a one-cell copy of the same check cost 20 s more and found nothing it didn't.


@pytest.mark.parametrize("notebook,index", _tutorial_dashboard_cells() or
                         [pytest.param(None, None, marks=pytest.mark.skip(reason="no chosen tutorial shows a RunDashboard"))])
def test_tutorial_dashboard_in_jupyterlab(lab, page, tmp_path, notebook, index):
    """The tutorial as a reader meets it: run the cells above its dashboard (Run menu), then the dashboard."""
    from playwright.sync_api import expect

    try:
        cells = _open_notebook(page, lab, notebook)
        dash = cells.nth(index)
        dash.locator(".jp-InputArea-editor").click()
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name=re.compile(r"^Run All Above Selected Cell")).click()
        # Every code cell above has run (a number in its prompt) before the dashboard's turn.
        for k in range(index):
            if "jp-CodeCell" in (cells.nth(k).get_attribute("class") or ""):
                expect(cells.nth(k).locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"),
                                                                             timeout=60_000)
                expect(cells.nth(k).locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                            has_text="Traceback")).to_have_count(0)
        _run_cell(page, dash)
        _check_dashboard(page, dash.locator(".jp-OutputArea-output"), tmp_path, Path(notebook).stem)
    except Exception:
        _dump_on_failure(page, lab)
        raise
