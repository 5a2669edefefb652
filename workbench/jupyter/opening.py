"""``open``: what a path is and which view opens it, from headers only (nothing is unpickled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.jupyter.checkpoints import manifest_of
from workbench.jupyter.files import Refused, inside, read_json, relative
from workbench.jupyter.plans import looks_like_plan
from workbench.jupyter.steptimes import trace_kind
from workbench.jupyter.timelines import warm

__all__ = ["open_info", "is_run_dir"]


def is_run_dir(p: Path, root: Path | None = None) -> bool:
    """A directory with an events.jsonl of its own (with ``root``: one that does not lead out of it; what
    lies outside is not even looked at)."""
    log = p / "events.jsonl"
    return p.is_dir() and (root is None or inside(root, log)) and log.is_file()


def open_info(root: Path, p: Path) -> dict[str, Any]:
    """``{"path", "view", "format", "name", ...}``: which view opens ``p`` (see handlers' docstring)."""
    from workbench.memory.snapshot import identify_memory_file

    rel = relative(root, p)
    base = {"path": rel, "name": p.name, "is_dir": p.is_dir()}
    if is_run_dir(p, root) or (p.is_file() and p.name == "events.jsonl"):
        run = p if p.is_dir() else p.parent
        out = {**base, "view": "run", "format": "run", "run": relative(root, run)}
        if inside(root, run / "checkpoints") and (run / "checkpoints").is_dir():
            out["checkpoints"] = relative(root, run / "checkpoints")
        return out
    kind = trace_kind(root, p)  # a profiler trace, a folder of them, a saved step timeline: the step-time tab
    if kind is not None:
        return {**base, "view": "time", "format": kind, **({"bytes": p.stat().st_size} if p.is_file() else {})}
    if p.is_file() and p.suffix in (".pickle", ".pkl"):
        kind = identify_memory_file(p)
        if kind == "snapshot":
            warm(root, p)
            return {**base, "view": "snapshot", "format": "snapshot", "bytes": p.stat().st_size}
        raise Refused(422, f"{rel}: not a torch memory snapshot (no 'segments'/'device_traces' in its header; "
                      "it was not unpickled); open a file written by torch.cuda.memory._dump_snapshot()")
    if p.is_file() and p.suffix == ".json" and not p.name.endswith(".safetensors.index.json") \
            and p.name != "workbench.json":
        kind = identify_memory_file(p)
        if kind == "profiler":
            return {**base, "view": "snapshot", "format": "profiler", "bytes": p.stat().st_size}
        doc = read_json(p)
        if looks_like_plan(doc):  # (its summary an object: what the plan view checks in full when it opens)
            s = doc["summary"]
            shown = {k: v for k, v in (("model", s.get("model_name")), ("layout", s.get("layout")),
                                       ("world_size", s.get("world_size"))) if type(v) in (str, int)}
            return {**base, "view": "plan", "format": "plan", "model": None, "layout": None, "world_size": None,
                    **shown}
        raise Refused(422, f"{rel}: a JSON file that is not a workbench plan (needs summary, parallel and "
                      "tensors); write one with `workbench plan MODEL --json > plan.json` or ShardingPlan.to_json()")
    if p.is_dir() and identify_memory_file(p) is not None and not (p / ".metadata").exists():
        return {**base, "view": "snapshot", "format": identify_memory_file(p)}
    m = manifest_of(root, p)  # checkpoints: headers and metadata only, so opening one also validates it
    s = m.summary()
    return {**base, "view": "checkpoint", "format": m.format, "checkpoint": relative(root, m.path),
            "step": s["step"], "n_tensors": s["n_tensors"], "total_bytes": s["total_bytes"]}
