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


_HEAD_BYTES = 256


class EventReader:
    """Incremental reader: each ``read_new()`` returns the complete events appended since the last call.

    It follows the one file it first read. When the run directory is reused (``--resume`` into the same
    ``--out``, or ``--overwrite``), the new run's events go to a new file at the same path; a reader of
    the earlier run then reads nothing more, instead of taking the new run's events, from its old offset,
    as its own.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVENTS_FILE
        self._offset = 0
        self._partial = b""
        # The file this reader follows: its (st_dev, st_ino), and its first bytes (the first event, with its
        # time and pid), since a new file may get a freed inode number back.
        self._file_id: tuple[int, int] | None = None
        self._head = b""
        self._replaced = False

    @property
    def replaced(self) -> bool:
        """True once the file at the path is no longer the one this reader followed (a new run's)."""
        return self._replaced

    def read_new(self) -> list[dict[str, Any]]:
        if self._replaced:
            return []
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                head = f.read(_HEAD_BYTES) if self._offset else b""
                if self._file_id is not None and (self._file_id != (st.st_dev, st.st_ino) or st.st_size < self._offset
                                                  or not head.startswith(self._head)):
                    self._replaced = True  # another run's events now: this reader's run has ended
                    return []
                self._file_id = (st.st_dev, st.st_ino)
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        if len(self._head) < _HEAD_BYTES and chunk:
            self._head = (self._head + chunk)[:_HEAD_BYTES]
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
