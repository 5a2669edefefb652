"""``workbench time show|import|compare``: tables and one JSON document over saved timelines and traces, and
one ``error:`` line (exit 2) for every input it cannot use."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from workbench.cli import main
from workbench.time import labels
from workbench.time.timeline import StepTimeline, span_frame


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def two_ranks(slow: float = 0.0, source: str = "measured") -> StepTimeline:
    rows = []
    for step in (0, 1):
        t = 10.0 * step
        rows += [
            dict(rank=0, start=t, end=t + 1.0, category="forward", step=step),
            dict(rank=0, start=t + 0.5, end=t + 1.5, category="communication", stream="comm", name="all_gather",
                 step=step),
            dict(rank=0, start=t + 2.0, end=t + 3.0, category="backward", step=step),
            dict(rank=1, start=t, end=t + 1.8 + slow, category="forward", step=step),
            dict(rank=1, start=t + 2.0 + slow, end=t + 3.0 + slow, category="backward", step=step),
        ]
    return StepTimeline(span_frame(rows), source=source)


@pytest.fixture
def saved(tmp_path):
    a = two_ranks().save(tmp_path / "a")
    b = two_ranks(slow=1.0, source="imported").save(tmp_path / "b.json")
    return a, b


def test_show_json_is_one_document_with_exact_figures(capsys, saved):
    code, out, err = run(capsys, "time", "show", str(saved[0]), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["ranks"] == [0, 1] and doc["steps"] == [0, 1]
    b0 = next(r for r in doc["breakdown"] if r["rank"] == 0 and r["step"] == 1)
    assert b0 == pytest.approx({"rank": 0, "step": 1, "forward": 1.0, "backward": 1.0, "optimizer": 0.0,
                                "communication": 0.5, "data": 0.0, "checkpoint": 0.0, "idle": 0.5, "step_s": 3.0})
    o0 = next(r for r in doc["overlap"] if r["rank"] == 0 and r["step"] == 0)
    assert o0 == pytest.approx({"rank": 0, "step": 0, "comm_s": 1.0, "exposed_s": 0.5, "overlapped_s": 0.5,
                                "exposed_fraction": 0.5})
    i0 = next(r for r in doc["idle"] if r["rank"] == 0 and r["step"] == 0)
    assert i0 == pytest.approx({"rank": 0, "step": 0, "host_s": 0.2, "rank_s": 0.3, "bubble_s": 0.0})
    assert doc["straggler_ranks"] == [1] and len(doc["stragglers"]) == 2


def test_show_rank_keeps_the_cross_rank_analysis_and_prints_one_rank(capsys, saved):
    code, out, _ = run(capsys, "time", "show", str(saved[0]), "--rank", "0", "--json")
    doc = json.loads(out)
    assert code == 0 and {r["rank"] for r in doc["idle"]} == {0}
    assert doc["idle"][0]["rank_s"] == pytest.approx(0.3)  # rank 1's work is still seen
    code, out, _ = run(capsys, "time", "show", str(saved[0]))
    assert code == 0
    assert "step timeline, cpu, 2 rank(s)" in out and "straggler(s): rank 1" in out
    assert "forward" in out and "exposed%" in out


def test_compare_two_saved_timelines(capsys, saved):
    code, out, err = run(capsys, "time", "compare", str(saved[0]), str(saved[1]), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["step_time_a_s"] == pytest.approx(3.0) and doc["step_time_b_s"] == pytest.approx(4.0)
    assert doc["step_time_ratio"] == pytest.approx(4 / 3)
    assert doc["categories"]["forward"]["delta_s"] == pytest.approx(0.5)  # rank 1's forward: +1 s, mean of 2
    code, out, _ = run(capsys, "time", "compare", str(saved[0]), str(saved[1]))
    assert code == 0 and "B/A x1.333" in out and "forward" in out


def test_compare_without_b_needs_a_run_directory(capsys, saved):
    code, out, err = run(capsys, "time", "compare", str(saved[0]))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert "pass a second timeline" in err


def _file(d, name: str, data: bytes):
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)
    return d / name


@pytest.mark.parametrize("make, says", [
    (lambda d: d / "missing", "no such file or directory"),
    (lambda d: _file(d, "run/config.json", b"{}").parent, "--profile"),
    (lambda d: _file(d, "x.json", b'{"hello": 1}'), "x.json"),
    (lambda d: _file(d, "t.json.gz", b"not gzip"), "t.json.gz"),
    (lambda d: _file(d, "empty/notes.txt", b"").parent, "empty"),
])
def test_show_refuses_what_it_cannot_read_in_one_line(capsys, tmp_path, make, says):
    pytest.importorskip("workbench.time.trace")
    path = make(tmp_path)
    code, out, err = run(capsys, "time", "show", str(path))
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    code, out, err = run(capsys, "time", "show", str(path), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["status"] == "error" and says in doc["error"]


def test_bad_rank_and_threshold_are_refused(capsys, saved):
    code, _, err = run(capsys, "time", "show", str(saved[0]), "--rank", "7")
    assert code == 2 and "rank 7 is not in" in err and "0-1" in err
    with pytest.raises(SystemExit) as e:
        main(["time", "show", str(saved[0]), "--threshold", "-1"])
    assert e.value.code == 2 and "fraction" in capsys.readouterr().err


def _trace(path, rank: int = 0):
    """A one-process torch.profiler trace of two labelled steps, as `train --profile` would write it."""
    a = torch.randn(64, 64)
    sched = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with labels.labelled(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   schedule=sched) as prof:
        for _ in range(3):
            with labels.label(labels.FORWARD):
                b = a @ a
            with labels.label(labels.BACKWARD):
                b @ a
            with labels.label(labels.OPTIMIZER):
                a.add_(0.0)
            prof.step()
    prof.export_chrome_trace(str(path))
    return path


def test_import_saves_a_timeline_that_show_reads_back(capsys, tmp_path):
    pytest.importorskip("workbench.time.trace")
    trace = _trace(tmp_path / "rank0.pt.trace.json.gz")
    code, out, err = run(capsys, "time", "import", str(trace), "--out", str(tmp_path / "imp"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["saved"].endswith("step_timeline.json") and doc["ranks"] == [0]
    assert len(doc["steps"]) == 2
    row = doc["breakdown"][0]
    assert row["forward"] > 0 and row["backward"] > 0 and row["optimizer"] > 0
    code, out2, err = run(capsys, "time", "show", str(tmp_path / "imp"), "--json")
    assert code == 0, err
    assert json.loads(out2)["breakdown"] == doc["breakdown"]
    # the trace itself, and a trace against its saved import: the same step time
    code, out3, err = run(capsys, "time", "compare", str(trace), str(tmp_path / "imp"), "--json")
    assert code == 0 and json.loads(out3)["step_time_ratio"] == pytest.approx(1.0)


def test_time_registers_the_other_subcommands_when_their_modules_exist(capsys):
    with pytest.raises(SystemExit):
        main(["time", "--help"])
    out = capsys.readouterr().out
    for cmd in ("show", "import", "compare"):
        assert cmd in out
    for module, cmd in (("workbench.prediction.step_time_cli", "predict"),
                        ("workbench.prediction.time_calibrate_cli", "calibrate")):
        try:
            importlib.import_module(module)
            present = True
        except ImportError:
            present = False
        assert (f"{cmd}  " in out or f"{cmd}\n" in out or f",{cmd}" in out) == present, (module, out)
