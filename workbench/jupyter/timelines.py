"""Memory timelines: a snapshot (or profiler trace, or saved timeline) parsed once, answered by window.

Each rank is kept as arrays (time, live bytes, bytes per category, the peak and what is alive at it), so
a zoom is a binary search and a downsampling of the visible events, in milliseconds.

**Large snapshots.** Reading a snapshot is pure Python (the safe reader never unpickles): about 50 MB/s,
so a 1 GB file takes tens of seconds. The read runs in a background thread (:class:`_Job`), started when
the file is opened, and a request that finds it unfinished gets an answer at once: how far it is, and
what the part read so far shows. That partial line is the change in allocated bytes since the trace's
first event (allocations minus completed frees of the entries read), exact for that part; the base
(what was alive before the trace), the categories and the peak come with the full timeline.

**Disk cache.** A parsed snapshot file is saved with :meth:`MemoryTimeline.save` (npz of plain arrays and
JSON: loading it unpickles nothing) under ``$XDG_CACHE_HOME/parallel-workbench/timelines/`` (default
``~/.cache``), keyed by the file's real path, size and modification time, so opening it again takes a
moment. An entry that does not match or does not load is deleted and the file is read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from workbench.jupyter.files import Refused, first_line, inside, json_safe, relative, stamp

__all__ = ["timeline_window", "warm", "cache_dir"]

_KEEP = 4  # finished timelines kept in memory
_PIECE_POINTS = 4000  # points kept of each piece of a snapshot (16 or 64 MiB) while it is read
CACHE_VERSION = 1


class _Rank:
    """One rank's timeline as arrays, computed once: what a window and its downsampling read."""

    def __init__(self, tl: Any, rank: int):
        from workbench.memory.timeline import CATEGORIES

        ev = tl.frame[tl.frame["rank"] == rank]
        self.t = ev["t"].to_numpy(dtype=np.float64)
        self.total = ev["total_bytes"].to_numpy(dtype=np.int64)
        self.cats = tl.category_bytes(rank).to_numpy(dtype=np.int64) if len(ev) else \
            np.zeros((0, len(CATEGORIES)), dtype=np.int64)
        self.phase = ev["phase"].astype(str).to_numpy()
        self.step = ev["step"].to_numpy()
        p = tl.peak(rank)
        alive = tl.alive_at(rank, p.index, top=10) if p.index >= 0 else None
        self.peak = {"bytes": p.bytes, "t": p.t, "step": p.step, "phase": p.phase, "microbatch": p.microbatch,
                     "by_category": p.by_category,
                     "alive": [] if alive is None else alive.to_dict("records")}
        self.spans = tl.phase_spans(rank, max_spans=400).to_dict("records") if len(ev) else []
        self.base = tl.base_bytes.get(rank, 0)


class _Loaded:
    def __init__(self, tl: Any, started: float, cached: bool):
        self.tl = tl
        self.ranks = {r: _Rank(tl, r) for r in tl.ranks}
        # seconds from the start of the read (or cache load) until the answers are ready
        self.parse = {"seconds": round(time.monotonic() - started, 3), "cached": cached}


# --------------------------------------------------------------------------------------------------
# the disk cache
# --------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "parallel-workbench" / "timelines"


def _cache_key(p: Path) -> tuple[Path, dict[str, Any]]:
    real = os.path.realpath(p)
    st = os.stat(real)
    ident = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "version": CACHE_VERSION}
    name = hashlib.sha256(real.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return cache_dir() / f"{name}-{st.st_size}-{st.st_mtime_ns}", ident


def _cache_load(p: Path) -> Any | None:
    """The cached timeline of ``p``, or None (an entry that does not match or load is removed)."""
    from workbench.memory.timeline import MemoryTimeline

    d, ident = _cache_key(p)
    if not d.is_dir():
        return None
    try:
        if json.loads((d / "source.json").read_text()) != ident:
            raise ValueError("stale")
        return MemoryTimeline.load(d)
    except Exception:  # noqa: BLE001 - stale, partial or damaged: read the snapshot again
        shutil.rmtree(d, ignore_errors=True)
        return None


def _cache_store(p: Path, tl: Any) -> None:
    """Save ``tl`` for ``p`` (atomically: a temporary directory renamed), dropping older entries of ``p``."""
    d, ident = _cache_key(p)
    tmp = d.with_name(f".tmp-{d.name}-{os.getpid()}-{threading.get_ident()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tl.save(tmp)
        (tmp / "source.json").write_text(json.dumps(ident))
        for old in d.parent.glob(d.name.split("-")[0] + "-*"):
            if old != d:
                shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, d)
    except OSError:  # a read-only or full cache directory: the next open reads the file again
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# the background parse
# --------------------------------------------------------------------------------------------------

class _Partial:
    """One rank's line while its file is read: time_us and the running change in allocated bytes,
    kept as the envelope of each piece read (exact at every point kept)."""

    def __init__(self) -> None:
        self.t: list[np.ndarray] = []
        self.delta: list[np.ndarray] = []
        self.running = 0
        self.events = 0
        self.devices: int | None = 0  # device traces with rows (a line only for one); None: no line

    def add(self, when: np.ndarray, delta: np.ndarray) -> None:
        if not len(when):
            return
        from workbench.memory.timeline import extreme_indices

        total = self.running + np.cumsum(delta)
        idx = extreme_indices(total, _PIECE_POINTS)
        t, d = when[idx], total[idx]
        self.t.append(t)
        self.delta.append(d)
        self.running = int(total[-1])
        self.events += len(when)


class _Job:
    """One memory file, read in a background thread; what it has read so far is :meth:`progress`."""

    def __init__(self, root: Path, p: Path, kind: str):
        self.root, self.p, self.kind = root, p, kind
        self.files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.suffix in (".pickle", ".pkl"))
        self.total = sum(q.stat().st_size for q in self.files if q.is_file()) if kind == "snapshot" else 0
        self.done_bytes = 0  # of files read completely
        self.reading = 0     # bytes of the file being read
        self.stage = "reading"
        self.started = time.monotonic()
        self.partial: dict[int, _Partial] = {}
        self.loaded: _Loaded | None = None
        self.error: Refused | None = None
        self.finished = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=f"workbench-parse-{p.name}", daemon=True).start()

    def _report(self, rp: Any) -> None:
        """The reader's callback (in this job's thread), after 16 MiB, every 64 MiB and at a file's end. It never
        raises (an exception here would surface as a damaged file): a failure only drops the line."""
        try:
            busy = [tr for tr in rp.new_events() if len(tr[0])]
            part = self.partial.get(rp.rank) or _Partial()
            if part.devices is not None:
                part.devices = max(part.devices, len(busy))
                if part.devices <= 1:
                    for when, delta in busy:
                        part.add(when, delta)
        except Exception:  # noqa: BLE001
            part = _Partial()
            part.devices = None  # no line for this rank
        with self._lock:
            self.partial[rp.rank] = part
            self.reading = rp.bytes_read
            if rp.bytes_read >= rp.bytes_total:
                self.done_bytes += rp.bytes_total
                self.reading = 0
                if self.done_bytes >= self.total:
                    self.stage = "labelling"

    def _run(self) -> None:
        from workbench.memory.snapshot import import_profiler_trace, import_snapshots
        from workbench.memory.timeline import MemoryTimeline

        p, root = self.p, self.root
        try:
            tl, cached = None, False
            if self.kind == "snapshot" and p.is_file():
                tl = _cache_load(p)
                cached = tl is not None
            if tl is None:
                if self.kind == "snapshot":
                    tl = import_snapshots([p] if p.is_file() else p, progress=self._report)
                elif self.kind == "profiler":
                    tl = import_profiler_trace(str(p))
                else:
                    tl = MemoryTimeline.load(p)
            self.stage = "summarizing"
            self.loaded = _Loaded(tl, self.started, cached)
        except (ValueError, KeyError, OSError) as e:
            self.error = Refused(422, json_safe(first_line(e), root))
        except Exception as e:  # noqa: BLE001 - a bug: one line on every request for this file
            self.error = Refused(500, f"internal error reading {relative(root, p)}: {type(e).__name__}: "
                                 f"{first_line(e)}; see the jupyter server log")
        finally:
            self.finished.set()
        if self.loaded is not None and not self.loaded.parse["cached"] and self.kind == "snapshot" and p.is_file():
            _cache_store(p, self.loaded.tl)

    def progress(self, points: int) -> dict[str, Any]:
        from workbench.memory.timeline import extreme_indices

        with self._lock:
            parts = {r: (list(q.t), list(q.delta), q.events, q.devices) for r, q in self.partial.items()
                     if q.devices is not None}
            done = self.done_bytes + self.reading
        firsts = [t[0][0] for t, _, _, _ in parts.values() if t]
        origin = min(firsts) if firsts else 0
        per_rank = []
        for r, (ts, ds, events, devices) in sorted(parts.items()):
            t = np.concatenate(ts) if ts else np.zeros(0, np.int64)
            d = np.concatenate(ds) if ds else np.zeros(0, np.int64)
            idx = extreme_indices(d, points)
            per_rank.append({"rank": r, "events_read": events, "several_devices": devices > 1,
                             "t": ((t[idx] - origin) * 1e-6).tolist(), "delta_bytes": d[idx].tolist(),
                             "max_delta_bytes": int(d.max()) if len(d) else None})
        return {"stage": self.stage, "bytes_read": done, "bytes_total": self.total,
                "fraction": done / self.total if self.total else None,
                "elapsed_s": round(time.monotonic() - self.started, 3), "per_rank": per_rank}


_JOBS: OrderedDict[tuple, _Job] = OrderedDict()
_JOBS_LOCK = threading.Lock()


def _job(root: Path, p: Path) -> _Job:
    from workbench.memory.snapshot import identify_memory_file

    key = (str(p), stamp(p))
    with _JOBS_LOCK:
        job = _JOBS.get(key)
        if job is not None:
            _JOBS.move_to_end(key)
            return job
    kind = identify_memory_file(p)
    rel = relative(root, p)
    if kind is None:
        raise Refused(422, f"{rel}: not a torch memory snapshot, profiler trace or saved timeline (nothing was "
                      "unpickled); open a file written by torch.cuda.memory._dump_snapshot()")
    if p.is_dir():  # every file a directory import reads must lie under the root too
        for d in (p, p / "memory"):
            for f in d.iterdir() if d.is_dir() else ():
                if not inside(root, f):
                    raise Refused(403, f"{relative(root, d)}/{f.name}: points outside the server's root; "
                                  "refusing to read it")
    with _JOBS_LOCK:
        job = _JOBS.get(key)
        if job is None:
            job = _JOBS[key] = _Job(root, p, kind)
            done = [k for k, j in _JOBS.items() if j.finished.is_set() and k != key]
            for k in done[:max(0, len(_JOBS) - _KEEP)]:
                del _JOBS[k]
        return job


def warm(root: Path, p: Path) -> None:
    """Start reading a snapshot as soon as it is opened; errors surface on its first timeline request."""
    try:
        _job(root, p)
    except Refused:
        pass


def timeline_window(root: Path, p: Path, t0: float | None = None, t1: float | None = None, points: int = 2000,
                    ranks: list[int] | None = None, wait: float = 10.0) -> dict[str, Any]:
    """The window's answer (``complete: true``), or, when the file is still being read after ``wait``
    seconds, ``{"path", "complete": false, "progress": {...}}`` with the part read so far."""
    from workbench.memory.timeline import CATEGORIES, extreme_indices

    job = _job(root, p)
    if not job.finished.wait(wait):
        return {"path": relative(root, p), "complete": False, "progress": job.progress(points)}
    if job.error is not None:
        raise job.error
    loaded = job.loaded
    assert loaded is not None
    tl = loaded.tl
    all_t = [r.t for r in loaded.ranks.values() if len(r.t)]
    t_min = float(min(a[0] for a in all_t)) if all_t else 0.0
    t_max = float(max(a[-1] for a in all_t)) if all_t else 0.0
    lo = t_min if t0 is None else t0
    hi = t_max if t1 is None else t1
    if hi < lo:
        raise Refused(400, f"t1={hi} is before t0={lo}; pass t0 <= t1 (seconds, within {t_min:g}..{t_max:g})")
    chosen = tl.ranks if ranks is None else ranks
    missing = [r for r in chosen if r not in loaded.ranks]
    if missing:
        raise Refused(404, f"rank {missing[0]} is not in this timeline; it has ranks {tl.ranks}")
    out_ranks = []
    for r in chosen:
        d = loaded.ranks[r]
        i0 = int(np.searchsorted(d.t, lo, "left"))
        i1 = int(np.searchsorted(d.t, hi, "right"))
        idx = i0 + extreme_indices(d.total[i0:i1], points)  # the core's rule: bin minima and maxima
        if i0 > 0:  # the level the window starts at
            idx = np.r_[i0 - 1, idx]
        used = [j for j, c in enumerate(CATEGORIES) if len(idx) and d.cats[idx, j].any()]
        wp = None
        if i1 > i0:
            k = i0 + int(np.argmax(d.total[i0:i1]))
            wp = {"bytes": int(d.total[k]), "t": float(d.t[k]), "phase": str(d.phase[k]), "step": int(d.step[k])}
        out_ranks.append({
            "rank": r, "base_bytes": d.base, "events": int(len(d.t)), "events_in_window": i1 - i0,
            "t": d.t[idx].tolist(), "total_bytes": d.total[idx].tolist(),
            "categories": {CATEGORIES[j]: d.cats[idx, j].tolist() for j in used},
            "peak": d.peak, "window_peak": wp,
            "phases": [s for s in d.spans if s["t1"] >= lo and s["t0"] <= hi],
        })
    return {"path": relative(root, p), "complete": True, "parse": loaded.parse, "source": tl.source,
            "device": tl.device, "ranks": tl.ranks, "categories": list(CATEGORIES), "t_range": [t_min, t_max],
            "window": [lo, hi], "points": points, "steps": tl.steps, "per_rank": out_ranks}
