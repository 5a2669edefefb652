"""How far a memory prediction is from a measurement: per rank, the peak and what it is made of.

    cmp = workbench.memory.comparison(measured, predicted)      # two MemoryTimelines
    cmp.to_frame()          # one row per rank: measured and predicted peak, signed relative error
    cmp.category_frame()    # one row per (rank, category): bytes at each one's own peak, and the error
    cmp.summary()           # median and max |error| over ranks, the worst rank

Each side is compared at its *own* peak (the two peaks need not happen at the same moment: the
prediction may peak one microbatch earlier), so the question answered is "how much memory will each
rank need, and for what", not "is the curve the same". Only the peaks are compared, never the curves;
so that an equal size cannot hide a different cause, each row also says in which phase (and step)
each peak falls, and ``same_phase`` is False (flagged in the table) where the two differ. The error is
signed and relative to the measurement::

    error = (predicted - measured) / measured        > 0: the prediction is too high (safe side)

Ranks are matched by number. A prediction usually simulates one representative per group of ranks that
build and run identically; its ``meta["rank_map"]`` maps every rank (a string) to the representative that
stands for it, and is used when present (:func:`matching_rank`).

Where both sides know the allocator's reserved peak (``max_memory_reserved``: an imported CUDA snapshot's
segments, a CUDA prediction's caching allocator model), each row also has ``measured_reserved``,
``predicted_reserved`` and their ``reserved_error``; elsewhere these are None.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from workbench.display import RendersInNotebook
from workbench.memory.timeline import CATEGORIES, MemoryTimeline
from workbench.units import format_bytes

__all__ = ["compare", "MemoryComparison", "matching_rank", "matching_step", "relative_error"]

PEAK_COLUMNS = ["rank", "predicted_rank", "measured_peak", "predicted_peak", "error", "measured_step",
                "measured_phase", "predicted_step", "predicted_phase", "same_phase", "measured_reserved",
                "predicted_reserved", "reserved_error"]
CATEGORY_COLUMNS = ["rank", "category", "measured", "predicted", "error"]


def relative_error(predicted: float, measured: float) -> float:
    """``(predicted - measured) / measured``; 0 when both are 0, +-inf when only the measurement is 0."""
    if measured == 0:
        return 0.0 if predicted == 0 else math.copysign(math.inf, predicted)
    return (predicted - measured) / measured


def matching_rank(predicted: MemoryTimeline, rank: int) -> int | None:
    """The rank of ``predicted`` that stands for ``rank``: its ``rank_map`` entry when it has one, else
    ``rank`` itself when it was simulated, else None."""
    rank_map = predicted.meta.get("rank_map")
    if rank_map:
        rep = rank_map.get(str(rank))
        if rep is None:
            return None
        rep = int(rep)
        if rep not in predicted.ranks:
            raise ValueError(f"the prediction's rank_map sends rank {rank} to rank {rep}, which it did not simulate "
                             f"(it has ranks {predicted.ranks}); predict again without ranks=")
        return rep
    return rank if rank in predicted.ranks else None


def matching_step(predicted: MemoryTimeline, step: int) -> int | None:
    """The step of ``predicted`` to draw against a measured ``step``: the same step when it was simulated,
    else its last one (a prediction simulates a step or two; the last is the steady state)."""
    steps = predicted.steps
    if not steps:
        return None
    return step if step in steps else steps[-1]


@dataclass(eq=False)  # frames inside: compare the numbers with to_frame(), not the objects
class MemoryComparison(RendersInNotebook):
    """A measurement against a prediction, rank by rank. Evaluate it in a notebook for the overlay view.

    ``peaks`` has one row per compared rank (:data:`PEAK_COLUMNS`), ``categories`` one per (rank,
    category) (:data:`CATEGORY_COLUMNS`). ``unmatched`` lists measured ranks the prediction has nothing for.
    """

    measured: MemoryTimeline
    predicted: MemoryTimeline
    peaks: pd.DataFrame
    categories: pd.DataFrame
    unmatched: list[int] = field(default_factory=list)

    def to_frame(self) -> pd.DataFrame:
        return self.peaks.copy()

    def category_frame(self) -> pd.DataFrame:
        return self.categories.copy()

    def summary(self) -> dict[str, Any]:
        """Median and max |peak error| over the compared ranks, the rank with the largest, and the ranks whose
        two peaks fall in different phases."""
        err = self.peaks["error"].abs()
        worst = int(self.peaks["rank"].iloc[int(np.argmax(err.to_numpy()))]) if len(err) else None
        res = pd.to_numeric(self.peaks["reserved_error"], errors="coerce").abs().dropna()
        reserved = ({"reserved_median_abs_error": _num(res.median()), "reserved_max_abs_error": _num(res.max())}
                    if len(res) else {})
        return {**reserved, "ranks": len(self.peaks), "compared": "peaks (each side at its own peak; curves are not compared)",
                "median_abs_error": _num(err.median()) if len(err) else None,
                "max_abs_error": _num(err.max()) if len(err) else None, "worst_rank": worst,
                "phase_mismatch_ranks": self.phase_mismatch_ranks(), "unmatched_ranks": list(self.unmatched),
                "measured": {"source": self.measured.source, "device": self.measured.device},
                "predicted": {"source": self.predicted.source, "device": self.predicted.device}}

    def phase_mismatch_ranks(self) -> list[int]:
        """Ranks whose measured and predicted peaks fall in different phases: their sizes may agree for
        different reasons (e.g. a prediction peaking in forward against a measurement peaking in backward)."""
        return [int(r) for r, same in zip(self.peaks["rank"], self.peaks["same_phase"]) if not same]

    def to_json(self) -> str:
        """The summary, the per-rank peaks and the per-category rows (an infinite error is null)."""
        def records(df: pd.DataFrame) -> list[dict[str, Any]]:
            return [{k: _num(v) for k, v in row.items()} for row in df.to_dict(orient="records")]

        return json.dumps({"summary": self.summary(), "peaks": records(self.peaks),
                           "categories": records(self.categories)})

    def __repr__(self) -> str:
        s = self.summary()
        if not s["ranks"]:
            return "MemoryComparison(no rank in common)"
        odd = s["phase_mismatch_ranks"]
        where = f"; peaks in different phases on rank(s) {_ranks_text(odd)}" if odd else ""
        return (f"MemoryComparison({s['ranks']} rank(s), median |error| {s['median_abs_error']:.1%}, "
                f"max {s['max_abs_error']:.1%} on rank {s['worst_rank']}{where})")

    def _repr_html_(self) -> str:
        by_rank = {r: g.set_index("category") for r, g in self.categories.groupby("rank")}
        head = "".join(f"<th>{h}</th>" for h in ("rank", "measured peak", "measured in", "predicted peak",
                                                 "predicted in", "error", *CATEGORIES))
        rows = []
        for p in self.peaks.itertuples(index=False):
            cats = by_rank.get(p.rank)
            cells = "".join(
                f"<td title='measured {format_bytes(cats.at[c, 'measured'])}, predicted "
                f"{format_bytes(cats.at[c, 'predicted'])}'>{_pct(cats.at[c, 'error'])}</td>"
                if cats is not None and (cats.at[c, "measured"] or cats.at[c, "predicted"]) else "<td></td>"
                for c in CATEGORIES)
            via = f" (as {p.predicted_rank})" if p.predicted_rank != p.rank else ""
            flag = ("" if p.same_phase else
                    " <span class='pw-phase-differs' style='color:#b35806' title='the two peaks fall in different "
                    "phases: the sizes may agree for different reasons'>&#9888; different phase</span>")
            rows.append(f"<tr><td>{p.rank}{via}</td><td>{format_bytes(p.measured_peak)}</td>"
                        f"<td>{_where(p.measured_phase, p.measured_step)}</td>"
                        f"<td>{format_bytes(p.predicted_peak)}</td>"
                        f"<td>{_where(p.predicted_phase, p.predicted_step)}{flag}</td>"
                        f"<td><b>{_pct(p.error)}</b></td>{cells}</tr>")
        note = (f"<br><i>no prediction for measured rank(s) {html.escape(str(self.unmatched))}</i>"
                if self.unmatched else "")
        return (f"<div><b>{html.escape(repr(self))}</b><table><tr>{head}</tr>{''.join(rows)}</table>"
                f"<small>Compared: the peaks only, each side at its own peak (the curves are not compared), "
                f"and the phase each peak falls in. error = (predicted - measured) / measured; the category "
                f"columns are the same error per category at the peaks (hover for the bytes).</small>{note}</div>")


def compare(measured: MemoryTimeline, predicted: MemoryTimeline) -> MemoryComparison:
    """Compare each measured rank's peak, and its bytes per category there, with its prediction's.

    Raises ValueError when no measured rank has a prediction (the numbers, or the rank_map, do not match).
    """
    peak_rows: list[dict[str, Any]] = []
    cat_rows: list[dict[str, Any]] = []
    unmatched: list[int] = []
    predicted_peaks: dict[int, Any] = {}
    for rank in measured.ranks:
        rep = matching_rank(predicted, rank)
        if rep is None:
            unmatched.append(rank)
            continue
        m = measured.peak(rank)
        if rep not in predicted_peaks:  # one representative often stands for many ranks
            predicted_peaks[rep] = predicted.peak(rep)
        p = predicted_peaks[rep]
        m_res, p_res = measured.reserved_peak(rank), predicted.reserved_peak(rep)
        peak_rows.append({"rank": rank, "predicted_rank": rep, "measured_peak": m.bytes, "predicted_peak": p.bytes,
                          "error": relative_error(p.bytes, m.bytes), "measured_step": m.step,
                          "measured_phase": m.phase, "predicted_step": p.step, "predicted_phase": p.phase,
                          "same_phase": m.phase == p.phase, "measured_reserved": m_res, "predicted_reserved": p_res,
                          "reserved_error": relative_error(p_res, m_res) if m_res is not None and p_res is not None
                          else None})
        for c in CATEGORIES:
            mb, pb = m.by_category.get(c, 0), p.by_category.get(c, 0)
            cat_rows.append({"rank": rank, "category": c, "measured": mb, "predicted": pb,
                             "error": relative_error(pb, mb)})
    if not peak_rows:
        raise ValueError(f"the prediction covers none of the measured ranks {measured.ranks} (it has ranks "
                         f"{predicted.ranks}{' and a rank_map' if predicted.meta.get('rank_map') else ''}); "
                         "predict the same layout as the measured run")
    return MemoryComparison(measured, predicted, pd.DataFrame(peak_rows, columns=PEAK_COLUMNS),
                            pd.DataFrame(cat_rows, columns=CATEGORY_COLUMNS), unmatched)


def _num(v: Any) -> Any:
    """A JSON-safe scalar: numpy numbers as Python ones, inf and NaN as None."""
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def _where(phase: str, step: int) -> str:
    return html.escape(phase) + (f", step {int(step)}" if step >= 0 else "")


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} ranks)]"


def _pct(e: float) -> str:
    return f"{e:+.1%}" if math.isfinite(e) else ("+inf" if e > 0 else "-inf")
