"""A snapshot's trace as rows: unique frames and stacks, and each device's rows in typed columns.

What :mod:`workbench.memory.plainpickle` keeps of a trace entry: one row of five integers (action, addr,
size, time_us, stack id), and a stack id into a table of unique stacks (tuples of unique frame ids).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

__all__: list[str] = []

# trace actions, as codes in the compact rows
_ACTIONS = {"alloc": 0, "free_requested": 1, "free_completed": 2, "segment_alloc": 3, "segment_free": 4,
            "segment_map": 5, "segment_unmap": 6, "snapshot": 7, "oom": 8}
_ALLOC, _FREE_REQUESTED, _FREE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _SNAP, _OOM = range(9)
_KEPT = frozenset({_ALLOC, _FREE, _SEG_ALLOC, _SEG_FREE, _SEG_MAP, _SEG_UNMAP, _OOM})


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
        # strings as they are, anything else "?": str() of a hostile value (a list shared 2**60 times
        # over) would cost without bound
        key = (filename if type(filename) is str else "?", line if type(line) is int and 0 <= line < 1 << 31 else 0,
               name if type(name) is str else "?")
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
