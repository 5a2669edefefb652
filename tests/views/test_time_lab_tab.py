"""Issue 33, part 4, in a real browser (JupyterLab + Debian's Chromium): a double-click on a profiler trace
(``*.pt.trace.json.gz``) opens the step-time tab with no kernel: one row per rank, bars in the categories'
colours, the per-rank totals, and a step picker that redraws another step.

The trace is a real CPU profile of three training steps (tests/test_jupyter_time.py makes it). Skipped, with
the reason, where Chromium or Playwright is missing, the labextension is not installed (``make
extension``) or the trace reader is missing.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from pathlib import Path

import pytest

from test_browser import browser, lab_page, start_files_lab  # noqa: F401 (browser: a fixture)
from test_jupyter_time import _profile

pytest.importorskip("workbench.time.trace", reason="the trace reader (issue 33, H-trace) is not installed")
pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not (Path(sys.prefix) / "share/jupyter/labextensions/parallel-workbench-lab/package.json").exists():
        pytest.skip("the labextension is not installed in this environment: run `make extension`")
    base = tmp_path_factory.mktemp("timetab")
    root = base / "files"
    root.mkdir()
    raw = base / "raw.pt.trace.json"
    _profile(raw)
    with open(raw, "rb") as a, gzip.open(root / "host_1.pt.trace.json.gz", "wb") as b:
        shutil.copyfileobj(a, b)
    with start_files_lab(root, base) as s:
        yield s


@pytest.fixture(scope="module")
def page(lab, browser):  # noqa: F811 (the fixture imported above)
    with lab_page(browser, lab, query="reset&", ready=".jp-DirListing-item[title^='Name: host_1']") as pg:
        yield pg


def test_a_trace_opens_in_the_step_time_tab_without_a_kernel(page):
    from workbench.palette import TIME_COLORS

    page.locator(".jp-DirListing-item[title^='Name: host_1.pt.trace.json.gz']").dblclick()
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.locator(".pw-gantt rect").first.wait_for(timeout=30_000)
    assert tab.locator(".pw-view").get_attribute("data-kind") == "time"
    text = tab.inner_text()
    assert "rank 0" in text and "where each rank's time goes, step 2" in text and "step (ms)" in text
    fills = set(tab.locator(".pw-gantt rect").evaluate_all("rs => rs.map(r => r.getAttribute('fill'))"))
    assert {TIME_COLORS["forward"], TIME_COLORS["backward"]} <= fills
    assert page.locator(".jp-Notebook").count() == 0  # no notebook, no kernel: the tab is the server's answer
    if os.environ.get("WORKBENCH_SCREENSHOTS"):  # the README's screenshots, when asked for
        page.screenshot(path=str(Path(os.environ["WORKBENCH_SCREENSHOTS"]) / "lab-time.png"))
    tab.locator("select.pw-time-step").select_option("0")
    tab.locator("text=where each rank's time goes, step 0").wait_for(timeout=20_000)
    tab.locator("select.pw-time-step").select_option("-1")
    tab.locator("text=where each rank's time goes, every step").wait_for(timeout=20_000)
