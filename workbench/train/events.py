"""The run directory's event stream: ``RUN_DIR/events.jsonl``, one JSON object per line.

Every rank appends to the same file. Each event is written with a single ``os.write`` on a file opened
with ``O_APPEND``, so lines from different processes never interleave. Readers tolerate a trailing
partial line (a writer may be mid-write) and skip it until it is complete.

Required keys: ``type``, ``rank``, ``time``. Types used here: ``launch``, ``nodes`` and ``run_end`` (rank -1,
the launcher), ``start``, ``step``, ``end``, ``error`` (with ``traceback``).

In a multi-node run every event also says which node wrote it: ``node`` (the ``--node-rank`` that node was
started with; each node writes its own run directory), and ``host`` on the events a person reads to find
a node (``launch``, ``start``, ``error``, ``run_end``).

Reading a run directory that may be damaged or hostile (a copied, uploaded or half-written run):

* the file: opened through :mod:`workbench.safeio`, so only a regular file inside the run directory is
  read (a FIFO, a device, a directory or a link out of the run is refused in one line, before it can block
  or stream), and one read takes at most :data:`EVENTS_MAX` new bytes;
* each line: one that is not UTF-8, not JSON, nested past the parser's depth, not an object, or whose
  fields have the wrong types (:func:`event_problem`) is *damaged*: it is skipped and counted
  (:attr:`EventReader.skipped`, the first one described by :attr:`EventReader.first_damage`), so a bit
  flip or a torn line hides one event, not the run, and consumers can index the fields checked here;
* the whole: a file none of whose complete lines is an event is not an event log, and
  :func:`read_events` refuses it in one line (a live reader only reports it: :attr:`EventReader.not_a_log`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from workbench import safeio
from workbench.event_schema import LAUNCHER_RANK, action_problem, event_problem  # noqa: F401 (re-exported)

EVENTS_FILE = "events.jsonl"
# Set by the launcher's agent of a multi-node run, for itself and the ranks it starts: this node's --node-rank.
NODE_ENV = "WORKBENCH_NODE"
_HOST_TYPES = frozenset({"launch", "start", "error", "run_end"})
# The most one read takes in: a step event is ~200 bytes and a pipeline rank's schedule event ~100 bytes per
# action, so 4 GiB is ~20M events, past a long many-rank run; what is read is kept (about 5x its size in
# Python objects), so a larger file is not one to read whole. A follower reads the new bytes only.
EVENTS_MAX = 4 << 30


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


# -- what an event is: workbench.event_schema (below every package; pipeline_bubble checks with it too)

# -- reading -------------------------------------------------------------------------------------------

_HEAD_BYTES = 256
_DECODE = json.JSONDecoder().raw_decode  # one value from the line's start: no whitespace scan (ours have none)
NOT_A_LOG_FIX = "open the events.jsonl of a run written by workbench train / workbench.launch"


def _lines(block: bytes) -> list[str | None]:
    """``block``'s lines as text; a line that is not UTF-8 is None (the others still read)."""
    try:
        return block.decode("utf-8").split("\n")  # one decode for the whole block: the common case
    except UnicodeDecodeError:
        out: list[str | None] = []
        for raw in block.split(b"\n"):
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        return out


def _diagnose(line: str | None) -> tuple[Any, str | None]:
    """A line the fast path did not take: ``(event, None)`` (spaces around it), ``(None, None)`` (a blank
    line) or ``(None, what is wrong with it)``."""
    if line is None:
        return None, "not UTF-8 text"
    text = line.strip()
    if not text:
        return None, None
    try:
        e, end = _DECODE(text)
    except RecursionError:
        return None, "nested deeper than JSON is read here"
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python converts
        return None, f"not JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else 'a number too long'})"
    if end != len(text):
        return None, "more than one JSON value"
    problem = event_problem(e)
    return (None, problem) if problem else (e, None)


class EventReader:
    """Incremental reader: each ``read_new()`` returns the complete events appended since the last call.

    It follows the one file it first read. When the run directory is reused (``--resume`` into the same
    ``--out``, or ``--overwrite``), the new run's events go to a new file at the same path; a reader of
    the earlier run then reads nothing more, instead of taking the new run's events, from its old offset,
    as its own.

    Damaged lines are skipped (see the module docstring): :attr:`skipped` counts them, :attr:`first_damage`
    says where the first one was and what was wrong with it. A file that is not what it should be (a FIFO,
    a device, a directory, a link out of the run directory, more than :data:`EVENTS_MAX` new bytes) raises
    :class:`workbench.safeio.FileRefused` (a ValueError) naming it; a missing one reads as no events yet.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / EVENTS_FILE
        self._offset = 0
        self._partial = b""
        # The file this reader follows: its (st_dev, st_ino), and its first bytes (the first event, with its
        # time and pid), since a new file may get a freed inode number back.
        self._file_id: tuple[int, int] | None = None
        self._head = b""
        self._replaced = False
        self._lines = 0  # complete lines read so far: the line number of a damaged one
        self.events_read = 0
        self.skipped = 0
        self.first_damage: str | None = None

    @property
    def replaced(self) -> bool:
        """True once the file at the path is no longer the one this reader followed (a new run's)."""
        return self._replaced

    @property
    def not_a_log(self) -> str | None:
        """Why the file read so far is no event log (it has complete lines, and none is an event), or None."""
        if self.events_read or not self.skipped:
            return None
        return f"is not an event log: none of its {self.skipped:,} line(s) is an event ({self.first_damage})"

    def _open(self):
        """The file, if it is a regular file inside the run directory; None while there is none."""
        try:
            path = safeio.confine(self.run_dir, EVENTS_FILE, self.run_dir, "event log")
            return safeio.open_regular(path, "event log")
        except safeio.FileRefused as e:
            if e.reason == "missing":
                return None
            raise

    def read_new(self) -> list[dict[str, Any]]:
        if self._replaced:
            return []
        f = self._open()
        if f is None:
            return []
        with f:
            st = os.fstat(f.fileno())
            head = f.read(_HEAD_BYTES) if self._offset else b""
            if self._file_id is not None and (self._file_id != (st.st_dev, st.st_ino) or st.st_size < self._offset
                                              or not head.startswith(self._head)):
                self._replaced = True  # another run's events now: this reader's run has ended
                return []
            self._file_id = (st.st_dev, st.st_ino)
            new = st.st_size - self._offset
            if new > EVENTS_MAX:
                raise safeio.FileRefused(self.path, f"holds {new:,} bytes of events to read, more than one read "
                                         f"takes ({EVENTS_MAX:,})", "it is not a run's event log; a live run's "
                                         "is followed as it grows (EventReader)", reason="too-large")
            f.seek(self._offset)
            chunk = f.read(max(new, 0))  # up to the size just seen: what is appended since is the next call's
        if len(self._head) < _HEAD_BYTES and chunk:
            self._head = (self._head + chunk)[:_HEAD_BYTES]
        self._offset += len(chunk)
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._partial = data
            return []
        self._partial = data[end + 1:]  # b"" when data ends with a newline
        lines = _lines(data[:end])
        first, self._lines = self._lines, self._lines + len(lines)
        events = []
        decode, problem_of = _DECODE, event_problem
        for i, line in enumerate(lines):
            if line:  # the fast path: one JSON object, nothing around it, a valid event
                try:
                    e, stop = decode(line)
                    if stop == len(line) and problem_of(e) is None:
                        events.append(e)
                        continue
                except (ValueError, RecursionError):
                    pass
            elif line is not None:
                continue  # an empty line
            e, problem = _diagnose(line)
            if e is not None:
                events.append(e)
            elif problem is not None:  # a line torn by a killed writer, a flipped bit: the rest is still good
                self.skipped += 1
                if self.first_damage is None:
                    self.first_damage = f"line {first + i + 1}: {problem}"
        self.events_read += len(events)
        return events


# Where a rank's recorded peak comes from, most detailed first (the run tab's and Run.summary's).
PEAK_SOURCES = {"memory": "memory recorder (memory events' peak_bytes)",
                "peak_mem_bytes": "peak probe (step events' peak_mem_bytes)",
                "cuda": "CUDA allocator (step events' mem_bytes: torch.cuda.max_memory_allocated)"}


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def memory_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Memory per rank and per pipeline stage, with one meaning of "peak": the tensor bytes the run
    recorded at their largest (a ``memory`` event's ``peak_bytes`` under ``--memory``, else the step
    events' ``peak_mem_bytes`` from the pipeline's probe, else on CUDA the step's ``mem_bytes``, which there
    is ``max_memory_allocated``). On CPU a step's ``mem_bytes`` is the process's resident set: RSS, a
    different quantity (the interpreter, torch's libraries, the allocator's cache), reported as
    ``rss_bytes`` and never as a peak."""
    device: dict[int, str] = {}
    stages: dict[int, set[int]] = {}
    best: dict[int, dict[str, tuple[float, Any]]] = {}  # rank -> source -> (largest value, its step)
    rss: dict[int, float] = {}
    reserved: set[int] = set()
    for e in events:
        rank, kind = e.get("rank"), e.get("type")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            continue
        if kind == "start" and isinstance(e.get("device"), str):
            device[rank] = e["device"]
        elif kind == "pipeline" and isinstance(e.get("stages"), dict):
            stages.setdefault(rank, set()).update(int(k) for k in e["stages"] if str(k).isdigit())
        elif kind == "schedule" and isinstance(e.get("actions"), list):
            stages.setdefault(rank, set()).update(a["stage"] for a in e["actions"] if isinstance(a, dict)
                                                  and isinstance(a.get("stage"), int) and a["stage"] >= 0)
        elif kind in ("step", "memory"):
            fields = (("peak_mem_bytes", "peak_mem_bytes"), ("mem_bytes", "mem_bytes")) if kind == "step" \
                else (("memory", "peak_bytes"),)
            if kind == "step" and "mem_reserved_bytes" in e:
                reserved.add(rank)
            for source, f in fields:
                v = _finite(e.get(f))
                if v is not None:
                    old = best.setdefault(rank, {}).get(source)
                    if old is None or v > old[0]:
                        best[rank][source] = (v, e.get("step"))
    rows = []
    for rank in sorted(set(best) | set(stages)):
        # the trainer says its device in its start event; a CUDA step also carries mem_reserved_bytes
        cuda = device[rank].startswith("cuda") if rank in device else rank in reserved
        mine = dict(best.get(rank, {}))
        mem = mine.pop("mem_bytes", None)
        if mem is not None:
            if cuda:
                mine["cuda"] = mem
            else:
                rss[rank] = mem[0]
        source = next((k for k in PEAK_SOURCES if k in mine), None)
        rows.append({"rank": rank, "stages": sorted(stages.get(rank, ())) or None,
                     "device": device.get(rank, "cuda" if cuda else "cpu"),
                     "peak_mem_bytes": int(mine[source][0]) if source else None,
                     "peak_step": mine[source][1] if source else None,
                     "peak_source": PEAK_SOURCES[source] if source else None,
                     "rss_bytes": int(rss[rank]) if rank in rss else None})
    out: dict[str, Any] = {"memory": rows}
    peaks = [r["peak_mem_bytes"] for r in rows if r["peak_mem_bytes"] is not None]
    if peaks:
        out["peak_mem_bytes"] = max(peaks)
        out["peak_mem_source"] = "; ".join(sorted({r["peak_source"] for r in rows if r["peak_source"]}))
    if rss:
        out["rss_bytes"] = int(max(rss.values()))
    per_stage: dict[int, list[dict]] = {}
    for r in rows:
        for st in r["stages"] or ():
            per_stage.setdefault(st, []).append(r)
    if per_stage:  # a stage's peak is the largest of its ranks' (a rank holding v stages holds them all at once)
        out["stages"] = [{"stage": st, "ranks": [r["rank"] for r in rs],
                          "peak_mem_bytes": max((r["peak_mem_bytes"] for r in rs if r["peak_mem_bytes"] is not None),
                                                default=None),
                          "rss_bytes": max((r["rss_bytes"] for r in rs if r["rss_bytes"] is not None), default=None)}
                         for st, rs in sorted(per_stage.items())]
    return out


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """All complete events currently in ``RUN_DIR/events.jsonl``, damaged lines skipped (see
    :class:`EventReader`). :class:`workbench.safeio.FileRefused` (a ValueError) naming the file if it is no
    event log at all, or not a regular file inside the run directory."""
    reader = EventReader(run_dir)
    events = reader.read_new()
    if reader.not_a_log:
        raise safeio.FileRefused(reader.path, reader.not_a_log, NOT_A_LOG_FIX)
    return events


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
