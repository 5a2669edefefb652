"""What an event of ``events.jsonl`` is: the checks every reader applies to a line before handing it out
(:func:`event_problem`, :func:`action_problem`). A module of its own, below every package, so that
:mod:`workbench.parallel.pipeline_bubble` checks hand-made schedule events the same way without importing
:mod:`workbench.train` (whose trainer imports the checkpoint package, which imports the parallel one).
:mod:`workbench.train.events` reads and writes the file and re-exports these."""

from __future__ import annotations

from typing import Any

LAUNCHER_RANK = -1  # the rank of the launcher's own events (launch, run_end)

# -- what an event is ----------------------------------------------------------------------------------

_INDEX_MAX = 1 << 31  # ranks, nodes, stages, microbatches: what int32 and numpy hold
_STEP_MAX = 1 << 62
_STEP_METRICS = ("loss", "tokens_per_s", "step_time_s", "mem_bytes", "grad_norm", "lr")
_ACTION_KEYS = ("stage", "microbatch", "phase", "start", "end")


_ABSENT = object()
_METRIC_TYPES = frozenset({int, float, type(None)})  # (a diverged loss is NaN, and says so)


def _index(x: Any, lo: int = 0, hi: int = _INDEX_MAX) -> bool:
    return type(x) is int and lo <= x < hi  # (not bool: True is no rank)


def _finite(x: Any) -> bool:
    return type(x) is int or (type(x) is float and x - x == 0)  # (inf - inf and nan - nan are nan)


def action_problem(a: Any) -> str | None:
    """What is wrong with one measured pipeline action (``stage``, ``microbatch``, ``phase``, ``start``,
    ``end``), or None."""
    if type(a) is not dict:
        return "a schedule action is not an object"
    missing = [k for k in _ACTION_KEYS if k not in a]
    if missing:
        return f"a schedule action has no {missing[0]!r}"
    if not (_index(a["stage"]) and _index(a["microbatch"])):
        return "a schedule action's stage or microbatch is not a small non-negative integer"
    if type(a["phase"]) is not str:
        return "a schedule action's phase is not text"
    if not (_finite(a["start"]) and _finite(a["end"])):
        return "a schedule action's start or end is not a finite number"
    return None


def event_problem(e: Any) -> str | None:
    """What makes ``e`` no event this module's readers hand out, or None: an object with a text ``type``
    and an integer ``rank`` (-1: the launcher), a finite ``time``, an integer ``step``/``node`` where
    present, numbers (or null) for a step's metrics, text for a ``run_end``'s status, and a ``schedule``
    event's measured actions. Consumers may index what is checked here; other fields they check
    themselves. (Every line of a run passes here: the common case is written out, without calls.)"""
    if type(e) is not dict:
        return f"a JSON {type(e).__name__}, not an object"
    kind, rank = e.get("type"), e.get("rank")
    if type(kind) is not str:
        return "no text 'type'"
    if type(rank) is not int or not LAUNCHER_RANK <= rank < _INDEX_MAX:
        return "'rank' is not an integer from -1 (the launcher) up"
    t = e.get("time", _ABSENT)
    if t is not _ABSENT and not (type(t) is float and t - t == 0 or type(t) is int):
        return "'time' is not a finite number"
    step = e.get("step", _ABSENT)
    if step is not _ABSENT and (type(step) is not int or not 0 <= step < _STEP_MAX):
        return "'step' is not a non-negative integer"
    if "node" in e and not _index(e["node"]):
        return "'node' is not a non-negative integer"
    if kind == "step":
        for k in _STEP_METRICS:
            if type(e.get(k)) not in _METRIC_TYPES:
                return f"a step's {k!r} is not a number"
    elif kind == "schedule":
        if step is _ABSENT:
            return "a schedule event has no 'step'"
        actions = e.get("actions", [e])
        if type(actions) is not list:
            return "a schedule event's 'actions' is not a list"
        for a in actions:
            problem = action_problem(a)
            if problem:
                return problem
    elif kind == "pipeline":
        if "microbatches" in e and not _index(e["microbatches"], 1):
            return "a pipeline event's 'microbatches' is not a positive integer"
        if "schedule" in e and type(e["schedule"]) is not str:
            return "a pipeline event's 'schedule' is not text"
    elif kind == "run_end":
        if type(e.get("status")) is not str:
            return "a run_end event's 'status' is not text"
    return None
