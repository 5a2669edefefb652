"""The one step-timeline schema: measured (profiler traces), imported and predicted step times alike.

A timeline is a table of spans, one row per stretch of time a rank spent on one thing::

    rank  start    end      category       phase     step  microbatch  module          stream   name             bytes
    0     0.0113   0.0141   forward        forward   3     0           layers.0.attn   compute  aten::mm         0
    0     0.0141   0.0190   communication  backward  3     1           layers.0        comm     all_gather       4194304
    1     0.0150   0.0170   idle           forward   3     -1          ""              compute  wait:bubble      0

- ``start``/``end`` are seconds from the timeline's origin (the first event of any rank, so ranks of one
  job share a clock); ``end >= start``.
- ``category`` is one of :data:`CATEGORIES`: where the time went. ``phase`` (:data:`PHASES`) says which
  part of the step a span belongs to: a gradient reduce-scatter is ``communication`` in phase
  ``backward``. ``step``/``microbatch`` are -1 where they do not apply.
- ``stream`` is where the span ran: ``compute`` (the main thread, or a GPU's compute stream), ``comm``
  (a collective's stream or thread), or a name such as ``cuda:7``. Spans of one stream never overlap in
  a well-formed timeline; spans of different streams may (that is overlap).
- ``name`` is the operator, kernel or collective (``aten::mm``, ``nccl:all_gather``, ``wait:host``...);
  ``bytes`` the payload of a collective (0 for other spans).

Spans are leaves: a forward span does not contain the communication span inside it. Questions across
spans (breakdown per step, exposed communication, idle split, stragglers, a diff of two runs) are in
:mod:`workbench.time.analysis`; this module holds the table, its checks, selection, totals and files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from workbench.display import RendersInNotebook

__all__ = ["CATEGORIES", "PHASES", "COLUMNS", "StepTimeline", "span_frame", "check_frame", "FORMAT_VERSION"]

CATEGORIES = ("forward", "backward", "optimizer", "communication", "data", "checkpoint", "idle")
PHASES = ("forward", "backward", "optimizer", "data", "checkpoint", "other")
COLUMNS = ("rank", "start", "end", "category", "phase", "step", "microbatch", "module", "stream", "name", "bytes")
_INTS = {"rank": np.int32, "step": np.int32, "microbatch": np.int32, "bytes": np.int64}
_STRINGS = ("module", "stream", "name")
FORMAT_VERSION = 1
# A saved timeline is read whole: refuse files past this size (a hostile one must not exhaust memory).
MAX_FILE_BYTES = 512 << 20


def span_frame(rows: Sequence[dict[str, Any]] | pd.DataFrame | None = None) -> pd.DataFrame:
    """A checked frame from span dicts (missing optional fields get their defaults) or a frame."""
    if rows is None:
        rows = []
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    defaults = {"phase": "other", "step": -1, "microbatch": -1, "module": "", "stream": "compute", "name": "",
                "bytes": 0}
    for c in COLUMNS:
        if c in df.columns and c in defaults:
            df[c] = df[c].where(df[c].notna(), defaults[c])
        elif c not in df.columns:
            if c in defaults:
                df[c] = defaults[c]
            elif len(df) == 0:
                df[c] = []
            else:
                raise ValueError(f"span rows need a {c!r} field")
    return check_frame(df)


def check_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Validate and type a frame against the schema; one ValueError naming what is wrong."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"a step timeline needs columns {list(COLUMNS)}; missing {missing}")
    df = df[list(COLUMNS)].copy()
    try:
        for c, dt in _INTS.items():
            df[c] = pd.to_numeric(df[c], errors="raise").astype(dt)
        for c in ("start", "end"):
            df[c] = pd.to_numeric(df[c], errors="raise").astype(np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a step timeline's numeric columns hold something else ({str(e)[:80]})") from None
    if len(df):
        if not (np.isfinite(df["start"]).all() and np.isfinite(df["end"]).all()):
            raise ValueError("a step timeline's start/end must be finite seconds")
        if (df["end"] < df["start"]).any():
            bad = df[df["end"] < df["start"]].iloc[0]
            raise ValueError(f"a span ends before it starts (rank {bad['rank']}, {bad['name']!r}: "
                             f"{bad['start']:.6f} > {bad['end']:.6f})")
    for c, allowed in (("category", CATEGORIES), ("phase", PHASES)):
        col = df[c].astype(str)
        bad = sorted(set(col.unique()) - set(allowed))
        if bad:
            raise ValueError(f"unknown {c} {bad[:3]}; a step timeline's {c} is one of {list(allowed)}")
        df[c] = pd.Categorical(col, categories=allowed)
    for c in _STRINGS:
        df[c] = df[c].astype(str)
    return df.sort_values(["rank", "start", "end"], kind="stable").reset_index(drop=True)


class StepTimeline(RendersInNotebook):
    """Spans of one or more ranks in the schema above.

    ``source`` says where it came from (``measured``, ``imported``, ``predicted``), ``device`` what it
    measures or targets (``cpu``, ``cuda``, or a device profile's name such as ``H100-SXM``); ``meta`` holds
    the rest (layout, model, device model, trace files...). A predicted timeline says which device model it
    used in ``meta["device_model"]``.
    """

    def __init__(self, frame: pd.DataFrame, *, source: str = "measured", device: str = "cpu",
                 meta: dict[str, Any] | None = None):
        self.frame = check_frame(frame)
        self.source = source
        self.device = device
        self.meta = dict(meta or {})

    @classmethod
    def concat(cls, timelines: Sequence["StepTimeline"], **kw) -> "StepTimeline":
        if not timelines:
            raise ValueError("no timelines to join")
        meta: dict[str, Any] = {}
        for tl in timelines:
            meta.update(tl.meta)
        frame = pd.concat([tl.frame for tl in timelines], ignore_index=True)
        return cls(frame, source=kw.get("source", timelines[0].source), device=kw.get("device", timelines[0].device),
                   meta=kw.get("meta", meta))

    def _new(self, frame: pd.DataFrame) -> "StepTimeline":
        return StepTimeline(frame, source=self.source, device=self.device, meta=self.meta)

    # -- selection ----------------------------------------------------------------------------
    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in self.frame["rank"].unique())

    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.frame["step"].unique() if s >= 0)

    def __len__(self) -> int:
        return len(self.frame)

    def select(self, rank: int | None = None, step: int | None = None, category: str | None = None) -> "StepTimeline":
        df = self.frame
        if rank is not None:
            df = df[df["rank"] == rank]
        if step is not None:
            df = df[df["step"] == step]
        if category is not None:
            if category not in CATEGORIES:
                raise ValueError(f"unknown category {category!r}; choose from {list(CATEGORIES)}")
            df = df[df["category"] == category]
        return self._new(df)

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def bars(self, max_bars: int = 2000, *, t0: float | None = None, t1: float | None = None) -> pd.DataFrame:
        """The spans to draw, at most about ``2 * max_bars`` per rank and stream, whatever their number.

        The resolution is ``(t1 - t0) / max_bars`` (default: the timeline's extent). Per rank and stream,
        neighbouring spans of one category less than a resolution apart are joined; what is still shorter
        than a resolution is gathered per time bin into one bar of the bin's dominant category. Columns:
        ``rank, stream, category, start, end, busy_s`` (seconds of spans inside), ``spans`` (how many),
        ``name`` (the longest span's name), ``step``. The views (notebook and JupyterLab) draw these."""
        if max_bars < 1:
            raise ValueError(f"max_bars={max_bars}: ask for at least 1 bar")
        cols = ["rank", "stream", "category", "start", "end", "busy_s", "spans", "name", "step"]
        df = self.frame
        if t0 is not None:
            df = df[df["end"] >= t0]
        if t1 is not None:
            df = df[df["start"] <= t1]
        if df.empty:
            return pd.DataFrame(columns=cols)
        lo = float(df["start"].min()) if t0 is None else float(t0)
        hi = float(df["end"].max()) if t1 is None else float(t1)
        res = max(hi - lo, 1e-12) / max_bars
        df = df.sort_values(["rank", "stream", "start"], kind="stable")
        d = pd.DataFrame({"rank": df["rank"].to_numpy(), "stream": df["stream"].to_numpy(),
                          "category": df["category"].astype(str).to_numpy(), "start": df["start"].to_numpy(),
                          "end": df["end"].to_numpy(), "name": df["name"].to_numpy(), "step": df["step"].to_numpy()})
        d["busy_s"] = d["end"] - d["start"]
        key = ["rank", "stream"]
        # a new run starts where the rank/stream/category changes or the gap to the run so far exceeds res
        run_end = d.groupby(key, sort=False)["end"].cummax().shift(1)
        same = ((d["rank"] == d["rank"].shift(1)) & (d["stream"] == d["stream"].shift(1))
                & (d["category"] == d["category"].shift(1)) & (d["start"] <= run_end + res))
        d["run"] = (~same).cumsum()
        runs = self._join(d, ["run"])
        long = runs[(runs["end"] - runs["start"]) >= res]
        short = runs[(runs["end"] - runs["start"]) < res].copy()
        if len(short):
            short["bin"] = ((short["start"] - lo) // res).astype(np.int64)
            dominant = (short.groupby([*key, "bin", "category"], sort=False)["busy_s"].sum().reset_index()
                        .sort_values("busy_s", ascending=False, kind="stable")
                        .drop_duplicates([*key, "bin"])[[*key, "bin", "category"]])
            short = self._join(short.drop(columns="category").merge(dominant, on=[*key, "bin"]), [*key, "bin"])
        out = pd.concat([long, short], ignore_index=True) if len(short) else long
        return out[cols].sort_values(["rank", "stream", "start"], kind="stable").reset_index(drop=True)

    @staticmethod
    def _join(d: pd.DataFrame, by: list[str]) -> pd.DataFrame:
        """One bar per group of ``d``: its extent, busy seconds, span count, longest span's name, first step."""
        n = d["spans"] if "spans" in d.columns else pd.Series(1, index=d.index)
        longest = d.loc[d.assign(_n=n).sort_values("busy_s", ascending=False, kind="stable")
                        .drop_duplicates(by).index, [*by, "name"]]
        aggs = {"rank": ("rank", "first"), "stream": ("stream", "first"), "category": ("category", "first"),
                "start": ("start", "min"), "end": ("end", "max"), "busy_s": ("busy_s", "sum"),
                "spans": ("spans", "sum"), "step": ("step", "first")}
        g = d.assign(spans=n).groupby(by, sort=False).agg(**{k: v for k, v in aggs.items() if k not in by})
        g = g.reset_index()
        return g.merge(longest, on=by, how="left")

    # -- totals -------------------------------------------------------------------------------
    def step_times(self) -> pd.DataFrame:
        """Per rank and step: the wall time from the step's first span to its last (``step_s``)."""
        df = self.frame[self.frame["step"] >= 0]
        if df.empty:
            return pd.DataFrame(columns=["rank", "step", "start", "end", "step_s"])
        g = df.groupby(["rank", "step"], observed=True).agg(start=("start", "min"), end=("end", "max")).reset_index()
        g["step_s"] = g["end"] - g["start"]
        return g

    def step_time(self, rank: int | None = None) -> float:
        """The median step time (seconds) of one rank, or of the slowest rank per step when ``rank`` is None."""
        st = self.step_times()
        if rank is not None:
            st = st[st["rank"] == rank]
        if st.empty:
            raise ValueError("this timeline has no spans inside a step (step >= 0)")
        per_step = st.groupby("step")["step_s"].max()
        return float(per_step.median())

    def totals(self) -> pd.DataFrame:
        """Seconds per rank and category, summed over spans (streams overlap, so rows may exceed wall time)."""
        df = self.frame.assign(seconds=self.frame["end"] - self.frame["start"])
        t = df.pivot_table(index="rank", columns="category", values="seconds", aggfunc="sum", fill_value=0.0,
                           observed=False)
        return t.reindex(columns=list(CATEGORIES), fill_value=0.0)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "device": self.device, "ranks": self.ranks, "spans": len(self),
                               "steps": self.steps}
        if self.steps:
            out["step_time_s"] = self.step_time()
            out["step_time_s_by_rank"] = {str(r): self.step_time(r) for r in self.ranks
                                          if (self.frame.loc[self.frame["rank"] == r, "step"] >= 0).any()}
        out["seconds_by_category"] = {str(r): {c: float(v) for c, v in row.items()}
                                      for r, row in self.totals().iterrows()}
        out["meta"] = self.meta
        return out

    def to_json(self) -> str:
        return json.dumps(self.summary(), default=_json_default)

    # -- files --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write one JSON file (columns as lists; never pickled), replaced atomically."""
        p = Path(path)
        if p.suffix != ".json":
            p = p / "step_timeline.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        cols = {c: (self.frame[c].astype(str).tolist() if c in ("category", "phase") else self.frame[c].tolist())
                for c in COLUMNS}
        doc = {"format": "workbench.step_timeline", "version": FORMAT_VERSION, "source": self.source,
               "device": self.device, "meta": self.meta, "columns": cols}
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(doc, default=_json_default))
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike) -> "StepTimeline":
        """Read what :meth:`save` wrote (a file, or a directory holding ``step_timeline.json``); a damaged or
        hostile file is one ValueError naming it."""
        from workbench.safeio import open_regular

        p = Path(path)
        if p.is_dir():
            p = p / "step_timeline.json"
        fix = "save one with StepTimeline.save or `workbench time import`"
        with open_regular(p, "step timeline", limit=MAX_FILE_BYTES, fix_missing=fix) as f:
            raw = f.read()
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{p} is not a step timeline (not readable JSON: {type(e).__name__}); {fix}") from None
        if not isinstance(doc, dict) or doc.get("format") != "workbench.step_timeline":
            raise ValueError(f"{p} is not a step timeline (no 'format': 'workbench.step_timeline'); {fix}")
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"{p} is a step timeline of version {doc.get('version')!r}; this workbench reads "
                             f"version {FORMAT_VERSION}")
        cols = doc.get("columns")
        if not isinstance(cols, dict) or any(not isinstance(cols.get(c), list) for c in COLUMNS):
            raise ValueError(f"{p} is damaged: its 'columns' must hold a list for each of {list(COLUMNS)}")
        n = {len(cols[c]) for c in COLUMNS}
        if len(n) != 1:
            raise ValueError(f"{p} is damaged: its columns have different lengths {sorted(n)}")
        for c in COLUMNS:
            kinds = (str,) if c in ("category", "phase", *_STRINGS) else (int, float)
            if any(type(v) not in kinds for v in cols[c]):
                raise ValueError(f"{p} is damaged: column {c!r} holds a value that is not "
                                 f"{'a string' if kinds == (str,) else 'a number'}")
        meta = doc.get("meta") if isinstance(doc.get("meta"), dict) else {}
        try:
            frame = pd.DataFrame({c: cols[c] for c in COLUMNS})
            return cls(frame, source=str(doc.get("source", "measured")), device=str(doc.get("device", "cpu")),
                       meta=meta)
        except ValueError as e:
            raise ValueError(f"{p} is damaged: {e}") from None

    # -- display ------------------------------------------------------------------------------
    def __repr__(self) -> str:
        st = f", step {self.step_time() * 1e3:.1f} ms" if self.steps else ""
        return f"StepTimeline({self.source}, {self.device}, ranks={self.ranks}, spans={len(self)}{st})"

    def _repr_html_(self) -> str:
        import html

        tot = self.totals()
        head = "".join(f"<th>{c}</th>" for c in ("rank", "step (ms)", *CATEGORIES))
        rows = []
        for r in self.ranks:
            try:
                st = f"{self.step_time(r) * 1e3:.2f}"
            except ValueError:
                st = "-"
            cells = "".join(f"<td>{tot.loc[r, c] * 1e3:.2f}</td>" if r in tot.index else "<td>0</td>"
                            for c in CATEGORIES)
            rows.append(f"<tr><td>{r}</td><td>{st}</td>{cells}</tr>")
        return (f"<div><b>StepTimeline</b> ({html.escape(self.source)}, {html.escape(self.device)}, {len(self)} spans; "
                f"ms per category, summed)<table><tr>{head}</tr>{''.join(rows)}</table></div>")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)
