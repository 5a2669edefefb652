"""The one memory-timeline schema: measured (CUDA or CPU), predicted and imported timelines alike.

A timeline is a table of allocation events, one row per allocation (``delta_bytes > 0``) or free
(``delta_bytes < 0``) on one rank::

    rank  t        delta_bytes  total_bytes  category    phase     step  microbatch  module          op                 id
    0     0.0113   4096         1.2e6        activation  forward   0     0           layers.0.attn   aten::mm           17
    0     0.0120   -4096        1.19e6       activation  backward  0     0           layers.0.attn   (free)             17

- ``t`` is seconds since the recording started (measured) or the event's sequence position in the
  simulated step, in the same units (predicted): both increase through the step.
- ``total_bytes`` is the running sum of ``delta_bytes`` on that rank, starting from the bytes already
  live when recording began (``base_bytes``), so ``total_bytes.max()`` is the rank's peak.
- ``category`` is one of :data:`CATEGORIES`; ``phase`` one of :data:`PHASES`. ``step`` and
  ``microbatch`` are -1 where they do not apply. ``module`` is the qualified name of the innermost
  module running when the storage was made ("" outside any), ``op`` the operator that made it.
- ``id`` pairs a free with its allocation (a storage or an allocator block): the bytes alive at any
  event are the ids whose deltas up to it sum to more than zero. That answers "what is alive at the peak".

Bytes per category at any event come from one cumulative sum per category; a plot of 10^6 events is
first reduced by :meth:`MemoryTimeline.downsample`, which keeps the largest total of every bin, so the
peak is never smoothed away.
"""

from __future__ import annotations

import json
import os
import tokenize
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from workbench.display import RendersInNotebook
from workbench.units import format_bytes

__all__ = ["CATEGORIES", "PHASES", "COLUMNS", "MemoryTimeline", "TimelineBuilder", "Peak"]

CATEGORIES = ("parameter", "gradient", "optimizer", "activation", "temporary", "communication",
              "checkpoint", "other")
PHASES = ("build", "forward", "backward", "optimizer", "checkpoint", "other")
COLUMNS = ("rank", "t", "delta_bytes", "total_bytes", "category", "phase", "step", "microbatch",
           "module", "op", "id")
_STRINGS = ("category", "phase", "module", "op")
_INTS = {"rank": np.int32, "delta_bytes": np.int64, "total_bytes": np.int64, "step": np.int32,
         "microbatch": np.int32, "id": np.int64}
FORMAT_VERSION = 1


def empty_frame() -> pd.DataFrame:
    return _typed(pd.DataFrame({c: [] for c in COLUMNS}))


def _typed(df: pd.DataFrame) -> pd.DataFrame:
    """The schema's dtypes: integers, float seconds, and categoricals for the repeated strings."""
    df = df.copy()
    for c, dt in _INTS.items():
        df[c] = df[c].astype(dt)
    df["t"] = df["t"].astype(np.float64)
    for c, fixed in (("category", CATEGORIES), ("phase", PHASES)):
        col = df[c]
        if isinstance(col.dtype, pd.CategoricalDtype):  # recode by value: no string pass over the rows
            if tuple(col.cat.categories) != fixed:
                col = col.cat.rename_categories([str(x) for x in col.cat.categories])
                df[c] = pd.Categorical(col, categories=fixed)
        else:
            df[c] = pd.Categorical(col.astype(str), categories=fixed)
    for c in ("module", "op"):
        if not isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].astype(str).astype("category")
    return df[list(COLUMNS)].reset_index(drop=True)


def check_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Validate a frame against the schema; one ValueError naming what is wrong."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"memory timeline lacks columns {missing}; it needs {list(COLUMNS)}")
    for col, allowed, what in (("category", CATEGORIES, "categories"), ("phase", PHASES, "phases")):
        bad = _distinct(df[col]) - set(allowed)
        if bad:
            raise ValueError(f"unknown memory {what} {sorted(bad)}; use one of {list(allowed)}")
    return _typed(df)


def _distinct(col: pd.Series) -> set[str]:
    """The distinct values of a column, cheaply when it is already categorical (millions of rows)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        used = np.unique(col.cat.codes.to_numpy())
        cats = col.cat.categories
        return {str(cats[c]) for c in used if c >= 0}
    return {str(v) for v in pd.unique(col)}


@dataclass(frozen=True)
class Peak:
    """A rank's largest ``total_bytes``: when, in which phase, and what it was made of."""

    rank: int
    bytes: int
    t: float
    index: int  # row position within the rank's events
    step: int
    phase: str
    microbatch: int
    by_category: dict[str, int] = field(default_factory=dict)


class TimelineBuilder:
    """Collects events cheaply (python lists) while a recorder runs; :meth:`timeline` makes the frame."""

    def __init__(self, rank: int = 0, base_bytes: int = 0):
        self.rank = rank
        self.base_bytes = int(base_bytes)
        self.rows: list[tuple] = []

    def add(self, t: float, delta: int, category: str, phase: str, step: int, microbatch: int,
            module: str, op: str, ident: int) -> None:
        self.rows.append((t, delta, category, phase, step, microbatch, module, op, ident))

    def insert_before_first(self, phase: str, delta: int, category: str, op: str, ident: int) -> bool:
        """A block that something outside the tracked tensor ops allocates, put just before the first event
        of ``phase`` (with that event's time, step and module). False when no event has that phase."""
        for i, row in enumerate(self.rows):
            if row[3] == phase:
                self.rows.insert(i, (row[0], int(delta), category, phase, row[4], row[5], row[6], op, ident))
                return True
        return False

    def frame(self, categories: dict[int, str] | None = None) -> pd.DataFrame:
        """The events as a frame. ``categories`` (id -> category) overrides what was known at allocation:
        a storage's identity (it became a gradient, optimizer state...) is often learnt later."""
        if not self.rows:
            return empty_frame()
        cols = list(zip(*self.rows))
        ids = np.asarray(cols[8], dtype=np.int64)
        category = list(cols[2])
        if categories:
            category = [categories.get(int(i), c) for i, c in zip(ids, category)]
        delta = np.asarray(cols[1], dtype=np.int64)
        df = pd.DataFrame({
            "rank": np.full(len(ids), self.rank, dtype=np.int32),
            "t": np.asarray(cols[0], dtype=np.float64),
            "delta_bytes": delta,
            "total_bytes": self.base_bytes + np.cumsum(delta),
            "category": category, "phase": list(cols[3]),
            "step": np.asarray(cols[4], dtype=np.int32), "microbatch": np.asarray(cols[5], dtype=np.int32),
            "module": list(cols[6]), "op": list(cols[7]), "id": ids})
        return _typed(df)

    def timeline(self, categories: dict[int, str] | None = None, **kw) -> "MemoryTimeline":
        return MemoryTimeline(self.frame(categories), base_bytes={self.rank: self.base_bytes}, **kw)


class MemoryTimeline(RendersInNotebook):
    """Memory events of one or more ranks in the schema above, with the questions people ask of them.

    ``source`` says where it came from (``measured``, ``predicted``, ``snapshot``, ``profiler``) and
    ``device`` what it measures or targets (``cpu`` or ``cuda``). ``base_bytes`` maps each rank to the bytes
    already live when its events start; ``meta`` holds the rest (layout, model, overhead...).
    """

    def __init__(self, frame: pd.DataFrame, *, source: str = "measured", device: str = "cpu",
                 base_bytes: dict[int, int] | None = None, meta: dict[str, Any] | None = None):
        self.frame = check_frame(frame)
        self.source = source
        self.device = device
        self.base_bytes = {int(k): int(v) for k, v in (base_bytes or {}).items()}
        self.meta = dict(meta or {})

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def concat(cls, timelines: Sequence["MemoryTimeline"], **kw) -> "MemoryTimeline":
        if not timelines:
            raise ValueError("no timelines to join")
        first = timelines[0]
        base: dict[int, int] = {}
        meta: dict[str, Any] = {}
        for tl in timelines:
            base.update(tl.base_bytes)
            meta.update(tl.meta)
        frame = pd.concat([tl.frame.astype({"module": str, "op": str}) for tl in timelines], ignore_index=True)
        frame = frame.sort_values(["rank", "t"], kind="stable")
        return cls(frame, source=kw.get("source", first.source), device=kw.get("device", first.device),
                   base_bytes=base, meta=meta)

    def _new(self, frame: pd.DataFrame) -> "MemoryTimeline":
        ranks = set(frame["rank"].unique().tolist())
        return MemoryTimeline(frame, source=self.source, device=self.device,
                              base_bytes={r: b for r, b in self.base_bytes.items() if r in ranks}, meta=self.meta)

    # -- selection ----------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.frame["rank"].unique().tolist()) | set(self.base_bytes))

    @property
    def steps(self) -> list[int]:
        return sorted(s for s in self.frame["step"].unique().tolist() if s >= 0)

    def __len__(self) -> int:
        return len(self.frame)

    def rank(self, rank: int) -> "MemoryTimeline":
        if rank not in self.ranks:
            raise KeyError(f"rank {rank} is not in this timeline; it has ranks {self.ranks}")
        return self._new(self.frame[self.frame["rank"] == rank])

    def select(self, rank: int | None = None, step: int | None = None) -> "MemoryTimeline":
        """Events of one rank and/or one step (``total_bytes`` keeps its absolute values)."""
        df = self.frame
        if rank is not None:
            if rank not in self.ranks:
                raise KeyError(f"rank {rank} is not in this timeline; it has ranks {self.ranks}")
            df = df[df["rank"] == rank]
        if step is None:
            return self._new(df)
        if step not in self.steps:
            raise KeyError(f"step {step} is not in this timeline; it has steps {self.steps}")
        # What was alive when the step began becomes the selection's base, so bytes per category,
        # peaks and totals stay absolute (allocations made before the step are listed by alive_at of
        # the whole timeline, not of the selection).
        base, per = {}, {}
        for r in sorted(set(df["rank"].unique().tolist())):
            ev = self._events(r)
            rows = np.flatnonzero(ev["step"].to_numpy() == step)
            if not len(rows):
                continue
            first = int(rows[0])
            if first == 0:
                base[r] = self.base_bytes.get(r, 0)
                per[str(r)] = self._base_by_category(r)
            else:
                base[r] = int(ev["total_bytes"].iloc[first - 1])
                cats = self.category_bytes(r).iloc[first - 1]
                per[str(r)] = {c: int(cats[c]) for c in CATEGORIES if cats[c]}
        df = df[df["step"] == step]
        return MemoryTimeline(df, source=self.source, device=self.device, base_bytes=base,
                              meta={**self.meta, "base_by_category": per})

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    # -- the questions ------------------------------------------------------------------------
    def _events(self, rank: int) -> pd.DataFrame:
        return self.frame[self.frame["rank"] == rank]

    def category_bytes(self, rank: int) -> pd.DataFrame:
        """Bytes alive per category after every event of ``rank`` (columns: the categories)."""
        ev = self._events(rank)
        codes = ev["category"].cat.codes.to_numpy()
        out = np.zeros((len(ev), len(CATEGORIES)), dtype=np.int64)
        out[np.arange(len(ev)), codes] = ev["delta_bytes"].to_numpy()
        out = np.cumsum(out, axis=0)
        base = self._base_by_category(rank)
        out += np.array([base.get(c, 0) for c in CATEGORIES], dtype=np.int64)
        return pd.DataFrame(out, columns=list(CATEGORIES), index=ev.index)

    def _base_by_category(self, rank: int) -> dict[str, int]:
        per = self.meta.get("base_by_category", {}).get(str(rank))
        if per:
            return {k: int(v) for k, v in per.items()}
        return {"other": self.base_bytes.get(rank, 0)}

    def peak(self, rank: int | None = None) -> Peak:
        """The peak of ``rank`` (default: the rank with the largest peak)."""
        if rank is None:
            peaks = {r: self.peak(r) for r in self.ranks}
            return max(peaks.values(), key=lambda p: p.bytes)
        ev = self._events(rank)
        base = self.base_bytes.get(rank, 0)
        if ev.empty:
            return Peak(rank, base, 0.0, -1, -1, "other", -1, self._base_by_category(rank))
        totals = ev["total_bytes"].to_numpy()
        i = int(np.argmax(totals))
        if totals[i] < base:
            return Peak(rank, base, float(ev["t"].iloc[0]), -1, -1, "other", -1, self._base_by_category(rank))
        cats = self.category_bytes(rank).iloc[i]
        row = ev.iloc[i]
        return Peak(rank, int(totals[i]), float(row["t"]), i, int(row["step"]), str(row["phase"]),
                    int(row["microbatch"]), {c: int(cats[c]) for c in CATEGORIES if cats[c]})

    def peaks(self) -> pd.DataFrame:
        """One row per rank: peak bytes, when, and bytes per category at that moment; plus ``reserved_bytes``
        (the allocator's reserved peak, :meth:`reserved_peak`) when the timeline knows it for every rank."""
        rows = []
        for r in self.ranks:
            p = self.peak(r)
            rows.append({"rank": r, "peak_bytes": p.bytes, "t": p.t, "step": p.step, "phase": p.phase,
                         "microbatch": p.microbatch, **{c: p.by_category.get(c, 0) for c in CATEGORIES}})
        reserved = [self.reserved_peak(r) for r in self.ranks]
        if rows and all(v is not None for v in reserved):
            for row, v in zip(rows, reserved):
                row["reserved_bytes"] = v
        return pd.DataFrame(rows)

    def reserved_peak(self, rank: int) -> int | None:
        """``max_memory_reserved`` of ``rank`` where the timeline knows it: a CUDA prediction's caching
        allocator model (``meta["allocator"]``, workbench.memory.allocator) or an imported snapshot's
        segment events (``meta["reserved_bytes"]``); else None."""
        for key, field_ in (("allocator", "peak_reserved"), ("reserved_bytes", "peak")):
            per = self.meta.get(key)
            per = per.get("ranks", per) if isinstance(per, dict) and key == "allocator" else per
            v = per.get(str(rank)) if isinstance(per, dict) else None
            if isinstance(v, dict) and type(v.get(field_)) is int:
                return v[field_]
        return None

    def peak_breakdown(self) -> pd.DataFrame:
        """What each rank's peak is made of, indexed by rank: one column per category that is non-zero at
        some rank's peak (none left out, in :data:`CATEGORIES` order), then ``peak``, their sum. Bytes a
        timeline cannot attribute (a base it does not split by category) would be an ``unattributed``
        column, so a row always adds up to its peak."""
        peaks = self.peaks().set_index("rank")
        shown = [c for c in CATEGORIES if peaks[c].any()]
        out = peaks[shown].astype(np.int64)
        rest = peaks["peak_bytes"].astype(np.int64) - out.sum(axis=1)
        if rest.any():
            out["unattributed"] = rest
        out["peak"] = peaks["peak_bytes"].astype(np.int64)
        return out

    def alive_at(self, rank: int, index: int, top: int | None = 10) -> pd.DataFrame:
        """The allocations alive just after event ``index`` of ``rank``, largest first: id, bytes,
        category, module, op, phase and when each was made."""
        ev = self._events(rank).iloc[: index + 1]
        if ev.empty:
            return pd.DataFrame(columns=["id", "bytes", "category", "module", "op", "phase", "t"])
        net = ev.groupby("id", sort=False)["delta_bytes"].sum()
        net = net[net > 0]
        first = ev[ev["delta_bytes"] > 0].drop_duplicates("id", keep="last").set_index("id")
        first = first.loc[first.index.intersection(net.index)]
        out = pd.DataFrame({"id": first.index, "bytes": net.loc[first.index].to_numpy(),
                            "category": first["category"].astype(str).to_numpy(),
                            "module": first["module"].astype(str).to_numpy(),
                            "op": first["op"].astype(str).to_numpy(),
                            "phase": first["phase"].astype(str).to_numpy(), "t": first["t"].to_numpy()})
        out = out.sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True)
        return out if top is None else out.head(top)

    def alive_at_peak(self, rank: int | None = None, top: int | None = 10) -> pd.DataFrame:
        p = self.peak(rank)
        return self.alive_at(p.rank, p.index, top)

    def modules_at_peak(self, rank: int | None = None) -> pd.DataFrame:
        """Bytes alive at the peak by the module that made them (activations and temporaries mostly)."""
        alive = self.alive_at_peak(rank, top=None)
        if alive.empty:
            return pd.DataFrame(columns=["module", "bytes", "count"])
        g = alive.groupby("module").agg(bytes=("bytes", "sum"), count=("bytes", "size"))
        return g.sort_values("bytes", ascending=False).reset_index()

    def phase_spans(self, rank: int, *, step: int | None = None, max_spans: int | None = None) -> pd.DataFrame:
        """Contiguous runs of one (phase, step, microbatch): the bands of the view.

        ``step`` keeps the runs of that step only. ``max_spans`` bounds the answer, so 10^6 events never
        make 10^5 bands: runs are first joined across microbatches (``microbatch`` -1), then across steps
        (``step`` -1), and if that is still too many, time is cut into ``max_spans`` equal slices. A slice
        takes the phase that ran for more than half of it (a phase lasts from its first event to the next
        phase's), and neighbouring slices of one phase are joined; a slice where no phase did so has no
        span: at that zoom the phases alternate too fast to draw, and one step shows them all.
        """
        ev = self._events(rank)
        if step is not None:
            ev = ev[ev["step"] == step]
        if ev.empty:
            return pd.DataFrame(columns=["phase", "step", "microbatch", "t0", "t1"])
        key = (ev["phase"].cat.codes.to_numpy().astype(np.int64) * 1_000_003
               + ev["step"].to_numpy() * 1009 + ev["microbatch"].to_numpy())
        starts = np.r_[0, np.flatnonzero(np.diff(key)) + 1]
        t = ev["t"].to_numpy()
        ends = np.r_[starts[1:], len(ev)]
        spans = pd.DataFrame({"phase": ev["phase"].astype(str).to_numpy()[starts],
                              "step": ev["step"].to_numpy()[starts],
                              "microbatch": ev["microbatch"].to_numpy()[starts],
                              "t0": t[starts], "t1": t[ends - 1]})
        if max_spans is None or len(spans) <= max_spans:
            return spans
        if max_spans < 1:
            raise ValueError(f"max_spans={max_spans}: ask for at least 1 span")
        for keys in (("phase", "step"), ("phase",)):
            spans = _join_spans(spans, keys)
            if len(spans) <= max_spans:
                return spans
        return _slice_spans(spans, max_spans)

    def step_progress(self, rank: int, t: Any) -> np.ndarray:
        """Times ``t`` of ``rank`` on a step clock: step s starts at s and ends where step s+1 starts.

        Each step's first event maps to its step number and the last step's last event to one more;
        times in between are interpolated linearly, times before the first step clamp to it. This puts
        timelines in different time units (a measured run in seconds, a prediction in event positions)
        on one axis, step against step. A rank without steps is one step 0, first event to last.
        """
        ev = self._events(rank)
        t = np.asarray(t, dtype=np.float64)
        if ev.empty:
            return np.zeros_like(t)
        times, steps = ev["t"].to_numpy(), ev["step"].to_numpy()
        inside = steps >= 0
        if not inside.any():
            lo, hi = float(times.min()), float(times.max())
            return np.clip((t - lo) / (hi - lo), 0.0, 1.0) if hi > lo else np.zeros_like(t)
        first = pd.Series(times[inside]).groupby(steps[inside]).min()
        anchor_t = np.r_[first.to_numpy(), times[inside].max()]
        anchor_x = np.r_[first.index.to_numpy(dtype=np.float64), first.index[-1] + 1.0]
        return np.interp(t, np.maximum.accumulate(anchor_t), anchor_x)

    def downsample(self, rank: int, max_points: int = 2000, *, step: int | None = None) -> pd.DataFrame:
        """At most ``max_points`` rows of ``rank`` for plotting: t, total and bytes per category.

        The rows are :func:`extreme_indices` of the totals: each equal-count bin's smallest and largest
        total, so peaks and dips survive, and the first and last events. ``step`` keeps the events of
        that step only, each still counting the bytes alive from before it (unlike ``select(step=...)``,
        whose category bytes start again from ``base_bytes``).
        """
        ev = self._events(rank)
        cats = self.category_bytes(rank)
        if step is not None:
            keep_step = (ev["step"] == step).to_numpy()
            ev, cats = ev[keep_step], cats[keep_step]
        totals = ev["total_bytes"].to_numpy()
        keep = extreme_indices(totals, max_points)
        out = cats.iloc[keep].reset_index(drop=True)
        out.insert(0, "t", ev["t"].to_numpy()[keep])
        out.insert(1, "total_bytes", totals[keep])
        out.insert(2, "phase", ev["phase"].astype(str).to_numpy()[keep])
        out.insert(3, "step", ev["step"].to_numpy()[keep])
        return out

    def summary(self) -> dict[str, Any]:
        return {"source": self.source, "device": self.device, "ranks": self.ranks, "events": len(self),
                "steps": self.steps,
                "peaks": {str(r): self.peak(r).bytes for r in self.ranks}, **{k: v for k, v in self.meta.items()
                                                                            if k != "base_by_category"}}

    def to_json(self) -> str:
        """The summary and each rank's peak breakdown (the events themselves go to :meth:`save`)."""
        d = self.summary()
        d["peak_by_category"] = {str(r): self.peak(r).by_category for r in self.ranks}
        return json.dumps(d, default=_json_default)

    # -- files --------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``rank{r}.npz`` (events) and ``rank{r}.json`` (source, device, base bytes, meta) per rank.

        One pair of files per rank, each replaced atomically, so every rank of a job writes its own into
        the same ``RUN_DIR/memory/`` without coordination. The .npz files hold plain arrays only
        (strings as codes into a vocabulary): loading them never unpickles anything.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for r in self.ranks:
            _write_npz(d / f"rank{r}.npz", self._events(r))
            meta = dict(self.meta)
            if "base_by_category" in meta:
                meta["base_by_category"] = {k: v for k, v in meta["base_by_category"].items() if k == str(r)}
            info = {"format": "workbench.memory_timeline", "version": FORMAT_VERSION, "rank": r,
                    "source": self.source, "device": self.device, "base_bytes": self.base_bytes.get(r, 0),
                    "meta": meta}
            tmp = d / f"rank{r}.json.tmp"
            tmp.write_text(json.dumps(info, default=_json_default))
            os.replace(tmp, d / f"rank{r}.json")
        return d

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MemoryTimeline":
        """Read what :meth:`save` wrote: a ``memory/`` directory or a run directory holding one.

        Every file may be damaged or hostile: each is a regular file of a plausible size (never a FIFO
        that would block), its JSON is checked field by field, its arrays against the sizes their headers
        claim, and any problem is one ValueError naming the file."""
        d = Path(path)
        if d.is_dir() and not list(d.glob("rank*.json")) and (d / "memory").is_dir():
            d = d / "memory"  # a run directory
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory of memory timelines")
        infos = sorted(d.glob("rank*.json"), key=lambda p: _rank_number(p.stem))
        if not infos:
            raise FileNotFoundError(f"{d} holds no memory timeline (no rank*.json); record one with "
                                    "`workbench train ... --memory` or `workbench memory record`")
        from workbench.safeio import confine

        frames, base, meta = [], {}, {}
        source = device = None
        for info_path in infos:
            # files of this directory: a link out of it is refused before it is opened
            info = _read_info(confine(d, info_path.name, what="memory timeline record"))
            r = info["rank"]
            f = confine(d, f"rank{r}.npz", what="memory timeline file")
            if not f.exists():
                raise FileNotFoundError(f"{f} is missing: rank {r}'s events were not written (did the rank crash?)")
            frames.append(_read_npz(f, r))
            base[r] = info["base_bytes"]
            m = dict(info["meta"])
            per = m.pop("base_by_category", None)
            if isinstance(per, dict):
                meta.setdefault("base_by_category", {}).update(per)
            meta.update(m)
            source, device = source or info["source"], device or info["device"]
        frame = pd.concat(frames, ignore_index=True)
        return cls(frame, source=source or "measured", device=device or "cpu", base_bytes=base, meta=meta)

    # -- display ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        peak = self.peak() if self.ranks else None
        at = f", peak {format_bytes(peak.bytes)} on rank {peak.rank}" if peak else ""
        return (f"MemoryTimeline({self.source}, {self.device}, ranks={self.ranks}, events={len(self)}{at})")

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r.rank}</td><td>{format_bytes(r.peak_bytes)}</td><td>{r.phase}</td><td>{r.step}</td>"
            + "".join(f"<td>{format_bytes(getattr(r, c))}</td>" for c in CATEGORIES) + "</tr>"
            for r in self.peaks().itertuples())
        head = "".join(f"<th>{c}</th>" for c in ("rank", "peak", "phase", "step", *CATEGORIES))
        return (f"<div><b>MemoryTimeline</b> ({self.source}, {self.device}, {len(self)} events)"
                f"<table><tr>{head}</tr>{rows}</table></div>")


def extreme_indices(values: np.ndarray, points: int) -> np.ndarray:
    """At most ``points`` sorted indices of ``values`` to draw: all of them when there are few, else the
    first, the last, and the smallest and largest value of each of at most ``(points - 2) // 2`` bins of
    equal count (the last one shorter), so the peak and the dips survive downsampling. O(n): one argmin
    and one argmax over the bins laid out as rows."""
    n = len(values)
    if n <= points:
        return np.arange(n)
    size = -(-n // max(1, (points - 2) // 2))  # values per bin
    full = n // size * size
    rows = np.asarray(values)[:full].reshape(-1, size)
    starts = np.arange(len(rows)) * size
    parts = [[0, n - 1], starts + rows.argmin(1), starts + rows.argmax(1)]
    if full < n:
        tail = np.asarray(values)[full:]
        parts.append([full + int(tail.argmin()), full + int(tail.argmax())])
    return np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))


def _rank_number(stem: str) -> int:
    digits = "".join(ch for ch in stem if ch in "0123456789")
    return int(digits) if 0 < len(digits) <= 9 else 0  # (a longer run of digits names no rank)


_INFO_MAX = 16 << 20  # a rank's JSON: source, device, base bytes and meta (a few KB when written)
_META_DEPTH = 16      # meta nests a few levels (base_by_category, downsampled); printing it must not recurse deep
_MAX_INFLATE = 1100   # deflate cannot compress more than 1032 to 1: a zip member claiming more lies


def _read_info(path: Path) -> dict[str, Any]:
    """A rank's ``rank{r}.json``, every field checked (one ValueError naming the file)."""
    from workbench.safeio import read_json

    info = read_json(path, _INFO_MAX, "memory timeline record",
                     fix="the timeline is damaged; record it again or delete this file")
    bad = f"{path} is not a workbench memory timeline record"
    if not isinstance(info, dict) or info.get("format") != "workbench.memory_timeline":
        raise ValueError(f"{bad} (no 'format': 'workbench.memory_timeline'); record it again")
    r, b, m = info.get("rank"), info.get("base_bytes", 0), info.get("meta", {})
    if type(r) is not int or not 0 <= r < (1 << 31):
        raise ValueError(f"{bad}: its rank is not a number from 0 to 2**31-1; record it again")
    if type(b) is not int or not -(1 << 63) <= b < (1 << 63):
        raise ValueError(f"{bad}: its base_bytes is not a 64-bit integer; record it again")
    if not isinstance(m, dict) or _depth(m) > _META_DEPTH:
        raise ValueError(f"{bad}: its meta is not a JSON object nested at most {_META_DEPTH} deep; record it again")
    per = m.get("base_by_category", {})  # the one part of meta the timeline computes with
    if not (isinstance(per, dict) and all(isinstance(v, dict) and all(
            k in CATEGORIES and type(b) is int and -(1 << 63) <= b < (1 << 63) for k, b in v.items())
            for v in per.values())):
        raise ValueError(f"{bad}: its meta's base_by_category is not bytes (64-bit integers) per rank and "
                         "category; record it again")
    source, device = info.get("source"), info.get("device")
    return {"rank": r, "base_bytes": b, "meta": m, "source": source if isinstance(source, str) else None,
            "device": device if isinstance(device, str) else None}


def _depth(value: Any) -> int:
    """How deep JSON values nest (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _join_spans(spans: pd.DataFrame, keys: tuple[str, ...]) -> pd.DataFrame:
    """Join neighbouring spans equal in ``keys``; a step or microbatch that differs inside a join is -1."""
    change = np.zeros(len(spans), dtype=bool)
    change[0] = True
    for k in keys:
        v = spans[k].to_numpy()
        change[1:] |= v[1:] != v[:-1]
    starts = np.flatnonzero(change)
    out = {"phase": spans["phase"].to_numpy()[starts]}
    for k in ("step", "microbatch"):
        v = spans[k].to_numpy()
        lo, hi = np.minimum.reduceat(v, starts), np.maximum.reduceat(v, starts)
        out[k] = np.where(lo == hi, lo, -1).astype(v.dtype)
    ends = np.r_[starts[1:], len(spans)] - 1
    out["t0"], out["t1"] = spans["t0"].to_numpy()[starts], spans["t1"].to_numpy()[ends]
    return pd.DataFrame(out)


def _slice_spans(spans: pd.DataFrame, n: int) -> pd.DataFrame:
    """``n`` equal time slices, each labelled with the phase that ran most of it (or dropped when none
    did), neighbours of one phase joined."""
    t0 = spans["t0"].to_numpy()
    stop = np.r_[t0[1:], spans["t1"].to_numpy()[-1]]  # a phase lasts until the next one starts
    lo, hi = float(t0[0]), float(stop[-1])
    edges = np.linspace(lo, hi, n + 1)
    phases = spans["phase"].to_numpy()
    names = [p for p in PHASES if (phases == p).any()]
    cover = np.zeros((len(names), n))
    for i, p in enumerate(names):  # time of phase p up to x: cumulative lengths, one searchsorted
        a, b = t0[phases == p], stop[phases == p]
        before = np.r_[0.0, np.cumsum(b - a)]
        j = np.maximum(np.searchsorted(a, edges, side="right") - 1, 0)  # the span starting last before x
        cover[i] = np.diff(before[j] + np.clip(edges - a[j], 0, b[j] - a[j]))
    best = np.argmax(cover, axis=0)
    label = np.where(cover[best, np.arange(n)] > 0.5 * (hi - lo) / n, best, -1)
    starts = np.r_[0, np.flatnonzero(np.diff(label)) + 1]
    ends = np.r_[starts[1:], n]
    keep = label[starts] >= 0
    return pd.DataFrame({"phase": np.asarray(names)[label[starts][keep]], "step": -1, "microbatch": -1,
                         "t0": edges[starts][keep], "t1": edges[ends][keep]})


def _write_npz(path: Path, ev: pd.DataFrame) -> None:
    arrays: dict[str, np.ndarray] = {}
    for c in COLUMNS:
        if c in _STRINGS:
            codes, vocab = pd.factorize(ev[c].astype(str), sort=False)
            arrays[c] = codes.astype(np.int32)
            arrays[c + "__vocab"] = np.asarray(vocab, dtype=str) if len(vocab) else np.zeros(0, dtype="<U1")
        else:
            arrays[c] = ev[c].to_numpy()
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def _read_npz(path: Path, rank: int) -> pd.DataFrame:
    from workbench.safeio import open_regular

    damaged = f"{path} is damaged or not a timeline file"
    try:
        with open_regular(path, "memory timeline file", fix_missing="record the timeline again") as fh, \
                np.load(fh, allow_pickle=False) as z:
            _check_members(z)
            cols = {}
            for c in COLUMNS:
                if c in _STRINGS:
                    vocab, codes = z[c + "__vocab"], z[c]
                    if codes.dtype.kind not in "iu" or vocab.dtype.kind not in "U" or vocab.ndim != 1:
                        raise ValueError("a string column of the wrong type")
                    if len(vocab) and (not len(codes) or 0 <= codes.min() <= codes.max() < len(vocab)):
                        # categoricals straight from the codes (sorted, as from strings): no pass over
                        # millions of strings
                        order = np.argsort(vocab, kind="stable")
                        if len(np.unique(vocab)) != len(vocab):
                            raise ValueError("a vocabulary with repeated strings")
                        ranks = np.empty(len(vocab), np.int64)
                        ranks[order] = np.arange(len(vocab))
                        cols[c] = pd.Categorical.from_codes(ranks[codes], categories=vocab[order].astype(str).tolist())
                    elif len(codes):
                        raise ValueError("string codes outside their vocabulary")
                    else:
                        cols[c] = np.zeros(0, dtype=str)
                else:
                    col = z[c]
                    if col.dtype.kind not in ("f" if c == "t" else "iu") or col.ndim != 1 \
                            or (c == "t" and not np.isfinite(col).all()):
                        raise ValueError(f"column {c} of the wrong type")
                    cols[c] = col
            if len({len(v) for v in cols.values()}) > 1:
                raise ValueError("columns of different lengths")
            return check_frame(pd.DataFrame(cols))
    except FileNotFoundError:
        raise
    except ValueError as e:
        if getattr(e, "file", None):  # safeio's refusal (not a regular file ...) names the file itself
            raise
        raise ValueError(f"{damaged} ({_safe_reason(e)}); record it again") from None
    except (OSError, KeyError, EOFError, IndexError, TypeError, OverflowError, MemoryError, RuntimeError,
            NotImplementedError, zipfile.BadZipFile, zlib.error) as e:
        # zipfile and numpy raise all of these for a damaged archive (NotImplementedError: an unknown
        # compression; RuntimeError: an encrypted member)
        raise ValueError(f"{damaged} ({type(e).__name__}); record it again") from None


def _safe_reason(e: ValueError) -> str:
    """Our own checks' words; numpy's and pandas' messages may quote the file's contents."""
    text = str(e)
    return text if text in _OWN_REASONS or text.startswith("column ") and text.endswith("wrong type") \
        else type(e).__name__


_OWN_REASONS = {"a string column of the wrong type", "an array header that is not numpy's",
                "a vocabulary with repeated strings", "string codes outside their vocabulary",
                "columns of different lengths", "an array larger than its zip member",
                "a member inflating more than deflate can"}


def _check_members(z: Any) -> None:
    """Every array's header against its zip member before numpy allocates it: numpy makes the whole array
    from the shape its header claims, so a 100-byte member claiming 10**12 rows would ask for terabytes."""
    from numpy.lib import format as npy

    for name in z.zip.namelist():
        info = z.zip.getinfo(name)
        if info.file_size > _MAX_INFLATE * info.compress_size + 4096:
            raise ValueError("a member inflating more than deflate can")
        with z.zip.open(name) as fp:
            try:
                version = npy.read_magic(fp)
                shape, _, dtype = (npy.read_array_header_1_0(fp) if version == (1, 0) else
                                   npy.read_array_header_2_0(fp))
            except (ValueError, SyntaxError, TypeError, KeyError, EOFError, tokenize.TokenError):
                # numpy parses the header's dict with the tokenizer: a damaged one raises any of these
                raise ValueError("an array header that is not numpy's") from None
            if dtype.hasobject or int(np.prod(shape, dtype=object)) * dtype.itemsize > info.file_size:
                raise ValueError("an array larger than its zip member")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
