"""Step timelines in JupyterLab: a profiler trace (``*.pt.trace.json(.gz)``), a folder of per-rank traces
(``RUN_DIR/profile/``) or a saved step timeline, read once and answered one step at a time.

What the tab draws is what ``StepTimelineView`` draws of the same timeline, computed by the timeline's own
methods: one row per rank and lane (compute above, communication below), the bars of
:meth:`StepTimeline.bars` (so 10^5 spans arrive as a few thousand bars), the seconds per category of
:meth:`StepTimeline.totals`, the step times of ``step_times``, and the colours of
:data:`workbench.palette.TIME_COLORS`; stragglers and exposed communication come from
:mod:`workbench.time.analysis` when it is installed. Traces are read by ``workbench.time.import_trace``
(bounded and confined like every reader here: nothing outside the server's root is opened).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from workbench import palette
from workbench.jupyter.files import FileCache, Refused, relative, stamp

__all__ = ["trace_kind", "time_answer", "MAX_SPANS"]

MAX_SPANS = 4_000_000  # spans read of one trace or folder, at most
MAX_ROWS = 64  # ranks drawn
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
_cache = FileCache(4)


def _is_trace(p: Path) -> bool:
    return p.name.endswith(TRACE_SUFFIXES)


def trace_kind(root: Path, p: Path) -> str | None:
    """``"trace"`` (one profiler trace file), ``"profile"`` (a folder holding per-rank traces, or a run
    directory's ``profile/``), ``"step_timeline"`` (a ``StepTimeline.save`` file or folder), else None.
    From names only, and the first bytes of a ``.json`` that could be a saved step timeline."""
    if p.is_file():
        if _is_trace(p):
            return "trace"
        if p.suffix == ".json" and p.stat().st_size > 0:
            from workbench.safeio import open_regular

            with open_regular(p, "step timeline") as f:
                head = f.read(4096)
            if b'"workbench.step_timeline"' in head:
                return "step_timeline"
        return None
    if p.is_dir():
        if (p / "step_timeline.json").is_file() and trace_kind(root, p / "step_timeline.json"):
            return "step_timeline"
        try:  # the reader's own rule for which files of a folder are traces (rank<r>.pt.trace.json.gz, Kineto's)
            from workbench.time.trace import find_traces
        except ImportError:
            return "profile" if any(d.is_dir() and any(_is_trace(q) and q.is_file() for q in _first(d))
                                    for d in (p, p / "profile")) else None
        try:
            find_traces(p)
            return "profile"
        except ValueError:
            return None
    return None


def _first(d: Path, n: int = 4096) -> list[Path]:
    out = []
    for i, q in enumerate(d.iterdir()):
        if i >= n:
            break
        out.append(q)
    return out


def _load(root: Path, p: Path) -> Any:
    kind = trace_kind(root, p)
    if kind is None:
        raise Refused(422, f"{relative(root, p)}: not a profiler trace (*.pt.trace.json[.gz]), a folder of them or "
                      "a saved step timeline; record one with `workbench train ... --profile 2`")
    from workbench.time.timeline import StepTimeline

    if kind == "step_timeline":
        try:
            return StepTimeline.load(p)
        except ValueError as e:
            raise Refused(422, str(e).replace(str(root) + "/", "")) from None
    try:
        trace = importlib.import_module("workbench.time.trace")
    except ImportError:
        raise Refused(422, "this workbench cannot read profiler traces (workbench.time.trace is missing); "
                      "install a release that has it") from None
    try:  # a folder: its traces, or its profile/ folder's (import_trace looks there)
        return trace.import_trace(p, max_spans=MAX_SPANS)
    except ValueError as e:
        raise Refused(422, f"{relative(root, p)}: {str(e).replace(str(root) + '/', '')}") from None


def _analysis() -> Any | None:
    try:
        return importlib.import_module("workbench.time.analysis")
    except ImportError:
        return None


def time_answer(root: Path, p: Path, step: int | None = None, bars: int = 1500) -> dict[str, Any]:
    """What the JupyterLab step-time tab draws (see ``handlers``: ``GET time/timeline``)."""
    tl = _cache.get((str(p.resolve()), stamp(p)), lambda: _load(root, p))
    from workbench.time.timeline import CATEGORIES

    steps = tl.steps
    if step is None:
        step = steps[-1] if steps else -1
    if step >= 0 and step not in steps:
        raise Refused(404, f"step {step} is not in {relative(root, p)}; its steps are {steps}")
    ranks = tl.ranks[:MAX_ROWS]
    shown = tl.select(step=step) if step >= 0 else tl
    shown = shown._new(shown.frame[shown.frame["rank"].isin(ranks)])
    b = shown.bars(bars)
    t0 = float(shown.frame["start"].min()) if len(shown) else 0.0
    lanes = []
    for r in ranks:
        lanes.append({"rank": r, "lane": "compute", "label": f"rank {r}"})
        if ((b["rank"] == r) & (b["category"] == "communication")).any():
            lanes.append({"rank": r, "lane": "comm", "label": f"rank {r} · comm"})
    row_of = {(x["rank"], x["lane"]): i for i, x in enumerate(lanes)}
    out_bars = [{"row": row_of[(int(r), "comm" if c == "communication" else "compute")], "category": c,
                 "start_ms": (s - t0) * 1e3, "end_ms": (e - t0) * 1e3, "name": str(n), "spans": int(k),
                 "busy_ms": busy * 1e3}
                for r, c, s, e, n, k, busy in zip(b["rank"], b["category"], b["start"], b["end"], b["name"],
                                                  b["spans"], b["busy_s"])
                if (int(r), "comm" if c == "communication" else "compute") in row_of]
    tot = shown.totals()
    st = tl.step_times()
    if step >= 0:
        st = st[st["step"] == step]
    step_ms = (st.groupby("rank")["step_s"].median() * 1e3).to_dict()
    per = 1 if step >= 0 else max(1, len(steps))
    totals = [{"rank": r, "step_ms": step_ms.get(r), **{c: float(tot.loc[r, c]) * 1e3 / per if r in tot.index else 0.0
                                                          for c in CATEGORIES}} for r in ranks]
    an = _analysis()
    stragglers = None
    if an is not None and steps:
        s = an.stragglers(shown if step >= 0 else tl)
        stragglers = [{"rank": int(x.rank), "excess": float(x.excess), "straggler": bool(x.straggler)}
                      for x in s.itertuples()]
        ov = an.communication_overlap(shown if step >= 0 else tl)
        exposed = (ov.groupby("rank")["exposed_s"].median() * 1e3).to_dict()
        for t in totals:
            t["exposed_comm_ms"] = exposed.get(t["rank"])
    return {"path": relative(root, p), "source": tl.source, "device": tl.device, "ranks": tl.ranks,
            "ranks_shown": ranks, "steps": steps, "step": step, "spans": len(tl), "spans_shown": len(shown),
            "categories": list(CATEGORIES), "colors": dict(palette.TIME_COLORS), "unit": "ms",
            "rows": lanes, "bars": out_bars, "totals": totals, "stragglers": stragglers,
            "step_time_ms": tl.step_time() * 1e3 if steps else None, "meta": {k: v for k, v in tl.meta.items()
                                                                              if type(v) in (str, int, float, bool)}}
