"""RunDashboard without a browser: real runs through torchrun, read back from the widgets' state."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest

import workbench.widgets.dashboard as dashboard_module
from workbench.config import PRESETS
from workbench.train.launcher import Run, build_job
from workbench.widgets import RunDashboard, plot_losses


@pytest.fixture
def dashboards(tmp_path):
    """Make dashboards whose runs land in tmp_path; stop whatever is still running afterwards."""
    made: list[RunDashboard] = []

    def make(**kwargs) -> RunDashboard:
        dash = RunDashboard(out_root=tmp_path / "runs", **kwargs)  # made on the first launch
        made.append(dash)
        return dash

    yield make
    for dash in made:
        for run in dash.runs:
            run.stop(grace_s=2)


def _trace_points(fig) -> dict[str, int]:
    return {t.name: len(t.x) for t in fig.data}


def test_constructor_sets_controls_and_displays(dashboards):
    dash = dashboards(preset="tiny", nproc=2, tp=2, sequence_parallel=True, steps=7, global_batch=4, seed=3,
                      data="text")
    assert dash.settings == {"model": "tiny", "nproc": 2, "dp_replicate": 1, "dp_shard": -1, "tp": 2,
                             "sequence_parallel": True, "pp": 1, "pp_schedule": "1F1B", "microbatches": None,
                             "ep": 1, "zero": 3, "steps": 7, "global_batch": 4, "seed": 3, "data": "text",
                             "device": "auto", "init_from": None}
    assert dash.run is None and dash.runs == []
    # Trainable presets come first, smallest first, and tiny is the default.
    names = [value for _, value in dash.controls["preset"].options]
    assert names[:3] == ["tiny", "tiny-moe", "small"] and set(names) == set(PRESETS)
    assert RunDashboard().controls["preset"].value == "tiny"
    # Evaluating the object in a notebook shows the widget.
    bundle = dash._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
    assert dash.error_panel.layout.display == "none"
    assert dash.timeline_box.layout.display == "none" and dash.experts_box.layout.display == "none"
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        RunDashboard(preset="gpt5")


def test_nproc_defaults_to_the_product_of_the_degrees(dashboards):
    assert dashboards(dp_replicate=2, tp=2).controls["nproc"].value == 4
    assert dashboards(pp=2, tp=2).controls["nproc"].value == 4
    assert dashboards(dp_shard=2).controls["nproc"].value == 2
    assert dashboards().controls["nproc"].value == 1


def test_config_error_shows_one_line_and_launches_nothing(dashboards, tmp_path):
    dash = dashboards(nproc=2, tp=3, steps=2)
    assert dash.launch() is None
    assert dash.runs == [] and dash.run is None
    assert list(tmp_path.iterdir()) == []  # no run directory was even created
    assert dash.error_panel.layout.display != "none"
    assert "tp=3 does not divide n_heads=8; choose tp in {1, 2, 4}" in dash.error_panel.value
    assert "<pre" not in dash.error_panel.value  # a config error is one line, not a traceback
    assert not dash.launch_button.disabled
    with pytest.raises(RuntimeError, match="nothing was launched"):
        dash.wait(1)

    # Whatever the core rejects is shown in the core's own words.
    dash.controls["tp"].value = 2
    dash.controls["nproc"].value = 3
    assert dash.launch() is None
    assert "nproc=3 is not divisible by dp_replicate*tp*pp=2" in dash.error_panel.value


def test_planning_only_preset_is_listed_but_not_launched(dashboards, tmp_path):
    dash = dashboards(preset="llama-7b", steps=1)
    assert dash.launch() is None
    assert dash.runs == [] and list(tmp_path.iterdir()) == []
    assert "llama-7b (6.74B params) needs at least" in dash.error_panel.value


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_live_run_fills_progress_and_one_trace_per_rank(dashboards):
    steps = 4
    dash = dashboards(preset="tiny", nproc=2, dp_shard=2, steps=steps)
    run = dash.launch()
    assert run is dash.run and dash.runs == [run]
    assert dash.launch_button.disabled and not dash.stop_button.disabled
    with pytest.raises(RuntimeError, match="in progress"):
        dash.launch()

    # The background thread alone (no wait()) drives the widgets while the run trains.
    deadline = time.monotonic() + 90
    while dash.progress.value < steps and time.monotonic() < deadline:
        time.sleep(0.1)
    assert dash.progress.value == steps

    assert dash.wait(60) is run
    assert run.status == "succeeded"
    assert dash.progress.max == steps and dash.progress.bar_style == "success"
    assert "succeeded" in dash.status.value
    assert dash.error_panel.layout.display == "none"
    assert not dash.launch_button.disabled and dash.stop_button.disabled
    label = f"#0 tiny dp_shard=2 ({run.run_dir.name})"
    for fig in (dash.loss_fig, dash.memory_fig):
        assert _trace_points(fig) == {f"{label} r0": steps, f"{label} r1": steps}
    # tokens/s is the whole job's: one line per run, and its axis says so; memory is per rank
    assert _trace_points(dash.tps_fig) == {label: steps}
    assert dash.tps_fig.layout.yaxis.title.text == "tokens/s (global)"
    assert "per rank" in dash.memory_fig.layout.yaxis.title.text
    assert dash.loss_fig.layout.legend.y > 1  # above the plot, clear of the x-axis title
    r0 = next(t for t in dash.loss_fig.data if t.name.endswith("r0"))
    assert list(r0.x) == list(range(steps))
    assert list(r0.y) == pytest.approx(run.losses(rank=0))
    memory = run.memory_history()
    m1 = next(t for t in dash.memory_fig.data if t.name.endswith("r1"))
    assert list(m1.y) == pytest.approx((memory[memory["rank"] == 1]["peak_bytes"] / 2**20).tolist())
    assert all(y > 0 for y in m1.y)
    assert dash.timeline_box.layout.display == "none"  # no pipeline, no timeline


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_failed_rank_and_its_traceback_show_in_the_error_panel(dashboards):
    dash = dashboards(preset="tiny", nproc=2, dp_shard=2, steps=5)
    run = dash.launch(fail_at={"rank": 1, "step": 2})
    dash.wait(90)
    assert run.status == "failed"
    panel = dash.error_panel.value
    assert dash.error_panel.layout.display != "none"
    assert "rank 1 failed" in panel
    assert "injected failure on rank 1 at step 2" in panel
    assert "<pre" in panel and "Traceback (most recent call last)" in panel
    assert "rank 1" in dash.status.value and dash.progress.bar_style == "danger"
    assert dash.progress.value == 2  # rank 0 finished steps 0 and 1 before rank 1 raised
    with pytest.raises(Exception, match="rank 1 failed"):
        dash.wait(1, raise_on_error=True)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_stop_stops_a_running_job(dashboards):
    dash = dashboards(preset="tiny", nproc=2, dp_shard=2, steps=10_000)
    run = dash.launch()
    deadline = time.monotonic() + 90
    while dash.progress.value < 1 and time.monotonic() < deadline:  # it is really training
        time.sleep(0.1)
    assert dash.progress.value >= 1
    dash.stop()
    assert run.done and run.status == "stopped"
    assert dash.wait(10) is run
    assert dash.progress.bar_style == "warning" and "stopped" in dash.status.value
    assert dash.error_panel.layout.display == "none"
    assert not dash.launch_button.disabled and dash.stop_button.disabled

    # Stopped while the ranks are still starting: still shown as stopped, not as a failure.
    early = dash.launch()
    dash.stop()
    assert early.done and dash.wait(10) is early
    assert "stopped" in dash.status.value and dash.error_panel.layout.display == "none"


@pytest.mark.timeout(120)
def test_runs_overlay_until_cleared(dashboards):
    dash = dashboards(preset="tiny", nproc=1, steps=2)
    first = dash.launch()
    dash.wait(60)
    dash.controls["seed"].value = 1
    second = dash.launch()
    dash.wait(60)
    assert dash.runs == [first, second] and dash.run is second
    names = [t.name for t in dash.loss_fig.data]
    assert names == [f"#0 tiny single process ({first.run_dir.name}) r0",
                     f"#1 tiny single process ({second.run_dir.name}) r0"]  # two runs, told apart
    assert [len(t.x) for t in dash.loss_fig.data] == [2, 2]
    assert first.losses() != second.losses()  # a different seed: a different curve, kept side by side
    # The title stays at the top of the figure and each legend entry gets its own row between it and the
    # plot, so a growing list of runs pushes the plot down instead of covering the title.
    lay = dash.loss_fig.layout
    assert lay.title.yref == "container" and lay.legend.orientation == "v" and lay.legend.y > 1
    assert lay.margin.t == 45 + dashboard_module.LEGEND_ROW_PX * 2
    assert lay.height - lay.margin.t - lay.margin.b == dashboard_module.PLOT_PX  # the plot keeps its height

    fig = plot_losses(first, second)
    assert [t.name for t in fig.data] == ["tiny single process"] * 2
    assert list(fig.data[1].y) == pytest.approx(second.losses())

    dash.clear()
    assert len(dash.loss_fig.data) == 0 and len(dash.tps_fig.data) == 0
    assert dash.loss_fig.layout.margin.t == 45  # no legend rows left
    assert dash.runs == [first, second]  # clearing the plot forgets no run


def _replayed_run(run_dir, events) -> Run:
    """A finished Run over hand-written events: a real (already exited) process and a real events.jsonl."""
    run_dir.mkdir(parents=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return Run(build_job("tiny", nproc=2, dp_shard=2, steps=2), run_dir, proc, run_dir / "launcher.log")


def _step(rank, step, mem_bytes, **extra):
    return {"type": "step", "rank": rank, "time": 100.0 + step, "step": step, "loss": 5.0 - step,
            "tokens_per_s": 1000.0, "step_time_s": 0.1, "mem_bytes": mem_bytes, **extra}


def _memory(rank, step, peak, live, **by_category):
    return {"type": "memory", "rank": rank, "time": 100.5 + step, "step": step, "live_bytes": live,
            "peak_bytes": peak, "by_category": by_category}


MiB = 2**20
# rank 0 records memory (--memory) for both steps; rank 1 has only its step events' mem_bytes
EVENTS = [_step(0, 0, 900 * MiB), _memory(0, 0, 40 * MiB, 10 * MiB, parameter=8 * MiB, activation=32 * MiB),
          _step(1, 0, 950 * MiB), _step(0, 1, 910 * MiB), _memory(0, 1, 44 * MiB, 12 * MiB, parameter=8 * MiB),
          _step(1, 1, 960 * MiB, peak_mem_bytes=50 * MiB)]


def test_memory_history_prefers_memory_events(tmp_path):
    run = _replayed_run(tmp_path / "run", EVENTS)
    memory = run.memory_history()
    assert memory[["rank", "step", "peak_bytes", "source"]].values.tolist() == [
        [0, 0, 40 * MiB, "memory"], [0, 1, 44 * MiB, "memory"],
        [1, 0, 950 * MiB, "mem_bytes"], [1, 1, 50 * MiB, "peak_mem_bytes"]]
    assert memory["live_bytes"].tolist()[:2] == [10 * MiB, 12 * MiB]
    assert memory["activation"].tolist()[0] == 32 * MiB and memory["parameter"].tolist()[1] == 8 * MiB
    assert list(_replayed_run(tmp_path / "empty", []).memory_history().columns) == [
        "rank", "step", "peak_bytes", "live_bytes", "source", "time"]


def test_memory_panel_draws_each_ranks_memory_per_step(dashboards, tmp_path, monkeypatch):
    run = _replayed_run(tmp_path / "replayed", EVENTS)
    monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: run)  # the run already happened
    dash = dashboards(preset="tiny", nproc=2, dp_shard=2, steps=2)
    assert dash.launch() is run and dash.wait(30) is run
    traces = {t.name: t for t in dash.memory_fig.data}
    label = "#0 tiny dp_shard=2 (replayed)"
    assert set(traces) == {f"{label} r0", f"{label} r1"}
    r0, r1 = traces[f"{label} r0"], traces[f"{label} r1"]
    assert (list(r0.x), list(r0.y), list(r0.text)) == ([0, 1], [40.0, 44.0], ["memory", "memory"])
    assert (list(r1.y), list(r1.text)) == ([950.0, 50.0], ["mem_bytes", "peak_mem_bytes"])
    assert r0.line.dash != r1.line.dash and r0.line.color == r1.line.color  # one run, one colour
    assert dash.memory_fig.layout.title.text == "Memory per step: each rank's peak within the step"
    dash.clear()
    assert len(dash.memory_fig.data) == 0


# Four steps of a 2-rank run as the trainer writes them, after the launcher's first event (half a second
# before step 0's): grad_norm and lr are the whole job's (alike on both ranks), step time is each rank's.
LAUNCHED_AT = 99.5
GRAD_NORMS, LRS, STEP_TIMES = [4.0, 2.0, 8.0, 1.0], [1e-4, 2e-4, 3e-4, 3e-4], [0.3, 0.1, 0.2, 0.1]
METRIC_EVENTS = [{"type": "launch", "rank": -1, "time": LAUNCHED_AT, "nproc": 2}] + [
    _step(rank, step, (900 + step) * MiB, grad_norm=GRAD_NORMS[step], lr=LRS[step],
          step_time_s=STEP_TIMES[step] + 0.05 * rank)
    for step in range(4) for rank in (0, 1)]


@pytest.fixture
def replayed(dashboards, tmp_path, monkeypatch):
    """A dashboard that has drawn finished runs of hand-written events (``replayed(n)``: n of them)."""

    def make(n: int = 1, events=METRIC_EVENTS):
        runs = [_replayed_run(tmp_path / f"replayed{i}", events) for i in range(n)]
        pending = list(runs)
        monkeypatch.setattr(dashboard_module, "launch", lambda *args, **kwargs: pending.pop(0))
        dash = dashboards(preset="tiny", nproc=2, dp_shard=2, steps=4)
        for run in runs:
            assert dash.launch() is run and dash.wait(30) is run
        return dash, [f"#{i} tiny dp_shard=2 (replayed{i})" for i in range(n)]

    return make


def _widgets_under(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _widgets_under(child)


def _traces(fig) -> dict:
    return {t.name: t for t in fig.data}


def test_every_step_metric_gets_a_figure_with_honest_units(replayed):
    dash, [label] = replayed()
    shown = list(_widgets_under(dash.widget))
    for fig in (dash.loss_fig, dash.tps_fig, dash.memory_fig, dash.grad_norm_fig, dash.lr_fig, dash.step_time_fig):
        assert any(w is fig for w in shown)  # on screen, no code needed
    # grad norm and lr are the same on every rank: one line per run, rank 0's, and the axis says global
    assert set(_traces(dash.grad_norm_fig)) == {label} and set(_traces(dash.lr_fig)) == {label}
    grad, lr = _traces(dash.grad_norm_fig)[label], _traces(dash.lr_fig)[label]
    assert (list(grad.x), list(grad.y)) == ([0, 1, 2, 3], GRAD_NORMS)
    assert list(lr.y) == LRS
    assert "(global)" in dash.grad_norm_fig.layout.yaxis.title.text
    assert "(global)" in dash.lr_fig.layout.yaxis.title.text
    # step time is each rank's own: a line per rank, in seconds
    times = _traces(dash.step_time_fig)
    assert set(times) == {f"{label} r0", f"{label} r1"}
    assert list(times[f"{label} r0"].y) == pytest.approx(STEP_TIMES)
    assert list(times[f"{label} r1"].y) == pytest.approx([t + 0.05 for t in STEP_TIMES])
    assert "seconds" in dash.step_time_fig.layout.yaxis.title.text
    assert "per rank" in dash.step_time_fig.layout.yaxis.title.text
    dash.clear()
    assert all(len(fig.data) == 0 for fig in (dash.grad_norm_fig, dash.lr_fig, dash.step_time_fig))


def test_smoothing_draws_the_ema_over_a_faint_raw_line(replayed):
    dash, [label] = replayed()
    w = 0.6
    dash.smoothing.value = w
    grad = _traces(dash.grad_norm_fig)
    raw, smooth = grad[label], grad[f"{label} (EMA)"]
    expected = [GRAD_NORMS[0]]  # s_0 = x_0, s_t = w s_(t-1) + (1 - w) x_t
    for x in GRAD_NORMS[1:]:
        expected.append(w * expected[-1] + (1 - w) * x)
    assert list(smooth.y) == pytest.approx(expected) == [4.0, 3.2, 5.12, 3.472]
    assert list(smooth.x) == list(raw.x) and list(raw.y) == GRAD_NORMS  # the raw points stay, faint
    assert raw.opacity < smooth.opacity == 1 and smooth.showlegend is False
    assert set(_traces(dash.loss_fig)) == {f"{label} r0", f"{label} r1", f"{label} r0 (EMA)", f"{label} r1 (EMA)"}
    assert list(_traces(dash.loss_fig)[f"{label} r0 (EMA)"].y) == pytest.approx([5.0, 4.6, 3.96, 3.176])
    assert set(_traces(dash.lr_fig)) == {label}  # a schedule, not a noisy measurement: not smoothed
    dash.smoothing.value = 0.9  # another weight redraws the same lines
    assert _traces(dash.grad_norm_fig)[f"{label} (EMA)"].y[1] == pytest.approx(0.9 * 4 + 0.1 * 2)
    dash.smoothing.value = 0  # raw again
    assert set(_traces(dash.grad_norm_fig)) == {label} and raw.opacity == 1


def test_log_scale_applies_to_loss_grad_norm_and_step_time(replayed):
    dash, _ = replayed()
    logged = (dash.loss_fig, dash.grad_norm_fig, dash.step_time_fig)
    dash.log_y.value = True
    assert [fig.layout.yaxis.type for fig in logged] == ["log"] * 3
    assert all(fig.layout.yaxis.type != "log" for fig in (dash.tps_fig, dash.lr_fig, dash.memory_fig))
    dash.log_y.value = False
    assert [fig.layout.yaxis.type for fig in logged] == ["linear"] * 3


def test_wall_clock_axis_is_seconds_since_each_runs_first_event(replayed):
    dash, labels = replayed(2)  # both runs drawn: a control redraws the earlier one too, nothing relaunched
    dash.x_axis.value = "time"
    since_launch = [100.0 + step - LAUNCHED_AT for step in range(4)]
    for label in labels:
        assert list(_traces(dash.loss_fig)[f"{label} r1"].x) == pytest.approx(since_launch)
        assert list(_traces(dash.grad_norm_fig)[label].x) == pytest.approx(since_launch)
        assert list(_traces(dash.memory_fig)[f"{label} r0"].x) == pytest.approx(since_launch)
    assert "seconds since the run started" in dash.step_time_fig.layout.xaxis.title.text
    dash.x_axis.value = "step"
    assert list(_traces(dash.lr_fig)[labels[0]].x) == [0, 1, 2, 3]
    assert dash.loss_fig.layout.xaxis.title.text == "step"
    assert len(dash.runs) == 2


def _interleaved_events(steps=(0, 1)) -> list[dict]:
    """pp=2, v=2 (Interleaved1F1B): rank 0 runs stages 0 and 2, rank 1 stages 1 and 3; m=2, unit-time actions."""
    events = [{"type": "pipeline", "rank": r, "schedule": "Interleaved1F1B", "microbatches": 2} for r in (0, 1)]
    for step in steps:
        acts = {0: [], 1: []}
        t = 100.0 * (step + 1)
        for mb in range(2):
            for stage in range(4):
                acts[stage % 2].append({"stage": stage, "microbatch": mb, "phase": "F", "start": t, "end": t + 1})
                t += 1
        for mb in range(2):
            for stage in reversed(range(4)):
                acts[stage % 2].append({"stage": stage, "microbatch": mb, "phase": "B", "start": t, "end": t + 1})
                t += 1
        events += [{"type": "schedule", "rank": r, "step": step, "actions": a} for r, a in acts.items()]
    return events


def test_interleaved_timeline_has_a_row_per_rank_and_tells_its_stages_apart(replayed):
    from workbench.widgets.plots import plot_pipeline_timeline

    fig = plot_pipeline_timeline(_interleaved_events())
    rows = ["stages 0, 2 · rank 0", "stages 1, 3 · rank 1"]
    assert list(fig.layout.yaxis.categoryarray) == rows  # one row per rank, not per stage
    bars = [(y, text, tuple(cd), t.marker.color) for t in fig.data for y, text, cd in zip(t.y, t.text, t.customdata)]
    assert len(bars) == 16  # 4 stages x 2 microbatches x F, B
    for row, text, (stage, rank, mb, phase, *_), _color in bars:
        assert row == rows[rank] and text == f"{phase}{mb} s{stage}"  # the bar says its stage
    # on rank 0, stage 0's and stage 2's forward of one microbatch differ in colour too (the later stage lighter)
    color = {(cd[0], cd[2], cd[3]): c for _, _, cd, c in bars}
    assert color[(0, 0, "F")] != color[(2, 0, "F")] and color[(0, 0, "F")] != color[(0, 1, "F")]
    assert color[(0, 0, "F")] == color[(1, 0, "F")]  # each rank's first stage: the microbatch's own colour
    assert "lighter" in fig.layout.title.text and fig.layout.meta["stages_per_rank"] == 2

    # GPipe / 1F1B (one stage per rank): the same one row per rank, bars labelled as before
    gpipe = [e for e in _interleaved_events() if e["type"] == "schedule"]
    for e in gpipe:
        e["actions"] = [dict(a, stage=e["rank"]) for a in e["actions"] if a["stage"] < 2]
    fig = plot_pipeline_timeline(gpipe)
    assert list(fig.layout.yaxis.categoryarray) == ["stage 0 · rank 0", "stage 1 · rank 1"]
    assert sorted(x for t in fig.data for x in t.text) == sorted(f"{p}{m}" for p in "FFBB" for m in (0, 1))

    # the dashboard's timeline is the same figure
    dash, _ = replayed(events=_interleaved_events())
    assert list(dash.timeline_fig.layout.yaxis.categoryarray) == rows
    assert "v=2" in dash.bubble_label.value


def test_core_never_imports_the_widget_layer():
    code = ("import sys, workbench, workbench.cli, workbench.train.launcher; "
            "print([m for m in sys.modules if m.split('.')[0] in ('ipywidgets', 'plotly', 'anywidget') "
            "or m.startswith('workbench.widgets')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_embedding_task_draws_retrieval_accuracy(dashboards):
    """The embedding preset: the same launch and event stream, plus held-out retrieval against chance."""
    dash = dashboards(task="embedding", preset="tiny", nproc=2, dp_shard=2, steps=6, global_batch=8,
                      eval_every=3, chunk=2)
    assert dash.controls["task"].value == "embedding" and dash.controls["global_batch"].value == 8
    assert dash.embedding.chunk == 2 and dash.settings["task"].name == "embedding"
    assert dash.settings["lr"] == 1e-3  # the preset's defaults
    assert dash.accuracy_box.layout.display == "none"
    run = dash.launch()
    assert dash.wait(90) is run and run.status == "succeeded", dash.status.value
    assert (run.run_dir / "embedding.json").exists() and (run.run_dir / "task.json").exists()
    assert dash.accuracy_box.layout.display == ""
    evals = [e for e in run.events_since(0) if e["type"] == "eval" and e["rank"] == 0]
    acc = next(t for t in dash.accuracy_fig.data if t.name != "chance")
    assert list(acc.x) == [0, 3, 6] == [e["step"] for e in evals]
    assert list(acc.y) == [e["retrieval_accuracy"] for e in evals]
    chance = next(t for t in dash.accuracy_fig.data if t.name == "chance")
    assert list(chance.y) == [1 / 200, 1 / 200]
    label = f"#0 tiny dp_shard=2 ({run.run_dir.name})"
    assert _trace_points(dash.loss_fig) == {f"{label} r0": 6, f"{label} r1": 6}
    assert "top-1" in dash.status.value
    # a bad embedding setting is one line in the error panel, and nothing launches
    dash.embedding = dataclasses.replace(dash.embedding, matryoshka="512")
    assert dash.launch() is None and "exceed the embedding size" in dash.error_panel.value
    dash.controls["task"].value = "lm"  # the language-model task ignores the embedding settings
    assert "task" not in dash.settings


def test_pipeline_settings_follow_pp_and_a_refused_launch_says_what_is_shown():
    """Notebook 02's suggestion, done in its dashboard: from a pp=2 GPipe run to tiny-moe, pp=1, dp_shard=2,
    ep=2. The microbatches box still says 4; it used to refuse the launch ("microbatches=4 applies to
    pipeline parallelism") under a green bar and the last run's timeline."""
    dash = RunDashboard(preset="tiny", pp=2, pp_schedule="GPipe", microbatches=4, nproc=2, steps=2)
    c = dash.controls
    assert not c["microbatches"].disabled and not c["pp_schedule"].disabled
    c["preset"].value, c["pp"].value, c["dp_shard"].value, c["ep"].value = "tiny-moe", 1, 2, 2
    assert c["microbatches"].disabled and c["pp_schedule"].disabled
    assert c["microbatches"].tooltip.endswith("(applies when pp > 1)")
    settings = dash.settings
    assert settings["microbatches"] is None
    model = settings.pop("model")
    job = build_job(model, **settings)  # what Launch builds: valid now
    assert job.parallel.ep == 2 and job.parallel.pp == 1
    c["pp"].value = 2
    assert not c["microbatches"].disabled and dash.settings["microbatches"] == 4
    assert not c["microbatches"].tooltip.endswith("(applies when pp > 1)")

    c["pp"].value, c["tp"].value = 1, 3  # tiny has 4 heads: refused before anything starts
    assert dash.launch() is None and dash.run is None
    assert "not launched: invalid configuration" in dash.status.value and "d62728" in dash.status.value
    assert "tp=3" in dash.error_panel.value and dash.error_panel.layout.display == ""
