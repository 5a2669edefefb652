"""Issue 28, finding 11, in the JupyterLab checkpoint tab, in a real browser (JupyterLab + Debian's Chromium).

* Compare with… a checkpoint's own Hugging Face export: the verdict says the tensors are equal and which
  kinds only the checkpoint holds, not a red "different".
* The key table keeps shapes and sizes on one line and every column on screen in a narrow window; its
  headers and the summary's labels are words, not snake_case.
* A tensor's statistics are labelled in words, floats to 4 significant digits; the histogram has a log10 |x|
  and a log count toggle.
* The summary's tensor count is the count the tab's Verify checks.

The checkpoint is what ``workbench train`` saves (``ckpt/step-000001``: model, AdamW with packed
hyper-parameters, scheduler, RNG, counters). Skipped, with the reason, where Chromium or Playwright is
missing or the labextension is not installed (``make extension``).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ckpt_views_fixtures import trained_checkpoint
from test_browser import browser, lab_page, start_files_lab  # noqa: F401 (browser: a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

KEY = "optim.state.layers.1.attention.wo.weight.exp_avg_sq"  # values near 1e-9: long raw floats


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not (Path(sys.prefix) / "share/jupyter/labextensions/parallel-workbench-lab/package.json").exists():
        pytest.skip("the labextension is not installed in this environment: run `make extension`")
    from workbench.checkpoint import export, inspect

    base = tmp_path_factory.mktemp("ckpttab")
    root = base / "files"
    root.mkdir()
    step = trained_checkpoint(root / "ckpt")
    export(step, root / "hf", to="hf", progress=False)
    with start_files_lab(root, base) as s:
        yield s, inspect(step)


@pytest.fixture(scope="module")
def page(lab, browser):
    # narrower than a laptop's screen: the key table used to push its last columns off the pane here
    with lab_page(browser, lab[0], width=1100, query="reset&", ready=".jp-DirListing-item[title^='Name: ckpt']") as pg:
        yield pg


# how many lines a cell's text takes: one client rect per line box of its text
_LINES = "td => { const r = document.createRange(); r.selectNodeContents(td); return r.getClientRects().length; }"


def _menu(page, name: str, item: str) -> None:
    page.locator(f".jp-DirListing-item[title^='Name: {name}']").click(button="right")
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def _tab(page):
    tab = page.locator(".jp-MainAreaWidget.pw-document:not(.lm-mod-hidden)").last
    tab.wait_for(timeout=20_000)
    return tab


def _open_checkpoint(page):
    _menu(page, "ckpt", "Open in Workbench")
    tab = _tab(page)  # (a tab already open on it is brought to the front, its filter as it was left)
    tab.locator("tr.pw-clickable").first.wait_for(timeout=30_000)
    return tab


def _shot(page, tmp_path: Path, name: str) -> None:
    out = Path(os.environ.get("WORKBENCH_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / f"lab-checkpoint-{name}.png"))


def test_compare_with_its_own_export_is_not_different(page, tmp_path):
    _menu(page, "ckpt", "Compare with")
    box = page.locator(".jp-Dialog input")
    box.wait_for(timeout=10_000)
    box.fill("hf")
    page.locator(".jp-Dialog .jp-mod-accept").click()
    verdict = _tab(page).locator(".pw-verdict")
    verdict.wait_for(timeout=60_000)
    text = verdict.inner_text()
    assert text.startswith("tensors equal: 48 of 48 compared"), text
    assert "only in A:" in text and "rng 3" in text and "different" not in text
    assert "pw-error" not in (verdict.get_attribute("class") or "")  # not the red banner
    _shot(page, tmp_path, "diff")


def test_key_table_keeps_shapes_and_sizes_on_one_line_and_every_column_on_screen(page, tmp_path):
    tab = _open_checkpoint(page)
    keys = tab.locator(".pw-keys")
    table = keys.locator("table.pw-table").first
    headers = table.locator("thead th").all_inner_texts()
    assert headers == ["key", "dtype", "shape", "kind", "size", "shards"], headers
    row = table.locator("tr.pw-clickable", has_text="model.layers.0.feed_forward.w1.weight").first
    cells = row.locator("td")
    assert cells.nth(2).inner_text() == "384 × 128" and cells.nth(4).inner_text() == "192.00 KiB"
    for i in (2, 4):  # shape, size: one line box each (a row's cells share its height: count the text's lines)
        assert cells.nth(i).evaluate("td => getComputedStyle(td).whiteSpace") == "nowrap"
        assert cells.nth(i).evaluate(_LINES) == 1
    # no column pushed off the pane: the table fits its box, a long key breaks instead
    fits = keys.evaluate("k => [k.scrollWidth, k.clientWidth]")
    assert fits[0] <= fits[1] + 1, fits
    summary = tab.locator(".pw-summary").first
    labels = summary.locator("th").all_inner_texts()
    assert "tensors" in labels and "total size" in labels and not any("_" in t for t in labels), labels
    _shot(page, tmp_path, "keys")


def test_statistics_labels_floats_and_log_toggles(page, lab, tmp_path):
    tab = _open_checkpoint(page)
    tab.locator("input.pw-filter").fill(KEY)
    tab.locator("tr.pw-clickable", has_text=KEY).first.click()
    detail = tab.locator(".pw-detail")
    detail.locator("rect.pw-bar").first.wait_for(timeout=30_000)
    rows = dict(zip(detail.locator("table.pw-summary th").all_inner_texts(),
                    detail.locator("table.pw-summary td").all_inner_texts()))
    assert "mean |x|" in rows and "non-finite" in rows and not any("_" in k for k in rows), rows
    assert rows["elements"] == "16,384"
    for k in ("min", "max", "mean", "std", "mean |x|", "L2 norm"):
        digits = re.sub(r"e[+-]\d+$", "", rows[k]).lstrip("-").replace(".", "").lstrip("0")
        assert len(digits) <= 4, (k, rows[k])
    chart = detail.locator(".pw-chart svg")
    linear = chart.locator("rect.pw-bar").evaluate_all("rs => rs.map(r => Number(r.getAttribute('height')))")
    detail.locator("input.pw-log-count").check()
    detail.locator(".pw-chart svg[data-count-scale='log']").wait_for(timeout=10_000)
    logged = detail.locator("rect.pw-bar").evaluate_all("rs => rs.map(r => Number(r.getAttribute('height')))")
    small = [i for i, h in enumerate(linear) if 0 < h < max(linear) / 10]
    assert small and all(logged[i] > linear[i] for i in small)  # the short bars grow on a log count axis
    detail.locator("input.pw-log-x").check()
    detail.locator(".pw-chart-title", has_text="log10 |x|").wait_for(timeout=30_000)
    assert detail.locator("input.pw-log-count").is_checked()  # the count axis stays log
    _shot(page, tmp_path, "histogram")


def test_summary_count_is_what_verify_checks(page, lab):
    _, manifest = lab
    tab = _open_checkpoint(page)
    shown = tab.locator(".pw-summary td[data-key='n_tensors']").first.inner_text()
    assert shown == str(manifest.summary()["n_tensors"]) == "201"
    _menu(page, "ckpt", "Verify checkpoint")
    tab = _tab(page)
    tab.locator(".pw-verdict").wait_for(timeout=30_000)
    checked = tab.locator("th", has_text=re.compile(r"^tensors$")).first.locator("xpath=following-sibling::td[1]")
    assert checked.inner_text() == shown
