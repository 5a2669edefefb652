"""One x axis for two timelines: a prediction's phases drawn over the same phases of a measurement.

A measurement counts time in seconds and a prediction in event positions, so neither clock can be drawn
against the other. :meth:`MemoryTimeline.step_progress` puts both on a *step clock* (step s from x = s to
x = s + 1), but linearly inside each step, and the two spend their steps very differently: a prediction
spends most of its positions where the most tensors are made, a measurement most of its seconds where the
most arithmetic is done. So on the plain step clock a prediction's backward can sit over the measured
forward, and its peak over the wrong phase.

:func:`phase_clock` aligns them by phase instead::

    reference  |build|  fwd mb0  |  fwd mb1  |      bwd mb1      |     bwd mb0     |opt|
    other      |build|fwd mb0|fwd mb1|  bwd mb1  | bwd mb0 |          opt           |
                 each (step, microbatch, phase) span of the other is stretched onto the same span of
                 the reference: x is piecewise linear between the ends of matched spans

A span is a contiguous run of events of one (step, microbatch, phase), the bands of the view; the k-th
run of a key in one timeline is matched with the k-th run of the same key in the other. Matched spans
must come in the same order on both sides (the longest run of them that does is kept), so the clock
never runs backwards. Before the first and after the last matched span, the other timeline keeps its own
step clock, shifted to continue from the nearest match (a prediction may simulate fewer steps or
micro-batches than were measured).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from workbench.memory.timeline import MemoryTimeline

__all__ = ["PhaseClock", "phase_clock", "span_keys"]


def span_keys(tl: MemoryTimeline, rank: int, step: int | None = None) -> pd.DataFrame:
    """Every span of ``rank`` (``MemoryTimeline.phase_spans``) with its key: ``step, microbatch, phase, n``,
    ``n`` counting earlier runs of the same (step, microbatch, phase), so repeated runs stay apart."""
    spans = tl.phase_spans(rank, step=step)
    if spans.empty:
        return spans.assign(n=pd.Series(dtype=np.int64))
    n = spans.groupby(["step", "microbatch", "phase"], sort=False).cumcount()
    return spans.assign(n=n.to_numpy(dtype=np.int64))


@dataclass(frozen=True)
class PhaseClock:
    """Maps times of ``other``'s rank onto ``reference``'s step clock, phase against phase (call it).

    ``anchors_t`` (the other's times) and ``anchors_x`` (where they go) are the ends of the matched spans;
    ``matched`` counts the spans matched, ``unmatched`` the other's spans that were not."""

    anchors_t: np.ndarray
    anchors_x: np.ndarray
    matched: int
    unmatched: int
    _own: Any  # t -> the other's own step clock, shifted by step_shift

    def __call__(self, t: Any) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        own = self._own(t)
        if not len(self.anchors_t):
            return own
        x = np.interp(t, self.anchors_t, self.anchors_x)
        # outside the matched spans: the other's own step clock, continuing from the nearest anchor
        lo, hi = self.anchors_t[0], self.anchors_t[-1]
        before, after = t < lo, t > hi
        if before.any():
            x[before] = self.anchors_x[0] - (self._own(np.array([lo]))[0] - own[before])
        if after.any():
            x[after] = self.anchors_x[-1] + (own[after] - self._own(np.array([hi]))[0])
        return x


def phase_clock(reference: MemoryTimeline, ref_rank: int, other: MemoryTimeline, other_rank: int, *,
                step_map: dict[int, int] | None = None) -> PhaseClock:
    """The clock that draws ``other``'s rank ``other_rank`` over ``reference``'s rank ``ref_rank``, phase by
    phase, on the reference's step clock (:meth:`MemoryTimeline.step_progress`).

    ``step_map`` renames the other's steps first (e.g. ``{1: 4}``: its steady-state step 1 drawn over the
    measured step 4); steps it does not name keep their numbers."""
    step_map = {int(k): int(v) for k, v in (step_map or {}).items()}
    ref = span_keys(reference, ref_rank)
    oth = span_keys(other, other_rank)
    # one step drawn elsewhere (a step zoom): its own clock moves with it
    shift = float(next(iter(step_map.values())) - next(iter(step_map))) if len(step_map) == 1 else 0.0
    own = _shifted(other, other_rank, shift)
    if ref.empty or oth.empty:
        return PhaseClock(np.zeros(0), np.zeros(0), 0, len(oth), own)
    if step_map:
        oth = oth.assign(step=oth["step"].map(lambda s: step_map.get(int(s), int(s))).astype(np.int64))
    ref_x0 = reference.step_progress(ref_rank, ref["t0"].to_numpy())
    ref_x1 = reference.step_progress(ref_rank, ref["t1"].to_numpy())
    where = {k: i for i, k in enumerate(zip(ref["step"].tolist(), ref["microbatch"].tolist(),
                                            ref["phase"].tolist(), ref["n"].tolist()))}
    pairs = []  # (other span index, reference span index), in the other's order
    for i, k in enumerate(zip(oth["step"].tolist(), oth["microbatch"].tolist(), oth["phase"].tolist(),
                              oth["n"].tolist())):
        j = where.get(k)
        if j is not None:
            pairs.append((i, j))
    keep = _increasing([j for _, j in pairs])
    pairs = [pairs[p] for p in keep]
    t0, t1 = oth["t0"].to_numpy(), oth["t1"].to_numpy()
    at, ax = [], []
    for i, j in pairs:
        at += [t0[i], t1[i]]
        ax += [ref_x0[j], ref_x1[j]]
    at_, ax_ = _strictly_increasing(np.asarray(at, dtype=np.float64), np.asarray(ax, dtype=np.float64))
    return PhaseClock(at_, ax_, len(pairs), len(oth) - len(pairs), own)


def _shifted(tl: MemoryTimeline, rank: int, shift: float):
    def own(t: np.ndarray) -> np.ndarray:
        return tl.step_progress(rank, t) + shift
    return own


def _increasing(values: list[int]) -> list[int]:
    """Positions of a longest strictly increasing subsequence of ``values`` (O(n log n))."""
    tails: list[int] = []      # tails[k]: the smallest last value of an increasing run of length k + 1
    tail_at: list[int] = []    # ... and its position
    back = [-1] * len(values)
    for i, v in enumerate(values):
        k = bisect.bisect_left(tails, v)
        if k == len(tails):
            tails.append(v)
            tail_at.append(i)
        else:
            tails[k], tail_at[k] = v, i
        back[i] = tail_at[k - 1] if k else -1
    out, i = [], tail_at[-1] if tail_at else -1
    while i >= 0:
        out.append(i)
        i = back[i]
    return out[::-1]


def _strictly_increasing(t: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Anchors in order with no repeated time (a one-event span starts and ends at the same t: its first
    x is kept) and x never decreasing."""
    if not len(t):
        return t, x
    keep = np.r_[True, np.diff(t) > 0]
    t, x = t[keep], x[keep]
    return t, np.maximum.accumulate(x)
