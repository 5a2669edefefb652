"""Pipeline timeline and tokens-per-expert views: on hand-made events, and live in the RunDashboard.

The hand-made schedule is the one of tests/test_pipeline.py (pp=2, m=2, GPipe, unit-time actions:
bubble 1/3 measured and in theory); the live run is a real pp=2 job through torchrun.
"""

from __future__ import annotations

import pytest

from workbench.parallel.pipeline_bubble import complete_steps, schedule_frame, schedule_shape
from workbench.train.events import read_events
from workbench.widgets import RunDashboard, plot_pipeline_timeline, plot_tokens_per_expert


def _act(s, m, ph, t, dt=1.0):
    return {"stage": s, "microbatch": m, "phase": ph, "start": 100.0 + t, "end": 100.0 + t + dt}


def _gpipe_step(step: int, t0: float = 0.0) -> list[dict]:
    #   rank 0: F0 F1 .  .  B0 B1        busy 4 of 6
    #   rank 1: .  F0 F1 B0 B1 .         busy 4 of 6
    return [
        {"type": "schedule", "rank": 0, "step": step, "actions": [
            _act(0, 0, "F", t0), _act(0, 1, "F", t0 + 1), _act(0, 0, "B", t0 + 4), _act(0, 1, "B", t0 + 5)]},
        {"type": "schedule", "rank": 1, "step": step, "actions": [
            _act(1, 0, "F", t0 + 1), _act(1, 1, "F", t0 + 2), _act(1, 0, "B", t0 + 3), _act(1, 1, "B", t0 + 4)]},
    ]


def _bars(fig) -> int:
    return sum(len(t.x) for t in fig.data if t.type == "bar")


def test_timeline_has_one_bar_per_action_and_the_bubbles_in_its_title():
    events = [{"type": "pipeline", "rank": r, "schedule": "GPipe", "microbatches": 2} for r in (0, 1)]
    events += _gpipe_step(0, t0=0) + _gpipe_step(1, t0=10)
    fig = plot_pipeline_timeline(events)
    assert fig.layout.meta["step"] == 1  # step 0 is warm-up: not the default once step 1 is there
    assert _bars(fig) == 8
    assert "bubble: measured 33% vs theory 33%" in fig.layout.title.text
    assert "GPipe, p=2, m=2" in fig.layout.title.text
    assert fig.layout.meta["bubble_measured"] == pytest.approx(1 / 3)
    assert fig.layout.meta["bubble_theory"] == pytest.approx(1 / 3)

    # time in ms from the step's first forward; rows are stages (with their rank), stage 0 on top
    bars = {(t.name, t.opacity, y): (b, x) for t in fig.data for y, b, x in zip(t.y, t.base, t.x)}
    assert bars[("microbatch 0", 1.0, "stage 0 · rank 0")] == pytest.approx((0.0, 1000.0))
    assert bars[("microbatch 1", 0.7, "stage 1 · rank 1")] == pytest.approx((4000.0, 1000.0))
    assert list(fig.layout.yaxis.categoryarray) == ["stage 0 · rank 0", "stage 1 · rank 1"]
    # F and B look different; the colour is the microbatch's, shared by its F and B
    f0, b0 = (t for t in fig.data if t.name == "microbatch 0")
    assert f0.marker.pattern.shape in (None, "") and b0.marker.pattern.shape == "/"
    assert f0.marker.color == b0.marker.color
    assert f0.marker.color != next(t for t in fig.data if t.name == "microbatch 1").marker.color
    assert "microbatch" in f0.hovertemplate and "ms" in f0.hovertemplate

    # a step can be chosen; a step not every rank has reported cannot
    assert plot_pipeline_timeline(events, step=0).layout.meta["step"] == 0
    with pytest.raises(ValueError, match="step 7 has no complete schedule; choose one of \\[0, 1\\]"):
        plot_pipeline_timeline(events, step=7)
    with pytest.raises(ValueError, match="no schedule events"):
        plot_pipeline_timeline([{"type": "step", "rank": 0, "step": 0, "loss": 1.0}])


def test_a_live_runs_newest_step_is_shown_only_once_every_rank_reported_it():
    events = _gpipe_step(0) + _gpipe_step(1, t0=10) + _gpipe_step(2, t0=20)[:1]  # rank 1 still on step 2
    frame = schedule_frame(events)
    assert complete_steps(frame) == [0, 1] and schedule_shape(frame) == (2, 2, 1)
    assert plot_pipeline_timeline(events).layout.meta["step"] == 1
    assert plot_pipeline_timeline(_gpipe_step(0)).layout.meta["step"] == 0  # the only step there is


def test_interleaved_timeline_infers_stages_per_rank():
    # pp=2, v=2: stages 0, 2 on rank 0 and 1, 3 on rank 1; m=2
    acts = {0: [], 1: []}
    t = 0
    for m in range(2):
        for s in range(4):
            acts[s % 2].append(_act(s, m, "F", t + s, dt=0.5))
    for r in (0, 1):
        acts[r] += [_act(s, m, "B", 10 + s, dt=0.5) for s in range(4) if s % 2 == r for m in range(2)]
    events = [{"type": "schedule", "rank": r, "step": 0, "actions": a} for r, a in acts.items()]
    fig = plot_pipeline_timeline(events)
    assert (fig.layout.meta["pp"], fig.layout.meta["microbatches"], fig.layout.meta["stages_per_rank"]) == (2, 2, 2)
    assert fig.layout.meta["bubble_theory"] == pytest.approx(1 / 5)
    assert "(p-1)/(v·m+p-1)" in fig.layout.title.text and _bars(fig) == 16
    assert list(fig.layout.yaxis.categoryarray) == ["stages 0, 2 · rank 0", "stages 1, 3 · rank 1"]  # a row per rank


def test_tokens_per_expert_chart():
    events = [
        {"type": "step", "rank": 0, "step": 0, "loss": 5.0, "aux_loss": 2.25},
        {"type": "moe", "rank": 0, "step": 0, "tokens_per_expert": [[1, 2, 3, 2], [2, 2, 2, 2]]},
        {"type": "step", "rank": 0, "step": 1, "loss": 4.0, "aux_loss": 2.0625},
        {"type": "moe", "rank": 0, "step": 1, "tokens_per_expert": [[4, 0, 2, 2], [2, 3, 1, 2]]},
        {"type": "moe", "rank": 1, "step": 1, "tokens_per_expert": [[4, 0, 2, 2], [2, 3, 1, 2]]},
    ]
    fig = plot_tokens_per_expert(events)
    assert fig.layout.meta["step"] == 1 and fig.layout.meta["aux_loss"] == 2.0625
    assert [t.name for t in fig.data] == ["layer 0", "layer 1"]
    assert [list(t.y) for t in fig.data] == [[4, 0, 2, 2], [2, 3, 1, 2]]
    assert "aux loss 2.062" in fig.layout.title.text
    assert fig.layout.shapes[0].y0 == 2  # balanced: 8 token-slots over 4 experts
    assert [list(t.y) for t in plot_tokens_per_expert(events, step=0).data][0] == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="no moe events"):
        plot_tokens_per_expert(events[:1])


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_dashboard_shows_the_timeline_of_a_real_pp2_run(tmp_path):
    steps, m = 3, 4
    dash = RunDashboard(preset="tiny", pp=2, pp_schedule="GPipe", microbatches=m, steps=steps,
                        out_root=tmp_path / "runs")
    assert dash.settings["nproc"] == 2 and dash.timeline_box.layout.display == "none"
    run = dash.launch()
    try:
        assert dash.timeline_box.layout.display == ""  # a pipeline run: shown from the launch on
        assert dash.wait(120) is run and run.status == "succeeded", run.error
    finally:
        run.stop(grace_s=2)

    meta = dash.timeline_fig.layout.meta
    assert meta["step"] == steps - 1 and meta["schedule"] == "GPipe"
    assert (meta["pp"], meta["microbatches"]) == (2, m)
    # one bar per measured action of the shown step: F and B of m microbatches on each of 2 stages
    frame = schedule_frame(read_events(run.run_dir))
    shown = frame[frame["step"] == meta["step"]]
    assert _bars(dash.timeline_fig) == len(shown) == 2 * 2 * m
    assert sorted(x for t in dash.timeline_fig.data for x in t.x) == pytest.approx(
        sorted((shown["end"] - shown["start"]) * 1e3))
    assert 0.0 < meta["bubble_measured"] < 1.0 and meta["bubble_theory"] == pytest.approx(1 / 5)
    title = dash.timeline_fig.layout.title.text
    assert f"bubble: measured {meta['bubble_measured']:.0%} vs theory 20%" in title
    label = dash.bubble_label.value
    assert f"measured <b>{meta['bubble_measured']:.1%}</b>" in label and "<b>20.0%</b>" in label
    assert dash.experts_box.layout.display == "none"  # a dense model has no experts to show
