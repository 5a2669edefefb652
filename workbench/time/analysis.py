"""Where each rank's step went: breakdown, exposed communication, idle split, stragglers, and a diff.

Every analysis reads one :class:`~workbench.time.timeline.StepTimeline` and answers per rank and step.
A rank's **step window** is the time from the first to the last span of that step on that rank (as
:meth:`StepTimeline.step_times` says); everything below is wall time inside that window, on that rank.
Within a window, spans of any step count (a gradient reduce-scatter of step 3 still running when step 4
starts is time step 4's window spent on communication).

**Breakdown** (:func:`breakdown`). Spans of several streams overlap, so seconds are charged *exclusively*:
at each instant the time goes to the first category active on the rank in the order
``forward > backward > optimizer > communication > data > checkpoint``, else to ``idle`` (an idle span,
or a gap no span covers). The categories of a row therefore sum to its ``step_s``, and its
``communication`` is the exposed communication of :func:`communication_overlap`::

    compute  |== fwd ==|          |==== bwd ====|
    comm         |=== ag ===|           |== rs ==|===|
    charged  |== fwd ==|comm|idle |==== bwd ====|com|

**Communication overlap** (:func:`communication_overlap`). ``comm_s``: time at least one communication
span is active (the union over streams). ``exposed_s``: the part of it no compute span (forward,
backward, optimizer; any stream) of the same rank covers; ``overlapped_s = comm_s - exposed_s``;
``exposed_fraction = exposed_s / comm_s`` (0 when the step has no communication).

**Idle split** (:func:`idle_split`). Waiting, in three reasons:

* ``bubble_s``: idle spans named ``wait:bubble``; and, on a pipeline stage (a step whose forward/backward
  spans carry microbatch numbers), the fill and drain of the schedule: every idle instant (whatever its
  name) and every exposed blocking wait (below) before its first microbatch starts or after its last
  one ends.
* ``rank_s``: waiting for another rank. Idle spans named ``wait:rank``; other idle time (unnamed idle
  spans, gaps) while at least one *other* rank is busy (computing, loading data or checkpointing: a
  forward, backward, optimizer, data or checkpoint span is active there); and the exposed part of
  communication spans that block on peers (:func:`is_wait_name`: a collective's wait, a point-to-point
  receive), the time a rank waits until its peers arrive.
* ``host_s``: idle spans named ``wait:host``, and the rest of the idle time: no rank at all is busy, so
  every rank waits on its host (Python, the data pipeline, kernel launches).

So ``host_s + rank_s + bubble_s`` is the breakdown's ``idle`` plus the exposed blocking waits (which the
breakdown charges to communication). Named idle spans name the reason outside a pipeline's fill and drain;
where one instant has several, ``wait:bubble`` wins over ``wait:rank`` over ``wait:host``.

**Stragglers** (:func:`stragglers`). Per rank, the median over steps of ``step_s`` and of ``busy_s``
(forward + backward + optimizer + data + checkpoint of the breakdown: the work, not the waiting). Ranks of
a synchronous job end each step together, at its last collective, so their step times are equal and the
straggler is the rank with more *work*: by default ranks are compared on ``busy_s`` against the median
rank (``by="step"`` compares step times, e.g. for predicted ranks that do not wait for each other).

**Diff** (:func:`diff`): two timelines (two runs, or a run and its prediction) as per-rank, per-category
deltas and the ratio of their step times; a :class:`TimelineDiff` that renders itself in a notebook.

All of it is interval arithmetic in numpy: per rank, one sort of the span boundaries and a cumulative
sum per kind of span (the sweep), then prefix sums queried at the window edges; the cross-rank
"another rank is busy" is one merged union of busy spans, measured by binary search. Cost is
O(n log n) in the number of spans.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from workbench.display import RendersInNotebook
from workbench.time.timeline import CATEGORIES, StepTimeline

__all__ = ["breakdown", "communication_overlap", "idle_split", "stragglers", "diff", "TimelineDiff",
           "BREAKDOWN_COLUMNS", "OVERLAP_COLUMNS", "IDLE_COLUMNS", "STRAGGLER_COLUMNS", "is_wait_name"]

BREAKDOWN_COLUMNS = ["rank", "step", *CATEGORIES, "step_s"]
OVERLAP_COLUMNS = ["rank", "step", "comm_s", "exposed_s", "overlapped_s", "exposed_fraction"]
IDLE_COLUMNS = ["rank", "step", "host_s", "rank_s", "bubble_s"]
STRAGGLER_COLUMNS = ["rank", "step_s", "busy_s", "median_s", "excess", "straggler"]

# Kinds of span in the sweep: the six working categories by their code in CATEGORIES (which is also the
# breakdown's priority order), then idle spans by the reason their name gives, then collective waits.
_FWD, _BWD, _OPT, _COMM, _DATA, _CKPT = range(6)
_IDLE_HOST, _IDLE_RANK, _IDLE_BUBBLE, _IDLE_OTHER, _COMM_WAIT = range(6, 11)
_N_KINDS = 11
_IDLE_NAMES = {"wait:host": _IDLE_HOST, "wait:rank": _IDLE_RANK, "wait:bubble": _IDLE_BUBBLE}
_BUSY = (_FWD, _BWD, _OPT, _DATA, _CKPT)  # a rank doing work (another rank waiting on it waits for a rank)
_IDLE = CATEGORIES.index("idle")


def is_wait_name(name: str) -> bool:
    """Whether a communication span is time blocked on peers: a collective's wait (``wait:...``,
    ``c10d::wait``, ``aten::wait``, ``_c10d_functional::wait_tensor``, ``gloo:wait``...) or a blocking
    point-to-point receive (``gloo:recv``, ``c10d::recv_``, ``nccl:recv``: a pipeline stage waiting for
    its neighbour's activations or gradients)."""
    n = name.lower()
    if n.startswith("wait:") or n == "wait" or n.endswith(("::wait", ":wait", "::wait_tensor", ".wait")):
        return True
    tail = re.split(r"[:.]", n)[-1].lstrip("_")
    return tail.startswith(("wait", "recv"))


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


class _Union:
    """A union of intervals, merged, with its measure up to any time (binary search)."""

    def __init__(self, start: np.ndarray, end: np.ndarray):
        keep = end > start
        s, e = start[keep], end[keep]
        if len(s) == 0:
            self.s = self.e = self.cum = np.zeros(0)
            return
        o = np.argsort(s, kind="stable")
        s, e = s[o], e[o]
        reach = np.maximum.accumulate(e)
        new = np.r_[True, s[1:] > reach[:-1]]
        first = np.flatnonzero(new)
        last = np.r_[first[1:] - 1, len(s) - 1]
        self.s, self.e = s[first], reach[last]
        self.cum = np.r_[0.0, np.cumsum(self.e - self.s)]

    def measure_to(self, t: np.ndarray) -> np.ndarray:
        """Measure of the union inside (-inf, t], elementwise."""
        t = np.asarray(t, dtype=np.float64)
        if len(self.s) == 0:
            return np.zeros_like(t)
        k = np.searchsorted(self.s, t, side="right") - 1
        kk = np.clip(k, 0, None)
        inside = np.clip(np.minimum(t, self.e[kk]) - self.s[kk], 0.0, None)
        return np.where(k < 0, 0.0, self.cum[kk] + inside)


def _kinds(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, kind, row) of every span, a collective wait also once more as _COMM_WAIT."""
    code = frame["category"].cat.codes.to_numpy().astype(np.int64)
    names = frame["name"].to_numpy()
    kind = code.copy()
    idle = np.flatnonzero(code == _IDLE)
    kind[idle] = _by_name(names[idle], lambda n: _IDLE_NAMES.get(n, _IDLE_OTHER), np.int64)
    comm = np.flatnonzero(code == _COMM)
    waits = comm[_by_name(names[comm], is_wait_name, bool)]
    rows = np.r_[np.arange(len(frame)), waits]
    kind = np.r_[kind, np.full(len(waits), _COMM_WAIT)]
    start = frame["start"].to_numpy()[rows]
    end = frame["end"].to_numpy()[rows]
    return start, end, kind, rows


def _by_name(names: np.ndarray, fn, dtype) -> np.ndarray:
    """``fn`` of each name, called once per distinct name (a trace repeats a few hundred names)."""
    if len(names) == 0:
        return np.zeros(0, dtype=dtype)
    uniq, inv = np.unique(names.astype(str), return_inverse=True)
    return np.array([fn(n) for n in uniq], dtype=dtype)[inv]


def _pipeline_allowed(tl: StepTimeline, pipeline: bool | None) -> bool:
    """``pipeline`` if given; else True unless the timeline's meta says the layout has pp == 1 (then
    microbatch numbers are gradient accumulation, and idle around them is no bubble)."""
    if pipeline is not None:
        return bool(pipeline)
    for key in ("parallel", "layout"):
        v = tl.meta.get(key)
        if isinstance(v, dict) and isinstance(v.get("pp"), int):
            return v["pp"] > 1
    return True


def _analyse(tl: StepTimeline, pipeline: bool | None = None) -> pd.DataFrame:
    """One row per (rank, step) with every figure the public functions select from."""
    cols = ["rank", "step", *CATEGORIES, "step_s", "comm_s", "exposed_s", "host_s", "rank_s", "bubble_s"]
    df = tl.frame
    windows = tl.step_times()
    if df.empty or windows.empty:
        return pd.DataFrame({c: pd.Series(dtype=np.int64 if c in ("rank", "step") else np.float64) for c in cols})
    allow_pp = _pipeline_allowed(tl, pipeline)
    start, end, kind, rows = _kinds(df)
    span_rank = df["rank"].to_numpy()[rows]
    busy_sel = np.isin(kind, _BUSY)
    busy_any = _Union(start[busy_sel], end[busy_sel])  # any rank working (all ranks share one clock)

    # Pipeline fill/drain edges: per (rank, step), the first start and last end of microbatched compute.
    mb = df[(df["microbatch"] >= 0) & df["category"].isin(("forward", "backward")) & (df["step"] >= 0)]
    edges = (mb.groupby(["rank", "step"], observed=True).agg(first=("start", "min"), last=("end", "max"))
             if allow_pp and not mb.empty else None)

    order = np.argsort(span_rank, kind="stable")
    start, end, kind, span_rank = start[order], end[order], kind[order], span_rank[order]
    out = []
    for r, g in windows.groupby("rank", sort=True):
        lo = np.searchsorted(span_rank, r, side="left")
        hi = np.searchsorted(span_rank, r, side="right")
        out.append(_analyse_rank(int(r), start[lo:hi], end[lo:hi], kind[lo:hi], g, edges, busy_any))
    res = pd.concat(out, ignore_index=True)
    return res[cols].sort_values(["rank", "step"], kind="stable").reset_index(drop=True)


def _analyse_rank(rank: int, s: np.ndarray, e: np.ndarray, kind: np.ndarray, windows: pd.DataFrame,
                  edges: pd.DataFrame | None, busy_any: _Union) -> pd.DataFrame:
    ws = windows["start"].to_numpy()
    we = windows["end"].to_numpy()
    steps = windows["step"].to_numpy()
    first, last = ws.copy(), we.copy()  # no pipeline: the whole window is "between microbatches"
    piped = np.zeros(len(steps), dtype=bool)
    if edges is not None:
        for i, st in enumerate(steps):
            key = (rank, int(st))
            if key in edges.index:
                first[i], last[i] = edges.at[key, "first"], edges.at[key, "last"]
                piped[i] = True
    b = np.unique(np.r_[s, e, ws, we, first, last])
    K = len(b) - 1
    if K <= 0:  # every span and window is one instant
        return pd.DataFrame({"rank": rank, "step": steps, **{c: 0.0 for c in CATEGORIES}, "step_s": we - ws,
                             "comm_s": 0.0, "exposed_s": 0.0, "host_s": 0.0, "rank_s": 0.0, "bubble_s": 0.0})
    # The sweep: +1 where a span of a kind starts, -1 where it ends; a cumulative sum counts the active
    # spans of each kind on each elementary segment [b[j], b[j+1]).
    size = len(b) * _N_KINDS
    cnt = (np.bincount(np.searchsorted(b, s) * _N_KINDS + kind, minlength=size)
           - np.bincount(np.searchsorted(b, e) * _N_KINDS + kind, minlength=size)).reshape(len(b), _N_KINDS)
    active = np.cumsum(cnt, axis=0)[:K] > 0
    seg = np.diff(b)
    working = active[:, :_CKPT + 1]
    any_work = working.any(axis=1)
    cat = np.where(any_work, working.argmax(axis=1), _IDLE)  # the first active category in priority order
    compute = active[:, _FWD] | active[:, _BWD] | active[:, _OPT]
    comm = active[:, _COMM]
    idle = cat == _IDLE
    bubble_named = idle & active[:, _IDLE_BUBBLE]
    rank_named = idle & ~bubble_named & active[:, _IDLE_RANK]
    host_named = idle & ~bubble_named & ~rank_named & active[:, _IDLE_HOST]
    implicit = idle & ~bubble_named & ~rank_named & ~host_named
    others_busy = busy_any.measure_to(b[1:]) - busy_any.measure_to(b[:-1])  # this rank is idle there
    measures = {
        **{c: np.where(cat == i, seg, 0.0) for i, c in enumerate(CATEGORIES)},
        "idle_unbubbled": np.where(idle & ~bubble_named, seg, 0.0),
        "comm_s": np.where(comm, seg, 0.0),
        "exposed_s": np.where(comm & ~compute, seg, 0.0),
        "bubble_named": np.where(bubble_named, seg, 0.0),
        "rank_named": np.where(rank_named, seg, 0.0),
        "host_named": np.where(host_named, seg, 0.0),
        "implicit": np.where(implicit, seg, 0.0),
        "implicit_busy": np.where(implicit, np.clip(others_busy, 0.0, seg), 0.0),
        "wait_exposed": np.where((cat == _COMM) & active[:, _COMM_WAIT], seg, 0.0),
    }
    iws, iwe = np.searchsorted(b, ws), np.searchsorted(b, we)
    ifi, ila = np.searchsorted(b, first), np.searchsorted(b, last)

    def total(name: str, i0: np.ndarray, i1: np.ndarray) -> np.ndarray:
        p = np.r_[0.0, np.cumsum(measures[name])]
        return p[i1] - p[i0]

    res = {"rank": np.full(len(steps), rank, dtype=np.int64), "step": steps.astype(np.int64)}
    for c in CATEGORIES:
        res[c] = total(c, iws, iwe)
    res["step_s"] = we - ws
    res["comm_s"] = total("comm_s", iws, iwe)
    res["exposed_s"] = total("exposed_s", iws, iwe)
    # A pipeline stage's fill and drain (before its first, after its last microbatch) is bubble whatever the
    # idle's name, and so is a blocking receive there; between them, the named reasons and the peers decide.
    fill_drain = sum(total(m, i0, i1) for m in ("idle_unbubbled", "wait_exposed") for i0, i1 in ((iws, ifi), (ila, iwe)))
    res["bubble_s"] = total("bubble_named", iws, iwe) + np.where(piped, fill_drain, 0.0)
    res["rank_s"] = total("rank_named", ifi, ila) + total("implicit_busy", ifi, ila) + total("wait_exposed", ifi, ila)
    res["host_s"] = total("host_named", ifi, ila) + total("implicit", ifi, ila) - total("implicit_busy", ifi, ila)
    return pd.DataFrame(res)


def _clean(df: pd.DataFrame) -> pd.DataFrame:
    """Rounding of prefix differences leaves -1e-17 for zero: clip tiny negatives to 0."""
    for c in df.columns:
        if df[c].dtype == np.float64:
            df[c] = df[c].mask(df[c].abs() < 1e-12, 0.0)
    return df


# --------------------------------------------------------------------------------------------------
# The analyses
# --------------------------------------------------------------------------------------------------


def _timeline(tl: Any) -> StepTimeline:
    if not isinstance(tl, StepTimeline):
        raise TypeError(f"expected a StepTimeline, got {type(tl).__name__}; load one with "
                        "workbench.time.load(path) or workbench.time.import_trace(path)")
    return tl


def breakdown(tl: StepTimeline) -> pd.DataFrame:
    """Seconds per rank, step and category, charged exclusively (see the module doc): columns
    ``rank, step, forward, backward, optimizer, communication, data, checkpoint, idle, step_s``; the
    categories of a row sum to ``step_s``."""
    return _clean(_analyse(_timeline(tl))[BREAKDOWN_COLUMNS])


def communication_overlap(tl: StepTimeline) -> pd.DataFrame:
    """Per rank and step: ``comm_s`` (time communicating), ``exposed_s`` (of it, not under compute),
    ``overlapped_s`` and ``exposed_fraction`` (0 for a step without communication)."""
    a = _analyse(_timeline(tl))
    out = a[["rank", "step", "comm_s", "exposed_s"]].copy()
    out["overlapped_s"] = out["comm_s"] - out["exposed_s"]
    out["exposed_fraction"] = np.where(out["comm_s"] > 0, out["exposed_s"] / out["comm_s"].where(out["comm_s"] > 0, 1),
                                       0.0)
    return _clean(out[OVERLAP_COLUMNS])


def idle_split(tl: StepTimeline, *, pipeline: bool | None = None) -> pd.DataFrame:
    """Per rank and step, waiting split into ``host_s``, ``rank_s`` and ``bubble_s`` (rules in the module
    doc). ``pipeline``: whether idle before the first / after the last microbatch is the pipeline bubble;
    None: yes when spans carry microbatch numbers, unless ``tl.meta`` says pp == 1."""
    return _clean(_analyse(_timeline(tl), pipeline)[IDLE_COLUMNS])


def stragglers(tl: StepTimeline, threshold: float = 0.05, *, by: str = "busy") -> pd.DataFrame:
    """Per rank: median ``step_s`` and ``busy_s`` over steps, the median rank's value of the compared
    measure (``by``: ``"busy"``, default, or ``"step"``) as ``median_s``, ``excess`` (relative: 0.10 is
    10 % over the median rank) and ``straggler`` (excess above ``threshold``)."""
    if by not in ("busy", "step"):
        raise ValueError(f"by={by!r}: compare ranks by 'busy' (their work) or 'step' (their step time)")
    if not (isinstance(threshold, (int, float)) and np.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold={threshold!r} must be a fraction >= 0, e.g. 0.05 for 5 % over the median rank")
    a = _analyse(_timeline(tl))
    if a.empty:
        return pd.DataFrame({c: pd.Series(dtype=bool if c == "straggler" else np.int64 if c == "rank" else np.float64)
                             for c in STRAGGLER_COLUMNS})
    a = a.assign(busy_s=a[["forward", "backward", "optimizer", "data", "checkpoint"]].sum(axis=1))
    per = a.groupby("rank", sort=True)[["step_s", "busy_s"]].median().reset_index()
    value = per["busy_s" if by == "busy" else "step_s"]
    med = float(np.median(value))
    per["median_s"] = med
    per["excess"] = (value - med) / med if med > 0 else 0.0
    per["straggler"] = per["excess"] > threshold
    per.attrs["by"] = by
    return _clean(per[STRAGGLER_COLUMNS])


# --------------------------------------------------------------------------------------------------
# Diff
# --------------------------------------------------------------------------------------------------

_DIFF_MEASURES = [*CATEGORIES, "step_s"]


def _per_rank(tl: StepTimeline) -> pd.DataFrame:
    """Mean seconds per step of each rank, per category and step_s (means keep the categories' sum)."""
    b = _analyse(tl)[BREAKDOWN_COLUMNS]
    return b.groupby("rank", sort=True)[_DIFF_MEASURES].mean()


def _label(tl: StepTimeline) -> str:
    return f"{tl.source} ({tl.device})"


@dataclass(eq=False)
class TimelineDiff(RendersInNotebook):
    """``b`` against ``a``, rank by rank: seconds per step in each category (mean over steps), their delta
    ``b - a``, and the ratio of the step times (``b / a``: above 1, ``b`` is slower).

    Ranks are matched by number; a prediction that simulated one representative per group of ranks
    maps every rank to its representative in ``meta["rank_map"]``, which is used when present.
    """

    a: StepTimeline
    b: StepTimeline
    rows: pd.DataFrame             # rank, b_rank, category, a_s, b_s, delta_s, ratio
    step_time_a_s: float
    step_time_b_s: float

    @property
    def step_time_ratio(self) -> float:
        return self.step_time_b_s / self.step_time_a_s if self.step_time_a_s > 0 else float("nan")

    def to_frame(self) -> pd.DataFrame:
        return self.rows.copy()

    def categories(self) -> pd.DataFrame:
        """Per category (and ``step_s``): mean over the matched ranks of ``a_s``, ``b_s`` and ``delta_s``."""
        g = self.rows.groupby("category", sort=False)[["a_s", "b_s", "delta_s"]].mean()
        return g.reindex(_DIFF_MEASURES).reset_index()

    def summary(self) -> dict[str, Any]:
        cats = self.categories().set_index("category")
        worst = cats.drop(index="step_s")["delta_s"]
        return {"a": _label(self.a), "b": _label(self.b), "step_time_a_s": self.step_time_a_s,
                "step_time_b_s": self.step_time_b_s, "step_time_ratio": _finite(self.step_time_ratio),
                "ranks": sorted(int(r) for r in self.rows["rank"].unique()),
                "largest_change": None if worst.abs().max() == 0 or worst.empty else str(worst.abs().idxmax())}

    def to_json(self) -> str:
        cats = {str(r.category): {"a_s": _finite(r.a_s), "b_s": _finite(r.b_s), "delta_s": _finite(r.delta_s)}
                for r in self.categories().itertuples(index=False)}
        rows = [{k: (_finite(v) if isinstance(v, float) else v) for k, v in rec.items()}
                for rec in self.rows.to_dict(orient="records")]
        return json.dumps({**self.summary(), "categories": cats, "rows": rows}, default=_plain)

    def __repr__(self) -> str:
        return (f"TimelineDiff({_label(self.a)} -> {_label(self.b)}: step {self.step_time_a_s * 1e3:.2f} ms -> "
                f"{self.step_time_b_s * 1e3:.2f} ms, x{self.step_time_ratio:.3f})")

    def _repr_html_(self) -> str:
        import html

        cats = self.categories()
        head = "".join(f"<th>{h}</th>" for h in ("category", "a (ms/step)", "b (ms/step)", "delta (ms)"))
        body = "".join(f"<tr><td>{html.escape(str(r.category))}</td><td>{r.a_s * 1e3:.3f}</td>"
                       f"<td>{r.b_s * 1e3:.3f}</td><td>{r.delta_s * 1e3:+.3f}</td></tr>"
                       for r in cats.itertuples(index=False))
        return (f"<div><b>TimelineDiff</b> {html.escape(_label(self.a))} &rarr; {html.escape(_label(self.b))}: "
                f"step {self.step_time_a_s * 1e3:.2f} ms &rarr; {self.step_time_b_s * 1e3:.2f} ms "
                f"(&times;{self.step_time_ratio:.3f}; mean over ranks)<table><tr>{head}</tr>{body}</table></div>")


def diff(a: StepTimeline, b: StepTimeline) -> TimelineDiff:
    """Compare two timelines (two runs, a run and its prediction): per rank and category, and step time."""
    a, b = _timeline(a), _timeline(b)
    pa, pb = _per_rank(a), _per_rank(b)
    if pa.empty or pb.empty:
        which = "first" if pa.empty else "second"
        raise ValueError(f"the {which} timeline has no spans inside a step (step >= 0); nothing to compare")
    rank_map = b.meta.get("rank_map") if isinstance(b.meta.get("rank_map"), dict) else {}
    recs = []
    for r in pa.index:
        rb = rank_map.get(str(r), r)
        if not isinstance(rb, int) or rb not in pb.index:
            continue
        for c in _DIFF_MEASURES:
            va, vb = float(pa.at[r, c]), float(pb.at[rb, c])
            recs.append({"rank": int(r), "b_rank": int(rb), "category": c, "a_s": va, "b_s": vb, "delta_s": vb - va,
                         "ratio": vb / va if va > 0 else float("nan")})
    if not recs:
        raise ValueError(f"the two timelines share no rank (first: {a.ranks}, second: {b.ranks}); compare "
                         "timelines of the same job, or select matching ranks")
    rows = pd.DataFrame(recs, columns=["rank", "b_rank", "category", "a_s", "b_s", "delta_s", "ratio"])
    return TimelineDiff(a, b, rows, a.step_time(), b.step_time())


def _finite(x: Any) -> Any:
    x = float(x)
    return x if np.isfinite(x) else None


def _plain(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return _finite(o)
    if isinstance(o, np.bool_):
        return bool(o)
    return str(o)
