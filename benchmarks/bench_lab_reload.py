"""How long JupyterLab takes to come back after a page reload with 25 tabs open (issue 28, finding 12).

A real ``jupyter lab`` (the workbench server extension and labextension) serves 10 notebooks of 7 plots
each, run in their live kernels and saved, and 15 Workbench tabs: 5 memory timelines, 5 checkpoints and 5
runs. Debian's Chromium (Playwright) opens all 25 tabs, then reloads the page, and the clock runs from the
reload until

- ``restored_s``: the 25 tabs are back in the dock and the active one (a notebook) has drawn its plots;
- ``all_tabs_s``: each tab in turn was activated and has drawn (a notebook: all 7 plots; a Workbench tab:
  its SVG or table).

The named baseline, measured in the same run on a fresh server and browser: the same notebooks with
plotly's ``go.FigureWidget`` (which ships plotly's bundle as every widget's own module) instead of our
``PlotView``. For it a notebook counts as drawn when its 7 plot elements exist, since some of its plots
come back blank after a reload (``plots_with_data`` says how many hold their traces: the one filled by
a later cell does not). The renderer's memory is the JS heap that Chrome reports
(``Performance.getMetrics``) and the resident set of Chromium's renderer processes, after every tab was
visited.

    python benchmarks/bench_lab_reload.py              # 10 notebooks + 15 tabs, both transports
    python benchmarks/bench_lab_reload.py --quick      # 2 notebooks + 3 tabs

Prints one JSON document: each transport's figures and the ratios ours / FigureWidget. Needs Chromium
and Playwright (``make test`` installs both) and the built labextension (``make extension``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "views"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import machine_info  # noqa: E402
from test_browser import CHROMIUM, CHROMIUM_ARGS, start_files_lab, write_notebook  # noqa: E402

PLOTS = 7
TRANSPORTS = {
    "PlotView": ("from workbench.widgets.plotly_view import PlotView as Plot", ".pw-plot"),
    "FigureWidget": ("from plotly.graph_objects import FigureWidget as Plot", ".js-plotly-plot"),
}


def _cells(transport: str) -> list[str]:
    """A notebook as a user's: a loss curve of 300 points per plot, some bars, one plot shown empty and
    filled by a later cell, two plots in a VBox."""
    imp = TRANSPORTS[transport][0]
    cells = [f"{imp}\nimport ipywidgets as W\nimport math\ny = [3 * math.exp(-i / 80) + 0.05 * math.sin(i) "
             "for i in range(300)]"]
    for i in range(PLOTS - 3):
        cells.append(f"Plot(data=[{{'type': 'scatter', 'y': y}}, {{'type': 'bar', 'y': y[::30]}}], "
                     f"layout={{'height': {260 + 10 * i}, 'title': {{'text': 'plot {i}'}}}})")
    cells.append("late = Plot(layout={'height': 250})\nlate")  # shown empty, filled by the next cell
    cells.append("late.add_scatter(y=y)\nlate.layout.title = 'filled later'")
    cells.append("W.VBox([Plot(data=[{'type': 'scatter', 'y': y[::-1]}], layout={'height': 240}) for _ in range(2)])")
    return cells


def _files(root: Path, transport: str, notebooks: int, per_kind: int) -> list[tuple[str, str]]:
    """Writes the notebooks and Workbench files under ``root``; returns (kind, path) per tab, notebooks last."""
    from memory_demo import demo_timeline
    from ckpt_views_fixtures import trained_checkpoint
    from test_run_tab_peaks import _pp_run

    tabs: list[tuple[str, str]] = []
    tl = demo_timeline()
    for k in range(per_kind):
        tl.save(root / f"mem{k}")
        tabs.append(("workbench", f"mem{k}"))
    step = trained_checkpoint(root / "ckpt0")
    for k in range(per_kind):
        if k:
            shutil.copytree(root / "ckpt0", root / f"ckpt{k}")  # the same checkpoint under another name
        tabs.append(("workbench", str(Path(f"ckpt{k}") / step.relative_to(root / "ckpt0"))))
    for k in range(per_kind):
        _pp_run(root / f"run{k}")
        tabs.append(("workbench", f"run{k}/events.jsonl"))
    for k in range(notebooks):
        write_notebook(root / f"plots{k}.ipynb", _cells(transport))
        tabs.append(("notebook", f"plots{k}.ipynb"))
    return tabs


# Per visible tab: drawn or not. A notebook is drawn when it has its plots (with data, for PlotView);
# a Workbench tab when its content holds an SVG or a table.
_ACTIVE_DRAWN = """([sel, plots, needData]) => {
  const cur = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!cur) return false;
  const w = cur.node;
  if (w.classList.contains('jp-NotebookPanel')) {
    const ps = Array.from(w.querySelectorAll(sel));
    return ps.length >= plots && (!needData || ps.every(p => (p.data || []).length > 0));
  }
  return !!w.querySelector('.pw-content svg, .pw-content table');
}"""
_WITH_DATA = "sel => Array.from(document.querySelectorAll(sel)).filter(p => (p.data || []).length > 0).length"
_STATE = """sel => { const w = window.jupyterapp.shell.currentWidget;
  return {title: w.title.label, plots: w.node.querySelectorAll(sel).length,
          text: w.node.innerText.slice(0, 200)}; }"""
_TABS = "() => document.querySelectorAll('#jp-main-dock-panel .lm-DockPanel-tabBar .lm-TabBar-tab').length"


def _wait(page, fn, arg=None, timeout: float = 600.0) -> float:
    """Polls ``fn`` in the page until it is true; the seconds it took. Raises on timeout."""
    t0 = time.perf_counter()
    page.wait_for_function(fn, arg=arg, timeout=timeout * 1000, polling=50)
    return time.perf_counter() - t0


def _renderer_rss(marker: str) -> int:
    """Resident bytes of the renderer processes of the Chromium whose command line holds ``marker``."""
    import psutil

    total = 0
    for p in psutil.process_iter(["cmdline"]):
        if marker in (p.info.get("cmdline") or []):
            for c in p.children(recursive=True):
                try:
                    if "--type=renderer" in c.cmdline():
                        total += c.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
    return total


def measure(transport: str, notebooks: int, per_kind: int, log) -> dict:
    from playwright.sync_api import sync_playwright

    sel = TRANSPORTS[transport][1]
    need_data = transport == "PlotView"
    with tempfile.TemporaryDirectory(prefix="pw-reload-") as tmp:
        base = Path(tmp)
        root = base / "files"
        root.mkdir()
        tabs = _files(root, transport, notebooks, per_kind)
        marker = f"--workbench-bench={uuid.uuid4().hex}"  # finds this browser's processes (Chromium ignores it)
        os.environ["OMP_NUM_THREADS"] = "1"  # the kernels' threads, as in the tests' Lab
        with start_files_lab(root, base, ("--LabApp.expose_app_in_browser=True",)) as server, \
                sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[*CHROMIUM_ARGS, marker])
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.goto(f"{server.url}/lab?reset&token={server.token}", timeout=60_000)
            page.wait_for_selector(".jp-DirListing-item", timeout=60_000)
            log(f"{transport}: opening {len(tabs)} tabs")
            for kind, path in tabs:
                if kind == "workbench":
                    page.evaluate("p => window.jupyterapp.commands.execute('parallel-workbench:open', {path: p})", path)
                    _wait(page, _ACTIVE_DRAWN, [sel, PLOTS, need_data])
                else:
                    page.evaluate("p => window.jupyterapp.commands.execute('docmanager:open', {path: p, factory: 'Notebook', kernel: {name: 'python3'}})", path)
                    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook", timeout=60_000)
                    _wait(page, "() => { const w = window.jupyterapp.shell.currentWidget; "
                                "return w && w.sessionContext && w.sessionContext.session && "
                                "w.sessionContext.session.kernel && w.sessionContext.session.kernel.connectionStatus === 'connected' && "
                                "w.sessionContext.session.kernel.status === 'idle'; }")
                    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
                    _wait(page, _ACTIVE_DRAWN, [sel, PLOTS, need_data])
                    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            page.evaluate("() => { const app = window.jupyterapp, last = app.shell.currentWidget; "
                          "for (const w of Array.from(app.shell.widgets('main'))) if (w.title.label === 'Launcher') w.close(); "
                          "app.shell.activateById(last.id); }")
            assert page.evaluate(_TABS) == len(tabs), page.locator("#jp-main-dock-panel .lm-TabBar-tab").all_inner_texts()
            time.sleep(3)  # the layout restorer saves the workspace shortly after the last change
            log(f"{transport}: reloading")
            t0 = time.perf_counter()
            page.reload(timeout=120_000)
            page.wait_for_function(f"n => ({_TABS})() >= n", arg=len(tabs), timeout=600_000, polling=50)
            tabs_s = time.perf_counter() - t0
            _wait(page, _ACTIVE_DRAWN, [sel, PLOTS, need_data])
            restored_s = time.perf_counter() - t0
            titles = page.locator("#jp-main-dock-panel .lm-DockPanel-tabBar .lm-TabBar-tab")
            not_drawn = []
            for k in range(titles.count()):
                titles.nth(k).click()
                try:
                    _wait(page, _ACTIVE_DRAWN, [sel, PLOTS, False], timeout=120)
                except Exception:  # playwright's TimeoutError: say which tab and what it holds, and go on
                    not_drawn.append(page.evaluate(_STATE, sel))
            all_s = time.perf_counter() - t0
            with_data = page.evaluate(_WITH_DATA, sel)
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
            rss = _renderer_rss(marker)
            browser.close()
    return {"tabs": len(tabs), "notebooks": notebooks, "plots": notebooks * PLOTS, "tabs_back_s": round(tabs_s, 2),
            "restored_s": round(restored_s, 2), "all_tabs_s": round(all_s, 2), "plots_with_data": with_data,
            "js_heap_mb": round(metrics.get("JSHeapUsedSize", 0) / 2**20, 1),
            "renderer_rss_mb": round(rss / 2**20, 1), "tabs_not_drawn": not_drawn}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 notebooks and 3 Workbench tabs")
    ap.add_argument("--transports", default="PlotView,FigureWidget", help="comma list (PlotView, FigureWidget)")
    args = ap.parse_args(argv)
    if not CHROMIUM.exists():
        print(json.dumps({"error": f"{CHROMIUM} not found: install Debian's chromium (make browser)"}))
        return 2
    notebooks, per_kind = (2, 1) if args.quick else (10, 5)
    log = lambda m: print(f"[bench_lab_reload] {m}", file=sys.stderr, flush=True)  # noqa: E731
    results = {}
    for t in args.transports.split(","):
        results[t] = measure(t, notebooks, per_kind, log)
        log(f"{t}: {json.dumps(results[t])}")  # each transport's figures as soon as they are in
    out = {"benchmark": "bench_lab_reload", "baseline": "FigureWidget", "machine": machine_info(), "results": results}
    if "PlotView" in results and "FigureWidget" in results:
        ours, base = results["PlotView"], results["FigureWidget"]
        out["ratios"] = {k: round(ours[k] / base[k], 3) if base[k] else None
                         for k in ("restored_s", "all_tabs_s", "js_heap_mb", "renderer_rss_mb")}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
