"""Run answers: the events of a run directory not yet seen, its status and summary, step series."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from workbench.jupyter.files import FileCache, Refused, relative

__all__ = ["run_events"]

_RUNS = FileCache(16)


class _RunState:
    """Events read so far from one run's events.jsonl; each request reads only what was appended."""

    def __init__(self, run_dir: Path):
        from workbench.train.events import EventReader

        self.run_dir = run_dir
        self.reader = EventReader(run_dir)
        self.events: list[dict] = []
        self.size = 0
        self.lock = threading.Lock()

    def refresh(self) -> list[dict]:
        from workbench.train.events import EventReader

        with self.lock:
            f = self.run_dir / "events.jsonl"
            size = f.stat().st_size if f.exists() else 0
            if size < self.size:  # rewritten (a new launch into the same directory): start over
                self.reader, self.events = EventReader(self.run_dir), []
            self.size = size
            self.events.extend(self.reader.read_new())
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
    if errors:
        first = min(errors, key=lambda e: e.get("time", 0))
        msg = str(first.get("message") or "").strip()
        if not msg:
            tb = str(first.get("traceback") or "").strip().splitlines()
            msg = tb[-1] if tb else "error"
        out["error"] = {"rank": first.get("rank"), "message": msg.splitlines()[0][:300]}
    return out


def run_events(root: Path, p: Path, since: int = 0, types: list[str] | None = None, limit: int = 5000,
               points: int = 0) -> dict[str, Any]:
    run_dir = p if p.is_dir() else p.parent
    if not (run_dir / "events.jsonl").is_file():
        raise Refused(404, f"{relative(root, run_dir)}: has no events.jsonl; open a run directory written by "
                      "workbench train / workbench.launch")
    st = _RUNS.get((str(run_dir),), lambda: _RunState(run_dir))
    events = st.refresh()
    n = len(events)
    since = min(since, n)
    nxt = min(n, since + limit)
    chunk = events[since:nxt]
    if types:
        chunk = [e for e in chunk if e.get("type") in types]
    out = {"path": relative(root, run_dir), "total": n, "since": since, "next": nxt, "events": chunk,
           "summary": _run_summary(run_dir, events)}
    out["status"] = out["summary"]["status"]
    if points > 0:
        out["series"] = _step_series(events, points)
    return out
