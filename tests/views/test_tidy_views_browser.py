"""Issue 28, finding 10, in a real browser: JupyterLab + Debian's Chromium, the notebook output ~900 px wide.

* ``KernelCheckView`` of a 300-row check (2 failing, 3 skipped): the output is one screen, not 12,586 px;
  the headline shows once; the failing rows are on show and the passing rows are not.
* ``PPOBatchView``: no horizontal scrollbar anywhere in its output, and every input (label and field,
  "world size" included) lies inside the output area, its label not cut short.

Reuses ``tests/test_browser.py``'s JupyterLab server and Chromium fixtures (skipped, with the reason,
where Chromium or Playwright is missing). Screenshots: ``kernel-check.png``, ``ppo-controls.png`` in the
test's tmp_path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_browser import (_dump_on_failure, _open_notebook, _run_cell, browser, lab, page,  # noqa: F401  (fixtures)
                          write_notebook)
from tidy_views_fixtures import synthetic_check

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
NOTEBOOK = "tidy_views.ipynb"
OUTPUT_WIDTH_PX = 900
CELLS = [
    f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom tidy_views_fixtures import synthetic_check\n"
    "from workbench.widgets import KernelCheckView\nKernelCheckView(synthetic_check())",
    "from workbench.rl import plan_ppo_batches\nfrom workbench.widgets import PPOBatchView\n"
    "PPOBatchView(plan_ppo_batches(64, 4, '64 prompts', '4 samples/rank', world_size=8, dp=4, ppo_epochs=2,\n"
    "                              total_prompts=6400))",
]

# Every element in the output that scrolls sideways (its content wider than its box, and not clipped on
# purpose), and the output's own size.
_OVERFLOW_JS = """(out) => {
  const wide = [];
  for (const el of [out, ...out.querySelectorAll('*')]) {
    const s = getComputedStyle(el);
    if (el.scrollWidth > el.clientWidth + 1 && ['auto', 'scroll'].includes(s.overflowX))
      wide.push(`${el.tagName}.${el.className} ${el.scrollWidth}>${el.clientWidth}`);
  }
  const r = out.getBoundingClientRect();
  return {wide, width: r.width, height: r.height, left: r.left, right: r.right};
}"""

# Each input of the form: its label's text, whether the label shows all of it, and where label and field lie.
_INPUTS_JS = """(form) => Array.from(form.children).map(w => {
  const labels = Array.from(w.querySelectorAll('label, span'));
  const field = w.querySelector('input:not([type=checkbox])');
  const box = (el) => { const r = el.getBoundingClientRect(); return {left: r.left, right: r.right, width: r.width}; };
  return {text: w.innerText.trim(), label_whole: labels.every(l => l.scrollWidth <= l.clientWidth + 1),
          widget: box(w), field: field ? box(field) : null};
})"""


def test_kernel_check_and_ppo_views_fit_the_notebook(lab, page, tmp_path):
    from playwright.sync_api import expect

    write_notebook(lab.root / NOTEBOOK, CELLS)
    check = synthetic_check()
    try:
        cells = _open_notebook(page, lab, NOTEBOOK)
        # Make the output area OUTPUT_WIDTH_PX wide: the editor is as wide as the output area beside the prompt.
        editor_w = cells.first.locator(".jp-InputArea-editor").bounding_box()["width"]
        page.set_viewport_size({"width": int(1400 - (editor_w - OUTPUT_WIDTH_PX)), "height": 1000})
        page.wait_for_timeout(500)
        for k in range(len(CELLS)):
            _run_cell(page, cells.nth(k))

        out = cells.nth(0).locator(".jp-OutputArea-executeResult .jp-OutputArea-output")
        expect(out.get_by_text("per kernel")).to_be_visible(timeout=120_000)
        assert not out.get_by_text("Error displaying widget").count(), "a widget failed to render"
        geo = out.evaluate(_OVERFLOW_JS)
        print(f"KernelCheckView output: {geo['width']:.0f} x {geo['height']:.0f} px")
        assert abs(geo["width"] - OUTPUT_WIDTH_PX) < 60, geo
        assert geo["height"] < 1000, f"the check's view is {geo['height']:.0f} px tall"
        text = out.inner_text()  # what is rendered: a folded <details> keeps its rows out of it
        assert text.count(check.headline()) == 1, "the headline is shown once"
        assert text.count("3 of 64 elements differ") == 2, "the failing rows are on show"
        assert "295 passing rows" in text and "18 cases" in text and "variant-0" not in text
        visible_rows = out.locator("tr:visible").count()
        assert visible_rows == (1 + 6) + (1 + 2), f"{visible_rows} table rows on show"  # per kernel; failures
        out.screenshot(path=str(tmp_path / "kernel-check.png"))

        out = cells.nth(1).locator(".jp-OutputArea-executeResult .jp-OutputArea-output")
        form = out.locator(".wb-ppo-form")
        expect(form).to_be_visible(timeout=120_000)
        geo = out.evaluate(_OVERFLOW_JS)
        inputs = form.evaluate(_INPUTS_JS)
        print(f"PPOBatchView output: {geo['width']:.0f} x {geo['height']:.0f} px; inputs: "
              + ", ".join(f"{i['text']} {i['widget']['width']:.0f} px (field "
                          f"{i['field']['width'] if i['field'] else 0:.0f})" for i in inputs))
        assert not geo["wide"], f"scrolls sideways: {geo['wide']}"
        assert len(inputs) == 9 and {"world size", "whole prompt groups"} <= {i["text"] for i in inputs}
        for i in inputs:
            assert geo["left"] - 1 <= i["widget"]["left"] and i["widget"]["right"] <= geo["right"] + 1, i
            assert i["label_whole"], f"the label {i['text']!r} is cut short"
            assert i["field"] is None or i["field"]["width"] >= 40, f"{i['text']!r}: a field too narrow to read"
        world = form.get_by_text("world size", exact=True)
        world.scroll_into_view_if_needed()
        expect(world).to_be_in_viewport()
        form.screenshot(path=str(tmp_path / "ppo-controls.png"))
    except Exception:
        _dump_on_failure(page, lab)
        raise
