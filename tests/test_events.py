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
