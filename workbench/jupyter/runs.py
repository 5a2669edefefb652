"""Run answers: the events of a run directory not yet seen, its status and summary, step series, its
checkpoints, and one pipeline step's measured schedule (pp > 1)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from workbench.jupyter.files import FileCache, Refused, inside, relative

__all__ = ["run_events", "run_pipeline", "run_checkpoints"]

_RUNS = FileCache(16)


class _RunState:
    """Events read so far from one run's events.jsonl; each request reads only what was appended."""

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


_STEP_FIELDS = ("loss", "tokens_per_s", "step_time_s", "mem_bytes", "grad_norm", "lr")


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
                series[f].append(None if not vals else (max(vals) if f == "mem_bytes" else sum(vals) / len(vals)))
        out[str(rank)] = series
    return out


def _run_summary(run_dir: Path, events: list[dict]) -> dict[str, Any]:
    from workbench.train.events import LAUNCHER_RANK

    out: dict[str, Any] = {"status": "running"}
    cfg = run_dir / "config.json"
    if cfg.is_file() and cfg.stat().st_size < (4 << 20):
        try:
            job = json.loads(cfg.read_text())
            out["model"] = (job.get("model") or {}).get("name")
            par = job.get("parallel") or {}
            try:
                from workbench.config import ParallelConfig

                out["layout"] = ParallelConfig.from_dict(par).describe()
            except (ValueError, TypeError, KeyError):
                out["layout"] = None
            out["steps_planned"] = (job.get("train") or {}).get("steps")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            out["config_error"] = "config.json is not valid JSON"
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
        mem = [e["mem_bytes"] for e in steps if isinstance(e.get("mem_bytes"), (int, float))]
        if mem:
            out["peak_mem_bytes"] = int(max(mem))
    out["ranks"] = sorted({int(e["rank"]) for e in events if isinstance(e.get("rank"), int) and e["rank"] >= 0})
    out["checkpoints"] = [e.get("step") for e in events if e.get("type") == "checkpoint"]
    pipe = next((e for e in events if e.get("type") == "pipeline"), None)
    if pipe is not None:
        out["pipeline"] = {"schedule": pipe.get("schedule"), "microbatches": pipe.get("microbatches")}
    if errors:
        first = min(errors, key=lambda e: e.get("time", 0))
        msg = str(first.get("message") or "").strip()
        if not msg:
            tb = str(first.get("traceback") or "").strip().splitlines()
            msg = tb[-1] if tb else "error"
        out["error"] = {"rank": first.get("rank"), "message": msg.splitlines()[0][:300]}
    return out


def _run_dir(root: Path, p: Path) -> Path:
    run_dir = p if p.is_dir() else p.parent
    if not (run_dir / "events.jsonl").is_file():
        raise Refused(404, f"{relative(root, run_dir)}: has no events.jsonl; open a run directory written by "
                      "workbench train / workbench.launch")
    return run_dir


def _events_of(run_dir: Path) -> list[dict]:
    return _RUNS.get((str(run_dir),), lambda: _RunState(run_dir)).refresh()


def run_checkpoints(root: Path, run_dir: Path, events: list[dict]) -> list[dict[str, Any]]:
    """The run's checkpoints, by path (what JupyterLab's file browser cannot open: it does not enter a
    folder named ``checkpoints``): the published ``step-*`` directories of ``RUN_DIR/checkpoints`` and
    those its ``checkpoint`` events name (a run may save elsewhere), under the root and still on disk."""
    from workbench.checkpoint.store import CheckpointStore, parse_step

    store = CheckpointStore(run_dir / "checkpoints")
    found: dict[str, dict[str, Any]] = {}
    latest = store.latest_pointer()
    for step in store.steps():
        d = store.path(step)
        if not inside(root, d):  # a step directory linked to outside the root
            continue
        found[str(d.resolve())] = {"step": step, "path": relative(root, d), "latest": d.name == latest}
    for e in events:
        if e.get("type") != "checkpoint" or not isinstance(e.get("path"), str):
            continue
        d = Path(e["path"])
        d = d if d.is_absolute() else root / d
        if d.is_dir() and inside(root, d) and str(d.resolve()) not in found:
            found[str(d.resolve())] = {"step": e.get("step", parse_step(d.name)), "path": relative(root, d),
                                       "latest": False}
    return sorted(found.values(), key=lambda c: (c["step"] is None, c["step"] or 0, c["path"]))


def run_pipeline(root: Path, p: Path, step: int | None = None) -> dict[str, Any]:
    """One pipeline step's measured schedule, for the timeline: a row per (stage, rank), a bar per forward
    and backward, in ms from the step's first forward; the measured bubble against (p-1)/(v m+p-1)."""
    from workbench.parallel.pipeline_bubble import (bubble_fraction, pipeline_step, pipeline_steps, schedule_frame,
                                                    schedule_shape, theoretical_bubble)

    run_dir = _run_dir(root, p)
    events = _events_of(run_dir)
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
    events = _events_of(run_dir)
    n = len(events)
    since = min(since, n)
    nxt = min(n, since + limit)
    chunk = events[since:nxt]
    if types:
        chunk = [e for e in chunk if e.get("type") in types]
    out = {"path": relative(root, run_dir), "total": n, "since": since, "next": nxt, "events": chunk,
           "summary": _run_summary(run_dir, events), "checkpoints": run_checkpoints(root, run_dir, events)}
    out["status"] = out["summary"]["status"]
    if points > 0:
        out["series"] = _step_series(events, points)
    return out
