"""Issue 28, finding 10: tidy outputs, checked on the widget tree (the browser check is in
``test_tidy_views_browser.py``).

* ``KernelCheckView`` showed all 300 passing rows under the headline, and the headline again as the
  table's title (12,586 px). Now: the headline once, a summary per kernel, the failing rows open, the
  per-case counts and the skipped and passing rows folded in ``<details>``, and every table inside a
  bounded, scrolling box.
* ``PPOBatchView`` put its inputs in two fixed rows (five 300 px inputs in the first), so "world size" sat
  behind a horizontal scrollbar. Now one row that wraps, each input as wide as its label and value.
"""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

import ipywidgets as widgets

from tidy_views_fixtures import synthetic_check  # tests/views/tidy_views_fixtures.py
from workbench.rl import plan_ppo_batches
from workbench.widgets import KernelCheckView, PPOBatchView

NOTEBOOK_WIDTH_PX = 900  # a JupyterLab notebook's output area, the narrow end


def _html_of(w: widgets.Widget) -> str:
    """Every HTML widget's markup in the view's tree, in order."""
    if isinstance(w, widgets.HTML):
        return w.value
    return "".join(_html_of(c) for c in getattr(w, "children", ()))


class _Rows(HTMLParser):
    """Each ``<tr>``'s cell texts, whether a folded ``<details>`` hides it, and whether a box of bounded
    height holds its table."""

    def __init__(self, markup: str):
        super().__init__()
        self.rows: list[tuple[list[str], bool, bool]] = []
        self._stack: list[tuple[str, dict]] = []
        self._cells: list[str] | None = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._stack.append((tag, a))
        if tag == "tr":
            self._cells = []
        elif tag in ("td", "th") and self._cells is not None:
            self._cells.append("")

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()[0] == tag:
                break
        if tag == "tr" and self._cells is not None:
            folded = any(t == "details" and "open" not in a for t, a in self._stack)
            bounded = any(t == "div" and "max-height" in (a.get("style") or "") for t, a in self._stack)
            self.rows.append((self._cells, folded, bounded))
            self._cells = None

    def handle_data(self, data):
        if self._cells:
            self._cells[-1] += data


def test_kernel_check_view_summary_first_failures_open_passing_folded():
    check = synthetic_check()  # 300 rows, 18 cases of 6 ops: 295 pass, 2 fail, 3 skipped
    view = KernelCheckView(check)
    markup = _html_of(view.widget)
    assert markup.count(html.escape(check.headline())) == 1, "the headline is shown once"
    rows = _Rows(markup).rows
    detail = [cells for cells, _, _ in rows if len(cells) == 10 and cells[0] != "case"]  # the per-row tables
    assert len(detail) == 300
    shown = [cells for cells, folded, _ in rows if not folded]
    # on show: the summary (a header and one row per kernel) and the failing rows (a header and 2 rows)
    assert len(shown) == (1 + 6) + (1 + 2), f"{len(shown)} rows on show"
    assert [c for c in shown if "3 of 64 elements differ" in c[-1]] == [c for c in detail if c[4] == "fail"]
    folded = [cells for cells, f, _ in rows if f and len(cells) == 10 and cells[0] != "case"]
    assert sorted(c[4] for c in folded) == ["pass"] * 295 + ["skip"] * 3
    assert all(bounded for _, _, bounded in rows), "every table scrolls inside a box of bounded height"
    # the summary names the failing kernel first, with its counts and worst error
    summary = shown[:7]
    assert summary[0][:2] == ["op", "status"] and {c[0] for c in summary[1:]} == {
        "index_put", "masked_fill", "mask_select", "mask_assign", "set_value", "dropout_add"}
    assert summary[1][:2] == ["dropout_add", "fail"] and summary[1][5] == "2" and summary[1][7] == "0.5"
    # each section says what it holds, on one line
    assert re.findall(r"<summary>([^<]*)</summary>", markup) == ["2 failing rows", "18 cases", "3 skipped rows",
                                                                  "295 passing rows"]


def test_kernel_check_view_all_passing_is_a_few_lines():
    check = synthetic_check(failing=0, skipped=0)
    view = KernelCheckView(check)
    assert view.controls["op"].label == "all ops" and view.controls["status"].label == "all"  # not blank
    rows = _Rows(_html_of(view.widget)).rows
    assert len([r for r in rows if not r[1]]) == 1 + 6  # the summary alone
    assert re.findall(r"<summary>([^<]*)</summary>", view.table.value) == ["18 cases", "300 passing rows"]
    view.select(status="fail")
    assert view.table.value == "<i>no rows</i>"
    view.select(op="set_value")
    assert view.controls["op"].label == "set_value"
    assert all(c[0].startswith("set_value/") for c, _, _ in _Rows(view.table.value).rows if c[0] != "case")


def _boxes_holding(root: widgets.Widget, targets: set[int]) -> list[widgets.Box]:
    found = []
    for child in getattr(root, "children", ()):
        if id(child) in targets and root not in found:
            found.append(root)
        found += _boxes_holding(child, targets)
    return found


def _lines_at(widths: list[int], line_px: int) -> int:
    """How many lines a wrapping flex row of these widths takes (each input has 2 px margins a side)."""
    lines, used = 1, 0
    for w in widths:
        if used and used + w + 4 > line_px:
            lines, used = lines + 1, 0
        used += w + 4
    return lines


def test_ppo_controls_wrap_within_the_notebook_width():
    view = PPOBatchView(plan_ppo_batches(64, 4, "64 prompts", "4 samples/rank", world_size=8, dp=4, ppo_epochs=2))
    inputs = list(view.inputs.values())
    boxes = _boxes_holding(view.widget, {id(w) for w in inputs})
    assert boxes, "the inputs are in the view"
    for box in boxes:  # a box that does not wrap puts what does not fit behind a scrollbar
        what = f"{type(box).__name__} of {len(box.children)} inputs"
        assert "wrap" in (box.layout.flex_flow or ""), f"{what} does not wrap"
        assert box.layout.overflow in (None, "", "visible")
    widths = []
    for key, w in view.inputs.items():
        assert w.layout.display != "none" and w.layout.visibility != "hidden", key
        m = re.fullmatch(r"(\d+)px", w.layout.width or "")
        assert m, f"{key}: width {w.layout.width!r}, not a fixed width (ipywidgets' default is 300 px)"
        widths.append(int(m.group(1)))
    assert max(widths) <= NOTEBOOK_WIDTH_PX // 3
    assert _lines_at(widths, NOTEBOOK_WIDTH_PX) <= 3
    assert view.inputs["world_size"].value == 8 and view.replan(world_size=16, dp=8).dp == 8
