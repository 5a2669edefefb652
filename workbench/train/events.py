"""The run directory's event stream: ``RUN_DIR/events.jsonl``, one JSON object per line.

Every rank appends to the same file. Each event is written with a single ``os.write`` on a file opened
with ``O_APPEND``, so lines from different processes never interleave. Readers tolerate a trailing
partial line (a writer may be mid-write) and skip it until it is complete.

Required keys: ``type``, ``rank``, ``time``. Types used here: ``launch``, ``nodes`` and ``run_end`` (rank -1,
the launcher), ``start``, ``step``, ``end``, ``error`` (with ``traceback``).

In a multi-node run every event also says which node wrote it: ``node`` (the ``--node-rank`` that node was
started with; each node writes its own run directory), and ``host`` on the events a person reads to find
a node (``launch``, ``start``, ``error``, ``run_end``).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

EVENTS_FILE = "events.jsonl"
LAUNCHER_RANK = -1
# Set by the launcher's agent of a multi-node run, for itself and the ranks it starts: this node's --node-rank.
NODE_ENV = "WORKBENCH_NODE"
_HOST_TYPES = frozenset({"launch", "start", "error", "run_end"})


def this_node() -> int | None:
    """This process's node in a multi-node run (its ``--node-rank``), or None on one node."""
    node = os.environ.get(NODE_ENV)
    return int(node) if node else None


class EventWriter:
    def __init__(self, run_dir: str | Path, rank: int):
        self.path = Path(run_dir) / EVENTS_FILE
        self.rank = rank
        self.node = this_node()
        self._host = socket.gethostname() if self.node is not None else None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = {"type": type, "rank": self.rank, "time": time.time()}
        if self.node is not None:
            event["node"] = self.node
            if type in _HOST_TYPES:
                event["host"] = self._host
        event.update(fields)
        os.write(self._fd, (json.dumps(event, default=str) + "\n").encode())
        return event

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventReader:
    """Incremental reader: each ``read_new()`` returns the complete events appended since the last call."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVENTS_FILE
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # b"" when data ends with a newline
        events = []
        for line in lines:
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a killed writer; the rest of the stream is still good
        return events


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """All complete events currently in ``RUN_DIR/events.jsonl``."""
    return EventReader(run_dir).read_new()


def follow(run_dir: str | Path, done, poll_s: float = 0.1) -> Iterator[dict[str, Any]]:
    """Yield events as they are written until ``done()`` is true and the file is drained."""
    reader = EventReader(run_dir)
    while True:
        finished = done()
        yield from reader.read_new()
        if finished:
            yield from reader.read_new()
            return
        time.sleep(poll_s)
