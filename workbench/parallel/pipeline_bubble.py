"""Pipeline bubbles, measured from ``schedule`` events and predicted from the schedule's shape.

A step's span is from the first forward start to the last backward end over all pp ranks. A rank's
bubble is the part of that span it spends computing nothing::

    bubble(rank) = 1 - busy(rank) / span          theoretical = (p - 1) / (v m + p - 1)

with p pipeline ranks, m microbatches and v stages per rank (v = 2 for Interleaved1F1B), assuming
equal stages and a backward that costs a fixed multiple of the forward.
"""

from __future__ import annotations

from typing import Any, Iterable

import pandas as pd

__all__ = ["schedule_frame", "bubble_fraction", "theoretical_bubble", "schedule_shape", "complete_steps",
           "pipeline_steps", "pipeline_step"]

COLUMNS = ["rank", "step", "stage", "microbatch", "phase", "start", "end"]


def schedule_frame(events: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """One row per measured action, from ``schedule`` events (batched ``actions`` lists or one per action).

    Events from :func:`workbench.train.events.read_events` are already checked; a hand-made one that is
    not a schedule event as the trainer writes it is one ValueError naming what is wrong with it."""
    from workbench.event_schema import event_problem

    rows = []
    for e in events:
        if not isinstance(e, dict) or e.get("type") != "schedule":
            continue
        problem = event_problem(e)
        if problem is not None:
            known = type(e.get("rank")) is int and type(e.get("step")) is int
            where = f" (rank {e['rank']}, step {e['step']})" if known else ""
            raise ValueError(f"a schedule event{where} is not one the trainer writes: {problem}; pass the events "
                             "of workbench.train.events.read_events")
        for a in e.get("actions", [e]):
            rows.append({"rank": e["rank"], "step": e["step"], **{k: a[k] for k in COLUMNS[2:]}})
    return pd.DataFrame(rows, columns=COLUMNS)


def bubble_fraction(events: Iterable[dict[str, Any]], skip_first: bool = True) -> float:
    """Mean measured bubble fraction over ranks and steps (step 0 includes warm-up; skipped if others exist)."""
    df = schedule_frame(events)
    if df.empty:
        raise ValueError("no schedule events; they are written by runs with pp > 1")
    if skip_first and df["step"].nunique() > 1:
        df = df[df["step"] != df["step"].min()]
    fractions = []
    for _, step in df.groupby("step"):
        span = step["end"].max() - step["start"].min()
        busy = (step["end"] - step["start"]).groupby(step["rank"]).sum()
        fractions.extend(1.0 - busy / span)
    return float(sum(fractions) / len(fractions))


def theoretical_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the idle fraction of GPipe / 1F1B (v = 1) and interleaved 1F1B."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def schedule_shape(frame: pd.DataFrame) -> tuple[int, int, int]:
    """``(pp, microbatches, stages_per_rank)`` read off the measured actions (one step or many).

    A rank that runs v stages shows v distinct ``stage`` values; S stages over v per rank make pp = S / v.
    """
    if frame.empty:
        raise ValueError("no schedule actions; they are written by runs with pp > 1")
    v = int(frame.groupby("rank")["stage"].nunique().max())
    return int(frame["stage"].nunique()) // v, int(frame["microbatch"].nunique()), v


def complete_steps(frame: pd.DataFrame, ranks: Iterable[int] | None = None) -> list[int]:
    """Steps whose ``schedule`` event every rank has written (``ranks``: default, every rank seen).

    Each rank writes one step's actions in one event, so a step is whole once each rank has reported it;
    a live run's newest step may still be missing its slower ranks.
    """
    expected = set(frame["rank"]) if ranks is None else set(ranks)
    seen = frame.groupby("step")["rank"].agg(set)
    return sorted(int(step) for step, have in seen.items() if expected <= have)


def pipeline_steps(events: list[dict[str, Any]]) -> list[int]:
    """The steps of a run's events that every pipeline rank has reported (ValueError if it has no schedule)."""
    frame = schedule_frame(events)
    if frame.empty:
        raise ValueError("no schedule events; they are written by runs with pp > 1")
    ranks = {e["rank"] for e in events if isinstance(e, dict) and e.get("type") == "pipeline"
             and isinstance(e.get("rank"), int)} or None
    return complete_steps(frame, ranks)


def pipeline_step(events: list[dict[str, Any]], step: int | None = None) -> int:
    """The step a timeline shows by default: the last one every pipeline rank has reported, not step 0
    (it includes warm-up: stage shape inference, optimizer state creation) unless it is the only one.
    ``step`` given: that step, if it is complete. ValueError naming the problem otherwise."""
    done = pipeline_steps(events)
    if step is not None:
        if step not in done:
            raise ValueError(f"step {step} has no complete schedule; choose one of {done}")
        return step
    if not done:
        raise ValueError("no step has been reported by every pipeline rank yet")
    steady = [s for s in done if s != 0]
    return steady[-1] if steady else done[-1]
