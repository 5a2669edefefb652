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
chain is read like a snapshot's stack (:func:`workbench.memory.labelling.classify_frames`): the phase,
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
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from workbench.memory.labelling import (NO_FACTS, _Contexts, _finish, _join, _label_events, fold_facts, frame_facts,
                                        label_of)
from workbench.memory.snapshot import DEFAULT_MAX_EVENTS
from workbench.memory.timeline import MemoryTimeline
from workbench.safeio import open_regular

__all__ = ["import_profiler_trace", "load_chrome_trace"]

_DEVICE_TYPES = {0: "cpu", 1: "cuda"}
_PY_FUNCTION = re.compile(r"^(.*)\((\d{1,9})\): (.*)$")  # (a line number that fits an int)
_STEP = re.compile(r"^ProfilerStep#(\d{1,9})$")
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


# A trace is read whole, so its size bounds the work; a gzipped one may inflate at most this much (chrome
# traces compress ~15x; a gzip bomb would otherwise turn a 1 MB file into gigabytes of JSON objects).
_MAX_INFLATE = 100
_INFLATE_FLOOR = 16 << 20


def _load_json(path: Path, how: str = _FIX) -> dict:
    """A chrome trace file (``.json`` or gzipped) read whole, bounded; every failure one ValueError ending in
    ``how`` (how to make a good one). Also :mod:`workbench.time.trace`'s reader, as :func:`load_chrome_trace`."""
    fix = f"the file is damaged or not a chrome trace; {how}"
    with open_regular(path, "profiler trace", fix_missing=how) as f:  # never a FIFO or a device
        size = os.fstat(f.fileno()).st_size
        head = f.read(2)
        f.seek(0)
        try:
            if head == b"\x1f\x8b":
                limit = _MAX_INFLATE * size + _INFLATE_FLOOR
                with gzip.GzipFile(fileobj=f) as g:
                    raw = g.read(limit + 1)
                if len(raw) > limit:
                    raise ValueError(f"{path} inflates to more than {limit:,} bytes ({_MAX_INFLATE} times its "
                                     f"size): refusing to read it; {fix}")
            else:
                raw = f.read()
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path} is not a profiler trace (a damaged gzip stream: {type(e).__name__}); "
                             f"{fix}") from None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: an integer of more than 4300 digits; RecursionError: nesting deeper than the
        # interpreter's limit (the decoder stops there, in C, without crashing)
        raise ValueError(f"{path} is not a profiler trace (not readable JSON: {type(e).__name__}); {how}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path} is JSON but not a chrome trace (no 'traceEvents'); {how}")
    return data


load_chrome_trace = _load_json  # the public name other readers of profiler traces use


def _ident(v: Any) -> str:
    """A pid or tid as a string key: strings hash with a per-process seed, so crafted colliding integers
    cannot make the per-thread dicts quadratic; a list or dict (never written by a profiler) is "?"."""
    return v if type(v) is str else repr(v) if v is None or type(v) in (int, float, bool) else "?"


def _number(v: Any, default: float = 0.0) -> float | None:
    """A finite int or float (a bool or anything else: None)."""
    if v is None:
        return default
    if type(v) in (int, float) and -1e300 < v < 1e300:
        return float(v)
    return None


def _integer(v: Any, default: int = 0) -> int | None:
    """An int64 value (a whole float too), or None."""
    if v is None:
        return default
    if type(v) is float and v.is_integer():
        v = int(v)
    return v if type(v) is int and -(1 << 63) <= v < (1 << 63) else None


def _events(trace: list, name: str) -> tuple[list[tuple], list[tuple]]:
    """The memory events as ``(ts, ev_idx, bytes, addr, total, device_type, device_id, thread)`` and the
    complete events as ``(ts, dur, frame, thread)``, each field checked: one line names the first wrong one."""
    memory, spans = [], []
    for i, e in enumerate(trace):
        if type(e) is not dict:
            continue
        args = e.get("args")
        if e.get("name") == "[memory]" and type(args) is dict:
            ts = _number(e.get("ts"), None)
            fields = [_integer(args.get(k), d) for k, d in (("Ev Idx", 0), ("Bytes", 0), ("Addr", 0),
                                                            ("Total Allocated", 0), ("Device Type", 0),
                                                            ("Device Id", -1))]
            if ts is None or None in fields:
                raise ValueError(f"{name}: memory event {i} has a time, size, address or device that is not a "
                                 f"number; the file is damaged; {_FIX}")
            memory.append((ts, *fields, (_ident(e.get("pid")), _ident(e.get("tid")))))
        elif e.get("ph") == "X" and "ts" in e:
            ts, dur = _number(e.get("ts"), None), _number(e.get("dur"))
            if ts is None or dur is None:
                raise ValueError(f"{name}: event {i} has a start or duration that is not a number; the file is "
                                 f"damaged; {_FIX}")
            spans.append((ts, dur, _frame_of(e), (_ident(e.get("pid")), _ident(e.get("tid")))))
    return memory, spans


def _frame_of(event: dict) -> tuple[str, int, str]:
    """An enclosing event as a stack frame: Python functions keep their file and line."""
    name = event.get("name", "")
    name = name if type(name) is str else ""
    if event.get("cat") == "python_function":
        m = _PY_FUNCTION.match(name)
        if m:
            return m.group(1), int(m.group(2)), m.group(3)
    return "", 0, name


def _facts(outer: tuple, frame: tuple[str, int, str]) -> tuple:
    """What a chain of enclosing events tells, from the chain around it and its innermost event: the
    snapshot frames' facts (:func:`fold_facts`), the innermost ``nn.Module``, ``aten::`` op and step. One
    fold per event opened: labelling is linear however deep events nest (walking each chain was
    quadratic: 10**5 nested events took hours)."""
    name = frame[2]
    m = _STEP.match(name)
    return (fold_facts(outer[0], frame_facts(*frame)),
            name[len("nn.Module: "):] if name.startswith("nn.Module: ") else outer[1],
            name if name.startswith("aten::") else outer[2],
            int(m.group(1)) if m else outer[3])


_NOTHING = (NO_FACTS, "", "", -1)


def _label(facts: tuple) -> tuple[tuple, int]:
    """(phase, hint, module, op) and the step of a chain of enclosing events, from its folded facts."""
    base, nn_module, aten, step = facts
    phase, hint, forward_at, op = label_of(base)
    return (phase, hint, nn_module or forward_at, aten or op), step


def _enclosing(spans: list[tuple], memory: list[tuple]) -> tuple[list[tuple], np.ndarray, np.ndarray]:
    """For every memory event, the id of its innermost enclosing event's context, and its step.

    One sweep per thread over the complete events in start order, with a stack of the open ones: a
    memory event sees the events open at its time. A context is labelled once, the first time it is
    the innermost one around a memory event."""
    by_tid: dict[Any, list[tuple]] = {}
    for sp in spans:
        by_tid.setdefault(sp[3], []).append(sp)
    labels: list[tuple] = [(None, None, "", "")]  # context 0: nothing enclosing
    steps_of: list[int] = [-1]
    ctx = np.zeros(len(memory), dtype=np.int64)
    step = np.full(len(memory), -1, dtype=np.int32)
    mem_by_tid: dict[Any, list[int]] = {}
    for i, m in enumerate(memory):
        mem_by_tid.setdefault(m[7], []).append(i)
    for key, idx in mem_by_tid.items():
        order = sorted(by_tid.get(key, []), key=lambda sp: (sp[0], -sp[1]))
        open_: list[list] = []  # [end, facts of the chain up to it, its context id or 0]
        j = 0
        for i in idx:
            ts = memory[i][0]
            while j < len(order) and order[j][0] <= ts:
                start, dur, frame, _ = order[j]
                while open_ and open_[-1][0] < start:
                    open_.pop()
                open_.append([start + dur, _facts(open_[-1][1] if open_ else _NOTHING, frame), 0])
                j += 1
            while open_ and open_[-1][0] < ts:
                open_.pop()
            if not open_:
                continue
            top = open_[-1]
            if not top[2]:
                label, s_ = _label(top[1])
                top[2] = len(labels)
                labels.append(label)
                steps_of.append(s_)
            ctx[i] = top[2]
            step[i] = steps_of[top[2]]
    return labels, ctx, step


def import_profiler_trace(source: str | os.PathLike | Any, rank: int = 0, *, device: str | None = None,
                          max_events: int = DEFAULT_MAX_EVENTS) -> MemoryTimeline:
    """One rank's timeline from a profiler's chrome trace (``.json`` or ``.json.gz``) or a stopped
    ``torch.profiler.profile`` not exported yet (torch exports a trace once). ``device`` is ``"cpu"``
    or ``"cuda"`` (default: cuda if the trace has CUDA memory events, else cpu)."""
    data, name = _read_trace(source)
    memory, spans = _events(data["traceEvents"], name)
    if not memory:
        raise ValueError(f"{name} has no memory events; profile with "
                         "torch.profiler.profile(profile_memory=True) and export that trace")
    kinds = {m[5] for m in memory}
    if device is None:
        device_type = 1 if 1 in kinds else min(kinds)
    else:
        wanted = {v: k for k, v in _DEVICE_TYPES.items()}.get(device)
        if wanted is None or wanted not in kinds:
            have = sorted(_DEVICE_TYPES.get(k, f"device type {k}") for k in kinds)[:8]
            raise ValueError(f"{name} has no {device} memory events; it has {have}")
        device_type = wanted
    memory = [m for m in memory if m[5] == device_type]
    ids = sorted({m[6] for m in memory})
    if len(ids) > 1:
        raise ValueError(f"{name} holds {_DEVICE_TYPES.get(device_type, device_type)} memory of devices "
                         f"{ids[:8]}{' ...' if len(ids) > 8 else ''}; a rank's timeline is one device's: profile "
                         "one device per rank")
    memory = [m for m in memory if m[2] != 0]
    if not memory:
        raise ValueError(f"{name} has no memory events that allocate or free bytes; profile with "
                         "torch.profiler.profile(profile_memory=True) and export that trace")
    memory.sort(key=lambda m: (m[0], m[1]))
    labels, ctx, step = _enclosing(spans, memory)
    contexts = _Contexts(labels)

    nbytes = np.array([m[2] for m in memory], dtype=np.int64)
    addr = np.array([m[3] for m in memory], dtype=np.int64)
    reported = np.array([m[4] for m in memory], dtype=np.int64)
    ts = np.array([m[0] for m in memory], dtype=np.float64) * 1e-6
    rows, facts = _label_events(ts, nbytes > 0, addr, np.abs(nbytes), ctx, contexts, None,
                                step=step if (step >= 0).any() else None)
    base = int(reported[0] - nbytes[0])
    ours = base + np.cumsum(rows.delta)
    meta: dict[str, Any] = {"profiler_total_mismatch_bytes": int(np.abs(ours - reported).max())}
    part = _finish(rank, rows, base, {"other": base}, contexts, max_events, meta, float(ts[0]))
    return _join([part], "profiler", _DEVICE_TYPES.get(device_type, f"device{device_type}"),
                 {"files": {str(rank): name}})
