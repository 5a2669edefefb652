"""Torch CUDA memory snapshots -> :class:`MemoryTimeline`: read as plain data, streamed, every rank at once.

``torch.cuda.memory._dump_snapshot(path)`` pickles the caching allocator's state and history::

    {"segments": [{"address", "total_size", "blocks": [{"address", "size", "requested_size",
                   "state": "active_allocated" | "active_pending_free" | "inactive", "frames"}], ...}],
     "device_traces": [[{"action": "alloc" | "free_requested" | "free_completed" | "segment_alloc" |
                         "segment_free" | "segment_map" | "segment_unmap" | "snapshot" | "oom",
                         "addr", "size", "stream", "time_us", "frames": [{"filename", "line", "name"}]}, ...]
                       for each device],
     "allocator_settings": {...}, "external_annotations": [...]}

**Read without unpickling, streamed, bounded by the file**: :mod:`workbench.memory.plainpickle` (its
docstring says how), with the limits of :mod:`workbench.safepickle`.

**Rows.** One row per ``alloc`` (``+size``) and per ``free_completed`` (``-size``); segment events only
feed ``meta["reserved_bytes"]``. Addresses are reused, so every allocation gets a fresh ``id`` and a free
pairs with the allocation live at its address. ``t`` is seconds from ``time_us``. ``base_bytes`` is what
was live before the first recorded event: blocks still allocated in ``segments`` that no recorded event
allocated (by the category of the stack that allocated them, in ``meta["base_by_category"]``), plus
frees of allocations made before the recording (``other``; torch's history is a ring buffer: the
oldest entries are dropped, so a trace usually starts mid-run).

**Categories from stack frames** (innermost frame first), unless ``identities`` names the address:

- a frame under ``torch/distributed/checkpoint/`` -> ``checkpoint``; a c10d collective
  (``distributed_c10d.py``, functional collectives, FSDP's collectives, ``nccl``) -> ``communication``,
  except FSDP's reduce-scatter buffers, whose output holds the sharded gradients: ``gradient`` where
  it outlives backward into the optimizer;
- ``parameter``: ``reset_parameters``, ``nn.init``, ``Module._apply/to/cuda/to_empty``, ``fully_shard``,
  a layer's constructor in ``torch/nn/modules``, any ``__init__`` under a device context
  (``with torch.device("cuda")``, ``set_default_device``), FSDP2's sharded parameters in any phase; what
  the build frees before it ends is ``other`` (see :mod:`workbench.memory.labelling`).
- otherwise the *phase* decides, with one lifetime rule: an allocation is a temporary unless it
  outlives the phase that made it into the phase that consumes it::

      phase      recognised by a frame                          alive at ...              -> category
      forward    forward, Module._call_impl                     the next backward event   -> activation
      backward   torch/autograd backward, Tensor.backward,      the next optimizer event  -> gradient
                 autograd::Engine, AccumulateGrad (-> gradient)
      optimizer  anything under torch/optim/                    the first event after     -> optimizer
                                                                this optimizer step
      build      the building frames above                      the next allocation of    -> parameter
                                                                another phase
      (otherwise a temporary, or for build other; checkpoint -> checkpoint, other -> other)

  An allocation that is never freed counts as surviving. On CUDA, backward runs in autograd's
  device thread, which has no Python frames: an allocation with an empty stack, or with library frames
  only that show no phase (a hook autograd's thread runs), takes the phase of the event before it (so
  it is backward right after ``loss.backward()`` starts); a stack with frames of the script and no
  phase marker is ``other`` (data loading, the loss outside any module). A free takes the phase
  of its own stack when that differs from its allocation's (torch records the freeing stack with
  ``context="all"``), else the phase of the event before it.

``step`` counts the optimizer steps completed before an event, from 0 at the start of the trace (-1
when the trace has no optimizer step). ``module`` is ``file.py:line`` of the innermost ``forward`` frame,
``op`` the ATen op of a C++ frame (``at::_ops::mm::call`` -> ``aten::mm``) or the innermost Python
function that is not a wrapper.

**Identities.** A live recorder knows what its tensors are: ``identities={storage.data_ptr(): "parameter",
...}`` labels the allocation at that address that is alive when the snapshot is taken (and a block of
``base_bytes`` there), exactly; earlier allocations that reused the address keep their inferred category.

**Downsampling.** A rank with more than ``max_events`` rows keeps its large events exactly and merges
runs of small ones, per category, into one row per bin and category (``op="(merged)"``, ``id`` = -1 -
category index, so :meth:`MemoryTimeline.alive_at` shows them as one lump per category). Every bin is
split at its highest total and its negative rows come first, so totals stay exact at every row,
the peak and its breakdown by category are the real ones, and no merged row rises above a real total.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import mmap
import os
import re
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from workbench.memory.labelling import (_HINT_CODES, _PH, REDUCTION, _Contexts, _finish, _join, _label_events,
                                        _check_category, _RankResult, classify_frames)
from workbench.memory.plainpickle import _Damaged, _Malformed, _PlainPickle, _Refused, _as_int
from workbench.memory.synthetic import write_synthetic_snapshot
from workbench.memory.timeline import CATEGORIES, MemoryTimeline
from workbench.memory.traces import (_ACTIONS, _ALLOC, _FREE, _KEPT, _OOM, _SEG_ALLOC, _SEG_FREE, _SEG_MAP,
                                     _SEG_UNMAP, _Columns, _Stacks, _StackRef, _Trace)
from workbench.safeio import confine, is_within, open_regular
from workbench.safepickle import UnsafePickle

__all__ = ["import_snapshots", "from_snapshot", "import_profiler_trace", "identify_memory_file", "snapshot_files",
           "classify_frames", "write_synthetic_snapshot", "measure_import", "ReadProgress", "DEFAULT_MAX_EVENTS"]

DEFAULT_MAX_EVENTS = 2_000_000
_NO_ROWS = _Columns.empty()  # a device trace without rows (shared: nothing changes it)
_TIMELINE_FIX = "record it again with torch.cuda.memory._record_memory_history() and _dump_snapshot()"


# ==================================================================================================
# A snapshot as compact arrays
# ==================================================================================================

class _RawSnapshot:
    """What a snapshot holds that a timeline needs: per device the rows (action, addr, size, time_us, sid),
    the blocks alive at the end (addr, requested bytes, sid), reserved bytes at the end, the stacks."""

    def __init__(self, name: str, stacks: _Stacks, traces: list[_Columns], blocks: np.ndarray,
                 reserved: int):
        self.name = name
        self.stacks = stacks
        self.traces = traces
        self.blocks = blocks  # (k, 3) int64: address, requested size, sid of blocks in an active state
        self.reserved = reserved

    def device_index(self, device: int | None) -> int:
        busy = [i for i, t in enumerate(self.traces) if len(t)]
        if device is not None:
            if not 0 <= device < len(self.traces):
                raise ValueError(f"{self.name} has traces for devices 0..{len(self.traces) - 1}, not device {device}")
            return device
        if len(busy) > 1:
            raise ValueError(f"{self.name} holds allocations on devices {busy}; choose one with device={busy[0]} "
                             "(a rank's timeline is one device's)")
        return busy[0] if busy else 0


class ReadProgress:
    """How far the read of one snapshot file has got: what ``import_snapshots(progress=callback)`` hands
    its callback after the first 16 MiB of each file, then every 64 MiB, and once at the file's end.

    The callback runs in the reading thread between two opcodes, so what :meth:`new_events` returns is
    consistent; keep the callback short (a 1 GB file calls it 16 times)."""

    def __init__(self, rank: int, path: Path, reader: "_PlainPickle", total: int):
        self.rank, self.path, self.bytes_total = rank, path, total
        self.bytes_read = 0
        self._reader = reader
        self._seen: dict[int, int] = {}

    def new_events(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per device trace with rows so far (in the order the file lists them, empty ones left out):
        ``(time_us, delta_bytes)`` of the allocations (+size) and completed frees (-size) read since the
        last call. Their running sum is the change in allocated bytes since the trace's first event."""
        out = []
        for key, trace in list(self._reader.traces.items()):
            n = self._seen.get(key, 0)
            action, size, when = trace.since(n)
            self._seen[key] = n + len(action)
            keep = (action == _ALLOC) | (action == _FREE)
            out.append((when[keep], np.where(action[keep] == _ALLOC, size[keep], -size[keep])))
        return out


def _open_buffer(path: Path) -> tuple[Any, Any]:
    # a regular file only: a FIFO (or a device) named *.pickle is refused, never opened to block or stream
    f = open_regular(path, "torch memory snapshot", fix_missing="pass a file torch.cuda.memory._dump_snapshot() wrote")
    try:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return f, b""
        return f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        data = f.read()
        return f, data


_GC_LOCK = threading.Lock()
_GC_READERS = [0, False]  # reads under way, and whether the collector was on before the first of them


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the machine runs: it makes containers that stay alive, and
    every collection walks all of them again (measured: 15% of a generated snapshot's read, more than half
    of a list nested 10**6 deep). Reference counting still frees what dies; a cycle a hostile file built is
    collected afterwards. Reads in several threads (the Jupyter server) share one pause, and the
    collector's state from before the first is restored after the last."""
    with _GC_LOCK:
        if _GC_READERS[0] == 0:
            _GC_READERS[1] = gc.isenabled()
            gc.disable()
        _GC_READERS[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_READERS[0] -= 1
            if _GC_READERS[0] == 0 and _GC_READERS[1]:
                gc.enable()


def _read_pickle(path: Path, progress: bool | Callable[[ReadProgress], None] = False, rank: int = 0) -> _RawSnapshot:
    stacks = _Stacks()
    f, buf = _open_buffer(path)
    bar = None
    try:
        callback: Callable[[int], None] | None = None
        watch: ReadProgress | None = None
        if callable(progress):
            def report(p: int) -> None:
                if watch is not None:
                    watch.bytes_read = p
                    progress(watch)
            callback = report
        elif progress and len(buf) > (64 << 20):
            from workbench.progress import tqdm
            bar = tqdm(total=len(buf), unit="B", unit_scale=True, desc=f"reading {path.name}", leave=False)
            callback = lambda p: bar.update(p - bar.n)  # noqa: E731
        if not len(buf):
            raise ValueError(f"{path} is empty: the snapshot was not written; {_TIMELINE_FIX}")
        if bytes(buf[:64]).lstrip()[:1] in (b"{", b"["):  # no pickle starts so: JSON
            raise ValueError(f"{path} is JSON, not a pickle: a profiler trace is read by import_profiler_trace, "
                             "a saved timeline by MemoryTimeline.load")
        reader = _PlainPickle(buf, stacks, callback)
        watch = ReadProgress(rank, path, reader, len(buf)) if callable(progress) else None
        try:
            with _collector_paused():
                top = reader.load()
            reader.memo = reader.stack = reader.pending = []  # the memo alone is 16 bytes a trace entry
            return _raw_from_top(top, reader.traces, stacks, str(path))
        except _Refused as e:
            raise ValueError(f"{path} is not a plain-data torch memory snapshot: it refers to {e}; "
                             "refusing to load it") from None
        except _Malformed as e:
            raise ValueError(f"{path} is not a torch memory snapshot: it {e}; pass the file "
                             "torch.cuda.memory._dump_snapshot() writes") from None
        except _Damaged as e:
            if str(e) == "ends early":
                raise ValueError(f"{path} ends early (truncated at {len(buf)} bytes): the snapshot was not "
                                 f"fully written; {_TIMELINE_FIX}") from None
            raise ValueError(f"{path} is not a readable pickle: it {e}; {_TIMELINE_FIX}") from None
        except UnsafePickle as e:
            raise ValueError(f"{path} is not a snapshot this reader takes: it {e}; refusing to read it (torch "
                             "never writes such a file)") from None
    finally:
        if bar is not None:
            bar.close()
        if isinstance(buf, mmap.mmap):
            buf.close()
        f.close()


def _raw_from_top(top: Any, traces: Mapping[int, _Trace], stacks: _Stacks, name: str) -> _RawSnapshot:
    """The compact snapshot from the top object the machine read. Each list and dict is visited once
    however often the file refers to it (``top`` keeps them all alive, so their ids stay theirs): a
    hostile file cannot make this walk longer than the file."""
    if not isinstance(top, dict) or not isinstance(top.get("device_traces"), list):
        what = f"a dict of {len(top)} keys, none of them" if isinstance(top, dict) else f"a {type(top).__name__}, no"
        raise ValueError(f"{name} is a pickle but not a torch memory snapshot (it holds {what} "
                         "'device_traces'); pass the file torch.cuda.memory._dump_snapshot() writes")
    arrays, seen = [], set()
    for lst in top["device_traces"]:
        if not isinstance(lst, list):
            raise ValueError(f"{name} is not a torch memory snapshot: device_traces holds "
                             f"{type(lst).__name__}, not lists of trace entries")
        tr = traces.get(id(lst)) if id(lst) not in seen else None
        seen.add(id(lst))
        arrays.append(tr.columns() if tr is not None else _NO_ROWS)
    blocks, reserved = [], 0
    sids: dict[int, int] = {}  # id of a traceback list -> its stack id
    segments = top.get("segments")
    for seg in segments if type(segments) is list else ():
        if type(seg) is not dict or id(seg) in seen:
            continue
        seen.add(id(seg))
        reserved += _as_int(seg.get("total_size", 0))
        addr = seg.get("address", 0)
        seg_blocks = seg.get("blocks")
        if type(seg_blocks) is not list or id(seg_blocks) in seen:
            continue
        seen.add(id(seg_blocks))
        for b in seg_blocks:
            if type(b) is not dict:
                continue
            size = _as_int(b.get("size", 0))
            a = _as_int(b.get("address", addr))
            state = b.get("state")
            if type(state) is str and state.startswith("active"):
                req = b.get("requested_size")
                frames = b.get("frames")
                sid = sids.get(id(frames)) if type(frames) is list else None
                if sid is None:
                    sid = stacks.stack_of(frames).sid
                    if type(frames) is list:
                        sids[id(frames)] = sid
                blocks.append((a, _as_int(req) if req is not None else size, sid))
            addr = a + size
    return _RawSnapshot(name, stacks, arrays,
                        np.array(blocks, dtype=np.int64).reshape(-1, 3), reserved)


def _raw_from_dict(snapshot: Mapping, name: str = "the snapshot") -> _RawSnapshot:
    """A live ``torch.cuda.memory._snapshot()`` dict: the same compact form, without any pickle."""
    stacks = _Stacks()
    seen: dict[int, _StackRef] = {}

    def stack_of(frames: Any) -> _StackRef:
        if not isinstance(frames, list) or not frames:
            return stacks._srefs[0]
        ref = seen.get(id(frames))
        if ref is None:
            ref = seen[id(frames)] = stacks.stack(tuple(
                stacks.frame(f.get("filename", "?"), f.get("line", 0), f.get("name", "?")).fid
                for f in frames if isinstance(f, dict)))
        return ref

    if not isinstance(snapshot, Mapping) or not isinstance(snapshot.get("device_traces"), list):
        raise ValueError(f"{name} is not a torch memory snapshot (no 'device_traces'); pass "
                         "torch.cuda.memory._snapshot() or a file from _dump_snapshot()")
    traces: dict[int, _Trace] = {}
    top = {"segments": [], "device_traces": []}
    for lst in snapshot["device_traces"]:
        owner: list = []
        tr = traces[id(owner)] = _Trace(owner)
        rows = []
        for e in lst:
            code = _ACTIONS.get(e.get("action"), -1)
            if code in _KEPT:
                rows.append((code, _as_int(e.get("addr", 0)) if code != _OOM else 0, _as_int(e.get("size", 0)),
                             _as_int(e.get("time_us", 0)), stack_of(e.get("frames")).sid))
        tr.add(rows)
        top["device_traces"].append(owner)
    for seg in snapshot.get("segments") or []:
        blocks = [dict(b, frames=stack_of(b.get("frames"))) for b in seg.get("blocks") or []]
        top["segments"].append(dict(seg, blocks=blocks))
    return _raw_from_top(top, traces, stacks, name)


# ==================================================================================================
# Snapshot -> one rank
# ==================================================================================================

def _snapshot_rank(raw: _RawSnapshot, rank: int, device: int | None, identities: Mapping[int, str] | None,
                   max_events: int) -> _RankResult:
    dev = raw.device_index(device)
    cols = raw.traces[dev] if raw.traces else _Columns.empty()
    raw.traces = []  # the rows below are all that is needed of them
    action = cols.action
    contexts = _Contexts.of_stacks(raw.stacks)
    meta: dict[str, Any] = {}

    seg = cols.take(np.isin(action, (_SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP)))
    seg_delta = np.where(np.isin(seg.action, (_SEG_ALLOC, _SEG_MAP)), seg.size, -seg.size)
    start = raw.reserved - int(seg_delta.sum())
    peak = start + max(0, int(np.cumsum(seg_delta).max())) if len(seg_delta) else start
    meta["reserved_bytes"] = {str(rank): {"start": start, "peak": peak, "end": raw.reserved}}
    ooms = int((action == _OOM).sum())
    if ooms:
        meta["oom_events"] = {str(rank): ooms}

    ev = cols.take((action == _ALLOC) | (action == _FREE))
    del cols, action
    if len(ev) and ev.time.any():
        t = ev.time.astype(np.float64) * 1e-6
        origin: float | None = float(t[0])
    else:
        t = np.arange(len(ev), dtype=np.float64) * 1e-6  # no times: the event order, one "µs" apart
        origin = None
        if len(ev):
            meta["time"] = "event order (the snapshot records no times)"
    ev.time = None
    labelled, facts = _label_events(t, ev.action == _ALLOC, ev.addr, ev.size, ev.sid, contexts, identities)
    del ev, t

    # base: blocks alive at the end that no recorded event allocated, plus frees of earlier allocations
    blocks = raw.blocks
    before = blocks[~np.isin(blocks[:, 0], facts["live_addr"])] if len(blocks) else blocks
    by_cat: dict[str, int] = {}
    known = {int(k): _check_category(v) for k, v in (identities or {}).items()}
    for addr, nbytes, sid in before.tolist():
        cat = known.get(addr) or _block_category(contexts, sid)
        by_cat[cat] = by_cat.get(cat, 0) + nbytes
    by_cat["other"] = by_cat.get("other", 0) + facts["orphan_bytes"]
    base = sum(by_cat.values())
    return _finish(rank, labelled, base, by_cat, contexts, max_events, meta, origin)


def _block_category(contexts: _Contexts, sid: int) -> str:
    """What a block allocated before the trace is, from its allocating stack (no lifetime to go by)."""
    hint = int(contexts.hint[sid])
    if hint >= 0:
        return CATEGORIES[hint]
    if hint == _HINT_CODES[REDUCTION]:  # FSDP's reduce-scatter output still alive: the sharded gradients
        return "gradient"
    phase = int(contexts.phase[sid])
    return {_PH["build"]: "parameter", _PH["optimizer"]: "optimizer", _PH["backward"]: "gradient",
            _PH["forward"]: "activation", _PH["checkpoint"]: "checkpoint"}.get(phase, "other")


# ==================================================================================================
# Public entry points
# ==================================================================================================

def from_snapshot(snapshot: Mapping | str | os.PathLike, rank: int = 0,
                  identities: Mapping[int, str] | None = None, *, device: int | None = None,
                  max_events: int = DEFAULT_MAX_EVENTS,
                  progress: bool | Callable[[ReadProgress], None] = False) -> MemoryTimeline:
    """One rank's timeline from a snapshot: a ``torch.cuda.memory._snapshot()`` dict or a pickle file.

    ``identities`` maps storage addresses to categories for what is alive when the snapshot is taken
    (parameters, gradients, optimizer state a recorder knows); ``device`` picks the device trace when
    the process used several GPUs."""
    if isinstance(snapshot, Mapping):
        raw = _raw_from_dict(snapshot)
        name = "snapshot"
    else:
        path = Path(snapshot)
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; pass a file written by torch.cuda.memory._dump_snapshot()")
        raw = _read_pickle(path, progress, rank)
        name = str(path)
    part = _snapshot_rank(raw, rank, device, identities, max_events)
    return _join([part], "snapshot", "cuda", {"files": {str(rank): name}})


# (at most 9 digits: a rank fits the int32 column; a longer number names no rank, the order decides)
_RANK_PATTERNS = (re.compile(r"rank[_-]?(\d{1,9})(?!\d)", re.I), re.compile(r"(?:^|[_\-.])(\d{1,9})$"))


def _rank_of(path: Path) -> int | None:
    stem = re.sub(r"\.(pickle|pkl)$", "", path.name)
    for rx in _RANK_PATTERNS:
        m = rx.search(stem)
        if m:
            return int(m.group(1))
    return None


def snapshot_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[int, Path]]:
    """``(rank, file)`` for a file, a directory of ``*.pickle``/``*.pkl``, or a list of either.

    The rank comes from the name (``rank3.pickle``, ``snapshot_rank3.pickle``, ``mem_3.pickle``), else
    from the order of the files."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            # the directory names these files: each one inside it (a link out of it is refused, not read)
            found = sorted(confine(p, q.name, what="snapshot") for q in p.iterdir()
                           if q.suffix in (".pickle", ".pkl") and q.is_file())
            if not found:
                raise FileNotFoundError(f"{p} holds no *.pickle snapshots; dump them with "
                                        "torch.cuda.memory._dump_snapshot(f'snapshot_rank{rank}.pickle')")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist; pass snapshot files or a directory of them")
    ranks = [_rank_of(f) for f in files]
    if None in ranks or len(set(ranks)) != len(ranks):
        ranks = list(range(len(files)))  # names do not say: the order does
    return sorted(zip(ranks, files))


def import_snapshots(paths: str | os.PathLike | Sequence[str | os.PathLike], *, device: int | None = None,
                     identities: Mapping[int, Mapping[int, str]] | None = None,
                     max_events: int = DEFAULT_MAX_EVENTS,
                     progress: bool | Callable[[ReadProgress], None] = True) -> MemoryTimeline:
    """Every rank of a job in one timeline, from its snapshot files (see :func:`snapshot_files`).

    Each file is streamed and reduced to its rows before the next is read, so memory grows with the
    rows kept (``max_events`` per rank), not with the files. ``identities`` is per rank. ``progress``:
    True shows a progress bar for large files; a callable gets a :class:`ReadProgress` as each file is
    read (after 16 MiB, then every 64 MiB: a server draws the part read from it while the rest is read)."""
    parts = []
    names = {}
    for rank, path in snapshot_files(paths):
        raw = _read_pickle(path, progress, rank)
        parts.append(_snapshot_rank(raw, rank, device, (identities or {}).get(rank), max_events))
        names[str(rank)] = str(path)
        del raw
    return _join(parts, "snapshot", "cuda", {"files": names})


def import_profiler_trace(source: Any, rank: int = 0, *, device: str | None = None,
                          max_events: int = DEFAULT_MAX_EVENTS) -> MemoryTimeline:
    """:func:`workbench.memory.profiler_trace.import_profiler_trace`, here too: one module answers for
    every file :func:`identify_memory_file` names (imported on call, as that module builds on this one)."""
    from workbench.memory.profiler_trace import import_profiler_trace as read_trace

    return read_trace(source, rank, device=device, max_events=max_events)


def identify_memory_file(path: str | os.PathLike) -> str | None:
    """``"snapshot"``, ``"profiler"`` or ``"timeline"`` for a file or directory one of the importers
    reads, from its first bytes (nothing is unpickled); None for anything else, including a file that
    cannot be read or is not a regular file (never opened: a FIFO would block). Never raises."""
    p = Path(path)

    def inside(q: Path, d: Path) -> bool:  # a file of the directory, not a link out of it (never read)
        return is_within(os.path.realpath(q), os.path.realpath(d))

    try:
        if p.is_dir():  # MemoryTimeline.save's directory (or a run directory holding it in memory/)
            for d in (p, p / "memory"):
                if d.is_dir() and any(inside(q, d) and identify_memory_file(q) == "timeline"
                                      for q in sorted(d.glob("*.json"))[:16]):
                    return "timeline"
            if any(q.suffix in (".pickle", ".pkl") and inside(q, p) and identify_memory_file(q) == "snapshot"
                   for q in itertools.islice(p.iterdir(), 4096)):
                return "snapshot"
            return None
        if not p.is_file():
            return None
        with open_regular(p, "memory file") as f:
            head = f.read(1 << 16)
        if head[:2] == b"\x1f\x8b":  # gzip: profilers write trace.json.gz
            import gzip
            with gzip.open(p, "rb") as g:
                head = g.read(1 << 16)
    except (OSError, EOFError, ValueError, zlib.error):  # unreadable, damaged gzip, refused by open_regular
        return None
    if head[:1] == b"\x80" and (b"device_traces" in head[:4096] or b"segments" in head[:4096]):
        return "snapshot"
    text = head.lstrip()
    if text[:1] == b"{":
        if b'"workbench.memory_timeline"' in text:
            return "timeline"
        if b'"traceEvents"' in text:
            return "profiler"
    return None


def measure_import(path: str | os.PathLike, max_events: int = DEFAULT_MAX_EVENTS) -> dict[str, Any]:
    """Import one snapshot here and report ``seconds``, peak ``rss_bytes`` of this process, ``events``.

    Call it in a fresh subprocess: the peak RSS is the process's, since it started."""
    import resource  # POSIX only: imported where it is used

    start = time.perf_counter()
    tl = import_snapshots([path], max_events=max_events, progress=False)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    down = tl.meta.get("downsampled", {})
    events = sum(v["events"] for v in down.values()) + sum(len(tl.frame[tl.frame["rank"] == int(r)])
                                                            for r in map(str, tl.ranks) if r not in down)
    return {"seconds": seconds, "rss_bytes": int(rss_bytes), "events": int(events), "rows": len(tl),
            "file_bytes": os.path.getsize(path), "peak_bytes": tl.peak().bytes}
