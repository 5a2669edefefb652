"""``workbench train ... --profile [STEPS]``: torch.profiler traces per rank in RUN_DIR/profile, the trainer's
labels in them, a ``profile`` event pointing at each, and one-line refusals of bad values."""

from __future__ import annotations

import gzip
import json
import subprocess
import time
from collections import Counter

import pytest
import torch

from workbench.time import labels
from workbench.train.profiling import StepProfiler


def _names(trace_path) -> Counter:
    with gzip.open(trace_path, "rt") as f:
        doc = json.load(f)
    return Counter(e["name"] for e in doc["traceEvents"]
                   if str(e.get("name", "")).startswith(("workbench.", "ProfilerStep#")))


# -- the option -----------------------------------------------------------------------------------------

def test_profile_alone_means_three_steps_and_is_off_by_default():
    from workbench.cli import build_parser

    p = build_parser()
    assert p.parse_args(["train", "tiny", "--profile"]).profile == 3
    assert p.parse_args(["train", "tiny", "--profile", "2"]).profile == 2
    assert p.parse_args(["train", "tiny"]).profile is None


@pytest.mark.parametrize("argv, says", [
    (["--profile", "0"], "profile=0 must be a positive number of steps to trace (e.g. --profile 3"),
    (["--profile", "5", "--steps", "3"], "pass --profile 2 or fewer, or --steps 6 or more"),
    (["--profile", "--steps", "1"], "pass --steps 4 or more"),
])
def test_bad_profile_values_are_one_line_naming_the_fix(capsys, tmp_path, argv, says):
    from workbench.cli import main

    code = main(["train", "tiny", "--out", str(tmp_path / "r"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()  # refused before anything is created


# -- labels ---------------------------------------------------------------------------------------------

def test_labels_cost_nothing_while_off_and_name_the_parts_of_a_step_while_on(tmp_path):
    assert not labels.enabled()
    assert labels.label(labels.FORWARD) is labels.microbatch_label(labels.BACKWARD, 3)  # the shared no-op
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        with labels.label(labels.FORWARD):
            pass
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 2e-6, f"{per_call * 1e6:.2f} us per unlabelled range (record_function costs ~6 us)"

    a = torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, labels.labelled():
        with labels.label(labels.OPTIMIZER):
            a @ a
        with labels.microbatch_label(labels.FORWARD, 2):
            a @ a
        for _ in labels.labelled_batches([1, 2]):
            pass
    assert not labels.enabled()
    names = Counter(e.name for e in prof.events())
    assert names["workbench.optimizer"] == 1 and names["workbench.forward#mb2"] == 1
    assert names["workbench.data"] == 3  # two batches and the fetch that finds the end


def test_step_profiler_traces_the_steps_after_one_warm_up_and_numbers_them_as_training_steps(tmp_path):
    events = []
    p = StepProfiler(str(tmp_path), 3, 2, 5, 9, torch.device("cpu"), lambda t, **kw: events.append({"type": t, **kw}))
    a = torch.randn(16, 16)
    on = []
    for step in range(5, 9):
        p.begin(step)
        on.append(labels.enabled())
        with labels.label(labels.FORWARD):
            a @ a
        p.end(step)
    p.close()
    assert on == [True, True, True, False] and not labels.enabled()
    assert events == [{"type": "profile", "path": "profile/rank3.pt.trace.json.gz", "steps": [6, 7],
                       "warmup_steps": [5], "activities": ["cpu"]}]
    names = _names(tmp_path / "profile" / "rank3.pt.trace.json.gz")
    assert names["ProfilerStep#6"] == 1 and names["ProfilerStep#7"] == 1 and "ProfilerStep#5" not in names
    assert names["workbench.forward"] == 2  # the warm-up step's ranges are discarded
    assert not list((tmp_path / "profile").glob("*.tmp.*"))


def test_a_resumed_run_traces_what_is_left_and_says_when_nothing_is(tmp_path):
    events = []
    emit = lambda t, **kw: events.append({"type": t, **kw})  # noqa: E731
    p = StepProfiler(str(tmp_path), 0, 3, 10, 12, torch.device("cpu"), emit)  # steps 10 (warm-up) and 11
    for step in (10, 11):
        p.begin(step)
        p.end(step)
    assert events[-1]["steps"] == [11]
    none = StepProfiler(str(tmp_path / "b"), 0, 3, 11, 12, torch.device("cpu"), emit)
    none.begin(11)
    none.end(11)
    none.close()
    assert events[-1]["path"] is None and "no step left" in events[-1]["reason"] and not labels.enabled()


def test_a_run_failing_mid_trace_writes_no_trace_and_switches_labels_off(tmp_path):
    events = []
    p = StepProfiler(str(tmp_path), 0, 3, 0, 10, torch.device("cpu"), lambda t, **kw: events.append(t))
    p.begin(0)
    p.end(0)
    p.begin(1)
    p.close()  # the trainer's finally after an exception in step 1
    assert events == [] and not (tmp_path / "profile").exists() and not labels.enabled()


# -- a real run -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def profiled_pp_run(tmp_path_factory, request):
    """`workbench train small --nproc 2 --pp 2 --profile 2 --steps 3` on CPU (gloo)."""
    from pathlib import Path
    import sys

    out = tmp_path_factory.mktemp("profiled") / "run"
    exe = Path(sys.executable).with_name("workbench")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "workbench.cli"]
    res = subprocess.run([*cli, "train", "small", "--nproc", "2", "--pp", "2", "--steps", "3", "--profile", "2",
                          "--out", str(out), "--json"], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, cli


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_every_rank_writes_a_labelled_trace_and_a_profile_event(profiled_pp_run):
    from workbench.train.events import read_events

    out, _ = profiled_pp_run
    ev = [e for e in read_events(out) if e["type"] == "profile"]
    assert sorted(e["rank"] for e in ev) == [0, 1]
    for e in ev:
        assert e["path"] == f"profile/rank{e['rank']}.pt.trace.json.gz" and e["steps"] == [1, 2]
        path = out / e["path"]
        with gzip.open(path, "rt") as f:
            doc = json.load(f)
        assert doc["distributedInfo"]["rank"] == e["rank"] and doc["distributedInfo"]["world_size"] == 2
        names = _names(path)
        assert names["ProfilerStep#1"] == names["ProfilerStep#2"] == 1
        for mb in (0, 1):  # the pipeline stage's microbatches, each step
            assert names[f"workbench.forward#mb{mb}"] == 2 and names[f"workbench.backward#mb{mb}"] == 2
        assert names["workbench.optimizer"] == 2 and names["workbench.data"] >= 2


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_time_show_json_breaks_the_profiled_run_down_per_rank_and_step(profiled_pp_run):
    out, cli = profiled_pp_run
    res = subprocess.run([*cli, "time", "show", str(out), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["status"] == "ok" and doc["source"] == "measured" and doc["ranks"] == [0, 1] and doc["steps"] == [1, 2]
    rows = doc["breakdown"]
    assert sorted((r["rank"], r["step"]) for r in rows) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    from workbench.time.timeline import CATEGORIES

    for r in rows:
        assert sum(r[c] for c in CATEGORIES) == pytest.approx(r["step_s"], rel=1e-9)
        assert r["forward"] > 0 and r["backward"] > 0 and r["optimizer"] > 0
    # the last stage waits for the first one's activations before its first microbatch: the bubble
    idle = {(r["rank"], r["step"]): r for r in doc["idle"]}
    assert idle[(1, 1)]["bubble_s"] > 0 and idle[(1, 2)]["bubble_s"] > 0
    assert {r["rank"] for r in doc["stragglers"]} == {0, 1}
    res = subprocess.run([*cli, "time", "compare", str(out), str(out / "profile"), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["step_time_ratio"] == pytest.approx(1.0)


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_time_compare_puts_a_profiled_run_beside_the_prediction_of_its_layout(profiled_pp_run):
    step_time = pytest.importorskip("workbench.prediction.step_time")
    if not hasattr(step_time, "predict_time"):
        pytest.skip("workbench.prediction.step_time.predict_time is not there yet")
    out, cli = profiled_pp_run
    res = subprocess.run([*cli, "time", "compare", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["a"] == "measured (cpu)" and doc["b"].startswith("predicted")
    assert doc["step_time_a_s"] > 0 and doc["step_time_b_s"] > 0 and doc["step_time_ratio"] > 0
    assert {r["rank"] for r in doc["rows"]} == {0, 1}  # every measured rank meets its representative


def test_overwriting_a_run_deletes_its_traces(tmp_path):
    from workbench.train.rundir import clear_run

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "rank0.pt.trace.json.gz").write_bytes(b"x")
    assert "profile" in clear_run(tmp_path) and not (tmp_path / "profile").exists()
