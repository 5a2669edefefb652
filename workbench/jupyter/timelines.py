"""Memory timelines: a snapshot (or profiler trace, or saved timeline) parsed once, answered by window.

Each rank is kept as arrays (time, live bytes, bytes per category, the peak and what is alive at it), so
a zoom is a binary search and a downsampling of the visible events, in milliseconds.

**One memory view.** The JupyterLab tab draws what ``MemoryTimelineView`` draws of the same timeline, and
every number of it comes from here, computed by the timeline's own methods: the stacked categories and the
total (the rows ``MemoryTimeline.downsample`` keeps: :func:`extreme_indices` of the totals, of one step
with ``step``), the phase bands (``phase_spans`` with the view's ``max_bands``), the peak marker and its
annotation (``peak``, or a step's own), what is alive at the peak (``alive_at``, ``modules_at_peak``), a
prediction's total dashed over it (``matching_rank``/``matching_step``, aligned by phase on the step
clock: ``workbench.memory.clock.phase_clock``), the colours (``workbench.palette``) and 1-2-5 axes
(``workbench.ticks``). tests/views/test_memory_tab_payload.py holds the two side by side.

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

from workbench import palette
from workbench.jupyter.files import Refused, first_line, inside, json_safe, relative, stamp

__all__ = ["timeline_window", "warm", "cache_dir"]

_KEEP = 4  # finished timelines kept in memory
MAX_BANDS, TABLE_ROWS = palette.MAX_BANDS, palette.TABLE_ROWS  # what the notebook view shows too
_PIECE_POINTS = 4000  # points kept of each piece of a snapshot (16 or 64 MiB) while it is read
CACHE_VERSION = 1


class _Rank:
    """One rank's timeline as arrays, computed once: what a window and its downsampling read. The rank's
    answers come from the timeline's own methods (``category_bytes``, ``peak``, ``alive_at``,
    ``modules_at_peak``, ``phase_spans``, ``step_progress``), the ones the notebook view calls."""

    def __init__(self, tl: Any, rank: int):
        from workbench.memory.timeline import CATEGORIES

        self.tl, self.rank = tl, rank
        ev = tl.frame[tl.frame["rank"] == rank]
        self.t = ev["t"].to_numpy(dtype=np.float64)
        self.total = ev["total_bytes"].to_numpy(dtype=np.int64)
        self.cats = tl.category_bytes(rank).to_numpy(dtype=np.int64) if len(ev) else \
            np.zeros((0, len(CATEGORIES)), dtype=np.int64)
        self.phase = ev["phase"].astype(str).to_numpy()
        self.step = ev["step"].to_numpy()
        self.mb = ev["microbatch"].to_numpy()
        p = tl.peak(rank)
        self.peak_index = p.index  # -1: nothing rose above the base
        alive = tl.alive_at(rank, p.index, top=TABLE_ROWS) if p.index >= 0 else None
        modules = tl.modules_at_peak(rank).head(TABLE_ROWS) if p.index >= 0 else None
        self.peak = {"bytes": p.bytes, "t": p.t, "step": p.step, "phase": p.phase, "microbatch": p.microbatch,
                     "by_category": p.by_category,
                     "alive": [] if alive is None else alive.to_dict("records"),
                     "modules": [] if modules is None else modules.to_dict("records")}
        # the whole view's bands: the notebook view's (phase_spans with its max_bands)
        self.spans = tl.phase_spans(rank, max_spans=MAX_BANDS).to_dict("records") if len(ev) else []
        self.base = tl.base_bytes.get(rank, 0)
        self._lock = threading.Lock()
        self._step_spans: dict[int, list[dict]] = {}
        self._runs: Any = None
        self._clock: np.ndarray | None = None

    def step_spans(self, step: int) -> list[dict]:
        """The bands of one step, as the notebook view draws them zoomed to it."""
        with self._lock:
            if step not in self._step_spans:
                self._step_spans[step] = self.tl.phase_spans(self.rank, step=step,
                                                             max_spans=MAX_BANDS).to_dict("records")
            return self._step_spans[step]

    def runs(self) -> Any:
        """Every run of one (phase, step, microbatch), a frame: what a zoomed window shows when few fall in it."""
        with self._lock:
            if self._runs is None:
                self._runs = self.tl.phase_spans(self.rank)
            return self._runs

    def clock(self) -> np.ndarray:
        """Every event on the step clock (``MemoryTimeline.step_progress``), computed once."""
        with self._lock:
            if self._clock is None:
                self._clock = self.tl.step_progress(self.rank, self.t)
            return self._clock


class _Loaded:
    def __init__(self, tl: Any, started: float, cached: bool):
        self.tl = tl
        self.ranks = {r: _Rank(tl, r) for r in tl.ranks}
        # seconds from the start of the read (or cache load) until the answers are ready
        self.parse = {"seconds": round(time.monotonic() - started, 3), "cached": cached}
        self._clocks: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def phase_clock(self, over: "_Loaded", rank: int, rep: int, ostep: int | None, step: int | None) -> Any:
        """``over``'s rank ``rep`` on this timeline's rank ``rank`` step clock, aligned by phase, as the
        notebook view aligns it (its steady-state step ``ostep`` drawn over the shown ``step`` it lacks).
        A few are kept: each costs a pass over both ranks' spans."""
        from workbench.memory.clock import phase_clock

        step_map = {ostep: step} if ostep is not None and ostep != step else None
        key = (id(over), rank, rep, ostep if step_map else None)
        with self._lock:
            hit = self._clocks.get(key)
            if hit is not None and hit[0] is over:
                return hit[1]
        clock = phase_clock(self.tl, rank, over.tl, rep, step_map=step_map)
        with self._lock:
            self._clocks[key] = (over, clock)
            while len(self._clocks) > 16:
                self._clocks.popitem(last=False)
        return clock


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
                "elapsed_s": round(time.monotonic() - self.started, 3), "per_rank": per_rank,
                "palette": palette.palette()}


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


def _overlay_job(root: Path, p: Path, wait: float) -> _Job:
    """The overlay's read (waited for up to ``wait`` s); a file that is none says it is the overlay."""
    try:
        job = _job(root, p)
    except Refused as e:
        raise Refused(e.status, f"overlay {e}") from None
    job.finished.wait(wait)
    return job


def _bands(spans: list[dict], d: _Rank, clock: str) -> list[dict]:
    """Phase spans as the view draws them: x on the plot's clock, the phase's colour, and the opacity of
    its microbatch (even or odd), the notebook view's rule."""
    if not spans:
        return []
    t0 = np.array([s["t0"] for s in spans], dtype=np.float64)
    t1 = np.array([s["t1"] for s in spans], dtype=np.float64)
    if clock == "step":  # step_progress is linear between events, so interpolating its values is exact
        t0, t1 = np.interp(t0, d.t, d.clock()), np.interp(t1, d.t, d.clock())
    out = []
    for s, a, b in zip(spans, t0.tolist(), t1.tolist()):
        mb = int(s["microbatch"])
        out.append({"phase": str(s["phase"]), "step": int(s["step"]), "microbatch": mb, "t0": float(s["t0"]),
                    "t1": float(s["t1"]), "x0": a, "x1": b, "color": palette.PHASE_COLORS[str(s["phase"])],
                    "opacity": palette.band_opacity(mb)})
    return out


def _window_bands(d: _Rank, step: int | None, whole: bool, t_lo: float, t_hi: float) -> list[dict]:
    """The bands of the view: the notebook view's for the whole timeline or a whole step; in a zoomed
    window every run of a phase in it, or the joined ones where more than MAX_BANDS fall in it."""
    joined = d.spans if step is None else d.step_spans(step)
    if whole:
        return joined
    f = d.runs()
    keep = (f["t1"].to_numpy() >= t_lo) & (f["t0"].to_numpy() <= t_hi)
    if step is not None:
        keep &= f["step"].to_numpy() == step
    if keep.sum() <= MAX_BANDS:
        return f[keep].to_dict("records")
    return [s for s in joined if s["t1"] >= t_lo and s["t0"] <= t_hi]


def _marker(kind: str, nbytes: int, t: float, x: float, phase: str, step: int, mb: int) -> dict[str, Any]:
    """The peak the view marks, with the notebook view's annotation (bytes; phase, step, microbatch)."""
    from workbench.units import format_bytes

    where = palette.peak_where(phase, step, mb)
    name = "window peak" if kind == "window" else "peak"
    return {"kind": kind, "bytes": int(nbytes), "t": float(t), "x": float(x), "phase": str(phase), "step": int(step),
            "microbatch": int(mb), "label": [f"{name} {format_bytes(int(nbytes))}", where]}


def _event_marker(d: _Rank, kind: str, k: int, x: np.ndarray, mb: int | None = None) -> dict[str, Any]:
    return _marker(kind, int(d.total[k]), float(d.t[k]), float(x[k]), str(d.phase[k]), int(d.step[k]),
                   int(d.mb[k]) if mb is None else mb)


def _overlay_line(loaded: _Loaded, over: _Loaded, rank: int, step: int | None, clock: str,
                  points: int) -> dict[str, Any] | None:
    """The overlay's rank standing for ``rank`` at the shown step, drawn as the notebook view draws it:
    ``downsample(rep, points, step=)``'s totals; when the two sources differ, on the timeline's step clock
    aligned phase by phase (``workbench.memory.clock.phase_clock``), its steady-state step aligned with a
    shown step it lacks."""
    from workbench.memory.comparison import matching_rank, matching_step
    from workbench.memory.timeline import extreme_indices

    try:
        rep = matching_rank(over.tl, rank)
    except ValueError as e:
        raise Refused(422, f"overlay: {first_line(e)}") from None
    if rep is None or rep not in over.ranks:
        return None
    ostep = None
    if step is not None:
        ostep = matching_step(over.tl, step) if clock == "step" else (step if step in over.tl.steps else None)
        if ostep is None:
            return None
    od = over.ranks[rep]
    if ostep is None:
        idx = extreme_indices(od.total, points)
    else:
        sel = np.flatnonzero(od.step == ostep)
        idx = sel[extreme_indices(od.total[sel], points)]
    if clock == "step":
        x = loaded.phase_clock(over, rank, rep, ostep, step)(od.t[idx])
    else:
        x = od.t[idx]
    return {"rank": rep, "source": over.tl.source, "step": ostep, "x": x.tolist(),
            "total_bytes": od.total[idx].tolist()}


def timeline_window(root: Path, p: Path, t0: float | None = None, t1: float | None = None, points: int = 2000,
                    ranks: list[int] | str | None = None, wait: float = 10.0, step: int | None = None,
                    overlay: Path | None = None) -> dict[str, Any]:
    """The window's answer (``complete: true``), or, when the file is still being read after ``wait``
    seconds, ``{"path", "complete": false, "progress": {...}}`` with the part read so far.

    ``ranks``: a list, None (all) or ``"peak"`` (the rank with the largest peak: the one the notebook
    view shows first). ``step``: only that step's events, each still counting what was alive before it
    (``MemoryTimeline.downsample(step=)``). ``overlay``: another memory file (a saved prediction) whose
    matching rank's total is drawn dashed; when its source differs, x is the step clock
    (``step_progress``) and ``t0``/``t1`` are on that clock. The whole view of a rank (no ``t0``/``t1``)
    carries the same points, bands and peak as ``MemoryTimelineView`` with the same ``max_points``."""
    from workbench.memory.timeline import CATEGORIES, extreme_indices
    from workbench.ticks import byte_axis, number_axis

    job = _job(root, p)
    if not job.finished.wait(wait):
        return {"path": relative(root, p), "complete": False, "progress": job.progress(points)}
    if job.error is not None:
        raise job.error
    loaded = job.loaded
    assert loaded is not None
    tl = loaded.tl
    over, over_info = None, None
    if overlay is not None:
        ojob = _overlay_job(root, overlay, wait)
        over_info = {"path": relative(root, overlay), "complete": ojob.finished.is_set()}
        if ojob.error is not None:
            raise Refused(ojob.error.status, f"overlay {ojob.error}")
        if ojob.loaded is not None:
            over = ojob.loaded
            over_info.update(source=over.tl.source, device=over.tl.device, ranks=over.tl.ranks)
    clock = "step" if over is not None and over.tl.source != tl.source else "time"
    all_t = [r.t for r in loaded.ranks.values() if len(r.t)]
    t_min = float(min(a[0] for a in all_t)) if all_t else 0.0
    t_max = float(max(a[-1] for a in all_t)) if all_t else 0.0
    if step is not None and step not in tl.steps:
        raise Refused(404, f"step {step} is not in this timeline; it has steps {tl.steps}")
    if ranks == "peak":
        chosen = [max(tl.ranks, key=lambda r: loaded.ranks[r].peak["bytes"])] if tl.ranks else []
    else:
        chosen = tl.ranks if ranks is None else list(ranks)
    missing = [r for r in chosen if r not in loaded.ranks]
    if missing:
        raise Refused(404, f"rank {missing[0]} is not in this timeline; it has ranks {tl.ranks}")

    def xs(d: _Rank) -> np.ndarray:
        return d.clock() if clock == "step" else d.t

    # the whole extent on the x axis: the trace's time, or the chosen ranks' step clock or step
    if clock == "time" and step is None:
        x_min, x_max = t_min, t_max
    else:
        ext = []
        for r in chosen:
            d = loaded.ranks[r]
            x = xs(d) if step is None else xs(d)[d.step == step]
            if len(x):
                ext += [float(x[0]), float(x[-1])]
        x_min, x_max = (min(ext), max(ext)) if ext else (0.0, 0.0)
    lo = x_min if t0 is None else t0
    hi = x_max if t1 is None else t1
    if hi < lo:
        raise Refused(400, f"t1={hi} is before t0={lo}; pass t0 <= t1 (within {x_min:g}..{x_max:g} on the "
                      f"{'step clock' if clock == 'step' else 'time axis, seconds'})")
    whole = t0 is None and t1 is None
    out_ranks = []
    for r in chosen:
        d = loaded.ranks[r]
        x_all = xs(d)
        sel = None if step is None else np.flatnonzero(d.step == step)
        xv = x_all if sel is None else x_all[sel]
        a = int(np.searchsorted(xv, lo, "left"))
        b = int(np.searchsorted(xv, hi, "right"))
        if sel is None:
            idx = a + extreme_indices(d.total[a:b], points)  # the core's rule (downsample): bin minima and maxima
            if a > 0:  # the level the window starts at
                idx = np.r_[a - 1, idx]
            inside = np.arange(a, b)
        else:
            idx = sel[a + extreme_indices(d.total[sel[a:b]], points)]
            if a > 0:
                idx = np.r_[sel[a - 1], idx]
            inside = sel[a:b]
        used = [j for j, c in enumerate(CATEGORIES) if len(idx) and d.cats[idx, j].any()]
        wp, marker = None, None
        if len(inside):
            k = int(inside[int(np.argmax(d.total[inside]))])
            wp = {"bytes": int(d.total[k]), "t": float(d.t[k]), "phase": str(d.phase[k]), "step": int(d.step[k])}
            if step is not None:  # the step's own peak (microbatch -1), as the notebook marks it zoomed to a step
                marker = _event_marker(d, "step" if whole else "window", k, x_all, -1 if whole else None)
        if step is None and len(d.t):  # the rank's peak (at its first event when nothing rose above the base)
            pk = d.peak
            px = float(x_all[max(d.peak_index, 0)])
            if lo <= px <= hi:
                marker = _marker("peak", pk["bytes"], pk["t"], px, pk["phase"], pk["step"], pk["microbatch"])
            elif wp is not None:  # zoomed away from it: the window's own
                marker = _event_marker(d, "window", k, x_all)
        line = _overlay_line(loaded, over, r, step, clock, points) if over is not None else None
        top = max([int(d.total[idx].max()) if len(idx) else 0] + [max(line["total_bytes"], default=0) if line else 0])
        t_lo = float(d.t[inside[0]]) if len(inside) else lo
        t_hi = float(d.t[inside[-1]]) if len(inside) else hi
        title = (f"Rank {r}" + ("" if step is None else f", step {step}") + f": memory by category "
                 f"({tl.source}, {tl.device})" + (f" vs dashed {over.tl.source}" if line else ""))
        out_ranks.append({
            "rank": r, "base_bytes": d.base, "events": int(len(d.t)), "events_in_window": int(len(inside)),
            "t": d.t[idx].tolist(), "x": x_all[idx].tolist(), "total_bytes": d.total[idx].tolist(),
            "stack": [CATEGORIES[j] for j in used],
            "categories": {CATEGORIES[j]: d.cats[idx, j].tolist() for j in used},
            "peak": d.peak, "window_peak": wp, "marker": marker, "title": title,
            "phases": _bands(_window_bands(d, step, whole, t_lo, t_hi), d, clock),
            "overlay": line, "y_axis": byte_axis(top),
        })
    x_axis = number_axis(lo, hi, target=8)  # a wide axis: about 8 ticks
    x_axis["title"] = palette.memory_x_title(tl.source, clock, over is not None)
    peaks = [{"rank": r, "bytes": d.peak["bytes"], "t": d.peak["t"], "step": d.peak["step"],
              "phase": d.peak["phase"]} for r, d in loaded.ranks.items()]
    return {"path": relative(root, p), "complete": True, "parse": loaded.parse, "source": tl.source,
            "device": tl.device, "ranks": tl.ranks, "categories": list(CATEGORIES), "t_range": [t_min, t_max],
            "x": clock, "x_range": [x_min, x_max], "x_axis": x_axis, "window": [lo, hi], "points": points,
            "step": step, "steps": tl.steps, "peaks": peaks, "palette": palette.palette(), "overlay": over_info,
            "per_rank": out_ranks}
