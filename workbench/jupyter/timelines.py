"""Memory timelines: a snapshot (or profiler trace, or saved timeline) parsed once, answered by window.

Each rank is kept as arrays (time, live bytes, bytes per category, the peak and what is alive at it), so
a zoom is a binary search and a downsampling of the visible events, in milliseconds.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from workbench.jupyter.files import FileCache, Refused, first_line, inside, json_safe, relative, stamp

__all__ = ["timeline_window", "warm"]

_TIMELINES = FileCache(4)


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
    def __init__(self, tl: Any):
        self.tl = tl
        self.ranks = {r: _Rank(tl, r) for r in tl.ranks}


def _load_timeline(root: Path, p: Path) -> _Loaded:
    from workbench.memory.snapshot import identify_memory_file, import_profiler_trace, import_snapshots
    from workbench.memory.timeline import MemoryTimeline

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

    def make() -> _Loaded:
        try:
            if kind == "snapshot":
                tl = import_snapshots([p] if p.is_file() else p, progress=False)
            elif kind == "profiler":
                tl = import_profiler_trace(str(p))
            else:
                tl = MemoryTimeline.load(p)
        except (ValueError, KeyError, OSError) as e:
            raise Refused(422, json_safe(first_line(e), root)) from None
        return _Loaded(tl)

    return _TIMELINES.get((str(p), stamp(p)), make)


def warm(root: Path, p: Path) -> None:
    """Start parsing a snapshot as soon as it is opened, so the view's first timeline request finds it
    parsed or half-way (a 200 MB snapshot takes seconds). Errors surface on that request."""
    def work() -> None:
        try:
            _load_timeline(root, p)
        except Exception:  # noqa: BLE001 - reported by memory/timeline, which parses again
            pass

    threading.Thread(target=work, name=f"workbench-parse-{p.name}", daemon=True).start()


def timeline_window(root: Path, p: Path, t0: float | None = None, t1: float | None = None, points: int = 2000,
                    ranks: list[int] | None = None) -> dict[str, Any]:
    from workbench.memory.timeline import CATEGORIES, extreme_indices

    loaded = _load_timeline(root, p)
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
    return {"path": relative(root, p), "source": tl.source, "device": tl.device, "ranks": tl.ranks,
            "categories": list(CATEGORIES), "t_range": [t_min, t_max], "window": [lo, hi], "points": points,
            "steps": tl.steps, "per_rank": out_ranks}
