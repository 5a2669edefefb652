"""Run answers: the events of a run directory not yet seen, its status and summary, step series, its
checkpoints, and one pipeline step's measured schedule (pp > 1)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from workbench import safeio
from workbench.jupyter.files import FileCache, Refused, inside, refusal, relative
from workbench.train.events import memory_summary

__all__ = ["run_events", "run_pipeline", "run_checkpoints"]

_RUNS = FileCache(16)


class _RunState:
    """Events read so far from one run's events.jsonl; each request reads only what was appended.
    Damaged lines are skipped and counted by the reader (``reader.skipped``: the summary's ``skipped_lines``)."""

    def __init__(self, run_dir: Path):
        from workbench.train.events import EventReader

        self.run_dir = run_dir
        self.reader = EventReader(run_dir)
        self.events: list[dict] = []
        self.lock = threading.Lock()

    def refresh(self) -> list[dict]:
        from workbench.train.events import EventReader

        with self.lock:
            new = self.reader.read_new()
            if self.reader.replaced:  # a new launch into the same directory: follow it from its start
                self.reader, self.events = EventReader(self.run_dir), []
                new = self.reader.read_new()
            self.events.extend(new)
            return self.events


_STEP_FIELDS = ("loss", "tokens_per_s", "step_time_s", "mem_bytes", "peak_mem_bytes", "grad_norm", "lr")
_MAX_FIELDS = ("mem_bytes", "peak_mem_bytes")  # a bin's memory is its largest, so no peak is averaged away
def _step_series(events: list[dict], points: int) -> dict[str, dict[str, list]]:
    """Per rank, the step metrics in at most ``points`` points: bins of equal count, each the mean of its
    steps (``mem_bytes``: the max), at the bin's last step."""
    per: dict[int, list[dict]] = {}
    for e in events:
        if e.get("type") == "step":
            per.setdefault(int(e.get("rank", 0)), []).append(e)
    out = {}
    for rank, steps in sorted(per.items()):
        n = len(steps)
        nb = min(n, max(1, points))
        edges = np.linspace(0, n, nb + 1).astype(np.int64)
        series: dict[str, list] = {"step": []}
        for f in _STEP_FIELDS:
            series[f] = []
        for a, b in zip(edges[:-1], edges[1:]):
            if b <= a:
                continue
            chunk = steps[a:b]
            series["step"].append(int(chunk[-1].get("step", b - 1)))
            for f in _STEP_FIELDS:
                vals = [float(e[f]) for e in chunk if isinstance(e.get(f), (int, float))]
                series[f].append(None if not vals else (max(vals) if f in _MAX_FIELDS else sum(vals) / len(vals)))
        out[str(rank)] = series
    return out


def _run_summary(run_dir: Path, events: list[dict]) -> dict[str, Any]:
    from workbench.train.events import LAUNCHER_RANK

    out: dict[str, Any] = {"status": "running"}
    try:  # the run's own config.json: not a link out of the run, a regular file of a few MiB at most
        job = safeio.read_json(safeio.confine(run_dir, "config.json", run_dir, "run config"), 4 << 20, "run config")
    except safeio.FileRefused as e:
        job = None
        if e.reason != "missing":
            out["config_error"] = f"config.json: {e.problem}"
    if job is not None:
        try:
            if not isinstance(job, dict):
                raise AttributeError("not an object")
            out["model"] = (job.get("model") or {}).get("name")
            par = job.get("parallel") or {}
            try:
                from workbench.config import ParallelConfig

                out["layout"] = ParallelConfig.from_dict(par).describe()
            except (ValueError, TypeError, KeyError):
                out["layout"] = None
            out["steps_planned"] = (job.get("train") or {}).get("steps")
        except AttributeError:
            out["config_error"] = "config.json is not a run's config (not an object of settings)"
    steps = [e for e in events if e.get("type") == "step"]
    errors = [e for e in events if e.get("type") == "error"]
    end = next((e for e in reversed(events) if e.get("type") == "run_end" and e.get("rank") == LAUNCHER_RANK), None)
    if end is not None:
        out["status"] = end.get("status", "failed")
    elif errors:
        out["status"] = "failed"
    if steps:
        r0 = min(int(e.get("rank", 0)) for e in steps)
        mine = [e for e in steps if int(e.get("rank", 0)) == r0]
        out["steps_logged"] = len({e.get("step") for e in steps})
        out["first_loss"], out["final_loss"] = mine[0].get("loss"), mine[-1].get("loss")
        out["last_step"] = max(int(e.get("step", 0)) for e in steps)
    memory = memory_summary(events)  # peak_mem_bytes: the recorded peak; rss_bytes: the resident set, labelled
    out.update({k: v for k, v in memory.items() if k != "stages"})
    out["ranks"] = sorted({int(e["rank"]) for e in events if isinstance(e.get("rank"), int) and e["rank"] >= 0})
    out["checkpoints"] = [e.get("step") for e in events if e.get("type") == "checkpoint"]
    pipe = next((e for e in events if e.get("type") == "pipeline"), None)
    if pipe is not None:
        out["pipeline"] = {"schedule": pipe.get("schedule"), "microbatches": pipe.get("microbatches"),
                           "stages": memory.get("stages", [])}
    if errors:
        first = min(errors, key=lambda e: e.get("time", 0))
        msg = str(first.get("message") or "").strip()
        if not msg:
            tb = str(first.get("traceback") or "").strip().splitlines()
            msg = tb[-1] if tb else "error"
        out["error"] = {"rank": first.get("rank"), "message": msg.splitlines()[0][:300]}
    return out


def _run_dir(root: Path, p: Path) -> Path:
    """The run directory of ``p`` (itself, or the directory of its events.jsonl), once its events.jsonl is
    known to be its own: a regular file inside it, not a link out of the run or the root (then, like a
    missing one, 404) and not a FIFO (whose open would block a server thread)."""
    run_dir = p if p.is_dir() else p.parent
    missing = Refused(404, f"{relative(root, run_dir)}: has no events.jsonl; open a run directory written by "
                      "workbench train / workbench.launch")
    try:
        safeio.regular_size(safeio.confine(run_dir, "events.jsonl", run_dir, "event log"), "event log")
    except safeio.FileRefused as e:
        if e.reason in ("missing", "outside"):
            raise missing from None
        raise Refused(422, f"{relative(root, run_dir)}/events.jsonl: {e.problem}; {e.fix}") from None
    return run_dir


def _events_of(root: Path, run_dir: Path) -> tuple[list[dict], "_RunState"]:
    """The run's events so far (and its state, for the count of damaged lines), or :class:`Refused`: its
    events.jsonl is not a regular file inside the run (swapped since :func:`_run_dir` looked), or none of
    its lines is an event."""
    from workbench.train.events import NOT_A_LOG_FIX

    state = _RUNS.get((str(run_dir),), lambda: _RunState(run_dir))
    try:
        events = state.refresh()
    except safeio.FileRefused as e:
        raise refusal(e, root) from None
    if state.reader.not_a_log:
        raise Refused(422, f"{relative(root, run_dir)}/events.jsonl: {state.reader.not_a_log}; {NOT_A_LOG_FIX}")
    return events, state


def run_checkpoints(root: Path, run_dir: Path, events: list[dict]) -> list[dict[str, Any]]:
    """The run's checkpoints, by path (what JupyterLab's file browser cannot open: it does not enter a
    folder named ``checkpoints``): the published ``step-*`` directories of ``RUN_DIR/checkpoints`` and
    those its ``checkpoint`` events name (a run may save elsewhere), under the root and still on disk."""
    from workbench.checkpoint.store import CheckpointStore, parse_step

    found: dict[str, dict[str, Any]] = {}
    try:  # the run's checkpoints/, not a link out of the run: nothing outside the root is listed
        store = CheckpointStore(safeio.confine(run_dir, "checkpoints", run_dir, "checkpoint directory"))
    except safeio.FileRefused:
        store = None
    latest = store.latest_pointer() if store is not None else None
    for step in store.steps() if store is not None else ():
        d = store.path(step)
        if not inside(root, d):  # a step directory linked to outside the root
            continue
        found[str(d.resolve())] = {"step": step, "path": relative(root, d), "latest": d.name == latest}
    for e in events:
        if e.get("type") != "checkpoint" or not isinstance(e.get("path"), str):
            continue
        d = Path(e["path"])
        d = d if d.is_absolute() else root / d
        try:  # nothing outside is even looked at
            if not (inside(root, d) and d.is_dir()) or str(d.resolve()) in found:
                continue
        except ValueError:  # a path no file can have (a NUL, a lone surrogate): what a damaged event names
            continue
        found[str(d.resolve())] = {"step": e.get("step", parse_step(d.name)), "path": relative(root, d),
                                   "latest": False}
    return sorted(found.values(), key=lambda c: (c["step"] is None, c["step"] or 0, c["path"]))


def run_pipeline(root: Path, p: Path, step: int | None = None) -> dict[str, Any]:
    """One pipeline step's measured schedule, for the timeline: a row per (stage, rank), a bar per forward
    and backward, in ms from the step's first forward; the measured bubble against (p-1)/(v m+p-1)."""
    from workbench.parallel.pipeline_bubble import (bubble_fraction, pipeline_step, pipeline_steps, schedule_frame,
                                                    schedule_shape, theoretical_bubble)

    run_dir = _run_dir(root, p)
    events, _ = _events_of(root, run_dir)
    rel = relative(root, run_dir)
    try:  # the last step every pipeline rank reported, unless ``step`` names a complete one
        step = pipeline_step(events, step)
    except ValueError as e:
        if "no schedule events" in str(e):
            raise Refused(404, f"{rel}: has no schedule events; they are written by pipeline runs (pp > 1)") from None
        if step is None:
            raise Refused(404, f"{rel}: {e}; refresh in a moment") from None
        raise Refused(404, f"{rel}: {e}") from None
    done = pipeline_steps(events)
    in_step = [e for e in events if e.get("type") == "schedule" and e.get("step") == step]
    frame = schedule_frame(in_step)
    pp, m, v = schedule_shape(frame)
    t0 = float(frame["start"].min())
    bars = [{"stage": int(r.stage), "rank": int(r.rank), "microbatch": int(r.microbatch), "phase": str(r.phase),
             "start_ms": (float(r.start) - t0) * 1e3, "end_ms": (float(r.end) - t0) * 1e3}
            for r in frame.sort_values(["stage", "start"]).itertuples()]
    schedule = next((e.get("schedule") for e in events if e.get("type") == "pipeline"), None)
    return {"path": rel, "step": step, "steps": done, "schedule": schedule, "pp": pp, "microbatches": m,
            "stages_per_rank": v, "bubble_measured": bubble_fraction(in_step, skip_first=False),
            "bubble_theory": theoretical_bubble(pp, m, v),
            "rows": [{"stage": s, "rank": r} for s, r in sorted({(b["stage"], b["rank"]) for b in bars})],
            "span_ms": max(b["end_ms"] for b in bars), "bars": bars}


def run_events(root: Path, p: Path, since: int = 0, types: list[str] | None = None, limit: int = 5000,
               points: int = 0) -> dict[str, Any]:
    run_dir = _run_dir(root, p)
    events, state = _events_of(root, run_dir)
    n = len(events)
    since = min(since, n)
    nxt = min(n, since + limit)
    chunk = events[since:nxt]
    if types:
        chunk = [e for e in chunk if e.get("type") in types]
    out = {"path": relative(root, run_dir), "total": n, "since": since, "next": nxt, "events": chunk,
           "summary": _run_summary(run_dir, events), "checkpoints": run_checkpoints(root, run_dir, events)}
    # damaged lines (a torn last line of a killed run, a flipped bit) are skipped, and the view says how many
    out["summary"]["skipped_lines"] = state.reader.skipped
    if state.reader.first_damage:
        out["summary"]["first_skipped"] = state.reader.first_damage
    out["status"] = out["summary"]["status"]
    if points > 0:
        out["series"] = _step_series(events, points)
    return out
