"""Issue 33, part 4: the step-timeline view and the advisor view, checked on real core objects.

* ``StepTimelineView``: one row per rank, every rank's spans drawn in its row by category, a prediction
  overlaid in the same rows (the rank that stands for each), per-rank totals and step times, a step
  selector; 10^5 spans draw as a bounded number of bars, quickly; stragglers when the analysis is there.
* ``StepTimeline.bars``: what the views draw keeps every span's busy time and count.
* ``AdvisorView``: a scatter of tokens/s against peak memory coloured by bound, the Pareto front marked,
  and a click (the handler called as the page's click message calls it) opens that layout's plan, memory
  and time views, made by the core.
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
from plotly.callbacks import Points

from time_views_fixtures import AdviceLike, many_spans, step_timeline  # tests/views/time_views_fixtures.py
from workbench.display import view_for
from workbench.memory.timeline import MemoryTimeline
from workbench.plan.types import ShardingPlan
from workbench.time.timeline import CATEGORIES, StepTimeline
from workbench.widgets import AdvisorView, StepTimelineView
from workbench.widgets.time_view import TIME_COLORS

HAVE_ANALYSIS = importlib.util.find_spec("workbench.time.analysis") is not None
HAVE_STEP_TIME = importlib.util.find_spec("workbench.prediction.step_time") is not None
HAVE_ADVISE = importlib.util.find_spec("workbench.prediction.advise") is not None


def _traces(view: StepTimelineView, role: str) -> list:
    return [t for t in view.fig.data if (t.meta or {}).get("role") == role]


def test_every_rank_has_its_row_of_spans_coloured_by_category():
    tl = step_timeline(ranks=4, steps=3)
    view = StepTimelineView(tl)
    assert view.step == 2  # the last step, the steady state, first
    measured = _traces(view, "measured")
    assert {t.meta["category"] for t in measured} == {"data", "forward", "backward", "optimizer", "communication",
                                                     "idle"}
    for t in measured:
        assert t.marker.color == TIME_COLORS[t.meta["category"]]
        # communication in the lane under the compute lane of the same row
        assert t.offset == (0.0 if t.meta["category"] == "communication" else -0.42)
    ranks_drawn = {int(r) for t in measured for r in t.y}
    assert ranks_drawn == {0, 1, 2, 3}
    for r in range(4):  # each rank's row holds its own step: forward and backward bars inside step 2's extent
        sel = tl.select(rank=r, step=2).frame
        fwd = next(t for t in measured if t.meta["category"] == "forward")
        mine = np.asarray(fwd.y) == r
        assert mine.any()
        assert np.asarray(fwd.base)[mine].min() >= sel["start"].min() * 1e3 - 1e-9
    # the row labels name the ranks, rank 0 on top
    y = view.fig.layout.yaxis
    assert list(y.tickvals) == [0, 1, 2, 3] and y.autorange == "reversed"
    assert [str(s) for s in y.ticktext][0].startswith("rank 0")


def test_the_totals_beside_match_the_timelines_own_totals_and_step_times():
    tl = step_timeline(ranks=3, steps=2)
    view = StepTimelineView(tl, step=1)
    tot = tl.select(step=1).totals()
    for t in _traces(view, "total"):
        cat = t.meta["category"]
        assert np.allclose(np.asarray(t.x) / 1e3, tot[cat].to_numpy())
    step = _traces(view, "step_time")[0]
    st = tl.step_times()
    assert np.allclose(np.asarray(step.x) / 1e3, st[st["step"] == 1].set_index("rank")["step_s"].to_numpy())
    table = view.rank_table()
    assert list(table["rank"]) == [0, 1, 2] and table["step_s"].notna().all()


def test_the_prediction_is_overlaid_in_each_ranks_row_from_the_rank_that_stands_for_it():
    measured = step_timeline(ranks=4, steps=3, slow_rank=2)
    predicted = step_timeline(ranks=1, steps=1, source="predicted", seed=7)
    predicted.meta["rank_map"] = {str(r): 0 for r in range(4)}  # one distinct rank stands for all four
    view = StepTimelineView(measured, predicted=predicted)
    over = _traces(view, "predicted")
    assert over, "no predicted bars drawn"
    assert {int(r) for t in over for r in t.y} == {0, 1, 2, 3}
    assert all(t.width < 0.2 for t in over)  # the thin lane
    # placed where the measured step starts
    start = measured.select(step=2).frame["start"].min() * 1e3
    assert min(np.asarray(t.base).min() for t in over) == pytest.approx(start, abs=1e-6)
    table = view.rank_table().set_index("rank")
    assert table["predicted_s"].nunique() == 1
    assert table.loc[2, "error"] < table.loc[0, "error"] - 0.15  # the slow rank is the one the model misses
    assert _traces(view, "predicted_step_time")
    assert "predicted" in view.header.value and "uncalibrated" in view.header.value
    # every step: the prediction repeated over each measured step
    view.select_step(None)
    over_all = _traces(view, "predicted")
    assert len({int(s) for t in over_all for s in np.asarray(t.customdata)[:, 3]}) == 3
    assert view.controls["step"].value == -1


def test_the_step_selector_redraws_one_step_and_refuses_a_step_that_is_not_there():
    tl = step_timeline(ranks=2, steps=3)
    view = StepTimelineView(tl, step="all")
    assert view.step is None and view.fig.layout.meta["spans"] == len(tl)
    view.controls["step"].value = 1  # what the dropdown does
    assert view.step == 1 and view.fig.layout.meta["spans"] == len(tl.select(step=1))
    with pytest.raises(ValueError, match="step 9 is not in this timeline"):
        view.select_step(9)


def test_a_hundred_thousand_spans_draw_as_few_bars_quickly(tmp_path):
    tl = many_spans(100_000, ranks=4)
    t0 = time.process_time()
    view = StepTimelineView(tl, step="all", max_bars=1000)
    cpu = time.process_time() - t0
    meta = view.fig.layout.meta
    assert meta["spans"] == 100_000
    assert meta["bars"] <= 4 * 2 * 2 * 1000  # ranks x streams x (joined runs + bins)
    assert sum(len(t.y) for t in view.fig.data) <= meta["bars"] + 64
    assert "drawn as" in view.note.value
    assert cpu < 10, f"building the view took {cpu:.1f} s of CPU"
    html = view.to_html(tmp_path / "time.html").read_text()
    assert len(html) < 8_000_000 and "plotly" in html.lower()


def test_bars_keep_every_spans_time_and_count():
    tl = many_spans(20_000, ranks=2)
    bars = tl.bars(300)
    assert int(bars["spans"].sum()) == len(tl)
    busy = (tl.frame["end"] - tl.frame["start"]).sum()
    assert bars["busy_s"].sum() == pytest.approx(busy, rel=1e-9)
    assert set(bars["category"]) <= set(CATEGORIES)
    per = bars.groupby(["rank", "stream"]).size()
    assert (per <= 2 * 300 + 2).all()
    # a step's worth of long spans stays whole: no span longer than the resolution is cut or merged away
    small = step_timeline(ranks=1, steps=1, ops=5)
    b = small.bars(10_000)
    assert len(b) >= len(small.select(category="optimizer")) and (b["end"] >= b["start"]).all()
    with pytest.raises(ValueError, match="at least 1 bar"):
        tl.bars(0)


def test_a_step_timeline_shows_this_view_when_evaluated():
    tl = step_timeline(ranks=2, steps=1)
    view = view_for(tl)
    assert isinstance(view, StepTimelineView)
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "pw-static" in bundle["text/html"]
    with pytest.raises(ValueError, match="no spans"):
        StepTimelineView(StepTimeline(tl.frame.iloc[:0]))
    with pytest.raises(TypeError, match="StepTimeline"):
        StepTimelineView(tl.frame)


@pytest.mark.skipif(not HAVE_ANALYSIS, reason="workbench.time.analysis (issue 33, H-measure) is not installed")
def test_stragglers_and_exposed_communication_come_from_the_analysis():
    tl = step_timeline(ranks=4, steps=3, slow_rank=3)
    view = StepTimelineView(tl, step="all")
    table = view.rank_table().set_index("rank")
    assert bool(table.loc[3, "straggler"]) and not table.loc[[0, 1, 2], "straggler"].any()
    assert "exposed_comm_s" in table and "straggler" in view.table.value
    assert "straggler" in str(view.fig.layout.yaxis.ticktext[3])


# -- the advisor ---------------------------------------------------------------------------------------------
def test_advisor_scatter_colours_by_bound_and_marks_the_pareto_front():
    advice = AdviceLike()
    view = AdvisorView(advice, views=("plan",))
    by_key = {t.meta["key"]: t for t in view.fig.data}
    assert {"bound:compute", "bound:communication", "bound:bubble", "no fit", "pareto"} <= set(by_key)
    assert list(by_key["bound:compute"].y) == [9000.0]
    assert list(by_key["no fit"].x) == [pytest.approx(2.0)]  # GiB, at its predicted peak
    front = advice.pareto()
    assert sorted(view.pareto_rows) == sorted(front.index) == [0, 1]
    assert sorted(view.fig.layout.meta["pareto"]) == [0, 1]
    assert "3 fit" in view.header.value and "2 on the Pareto front" in view.header.value
    assert view.fig.layout.shapes and view.fig.layout.shapes[0].x0 == pytest.approx(1.0)  # the 1 GiB budget


def test_a_click_on_a_point_opens_that_layouts_plan_and_memory_views():
    advice = AdviceLike()
    view = AdvisorView(advice, views=("plan", "memory"))
    trace = next(t for t in view.fig.data if t.meta["key"] == "bound:communication")  # the tp=2 point
    # what PlotView does with the page's click message
    trace._dispatch_on_click(Points(point_inds=[0], xs=[0.2], ys=[6000.0], trace_name=trace.name,
                                    trace_index=list(view.fig.data).index(trace)), None)
    assert view.selected == 1
    plan, mem = view.opened["plan"], view.opened["memory"]
    assert isinstance(plan, ShardingPlan) and plan.parallel.tp == 2 and plan.world_size == 2
    assert isinstance(mem, MemoryTimeline) and mem.source == "predicted"
    assert "tp=2" in view.status.value and "could not" not in view.status.value
    assert any(t.meta.get("key") == "selected" for t in view.fig.data)  # the opened point is starred


def test_a_layout_the_core_refuses_opens_as_its_one_line_error():
    advice = AdviceLike()
    advice.rows[0]["layout"] = "tp=3"  # 3 does not divide the tiny model's heads
    view = AdvisorView(advice, views=("plan",))
    made = view.open(0)
    assert isinstance(made["plan"], str) and "tp=3" in made["plan"] and "\n" not in made["plan"]
    assert "could not make plan" in view.status.value
    with pytest.raises(ValueError, match="row 7 is not in the advice"):
        view.open(7)


@pytest.mark.skipif(not HAVE_STEP_TIME, reason="workbench.prediction.step_time (issue 33, H-predict) is not installed")
def test_a_click_opens_the_predicted_step_timeline_too():
    view = AdvisorView(AdviceLike(), views=("time",))
    made = view.open(0)
    assert isinstance(made["time"], StepTimeline), made["time"]
    assert made["time"].source == "predicted"


@pytest.mark.skipif(not HAVE_ADVISE, reason="workbench.prediction.advise (issue 33, H-advise) is not installed")
def test_the_real_advice_shows_as_the_advisor_view():
    from workbench.prediction.advise import advise

    advice = advise("tiny", gpus=2, gpu_memory="1GiB", gpu="cpu", global_batch=4, seq_len=32, top=2, exact=2)
    view = view_for(advice)
    assert isinstance(view, AdvisorView)
    assert view.fig.layout.meta["fits"] >= 1 and view.pareto_rows
    best = int(view.frame.index[view._fits()][0])
    made = view.open(best)
    assert not any(isinstance(o, str) for o in made.values()), made
