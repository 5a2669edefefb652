"""ShardingPlanView in a real browser at 8, 1024 and 8192 ranks: JupyterLab + Debian's Chromium.

Reuses ``test_browser``'s JupyterLab server and Chromium fixtures (skipped, with the reason, where
Chromium or Playwright is missing). For each size a one-cell notebook shows the view; the test waits for
the mesh and tensor plots, screenshots the output (``plan-<ranks>.png`` in the test's tmp_path) and reads
each plot's pixels back: neither is blank (a sliver or an empty panel would be nearly all white) and
each shows many colours (the continuous block scale, not ten repeating ones).
"""

from __future__ import annotations

import base64
import json

import pytest

import test_browser as tb  # tests/test_browser.py: its fixtures and helpers

# The fixtures, by assignment so pytest finds them in this module.
lab, browser, page = tb.lab, tb.browser, tb.page

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]

LAYOUTS = {
    8: ("tiny", "pp=2, dp_shard=2, tp=2"),
    1024: ("llama-70b", "dp_shard=128, tp=8"),
    8192: ("llama-70b", "dp_shard=1024, tp=8"),
}

# Pixels of a PNG, counted in the page itself (no image library needed here): the share that is not
# white, and how many distinct colours there are.
_INK_JS = """async (b64) => {
  const img = new Image();
  img.src = 'data:image/png;base64,' + b64;
  await img.decode();
  const c = document.createElement('canvas');
  c.width = img.width; c.height = img.height;
  const ctx = c.getContext('2d');
  ctx.drawImage(img, 0, 0);
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  let ink = 0;
  for (let i = 0; i < d.length; i += 4) {
    const k = (d[i] << 16) | (d[i + 1] << 8) | d[i + 2];
    if (k !== 0xffffff) ink++;
    if (seen.size < 5000) seen.add(k);
  }
  return {width: c.width, height: c.height, ink: ink / (d.length / 4), colours: seen.size};
}"""


def _source(model: str, layout: str) -> str:
    return ("import workbench\n"
            "from workbench.config import ParallelConfig\n"
            "from workbench.widgets import ShardingPlanView\n"
            f"ShardingPlanView(workbench.plan({model!r}, ParallelConfig({layout})))")


def _pixels(page, locator) -> dict:
    png = locator.screenshot()
    return page.evaluate(_INK_JS, base64.b64encode(png).decode())


@pytest.mark.parametrize("ranks", sorted(LAYOUTS))
def test_plan_view_renders_legibly_in_jupyterlab(browser, lab, page, tmp_path, ranks):
    from playwright.sync_api import expect

    model, layout = LAYOUTS[ranks]
    name = f"plan_view_{ranks}.ipynb"
    (lab.root / name).write_text(json.dumps(tb._notebook(_source(model, layout)), indent=1))
    try:
        cells = tb._open_notebook(page, lab, name)
        tb._run_cell(page, cells.first)
        output = cells.first.locator(".jp-OutputArea-executeResult .jp-OutputArea-output")  # not stderr
        mesh = output.locator(".js-plotly-plot").filter(has_text="Mesh:")
        tensor = output.locator(".js-plotly-plot").filter(has_text="distinct block")
        expect(mesh).to_be_visible(timeout=120_000)
        expect(tensor).to_be_visible(timeout=30_000)
        assert not output.get_by_text("Error displaying widget").count(), "a widget failed to render"
        expect(mesh).to_contain_text(f"{ranks:,} ranks")
        # Both plots carry the block colour bar, and draw something: the mesh as heatmap cells, the
        # tensor as filled blocks or (8192 ranks: 8000 blocks) as a raster.
        expect(mesh.locator(".colorbar")).to_have_count(1)
        expect(mesh.locator(".heatmaplayer image")).not_to_have_count(0)
        drawn = tensor.locator(".heatmaplayer image, .scatterlayer .js-fill")
        expect(drawn.first).to_be_attached(timeout=10_000)
        mesh.scroll_into_view_if_needed()
        output.screenshot(path=str(tmp_path / f"plan-{ranks}.png"))

        box = mesh.locator(".nsewdrag").first.bounding_box()  # the mesh's plot area: not a sliver
        assert box and box["height"] >= 40 and box["width"] >= 200, box
        for label, plot in (("mesh", mesh), ("tensor", tensor)):
            px = _pixels(page, plot)
            print(f"{ranks} ranks, {label}: {px}")
            assert px["ink"] > 0.08, f"the {label} plot is nearly blank at {ranks} ranks: {px}"
            assert px["colours"] > 20, f"the {label} plot shows too few colours at {ranks} ranks: {px}"
    except Exception:
        tb._dump_on_failure(page, lab)
        raise
