"""Axis ticks people read: steps of 1, 2 or 5 times a power of ten, in a named unit.

A plot whose ticks are the range cut in four (``457.03 MiB``, ``0.7201 s``) makes the reader do the
arithmetic. These helpers pick a round step instead, and say how many decimals its labels need::

    byte_axis(457_000_000)        -> unit "MiB", ticks 0, 100, ..., 500 MiB (in bytes), labels "0" ... "500"
    number_axis(0.13, 2.9)        -> step 0.5: ticks 0.5, 1, 1.5, 2, 2.5; labels "0.5", "1", ... "2.5"

The JupyterLab memory tab draws the axes the server computes here (``workbench.jupyter.timelines``),
so its labels and its zoom label are the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

from workbench.units import axis_unit

__all__ = ["nice_step", "decimals", "tick_label", "number_axis", "byte_axis"]


def nice_step(span: float, target: int = 5) -> float:
    """The step of 1, 2 or 5 times a power of ten that cuts ``span`` into about ``target`` intervals (at
    most ``target``; 1 for an empty or non-finite span)."""
    if not (math.isfinite(span) and span > 0):
        return 1.0
    raw = span / max(1, target)
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * power >= raw * (1 - 1e-9):
            return m * power
    return 10 * power  # pragma: no cover - the loop always returns


def decimals(step: float) -> int:
    """Decimals a label of a multiple of ``step`` needs (0.5 -> 1, 0.05 -> 2, 20 -> 0)."""
    return max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0


def tick_label(value: float, step: float) -> str:
    """``value`` (a multiple of ``step``) with the decimals the step needs, trailing zeros dropped (as
    plotly writes ticks: 0.5, 1, 1.5); never ``-0``."""
    text = f"{value:.{decimals(step)}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if float(text) == 0 else text


def _multiples(lo: float, hi: float, step: float) -> list[float]:
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    # round to the step's decimals so 0.1 * 3 is 0.3, not 0.30000000000000004
    return [round(k * step, decimals(step) + 1) for k in range(first, last + 1)]


def number_axis(lo: float, hi: float, target: int = 6) -> dict[str, Any]:
    """Ticks inside ``[lo, hi]`` (a time or step window): the range stays the window, the ticks are the
    round multiples of the step that fall in it. ``window_label`` writes the window with one decimal more
    than the ticks, so it agrees with the axis it names."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:  # one instant: a unit window around it
        lo, hi = lo - 0.5, hi + 0.5
    step = nice_step(hi - lo, target)
    ticks = _multiples(lo, hi, step)
    d = decimals(step) + 1
    return {"range": [lo, hi], "step": step, "ticks": ticks, "labels": [tick_label(v, step) for v in ticks],
            "window_label": f"{lo:.{d}f} – {hi:.{d}f}"}


def byte_axis(top: float, target: int = 6) -> dict[str, Any]:
    """A bytes axis from 0 to the first round tick at or above ``top``, in the binary unit that keeps
    ``top`` at 1 or more (:func:`workbench.units.axis_unit`, what the notebook view uses). ``ticks`` are in
    bytes, ``labels`` in ``unit``."""
    top = float(top) if math.isfinite(top) and top > 0 else 1.0
    unit, scale = axis_unit(top)
    step = nice_step(top / scale, target)
    n = max(1, math.ceil(top / scale / step - 1e-9))
    values = [round(k * step, decimals(step) + 1) for k in range(n + 1)]
    return {"unit": unit, "scale": scale, "range": [0, values[-1] * scale], "step": step * scale,
            "ticks": [v * scale for v in values], "labels": [tick_label(v, step) for v in values]}
