"""Issue 28, findings 8 and 5 in a real browser: the Lab memory tab draws the notebook view's picture, and the
run tab calls only the recorded peak a peak.

A real ``jupyter lab`` (workbench server extension, the prebuilt labextension) serves a saved memory
timeline (tests/views/memory_demo.py: 3 ranks, 30 steps of 4 microbatches), a saved prediction of it, and
a pp=2 run's events; Playwright drives Debian's Chromium (tests/test_browser.py's fixtures). The memory
tab's SVG must hold the stacked category areas in the core palette's colours, in the notebook view's
order, the total in a colour no category has, the phase bands, the peak marker with the notebook view's
annotation, 1-2-5 tick labels in one unit, a zoom label equal to the axis, a rank and a step picker,
and the prediction dashed after it is picked. On the extension before issue 28 the tab drew overlaid
polylines (no ``path.pw-area``, no ``g.pw-peak``, no ``rect.pw-phase-band``), and the run tab's
summary called the 359 MiB resident set ``peak_mem_bytes``.

Skipped, with the reason, where Chromium or Playwright is missing, or where the labextension is not
installed (run ``make extension``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from memory_demo import demo_prediction, demo_timeline
from test_browser import browser, lab_page, start_files_lab  # noqa: F401 (browser: a fixture)
from test_run_tab_peaks import _pp_run

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def lab_memory(tmp_path_factory):
    if not (Path(sys.prefix) / "share/jupyter/labextensions/parallel-workbench-lab/package.json").exists():
        pytest.skip("the labextension is not installed in this environment: run `make extension`")
    base = tmp_path_factory.mktemp("labmem")
    root = base / "files"
    root.mkdir()
    tl = demo_timeline()
    tl.save(root / "memdemo")
    demo_prediction().save(root / "predicted_memdemo")
    _pp_run(root / "pprun")
    with start_files_lab(root, base) as server:
        yield server, tl


@pytest.fixture(scope="module")
def page(lab_memory, browser):
    with lab_page(browser, lab_memory[0], height=1000) as pg:
        yield pg


def _open_dir(page, name: str):
    page.locator(f".jp-DirListing-item[title^='Name: {name}']").click(button="right")
    page.locator(".lm-Menu-itemLabel", has_text="Open in Workbench").first.click()
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.wait_for(timeout=20_000)
    return tab


def _attrs(loc, attr: str) -> list[str]:
    return loc.evaluate_all(f"ns => ns.map(n => n.getAttribute('{attr}'))")


def _texts(loc) -> list[str]:
    return loc.evaluate_all("ns => ns.map(n => n.textContent)")


def _nice_labels(labels: list[str]) -> float:
    """The labels' common step, after checking it is 1, 2 or 5 times a power of ten and every label is
    written with no more decimals than that step needs."""
    values = [float(x) for x in labels]
    assert len(values) >= 2, labels
    steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    assert len(steps) == 1, labels
    step = steps.pop()
    mant = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mant, m) for m in (1, 2, 5)), labels
    need = max(0, -math.floor(math.log10(step) + 1e-9))
    assert all(len(x.split(".")[1]) <= need for x in labels if "." in x), labels
    return step


def _chart_title(tab) -> str:
    return tab.locator(".pw-memory-chart .pw-chart-title").first.text_content()


def test_memory_tab_draws_the_notebook_views_picture(page, lab_memory, tmp_path):
    from workbench import palette
    from workbench.widgets import MemoryTimelineView

    server, tl = lab_memory
    tab = _open_dir(page, "memdemo")
    tab.locator(".pw-memory-chart path.pw-area").first.wait_for(timeout=30_000)
    view = MemoryTimelineView(tl)  # the notebook's view of the same timeline: the rank with the largest peak
    cats = [t.name for t in view.fig.data if (t.meta or {}).get("role") == "category"]
    areas = tab.locator(".pw-memory-chart path.pw-area")
    assert _attrs(areas, "data-category") == cats  # stacked bottom first, as the notebook's stackgroup
    assert _attrs(areas, "fill") == [palette.CATEGORY_COLORS[c] for c in cats]
    total = tab.locator(".pw-memory-chart polyline.pw-total")
    assert _attrs(total, "stroke") == [palette.TOTAL_COLOR] and palette.TOTAL_COLOR not in _attrs(areas, "fill")
    assert _chart_title(tab) == view.fig.layout.title.text
    # the phase bands: as many as the notebook view draws, in the phases' colours
    bands = tab.locator(".pw-memory-chart rect.pw-phase-band")
    assert bands.count() == len(view.fig.layout.shapes) > 0
    assert set(_attrs(bands, "fill")) <= set(palette.PHASE_COLORS.values())
    # the peak marker and its annotation, the notebook view's words
    peak = tab.locator(".pw-memory-chart g.pw-peak")
    assert peak.count() == 1
    assert "<br>".join(_texts(peak.locator("text"))) == view.fig.layout.annotations[0].text
    assert int(peak.get_attribute("data-bytes")) == tl.peak().bytes
    # 1-2-5 ticks in one unit; the zoom label names the axis' own range
    assert tab.locator(".pw-ytitle").text_content() == view.fig.layout.meta["unit"] == "MiB"
    _nice_labels(_texts(tab.locator(".pw-memory-chart .pw-ytick")))
    _nice_labels(_texts(tab.locator(".pw-memory-chart .pw-xtick")))
    status, answer = server.api("/workbench/api/memory/timeline?path=memdemo&rank=peak&points=2000")
    assert status == 200
    assert f"window {answer['x_axis']['window_label']} s" in tab.locator(".pw-zoom").text_content()
    assert "Alive at rank 2's peak" in tab.locator(".pw-alive").inner_text()
    page.screenshot(path=str(tmp_path / "memory-tab.png"))

    # drag across the plot: the server's window; ticks stay nice, the label follows the axis
    box = tab.locator(".pw-memory-chart svg").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.3, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.36, y, steps=4)
    page.mouse.up()
    tab.locator("button.pw-reset:not([disabled])").wait_for(timeout=20_000)
    label = tab.locator(".pw-zoom").text_content()
    lo, hi = (float(x) for x in label.split("window ")[1].split(" s;")[0].split(" – "))
    xt = [float(x) for x in _texts(tab.locator(".pw-memory-chart .pw-xtick"))]
    assert all(lo <= x <= hi for x in xt) and hi - lo < 0.1 * (answer["x_range"][1] - answer["x_range"][0])
    _nice_labels(_texts(tab.locator(".pw-memory-chart .pw-xtick")))
    tab.locator("button.pw-reset").click()

    # the rank and step pickers: the notebook view's rank 0, zoomed to step 3
    tab.locator("select.pw-rank").select_option("0")
    tab.locator(".pw-memory-chart .pw-chart-title", has_text="Rank 0:").wait_for(timeout=20_000)
    tab.locator("select.pw-step").select_option("3")
    tab.locator(".pw-memory-chart .pw-chart-title", has_text="Rank 0, step 3").wait_for(timeout=20_000)
    view0 = MemoryTimelineView(tl, rank=0, step=3)
    assert "<br>".join(_texts(tab.locator(".pw-memory-chart g.pw-peak text"))) == view0.fig.layout.annotations[0].text
    assert tab.locator(".pw-memory-chart rect.pw-phase-band").count() == len(view0.fig.layout.shapes)

    # the prediction, dashed, on the step clock (a measurement against a prediction)
    tab.locator("input.pw-overlay-path").fill("predicted_memdemo")
    tab.locator("button.pw-overlay-button").click()
    over = tab.locator(".pw-memory-chart polyline.pw-overlay")
    over.wait_for(timeout=30_000)
    assert over.get_attribute("stroke-dasharray") and over.get_attribute("stroke") == palette.OVERLAY_COLOR
    assert tab.locator(".pw-xtitle").text_content().startswith("step (")
    assert "predicted total (rank 0)" in tab.locator(".pw-memory-legend").inner_text()
    assert "vs dashed predicted" in _chart_title(tab)
    page.screenshot(path=str(tmp_path / "memory-tab-overlay.png"))


def test_run_tab_calls_only_the_recorded_peak_a_peak(page, tmp_path):
    tab = _open_dir(page, "pprun")
    tab.locator(".pw-run-memory table").first.wait_for(timeout=20_000)
    tab.locator(".pw-run-memory").scroll_into_view_if_needed()
    page.screenshot(path=str(tmp_path / "run-tab-memory.png"))
    summary = tab.locator(".pw-summary").first
    assert summary.locator("td[data-key='peak_mem_bytes']").inner_text() == "42.00 MiB"
    assert "recorded peak" in summary.locator("tr", has=page.locator("td[data-key='peak_mem_bytes']")).inner_text()
    rss_row = summary.locator("tr", has=page.locator("td[data-key='rss_bytes']")).inner_text()
    assert "RSS" in rss_row and "359.00 MiB" in rss_row
    stages = tab.locator(".pw-run-memory table").nth(1).inner_text()
    assert "42.00 MiB" in stages and "18.00 MiB" in stages and "RSS (resident set)" in stages
    steps = tab.locator("table.pw-table").last.inner_text()  # last steps: the probe's peak beside RSS
    assert "peak_mem_bytes" in steps and "RSS (resident set)" in steps and "42.00 MiB" in steps


def test_memory_requests_with_bad_arguments_are_one_line(lab_memory):
    import urllib.request

    server, _ = lab_memory

    def error(query: str) -> tuple[int, str]:
        req = urllib.request.Request(f"{server.url}/workbench/api/memory/timeline?path=memdemo&{query}",
                                     headers={"Authorization": f"token {server.token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, ""
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]

    assert error("step=x") == (400, "step='x' is not an integer; pass e.g. step=2")
    status, msg = error("step=99")
    assert status == 404 and msg.startswith("step 99 is not in this timeline")
    status, msg = error("overlay=../../etc")  # outside the root: as a missing path
    assert status == 404 and "etc" in msg and "\n" not in msg
    status, msg = error("overlay=pprun")  # a run without memory/: not a timeline
    assert status == 422 and msg.startswith("overlay pprun: not a torch memory snapshot")
    status, body = server.api("/workbench/api/memory/timeline?path=memdemo&rank=peak&overlay=predicted_memdemo")
    assert status == 200 and body["x"] == "step" and body["per_rank"][0]["overlay"]["rank"] == 0
