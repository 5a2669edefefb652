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

This module imports nothing: the server extension, the core and the views all read it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CATEGORY_COLORS", "PHASE_COLORS", "KIND_COLORS", "BAND_OPACITY", "TOTAL_COLOR", "OVERLAY_COLOR",
           "PEAK_COLOR", "palette"]

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


def palette() -> dict[str, Any]:
    """The palette as JSON, what the server sends the JupyterLab tabs."""
    return {"categories": dict(CATEGORY_COLORS), "phases": dict(PHASE_COLORS), "band_opacity": list(BAND_OPACITY),
            "total": TOTAL_COLOR, "overlay": OVERLAY_COLOR, "peak": PEAK_COLOR}
