"""Issue 28, "Done when": each tutorial runs with Run All in Chromium, twice, and every plot in it has drawn
data; the same holds after a page reload.

A real JupyterLab serves a copy of notebooks/; for each chosen tutorial: Run All, then every PlotView on
the page must hold traces (plotly's ``gd.data``) and have drawn each of them (a ``.trace`` group in the
plot's SVG or GL layer), with no "Error displaying widget" and no traceback; then save, reload the page
and check again (the views come back from the kernel); then Restart Kernel and Run All, and check again.

Which tutorials: ``WORKBENCH_BROWSER_PLOTS`` (comma-separated file names, or ``all``); by default one
(06, about two minutes here with its three passes), so the suite stays near its time. `make
test-exhaustive` runs all seven.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from test_browser import (_dump_on_failure, _open_notebook, browser, lab, menu, page,  # noqa: F401  (fixtures)
                          restart_and_run_all)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
CHOSEN = os.environ.get("WORKBENCH_BROWSER_PLOTS", "06_kernels.ipynb")
TUTORIALS = sorted(p.name for p in (REPO / "notebooks").glob("[0-9]*.ipynb")
                   if CHOSEN == "all" or p.name in CHOSEN.split(","))
RUN_TIMEOUT_MS = 900_000

# Per plot: traces in the figure and traces drawn. A trace plotly draws has a group in one of the layers.
PLOTS = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .pw-plot')).map(el => ({
    data: (el.data || []).length,
    drawn: el.querySelectorAll('.scatterlayer .trace, .barlayer .trace, .heatmaplayer .trace, .imagelayer .trace, .maplayer .trace, .trace.scatter, .pielayer .trace, .treemaplayer .trace, .iciclelayer .trace, .sunburstlayer .trace, .funnellayer .trace, .boxlayer .trace, .violinlayer .trace, .contourlayer .trace, .gl-container canvas').length,
    visible: el.offsetParent !== null,
    error: el.classList.contains('pw-plot-error') ? el.textContent : null,
}))"""


def _code_cells(name: str) -> int:
    return sum(c["cell_type"] == "code" for c in json.loads((REPO / "notebooks" / name).read_text())["cells"])


RUN_STATE = """() => {
    const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    const prompts = Array.from(panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')).map(p => p.textContent.trim());
    const error = Array.from(panel.querySelectorAll('.jp-OutputArea-output')).find(o => /Traceback|Error:/.test(o.textContent)
        && o.closest('.jp-OutputArea-child').querySelector('[data-mime-type="application/vnd.jupyter.stderr"]'));
    return {done: prompts.length > 0 && prompts.every(p => /^\\[\\d+\\]/.test(p)), prompts,
            error: error ? error.textContent.slice(0, 2000) : null};
}"""


def _wait_ran(page, cells) -> None:
    """Every code cell has run (a number in its prompt); fails at once, with the traceback, when one fails
    (Run All then stops, and the cells below would never get a number)."""
    from helpers import wait_for

    def state():
        st = page.evaluate(RUN_STATE)
        return st if st["done"] or st["error"] else None
    try:
        st = wait_for(state, timeout=RUN_TIMEOUT_MS / 1000)
    except TimeoutError:
        raise AssertionError(f"the cells did not all run: prompts {page.evaluate(RUN_STATE)['prompts']}") from None
    assert not st["error"], f"a cell failed: {st['error']}"


def _assert_plots(page, when: str) -> int:
    from helpers import wait_for

    def ok():
        got = page.evaluate(PLOTS)
        return got if got and all(g["data"] >= 1 and g["drawn"] >= 1 and not g["error"] for g in got if g["visible"]) else None
    try:
        got = wait_for(ok, timeout=90)
    except TimeoutError:
        raise AssertionError(f"{when}: not every plot drew its data: {page.evaluate(PLOTS)}") from None
    assert not page.get_by_text("Error displaying widget").count(), f"{when}: a widget failed to render"
    return len(got)


def _save(page, lab, name: str) -> None:
    from helpers import wait_for

    menu(page, "File", re.compile(r"^Save Notebook$|^Save Notebook\s+Ctrl\+S"))

    def saved():
        status, nb = lab.api(f"/api/contents/{name}")
        return status == 200 and any(c.get("outputs") for c in nb["content"]["cells"])
    try:
        wait_for(saved, timeout=60)
    except TimeoutError:
        raise AssertionError(f"{name} was not saved with its outputs within 60 s") from None


@pytest.mark.parametrize("name", TUTORIALS or [pytest.param(None, marks=pytest.mark.skip(reason="no tutorial chosen"))])
def test_tutorial_plots_draw_in_jupyterlab(lab, page, tmp_path, name):
    from playwright.sync_api import expect

    try:
        cells = _open_notebook(page, lab, name)
        menu(page, "Run", re.compile(r"^Run All Cells"))
        _wait_ran(page, cells)
        n = _assert_plots(page, "after Run All")
        page.screenshot(path=str(tmp_path / "run-all.png"), full_page=True)
        print(f"{name}: {n} plots drew after Run All")

        _save(page, lab, name)
        page.reload()
        cells = _open_notebook(page, lab, name)
        assert _assert_plots(page, "after a page reload") == n

        restart_and_run_all(page)
        expect(cells.nth(0).locator(".jp-InputPrompt")).not_to_have_text(re.compile(r"\[\d+\]"), timeout=60_000)
        _wait_ran(page, cells)
        assert _assert_plots(page, "after the second Run All") == n
    except Exception:
        _dump_on_failure(page, lab)
        raise
