"""Run directories and plan JSON that are damaged or hostile (issue 27, classes 1-3 of the fuzzer's findings).

1. events.jsonl lines: a damaged line (not UTF-8, nested 10^5 deep, not an object, fields of the wrong
   type) is skipped and counted, in the Python API and in the server's answers; a file none of whose
   lines is an event is one error naming it.
2. The run directory's files: events.jsonl that is a FIFO, a directory or a link out of the run, and a
   config.json linked out of the run, are refused in one line (a FIFO without blocking).
3. Plan JSON: every damaged field is one ValueError naming the file and the field, from the Python API
   (``from_json``, ``load``) and the server (``plan``, ``open``), never KeyError/TypeError/IndexError/500.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

import workbench
from workbench.config import JobConfig, ParallelConfig
from workbench.jupyter.files import Refused
from workbench.plan.types import ShardingPlan
from workbench.safeio import FileRefused
from workbench.train import events as events_module
from workbench.train.events import EventReader, EventWriter, read_events

# -- a run directory ---------------------------------------------------------------------------------


def _run(d: Path) -> Path:
    """A finished two-step pp=2 run's events, as the launcher and the ranks write them, and its config."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(JobConfig().to_json())
    with EventWriter(d, -1) as w:
        w.emit("launch", nproc=2)
    for rank in (0, 1):
        with EventWriter(d, rank) as w:
            w.emit("pipeline", schedule="GPipe", microbatches=2)
            for step in (0, 1):
                w.emit("step", step=step, loss=2.0 - step, tokens_per_s=10.0, mem_bytes=1000 + rank)
                acts = [{"stage": rank, "microbatch": m, "phase": ph, "start": step + rank + i, "end": step + rank + i + 1.0}
                        for i, (m, ph) in enumerate([(0, "F"), (1, "F"), (0, "B"), (1, "B")])]
                w.emit("schedule", step=step, actions=acts)
    with EventWriter(d, -1) as w:
        w.emit("run_end", status="succeeded")
    return d


DAMAGED_LINES = [
    b'{"type": "step", "rank": 0, "step": 5, "x": "\xff\xfe"}',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's depth
    b"[1, 2]", b"42", b'"text"', b"null", b"true",  # not objects
    b'{"type": "step", "rank": "x", "step": 1}',
    b'{"type": "step", "rank": 0, "step": [1]}',
    b'{"type": "step", "rank": 0, "step": 1, "loss": "nan"}',
    b'{"type": "step", "rank": 1e400, "step": 1}',
    b'{"type": "error", "rank": 0, "time": "x", "message": 5}',
    b'{"type": "schedule", "rank": 0, "step": 1, "actions": [{}]}',
    b'{"type": "schedule", "rank": 0, "step": 1, "actions": [{"stage": "0x10", "microbatch": 0, "phase": "F", '
    b'"start": 0, "end": 1}]}',
    b'{"type": "schedule", "rank": 0, "step": 1}',
    b'{"type": "pipeline", "rank": [], "schedule": {}}',
    b'{"type": "run_end", "rank": -1, "status": ["x"]}',
    b'{"type": "step", "rank": 0, "step": 1} {"type": "step", "rank": 0, "step": 2}',
    "\ufeff{}".encode("utf-16-le"),  # what json.loads(bytes) took for UTF-16
]


def _damage(run: Path) -> int:
    """Damaged lines spread through the run's events (one in the middle, the rest after); their count."""
    lines = (run / "events.jsonl").read_bytes().splitlines()
    lines[3:3] = DAMAGED_LINES[:1]
    lines += DAMAGED_LINES[1:]
    (run / "events.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return len(DAMAGED_LINES)


def test_damaged_event_lines_are_skipped_and_counted(tmp_path):
    run = _run(tmp_path / "run")
    good = read_events(run)
    n = _damage(run)
    assert read_events(run) == good  # every good event still read; nothing else
    reader = EventReader(run)
    assert reader.read_new() == good
    assert reader.skipped == n and reader.first_damage == "line 4: not UTF-8 text"
    assert all(isinstance(e, dict) and isinstance(e["type"], str) and isinstance(e["rank"], int) for e in good)


def test_a_live_reader_still_follows_the_file_and_counts_a_torn_line_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = run / "events.jsonl"
    path.write_bytes(b'{"type": "launch", "rank": -1, "time": 1.0}\n{"type": "st')
    reader = EventReader(run)
    assert [e["type"] for e in reader.read_new()] == ["launch"] and reader.skipped == 0  # partial: not yet
    with open(path, "ab") as f:  # a killed writer's torn line ends where the next writer's line begins
        f.write(b'{"type": "step", "rank": 0, "time": 2.0, "step": 0}\n')
    assert reader.read_new() == [] and reader.skipped == 1
    with open(path, "ab") as f:
        f.write(b'{"type": "step", "rank": 0, "time": 3.0, "step": 1}\n')
    assert [e["step"] for e in reader.read_new()] == [1] and reader.skipped == 1
    assert reader.first_damage.startswith("line 2: not JSON")


def test_a_file_with_no_event_at_all_is_one_error_naming_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_bytes(b"PK\x03\x04\x00\xff\n" + bytes(range(256)) * 4 + b"\n")
    with pytest.raises(ValueError) as e:
        read_events(run)
    msg = str(e.value)
    assert "events.jsonl: is not an event log" in msg and "line 1" in msg and "\n" not in msg
    (run / "events.jsonl").write_bytes(b"")  # empty: a run that has not written yet
    assert read_events(run) == []


def test_the_server_answers_a_damaged_run_and_says_how_many_lines_it_skipped(tmp_path):
    from workbench.jupyter.runs import run_events, run_pipeline

    run = _run(tmp_path / "run")
    n = _damage(run)
    out = run_events(tmp_path, run, points=4)
    assert out["status"] == "succeeded" and out["summary"]["skipped_lines"] == n
    assert out["summary"]["first_skipped"] == "line 4: not UTF-8 text"
    assert out["summary"]["steps_logged"] == 2 and out["summary"]["rss_bytes"] == 1001  # CPU mem_bytes: RSS
    assert "peak_mem_bytes" not in out["summary"]  # no peak recorded: RSS is never called one (issue 28)
    assert run_pipeline(tmp_path, run)["pp"] == 2
    (run / "events.jsonl").write_bytes(b"\x00\x01\n\x02\n")
    with pytest.raises(Refused) as e:
        run_events(tmp_path, tmp_path / "run")
    assert e.value.status == 422 and "none of its 2 line(s) is an event" in str(e.value)


def test_schedule_frame_of_hand_made_garbage_is_one_value_error():
    from workbench.parallel.pipeline_bubble import schedule_frame

    with pytest.raises(ValueError, match=r"a schedule event \(rank 0, step 1\) is not one the trainer writes: "
                                         r"a schedule action has no 'end'"):
        schedule_frame([{"type": "schedule", "rank": 0, "step": 1,
                         "actions": [{"stage": 0, "microbatch": 0, "phase": "F", "start": 0.0}]}])


# -- the run directory's files: confined, regular ---------------------------------------------------------


def _in_thread(fn, timeout: float = 10.0):
    """``fn()``'s result or exception, or ("hang", None) if it is still blocked after ``timeout`` s."""
    out: list = []

    def call():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out.append(("raised", e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ("hang", None)


def test_events_jsonl_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "events.jsonl")
    how, e = _in_thread(lambda: read_events(run))
    if how == "hang":  # a reader blocked in open() (the old one) is let go, so the test ends either way
        os.close(os.open(run / "events.jsonl", os.O_WRONLY | os.O_NONBLOCK))
    assert how == "raised" and isinstance(e, FileRefused) and e.reason == "special", (how, e)
    assert "events.jsonl: is a FIFO" in str(e)


def test_events_jsonl_that_is_a_directory_or_leads_out_of_the_run_is_refused(tmp_path):
    run = _run(tmp_path / "run")
    good = read_events(run)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (run / "events.jsonl").rename(outside / "events.jsonl")
    (run / "events.jsonl").symlink_to(outside / "events.jsonl")
    with pytest.raises(FileRefused) as e:
        read_events(run)
    assert e.value.reason == "outside" and "leads outside run/" in str(e.value)
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").symlink_to("../elsewhere/events.jsonl")  # relative, the same
    with pytest.raises(FileRefused):
        EventReader(run).read_new()
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").mkdir()
    with pytest.raises(FileRefused, match="events.jsonl: is a directory"):
        read_events(run)
    (run / "events.jsonl").rmdir()
    (outside / "events.jsonl").rename(run / "real.jsonl")
    (run / "events.jsonl").symlink_to("real.jsonl")  # a link that stays inside the run is its own file
    assert read_events(run) == good


def test_one_read_is_bounded_but_a_follower_reads_a_growing_file_in_parts(tmp_path, monkeypatch):
    run = _run(tmp_path / "run")
    size = (run / "events.jsonl").stat().st_size
    follower = EventReader(run)
    first = follower.read_new()
    monkeypatch.setattr(events_module, "EVENTS_MAX", size)
    with open(run / "events.jsonl", "ab") as f:
        f.write((run / "events.jsonl").read_bytes()[:size])  # the file doubles: each read takes its new part
    assert len(follower.read_new()) == len(first)
    with pytest.raises(FileRefused, match="bytes of events to read, more than one read takes") as e:
        read_events(run)  # the whole file at once: over the bound
    assert e.value.reason == "too-large"


def test_job_config_linked_out_of_its_run_is_refused(tmp_path):
    run = _run(tmp_path / "run")
    assert JobConfig.load(run / "config.json") == JobConfig()
    (run / "config.json").rename(tmp_path / "secret.json")
    (run / "config.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(ValueError, match=r"config.json: .*leads outside run/ through a symbolic link"):
        JobConfig.load(run / "config.json")


# -- plan JSON ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_doc() -> dict:
    return json.loads(workbench.plan("tiny", ParallelConfig(dp_shard=2, tp=2)).to_json())


def _set(path: str, value):
    def edit(d):
        *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


def _drop(path: str):
    def edit(d):
        *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in keys:
            d = d[k]
        del d[last]
    return edit


# (edit, the field the message must name): each raised KeyError, TypeError, AttributeError, IndexError,
# OverflowError or a pandas error before, or read on into numbers that mean nothing.
BAD_PLANS = {
    "summary is 5": (_set("summary", 5), "summary: is a number"),
    "no model_name": (_drop("summary.model_name"), "summary.model_name: is null"),
    "a tensor that is a number": (_set("tensors.1", 5), "tensors[1]: is a number, not an object"),
    "a tensor without dtype": (_drop("tensors.2.dtype"), "tensors[2]: has no 'dtype'"),
    "dtype a list": (_set("tensors.2.dtype", ["float32"]), "tensors[2].dtype: is not one of"),
    "kind unknown": (_set("tensors.2.kind", -9223372036854775808), "tensors[2].kind"),
    "shape an object": (_set("tensors.3.global_shape", {}), "tensors[3].global_shape: is an object"),
    "shape holds a list": (_set("tensors.3.global_shape.0", [4]), "tensors[3].global_shape[0]: is a list"),
    "shape 1e308": (_set("tensors.3.global_shape.0", 1e308), "tensors[3].global_shape[0]: is a number, not an int"),
    "shape 2^64": (_set("tensors.3.global_shape.0", 2**64), "tensors[3].global_shape[0]: size 18446744073709551616"),
    "split dim text": (_set("tensors.0.splits.0.0", "%s%n"), "tensors[0].splits[0]: is text"),
    "split mesh dim 7": (_set("tensors.0.splits.0.1", 7), "tensors[0].splits[0]: mesh dimension 7 is outside 0..3"),
    "split of 5 numbers": (_set("tensors.0.splits.0", [0, 1, 2, 1, 1]), "tensors[0].splits[0]: is a list of 5"),
    "split stride 2^63": (_set("tensors.0.splits.0.3", 2**63), "tensors[0].splits[0]: stride"),
    "holders text": (_set("tensors.0.holders", "%s"), "tensors[0].holders: is text"),
    "placements false": (_set("tensors.0.placements", False), "tensors[0].placements: is true/false"),
    "3 placements": (_set("tensors.0.placements", ["R", "R", "R"]), "tensors[0].placements: has 3 entries"),
    "comm without bytes": (_drop("comm.0.bytes_per_rank"), "comm[0].bytes_per_rank: is null"),
    "comm row text": (_set("comm.1", "1e30"), "comm[1]: is text, not an object"),
    "comm stage an object": (_set("comm.0.stage", {"0": 0}), "comm[0].stage: is an object"),
    "zero null": (_set("parallel.zero", None), "parallel: zero=None is unknown"),
    "unknown model field": (_set("model.norm_epsx", 1), "model: unknown ModelConfig field(s) ['norm_epsx']"),
    "notes a number": (_set("notes", 5), "notes: is a number, not a list"),
}


@pytest.mark.parametrize("name", list(BAD_PLANS))
def test_a_damaged_plan_is_one_value_error_naming_the_file_and_field(plan_doc, tmp_path, name):
    edit, says = BAD_PLANS[name]
    doc = json.loads(json.dumps(plan_doc))
    edit(doc)
    text = json.dumps(doc)
    with pytest.raises(ValueError) as e:
        ShardingPlan.from_json(text, source="mine.json")
    msg = str(e.value)
    assert type(e.value) is ValueError and msg.startswith("mine.json: ") and says in msg and "\n" not in msg, msg
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(ValueError, match="plan.json: ") as e:
        ShardingPlan.load(tmp_path / "plan.json")
    assert says in str(e.value)


@pytest.mark.parametrize("text", [b"[" * 100_000, b'{"summary": "\xff"}', b'{"summary": {', b"1" * 5000, b"[1]"])
def test_plan_text_that_is_not_json_or_not_an_object_is_one_value_error(text):
    with pytest.raises(ValueError) as e:
        ShardingPlan.from_json(text)
    assert type(e.value) is ValueError and str(e.value).startswith("plan JSON: ") and "\n" not in str(e.value)


def test_a_plan_that_would_cost_more_than_its_size_is_refused_before_any_work(plan_doc):
    doc = json.loads(json.dumps(plan_doc))
    doc["parallel"] = {**doc["parallel"], "dp_shard": 65536, "tp": 1}
    t = doc["tensors"][0]
    doc["tensors"] = [{**t, "global_shape": [i + 1, 8], "splits": []} for i in range(2049)]  # 2,049 layouts
    with pytest.raises(ValueError, match=r"tensors: have 134,283,264 \(layout x rank\) pieces to compute over "
                                         r"65,536 ranks, more than a plan has \(134,217,728\)"):
        ShardingPlan.from_dict(doc)


def test_a_valid_plan_reads_back_the_same(plan_doc, tmp_path):
    direct = workbench.plan("tiny", ParallelConfig(dp_shard=2, tp=2))
    (tmp_path / "plan.json").write_text(direct.to_json())
    for back in (ShardingPlan.from_json(direct.to_json()), ShardingPlan.load(tmp_path / "plan.json")):
        assert back.rank_bytes().equals(direct.rank_bytes()) and back.summary() == direct.summary()
        assert back.comm().equals(direct.comm()) and back.notes == direct.notes


def test_a_plan_file_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "plan.json")
    how, e = _in_thread(lambda: ShardingPlan.load(tmp_path / "plan.json"))
    if how == "hang":
        os.close(os.open(tmp_path / "plan.json", os.O_WRONLY | os.O_NONBLOCK))
    assert how == "raised" and isinstance(e, ValueError) and "plan.json: is a FIFO" in str(e), (how, e)


def test_the_server_answers_a_damaged_plan_with_one_line_422(plan_doc, tmp_path):
    from workbench.jupyter.opening import open_info
    from workbench.jupyter.plans import plan_table

    doc = json.loads(json.dumps(plan_doc))
    doc["tensors"][5]["global_shape"] = {}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(Refused) as e:
        plan_table(tmp_path, tmp_path / "bad.json")
    assert e.value.status == 422 and str(e.value).startswith("bad.json: tensors[5].global_shape: is an object")
    (tmp_path / "summary5.json").write_text(json.dumps({**plan_doc, "summary": 5}))
    with pytest.raises(Refused) as e:
        open_info(tmp_path, tmp_path / "summary5.json")
    assert e.value.status == 422 and "not a workbench plan" in str(e.value)
    (tmp_path / "good.json").write_text(json.dumps(plan_doc))
    assert open_info(tmp_path, tmp_path / "good.json")["model"] == "tiny"
    assert plan_table(tmp_path, tmp_path / "good.json")["world_size"] == 4
