"""Torch CUDA memory snapshots -> :class:`MemoryTimeline`: read as plain data, streamed, every rank at once.

``torch.cuda.memory._dump_snapshot(path)`` pickles the caching allocator's state and history::

    {"segments": [{"address", "total_size", "blocks": [{"address", "size", "requested_size",
                   "state": "active_allocated" | "active_pending_free" | "inactive", "frames"}], ...}],
     "device_traces": [[{"action": "alloc" | "free_requested" | "free_completed" | "segment_alloc" |
                         "segment_free" | "segment_map" | "segment_unmap" | "snapshot" | "oom",
                         "addr", "size", "stream", "time_us", "frames": [{"filename", "line", "name"}]}, ...]
                       for each device],
     "allocator_settings": {...}, "external_annotations": [...]}

**Read without unpickling.** A pickle may name any callable (``os.system``) and call it, so this module
never calls ``pickle.load``. It runs its own small stack machine that knows only the plain-data
opcodes (dicts, lists, tuples, strings, bytes, numbers, ``None``, the memo). An opcode that would
import or call something (GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, EXT, PERSID) stops the
read with one line that names what the file refers to; nothing in the file is executed.

**Streamed.** A recording of a long run is gigabytes; its tree of Python dicts would be ten times that.
The machine keeps only what a timeline needs: each trace entry becomes one row of five integers
(action, addr, size, time_us, stack id) as it joins its device's list, and each traceback becomes a
stack id into a table of unique stacks (torch shares frame dicts between tracebacks, so the pickle
memoizes them and later entries refer back with GET: the memo is kept, but an entry's slot holds a
marker and a traceback's slot its stack id). Most entries are matched in one step by a regular
expression for the exact bytes pickle writes for ``{action: GET, addr: int, ..., frames: [GET, ...]}``;
anything else (a first-seen frame, a FRAME header) goes through the general opcode loop, which gives
the same result. The file is memory-mapped and the pages already read are handed back to the OS.

**Rows.** One row per ``alloc`` (``+size``) and per ``free_completed`` (``-size``); segment events only
feed ``meta["reserved_bytes"]``. Addresses are reused, so every allocation gets a fresh ``id`` and a free
pairs with the allocation live at its address. ``t`` is seconds from ``time_us``. ``base_bytes`` is what
was live before the first recorded event: blocks still allocated in ``segments`` that no recorded event
allocated (by the category of the stack that allocated them, in ``meta["base_by_category"]``), plus
frees of allocations made before the recording (``other``; torch's history is a ring buffer: the
oldest entries are dropped, so a trace usually starts mid-run).

**Categories from stack frames** (innermost frame first), unless ``identities`` names the address:

- a frame under ``torch/distributed/checkpoint/`` -> ``checkpoint``; a c10d collective
  (``distributed_c10d.py``, functional collectives, FSDP's collectives, ``nccl``) -> ``communication``;
  ``reset_parameters``, ``nn.init``, ``Module._apply/to/cuda/to_empty``, ``fully_shard`` -> ``parameter``.
- otherwise the *phase* decides, with one lifetime rule: an allocation is a temporary unless it
  outlives the phase that made it into the phase that consumes it::

      phase      recognised by a frame                          alive at ...              -> category
      forward    forward, Module._call_impl                     the next backward event   -> activation
      backward   torch/autograd backward, Tensor.backward,      the next optimizer event  -> gradient
                 autograd::Engine, AccumulateGrad (-> gradient)
      optimizer  anything under torch/optim/                    the first event after     -> optimizer
                                                                this optimizer step
      (otherwise a temporary; checkpoint -> checkpoint, build -> parameter, other -> other)

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

import codecs
import mmap
import os
import pickle
import random
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from workbench.memory.timeline import CATEGORIES, PHASES, MemoryTimeline, empty_frame

__all__ = ["import_snapshots", "from_snapshot", "import_profiler_trace", "identify_memory_file", "snapshot_files",
           "classify_frames", "write_synthetic_snapshot", "measure_import", "ReadProgress", "DEFAULT_MAX_EVENTS"]

DEFAULT_MAX_EVENTS = 2_000_000

# trace actions, as codes in the compact rows
_ACTIONS = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
            "segment_map": 5, "segment_unmap": 6, "snapshot": 7, "oom": 8}
_ALLOC, _FREE_REQUESTED, _FREE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _SNAP, _OOM = range(9)
_KEPT = frozenset({_ALLOC, _FREE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _OOM})

_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_PH = {p: i for i, p in enumerate(PHASES)}
_TIMELINE_FIX = "record it again with torch.cuda.memory._record_memory_history() and _dump_snapshot()"


# ==================================================================================================
# Unique frames and stacks
# ==================================================================================================

class _FrameRef:
    """A frame dict, once read: its id in :class:`_Stacks` (what the memo holds in its place)."""
    __slots__ = ("fid",)

    def __init__(self, fid: int):
        self.fid = fid


class _StackRef:
    """A traceback list, once read: its stack id (what the memo holds in its place)."""
    __slots__ = ("sid",)

    def __init__(self, sid: int):
        self.sid = sid


class _Stacks:
    """Unique frames ``(filename, line, name)`` and unique stacks (tuples of frame ids, innermost first).

    Stack 0 is the empty stack: entries recorded without context, and CUDA backward allocations
    (autograd's device thread has no Python frames)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int, str]] = []
        self._fids: dict[tuple, int] = {}
        self._frefs: list[_FrameRef] = []
        self.stacks: list[tuple[int, ...]] = [()]
        self._sids: dict[tuple, int] = {(): 0}
        self._srefs: list[_StackRef] = [_StackRef(0)]

    def frame(self, filename: Any, line: Any, name: Any) -> _FrameRef:
        key = (str(filename), int(line) if isinstance(line, int) else 0, str(name))
        fid = self._fids.get(key)
        if fid is None:
            fid = self._fids[key] = len(self.frames)
            self.frames.append(key)
            self._frefs.append(_FrameRef(fid))
        return self._frefs[fid]

    def stack(self, fids: tuple[int, ...]) -> _StackRef:
        sid = self._sids.get(fids)
        if sid is None:
            sid = self._sids[fids] = len(self.stacks)
            self.stacks.append(fids)
            self._srefs.append(_StackRef(sid))
        return self._srefs[sid]

    def stack_of(self, value: Any) -> _StackRef:
        """A ``frames`` value as read (a list of frame refs, or a stack already made) -> its stack."""
        if type(value) is _StackRef:
            return value
        if isinstance(value, list):
            return self.stack(tuple(f.fid for f in value if type(f) is _FrameRef))
        return self._srefs[0]

    def frames_of(self, sid: int) -> list[tuple[str, int, str]]:
        return [self.frames[f] for f in self.stacks[sid]]


# ==================================================================================================
# The plain-data pickle machine
# ==================================================================================================

class _Refused(Exception):
    """The file asks for something that is not plain data (the message says what)."""


class _Damaged(Exception):
    """The opcode stream is not a well-formed pickle here (the message says what)."""


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_ENTRY = _Marker("trace entry")  # what the stack and the memo hold for a trace entry once it became a row


class _Columns:
    """A device's kept trace rows as typed columns: 29 bytes a row."""
    __slots__ = ("action", "addr", "size", "time", "sid")

    def __init__(self, action: np.ndarray, addr: np.ndarray, size: np.ndarray, time: np.ndarray, sid: np.ndarray):
        self.action, self.addr, self.size, self.time, self.sid = action, addr, size, time, sid

    @classmethod
    def empty(cls) -> "_Columns":
        return cls(np.zeros(0, np.int8), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros(0, np.int32))

    def __len__(self) -> int:
        return len(self.action)

    def take(self, mask: np.ndarray) -> "_Columns":
        return _Columns(self.action[mask], self.addr[mask], self.size[mask], self.time[mask], self.sid[mask])


_DTYPES = (np.int8, np.int64, np.int64, np.int64, np.int32)


class _Trace:
    """The rows of one device's trace list, gathered in typed numpy chunks as they arrive."""
    __slots__ = ("owner", "rows", "chunks", "n")

    def __init__(self, owner: list):
        self.owner = owner  # the list object the pickle appends to (kept alive so its id stays unique)
        self.rows: list[tuple] = []
        self.chunks: list[list[np.ndarray]] = []
        self.n = 0

    def add(self, records: Iterable) -> None:
        self.rows.extend(filter(None, records))
        if len(self.rows) >= 1 << 16:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            block = np.array(self.rows, dtype=np.int64).reshape(-1, 5)
            self.chunks.append([block[:, j].astype(dt) for j, dt in enumerate(_DTYPES)])
            self.n += len(block)
            self.rows = []

    def since(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Action, size and time_us of the rows after the first ``n`` (in arrival order)."""
        parts, at = [], 0
        for chunk in self.chunks:
            k = len(chunk[0])
            if at + k > n:
                lo = max(0, n - at)
                parts.append((chunk[0][lo:], chunk[2][lo:], chunk[3][lo:]))
            at += k
        if self.rows:
            block = np.array(self.rows, dtype=np.int64).reshape(-1, 5)[max(0, n - at):]
            parts.append((block[:, 0], block[:, 2], block[:, 3]))
        if not parts:
            return np.zeros(0, np.int8), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return tuple(np.concatenate([q[j] for q in parts]) for j in range(3))  # type: ignore[return-value]

    def columns(self) -> _Columns:
        """All rows as columns; the chunks are released as they are copied."""
        self.flush()
        out = [np.empty(self.n, dtype=dt) for dt in _DTYPES]
        at = 0
        self.chunks.reverse()
        while self.chunks:
            chunk = self.chunks.pop()
            for col, part in zip(out, chunk):
                col[at:at + len(part)] = part
            at += len(chunk[0])
        self.n = 0
        return _Columns(*out)


# regular expressions for the bytes pickle (protocol 4/5) writes for a typical trace entry:
#   EMPTY_DICT MEMOIZE MARK (key:GET value)*k SETITEMS
# with values that are ints, GETs, None/bools, an empty string, or a traceback list of GETs
_GET = rb"h.|j...."
_INT = (rb"K.|M..|J....|\x8a(?:\x00|\x01.|\x02..|\x03...|\x04....|\x05.....|\x06......|\x07.......|"
        rb"\x08........)")
_FRAMES = rb"\]\x94(?:\((?:" + _GET + rb")*+e|(?:" + _GET + rb")a)?"
_VALUE = rb"(" + _INT + rb"|" + _GET + rb"|N|\x88|\x89|\x8c\x00\x94|" + _FRAMES + rb")"
_KEY = rb"(" + _GET + rb")"
_ENTRY_PATTERNS = [re.compile(rb"\}\x94\(" + (_KEY + _VALUE) * k + rb"u", re.S) for k in (6, 5, 7, 8, 4, 9)]

_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_F64 = struct.Struct(">d").unpack_from

_OPNAMES = {0x63: "GLOBAL", 0x93: "STACK_GLOBAL", 0x52: "REDUCE", 0x62: "BUILD", 0x69: "INST", 0x6f: "OBJ",
            0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x50: "PERSID",
            0x51: "BINPERSID", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}


class _NotSimple(Exception):
    """A value the fast path does not decode; the general loop takes the entry."""


def _as_int(value: Any) -> int:
    if value is None or isinstance(value, bool):
        return int(bool(value))
    if isinstance(value, int):
        return value
    raise _Damaged(f"a trace entry holds {type(value).__name__} where a number belongs")


class _PlainPickle:
    """One pass over a pickle's opcodes, building plain data and turning trace entries into rows.

    ``load()`` returns the top object with every device trace list left empty; the rows are in
    ``traces`` (keyed by ``id`` of the list they belong to)."""

    def __init__(self, buf: Any, stacks: _Stacks, progress: Callable[[int], None] | None = None):
        self.buf = buf
        self.stacks = stacks
        self.progress = progress
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []
        self.slots: dict[int, int] = {}        # id(dict|list) -> memo index, for containers we may compact
        self.pending: list = []                 # rows of entries completed since their list's last APPENDS
        self.traces: dict[int, _Trace] = {}
        self.plans: dict[tuple, Any] = {}       # key GET bytes of an entry -> its layout (or False)
        self.layouts: list = []                 # layouts seen, the last one used first
        self.actcache: dict[bytes, int] = {}    # GET bytes -> action code
        self.framecache: dict[bytes, _StackRef] = {}  # bytes of a traceback list of GETs -> its stack
        self.ints: dict[bytes, int] = {}        # bytes of an int opcode -> its value (addresses, sizes recur)
        self.pos = 0

    # -- memo compaction ------------------------------------------------------------------------
    def _forget_caches(self) -> None:
        """A PUT overwrote a memo slot: what the caches derived from GET indices may be stale."""
        self.plans.clear()
        self.layouts.clear()
        self.actcache.clear()
        self.framecache.clear()

    def _replace(self, obj: Any, compact: Any) -> None:
        idx = self.slots.pop(id(obj), None)
        if idx is not None and idx < len(self.memo) and self.memo[idx] is obj:
            self.memo[idx] = compact

    def _entry_row(self, d: dict) -> tuple | None:
        """A trace entry dict, complete, becomes a row (None for actions a timeline does not use)."""
        action = d["action"]
        code = _ACTIONS.get(action, -1) if isinstance(action, str) else -1
        frames = d.get("frames")
        sref = self.stacks.stack_of(frames)
        if isinstance(frames, list):
            self._replace(frames, sref)
        self._replace(d, _ENTRY)
        if code not in _KEPT:
            return None
        addr = d.get("addr", 0) if code != _OOM else 0
        return (code, _as_int(addr), _as_int(d.get("size", 0)), _as_int(d.get("time_us", 0)), sref.sid)

    def _trace_of(self, target: Any) -> _Trace:
        if not isinstance(target, list):
            raise _Damaged("trace entries appended to something that is not a list")
        trace = self.traces.get(id(target))
        if trace is None:
            trace = self.traces[id(target)] = _Trace(target)
        return trace

    def _appending(self, target: Any, items: list) -> list:
        """Items about to join a list, which is when a dict is complete (protocols 0 and 1 set a dict's
        items one SETITEM at a time): a trace entry goes to its list's rows instead, a frame dict
        becomes a frame ref. Entries the fast path read are markers whose rows wait in ``pending``."""
        k = items.count(_ENTRY)
        if k > len(self.pending):
            raise _Damaged("trace entries appended twice")
        if k and k == len(items):  # a batch of entries from the fast path: the common case
            self._trace_of(target).add(self.pending[-k:])
            del self.pending[-k:]
            return []
        waiting = iter(self.pending[len(self.pending) - k:]) if k else iter(())
        if k:
            del self.pending[-k:]
        out, rows, entries = [], [], False
        for x in items:
            if x is _ENTRY:
                rows.append(next(waiting))
                entries = True
            elif type(x) is dict and "action" in x:
                rows.append(self._entry_row(x))
                entries = True
            elif type(x) is dict and "filename" in x and "line" in x and "name" in x:
                ref = self.stacks.frame(x["filename"], x["line"], x["name"])
                self._replace(x, ref)
                out.append(ref)
            else:
                out.append(x)
        if entries:
            self._trace_of(target).add(rows)
        return out

    # -- the fast path --------------------------------------------------------------------------
    def _layout(self, keys: tuple[bytes, ...]) -> Any:
        """The fields of entries whose keys are these GETs, and a regex for exactly such entries.

        The keys become literal bytes and only the values that matter are captured, so one ``match``
        does the parsing; False if the keys are not a trace entry's."""
        names = []
        memo = self.memo
        for kb in keys:
            idx = kb[1] if kb[0] == 0x68 else _U32(kb, 1)[0]
            if idx >= len(memo) or type(memo[idx]) is not str:
                self.plans[keys] = False
                return False
            names.append(memo[idx])
        if "action" not in names or len(set(names)) != len(names):
            self.plans[keys] = False
            return False
        parts, fields = [rb"\}\x94\("], {}
        memo_groups = []
        group = 0
        for kb, name in zip(keys, names):
            parts.append(re.escape(kb))
            if name == "action":
                parts.append(rb"(" + _GET + rb")")
            elif name in ("addr", "size", "time_us"):
                parts.append(rb"(" + _INT + rb")")
            elif name in ("stream", "device_free"):
                parts.append(rb"(?:" + _INT + rb"|N)")
                continue
            elif name == "frames":
                parts.append(rb"(" + _FRAMES + rb"|" + _GET + rb")")
                memo_groups.append(group)
            else:
                parts.append(_VALUE)
                memo_groups.append(group)
            fields[name] = group
            group += 1
        parts.append(rb"u")
        layout = (re.compile(b"".join(parts), re.S), fields["action"], fields.get("addr", -1),
                  fields.get("size", -1), fields.get("time_us", -1), fields.get("frames", -1), tuple(memo_groups))
        self.plans[keys] = layout
        self.layouts.insert(0, layout)
        return layout

    def _frames_value(self, v: bytes) -> tuple[_StackRef, int]:
        """A traceback value's stack, and the memo slot to compact (-1: it makes a new slot)."""
        if v[0] == 0x5d:  # a new list of GETs
            sref = self.framecache.get(v)
            if sref is None:
                body = v[3:-1] if len(v) > 2 and v[2] == 0x28 else v[2:-1]
                fids = []
                memo = self.memo
                i, n = 0, len(body)
                while i < n:
                    if body[i] == 0x68:
                        idx, i = body[i + 1], i + 2
                    else:
                        idx, i = _U32(body, i + 1)[0], i + 5
                    f = memo[idx] if idx < len(memo) else None
                    if type(f) is not _FrameRef:
                        raise _NotSimple
                    fids.append(f.fid)
                sref = self.framecache[v] = self.stacks.stack(tuple(fids))
            return sref, -1
        if v[0] in (0x68, 0x6a):  # the same traceback as an earlier entry (or block)
            idx = v[1] if v[0] == 0x68 else _U32(v, 1)[0]
            obj = self.memo[idx] if idx < len(self.memo) else None
            if type(obj) is _StackRef:
                return obj, -2
            if isinstance(obj, list):
                return self.stacks.stack_of(obj), idx
        raise _NotSimple

    def _discover(self, p: int) -> Any:
        """The layout of the entry at ``p`` through the general patterns, or None."""
        for rx in _ENTRY_PATTERNS:
            m = rx.match(self.buf, p)
            if m is not None:
                keys = m.groups()[0::2]
                layout = self.plans.get(keys)
                return self._layout(keys) if layout is None else layout
        return None

    def _fast(self, p: int) -> int:
        """Consume consecutive trace entries starting at ``p`` (an EMPTY_DICT); return where it stopped."""
        buf, memo, stack, pending = self.buf, self.memo, self.stack, self.pending
        actcache, layouts, framecache = self.actcache, self.layouts, self.framecache
        from_bytes = int.from_bytes
        empty = self.stacks._srefs[0]
        ints = self.ints
        hot = None  # the match of the last entry's layout when it is torch's (see below)
        ia = iaddr = isize = itime = iframes = -1  # that layout's groups
        while True:
            if hot is not None:
                # The common case in one step: an entry in torch's layout (the traceback, a new list of
                # GETs, is the one value that makes a memo slot) whose action and traceback were seen
                # before. It does what the general path below does for such an entry.
                m = hot(buf, p)
                if m is not None:
                    g = m.groups()
                    code = actcache.get(g[ia])
                    sref = framecache.get(g[iframes])  # only new lists of GETs are in it
                    if code is not None and sref is not None:
                        v = g[iaddr]
                        addr = ints.get(v)
                        if addr is None:
                            addr = ints[v] = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                              else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        v = g[isize]
                        size = ints.get(v)
                        if size is None:
                            size = ints[v] = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                              else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        v = g[itime]
                        when = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                                else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
                        memo.append(_ENTRY)
                        memo.append(sref)
                        stack.append(_ENTRY)
                        pending.append((code, addr if code != _OOM else 0, size, when, sref.sid)
                                       if code in _KEPT else None)
                        p = m.end()
                        continue
                if len(ints) > (1 << 18):
                    ints.clear()
            m = None
            for layout in layouts:
                m = layout[0].match(buf, p)
                if m is not None:
                    break
            if m is None:
                layout = self._discover(p)
                if not layout:
                    return p
                m = layout[0].match(buf, p)
                if m is None:
                    return p
            if layout is not layouts[0]:
                layouts.remove(layout)
                layouts.insert(0, layout)
            _, ia, iaddr, isize, itime, iframes, imemo = layout
            g = m.groups()
            code = actcache.get(g[ia])
            if code is None:
                av = g[ia]
                idx = av[1] if av[0] == 0x68 else _U32(av, 1)[0]
                name = memo[idx] if idx < len(memo) else None
                if type(name) is not str:
                    return p
                code = actcache[av] = _ACTIONS.get(name, -1)
            # ints: BININT1/BININT2 unsigned, BININT and LONG1 signed, little-endian
            v = g[iaddr] if iaddr >= 0 else b"N"
            addr = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            v = g[isize] if isize >= 0 else b"N"
            size = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            v = g[itime] if itime >= 0 else b"N"
            when = (from_bytes(v[2:], "little", signed=True) if v[0] == 0x8a
                    else from_bytes(v[1:], "little", signed=v[0] == 0x4a))
            slot = -2
            if iframes >= 0:
                fv = g[iframes]
                sref = framecache.get(fv)
                if sref is None:
                    try:
                        sref, slot = self._frames_value(fv)
                    except _NotSimple:
                        return p
            else:
                sref = empty
            if len(imemo) == 1 and imemo[0] == iframes:  # torch's layout: the traceback is the one new slot
                memo.append(_ENTRY)
                if fv[0] == 0x5d:
                    memo.append(sref)
            else:
                for i in imemo:  # other values must be ones we can memoize as the general loop would
                    c = g[i][0]
                    if (c == 0x5d and i != iframes) or (c == 0x8c and g[i] != b"\x8c\x00\x94"):
                        return p
                memo.append(_ENTRY)
                for i in imemo:
                    c = g[i][0]
                    if c == 0x5d:
                        memo.append(sref)
                    elif c == 0x8c:
                        memo.append("")
            if slot >= 0:
                memo[slot] = sref
            stack.append(_ENTRY)
            pending.append((code, addr if code != _OOM else 0, size, when, sref.sid) if code in _KEPT else None)
            p = m.end()
            torch_layout = len(imemo) == 1 and imemo[0] == iframes and min(iaddr, isize, itime) >= 0
            hot = layout[0].match if torch_layout else None

    # -- the general loop -----------------------------------------------------------------------
    def load(self) -> Any:
        try:
            return self._run()
        except (IndexError, struct.error, UnicodeDecodeError, ValueError, KeyError, OverflowError,
                TypeError) as e:
            if self.pos >= len(self.buf) - 9:  # an opcode's argument runs past the end: 8 bytes at most
                raise _Damaged("ends early") from None
            raise _Damaged(f"is damaged at byte {self.pos} ({type(e).__name__})") from None

    def _run(self) -> Any:
        buf = self.buf
        n = len(buf)
        stack, marks, memo, slots = self.stack, self.marks, self.memo, self.slots
        appending = self._appending
        report_every = 1 << 26
        report_at = 1 << 24  # the first report early: a view draws the part read from it
        p = 0
        while True:
            self.pos = p
            if p >= n:
                raise _Damaged("ends early")
            op = buf[p]
            p += 1
            if op == 0x68:  # BINGET
                stack.append(memo[buf[p]])
                p += 1
            elif op == 0x6a:  # LONG_BINGET
                stack.append(memo[_U32(buf, p)[0]])
                p += 4
            elif op == 0x94:  # MEMOIZE
                obj = stack[-1]
                if type(obj) is dict or type(obj) is list:
                    slots[id(obj)] = len(memo)
                memo.append(obj)
            elif op == 0x7d:  # EMPTY_DICT: most often the start of a run of trace entries
                q = self._fast(p - 1)
                if q != p - 1:
                    p = q
                    if p >= report_at:
                        report_at = p + report_every
                        self._progress(p)
                    continue
                stack.append({})
            elif op == 0x8c:  # SHORT_BINUNICODE
                k = buf[p]
                if p + 1 + k > n:
                    self._length(k, p + 1)
                stack.append(str(buf[p + 1:p + 1 + k], "utf-8", "surrogatepass"))
                p += 1 + k
            elif op == 0x4b:  # BININT1
                stack.append(buf[p])
                p += 1
            elif op == 0x4d:  # BININT2
                stack.append(buf[p] | (buf[p + 1] << 8))
                p += 2
            elif op == 0x4a:  # BININT
                stack.append(_I32(buf, p)[0])
                p += 4
            elif op == 0x8a:  # LONG1
                k = buf[p]
                stack.append(int.from_bytes(buf[p + 1:p + 1 + k], "little", signed=True))
                p += 1 + k
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x75:  # SETITEMS
                k = marks.pop()
                d = stack[k - 1]
                items = stack[k:]
                del stack[k:]
                if type(d) is not dict:
                    raise _Damaged("SETITEMS on something that is not a dict")
                for i in range(0, len(items) - 1, 2):
                    d[items[i]] = items[i + 1]
            elif op == 0x65:  # APPENDS
                k = marks.pop()
                target = stack[k - 1]
                items = stack[k:]
                del stack[k:]
                items = appending(target, items)
                if items:
                    if type(target) is list:
                        target.extend(items)
                    elif isinstance(target, (set,)):
                        target.update(items)
                    else:
                        raise _Damaged("APPENDS on something that is not a list")
                if p >= report_at:
                    report_at = p + report_every
                    self._progress(p)
            elif op == 0x5d:  # EMPTY_LIST
                stack.append([])
            elif op == 0x61:  # APPEND
                target = stack[-2]
                for item in appending(target, [stack.pop()]):
                    if type(target) is not list:
                        raise _Damaged("APPEND on something that is not a list")
                    target.append(item)
            elif op == 0x73:  # SETITEM
                v = stack.pop()
                key = stack.pop()
                d = stack[-1]
                if type(d) is not dict:
                    raise _Damaged("SETITEM on something that is not a dict")
                d[key] = v
            elif op == 0x95:  # FRAME: a length hint only
                p += 8
            elif op == 0x80:  # PROTO
                p += 1
            elif op == 0x2e:  # STOP
                self.pos = p
                self._progress(p)
                if len(stack) != 1:
                    raise _Damaged(f"stops with {len(stack)} objects on the stack")
                return stack[0]
            elif op == 0x4e:  # NONE
                stack.append(None)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x86:  # TUPLE2
                stack[-2:] = [(stack[-2], stack[-1])]
            elif op == 0x87:  # TUPLE3
                stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
            elif op == 0x74:  # TUPLE
                k = marks.pop()
                t = tuple(stack[k:])
                del stack[k:]
                stack.append(t)
            elif op == 0x6c:  # LIST
                k = marks.pop()
                lst: list = []
                lst.extend(appending(lst, stack[k:]))
                del stack[k:]
                stack.append(lst)
            elif op == 0x64:  # DICT
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                stack.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
            elif op == 0x71:  # BINPUT
                p = self._put(buf[p], p + 1)
            elif op == 0x72:  # LONG_BINPUT
                p = self._put(_U32(buf, p)[0], p + 4)
            elif op == 0x70:  # PUT (text)
                line, p = self._line(p)
                self._put(int(line), p)
            elif op == 0x67:  # GET (text)
                line, p = self._line(p)
                stack.append(memo[int(line)])
            elif op == 0x58:  # BINUNICODE
                k = self._length(_U32(buf, p)[0], p + 4)
                stack.append(str(buf[p + 4:p + 4 + k], "utf-8", "surrogatepass"))
                p += 4 + k
            elif op == 0x8d:  # BINUNICODE8
                k = self._length(_U64(buf, p)[0], p + 8)
                stack.append(str(buf[p + 8:p + 8 + k], "utf-8", "surrogatepass"))
                p += 8 + k
            elif op == 0x43:  # SHORT_BINBYTES
                k = buf[p]
                stack.append(bytes(buf[p + 1:p + 1 + k]))
                p += 1 + k
            elif op == 0x42:  # BINBYTES
                k = self._length(_U32(buf, p)[0], p + 4)
                stack.append(bytes(buf[p + 4:p + 4 + k]))
                p += 4 + k
            elif op == 0x8e:  # BINBYTES8
                k = self._length(_U64(buf, p)[0], p + 8)
                stack.append(bytes(buf[p + 8:p + 8 + k]))
                p += 8 + k
            elif op == 0x96:  # BYTEARRAY8
                k = self._length(_U64(buf, p)[0], p + 8)
                stack.append(bytearray(buf[p + 8:p + 8 + k]))
                p += 8 + k
            elif op == 0x55:  # SHORT_BINSTRING (python 2 str)
                k = buf[p]
                stack.append(bytes(buf[p + 1:p + 1 + k]).decode("latin-1"))
                p += 1 + k
            elif op == 0x54:  # BINSTRING
                k = self._length(_I32(buf, p)[0], p + 4)
                stack.append(bytes(buf[p + 4:p + 4 + k]).decode("latin-1"))
                p += 4 + k
            elif op == 0x53:  # STRING (text, quoted)
                line, p = self._line(p)
                if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
                    raise _Damaged("a STRING opcode without quotes")
                stack.append(codecs.escape_decode(line[1:-1])[0].decode("latin-1"))
            elif op == 0x56:  # UNICODE (text)
                line, p = self._line(p)
                stack.append(line.decode("raw-unicode-escape"))
            elif op == 0x49:  # INT (text)
                line, p = self._line(p)
                stack.append(True if line == b"01" else False if line == b"00" else int(line))
            elif op == 0x4c:  # LONG (text)
                line, p = self._line(p)
                stack.append(int(line.rstrip(b"L")))
            elif op == 0x8b:  # LONG4
                k = self._length(_I32(buf, p)[0], p + 4)
                stack.append(int.from_bytes(buf[p + 4:p + 4 + k], "little", signed=True))
                p += 4 + k
            elif op == 0x46:  # FLOAT (text)
                line, p = self._line(p)
                stack.append(float(line))
            elif op == 0x47:  # BINFLOAT
                stack.append(_F64(buf, p)[0])
                p += 8
            elif op == 0x8f:  # EMPTY_SET
                stack.append(set())
            elif op == 0x90:  # ADDITEMS
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                target = stack[-1]
                if type(target) is not set:
                    raise _Damaged("ADDITEMS on something that is not a set")
                target.update(items)
            elif op == 0x91:  # FROZENSET
                k = marks.pop()
                fs = frozenset(stack[k:])
                del stack[k:]
                stack.append(fs)
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    marks.pop()
            elif op == 0x31:  # POP_MARK
                k = marks.pop()
                del stack[k:]
            elif op == 0x32:  # DUP
                stack.append(stack[-1])
            elif op in _OPNAMES:
                raise _Refused(self._refusal(op, p))
            else:
                raise _Damaged(f"has byte 0x{op:02x} at offset {p - 1}, which is no pickle opcode")

    def _put(self, idx: int, p: int) -> int:
        memo = self.memo
        obj = self.stack[-1]
        if idx == len(memo):
            memo.append(obj)
        elif idx < len(memo):
            memo[idx] = obj
            self._forget_caches()
        else:
            if idx > len(memo) + (1 << 24):
                raise _Damaged(f"puts memo slot {idx}, far beyond the {len(memo)} in use")
            memo.extend([None] * (idx - len(memo)))
            memo.append(obj)
        if type(obj) is dict or type(obj) is list:
            self.slots[id(obj)] = idx
        return p

    def _line(self, p: int) -> tuple[bytes, int]:
        end = self.buf.find(b"\n", p)
        if end < 0:
            self.pos = len(self.buf)
            raise _Damaged("ends early")
        return bytes(self.buf[p:end]), end + 1

    def _length(self, k: int, p: int) -> int:
        if k < 0 or p + k > len(self.buf):
            self.pos = len(self.buf)
            raise _Damaged("ends early")
        return k

    def _refusal(self, op: int, p: int) -> str:
        if op in (0x63, 0x69):  # GLOBAL / INST: "module\nname\n"
            try:
                module, p = self._line(p)
                name, _ = self._line(p)
                return f"{module.decode('utf-8', 'replace')}.{name.decode('utf-8', 'replace')}"
            except _Damaged:
                pass
        if op == 0x93 and len(self.stack) >= 2 and all(isinstance(x, str) for x in self.stack[-2:]):
            return f"{self.stack[-2]}.{self.stack[-1]}"
        return f"the pickle opcode {_OPNAMES[op]} (it would construct or call an object)"

    def _progress(self, p: int) -> None:
        if self.progress is not None:
            self.progress(p)
        buf = self.buf
        if isinstance(buf, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            # hand back the pages already read: a 1 GB file would otherwise count fully in our RSS
            end = (p - (1 << 20)) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > 0:
                try:
                    buf.madvise(mmap.MADV_DONTNEED, 0, end)
                except OSError:
                    pass


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
    f = open(path, "rb")
    try:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return f, b""
        return f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        data = f.read()
        return f, data


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
            from tqdm.auto import tqdm
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
            top = reader.load()
        except _Refused as e:
            raise ValueError(f"{path} is not a plain-data torch memory snapshot: it refers to {e}; "
                             "refusing to load it") from None
        except _Damaged as e:
            if str(e) == "ends early":
                raise ValueError(f"{path} ends early (truncated at {len(buf)} bytes): the snapshot was not "
                                 f"fully written; {_TIMELINE_FIX}") from None
            raise ValueError(f"{path} is not a readable pickle: it {e}; {_TIMELINE_FIX}") from None
        reader.memo = reader.stack = reader.pending = []  # the memo alone is 16 bytes a trace entry
        return _raw_from_top(top, reader.traces, stacks, str(path))
    finally:
        if bar is not None:
            bar.close()
        if isinstance(buf, mmap.mmap):
            buf.close()
        f.close()


def _raw_from_top(top: Any, traces: Mapping[int, _Trace], stacks: _Stacks, name: str) -> _RawSnapshot:
    if not isinstance(top, dict) or not isinstance(top.get("device_traces"), list):
        what = f"a dict with keys {sorted(map(str, top))[:6]}" if isinstance(top, dict) else type(top).__name__
        raise ValueError(f"{name} is a pickle but not a torch memory snapshot (it holds {what}, no "
                         "'device_traces'); pass the file torch.cuda.memory._dump_snapshot() writes")
    arrays = []
    for lst in top["device_traces"]:
        if not isinstance(lst, list):
            raise ValueError(f"{name} is not a torch memory snapshot: device_traces holds "
                             f"{type(lst).__name__}, not lists of trace entries")
        tr = traces.get(id(lst))
        arrays.append(tr.columns() if tr is not None else _Columns.empty())
    blocks, reserved = [], 0
    for seg in top.get("segments") or []:
        if not isinstance(seg, dict):
            continue
        reserved += _as_int(seg.get("total_size", 0))
        addr = seg.get("address", 0)
        for b in seg.get("blocks") or []:
            if not isinstance(b, dict):
                continue
            size = _as_int(b.get("size", 0))
            a = _as_int(b.get("address", addr))
            state = str(b.get("state", ""))
            if state.startswith("active"):
                req = b.get("requested_size")
                blocks.append((a, _as_int(req) if req is not None else size, stacks.stack_of(b.get("frames")).sid))
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
# Stack frames -> phase, category hint, module, op
# ==================================================================================================

_WRAPPERS = frozenset({"_call_impl", "_wrapped_call_impl", "wrapper", "inner", "decorate_context", "_fn",
                       "<module>", "__call__", "_use_grad", "maybe_fallback", "__torch_function__",
                       "__torch_dispatch__", "_no_grad_wrapper", "<lambda>", "_run_code", "_run_module_as_main"})
_BUILD_NAMES = frozenset({"reset_parameters", "init_weights", "_init_weights", "fully_shard", "to_empty"})
_MODULE_BUILD = frozenset({"_apply", "to", "cuda", "to_empty", "load_state_dict", "_load_from_state_dict",
                           "register_parameter"})
_ATEN = re.compile(r"at::_ops::(\w+)::")


def classify_frames(frames: Sequence[tuple[str, int, str]]) -> tuple[str | None, str | None, str, str]:
    """``(phase, category hint, module, op)`` of one stack, innermost frame first (see the module docstring).

    ``phase`` is None for an empty stack, or one of library frames only that show no phase (a hook that
    autograd's thread runs): the caller carries the previous phase forward. The hint is a
    category that holds whatever the lifetime rule would say (communication, checkpoint, parameter,
    gradient for ``AccumulateGrad``), or None."""
    if not frames:
        return None, None, "", ""
    ckpt = comm = opt = bwd = fwd = build = grad = recompute = user = False
    module = op = py_op = ""
    for filename, line, name in frames:
        f = filename.replace("\\", "/")
        if "torch/distributed/checkpoint/" in f or "workbench/checkpoint/" in f:
            ckpt = True
        if ("distributed_c10d.py" in f or "_functional_collectives" in f or "_fsdp_collectives" in f
                or "c10d::" in name or "nccl" in name.lower() or "gloo:" in name or "ProcessGroup" in name):
            comm = True
        if "torch/optim/" in f or name.startswith("Optimizer."):
            opt = True
        if (("torch/autograd/" in f and name in ("backward", "_engine_run_backward", "grad", "run_backward"))
                or (f.endswith("torch/_tensor.py") and name == "backward")
                or "autograd::engine" in name.lower() or "Engine::evaluate_function" in name
                or "Engine::thread_main" in name):
            bwd = True
        if "AccumulateGrad" in name:
            bwd = grad = True
        if "torch/utils/checkpoint.py" in f and ("unpack" in name or "recompute" in name):
            bwd = recompute = True
        if not ("/torch/" in f or "site-packages/" in f or f.startswith("<") or f in ("??", "")):
            user = True
        is_module_py = f.endswith("torch/nn/modules/module.py")
        if (is_module_py and name in _MODULE_BUILD) or name in _BUILD_NAMES or f.endswith("torch/nn/init.py"):
            build = True
        if name == "forward" or (is_module_py and name in ("_call_impl", "_wrapped_call_impl")):
            fwd = True
            if name == "forward" and not module and not is_module_py:
                module = f"{f.rsplit('/', 1)[-1]}:{line}"
        if not op:
            m = _ATEN.search(name)
            if m:
                op = f"aten::{m.group(1)}"
            elif name.startswith("aten::"):  # a profiler's operator event
                op = name
        if name.startswith("nn.Module: "):  # a profiler's module event
            fwd = True
        if not py_op and filename not in ("??", "") and name not in _WRAPPERS and "::" not in name:
            py_op = name
    phase = ("checkpoint" if ckpt else "optimizer" if opt else "backward" if bwd else "forward" if fwd
             else "build" if build else "other" if user else None)  # library frames only: a hook, carry on
    hint = ("checkpoint" if ckpt else "communication" if comm else "gradient" if grad
            else "activation" if recompute else "parameter" if build and phase == "build" else None)
    return phase, hint, module, op or py_op


class _Contexts:
    """Per context (a snapshot stack, or a profiler's enclosing events): phase code (-1: take the previous
    one), category hint code (-1: lifetime rule), module code and op code into vocabularies."""

    def __init__(self, labels: Sequence[tuple[str | None, str | None, str, str]]):
        self.phase = np.array([_PH[p] if p else -1 for p, _, _, _ in labels], dtype=np.int8)
        self.hint = np.array([_CAT[h] if h else -1 for _, h, _, _ in labels], dtype=np.int8)
        self.module_vocab: list[str] = [""]
        self.op_vocab: list[str] = ["", "(free)", "(merged)"]
        mv = {"": 0}
        ov = {s: i for i, s in enumerate(self.op_vocab)}
        self.module = np.array([mv.setdefault(m, len(mv)) for _, _, m, _ in labels], dtype=np.int32)
        self.op = np.array([ov.setdefault(o, len(ov)) for _, _, _, o in labels], dtype=np.int32)
        self.module_vocab = list(mv)
        self.op_vocab = list(ov)

    @classmethod
    def of_stacks(cls, stacks: _Stacks) -> "_Contexts":
        return cls([classify_frames(stacks.frames_of(s)) for s in range(len(stacks.stacks))])


# ==================================================================================================
# Events -> rows of the schema
# ==================================================================================================

def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 - 2 else np.int64


def _next_true(mask: np.ndarray) -> np.ndarray:
    """For every i, the smallest j > i with mask[j] (len(mask) if none)."""
    n = len(mask)
    it = _index_dtype(n)
    at = np.where(mask, np.arange(n, dtype=it), it(n))
    at = np.minimum.accumulate(at[::-1])[::-1]  # smallest j >= i
    out = np.empty(n, dtype=it)
    out[:-1] = at[1:]
    if n:
        out[-1] = n
    return out


def _ffill(codes: np.ndarray, default: int) -> np.ndarray:
    """Replace -1 by the last code before it (``default`` where there is none)."""
    valid = codes >= 0
    if valid.all() or not len(codes):
        return codes.astype(np.int8)
    idx = np.where(valid, np.arange(len(codes), dtype=_index_dtype(len(codes))), -1)
    np.maximum.accumulate(idx, out=idx)
    out = np.where(idx >= 0, codes[np.maximum(idx, 0)], default)
    return out.astype(np.int8)


_ROW_FIELDS = ("t", "delta", "cat", "phase", "step", "module", "op", "id")


class _Rows:
    """The rows of one rank before totals: parallel arrays, in event order."""
    __slots__ = _ROW_FIELDS

    def __init__(self, **cols: np.ndarray):
        for k in _ROW_FIELDS:
            setattr(self, k, cols[k])

    def __len__(self) -> int:
        return len(self.delta)

    def take(self, idx: np.ndarray) -> "_Rows":
        return _Rows(**{k: getattr(self, k)[idx] for k in _ROW_FIELDS})


def _label_events(t: np.ndarray, is_alloc: np.ndarray, addr: np.ndarray, size: np.ndarray, ctx: np.ndarray,
                  contexts: _Contexts, identities: Mapping[int, str] | None,
                  step: np.ndarray | None = None) -> tuple[_Rows, dict[str, Any]]:
    """Pair frees with allocations, number them, and give every row its phase, category, step, module, op.

    Returns the rows and what the caller needs for ``base_bytes``: ``orphan_bytes`` (frees of
    allocations made before the events start) and ``live_addr`` (addresses allocated and still live at
    the end). Written for 10^7 events: index arrays are int32 and temporaries are dropped early."""
    n = len(addr)
    it = _index_dtype(n)
    is_alloc = np.asarray(is_alloc, dtype=bool)
    # pairing: in (address, time) order a free follows the allocation it frees
    order = np.argsort(addr, kind="stable").astype(it)
    pair = np.zeros(n, dtype=bool)
    if n > 1:
        a_sorted = addr[order]
        np.equal(a_sorted[1:], a_sorted[:-1], out=pair[1:])
        del a_sorted
        al_sorted = is_alloc[order]
        pair[1:] &= al_sorted[:-1] & ~al_sorted[1:]
        del al_sorted
    at = np.flatnonzero(pair)
    del pair
    partner = np.full(n, -1, dtype=it)
    partner[order[at]] = order[at - 1]
    partner[order[at - 1]] = order[at]
    del order, at
    paired = ~is_alloc & (partner >= 0)
    orphan = ~is_alloc & (partner < 0)
    safe_partner = np.where(partner >= 0, partner, 0).astype(it)

    ids = np.zeros(n, dtype=np.int64)
    n_alloc = int(is_alloc.sum())
    ids[is_alloc] = np.arange(1, n_alloc + 1)
    ids[paired] = ids[partner[paired]]
    ids[orphan] = n_alloc + 1 + np.arange(int(orphan.sum()))
    delta = size.astype(np.int64, copy=True)
    delta[paired] = size[partner[paired]]
    np.negative(delta, out=delta, where=~is_alloc)

    # phase: the context's own, carried forward over empty stacks and over frees that repeat their
    # allocation's stack (torch's context="alloc" records the allocating stack on the free)
    own = contexts.phase[ctx] if n else np.zeros(0, dtype=np.int8)
    own[paired & (ctx == ctx[safe_partner])] = -1
    phase = _ffill(own, _PH["other"])
    del own

    if step is None:
        opt = phase == _PH["optimizer"]
        step = np.zeros(n, dtype=np.int32)
        if opt.any():
            step[1:] = opt[:-1] & ~opt[1:]
            np.cumsum(step, out=step)
        else:
            step[:] = -1
        del opt

    # category: hint, else the lifetime rule of the allocating phase
    free_at = np.where(partner >= 0, partner, it(n + 1)).astype(it)
    cat = np.full(n, _CAT["other"], dtype=np.int8)
    rules = ((_PH["forward"], phase == _PH["backward"], _CAT["activation"]),
             (_PH["backward"], phase == _PH["optimizer"], _CAT["gradient"]),
             (_PH["optimizer"], phase != _PH["optimizer"], _CAT["optimizer"]))
    for ph, consumer, survivor in rules:
        m = is_alloc & (phase == ph)
        if m.any():
            nxt = _next_true(consumer)
            cat[m] = np.where(free_at[m] > nxt[m], survivor, _CAT["temporary"])
            del nxt
        del m
    del free_at
    cat[is_alloc & (phase == _PH["checkpoint"])] = _CAT["checkpoint"]
    cat[is_alloc & (phase == _PH["build"])] = _CAT["parameter"]
    if n:
        hint = contexts.hint[ctx]
        hinted = is_alloc & (hint >= 0)
        cat[hinted] = hint[hinted]
        del hint, hinted
    live = is_alloc & (partner < 0)
    if identities:
        known = {int(k): _CAT[_check_category(v)] for k, v in identities.items()}
        live_pos = np.flatnonzero(live)
        for i in live_pos[np.isin(addr[live_pos], np.fromiter(known, dtype=np.int64, count=len(known)))]:
            cat[i] = known[int(addr[i])]
    cat[paired] = cat[partner[paired]]
    cat[orphan] = _CAT["other"]

    module = contexts.module[ctx] if n else np.zeros(0, dtype=np.int32)
    module[paired] = module[partner[paired]]
    op = np.ones(n, dtype=np.int32)  # "(free)"
    if n:
        op[is_alloc] = contexts.op[ctx[is_alloc]]
    facts = {"orphan_bytes": int(size[orphan].sum()) if n else 0, "live_addr": addr[live]}
    rows = _Rows(t=np.asarray(t, dtype=np.float64), delta=delta, cat=cat, phase=phase, step=step.astype(np.int32),
                 module=module.astype(np.int32), op=op, id=ids)
    return rows, facts


def _check_category(c: str) -> str:
    if c not in _CAT:
        raise ValueError(f"unknown memory category {c!r} in identities; use one of {list(CATEGORIES)}")
    return c


def _merged_groups(rows: _Rows, total: np.ndarray, large: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """For the small events (``~large``): their positions and the (bin half, category) key of each.

    Runs of small events between large ones are cut into bins of ``b`` events; each bin is split after
    its highest total (the first event reaching it), so the peak ends a group."""
    n = len(rows)
    it = _index_dtype(n)
    small_pos = np.flatnonzero(~large).astype(it)
    if not len(small_pos):
        return small_pos, np.zeros(0, dtype=np.int64)
    last_large = np.maximum.accumulate(np.where(large, np.arange(n, dtype=it), it(-1)))[small_pos]
    bin_of = (small_pos - last_large - 1) // b  # position in the run, in bins
    new_bin = np.ones(len(small_pos), dtype=bool)
    new_bin[1:] = (last_large[1:] != last_large[:-1]) | (bin_of[1:] != bin_of[:-1])
    del last_large, bin_of
    starts = np.flatnonzero(new_bin)
    chunk = (np.cumsum(new_bin) - 1).astype(it)
    del new_bin
    tot = total[small_pos]
    cmax = np.maximum.reduceat(tot, starts)
    hit = np.flatnonzero(tot == cmax[chunk])
    del tot, cmax
    first_hit = np.full(len(starts), len(small_pos), dtype=it)
    np.minimum.at(first_hit, chunk[hit], hit.astype(it))
    del hit
    after_peak = np.arange(len(small_pos), dtype=it) > first_hit[chunk]
    key = (chunk.astype(np.int64) * 2 + after_peak) * len(CATEGORIES) + rows.cat[small_pos]
    return small_pos, key


def _downsample(rows: _Rows, base: int, max_events: int) -> tuple[_Rows, dict[str, Any]]:
    """At most ``max_events`` rows with the same totals at every kept row, the same peak and breakdown.

    The largest events stay as they are. Runs of smaller events between them are cut into bins of ``b``
    events; each bin is split at its highest total, and each half becomes one row per category
    (negative rows first, so no merged row rises above a real total). ``b`` doubles until the rows
    fit; when even whole runs do not fit (too many runs), fewer events are kept whole."""
    n = len(rows)
    total = base + np.cumsum(rows.delta)
    absd = np.abs(rows.delta)
    keep = max_events // 4
    while True:
        if keep > 0 and n > keep:
            threshold = int(np.partition(absd, n - keep)[n - keep])
            large = absd > threshold
        else:
            threshold, large = int(absd.max()) if n else 0, np.zeros(n, dtype=bool)
        n_large = int(large.sum())
        n_small = n - n_large
        b = max(1, n_small // max(1, max_events - n_large))
        while True:
            small_pos, key = _merged_groups(rows, total, large, b)
            # the rows a bin makes: one per category present in each half (keys are small and dense)
            present = np.zeros(int(key[-1] // len(CATEGORIES) + 1) * len(CATEGORIES) if len(key) else 0, dtype=bool)
            present[key] = True
            count = int(present.sum())
            if n_large + count <= max_events or b >= n_small:
                break
            b *= 2
        if n_large + count <= max_events:
            break
        del small_pos, key, present
        keep //= 2
    del absd
    uniq = np.flatnonzero(present)
    slot = np.cumsum(present, dtype=_index_dtype(len(present))) - 1
    del present
    inverse = slot[key]
    del slot
    sums = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(sums, inverse, rows.delta[small_pos])
    del inverse
    # the last event of a group places all its rows (keys grow along the events: groups are contiguous)
    group = key // len(CATEGORIES)
    ends = np.flatnonzero(np.r_[group[1:] != group[:-1], True]) if len(group) else np.zeros(0, dtype=np.int64)
    anchor = small_pos[ends][np.searchsorted(group[ends], uniq // len(CATEGORIES))].astype(np.int64)
    del key, group, ends, small_pos
    ucat = (uniq % len(CATEGORIES)).astype(np.int8)
    nonzero = sums != 0
    sums, ucat, anchor = sums[nonzero], ucat[nonzero], anchor[nonzero]
    merged = _Rows(t=rows.t[anchor], delta=sums, cat=ucat, phase=rows.phase[anchor], step=rows.step[anchor],
                   module=np.zeros(len(sums), dtype=np.int32), op=np.full(len(sums), 2, dtype=np.int32),
                   id=-1 - ucat.astype(np.int64))
    large_pos = np.flatnonzero(large)
    kept = rows.take(large_pos)
    # order: by anchor event; a group's negative rows before its positive ones, then by category
    order_key = np.concatenate([large_pos.astype(np.int64) * 4 + 3, anchor * 4 + (sums > 0)])
    sub = np.concatenate([np.zeros(len(large_pos), dtype=np.int8), ucat])
    order = np.lexsort((sub, order_key))
    both = _Rows(**{k: np.concatenate([getattr(kept, k), getattr(merged, k)])[order] for k in _ROW_FIELDS})
    return both, {"events": n, "rows": len(both), "kept_above_bytes": threshold, "bin_events": b}


def _frame(rank: int, rows: _Rows, base: int, contexts: _Contexts) -> pd.DataFrame:
    n = len(rows)
    return pd.DataFrame({
        "rank": np.full(n, rank, dtype=np.int32), "t": rows.t, "delta_bytes": rows.delta,
        "total_bytes": base + np.cumsum(rows.delta),
        "category": pd.Categorical.from_codes(rows.cat, categories=list(CATEGORIES)),
        "phase": pd.Categorical.from_codes(rows.phase, categories=list(PHASES)),
        "step": rows.step, "microbatch": np.full(n, -1, dtype=np.int32),
        "module": pd.Categorical.from_codes(rows.module, categories=contexts.module_vocab),
        "op": pd.Categorical.from_codes(rows.op, categories=contexts.op_vocab),
        "id": rows.id})


class _RankResult:
    """One rank's part of a timeline: frame, base and meta, with ``t`` in absolute seconds until placed."""

    def __init__(self, rank: int, frame: pd.DataFrame, base: int, base_by_category: dict[str, int],
                 meta: dict[str, Any], origin: float | None):
        self.rank, self.frame, self.base = rank, frame, base
        self.base_by_category, self.meta, self.origin = base_by_category, meta, origin


def _finish(rank: int, rows: _Rows, base: int, base_by_category: dict[str, int], contexts: _Contexts,
            max_events: int, meta: dict[str, Any], origin: float | None) -> _RankResult:
    if max_events < 16:
        raise ValueError(f"max_events={max_events} is too small to keep a timeline's shape; use 16 or more")
    if len(rows) > max_events:
        rows, info = _downsample(rows, base, max_events)
        meta.setdefault("downsampled", {})[str(rank)] = info
    return _RankResult(rank, _frame(rank, rows, base, contexts), base,
                       {k: v for k, v in base_by_category.items() if v}, meta, origin)


def _join(parts: Sequence[_RankResult], source: str, device: str, extra_meta: dict[str, Any]) -> MemoryTimeline:
    """Ranks on one clock: ``t`` from the earliest first event of any rank."""
    origins = [p.origin for p in parts if p.origin is not None]
    origin = min(origins) if origins else 0.0
    meta: dict[str, Any] = dict(extra_meta)
    frames = []
    for p in parts:
        f = p.frame
        if p.origin is not None and len(f):
            f = f.assign(t=f["t"].to_numpy() - origin)
        frames.append(f)
        for key, value in p.meta.items():
            if isinstance(value, dict):
                meta.setdefault(key, {}).update(value)
            else:
                meta[key] = value
        meta.setdefault("base_by_category", {})[str(p.rank)] = p.base_by_category
    frame = pd.concat(frames, ignore_index=True) if frames else empty_frame()
    return MemoryTimeline(frame, source=source, device=device, base_bytes={p.rank: p.base for p in parts},
                          meta=meta)


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


_RANK_PATTERNS = (re.compile(r"rank[_-]?(\d+)", re.I), re.compile(r"(?:^|[_\-.])(\d+)$"))


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
            found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix in (".pickle", ".pkl"))
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
    reads, from its first bytes (nothing is unpickled); None for anything else."""
    p = Path(path)
    if p.is_dir():  # MemoryTimeline.save's directory (or a run directory holding it in memory/)
        for d in (p, p / "memory"):
            if d.is_dir() and any(identify_memory_file(q) == "timeline" for q in sorted(d.glob("*.json"))[:16]):
                return "timeline"
        if any(q.suffix in (".pickle", ".pkl") and identify_memory_file(q) == "snapshot" for q in p.iterdir()):
            return "snapshot"
        return None
    if not p.is_file():
        return None
    with open(p, "rb") as f:
        head = f.read(1 << 16)
    if head[:2] == b"\x1f\x8b":  # gzip: profilers write trace.json.gz
        import gzip
        try:
            with gzip.open(p, "rb") as g:
                head = g.read(1 << 16)
        except OSError:
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


# ==================================================================================================
# A synthetic snapshot, in torch's exact format, for tests and benchmarks
# ==================================================================================================

class _SpliceWriter:
    """Writes one protocol-4 pickle in pieces made by the C ``pickle.Pickler``, in bounded memory.

    A reader numbers memo slots in the order MEMOIZE opcodes arrive, and GET opcodes name slots by
    number. One persistent pickler (``head``) writes everything up to and including the first batch of
    trace entries, so its numbering is the reader's (the few opcodes written by hand get placeholder
    slots in its memo). The shared objects (key and action strings, frame dicts) are then taken from
    its memo with their slot numbers, and every later batch is pickled by a fresh pickler whose memo
    holds just those: its GETs of them are right, and its entries (new dicts and lists, never referred to
    again) are not kept anywhere. The picklers' FRAME opcodes are kept, resized where a piece is trimmed."""

    def __init__(self, f: Any):
        import io
        self.f = f
        self._bio = io.BytesIO()
        self.head: pickle.Pickler | None = pickle.Pickler(self._bio, protocol=4)
        self._placeholders: list = []
        self.shared: dict[int, tuple[int, Any]] = {}
        self.checked = False  # whether a batch was checked to make no shared object of its own
        f.write(b"\x80\x04")

    def raw(self, data: bytes, memoized: int = 0) -> None:
        """Opcodes written by hand; ``memoized`` of them are MEMOIZE (the head's numbering must follow)."""
        if memoized and self.head is not None:
            memo = self.head.memo.copy()
            for _ in range(memoized):
                ph = object()
                self._placeholders.append(ph)
                memo[id(ph)] = (len(memo), ph)
            self.head.memo = memo
        self.f.write(data)

    def head_obj(self, value: Any) -> None:
        assert self.head is not None, "the head pickler is retired once the first batch is written"
        self.head.dump(value)
        data = self._bio.getvalue()
        self._bio.seek(0)
        self._bio.truncate()
        self._write(data)

    def retire_head(self) -> None:
        """Keep the shared objects and their slots; the head's numbering is not followed from here on."""
        assert self.head is not None
        self.shared = {k: (idx, obj) for k, (idx, obj) in self.head.memo.copy().items()
                       if isinstance(obj, str) or (type(obj) is dict and "filename" in obj)}
        self.head = None

    def obj(self, value: Any, drop_prefix: bytes = b"", strict: bool = False) -> None:
        """A piece by a fresh pickler; ``strict``: it must not memoize a string or frame dict of its own
        (a second use of one would name a slot number the reader does not have)."""
        import io
        bio = io.BytesIO()
        p = pickle.Pickler(bio, protocol=4)
        p.memo = self.shared
        p.dump(value)
        if strict:
            new = [obj for key, (_, obj) in p.memo.copy().items() if key not in self.shared]
            assert not any(isinstance(o, str) or (type(o) is dict and "filename" in o) for o in new), \
                "a frame or string first used after the first batch"
        self._write(bio.getvalue(), drop_prefix)

    def items(self, batch: list) -> None:
        """Append ``batch`` to the list written last: that list's own EMPTY_LIST+MEMOIZE are dropped."""
        if batch:
            self.obj(batch, drop_prefix=b"]\x94", strict=not self.checked)  # the simulation repeats its steps
            self.checked = True

    def _write(self, data: bytes, drop_prefix: bytes = b"") -> None:
        pieces, pos = [], 2  # after PROTO
        while pos < len(data):
            if data[pos] == 0x95:
                k = int.from_bytes(data[pos + 1:pos + 9], "little")
                pieces.append(data[pos + 9:pos + 9 + k])
                pos += 9 + k
            else:
                pieces.append(data[pos:])
                break
        if drop_prefix:
            assert pieces[0].startswith(drop_prefix)
            pieces[0] = pieces[0][len(drop_prefix):]
        assert pieces[-1].endswith(b".")
        pieces[-1] = pieces[-1][:-1]
        for piece in pieces:
            if len(piece) >= 4:
                self.f.write(b"\x95" + len(piece).to_bytes(8, "little"))
            self.f.write(piece)


_SIMULATED_BYTES = 8 << 20  # a synthetic snapshot's steps are simulated up to here, then the last one repeats
_FRAME_TARGET = 64 << 10    # the pickler's frame size


def _repeat_step(w: _SpliceWriter, sim: "_TrainingSim", entries: list[dict], target_bytes: int) -> None:
    """Append copies of one simulated step's ``entries`` to the trace list being written, each later in
    time by the step's length, until the file reaches ``target_bytes``: gigabytes in seconds.

    A step after the first starts and ends with the same allocations alive (parameters and optimizer
    state), so its copies are valid steps: every address they allocate is free when they start. Each
    entry is pickled once, by a pickler holding the shared strings and frames as the head wrote them, so
    its bytes are the ones the C pickler writes for it in a list; copies differ only in the 7-byte
    ``time_us`` values (LONG1), rewritten with numpy. They are grouped as pickle groups them (MARK, at
    most 1000 items, APPENDS) in frames of about 64 KiB that end between opcodes."""
    import io
    sentinel = 0x5A << 48  # a 7-byte LONG1, as 2024's time_us values are
    pieces: list[bytes] = []
    offsets: list[int] = []
    for i, e in enumerate(entries):
        assert e["time_us"] < (1 << 55), "time_us must fit the 7-byte LONG1 the copies rewrite"
        bio = io.BytesIO()
        pk = pickle.Pickler(bio, protocol=4)
        pk.memo = w.shared
        pk.dump({**e, "time_us": sentinel + i})  # the same keys (the shared strings), in the same order
        data = bio.getvalue()
        body = data[11:-1] if data[2] == 0x95 else data[2:-1]  # PROTO, FRAME ... STOP
        mark = b"\x8a\x07" + (sentinel + i).to_bytes(7, "little")
        at = body.find(mark)
        assert at > 0 and body.find(mark, at + 1) < 0
        pieces.append(body)
        offsets.append(at + 2)
    template, times = bytearray(), []
    frame, frame_at = bytearray(), []
    def close_frame() -> None:
        if frame:
            template.extend(b"\x95" + len(frame).to_bytes(8, "little"))
            base = len(template)
            times.extend(base + o for o in frame_at)
            template.extend(frame)
            frame.clear()
            frame_at.clear()
    for b0 in range(0, len(pieces), 1000):
        frame.extend(b"(")
        for body, off in zip(pieces[b0:b0 + 1000], offsets[b0:b0 + 1000]):
            if len(frame) + len(body) > _FRAME_TARGET:
                close_frame()
            frame_at.append(len(frame) + off)
            frame.extend(body)
        frame.extend(b"e")
    close_frame()
    tpl = np.frombuffer(bytes(template), dtype=np.uint8)
    pos = np.asarray(times, dtype=np.int64)
    t0 = np.array([e["time_us"] for e in entries], dtype=np.int64)
    period = int(t0[-1] - t0[0]) + 20
    allocs = sum(1 for e in entries if e["action"] == "alloc")
    per_block = max(1, (32 << 20) // len(tpl))
    f = w.f
    reps = 0
    while f.tell() < target_bytes:
        k = min(per_block, -(-(target_bytes - f.tell()) // len(tpl)))
        block = np.tile(tpl, k)
        r = np.arange(1 + reps, 1 + reps + k, dtype=np.int64)
        when = t0[None, :] + r[:, None] * period
        assert when.max() < (1 << 55)
        raw = when.astype("<i8").view(np.uint8).reshape(k, len(t0), 8)[:, :, :7]
        at = (np.arange(k, dtype=np.int64)[:, None] * len(tpl) + pos[None, :])[:, :, None] + np.arange(7)
        block[at] = raw
        f.write(block.tobytes())
        reps += k
    sim.entries += reps * len(entries)
    sim.allocs += reps * allocs
    sim.steps += reps
    sim.clock = int(t0[-1]) + reps * period


def _synthetic_frames(n_frames: int) -> dict[str, list[dict]]:
    """Stacks (innermost first) of a training script, as torch records them: shared frame dicts."""
    def fr(filename: str, line: int, name: str) -> dict:
        return {"filename": filename, "line": line, "name": name}

    site = "/opt/conda/lib/python3.11/site-packages/torch"
    outer = [fr("/work/train.py", 88, "train_step"), fr("/work/train.py", 131, "main"),
             fr("/work/train.py", 140, "<module>")]
    pad = [fr("/work/loop.py", 10 + i, f"run_{i}") for i in range(max(0, n_frames - 12))]
    call = [fr(f"{site}/nn/modules/module.py", 1784, "_call_impl"),
            fr(f"{site}/nn/modules/module.py", 1773, "_wrapped_call_impl")]
    model = [fr("/work/model.py", 61, "forward")] + call + [fr("/work/model.py", 102, "forward")] + call
    stacks = {
        "linear": [fr(f"{site}/nn/modules/linear.py", 125, "forward")] + call + model,
        "attention": [fr(f"{site}/nn/functional.py", 6102, "scaled_dot_product_attention"),
                      fr("/work/model.py", 44, "forward")] + call + [fr("/work/model.py", 102, "forward")] + call,
        "norm": [fr(f"{site}/nn/modules/normalization.py", 217, "forward")] + call + model,
        "allgather": [fr(f"{site}/distributed/distributed_c10d.py", 3905, "all_gather_into_tensor"),
                      fr(f"{site}/distributed/c10d_logger.py", 81, "wrapper"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 250, "foreach_all_gather"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 290, "unshard"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_state.py", 240, "_pre_forward")] + call + model,
        "loss": [fr(f"{site}/nn/functional.py", 3462, "cross_entropy"), fr("/work/train.py", 80, "loss_fn")],
        "backward": [fr(f"{site}/autograd/graph.py", 829, "_engine_run_backward"),
                     fr(f"{site}/autograd/__init__.py", 353, "backward"), fr(f"{site}/_tensor.py", 648, "backward"),
                     fr("/work/train.py", 84, "train_step")],
        "engine": [],  # autograd's CUDA device thread: no Python frames
        "reducescatter": [fr(f"{site}/distributed/distributed_c10d.py", 4407, "reduce_scatter_tensor"),
                          fr(f"{site}/distributed/c10d_logger.py", 81, "wrapper"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 420,
                             "foreach_reduce"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 470, "post_backward"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_state.py", 320, "_post_backward")],
        "adam_state": [fr(f"{site}/optim/adamw.py", 150, "_init_group"), fr(f"{site}/optim/adamw.py", 210, "step"),
                       fr(f"{site}/optim/optimizer.py", 485, "wrapper"), fr("/work/train.py", 86, "train_step")],
        "adam_math": [fr(f"{site}/optim/adam.py", 610, "_multi_tensor_adam"), fr(f"{site}/optim/adam.py", 900, "adam"),
                      fr(f"{site}/optim/adamw.py", 226, "step"), fr(f"{site}/optim/optimizer.py", 485, "wrapper"),
                      fr("/work/train.py", 86, "train_step")],
        "zero_grad": [fr(f"{site}/optim/optimizer.py", 950, "zero_grad"), fr("/work/train.py", 87, "train_step")],
        "params": [fr(f"{site}/nn/modules/linear.py", 118, "reset_parameters"),
                   fr(f"{site}/nn/modules/linear.py", 110, "__init__"), fr("/work/model.py", 20, "__init__"),
                   fr("/work/train.py", 120, "main")],
        "data": [fr("/work/data.py", 33, "__next__"), fr("/work/train.py", 79, "train_step")],
    }
    for k, v in stacks.items():
        if v and k not in ("params", "reducescatter"):  # params: before the loop; reduce-scatter: a hook on
            stacks[k] = v + outer + pad                  # autograd's thread, below no frame of the script
    return stacks


class _TrainingSim:
    """A simulated FSDP training loop on one GPU, emitting trace entries as torch records them.

    Deterministic for a seed. After any whole number of steps (one or more) the live allocations are
    the same: parameters and AdamW state, so the segments a snapshot lists at the end are known after
    one step."""

    K = {k: k for k in ("action", "addr", "size", "stream", "time_us", "frames")}  # torch's shared key strings
    A = {a: a for a in _ACTIONS}

    def __init__(self, seed: int, n_frames: int, layers: int):
        self.rng = random.Random(seed)
        self.stacks = _synthetic_frames(n_frames)
        self.layers = layers
        self.clock = 1_718_000_000_000_000
        self.free_lists: dict[int, list[int]] = {}
        self.top = 0x7F3A_0000_0000
        self.live: dict[int, tuple[int, str]] = {}  # addr -> (size, stack name)
        self.total = self.peak = self.entries = self.allocs = self.steps = 0
        self.out: list[dict] = []
        rng = self.rng
        # before the trace: sharded parameters, and the data batch the first step frees
        self.param_sizes = [[rng.choice((1, 2, 4)) << 20 for _ in range(4)] for _ in range(layers)]
        for layer in self.param_sizes:
            for s in layer:
                self.alloc(s, "params", recorded=False)
        self.stale = [self.alloc(self.randint(1, 8) << 16, "data", recorded=False) for _ in range(2)]
        self.base = self.peak = self.total
        self.opt_state: list[int] = []

    def randint(self, a: int, b: int) -> int:
        return a + int(self.rng.random() * (b - a + 1))  # random.randint is slow Python; this is C

    def entry(self, action: str, addr: int, size: int, where: str) -> None:
        self.clock += self.randint(2, 40)
        K = self.K
        self.out.append({K["action"]: self.A[action], K["addr"]: addr, K["size"]: size, K["stream"]: 0,
                         K["time_us"]: self.clock, K["frames"]: list(self.stacks[where])})
        self.entries += 1

    def alloc(self, size: int, where: str, recorded: bool = True) -> int:
        size = max(512, (size + 511) // 512 * 512)
        fl = self.free_lists.get(size)
        if fl:
            addr = fl.pop()
        else:
            addr, self.top = self.top, self.top + size
        self.live[addr] = (size, where)
        self.total += size
        self.peak = max(self.peak, self.total)
        if recorded:
            self.allocs += 1
            self.entry("alloc", addr, size, where)
        return addr

    def free(self, addr: int, where: str) -> None:
        size, _ = self.live.pop(addr)
        self.free_lists.setdefault(size, []).append(addr)
        self.total -= size
        self.entry("free_requested", addr, size, where)
        self.entry("free_completed", addr, size, where)

    def step(self) -> None:
        alloc, free, sizes = self.alloc, self.free, self.param_sizes
        cache = 0x7E00_0000_0000 + self.steps * (2 << 20)
        self.entry("segment_alloc", cache, 2 << 20, "data")  # a cache segment, returned by empty_cache()
        batch_in = alloc(self.randint(1, 8) << 16, "data")
        for addr in self.stale:
            free(addr, "data")
        self.stale = []
        acts = []
        for layer in range(self.layers):  # forward: all-gather, kept activations, temporaries
            gathered = alloc(sum(sizes[layer]) * 2, "allgather")
            acts.append([alloc(self.randint(4, 64) << 14, ("linear", "attention", "norm")[i]) for i in range(3)])
            for _ in range(2):
                free(alloc(self.randint(1, 32) << 14, "linear"), "linear")
            free(gathered, "linear")
        loss = alloc(4096, "loss")
        seed_grad = alloc(4096, "backward")
        grads = []
        for layer in reversed(range(self.layers)):  # backward, on the engine thread (no Python frames)
            gathered = alloc(sum(sizes[layer]) * 2, "engine")
            for _ in range(2):
                free(alloc(self.randint(1, 32) << 14, "engine"), "engine")
            unsharded = alloc(sum(sizes[layer]) * 2, "engine")
            for addr in acts[layer]:
                free(addr, "engine")
            reduced = alloc(sum(sizes[layer]), "reducescatter")
            free(unsharded, "reducescatter")
            free(reduced, "reducescatter")
            grads.extend(alloc(s, "engine") for s in sizes[layer])
            free(gathered, "engine")
        free(seed_grad, "engine")
        free(loss, "engine")
        if not self.opt_state:  # AdamW's exp_avg and exp_avg_sq, on the first step
            self.opt_state = [alloc(s, "adam_state") for layer in sizes for s in layer for _ in range(2)]
        for _ in range(self.layers):
            free(alloc(self.randint(1, 16) << 16, "adam_math"), "adam_math")
        for addr in grads:  # zero_grad(set_to_none=True)
            free(addr, "zero_grad")
        free(batch_in, "data")
        self.entry("segment_free", cache, 2 << 20, "data")
        self.steps += 1

    def segments(self, device: int) -> list[dict]:
        """The live blocks as torch lists them: one segment each, with the stack that allocated it."""
        out = []
        for addr, (size, where) in sorted(self.live.items()):
            frames = list(self.stacks[where])
            out.append({"device": device, "address": addr, "total_size": size + 512, "allocated_size": size,
                        "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
                        "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
                        "blocks": [{"address": addr, "size": size, "requested_size": size,
                                    "state": "active_allocated", "frames": frames},
                                   {"address": addr + size, "size": 512, "requested_size": 0, "state": "inactive",
                                    "frames": []}]})
        return out


def write_synthetic_snapshot(path: str | os.PathLike, target_bytes: int, seed: int = 0, n_frames: int = 24, *,
                             layers: int = 8, device: int = 0, devices: int = 1,
                             simulate_bytes: int = _SIMULATED_BYTES) -> dict[str, Any]:
    """Write a snapshot of a simulated FSDP training loop in torch's exact format, of about ``target_bytes``.

    Each step runs forward (an all-gather buffer, kept activations and temporaries per layer), backward
    (on autograd's device thread, so without frames: gradients, reduce-scatter buffers, activations
    freed), an AdamW step (state made on the first step, temporaries) and ``zero_grad``. Parameters and
    a data batch exist before the trace starts, so ``base_bytes`` is not zero and some frees have no
    allocation in the trace. Frees are recorded as torch does with ``context="all"``: free_requested,
    then free_completed, with the freeing stack. Whole steps are written until the file reaches
    ``target_bytes``, with bounded memory whatever the size; beyond ``simulate_bytes`` (8 MiB) the last
    simulated step is repeated, later in time, as bytes (a 1 GB file takes seconds). ``device``/``devices``
    place the trace among empty ones, as a process that sees several GPUs writes it.

    Returns the ground truth: ``bytes`` (the file's size), ``entries``, ``allocations``, ``steps``,
    ``peak_bytes`` (the exact peak of live requested bytes, ``base_bytes`` included), ``base_bytes`` and
    ``end_bytes``."""
    if not 0 <= device < devices:
        raise ValueError(f"device={device} is not among devices=0..{devices - 1}")
    probe = _TrainingSim(seed, n_frames, layers)
    probe.step()
    segments = probe.segments(device)
    sim = _TrainingSim(seed, n_frames, layers)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        w = _SpliceWriter(f)
        w.raw(b"}\x94(", memoized=1)  # the top dict: EMPTY_DICT MEMOIZE MARK
        w.head_obj("segments")
        w.head_obj(segments)
        w.head_obj("device_traces")
        w.raw(b"]\x94(", memoized=1)
        for d in range(devices):
            if d != device:
                (w.head_obj if w.head is not None else w.obj)([])
                continue
            sim.step()  # the first batch defines every frame and string: a whole step uses them all
            w.head_obj(sim.out)
            sim.out = []
            w.retire_head()
            per_entry = max(1, f.tell() // max(1, sim.entries))  # bytes an entry takes, from the first batch
            simulated = min(target_bytes, simulate_bytes)
            while f.tell() < simulated:
                sim.step()
                if len(sim.out) >= min(20_000, (simulated - f.tell()) // per_entry):
                    w.items(sim.out)
                    sim.out = []
            w.items(sim.out)
            sim.out = []
            if f.tell() < target_bytes:  # beyond simulate_bytes: one more simulated step, then copies of it
                sim.step()
                step, sim.out = sim.out, []
                w.items(step)
                _repeat_step(w, sim, step, target_bytes)
        w.raw(b"e")
        w.obj("allocator_settings")
        w.obj({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
               "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
               "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {"1": 0, "2": 0}})
        w.obj("external_annotations")
        w.obj([])
        w.raw(b"u.")
    assert sorted(sim.live) == sorted(probe.live), "the simulation's end state must not depend on its length"
    return {"path": str(path), "bytes": path.stat().st_size, "entries": sim.entries, "allocations": sim.allocs,
            "steps": sim.steps, "peak_bytes": sim.peak, "base_bytes": sim.base, "end_bytes": sim.total}
