"""The pipeline timeline exports to Chrome/Perfetto Trace Event Format (hand-made schedule events)."""

import json

import pytest

from workbench.widgets.plots import export_pipeline_trace, pipeline_trace


def _act(stage, mb, phase, t):
    return {"stage": stage, "microbatch": mb, "phase": phase, "start": float(t), "end": float(t + 1)}


def _events(steps=(0, 1)):
    out = [{"type": "pipeline", "rank": r, "schedule": "GPipe", "microbatches": 2} for r in (0, 1)]
    for s in steps:
        base = 10 * s
        out.append({"type": "schedule", "rank": 0, "step": s, "actions": [
            _act(0, 0, "F", base), _act(0, 1, "F", base + 1), _act(0, 0, "B", base + 4), _act(0, 1, "B", base + 5)]})
        out.append({"type": "schedule", "rank": 1, "step": s, "actions": [
            _act(1, 0, "F", base + 1), _act(1, 1, "F", base + 2),
            _act(1, 0, "B", base + 3), _act(1, 1, "B", base + 4)]})
    return out


def test_trace_export_is_valid_trace_event_format(tmp_path):
    path = export_pipeline_trace(_events(), tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 16  # 2 steps x 2 ranks x 4 actions
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] == pytest.approx(1e6) and e["ts"] >= 0
    assert min(e["ts"] for e in complete) == 0
    assert {e["pid"] for e in complete} == {0, 1}
    assert {e["name"] for e in complete} == {"F0", "F1", "B0", "B1"}


def test_trace_of_one_step_holds_only_that_step():
    doc = pipeline_trace(_events(), step=1)
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 8
    assert {e["args"]["step"] for e in complete} == {1}
    with pytest.raises(ValueError, match="choose one of"):
        pipeline_trace(_events(), step=7)


def test_dashboard_exports_the_runs_trace_from_its_button(tmp_path, monkeypatch):
    import workbench.widgets.dashboard as dashboard_module
    from test_dashboard import _replayed_run
    from workbench.widgets import RunDashboard

    run = _replayed_run(tmp_path / "replayed", _events())
    monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: run)  # the run already happened
    dash = RunDashboard(out_root=tmp_path / "runs", preset="tiny", nproc=2, dp_shard=2, steps=2)
    with pytest.raises(ValueError, match="no run yet"):
        dash.export_trace(tmp_path / "none.json")
    assert dash.launch() is run and dash.wait(30) is run
    assert "bubble</b> at step 1" in dash.bubble_label.value  # the timeline was drawn from the events
    dash.trace_button.click()
    doc = json.loads((run.run_dir / "pipeline_trace.json").read_text())
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 16
    assert "pipeline_trace.json" in dash.trace_status.value
    one = json.loads(dash.export_trace(tmp_path / "step0.json", step=0).read_text())
    assert len([e for e in one["traceEvents"] if e["ph"] == "X"]) == 8


def test_median_timeline_takes_each_actions_median_over_steady_steps():
    from workbench.widgets.plots import plot_pipeline_timeline

    events = _events(steps=(0, 1, 2, 3))
    # step 2's rank-1 forward of microbatch 0 is slow; the median ignores one outlier of three
    for e in events:
        if e.get("step") == 2 and e["rank"] == 1:
            e["actions"][0]["end"] += 5.0
    fig = plot_pipeline_timeline(events, step="median")
    assert fig.layout.meta["step"] == "median" and "median over steps" in fig.layout.title.text
    assert fig.layout.meta["bubble_measured"] == pytest.approx(1 / 3)
    f0 = next(t for t in fig.data if t.name == "microbatch 0" and "F0" in t.text)
    assert max(f0.x) == pytest.approx(1000.0)  # 1 s in ms, not the outlier's 6 s


def test_dashboard_step_picker_shows_the_picked_step_and_the_median(tmp_path, monkeypatch):
    import workbench.widgets.dashboard as dashboard_module
    from test_dashboard import _replayed_run
    from workbench.widgets import RunDashboard

    run = _replayed_run(tmp_path / "replayed", _events(steps=(0, 1, 2)))
    monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: run)
    dash = RunDashboard(out_root=tmp_path / "runs", preset="tiny", nproc=2, dp_shard=2, steps=3)
    dash.launch()
    dash.wait(30)
    assert [v for _, v in dash.timeline_step.options] == ["latest", "median", 0, 1, 2]
    assert dash.timeline_fig.layout.meta["step"] == 2 and "at step 2" in dash.bubble_label.value
    dash.timeline_step.value = 0
    assert dash.timeline_fig.layout.meta["step"] == 0 and "at step 0" in dash.bubble_label.value
    dash.timeline_step.value = "median"
    assert dash.timeline_fig.layout.meta["step"] == "median"
    assert "median over steps" in dash.bubble_label.value
