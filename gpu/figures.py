"""What gpu/check.py reads back from its commands: their JSON documents, events and JUnit files, made into
the summary's figures. Standard library only; every file read is one the check's own commands wrote."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def find(meta: dict[str, Any], key: str) -> Any:
    """``key`` at the top of a timeline's rank JSON or in its ``meta``."""
    return meta.get(key, meta.get("meta", {}).get(key) if isinstance(meta.get("meta"), dict) else None)


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed run
            if isinstance(e, dict):
                out.append(e)
    return out


def rank0_peak(doc: dict[str, Any]) -> int:
    """Rank 0's peak from a `workbench memory import|show --json` document (``peaks``: one record per rank)."""
    return int(next(r["peak_bytes"] for r in doc["peaks"] if r["rank"] == 0))


def measured_peaks(run_dir: Path) -> dict[str, Any]:
    steps = [e for e in events(run_dir) if e.get("type") == "step" and e.get("rank") == 0]
    alloc = [e["mem_bytes"] for e in steps if isinstance(e.get("mem_bytes"), int)]
    reserved = [e["mem_reserved_bytes"] for e in steps if isinstance(e.get("mem_reserved_bytes"), int)]
    return {"steps": len(steps), "allocated_bytes": max(alloc) if alloc else None,
            "reserved_bytes": max(reserved) if reserved else None}


def run_phases(run_dir: Path) -> dict[str, Any]:
    """Where a short run's wall time went, from its events: launch -> rank 0's start (interpreters,
    process group, model build), start -> its first step's end (that step's warm-up included)."""
    ev = events(run_dir)
    t = {e["type"]: e["time"] for e in reversed(ev) if e.get("rank") in (0, -1) and isinstance(e.get("time"), float)}
    first = next((e["time"] for e in ev if e.get("type") == "step" and e.get("rank") == 0), None)
    out: dict[str, Any] = {}
    if "launch" in t and "start" in t:
        out["launch_to_start_s"] = round(t["start"] - t["launch"], 2)
    if "start" in t and first is not None:
        out["start_to_first_step_s"] = round(first - t["start"], 2)
    return out


def junit(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes from pytest's JUnit XML (our own run's file)."""
    if not path.exists():
        return {"tests": {}}
    tests: dict[str, Any] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else None
                break
        tests[case.get("name", "?")] = {"outcome": outcome, "seconds": round(float(case.get("time") or 0), 1),
                                        "message": message}
    counts = {k: sum(1 for t in tests.values() if t["outcome"] == v)
              for k, v in (("passed", "passed"), ("failed", "failed"), ("errors", "error"), ("skipped", "skipped"))}
    return {**counts, "tests": tests}


def verbose(text: str) -> dict[str, Any]:
    """Per-test outcomes from pytest's -v lines (``tests/test_gpu.py::name PASSED``, with xdist
    ``[gw0] PASSED tests/test_gpu.py::name``), for a run stopped before it wrote its JUnit file."""
    tests: dict[str, Any] = {}
    for line in text.splitlines():
        words = line.replace("[", " [").split()
        node = next((w for w in words if "::" in w), None)
        outcome = next((w.lower() for w in words if w in ("PASSED", "FAILED", "SKIPPED", "ERROR")), None)
        if node and outcome:
            tests[node.split("::", 1)[1]] = {"outcome": outcome, "seconds": None, "message": None}
    counts = {k: sum(1 for t in tests.values() if t["outcome"] == v)
              for k, v in (("passed", "passed"), ("failed", "failed"), ("errors", "error"), ("skipped", "skipped"))}
    return {**counts, "tests": tests, "from": "pytest -v lines (no JUnit file: the run was stopped)"}


def gpu_train_figures(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    if doc.get("skipped"):
        return {"skipped": doc.get("reason")}
    m = doc.get("modes", {}).get(mode, {})
    keep = ("tokens_per_s", "step_time_s", "mfu", "mfu_6n", "mfu_reported", "peak_mem_bytes", "optim_impl",
            "compiled_blocks", "precision", "kernels")
    return {"model": doc.get("model", {}).get("name"), "n_params": doc.get("model", {}).get("n_params"),
            "tokens_per_step": (doc.get("global_batch") or 0) * (doc.get("seq_len") or 0),
            "steps_measured": m.get("trainer", {}).get("steps_measured"),
            "peak_tflops": doc.get("peak", {}).get("tflops"),
            "reference": {k: m.get("reference", {}).get(k) for k in keep if k in m.get("reference", {})},
            "trainer": {k: m.get("trainer", {}).get(k) for k in keep if k in m.get("trainer", {})},
            "tokens_per_s_ratio": m.get("tokens_per_s_ratio"), "peak_mem_ratio": m.get("peak_mem_ratio"),
            "targets_met": m.get("targets_met"), "loss_first_rel_diff": m.get("loss_first_rel_diff")}


def kernel_figures(doc: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for case, by_dtype in (doc.get("cases") or {}).items():
        for dtype, by_size in by_dtype.items():
            for size, r in by_size.items():
                rows.append({"case": case, "dtype": dtype, "size": int(size),
                             **{k: r.get(k) for k in ("time_ms", "eager_ms", "compile_ms", "copy_fraction",
                                                      "vs_eager", "vs_compile")}})
    return {"gpu": doc.get("gpu"), "check": doc.get("check"), "rows": rows,
            "targets": [{k: t.get(k) for k in ("target", "metric", "threshold", "measured", "met", "why_none")}
                        for t in doc.get("targets", [])],
            "dispatch_us": doc.get("dispatch_us")}
