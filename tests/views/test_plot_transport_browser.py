"""Issue 28, finding 1-2: every plot draws, in a fresh kernel, after more edits, and after a page reload.

plotly's FigureWidget kept only the figure it was built with as widget state and sent later edits as
one-off messages, so a view drawn late and every view rebuilt after a reload showed empty axes.
``PlotView`` keeps the whole figure in its state. Here a real JupyterLab in Chromium runs a notebook of
plots (figures displayed whole, one displayed empty and filled by a later cell, two inside a VBox) with
Run All; then the page is reloaded; then the kernel is restarted and everything runs again. Each time,
each plot's DOM must hold its traces (plotly's ``gd.data`` and the drawn ``.trace`` groups), at the height
its layout asks for.
"""

from __future__ import annotations

import re

import pytest

from test_browser import (_dump_on_failure, _open_notebook, browser, lab, menu, page,  # noqa: F401  (fixtures)
                          restart_and_run_all, write_notebook)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

NOTEBOOK = "plots_smoke.ipynb"
CELLS = [
    "from workbench.widgets.plotly_view import PlotView\nimport ipywidgets as W",
    *[f"PlotView(data=[{{'type': 'scatter', 'y': [1, 3, 2, 4]}}], layout={{'height': {240 + 20 * i}}})"
      for i in range(4)],
    "late = PlotView(layout={'height': 300})\nlate",
    "late.add_scatter(y=[4, 3, 2, 1])\nwith late.batch_update():\n    late.add_bar(y=[1, 2])\n    late.layout.title = 'filled later'",
    "W.VBox([PlotView(data=[{'type': 'bar', 'y': [1, 2, 3]}], layout={'height': 220}) for _ in range(2)])",
]
# (traces, height) per plot, in page order.
EXPECTED = [(1, 240), (1, 260), (1, 280), (1, 300), (2, 300), (1, 220), (1, 220)]

DRAWN = """() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .pw-plot')).map(el => ({
    data: (el.data || []).length,
    drawn: el.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length,
    height: Math.round(el.getBoundingClientRect().height),
    error: el.classList.contains('pw-plot-error') ? el.textContent : null,
}))"""


def _wait_all_ran(page, cells) -> None:
    from playwright.sync_api import expect

    for k in range(len(CELLS)):
        expect(cells.nth(k).locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=120_000)


def _save(page, lab) -> None:
    """Save (what autosave does every two minutes), so the reloaded page shows the outputs."""
    from helpers import wait_for

    menu(page, "File", re.compile(r"^Save Notebook$|^Save Notebook\s+Ctrl\+S"))

    def saved():
        status, nb = lab.api(f"/api/contents/{NOTEBOOK}")
        return status == 200 and sum(bool(c.get("outputs")) for c in nb["content"]["cells"]) >= 6
    try:
        wait_for(saved, timeout=60)
    except TimeoutError:
        raise AssertionError("the notebook was not saved with its outputs within 60 s") from None


def _assert_drawn(page, when: str) -> None:
    from helpers import wait_for

    def ok():
        got = page.evaluate(DRAWN)
        return got if (len(got) == len(EXPECTED) and all(g["data"] == n and g["drawn"] == n and abs(g["height"] - h) <= 2
                                                          for g, (n, h) in zip(got, EXPECTED))) else None
    try:
        wait_for(ok, timeout=60)
    except TimeoutError:
        raise AssertionError(f"{when}: plots drawn {page.evaluate(DRAWN)}; expected (traces, height) {EXPECTED}") from None
    assert not page.get_by_text("Error displaying widget").count(), f"{when}: a widget failed to render"


def test_plots_draw_after_run_all_reload_and_restart(lab, page, tmp_path):
    from playwright.sync_api import expect

    write_notebook(lab.root / NOTEBOOK, CELLS)
    try:
        cells = _open_notebook(page, lab, NOTEBOOK)
        menu(page, "Run", re.compile(r"^Run All Cells"))
        _wait_all_ran(page, cells)
        _assert_drawn(page, "after Run All")
        page.screenshot(path=str(tmp_path / "run-all.png"))

        _save(page, lab)
        page.reload()  # the kernel lives on; the widget models come back from it
        cells = _open_notebook(page, lab, NOTEBOOK)
        _assert_drawn(page, "after a page reload")

        restart_and_run_all(page)
        expect(cells.nth(0).locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[1\]"), timeout=120_000)
        _wait_all_ran(page, cells)
        _assert_drawn(page, "after a kernel restart and Run All")
    except Exception:
        _dump_on_failure(page, lab)
        raise


def test_plotly_js_is_served_once_per_version_and_only_behind_the_login(lab):
    """The route PlotView loads plotly.js from: the plotly package's file, cached for good under a versioned
    URL (so a page of many plots, or a reload, downloads it once), refused without the token."""
    import urllib.error
    import urllib.request

    from plotly.offline import get_plotlyjs_version

    from workbench.widgets.plotly_view import PLOTLY_ROUTE, plotly_js

    url = f"{lab.url}/{PLOTLY_ROUTE}?v={get_plotlyjs_version()}"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"token {lab.token}"}),
                                timeout=30) as resp:
        body, headers = resp.read(), resp.headers
    assert body.decode() == plotly_js()
    assert "javascript" in headers["Content-Type"]
    assert re.search(r"max-age=(\d+)", headers["Cache-Control"]) and int(
        re.search(r"max-age=(\d+)", headers["Cache-Control"]).group(1)) >= 365 * 86400
    try:  # without the token: the login page (urllib follows the redirect) or a refusal, never the file
        with urllib.request.urlopen(urllib.request.Request(url), timeout=30) as resp:
            assert resp.url != url and "javascript" not in resp.headers["Content-Type"], resp.url
    except urllib.error.HTTPError as e:
        assert e.code == 403
    for other in ("workbench/static/plotly.js", "workbench/static/../__init__.py"):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(f"{lab.url}/{other}",
                                                          headers={"Authorization": f"token {lab.token}"}), timeout=30)
