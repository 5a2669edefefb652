"""Issue 28, finding 8: one memory view. The Lab tab's answer (``workbench.jupyter.timelines``) carries the
notebook view's picture of the same timeline: the same stacked category series, total, phase bands, peak
marker and annotation, prediction overlay, titles and colours (one palette in the core), with 1-2-5 ticks.

Each test compares the server's ``memory/timeline`` answer with ``MemoryTimelineView``'s figure of the same
saved timeline, read back from the figure. On the code before issue 28 the answer had no ``x``, ``stack``,
``marker``, ``y_axis``/``x_axis``, ``palette`` or overlay, its bands were cut at 400 (the view's at 200),
and no core palette module existed: every test here fails there.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from memory_demo import demo_prediction, demo_timeline
from workbench import palette
from workbench.jupyter import timelines
from workbench.memory.timeline import CATEGORIES, PHASES, MemoryTimeline
from workbench.ticks import byte_axis, nice_step, number_axis


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("memtab")
    demo_timeline().save(root / "measured")
    demo_prediction().save(root / "predicted")
    return root


def _answer(root, **kw) -> dict:
    return timelines.timeline_window(root, root / "measured", wait=60, **kw)


def _view(root, **kw):
    from workbench.widgets import MemoryTimelineView

    over = kw.pop("overlay", None)
    return MemoryTimelineView(MemoryTimeline.load(root / "measured"),
                              overlay=None if over is None else MemoryTimeline.load(over), **kw)


def _role(fig, role: str) -> list:
    return [t for t in fig.data if (t.meta or {}).get("role") == role]


def _same_picture(r: dict, answer: dict, view) -> None:
    """The notebook view's figure and one rank of the server's answer draw the same thing."""
    fig = view.fig
    unit = fig.layout.meta["unit"]
    assert r["y_axis"]["unit"] == unit
    scale = r["y_axis"]["scale"]
    cats = _role(fig, "category")
    # the stacked categories, bottom first, each with its palette colour
    assert r["stack"] == [t.name for t in cats]
    for t in cats:
        assert np.allclose(np.asarray(t.x, dtype=float), r["x"])
        assert np.allclose(np.asarray(t.y, dtype=float) * scale, r["categories"][t.name])
        assert t.fillcolor == answer["palette"]["categories"][t.name]
    (total,) = _role(fig, "total")
    assert np.allclose(np.asarray(total.y, dtype=float) * scale, r["total_bytes"])
    assert total.line.color == answer["palette"]["total"]
    # the phase bands: same spans, colours and microbatch shading
    shapes = fig.layout.shapes
    assert len(shapes) == len(r["phases"]) > 0
    for s, b in zip(shapes, r["phases"]):
        assert (s.x0, s.x1, s.fillcolor, s.opacity) == pytest.approx((b["x0"], b["x1"], b["color"], b["opacity"]))
    # the peak: where, how much, and the annotation's two lines
    (peak,) = _role(fig, "peak")
    m = r["marker"]
    assert (peak.x[0], peak.y[0] * scale) == pytest.approx((m["x"], m["bytes"]))
    assert fig.layout.annotations[0].text == "<br>".join(m["label"])
    assert fig.layout.title.text == r["title"]
    assert fig.layout.xaxis.title.text == answer["x_axis"]["title"]
    assert fig.layout.meta["x"] == answer["x"]


def test_the_palette_is_one_and_the_total_is_no_category():
    from workbench.kinds import KIND_COLORS
    from workbench.widgets import memory_view, plan_view

    assert set(CATEGORIES) <= set(palette.CATEGORY_COLORS) and set(palette.PHASE_COLORS) == set(PHASES)
    assert memory_view.CATEGORY_COLORS == {c: palette.CATEGORY_COLORS[c] for c in CATEGORIES}
    assert memory_view.PHASE_COLORS == palette.PHASE_COLORS
    assert plan_view.MEMORY_COLORS == memory_view.CATEGORY_COLORS
    assert all(plan_view.CATEGORY_COLORS[k] == palette.CATEGORY_COLORS[k] for k in plan_view.CATEGORIES)
    assert KIND_COLORS["parameter"] == KIND_COLORS["model"] == palette.CATEGORY_COLORS["parameter"]
    # every category its own colour, and none of them the total's, the overlay's or the peak's
    colours = [palette.CATEGORY_COLORS[c] for c in CATEGORIES]
    assert len(set(colours)) == len(colours)
    assert not {palette.TOTAL_COLOR, palette.OVERLAY_COLOR, palette.PEAK_COLOR} & set(colours)


def test_whole_view_is_the_notebook_views_picture(saved):
    answer = _answer(saved, ranks="peak")
    view = _view(saved)  # the rank with the largest peak, all steps
    assert answer["palette"] == palette.palette()
    assert timelines._job(saved, saved / "measured").progress(10)["palette"] == palette.palette()  # while reading
    (r,) = answer["per_rank"]
    assert r["rank"] == view.rank == 2
    assert r["events"] > answer["points"] >= len(r["t"])  # downsampled, as the view is
    assert r["marker"]["bytes"] == view.fig.layout.meta["peak_bytes"] == r["peak"]["bytes"] == max(r["total_bytes"])
    assert len(r["phases"]) < 271  # 271 spans joined into at most 200 bands, as the view joins them
    _same_picture(r, answer, view)
    # the stack adds up to the total at every point
    assert np.array_equal(np.sum([r["categories"][c] for c in r["stack"]], axis=0), r["total_bytes"])


def test_alive_at_peak_is_the_core_answer(saved):
    tl = MemoryTimeline.load(saved / "measured")
    (r,) = _answer(saved, ranks=[1])["per_rank"]
    p = tl.peak(1)
    assert r["peak"]["by_category"] == p.by_category
    assert r["peak"]["alive"] == tl.alive_at(1, p.index, top=10).to_dict("records")
    assert r["peak"]["modules"] == tl.modules_at_peak(1).head(10).to_dict("records")
    html = _view(saved, rank=1).table.value  # the notebook view's table lists the same allocations
    for a in r["peak"]["alive"][:3]:
        assert a["op"] in html and a["category"] in html


def test_a_step_with_the_prediction_overlay_is_the_notebook_views_picture(saved):
    answer = _answer(saved, ranks=[1], step=3, overlay=saved / "predicted")
    view = _view(saved, rank=1, step=3, overlay=saved / "predicted")
    assert answer["x"] == "step" and answer["overlay"]["source"] == "predicted"  # measured vs predicted: step clock
    (r,) = answer["per_rank"]
    _same_picture(r, answer, view)
    assert r["marker"]["kind"] == "step" and r["marker"]["microbatch"] == -1  # the step's own peak
    (over,) = _role(view.fig, "overlay")
    scale = r["y_axis"]["scale"]
    assert r["overlay"]["rank"] == over.meta["rank"] == 0
    assert r["overlay"]["step"] == 1  # the prediction's last (steady-state) step, drawn at step 3
    assert np.allclose(np.asarray(over.x, dtype=float), r["overlay"]["x"])
    assert np.allclose(np.asarray(over.y, dtype=float) * scale, r["overlay"]["total_bytes"])
    lo, hi = answer["x_axis"]["range"]  # the step's first event to its last, on the step clock
    assert lo == 3.0 and 3.9 < hi < 4.0 and hi == max(r["x"])


def test_a_zoomed_window_keeps_its_axis_and_label_in_step(saved):
    whole = _answer(saved, ranks=[0])
    lo, hi = whole["t_range"]
    t0, t1 = lo + 0.3 * (hi - lo), lo + 0.37 * (hi - lo)
    answer = _answer(saved, ranks=[0], t0=t0, t1=t1)
    (r,) = answer["per_rank"]
    ax = answer["x_axis"]
    assert ax["range"] == [t0, t1] == answer["window"]  # the axis spans exactly the window it names
    a, b = (float(x.replace("\u2212", "-")) for x in ax["window_label"].split(" – "))
    d = len(ax["window_label"].split(" – ")[0].split(".")[1])
    assert abs(a - t0) <= 0.5 * 10 ** -d and abs(b - t1) <= 0.5 * 10 ** -d
    assert all(t0 <= t <= t1 for t in ax["ticks"])
    assert all(t0 <= x <= t1 for x in r["x"][1:]) and r["x"][0] <= t0
    assert r["marker"]["kind"] in ("peak", "window") and t0 <= r["marker"]["x"] <= t1
    # every band drawn overlaps the window, and phases alternate there: more than one band
    assert len(r["phases"]) > 1 and all(b["x1"] >= t0 and b["x0"] <= t1 for b in r["phases"])


def _is_nice(step: float) -> bool:
    mant = step / 10 ** math.floor(math.log10(step))
    return any(math.isclose(mant, m) for m in (1, 2, 5))


def test_ticks_are_1_2_5_steps_in_one_unit():
    ax = byte_axis(457.03 * 2**20)  # the tab's old first tick
    assert ax["unit"] == "MiB" and ax["labels"] == ["0", "100", "200", "300", "400", "500"]
    assert number_axis(0, 4 * 0.7201)["labels"] == ["0", "0.5", "1", "1.5", "2", "2.5"]
    rng = np.random.default_rng(0)
    for _ in range(2000):
        lo = float(rng.uniform(-5, 50)) * 10 ** int(rng.integers(-4, 4))
        span = float(rng.uniform(1e-3, 10)) * 10 ** int(rng.integers(-3, 4))
        ax = number_axis(lo, lo + span)
        assert _is_nice(ax["step"]) and 2 <= len(ax["ticks"]) <= 7, ax
        assert all(math.isclose(b - a, ax["step"], rel_tol=1e-6) for a, b in zip(ax["ticks"], ax["ticks"][1:]))
        for v, label in zip(ax["ticks"], ax["labels"]):
            assert math.isclose(float(label), v, rel_tol=1e-9, abs_tol=ax["step"] * 1e-6)
            assert len(label.split(".")[-1]) <= max(0, -math.floor(math.log10(ax["step"]) + 1e-9)) or "." not in label
        top = float(rng.uniform(1, 1000)) * 1024 ** int(rng.integers(0, 5))
        b = byte_axis(top)
        assert _is_nice(b["step"] / b["scale"]) and b["range"][1] >= top and b["ticks"][0] == 0
        assert b["range"][1] < top + b["step"] * 1.000001  # the axis ends at the first tick above the top
        assert all(float(lbl) * b["scale"] == pytest.approx(v) for v, lbl in zip(b["ticks"], b["labels"]))
    assert nice_step(0) == 1.0 and nice_step(float("nan")) == 1.0


def test_the_answers_axes_are_nice_and_cover_the_data(saved):
    answer = _answer(saved, ranks="peak", overlay=saved / "predicted")
    (r,) = answer["per_rank"]
    y = r["y_axis"]
    assert _is_nice(y["step"] / y["scale"]) and y["ticks"][0] == 0
    assert y["range"][1] >= max(max(r["total_bytes"]), max(r["overlay"]["total_bytes"]))
    assert _is_nice(answer["x_axis"]["step"])
    assert not any(len(lbl.split(".")[-1]) > 3 for lbl in y["labels"] if "." in lbl)  # never 457.03


def test_bad_requests_are_one_line(saved):
    from workbench.jupyter.files import Refused

    with pytest.raises(Refused, match=r"step 99 is not in this timeline"):
        _answer(saved, step=99)
    (saved / "notes.txt").write_text("not a timeline")
    with pytest.raises(Refused) as e:
        _answer(saved, overlay=saved / "notes.txt")
    assert e.value.status == 422 and str(e.value).startswith("overlay ")
