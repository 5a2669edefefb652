"""MemoryTimelineView, compare() and MemoryComparisonView without a browser: read back from the figures.

The hand-made timeline has two ranks with known numbers (rank 1 is rank 0 with every size doubled)::

    rank 0   t    delta  category    phase      step mb  total
             0.0  +1000  parameter   build      -1  -1   1000
             1.0   +400  activation  forward     0   0   1400
             1.5   +200  activation  forward     0   1   1600
             2.0   +300  gradient    backward    0   1   1900   <- step 0's peak
             2.5   -200  activation  backward    0   1   1700
             3.0   -400  activation  backward    0   0   1300
             3.5   +600  optimizer   optimizer   0  -1   1900
             4.0   -300  gradient    optimizer   0  -1   1600
             5.0   +500  activation  forward     1   0   2100
             6.0   +100  temporary   backward    1   0   2200   <- the peak
             6.5   -100  temporary   backward    1   0   2100
             7.0   -500  activation  backward    1   0   1600

The prediction simulates rank 0 only, in event positions, and its rank_map sends both ranks to it.
"""

from __future__ import annotations

import json
import math
import re
import time

import numpy as np
import pandas as pd
import pytest

from workbench.display import view_for
from workbench.memory.comparison import MemoryComparison, compare, matching_rank, matching_step
from workbench.memory.timeline import CATEGORIES, MemoryTimeline, TimelineBuilder
from workbench.units import format_bytes
from workbench.widgets import MemoryComparisonView, MemoryTimelineView
from workbench.widgets.memory_view import CATEGORY_COLORS, PHASE_COLORS

EVENTS = [  # t, delta, category, phase, step, microbatch, module, op, id
    (0.0, 1000, "parameter", "build", -1, -1, "", "aten::empty", 1),
    (1.0, 400, "activation", "forward", 0, 0, "layers.0", "aten::mm", 2),
    (1.5, 200, "activation", "forward", 0, 1, "layers.1", "aten::mm", 3),
    (2.0, 300, "gradient", "backward", 0, 1, "layers.1", "aten::mm", 4),
    (2.5, -200, "activation", "backward", 0, 1, "layers.1", "(free)", 3),
    (3.0, -400, "activation", "backward", 0, 0, "layers.0", "(free)", 2),
    (3.5, 600, "optimizer", "optimizer", 0, -1, "", "aten::zeros", 5),
    (4.0, -300, "gradient", "optimizer", 0, -1, "", "(free)", 4),
    (5.0, 500, "activation", "forward", 1, 0, "layers.0", "aten::mm", 6),
    (6.0, 100, "temporary", "backward", 1, 0, "layers.0", "aten::add", 7),
    (6.5, -100, "temporary", "backward", 1, 0, "layers.0", "(free)", 7),
    (7.0, -500, "activation", "backward", 1, 0, "layers.0", "(free)", 6),
]
PREDICTED = [  # one step per event group, in event positions; peak 2000 in step 1
    (0, 1000, "parameter", "build", -1, -1, "", "aten::empty", 1),
    (1, 400, "activation", "forward", 0, 0, "layers.0", "aten::mm", 2),
    (2, -400, "activation", "backward", 0, 0, "layers.0", "(free)", 2),
    (3, 600, "optimizer", "optimizer", 0, -1, "", "aten::zeros", 3),
    (4, 400, "activation", "forward", 1, 0, "layers.0", "aten::mm", 4),
    (5, -400, "activation", "backward", 1, 0, "layers.0", "(free)", 4),
]


def _timeline(rows, ranks=(0, 1), source="measured", **kw) -> MemoryTimeline:
    parts = []
    for r in ranks:
        b = TimelineBuilder(rank=r)
        for t, d, *rest in rows:
            b.add(float(t), d * (r + 1), *rest[:6], rest[6] + 100 * r)
        parts.append(b.timeline(source=source))
    tl = MemoryTimeline.concat(parts, source=source)
    tl.meta.update(kw)
    return tl


@pytest.fixture(scope="module")
def measured() -> MemoryTimeline:
    return _timeline(EVENTS)


@pytest.fixture(scope="module")
def predicted() -> MemoryTimeline:
    return _timeline(PREDICTED, ranks=(0,), source="predicted", rank_map={"0": 0, "1": 0})


def _traces(fig, role: str) -> list:
    return [t for t in fig.data if (t.meta or {}).get("role") == role]


# -- the core queries the view stands on --------------------------------------------------------------

def test_core_answers_the_view_needs(measured):
    assert measured.peak().rank == 1 and measured.peak(0).bytes == 2200
    # a step's events still count what was alive before it (the parameter), unlike select(step=)
    ds = measured.downsample(0, step=1)
    assert ds["t"].tolist() == [5.0, 6.0, 6.5, 7.0]
    assert ds["parameter"].tolist() == [1000] * 4 and ds["optimizer"].tolist() == [600] * 4
    assert ds["total_bytes"].tolist() == [2100, 2200, 2100, 1600]
    assert (ds[list(CATEGORIES)].sum(axis=1) == ds["total_bytes"]).all()

    spans = measured.phase_spans(0)
    assert len(spans) == 8  # build; step 0: fwd mb0, fwd mb1, bwd mb1, bwd mb0, opt; step 1: fwd, bwd
    assert measured.phase_spans(0, step=1)[["phase", "t0", "t1"]].values.tolist() == [
        ["forward", 5.0, 5.0], ["backward", 6.0, 7.0]]
    joined = measured.phase_spans(0, max_spans=7)  # microbatches joined: 6 runs of (phase, step)
    assert joined[["phase", "step", "microbatch"]].values.tolist() == [
        ["build", -1, -1], ["forward", 0, -1], ["backward", 0, -1], ["optimizer", 0, -1], ["forward", 1, 0],
        ["backward", 1, 0]]
    assert len(measured.phase_spans(0, max_spans=3)) <= 3

    # step clock: a step's first event is its number, the last step ends at its last event
    assert measured.step_progress(0, [0.0, 1.0, 3.0, 5.0, 6.0, 7.0]).tolist() == [0.0, 0.0, 0.5, 1.0, 1.5, 2.0]


def test_phase_spans_stay_bounded_for_a_long_run():
    # 3000 steps of (forward, backward), 2 events each, over t = 0..12000; then one checkpoint phase
    # until t = 24000. Joining across steps still leaves 6001 spans, so time is cut into 50 slices:
    # forward and backward share each early slice half and half, so none gets a band (drawing either
    # would be a lie); the checkpoint fills the late slices and becomes one band.
    n = 12_000
    i = np.arange(n)
    frame = pd.DataFrame({
        "rank": 0, "t": np.r_[i, 12_000, 24_000].astype(float),
        "delta_bytes": np.r_[np.where(i % 2 == 0, 8, -8), 64, -64],
        "total_bytes": np.r_[np.where(i % 2 == 0, 8, 0), 64, 0], "category": "activation",
        "phase": [*np.where((i // 2) % 2 == 0, "forward", "backward"), "checkpoint", "checkpoint"],
        "step": np.r_[i // 4, -1, -1], "microbatch": 0, "module": "", "op": "aten::mm", "id": np.r_[i // 2, n, n]})
    tl = MemoryTimeline(frame)
    assert len(tl.phase_spans(0)) == 6001
    bands = tl.phase_spans(0, max_spans=50)
    assert bands[["phase", "t0", "t1"]].values.tolist() == [["checkpoint", 12_000.0, 24_000.0]]
    assert len(tl.phase_spans(0, step=7, max_spans=50)) == 2  # one step: every span, nothing joined
    with pytest.raises(ValueError, match="at least 1 span"):
        tl.phase_spans(0, max_spans=0)


# -- the timeline view --------------------------------------------------------------------------------

def test_view_draws_categories_total_peak_and_bands(measured):
    view = MemoryTimelineView(measured)
    assert view.rank == 1  # the rank with the largest peak comes first
    peak = measured.peak()
    meta = view.fig.layout.meta
    assert meta["peak_bytes"] == peak.bytes == 4400 and meta["rank"] == 1 and meta["unit"] == "KiB"

    cats = _traces(view.fig, "category")
    assert [t.name for t in cats] == ["parameter", "gradient", "optimizer", "activation", "temporary"]
    assert [t.fillcolor for t in cats] == [CATEGORY_COLORS[t.name] for t in cats]
    assert all(t.stackgroup == "bytes" for t in cats)
    ds = measured.downsample(1)
    act = next(t for t in cats if t.name == "activation")
    assert np.allclose(np.asarray(act.y) * 1024, ds["activation"])
    (total,) = _traces(view.fig, "total")
    assert max(total.y) * 1024 == pytest.approx(4400)

    (marker,) = _traces(view.fig, "peak")
    assert (marker.x[0], marker.y[0] * 1024) == (6.0, pytest.approx(4400))
    (note,) = view.fig.layout.annotations
    assert f"peak {format_bytes(4400)}" in note.text and "backward, step 1, microbatch 0" in note.text

    shapes = view.fig.layout.shapes
    assert len(shapes) == meta["bands"] == len(measured.phase_spans(1))
    assert {s.fillcolor for s in shapes} == {PHASE_COLORS[p] for p in ("build", "forward", "backward", "optimizer")}
    assert sorted(s.name for s in shapes if s.showlegend) == ["backward", "build", "forward", "optimizer"]
    assert all(s.layer == "below" and s.yref == "paper" for s in shapes)

    # what is alive at the peak: the largest allocations, then by module
    table = view.table.value
    assert "Alive at rank 1's peak" in table
    rows = re.findall(r"<tr><td style='text-align:right'>([^<]+)</td><td>([a-z]+)</td>", table)
    assert rows[:4] == [(format_bytes(2000), "parameter"), (format_bytes(1200), "optimizer"),
                        (format_bytes(1000), "activation"), (format_bytes(200), "temporary")]
    assert "<td>layers.0</td><td style='text-align:right'>" + format_bytes(1200) in table  # 1000 + 200, 2 allocations


def test_rank_selector_switches_traces(measured):
    view = MemoryTimelineView(measured, rank=1)
    view.controls["rank"].value = 0  # what the dropdown does
    assert view.rank == 0 and view.fig.layout.meta["rank"] == 0
    assert view.fig.layout.meta["peak_bytes"] == measured.peak(0).bytes == 2200
    (total,) = _traces(view.fig, "total")
    assert np.allclose(np.asarray(total.y) * 1024, measured.downsample(0)["total_bytes"])
    assert "Rank 0" in view.fig.layout.title.text
    with pytest.raises(ValueError, match=r"rank 5 is not in this timeline; it has ranks \[0, 1\]"):
        view.select_rank(5)


def test_step_selector_zooms_to_one_step(measured):
    view = MemoryTimelineView(measured, rank=0)
    view.controls["step"].value = 0
    assert view.step == 0 and view.fig.layout.meta["step"] == 0
    (total,) = _traces(view.fig, "total")
    assert list(total.x) == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    param = next(t for t in _traces(view.fig, "category") if t.name == "parameter")
    assert np.allclose(np.asarray(param.y) * 1024, 1000)  # alive from before the step, still counted
    assert view.fig.layout.meta["peak_bytes"] == 1900  # the step's own peak (first reached at t=2.0)
    assert _traces(view.fig, "peak")[0].x[0] == 2.0
    assert "backward, step 0" in view.fig.layout.annotations[0].text
    assert {s.name for s in view.fig.layout.shapes} == {"forward", "backward", "optimizer"}
    view.controls["step"].value = -1  # "all steps"
    assert view.step is None and view.fig.layout.meta["peak_bytes"] == 2200
    with pytest.raises(ValueError, match=r"step 9 is not in this timeline; it has steps \[0, 1\]"):
        view.select_step(9)


def test_small_multiples_one_panel_per_rank_capped(measured):
    view = MemoryTimelineView(measured, mode="ranks")
    assert view.rank_box.layout.display == "none" and view.grid_box.layout.display == ""
    totals = _traces(view.grid_fig, "total")
    assert [t.meta["rank"] for t in totals] == [0, 1]
    assert len({t.yaxis for t in totals}) == 2 and view.grid_fig.layout.yaxis2.matches == "y"  # one y axis
    assert [a.text for a in view.grid_fig.layout.annotations] == [f"rank 0: peak {format_bytes(2200)}",
                                                                  f"rank 1: peak {format_bytes(4400)}"]
    view.controls["rank"].value = 0  # picking a rank shows it alone
    assert view.mode == "rank" and view.rank_box.layout.display == ""

    many = _timeline(EVENTS[:4], ranks=range(20))
    grid = MemoryTimelineView(many, mode="ranks", max_ranks=16)
    assert len(_traces(grid.grid_fig, "total")) == 16 and grid.grid_ranks == list(range(16))
    assert "first 16 of 20 ranks" in grid.note.value


def test_prediction_overlay_is_dashed_on_a_step_clock(measured, predicted):
    view = MemoryTimelineView(measured, overlay=predicted, rank=1)
    assert view.x == "step"  # measured seconds against predicted positions: both on the step clock
    (over,) = _traces(view.fig, "overlay")
    assert over.line.dash == "dash" and over.meta["rank"] == 0  # rank 1 is predicted by rank 0 (rank_map)
    # aligned by phase (workbench.memory.clock): each predicted event lands in the measured band of its own
    # (step, microbatch, phase): step 0's forward at 0, its backward where the measured backward of
    # microbatch 0 starts (t=3.0 -> 0.5), its optimizer on the measured optimizer (t=3.5 -> 0.625); step 1
    # likewise (t=5.0 -> 1.0, t=6.0 -> 1.5)
    assert list(over.x) == [0.0, 0.0, 0.5, 0.625, 1.0, 1.5]
    (total,) = _traces(view.fig, "total")
    assert min(total.x) == 0.0 and max(total.x) == 2.0  # measured steps 0 and 1 on the same clock
    assert "step" in view.fig.layout.xaxis.title.text
    assert "dashed: <b>predicted</b>" in view.header.value

    # zoomed to a step, the prediction's same step is drawn over it
    view.select_step(1)
    (over,) = _traces(view.fig, "overlay")
    assert list(over.x) == [1.0, 1.5] and max(over.y) * 1024 == pytest.approx(2000)

    # small multiples carry the overlay too, one per rank
    view.show("ranks")
    assert [t.meta["rank"] for t in _traces(view.grid_fig, "overlay")] == [0, 1]
    # same source: plain time
    assert MemoryTimelineView(measured, overlay=measured).x == "time"


def test_to_html_is_one_offline_file(measured, predicted, tmp_path):
    view = MemoryTimelineView(measured, overlay=predicted)
    path = view.to_html(tmp_path / "memory.html")
    text = path.read_text()
    assert re.findall(r"<script[^>]*\bsrc=", text) == []  # nothing loaded from anywhere, no CDN
    assert "https://cdn.plot.ly/plotly" not in text
    assert "Plotly.newPlot" in text and len(text) > 1_000_000  # plotly.js itself is inlined
    assert "Alive at rank 1" in text
    view.show("ranks")  # the small multiples, as they are shown
    text = view.to_html(tmp_path / "ranks.html").read_text()
    assert re.findall(r"<script[^>]*\bsrc=", text) == [] and f"rank 1: peak {format_bytes(4400)}" in text


def test_display_registry_picks_the_views(measured, predicted):
    assert isinstance(view_for(measured), MemoryTimelineView)
    assert isinstance(view_for(compare(measured, predicted)), MemoryComparisonView)
    bundle = MemoryTimelineView(measured)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_a_million_events_plot_bounded_points():
    n, steps = 1_000_000, 1000  # 1000 steps x 4 microbatches x (forward, backward): 8000 phase spans
    per = n // steps
    pos = np.arange(n) % per
    half = per // 2
    sizes = (np.arange(n // 2) % 97 + 1) * 4096
    delta = np.empty(n, dtype=np.int64)
    ids = np.empty(n, dtype=np.int64)
    for_step = np.arange(n).reshape(steps, per)
    alloc, free = for_step[:, :half].ravel(), for_step[:, half:][:, ::-1].ravel()  # freed in reverse order
    delta[alloc], delta[free] = sizes, -sizes
    ids[alloc], ids[free] = np.arange(n // 2), np.arange(n // 2)
    frame = pd.DataFrame({
        "rank": 0, "t": np.arange(n) * 1e-5, "delta_bytes": delta, "total_bytes": np.cumsum(delta),
        "category": pd.Categorical.from_codes((ids % 3 == 0).astype(np.int8) + 3, CATEGORIES),
        "phase": np.where(pos < half, "forward", "backward"), "step": np.arange(n) // per,
        "microbatch": (pos % half) * 4 // half, "module": "layers.0", "op": "aten::mm", "id": ids})
    tl = MemoryTimeline(frame)

    start = time.perf_counter()
    view = MemoryTimelineView(tl, max_points=2000, max_bands=200)
    seconds = time.perf_counter() - start
    print(f"\nMemoryTimelineView of {n:,} events: {seconds:.2f} s")
    assert all(len(t.x) <= 2000 for t in view.fig.data)
    assert len(view.fig.layout.shapes) <= 200 and "8,000 phase spans drawn as" in view.note.value
    assert view.fig.layout.meta["peak_bytes"] == tl.peak(0).bytes == int(frame["total_bytes"].max())
    view.select_step(500)  # one step: all of its 1000 events and its 8 spans
    assert [len(t.x) for t in _traces(view.fig, "total")] == [per]
    assert len(view.fig.layout.shapes) == 8 and view.note.value == ""


# -- compare ------------------------------------------------------------------------------------------

def test_compare_is_exact_per_rank_and_category(measured, predicted):
    cmp = compare(measured, predicted)
    assert isinstance(cmp, MemoryComparison)
    peaks = cmp.to_frame()
    assert peaks[["rank", "predicted_rank", "measured_peak", "predicted_peak"]].values.tolist() == [
        [0, 0, 2200, 2000], [1, 0, 4400, 2000]]
    assert peaks["error"].tolist() == [(2000 - 2200) / 2200, (2000 - 4400) / 4400]
    assert peaks[["measured_phase", "measured_step", "predicted_phase", "predicted_step"]].values.tolist() == [
        ["backward", 1, "forward", 1], ["backward", 1, "forward", 1]]

    cats = cmp.category_frame().set_index(["rank", "category"])
    assert cats.loc[(0, "parameter")].tolist() == [1000, 1000, 0.0]
    assert cats.loc[(0, "activation")].tolist() == [500, 400, -0.2]
    assert cats.loc[(0, "temporary")].tolist() == [100, 0, -1.0]
    assert cats.loc[(0, "gradient")].tolist() == [0, 0, 0.0]  # absent on both sides: no error
    assert cats.loc[(1, "parameter")].tolist() == [2000, 1000, -0.5]
    assert len(cats) == 2 * len(CATEGORIES)

    s = cmp.summary()
    assert s["median_abs_error"] == pytest.approx((200 / 2200 + 2400 / 4400) / 2)
    assert s["max_abs_error"] == pytest.approx(2400 / 4400) and s["worst_rank"] == 1
    assert s["unmatched_ranks"] == []
    doc = json.loads(cmp.to_json())
    assert doc["peaks"][1]["error"] == pytest.approx(-6 / 11) and len(doc["categories"]) == 16
    assert "-54.5%" in cmp._repr_html_()
    # the prediction peaks in forward, the measurement in backward: said, not hidden behind the sizes
    assert s["phase_mismatch_ranks"] == [0, 1] and peaks["same_phase"].tolist() == [False, False]
    assert repr(cmp) == ("MemoryComparison(2 rank(s), median |error| 31.8%, max 54.5% on rank 1; peaks in "
                         "different phases on rank(s) [0, 1])")


def test_compare_without_rank_map_and_its_errors(measured, predicted):
    no_map = MemoryTimeline(predicted.frame, source="predicted")  # rank 0 only, no rank_map
    cmp = compare(measured, no_map)
    assert cmp.to_frame()["rank"].tolist() == [0] and cmp.unmatched == [1]
    assert "no prediction for measured rank(s) [1]" in cmp._repr_html_()
    assert (matching_rank(no_map, 0), matching_rank(no_map, 1)) == (0, None)

    # a predicted measurement-only error: the other sign, and inf where only the prediction has bytes
    flipped = compare(predicted.rank(0), measured)
    assert flipped.to_frame()["error"].tolist() == [(2200 - 2000) / 2000]
    cats = flipped.category_frame().set_index("category")["error"]
    assert math.isinf(cats["temporary"]) and cats["temporary"] > 0
    assert json.loads(flipped.to_json())["categories"][4]["error"] is None  # inf is null in JSON

    broken = MemoryTimeline(predicted.frame, source="predicted", meta={"rank_map": {"0": 0, "1": 3}})
    with pytest.raises(ValueError, match="sends rank 1 to rank 3, which it did not simulate"):
        compare(measured, broken)
    elsewhere = MemoryTimeline(predicted.frame.assign(rank=7), source="predicted")
    with pytest.raises(ValueError, match=r"covers none of the measured ranks \[0, 1\]"):
        compare(measured, elsewhere)
    assert (matching_step(predicted, 1), matching_step(predicted, 5)) == (1, 1)


def test_comparison_view_overlays_every_rank(measured, predicted):
    cmp = compare(measured, predicted)
    view = MemoryComparisonView(cmp)
    measured_bars, predicted_bars = view.peaks_fig.data
    assert list(measured_bars.x) == ["rank 0", "rank 1"]
    assert np.allclose(np.asarray(measured_bars.y) * 1024, [2200, 4400])
    # each peak's phase differs from the measured one's (forward vs backward): the bar says so
    assert list(predicted_bars.text) == ["-9.1% ⚠ other phase", "-54.5% ⚠ other phase"]
    assert view.timeline_view.mode == "ranks"
    assert [t.meta["rank"] for t in _traces(view.timeline_view.grid_fig, "overlay")] == [0, 1]
    assert view.table.value == cmp._repr_html_()


def test_routing_band_is_drawn_between_its_low_and_high_totals(measured, predicted):
    """A MoE band (workbench.prediction.routing.MemoryBand): the area from the balanced (low) total to the
    skewed (high) total, on the step clock, both sides aligned by phase like the overlay."""
    from workbench.prediction.routing import MemoryBand

    skewed = [(t, int(d * 1.5) if cat == "activation" else d, cat, *rest)  # peak 2200 instead of 2000
              for t, d, cat, *rest in PREDICTED]
    high = _timeline(skewed, ranks=(0,), source="predicted", rank_map={"0": 0, "1": 0})
    band = MemoryBand(predicted, high, 2.0)
    assert band.peaks().to_dict(orient="list") == {"rank": [0, 1], "low_peak": [2000, 2000],
                                                     "high_peak": [2200, 2200]}

    view = MemoryTimelineView(measured, band=band, rank=1)
    assert view.x == "step"
    (area,) = _traces(view.fig, "band")
    assert area.fill == "toself" and view.fig.data[0] is area  # behind everything else
    assert area.meta["rank"] == 0 and (area.meta["low_peak"], area.meta["high_peak"]) == (2000, 2200)
    n = len(area.x) // 2  # the high total forward, then the low total back, on the measured step clock
    assert list(area.x[:n]) == [0.0, 0.0, 0.5, 0.625, 1.0, 1.5] == list(area.x[n:][::-1])
    scale = 4400 / max(_traces(view.fig, "total")[0].y)  # the axis unit of the shown rank
    assert [round(y * scale) for y in area.y[:n]] == [1000, 1600, 1000, 1600, 2200, 1600]
    assert [round(y * scale) for y in area.y[n:][::-1]] == [1000, 1400, 1000, 1600, 2000, 1600]
    assert view.fig.layout.meta["routing_band"]["high_peak"] == 2200
    assert "routing band" in view.fig.layout.title.text

    view.show("ranks")  # one band per small multiple
    assert [t.meta["rank"] for t in _traces(view.grid_fig, "band")] == [0, 0]
    shown = view_for(band)  # evaluating a band shows its low timeline with the band behind it
    assert isinstance(shown, MemoryTimelineView) and shown.band is band and len(_traces(shown.fig, "band")) == 1
    with pytest.raises(ValueError, match="step clock"):
        MemoryTimelineView(measured, band=band, x="time")
