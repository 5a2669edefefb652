"""torch.profiler traces -> :class:`~workbench.time.timeline.StepTimeline`: where each rank's steps went.

    tl = import_trace("runs/x/profile")          # every rank of a run (``train --profile``)
    tl = import_trace(prof)                      # a stopped torch.profiler.profile of this process
    tl = import_trace(["r0.json.gz", "r1.json.gz"], max_spans=20_000)

A trace (Kineto's chrome format, ``.json`` or ``.json.gz``) holds complete ("X") events: operators,
``record_function`` ranges, gloo's worker-thread runs, and on a GPU the kernels on their streams. They nest
on each thread. The import:

1. reads each file through the bounded reader of :mod:`workbench.memory.profiler_trace` (regular files only,
   gzip bombs refused, bad JSON one line);
2. per thread, nests the events (a stack sweep in start order) and folds what each event tells to everything
   inside it (:mod:`workbench.time.trace_rules`: step, labels, phase, collective, microbatch, module);
3. flattens each stream into leaves: at every instant the innermost event (the one started last) owns the
   time, so a parent's own time is what its children leave. Streams: ``compute`` (the main thread, the one
   holding ``ProfilerStep#N``, with autograd's backward threads), ``comm`` (gloo's worker threads and the
   ``gloo:``/``nccl:`` ranges of collectives in flight),
   ``cuda:<stream>`` (kernels, classified by the host op that launched them: ``External id``/``correlation``),
   ``thread:<tid>`` (any other thread);
4. classifies each leaf (the rules in :mod:`workbench.time.trace_rules`); the main thread's time inside a step
   with nothing but the step marker open is ``idle``, ``wait:rank`` while one of the rank's collectives is in
   flight, else ``wait:host``;
5. counts each collective's payload once: on the host call (``c10d::allreduce_``, ``record_param_comms``),
   or where a rank's trace has none, on the worker-thread run or NCCL kernel;
6. aligns ranks on one clock (``baseTimeNanoseconds``; the origin is the first event of any rank), and with
   ``max_spans`` merges a rank's adjacent leaves of one kind, no more than it takes to fit, keeping every
   category's seconds per step and stream (:func:`_cap`).

Cost is linear in the events (sorting aside): one file at a time is held in memory. Measured on the 2-core
machine: ~40 us of CPU per event (a 250k-event trace in ~10 s; a quarter of it is the JSON decoder).

Not done here: idle time of a GPU stream (the analysis can find it between a stream's spans), and a
host blocked in ``cudaStreamSynchronize`` counts as the phase it blocks in.
"""

from __future__ import annotations

import bisect
import heapq
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from workbench.time.timeline import COLUMNS, PHASES, StepTimeline
from workbench.time.trace_rules import collective_kind, match, payload_bytes

__all__ = ["import_trace", "find_traces"]

FIX = ("record one with `workbench train --profile` or torch.profiler.profile(...).export_chrome_trace(path) "
       "(tensorboard_trace_handler writes <host>_<pid>.<n>.pt.trace.json.gz)")
_RANK_FILE = re.compile(r"rank(\d{1,6})\.pt\.trace\.json(?:\.gz)?")
_KINETO_FILE = re.compile(r".{1,200}\.pt\.trace\.json(?:\.gz)?")
_MAX_FILES = 1 << 16
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_SKIP_CATS = {"Trace", "gpu_user_annotation", "python_function_trace"}
_LIFETIMES = ("gloo:", "nccl:")  # a process group backend's ranges (see _rank_spans)
_MAX_TS = 1e17   # microseconds: ~3,000 years from the clock's zero
_MAX_DUR = 1e13  # microseconds: ~4 months for one event


# -- sources ------------------------------------------------------------------------------------------------

def find_traces(directory: str | os.PathLike) -> tuple[list[tuple[int | None, Path]], bool]:
    """The trace files of a run directory, its ``profile/`` or any directory of Kineto traces, as
    ``(rank or None, path)`` (the rank of ``rank{r}.pt.trace.json(.gz)``; a Kineto file's is inside it), and
    whether it is a workbench run's. Only regular files whose names match are listed, each confined to the
    directory (a link leading out of it is refused)."""
    from workbench.safeio import confine

    base = Path(directory)
    sub = "profile/" if (base / "profile").is_dir() else ""
    measured = bool(sub) or (base.name == "profile" and (base.parent / "config.json").is_file())
    d = base / sub if sub else base
    found: list[tuple[int | None, Path]] = []
    try:
        with os.scandir(d) as it:
            for entry in it:
                m = _RANK_FILE.fullmatch(entry.name)
                if not (m or _KINETO_FILE.fullmatch(entry.name)):
                    continue
                if len(found) >= _MAX_FILES:
                    raise ValueError(f"{d} holds more than {_MAX_FILES:,} trace files; import a list of the ranks "
                                     "you want instead")
                # confined to the directory named: a profile/ linked elsewhere is refused too
                found.append((int(m.group(1)) if m else None, confine(base, sub + entry.name, base, "profiler trace")))
    except OSError as e:
        raise ValueError(f"{d}: cannot list it ({e.strerror or type(e).__name__}); check its permissions") from None
    if not found:
        raise ValueError(f"{d} holds no profiler traces (rank<r>.pt.trace.json.gz or "
                         f"<host>_<pid>.<n>.pt.trace.json[.gz]); {FIX}")
    return sorted(found, key=lambda rp: (rp[0] is None, rp[0] or 0, rp[1].name)), measured


def _load(item: Any) -> tuple[dict, str]:
    from workbench.memory.profiler_trace import load_chrome_trace

    if hasattr(item, "export_chrome_trace"):  # a stopped torch.profiler.profile
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "trace.json"
            try:
                item.export_chrome_trace(str(path))
            except (RuntimeError, AttributeError) as e:  # (a running profile has no trace yet: AttributeError)
                raise ValueError(f"this profile cannot be exported ({(str(e).splitlines() or [''])[0][:120]}): torch "
                                 "exports a profile once, after it stops; import the file it was exported to, or "
                                 "leave the profile's `with` block first") from None
            return load_chrome_trace(path, FIX), "profile"
    if not isinstance(item, (str, os.PathLike)):
        raise ValueError(f"cannot import a trace from a {type(item).__name__}; pass a torch.profiler.profile, a "
                         ".json/.json.gz trace file, a list of them, or a directory of per-rank traces")
    return load_chrome_trace(Path(item), FIX), str(item)


def _check_ranks(ranks: Any) -> set[int] | None:
    if ranks is None:
        return None
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    try:
        ranks = list(ranks)
    except TypeError:
        ranks = [ranks]
    if not ranks or any(type(r) is not int or r < 0 for r in ranks):
        raise ValueError(f"ranks must be a list of ranks (ints >= 0), not {ranks!r:.80}")
    return set(ranks)


def _trace_rank(data: dict, name: str) -> int | None:
    info = data.get("distributedInfo")
    if info is None:
        return None
    r = info.get("rank") if type(info) is dict else None
    if type(r) is not int or not 0 <= r < (1 << 31):
        raise ValueError(f"{name}: distributedInfo.rank is not a rank (an int >= 0); the file is damaged; {FIX}")
    return r


def _base_ns(data: dict) -> int | None:
    b = data.get("baseTimeNanoseconds")
    return b if type(b) is int and 0 <= b < (1 << 63) else None


# -- one trace ----------------------------------------------------------------------------------------------

class _Trace:
    """One rank's events, parsed and checked: host events per thread, device events per stream."""

    def __init__(self, data: dict, name: str):
        self.name = name
        self.clamped = 0
        self.thread_names: dict[str, str] = {}
        ts_l, end_l, name_l, thread_l, args_l, cat_l = [], [], [], [], [], []
        events = data["traceEvents"]
        for i, e in enumerate(events):
            if type(e) is not dict:
                continue
            ph = e.get("ph")
            if ph == "M":
                args = e.get("args")
                if e.get("name") == "thread_name" and type(args) is dict and type(args.get("name")) is str:
                    key = "h:" + _ident(e.get("pid")) + "/" + _ident(e.get("tid"))
                    # (Kineto may name a thread twice: "thread 7 (pt_gloo_runloop)", then "thread 7 (python)")
                    self.thread_names[key] = (self.thread_names.get(key, "") + " " + args["name"][:200])[-1000:]
                continue
            if ph != "X":
                continue
            cat = e.get("cat")
            cat = cat if type(cat) is str else ""
            if cat in _SKIP_CATS:
                continue
            ts, dur = e.get("ts"), e.get("dur", 0)
            if type(ts) not in (int, float) or type(dur) not in (int, float) or not -_MAX_TS < ts < _MAX_TS \
                    or not dur < _MAX_DUR or dur != dur:
                raise ValueError(f"{name}: event {i} has a start or duration that is not a time in microseconds "
                                 f"(a number, |ts| < {_MAX_TS:.0e}, dur < {_MAX_DUR:.0e}); the file is damaged; {FIX}")
            if dur < 0:
                self.clamped += 1
                dur = 0
            ev_name = e.get("name")
            args = e.get("args")
            gpu = cat in _GPU_CATS
            if gpu and type(args) is dict and type(args.get("stream")) is int:
                thread = "cuda:" + str(args["stream"])
            else:
                thread = ("cuda:" + _ident(e.get("tid")) if gpu
                          else "h:" + _ident(e.get("pid")) + "/" + _ident(e.get("tid")))
            ts_l.append(float(ts))
            end_l.append(float(ts) + float(dur))
            name_l.append(ev_name[:1000] if type(ev_name) is str else "")
            thread_l.append(thread)
            args_l.append(args if type(args) is dict else None)
            cat_l.append(cat)
        self.ts, self.end, self.names, self.threads, self.args, self.cats = ts_l, end_l, name_l, thread_l, args_l, cat_l

    def __len__(self) -> int:
        return len(self.ts)


def _ident(v: Any) -> str:
    return v[:100] if type(v) is str else repr(v) if v is None or type(v) in (int, float, bool) else "?"


# facts of an event: (label, rule phase, call (event index of the outermost collective) or -1, microbatch,
# module, step marker?, own kind)
_NONE = ("", "", -1, -1, "", False, "")


def _nest(tr: _Trace, idx: list[int], matches: list, facts: list, backward_thread: bool) -> None:
    """Fold the facts down each event's chain of enclosing events on one thread (a stack sweep)."""
    ts, end = tr.ts, tr.end
    order = sorted(idx, key=lambda i: (ts[i], -end[i], i))
    stack: list[int] = []
    for i in order:
        while stack and end[stack[-1]] <= ts[i]:
            stack.pop()
        outer = facts[stack[-1]] if stack else ("", "backward" if backward_thread else "", -1, -1, "", False, "")
        m = matches[i]
        if m is None:
            facts[i] = (*outer[:5], False, "")
        else:
            kind, value, _, mb, module = m
            label, rule, call = outer[0], outer[1], outer[2]
            if kind == "label":
                label = value
            elif kind == "phase":
                rule = value
            elif kind in ("comm", "wait") and call < 0:
                call = i
            facts[i] = (label, rule, call, mb if mb >= 0 else outer[3], module or outer[4], kind == "step", kind)
        stack.append(i)


def _flatten(items: list[tuple[float, float, int]], cuts: frozenset = frozenset()) -> list[list]:
    """Leaves of possibly nested events ``(start, end, owner)``: at each instant the event started last (then
    the shorter, then the later in the file) owns the time. Adjacent pieces of one owner join, except across
    ``cuts`` (the steps' bounds: a Python function open across two steps is a leaf in each)."""
    items = sorted(items)
    points = sorted({t for s, e, _ in items for t in (s, e)})
    heap: list[tuple[float, float, int]] = []
    out: list[list] = []
    j, n = 0, len(items)
    for k in range(len(points) - 1):
        t = points[k]
        while j < n and items[j][0] <= t:
            s, e, o = items[j]
            heapq.heappush(heap, (-s, e, -o))
            j += 1
        while heap and heap[0][1] <= t:
            heapq.heappop(heap)
        if heap:
            owner = -heap[0][2]
            if out and out[-1][2] == owner and out[-1][1] == t and t not in cuts:
                out[-1][1] = points[k + 1]
            else:
                out.append([t, points[k + 1], owner])
    return out


class _Steps:
    """The steps of a rank: intervals of the main thread's step markers, numbered."""

    def __init__(self, tr: _Trace, markers: list[int]):
        wb = [i for i in markers if tr.names[i].startswith("workbench.step")]
        prof = sorted((i for i in markers if not tr.names[i].startswith("workbench.step")), key=lambda i: tr.ts[i])
        chosen = wb or prof
        rows = []
        prof_starts = [tr.ts[p] for p in prof]
        for k, i in enumerate(sorted(chosen, key=lambda i: tr.ts[i])):
            n = match(tr.names[i])[2]
            if n < 0:  # workbench.step without a number: the ProfilerStep#N around it, else its ordinal
                j = bisect.bisect_right(prof_starts, tr.ts[i]) - 1
                n = match(tr.names[prof[j]])[2] if j >= 0 and tr.ts[i] < tr.end[prof[j]] else k
            rows.append((tr.ts[i], tr.end[i], n))
        self.starts = [r[0] for r in rows]
        self.rows = rows

    def of(self, t: float) -> int:
        k = bisect.bisect_right(self.starts, t) - 1
        return self.rows[k][2] if k >= 0 and t < self.rows[k][1] else -1

    def index(self, t: float) -> int:
        k = bisect.bisect_right(self.starts, t) - 1
        return k if k >= 0 and t < self.rows[k][1] else -1


def _rank_spans(tr: _Trace) -> tuple[list[tuple], dict[str, Any]]:
    """One trace's leaf spans as rows of :data:`COLUMNS` (rank 0; times in microseconds on its own clock), and
    what was seen."""
    n = len(tr)
    by_thread: dict[str, list[int]] = {}
    for i in range(n):
        by_thread.setdefault(tr.threads[i], []).append(i)
    host = {t: ix for t, ix in by_thread.items() if not t.startswith("cuda:")}
    device = {t: ix for t, ix in by_thread.items() if t.startswith("cuda:")}
    known: dict[str, Any] = {}  # names repeat (aten::mm ...): each is matched once
    matches = [known[nm] if nm in known else known.setdefault(nm, match(nm)) for nm in tr.names]
    del known
    kinds = [m[0] if m else "" for m in matches]

    def comm_thread(t: str, ix: list[int]) -> bool:
        tn = tr.thread_names.get(t, "").lower()
        return "gloo" in tn or "nccl" in tn or all(kinds[i] in ("comm", "wait") for i in ix)

    markers = {t: sum(kinds[i] == "step" for i in ix) for t, ix in host.items()}
    comm = {t for t, ix in host.items() if comm_thread(t, ix) and not markers[t]}
    candidates = [t for t in host if t not in comm] or list(host)
    main = max(candidates, key=lambda t: (markers[t], len(host[t]), t)) if candidates else None
    comm.discard(main)  # (a trace of nothing but collectives: they ran on the main thread)
    # A backend's own range on an issuing thread ("gloo:send", "nccl:all_reduce") spans the collective's
    # lifetime, from issue to completion, not a blocking call: the thread runs on inside it (a pipeline's
    # forward while its send is in flight). Those ranges join the comm stream, never enclose the thread's work.
    lifetimes: list[int] = []
    for t in list(host):
        if t not in comm:
            lifetimes += [i for i in host[t] if kinds[i] == "comm" and tr.names[i].startswith(_LIFETIMES)]
            host[t] = [i for i in host[t] if not (kinds[i] == "comm" and tr.names[i].startswith(_LIFETIMES))]
    if lifetimes:
        host["h:in flight"] = lifetimes
        comm.add("h:in flight")
    backward = {t for t, ix in host.items() if t != main and t not in comm and not markers[t]
                and any(tr.names[i].startswith("autograd::engine::evaluate_function") for i in ix)}
    facts: list = [_NONE] * n
    for t, ix in host.items():
        _nest(tr, ix, matches, facts, t in backward)
    steps = _Steps(tr, [i for i in host.get(main, []) if kinds[i] == "step"] if main else [])

    # per step: where backward starts and ends on the compute stream (the positional rule)
    compute_threads = ({main} if main else set()) | backward
    bwd: dict[int, list[float]] = {}
    for t in compute_threads:
        for i in host[t]:
            f = facts[i]
            if (f[0] or f[1]) == "backward" and f[2] < 0:
                k = steps.index(tr.ts[i])
                lo_hi = bwd.setdefault(k, [tr.ts[i], tr.end[i]])
                lo_hi[0], lo_hi[1] = min(lo_hi[0], tr.ts[i]), max(lo_hi[1], tr.end[i])

    def classify(i: int, t0: float) -> tuple[str, str]:
        """(category, phase) of time owned by host event ``i`` at ``t0``."""
        label, rule, call = facts[i][0], facts[i][1], facts[i][2]
        phase = label or rule
        if not phase:
            lo_hi = bwd.get(steps.index(t0))
            phase = "forward" if lo_hi is None or t0 < lo_hi[0] else "optimizer" if t0 >= lo_hi[1] else "backward"
        if call >= 0:
            return "communication", phase
        return phase, phase

    rows: list[tuple] = []

    def emit(s, e, cat, phase, step, mb, module, stream, name, nbytes=0):
        rows.append((0, s, e, cat, phase, step, mb, module, stream, name, nbytes))

    # collective payloads: worker-thread runs in issue order, paired with the host calls of the same kind
    # (a host call's TensorList names no dtype; its run does)
    runs: dict[str, list[int]] = {}
    for t in comm:
        for i in sorted(host[t], key=lambda i: tr.ts[i]):
            runs.setdefault(collective_kind(tr.names[i]), []).append(i)
    calls = sorted({facts[i][2] for t in host if t not in comm for i in host[t] if facts[i][2] >= 0},
                   key=lambda i: tr.ts[i])
    call_bytes: dict[int, int] = {}
    seen: dict[str, int] = {}
    for c in calls:
        kind = collective_kind(tr.names[c])
        k = seen[kind] = seen.get(kind, -1) + 1
        paired = runs.get(kind, [])
        fallback = payload_bytes(tr.args[paired[k]])[1] if kind and k < len(paired) else ""
        call_bytes[c] = payload_bytes(tr.args[c], fallback)[0]
    for t in host:
        if t in comm:
            continue
        for i in host[t]:
            c = facts[i][2]
            if c >= 0 and c != i and facts[i][6] == "comm":
                call_bytes[c] = max(call_bytes.get(c, 0), payload_bytes(tr.args[i])[0])
    host_bytes = any(call_bytes.values())

    # the compute stream
    cuts = frozenset(t for r in steps.rows for t in r[:2])
    leaves = _flatten([(tr.ts[i], tr.end[i], i) for t in compute_threads for i in host[t]], cuts) if main else []
    comm_busy = _union([(tr.ts[i], tr.end[i]) for t in comm for i in host[t]]
                       + [(tr.ts[i], tr.end[i]) for ix in device.values() for i in ix if kinds[i] == "comm"])
    lookup_starts, lookup = [], []
    paid: set[int] = set()
    for s, e, i in leaves:
        step = steps.of(s)
        if facts[i][5]:  # nothing but a step marker open: a gap
            if step >= 0:
                for a, b, waiting in _split(s, e, comm_busy):
                    emit(a, b, "idle", "other", step, -1, "", "compute", "wait:rank" if waiting else "wait:host")
            continue
        cat, phase = classify(i, s)
        c = facts[i][2]
        nbytes = call_bytes.get(c, 0) if c >= 0 and c not in paid else 0
        if c >= 0:
            paid.add(c)
        emit(s, e, cat, phase, step, facts[i][3], facts[i][4], "compute", tr.names[i], nbytes)
        lookup_starts.append(s)
        lookup.append((e, phase, step, facts[i][3]))
    for c in calls:  # a call too short to own any time still carries its bytes
        if c not in paid and call_bytes.get(c):
            cat, phase = classify(c, tr.ts[c])
            emit(tr.ts[c], tr.ts[c], "communication", phase, steps.of(tr.ts[c]), facts[c][3], facts[c][4], "compute",
                 tr.names[c], call_bytes[c])

    def context(t0: float) -> tuple[str, int, int]:
        """(phase, step, microbatch) of the compute stream at ``t0``."""
        k = bisect.bisect_right(lookup_starts, t0) - 1
        if k >= 0 and t0 < lookup[k][0]:
            return lookup[k][1], lookup[k][2], lookup[k][3]
        return "other", steps.of(t0), -1

    # gloo's worker threads (one "comm" stream) and any other host thread
    others = [(f"thread:{t.split('/', 1)[-1]}", [t]) for t in host if t not in comm and t not in compute_threads]
    for stream, threads in ([("comm", sorted(comm))] if comm else []) + others:
        paid_runs: set[int] = set()
        for s, e, i in _flatten([(tr.ts[i], tr.end[i], i) for t in threads for i in host[t]]):
            phase, step, mb = context(s)
            nbytes = 0
            if stream == "comm" or facts[i][2] >= 0:
                cat = "communication"
                nbytes = 0 if host_bytes or i in paid_runs else payload_bytes(tr.args[i])[0]
                paid_runs.add(i)
            else:
                cat, phase = classify(i, s)
            emit(s, e, cat, phase if phase in PHASES else "other", step, facts[i][3] if facts[i][3] >= 0 else mb,
                 facts[i][4], stream, tr.names[i], nbytes)

    # device streams: kernels classified by the host op that launched them
    by_ext: dict[int, int] = {}
    by_corr: dict[int, int] = {}
    for ix in host.values():
        for i in ix:
            a = tr.args[i]
            if a is None:
                continue
            x, corr = a.get("External id"), a.get("correlation")
            if type(x) is int and (tr.cats[i] == "cpu_op" or x not in by_ext):  # an operator over a range
                by_ext[x] = i
            if type(corr) is int:
                by_corr[corr] = i
    for stream, ix in sorted(device.items()):
        paid_runs = set()
        for s, e, i in _flatten([(tr.ts[i], tr.end[i], i) for i in ix]):
            a = tr.args[i] or {}
            corr, x = a.get("correlation"), a.get("External id")
            launcher = by_corr.get(corr) if type(corr) is int else None
            if launcher is None and type(x) is int:
                launcher = by_ext.get(x)
            if launcher is not None:
                cat, phase = classify(launcher, tr.ts[launcher])
                step, mb, module = steps.of(tr.ts[launcher]), facts[launcher][3], facts[launcher][4]
            else:
                phase, step, mb = context(s)
                phase = phase if phase in PHASES else "other"
                cat, module = (phase if phase in ("forward", "backward", "optimizer", "data", "checkpoint")
                               else "forward"), ""
            nbytes = 0
            if kinds[i] == "comm":
                cat = "communication"
                if not host_bytes and i not in paid_runs:
                    nbytes = payload_bytes(a)[0]
                paid_runs.add(i)
            emit(s, e, cat, phase, step, mb, module, stream, tr.names[i], nbytes)
    pretty = [t[2:] if t else None for t in (main, *sorted(backward), *sorted(comm))]
    seen_info = {"events": n, "threads": {"main": pretty[0], "backward": pretty[1:1 + len(backward)],
                                          "comm": pretty[1 + len(backward):]},
                 "device_streams": sorted(device), "steps": [r[2] for r in steps.rows],
                 "negative_durations_clamped": tr.clamped}
    return rows, seen_info


def _union(intervals: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif e > s:
            out.append([s, e])
    return out


def _split(s: float, e: float, busy: list[list[float]]) -> Iterable[tuple[float, float, bool]]:
    """``[s, e)`` cut where ``busy`` intervals begin and end: (start, end, inside busy)."""
    k = max(bisect.bisect_right(busy, [s]) - 1, 0)
    t = s
    while t < e and k < len(busy):
        a, b = busy[k]
        if b <= t:
            k += 1
            continue
        if a > t:
            yield t, min(a, e), False
            t = min(a, e)
            continue
        yield t, min(b, e), True
        t = min(b, e)
        k += 1
    if t < e:
        yield t, e, False


# -- fitting max_spans ---------------------------------------------------------------------------------------

_KEYS = (["stream", "category", "phase", "step", "microbatch", "module", "name"],
         ["stream", "category", "phase", "step", "microbatch"],
         ["stream", "category", "step"])


def _cap(df: pd.DataFrame, max_spans: int) -> tuple[pd.DataFrame, int]:
    """At most ``max_spans`` spans of one rank, merging no more than it takes. A run of adjacent spans of one
    stream and kind (:data:`_KEYS`, finer first) merges in chunks of ``k`` spans, the smallest ``k`` that fits;
    a merged span lasts as long as its spans together, from the first one's start, and takes the name and
    module of its longest one. Last, one span per category of each stretch of a stream within one step.
    Every category's seconds per step and stream stay exact, and so do the bytes."""
    before = len(df)
    if before <= max_spans:
        return df, 0
    df = _merge_runs(df, _KEYS[0], None)  # identical neighbours: nothing is lost but their boundaries
    for keys in _KEYS[1:]:
        if len(df) <= max_spans:
            return df, before - len(df)
        lengths = np.bincount(_runs(df, keys)[1])
        if int(lengths.size) <= max_spans:  # whole runs would fit: find the smallest chunk that does
            lo, hi = 1, int(lengths.max())
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if int(np.ceil(lengths / mid).sum()) <= max_spans else (mid + 1, hi)
            return (out := _merge_runs(df, keys, lo)), before - len(out)
    df = _merge_runs(df, _KEYS[-1], None)
    if len(df) <= max_spans:
        return df, before - len(df)
    df = df.sort_values(["stream", "start"], kind="stable").reset_index(drop=True)
    window = (df[["stream", "step"]] != df[["stream", "step"]].shift()).any(axis=1).cumsum()
    df = df.assign(_w=window.to_numpy(), _d=(df["end"] - df["start"]).to_numpy())
    g = df.groupby(["_w", "category"], observed=True, sort=False)
    out = g.agg(rank=("rank", "first"), start=("start", "min"), _d=("_d", "sum"), phase=("phase", "first"),
                step=("step", "first"), microbatch=("microbatch", "first"), stream=("stream", "first"),
                bytes=("bytes", "sum")).reset_index()
    out = out.sort_values(["_w", "start"], kind="stable")
    first = out.groupby("_w")["start"].transform("min")
    offset = out.groupby("_w")["_d"].cumsum() - out["_d"]
    out["start"] = first + offset
    out["end"] = out["start"] + out["_d"]
    out["module"], out["name"] = "", "merged:" + out["category"].astype(str)
    return out[list(COLUMNS)].reset_index(drop=True), before - len(out)


def _runs(df: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """``df`` in stream order and the run of adjacent equal ``keys`` each row is in (0, 1, ...)."""
    df = df.sort_values(["stream", "start"], kind="stable").reset_index(drop=True)
    k = df[keys].astype(str)
    return df, (k != k.shift()).any(axis=1).cumsum().to_numpy() - 1


def _merge_runs(df: pd.DataFrame, keys: list[str], chunk: int | None) -> pd.DataFrame:
    """Each run of adjacent spans of equal ``keys`` merged, ``chunk`` spans at a time (None: whole runs)."""
    df, run = _runs(df, keys)
    group = run
    if chunk is not None and chunk > 1:
        pos = pd.Series(run).groupby(run).cumcount().to_numpy()
        group = run * (int(pos.max()) // chunk + 1) + pos // chunk
    elif chunk == 1:
        return df
    df = df.assign(_g=group, _d=(df["end"] - df["start"]).to_numpy())
    g = df.groupby("_g", sort=False)
    longest = df.loc[g["_d"].idxmax().to_numpy(), ["name", "module"]].reset_index(drop=True)
    out = g.agg(rank=("rank", "first"), start=("start", "first"), _d=("_d", "sum"), category=("category", "first"),
                phase=("phase", "first"), step=("step", "first"), microbatch=("microbatch", "first"),
                stream=("stream", "first"), bytes=("bytes", "sum")).reset_index(drop=True)
    out["name"], out["module"] = longest["name"].to_numpy(), longest["module"].to_numpy()
    out["end"] = out["start"] + out["_d"]
    return out[list(COLUMNS)].reset_index(drop=True)


# -- the import --------------------------------------------------------------------------------------------

def import_trace(source: Any, *, ranks: Sequence[int] | int | None = None,
                 max_spans: int | None = None) -> StepTimeline:
    """A :class:`StepTimeline` from torch.profiler traces (see the module's docstring).

    ``source``: a stopped ``torch.profiler.profile`` (not exported yet: torch exports a trace once), a trace
    file (``.json`` / ``.json.gz``), a list of them, or a directory: a run directory, its ``profile/``
    (``rank{r}.pt.trace.json.gz``), or Kineto's ``<host>_<pid>.<n>.pt.trace.json[.gz]`` files, whose
    ``distributedInfo.rank`` names the rank (files without one take the ranks after the named ones, in name
    order). ``ranks``: keep only these ranks; a single trace that names no rank is rank ``ranks[0]`` (else 0).
    ``max_spans``: at most about this many spans per rank (see :func:`_cap`).

    ``source`` of the result is ``measured`` for a workbench run directory, else ``imported``; ``device`` is
    ``cuda`` when a trace holds kernels, else ``cpu``. Every damaged or hostile file is one ValueError naming it."""
    want = _check_ranks(ranks)
    if max_spans is not None and (type(max_spans) is not int or max_spans < 1):
        raise ValueError(f"max_spans must be a positive int (spans per rank), not {max_spans!r:.40}")
    kind = "imported"
    if hasattr(source, "export_chrome_trace"):
        items: list[tuple[int | None, Any]] = [(None, source)]
    elif isinstance(source, (list, tuple)):
        if not source:
            raise ValueError(f"no trace files to import; {FIX}")
        items = [(None, p) for p in source]
    elif isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        items, measured = find_traces(source)
        kind = "measured" if measured else kind
    elif isinstance(source, (str, os.PathLike)):
        items = [(None, source)]
    else:
        raise ValueError(f"cannot import a trace from a {type(source).__name__}; pass a torch.profiler.profile, a "
                         ".json/.json.gz trace file, a list of them, or a directory of per-rank traces")

    # one file at a time: read, turned into spans (on its own clock), and let go
    parts: list[dict[str, Any]] = []
    named_ranks: list[int] = []
    for named, item in items:
        if want is not None and named is not None and named not in want:
            named_ranks.append(named)
            continue  # rank{r} files of other ranks: not even opened
        data, name = _load(item)
        r = named if named is not None else _trace_rank(data, name)
        if want is not None and r is not None and r not in want:
            named_ranks.append(r)
            continue
        info = data.get("distributedInfo") if type(data.get("distributedInfo")) is dict else {}
        base = _base_ns(data)
        tr = _Trace(data, name)
        del data
        rows, seen = _rank_spans(tr)
        df = pd.DataFrame.from_records(rows, columns=list(COLUMNS))
        del rows
        merged = 0
        if max_spans is not None and len(df):
            df, merged = _cap(df, max_spans)
        parts.append({"rank": r, "frame": df, "base": base, "first": min(tr.ts) if len(tr) else None, "name": name,
                      "info": info, "seen": seen, "merged": merged})
        del tr
    if not parts:
        raise ValueError(f"the traces hold ranks {sorted(named_ranks)[:16]}, none of ranks {sorted(want or [])[:16]}; "
                         "choose ranks that ran")
    # ranks: named ones as named; unnamed files follow in order (one unnamed trace: ranks[0] or 0)
    taken = [p["rank"] for p in parts if p["rank"] is not None]
    dup = {r for r in taken if taken.count(r) > 1}
    if dup:
        names = [p["name"] for p in parts if p["rank"] in dup][:2]
        raise ValueError(f"{' and '.join(names)} both hold rank {min(dup)}; import one run's traces at a time")
    nxt = min(want) if want and len(parts) == 1 else max(taken, default=-1) + 1
    for p in parts:
        if p["rank"] is None:
            p["rank"], nxt = nxt, nxt + 1
    if want is not None:  # (files that name no rank were numbered after the others)
        parts = [p for p in parts if p["rank"] in want]
        if not parts:
            raise ValueError(f"the traces name no rank among {sorted(want)[:16]}; choose ranks that ran")
    # one clock: each rank's profiler counts from its own base time
    bases = [p["base"] for p in parts]
    floor = min(bases) if all(b is not None for b in bases) else None
    dist: dict[str, Any] = {}
    for p in parts:
        offset = (p["base"] - floor) / 1e3 if floor is not None else 0.0
        p["frame"]["rank"] = p["rank"]
        p["frame"]["start"] += offset
        p["frame"]["end"] += offset
        p["first"] = None if p["first"] is None else p["first"] + offset
        if p["info"]:
            dist = {k: p["info"].get(k) for k in ("backend", "world_size") if type(p["info"].get(k)) in (str, int)}
    starts = [p["first"] for p in parts if p["first"] is not None]
    origin = min(starts) if starts else 0.0
    frame = pd.concat([p["frame"] for p in parts], ignore_index=True)
    frame["start"] = (frame["start"] - origin) * 1e-6
    frame["end"] = (frame["end"] - origin) * 1e-6
    frame["end"] = np.maximum(frame["end"], frame["start"])  # rounding never makes a span end before it starts
    meta = {"files": {str(p["rank"]): p["name"] for p in parts}, "traces": {str(p["rank"]): p["seen"] for p in parts},
            "origin_us": origin + (floor or 0) / 1e3, "distributed": dist,
            "spans_merged": sum(p["merged"] for p in parts), "max_spans": max_spans}
    device = "cuda" if any(p["seen"]["device_streams"] for p in parts) else "cpu"
    return StepTimeline(frame, source=kind, device=device, meta=meta)
