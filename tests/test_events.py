"""The events.jsonl stream: many writers, one file, no torn lines; readers skip partial lines."""

from __future__ import annotations

import json
import multiprocessing as mp

from workbench.train.events import EventReader, EventWriter, read_events


def _writer(run_dir: str, rank: int, n: int) -> None:
    with EventWriter(run_dir, rank) as ev:
        for i in range(n):
            ev.emit("step", step=i, payload="x" * 300)


def test_concurrent_writers_never_interleave(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), r, 300)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(lines) == 1200
    events = [json.loads(line) for line in lines]  # every line parses
    for r in range(4):
        assert [e["step"] for e in events if e["rank"] == r] == list(range(300))


def test_reader_waits_for_a_partial_line(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(tmp_path)
    assert reader.read_new() == []
    path.write_text('{"type": "step", "rank": 0, "time": 1.0}\n{"type": "st')
    assert [e["type"] for e in reader.read_new()] == ["step"]
    with open(path, "a") as f:
        f.write('ep", "rank": 1, "time": 2.0}\n')
    assert [e["rank"] for e in reader.read_new()] == [1]
    assert len(read_events(tmp_path)) == 2


def test_torn_line_from_a_killed_writer_is_skipped(tmp_path):
    (tmp_path / "events.jsonl").write_text('{"type": "st\n{"type": "end", "rank": 0, "time": 3}\n')
    assert [e["type"] for e in read_events(tmp_path)] == ["end"]


def test_a_reader_of_an_earlier_run_takes_none_of_the_next_runs_events(tmp_path):
    """--resume or --overwrite into the same --out starts a new events.jsonl at the same path: the earlier
    run's reader (a Run object in a notebook) used to read on from its old offset, in the new file."""
    path = tmp_path / "events.jsonl"
    first = [{"type": "launch", "rank": -1, "time": 1.0, "pid": 11}] + [
        {"type": "step", "rank": 0, "step": s, "time": 2.0 + s} for s in range(3)]
    path.write_text("".join(json.dumps(e) + "\n" for e in first))
    old = EventReader(tmp_path)
    assert len(old.read_new()) == 4 and not old.replaced
    # The next run: the file removed, a new one written, longer than the old (the old offset lands inside it).
    path.unlink()
    second = [{"type": "launch", "rank": -1, "time": 9.0, "pid": 22}] + [
        {"type": "step", "rank": 0, "step": s, "time": 10.0 + s} for s in range(100, 110)]
    path.write_text("".join(json.dumps(e) + "\n" for e in second))
    assert old.read_new() == [] and old.replaced
    with open(path, "a") as f:
        f.write(json.dumps({"type": "end", "rank": -1, "time": 30.0}) + "\n")
    assert old.read_new() == []  # and stays so
    assert [e.get("step") for e in EventReader(tmp_path).read_new()][:2] == [None, 100]  # a new reader: the new run


def test_a_file_rewritten_in_place_is_also_another_runs(tmp_path):
    """Same inode, different content (truncated and rewritten, or a freed inode number handed back)."""
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"type": "launch", "rank": -1, "time": 1.0, "pid": 11}) + "\n")
    reader = EventReader(tmp_path)
    assert len(reader.read_new()) == 1
    with open(path, "r+") as f:  # the same file object on disk
        f.seek(0)
        f.write(json.dumps({"type": "launch", "rank": -1, "time": 5.0, "pid": 99}) + "\n")
        f.write(json.dumps({"type": "step", "rank": 0, "step": 0, "time": 6.0}) + "\n")
    assert reader.read_new() == [] and reader.replaced
