"""The one set of colours every plot of the workbench uses: notebook views, the JupyterLab tabs, exports.

A category is one colour wherever it appears (a plan's bytes per rank, a memory timeline's stacked
areas, a checkpoint's bytes by kind), so a reader who learnt "parameter is blue" in one view reads the
next one without a legend. The JupyterLab extension gets this palette from the server
(:func:`palette`), never a copy of its own.

* :data:`CATEGORY_COLORS`: the memory categories (``workbench.memory.timeline.CATEGORIES``) plus
  ``master`` (the fp32 copy a plan shows beside them). The first three are the plan's state kinds.
* :data:`PHASE_COLORS`: the phases (``workbench.memory.timeline.PHASES``), drawn as translucent bands
  behind the data (:data:`BAND_OPACITY`: even and odd microbatches, so neighbours stay apart).
* :data:`TOTAL_COLOR`, :data:`OVERLAY_COLOR`, :data:`PEAK_COLOR`: the total line, another timeline's
  total dashed over it (a prediction), and the peak marker. None of them is a category's colour, so the
  total never reads as one more category.

Beside the colours, what both memory views write the same way (:func:`band_opacity`, :func:`peak_where`,
:func:`memory_x_title`) and how much they show (:data:`MAX_BANDS`, :data:`TABLE_ROWS`), so the Lab tab and
the notebook view cannot drift apart.

This module imports nothing: the server extension, the core and the views all read it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CATEGORY_COLORS", "PHASE_COLORS", "KIND_COLORS", "BAND_OPACITY", "TOTAL_COLOR", "OVERLAY_COLOR",
           "PEAK_COLOR", "MAX_BANDS", "TABLE_ROWS", "TIME_COLORS", "palette", "band_opacity", "peak_where",
           "memory_x_title"]

CATEGORY_COLORS = {
    "parameter": "#1f77b4", "gradient": "#ff7f0e", "optimizer": "#2ca02c", "activation": "#d62728",
    "temporary": "#e377c2", "communication": "#17becf", "checkpoint": "#bcbd22", "other": "#7f7f7f",
    "master": "#9467bd",
}
PHASE_COLORS = {"build": "#9e9e9e", "forward": "#6baed6", "backward": "#fd8d3c", "optimizer": "#74c476",
                "checkpoint": "#c7b42c", "other": "#d9d9d9"}
BAND_OPACITY = (0.22, 0.12)  # even / odd microbatch
TOTAL_COLOR = "#333333"
OVERLAY_COLOR = "#000000"
PEAK_COLOR = "#000000"
# A checkpoint's kinds: a kind saved from an in-memory category keeps its colour (model = parameter).
KIND_COLORS = {"parameter": CATEGORY_COLORS["parameter"], "gradient": CATEGORY_COLORS["gradient"],
               "optimizer": CATEGORY_COLORS["optimizer"], "master": CATEGORY_COLORS["master"],
               "model": CATEGORY_COLORS["parameter"], "rng": "#8c564b", "extra": "#7f7f7f"}
# A step timeline's categories (workbench.time.timeline.CATEGORIES): optimizer, communication and checkpoint
# keep their memory colours; forward and backward are the phase bands' hues, darker; idle is pale grey.
TIME_COLORS = {"forward": "#3182bd", "backward": "#e6550d", "optimizer": CATEGORY_COLORS["optimizer"],
               "communication": CATEGORY_COLORS["communication"], "data": "#8c564b",
               "checkpoint": CATEGORY_COLORS["checkpoint"], "idle": "#d0d0d0"}


MAX_BANDS = 200  # phase bands a memory view draws at most (more are joined by the core)
TABLE_ROWS = 10  # rows of the alive-at-peak tables


def band_opacity(microbatch: int) -> float:
    """A phase band's opacity: even and odd microbatches alternate; no microbatch (-1) is even."""
    return BAND_OPACITY[microbatch % 2 if microbatch >= 0 else 0]


def peak_where(phase: str, step: int, microbatch: int) -> str:
    """Where a peak fell, as its annotation says: "backward, step 2, microbatch 1"."""
    return f"{phase}, step {step}" + (f", microbatch {microbatch}" if microbatch >= 0 else "")


def memory_x_title(source: str, clock: str, overlay: bool) -> str:
    """A memory timeline's x axis title: the step clock (``clock == "step"``), else a measurement's seconds
    or a prediction's event positions."""
    if clock == "step":
        return ("step (each step from its first event to the next step's"
                + ("; the dashed line aligned phase by phase)" if overlay else ")"))
    return "seconds since recording began" if source != "predicted" else "event position (simulated clock)"


def palette() -> dict[str, Any]:
    """The palette as JSON, what the server sends the JupyterLab tabs."""
    return {"categories": dict(CATEGORY_COLORS), "phases": dict(PHASE_COLORS), "band_opacity": list(BAND_OPACITY),
            "total": TOTAL_COLOR, "overlay": OVERLAY_COLOR, "peak": PEAK_COLOR, "time": dict(TIME_COLORS)}
