"""Profiler memory events -> :class:`MemoryTimeline`: what ``torch.profiler`` saw, in the one schema.

``torch.profiler.profile(profile_memory=True)`` records an instant event for every allocation and free
the allocator reports; ``export_chrome_trace(path)`` writes them as::

    {"ph": "i", "name": "[memory]", "ts": 4578616093555.95, "tid": 31019,
     "args": {"Addr": 94265089830080, "Bytes": 1024 | -1024, "Total Allocated": 2048,
              "Device Type": 0 (CPU) | 1 (CUDA), "Device Id": -1, ...}}

next to the complete ("X") events of the operators, modules and Python functions that were running::

    nn.Module: Linear_0            the forward of a module (its class and instance number)
    aten::addmm                    an operator
    autograd::engine::evaluate_function: AddmmBackward0            backward
    autograd::engine::evaluate_function: torch::autograd::AccumulateGrad   a gradient
    Optimizer.step#AdamW.step, Optimizer.zero_grad#AdamW.zero_grad  the optimizer
    ProfilerStep#3                 the step (when the profiler runs with a schedule)
    torch/optim/adamw.py(210): step                                 a Python function (with_stack=True)

Each memory event takes the chain of events enclosing it on its thread, innermost first, and that
chain is read like a snapshot's stack (:func:`workbench.memory.snapshot.classify_frames`): the phase,
a category hint, ``module`` = the innermost ``nn.Module: <Class>_<n>``, ``op`` = the innermost
``aten::`` operator. Then the same rules as for snapshots apply: frees pair with the allocation at their
address, an allocation is a temporary unless it outlives its phase (activation, gradient, optimizer
state), and a rank with more than ``max_events`` rows is downsampled keeping exact totals and the peak.

``t`` is seconds from the first memory event. ``base_bytes`` is the allocator's total just before the
first event (``Total Allocated - Bytes``), so ``total_bytes`` equals the profiler's ``Total Allocated``
after every event when no event was lost; ``meta["profiler_total_mismatch_bytes"]`` says how far they
ever differ (0 when they agree). On CPU the allocator does not report frees of memory allocated
before profiling started, so that memory stays in ``base_bytes``.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from workbench.memory.snapshot import (DEFAULT_MAX_EVENTS, _Contexts, _finish, _join, _label_events,
                                       classify_frames)
from workbench.memory.timeline import MemoryTimeline

__all__ = ["import_profiler_trace"]

_DEVICE_TYPES = {0: "cpu", 1: "cuda"}
_PY_FUNCTION = re.compile(r"^(.*)\((\d+)\): (.*)$")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_FIX = "export one with prof.export_chrome_trace(path) from torch.profiler.profile(profile_memory=True)"


def _read_trace(source: Any) -> tuple[dict, str]:
    if hasattr(source, "export_chrome_trace"):  # a torch.profiler.profile, already stopped
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            try:
                source.export_chrome_trace(str(path))
            except RuntimeError as e:  # torch exports a profile's trace once
                raise ValueError(f"this profile cannot be exported again ({e}); import the file it was "
                                 "exported to instead") from None
            return _load_json(path), "profile"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; {_FIX}")
    return _load_json(path), str(path)


def _load_json(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a profiler trace (not readable JSON: {type(e).__name__}); {_FIX}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is JSON but not a chrome trace (no 'traceEvents'); {_FIX}")
    return data


def _frame_of(event: dict) -> tuple[str, int, str]:
    """An enclosing event as a stack frame: Python functions keep their file and line."""
    name = str(event.get("name", ""))
    if event.get("cat") == "python_function":
        m = _PY_FUNCTION.match(name)
        if m:
            return m.group(1), int(m.group(2)), m.group(3)
    return "", 0, name


def _label(chain: list[dict]) -> tuple[tuple, int]:
    """(phase, hint, module, op) and the step of a chain of enclosing events (innermost first)."""
    frames = [_frame_of(e) for e in chain]
    phase, hint, forward_at, op = classify_frames(frames)
    module = next((n[len("nn.Module: "):] for _, _, n in frames if n.startswith("nn.Module: ")), forward_at)
    aten = next((n for _, _, n in frames if n.startswith("aten::")), "")
    step = next((int(m.group(1)) for _, _, n in frames if (m := _STEP.match(n))), -1)
    return (phase, hint, module, aten or op), step


def _enclosing(events: list[dict], memory: list[dict]) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """For every memory event, the id of its innermost enclosing event's context, and its step.

    One sweep per thread over the complete events in start order, with a stack of the open ones: a
    memory event sees the events open at its time. A context is labelled once, the first time it is
    the innermost one around a memory event."""
    by_tid: dict[Any, list[dict]] = {}
    for e in events:
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    labels: list[tuple] = [(None, None, "", "")]  # context 0: nothing enclosing
    steps_of: list[int] = [-1]
    ids: dict[int, int] = {}
    ctx = np.zeros(len(memory), dtype=np.int64)
    step = np.full(len(memory), -1, dtype=np.int32)
    mem_by_tid: dict[Any, list[int]] = {}
    for i, m in enumerate(memory):
        mem_by_tid.setdefault((m.get("pid"), m.get("tid")), []).append(i)
    for key, idx in mem_by_tid.items():
        spans = sorted(by_tid.get(key, []), key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        open_: list[dict] = []
        j = 0
        for i in idx:
            ts = float(memory[i]["ts"])
            while j < len(spans) and float(spans[j]["ts"]) <= ts:
                s = spans[j]
                start = float(s["ts"])
                while open_ and float(open_[-1]["ts"]) + float(open_[-1].get("dur", 0)) < start:
                    open_.pop()
                open_.append(s)
                j += 1
            while open_ and float(open_[-1]["ts"]) + float(open_[-1].get("dur", 0)) < ts:
                open_.pop()
            if not open_:
                continue
            top = id(open_[-1])
            c = ids.get(top)
            if c is None:
                label, s_ = _label(open_[::-1])
                c = ids[top] = len(labels)
                labels.append(label)
                steps_of.append(s_)
            ctx[i] = c
            step[i] = steps_of[c]
    return labels, ctx, step


def import_profiler_trace(source: str | os.PathLike | Any, rank: int = 0, *, device: str | None = None,
                          max_events: int = DEFAULT_MAX_EVENTS) -> MemoryTimeline:
    """One rank's timeline from a profiler's chrome trace (``.json`` or ``.json.gz``) or a stopped
    ``torch.profiler.profile`` not exported yet (torch exports a trace once). ``device`` is ``"cpu"``
    or ``"cuda"`` (default: cuda if the trace has CUDA memory events, else cpu)."""
    data, name = _read_trace(source)
    trace = data["traceEvents"]
    memory = [e for e in trace if e.get("name") == "[memory]" and isinstance(e.get("args"), dict)]
    if not memory:
        raise ValueError(f"{name} has no memory events; profile with "
                         "torch.profiler.profile(profile_memory=True) and export that trace")
    kinds = {int(e["args"].get("Device Type", 0)) for e in memory}
    if device is None:
        device_type = 1 if 1 in kinds else min(kinds)
    else:
        wanted = {v: k for k, v in _DEVICE_TYPES.items()}.get(device)
        if wanted is None or wanted not in kinds:
            have = sorted(_DEVICE_TYPES.get(k, f"device type {k}") for k in kinds)
            raise ValueError(f"{name} has no {device} memory events; it has {have}")
        device_type = wanted
    memory = [e for e in memory if int(e["args"].get("Device Type", 0)) == device_type]
    ids = sorted({int(e["args"].get("Device Id", -1)) for e in memory})
    if len(ids) > 1:
        raise ValueError(f"{name} holds {_DEVICE_TYPES.get(device_type, device_type)} memory of devices {ids}; "
                         "a rank's timeline is one device's: profile one device per rank")
    memory = [e for e in memory if int(e["args"].get("Bytes", 0)) != 0]
    memory.sort(key=lambda e: (float(e["ts"]), int(e["args"].get("Ev Idx", 0))))
    spans = [e for e in trace if e.get("ph") == "X" and "ts" in e]
    labels, ctx, step = _enclosing(spans, memory)
    contexts = _Contexts(labels)

    nbytes = np.array([int(e["args"]["Bytes"]) for e in memory], dtype=np.int64)
    addr = np.array([int(e["args"].get("Addr", 0)) for e in memory], dtype=np.int64)
    reported = np.array([int(e["args"].get("Total Allocated", 0)) for e in memory], dtype=np.int64)
    ts = np.array([float(e["ts"]) for e in memory], dtype=np.float64) * 1e-6
    rows, facts = _label_events(ts, nbytes > 0, addr, np.abs(nbytes), ctx, contexts, None,
                                step=step if (step >= 0).any() else None)
    base = int(reported[0] - nbytes[0])
    ours = base + np.cumsum(rows.delta)
    meta: dict[str, Any] = {"profiler_total_mismatch_bytes": int(np.abs(ours - reported).max())}
    part = _finish(rank, rows, base, {"other": base}, contexts, max_events, meta, float(ts[0]))
    return _join([part], "profiler", _DEVICE_TYPES.get(device_type, f"device{device_type}"),
                 {"files": {str(rank): name}})
