"""Shared by every answer: paths under the server's root, caches of parsed files, refusals, JSON.

The views' answers (:mod:`.checkpoints`, :mod:`.timelines`, :mod:`.plans`, :mod:`.runs`, :mod:`.opening`)
take paths already resolved inside the server's root (:func:`resolve`) and return plain JSON-able dicts.
Nothing is computed there that the core does not already know: manifests come from
``workbench.checkpoint.inspect``, statistics from ``tensor_stats``, timelines from the safe snapshot reader,
plans from ``ShardingPlan.from_json``, runs from the ``events.jsonl`` reader. They only cut the answers to
what a view draws (a page of keys, a window of a timeline, the events not yet seen), so a file is never
sent whole, and they keep what was parsed (:class:`FileCache`, per path, modification time and size) so
zooming and paging do not parse again.

A problem is a :class:`Refused`: one line naming the problem and the fix, with the HTTP status to send.
"""

from __future__ import annotations

import math
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

__all__ = ["Refused", "resolve", "not_found", "refusal", "relative", "inside", "stamp", "FileCache", "json_safe", "read_json", "first_line",
           "parse_int", "parse_float", "parse_bool", "parse_scalar"]

MAX_LIMIT = 2000  # rows of one page
MAX_POINTS = 20_000  # points of one timeline answer, per rank
MAX_BINS = 1000
MAX_JSON_BYTES = 256 << 20  # a plan JSON larger than this is not one workbench wrote


class Refused(Exception):
    """An answer the server will not give: ``status`` (4xx) and one line naming the problem and the fix."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(" ".join(str(message).split()))  # always one line


# --------------------------------------------------------------------------------------------------
# paths
# --------------------------------------------------------------------------------------------------

def resolve(root: Path, rel: str | None, what: str = "path", allow_hidden: bool = True) -> Path:
    """``rel`` (relative to the server's root) as an absolute path inside ``root``, or :class:`Refused`.

    Symlinks are followed before the check, so a link that points outside the root is refused like
    ``../``, and with the same answer as a path that does not exist (:func:`not_found`): the reply never
    tells what exists outside the root. A leading ``/`` means the root, as in the contents API. Hidden
    components are refused in the path as given and in the path it resolves to (a visible link to a
    hidden file is hidden). Only directories and regular files are served: a FIFO or a device is refused
    before anything opens it."""
    if rel is None or not str(rel).strip():
        raise Refused(400, f"missing ?{what}=; pass a path relative to the server's root directory")
    rel = str(rel).strip()
    if "\x00" in rel:
        raise Refused(400, f"{what} contains a NUL byte; pass a plain relative path")
    p = Path(rel.lstrip("/"))  # as the contents API reads it: "/a/b" is "a/b" under the root
    root = root.resolve()
    full = (root / p).resolve()
    if not full.is_relative_to(root):
        raise not_found(rel)
    if not allow_hidden and (_hidden(p.parts) or _hidden(full.relative_to(root).parts)):
        raise Refused(403, f"{rel}: hidden files are not served (ContentsManager.allow_hidden is False); "
                      "open the directory that holds it, or start the server with allow_hidden")
    try:
        mode = full.stat().st_mode
    except OSError:
        raise not_found(rel) from None
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise Refused(422, f"{rel}: not a regular file or directory (a FIFO, socket or device); nothing is read "
                      "from it; open a file or a directory")
    return full


def _hidden(parts) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in parts)


def not_found(rel: str) -> Refused:
    """The one answer for a path that does not exist and for one that leads outside the root (by ``..``, an
    absolute name or a link): the client learns nothing about what exists outside."""
    return Refused(404, f"{rel}: no such file or directory under the server's root; check the path")


def refusal(e: Exception, root: Path) -> Refused:
    """A file refused by :mod:`workbench.safeio` or a checkpoint reader, as the answer to send: 404 for a file
    missing or outside (its directory or the root), 422 for anything else, in the reader's words with paths
    under the root made relative. The words depend only on the name and on what lies inside the root: a
    name is refused by its text and a link by where it points, before anything outside is looked at."""
    return Refused(404 if getattr(e, "reason", "format") in ("missing", "outside") else 422, json_safe(str(e), root))


def relative(root: Path, p: Path | str) -> str:
    p = Path(p)
    try:
        return str(p.resolve().relative_to(root.resolve())) or "."
    except ValueError:
        return str(p)


def inside(root: Path, p: Path) -> bool:
    return p.resolve().is_relative_to(root.resolve())


def stamp(p: Path) -> tuple:
    """What changes when the file (or a direct child of the directory) changes."""
    st = p.stat()
    if not p.is_dir():
        return (st.st_mtime_ns, st.st_size)
    kids = []
    for c in sorted(p.iterdir()):
        try:
            s = c.stat()
            kids.append((c.name, s.st_mtime_ns, s.st_size))
        except OSError:
            continue
    return (st.st_mtime_ns, hash(tuple(kids)))


class FileCache:
    """A small LRU of parsed files keyed by (path, stamp); one lock per key so a file parses once."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[tuple, threading.Lock] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            lock = self._key_locks.setdefault(key, threading.Lock())
        with lock:
            with self._lock:
                if key in self._items:
                    return self._items[key]
            value = make()
            with self._lock:
                self._items[key] = value
                while len(self._items) > self.size:
                    old, _ = self._items.popitem(last=False)
                    self._key_locks.pop(old, None)
                self._key_locks.pop(key, None)
            return value




def json_safe(obj: Any, root: Path | None = None) -> Any:
    """Plain JSON (no NaN, no numpy scalars), with absolute paths under ``root`` made relative."""
    import numpy as np  # here, not at the top: the server extension loads this module before any request

    prefix = None if root is None else str(root.resolve()) + os.sep
    def walk(o: Any) -> Any:
        if isinstance(o, dict):
            return {str(k): walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v) for v in o]
        if isinstance(o, (bool, np.bool_)):
            return bool(o)
        if isinstance(o, (int, np.integer)):
            return int(o)
        if isinstance(o, (float, np.floating)):
            f = float(o)
            return f if math.isfinite(f) else None
        if isinstance(o, str):
            return o.replace(prefix, "") if prefix and prefix in o else o
        if isinstance(o, Path):
            return walk(str(o))
        if o is None:
            return None
        if isinstance(o, np.ndarray):
            return walk(o.tolist())
        return walk(str(o))
    return walk(obj)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def read_json(p: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """``p`` parsed as JSON: a regular file (never a FIFO or device) of at most ``limit`` bytes, inside the
    root of the answer being given (workbench.safeio); each problem one :class:`Refused` naming the file."""
    from workbench.safeio import FileRefused, read_json as read_bounded_json

    try:
        return read_bounded_json(p, limit, "workbench JSON file", fix="the file is damaged or not JSON; open a plan "
                                 "written by `workbench plan --json` or ShardingPlan.to_json()")
    except FileRefused as e:
        status = 404 if e.reason in ("missing", "outside") else 422
        raise Refused(status, f"{p.name}: {e.problem}; {e.fix}") from None


def parse_int(v: str, name: str, lo: int | None = None, hi: int | None = None) -> int:
    try:
        x = int(v)
    except (TypeError, ValueError):
        raise Refused(400, f"{name}={v!r} is not an integer; pass e.g. {name}=2") from None
    if lo is not None and x < lo or hi is not None and x > hi:
        bounds = f"{lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise Refused(400, f"{name}={x} is out of range; pass {name} {bounds}")
    return x


def parse_float(v: str, name: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise Refused(400, f"{name}={v!r} is not a number; pass seconds like {name}=1.5") from None
    if not math.isfinite(x):
        raise Refused(400, f"{name}={v!r} is not finite; pass a finite number")
    return x


def parse_bool(v: str, name: str) -> bool:
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise Refused(400, f"{name}={v!r} is not a boolean; pass {name}=true or {name}=false")


def parse_scalar(v: str) -> Any:
    s = v.strip()
    if re.fullmatch(r"-?\d+", s):
        return int(s)
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    return s
