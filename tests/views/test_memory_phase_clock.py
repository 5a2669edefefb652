"""Issue 28, finding 6: a prediction drawn over a measurement lines up phase against phase, and the comparison
table says what it compares.

The two hand-made timelines of one rank spend their steps very differently, as a real pair does::

    measured (seconds)     |fwd: 10 activations over 2.9 s|bwd: the peak, then frees, 0.8 s|opt|
    predicted (positions)  |fwd: 10 positions|bwd: the peak, then 46 positions of churn    |opt|

Both peak in backward of step 1 (step 0 made the optimizer state). On the plain step clock (linear within
each step: the view before this fix) the predicted peak was drawn at x = 1.17, inside the measured forward
band of step 1 (x = 1.0 to 1.62), while the measured peak sat at x = 1.71 in the backward band. Aligned by
phase, the predicted backward is stretched onto the measured backward, and the two peaks share the band.
"""

from __future__ import annotations

import numpy as np

from workbench.memory.clock import phase_clock
from workbench.memory.comparison import compare
from workbench.memory.timeline import MemoryTimeline, TimelineBuilder
from workbench.widgets import MemoryTimelineView


def _measured() -> MemoryTimeline:
    b = TimelineBuilder(rank=0)
    ident = 0

    def add(t, delta, cat, phase, step, mb, op="aten::mm", i=None):
        nonlocal ident
        if i is None:
            ident += 1
            i = ident
        b.add(t, delta, cat, phase, step, mb, "layers.0", op, i)
        return i

    add(0.0, 1000, "parameter", "build", -1, -1, "aten::empty")
    for step in range(2):
        t0 = 0.1 + 5.0 * step
        acts = [add(t0 + 0.29 * k, 100, "activation", "forward", step, 0) for k in range(10)]
        tmp = add(t0 + 3.0, 500, "temporary", "backward", step, 0, "aten::add")          # the peak
        add(t0 + 3.1, -500, "temporary", "backward", step, 0, "(free)", tmp)
        for k, a in enumerate(acts):
            add(t0 + 3.2 + 0.06 * k, -100, "activation", "backward", step, 0, "(free)", a)
        if step == 0:
            add(t0 + 4.0, 300, "optimizer", "optimizer", step, -1, "aten::zeros")
        else:
            tmp = add(t0 + 4.0, 50, "temporary", "optimizer", step, -1, "aten::mul")
            add(t0 + 4.2, -50, "temporary", "optimizer", step, -1, "(free)", tmp)
    return b.timeline(source="measured", device="cpu")


def _predicted(peak_phase: str = "backward") -> MemoryTimeline:
    b = TimelineBuilder(rank=0)
    pos, ident = 0, 0

    def add(delta, cat, phase, step, mb, op="aten::mm", i=None):
        nonlocal pos, ident
        if i is None:
            ident += 1
            i = ident
        b.add(float(pos), delta, cat, phase, step, mb, "layers.0", op, i)
        pos += 1
        return i

    add(1000, "parameter", "build", -1, -1, "aten::empty")
    for step in range(2):
        acts = [add(100, "activation", "forward", step, 0) for _ in range(10)]
        if peak_phase == "forward":  # a prediction that peaks one phase early: the case to flag
            tmp = add(700, "temporary", "forward", step, 0, "aten::add")
            add(-700, "temporary", "forward", step, 0, "(free)", tmp)
        tmp = add(500, "temporary", "backward", step, 0, "aten::add")                      # the peak
        add(-500, "temporary", "backward", step, 0, "(free)", tmp)
        for _ in range(18):  # backward's many small temporaries: most of the prediction's positions
            tmp = add(8, "temporary", "backward", step, 0, "aten::mul")
            add(-8, "temporary", "backward", step, 0, "(free)", tmp)
        for a in acts:
            add(-100, "activation", "backward", step, 0, "(free)", a)
        if step == 0:
            add(300, "optimizer", "optimizer", step, -1, "aten::zeros")
        else:
            tmp = add(50, "temporary", "optimizer", step, -1, "aten::mul")
            add(-50, "temporary", "optimizer", step, -1, "(free)", tmp)
    tl = b.timeline(source="predicted", device="cpu")
    tl.meta["rank_map"] = {"0": 0}
    return tl


def _band_of(shapes, x: float) -> str | None:
    """The phase of the band drawn at x (a zero-width band, like the build at x = 0, only where nothing else is)."""
    hits = [s.name for s in shapes if s.x0 <= x <= s.x1 and s.x1 > s.x0] or [
        s.name for s in shapes if s.x0 <= x <= s.x1]
    return hits[0] if len(hits) == 1 else None


def test_overlay_peak_falls_in_the_measured_band_of_its_phase():
    measured, predicted = _measured(), _predicted()
    assert measured.peak(0).phase == predicted.peak(0).phase == "backward"
    view = MemoryTimelineView(measured, overlay=predicted, rank=0)
    assert view.x == "step"
    shapes = view.fig.layout.shapes
    (marker,) = [t for t in view.fig.data if (t.meta or {}).get("role") == "peak"]
    assert _band_of(shapes, marker.x[0]) == "backward"  # the measured peak
    (over,) = [t for t in view.fig.data if (t.meta or {}).get("role") == "overlay"]
    peak_x = float(np.asarray(over.x)[int(np.argmax(over.y))])
    # before: 1.17, in the forward band (the plain step clock drew the predicted peak over the measured forward)
    assert _band_of(shapes, peak_x) == "backward", f"predicted peak drawn at x={peak_x:.3f}"

    # every predicted event lies in the measured band of its own phase
    ds = predicted.downsample(0, 10_000)
    xs = phase_clock(measured, 0, predicted, 0)(ds["t"].to_numpy())
    for x, phase, step in zip(xs, ds["phase"], ds["step"]):
        if step >= 0:
            assert _band_of(shapes, float(x)) == phase, (x, phase, step)


def test_the_clock_keeps_order_and_continues_past_the_matched_spans():
    measured, predicted = _measured(), _predicted()
    clock = phase_clock(measured, 0, predicted, 0)
    t = predicted.frame["t"].to_numpy()
    x = clock(t)
    assert (np.diff(x) >= 0).all()  # never runs backwards
    assert clock.matched == 7 and clock.unmatched == 0  # build + 3 spans per step
    # a step zoom onto a step the prediction lacks: its step 1 aligned with measured step 1, and beyond its
    # last matched span the prediction keeps its own step clock
    zoomed = phase_clock(measured, 0, predicted.select(step=1), 0, step_map={1: 1})
    assert zoomed(predicted.select(step=1).frame["t"].to_numpy()).min() >= 1.0
    # a step the reference lacks (measured step 0 only, predicted steps 0 and 1): drawn after the last match
    first = MemoryTimeline(measured.frame[measured.frame["step"] <= 0], source="measured")
    tail = phase_clock(first, 0, predicted, 0)
    later = predicted.frame[predicted.frame["step"] == 1]["t"].to_numpy()
    xs = tail(later)
    assert tail.matched == 4 and (np.diff(xs) > 0).all() and xs[0] > tail.anchors_x[-1] and xs[-1] < 2.1


def test_comparison_table_names_what_it_compares_and_flags_a_phase_mismatch():
    measured = _measured()
    same = compare(measured, _predicted())
    html = same._repr_html_()
    assert "Compared: the peaks only" in html and "the curves are not compared" in html
    assert "<th>measured in</th>" in html and "<th>predicted in</th>" in html
    assert html.count("<td>backward, step 1</td>") == 2 and "backward, step 1 <span" not in html
    assert same.to_frame()["same_phase"].tolist() == [True] and same.summary()["phase_mismatch_ranks"] == []
    assert "different phase" not in html

    early = compare(measured, _predicted("forward"))
    row = early.to_frame().iloc[0]
    assert (row.measured_phase, row.predicted_phase, bool(row.same_phase)) == ("backward", "forward", False)
    html = early._repr_html_()
    assert "<td>backward, step 1</td>" in html and "forward, step 1 <span class='pw-phase-differs'" in html
    assert "different phase" in html and early.summary()["phase_mismatch_ranks"] == [0]
    assert "peaks in different phases on rank(s) [0]" in repr(early)


def test_a_clock_for_timelines_without_common_spans_is_the_own_step_clock():
    measured = _measured()
    other = MemoryTimeline(_predicted().frame.assign(step=7), source="predicted")
    clock = phase_clock(measured, 0, other, 0)
    t = other.frame["t"].to_numpy()[:5]
    # only the build span (step -1 was renamed too: nothing matches) -> its own step clock
    assert clock.matched == 0 and np.allclose(clock(t), other.step_progress(0, t))
