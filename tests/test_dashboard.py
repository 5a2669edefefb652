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
                             "device": "auto"}
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

    fig = plot_losses(first, second)
    assert [t.name for t in fig.data] == ["tiny single process"] * 2
    assert list(fig.data[1].y) == pytest.approx(second.losses())

    dash.clear()
    assert len(dash.loss_fig.data) == 0 and len(dash.tps_fig.data) == 0
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
