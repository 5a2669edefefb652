"""``MemoryTimelineView``: where a rank's memory goes, step by step, drawn from a :class:`MemoryTimeline`.

A thin view: every number comes from the timeline (``downsample``, ``phase_spans``, ``peak``,
``alive_at``, ``modules_at_peak``, ``step_progress``); the view only draws them::

    view = MemoryTimelineView(measured)                     # or just evaluate the timeline in a notebook
    view = MemoryTimelineView(measured, overlay=predicted)  # the prediction as a dashed total
    view = MemoryTimelineView(measured, band=predict_band(job))  # a MoE's routing band behind it
    view.select_rank(3); view.select_step(2)                # or the dropdowns
    view.show("ranks")                                      # small multiples: every rank's total
    view.to_html("memory.html")                             # one offline file, plotly.js inlined

* **one rank**: bytes alive per category, stacked (one fixed colour per category, in the order of
  ``CATEGORIES``), with the total as a thin line on top. Behind it, translucent bands name what the
  program was doing (forward, backward, optimizer, checkpoint...); alternate microbatches are shaded
  lighter. The peak is marked and annotated (bytes, phase, step), and the table under the figure lists
  what is alive there: the largest allocations and the modules that made them.
* **step**: zooms to one step, every event of it redrawn at full resolution (``downsample(step=)``).
  The peak marker then shows the step's own peak; the table stays on the rank's overall peak.
* **small multiples**: a grid of every rank's total (the first ``max_ranks``), one shared y axis so the
  heaviest rank stands out.
* **overlay**: another timeline's total as a dashed line, e.g. a prediction over a measurement. Rank r
  is compared with the overlay's rank that stands for it (its ``rank_map``, see
  :func:`workbench.memory.comparison.matching_rank`). A measurement counts time in seconds, a prediction in
  event positions, so when the two sources differ (``x="auto"``) they are drawn on the timeline's *step
  clock* (:meth:`MemoryTimeline.step_progress`: step s runs from x = s to x = s + 1), the overlay aligned
  by phase (:func:`workbench.memory.clock.phase_clock`): each of its (step, microbatch, phase) spans is
  stretched onto the same span of the timeline, so its forward lies over the forward band, its backward
  over the backward band, and its peak in the phase where it happened. Zoomed to a step the prediction
  does not have, its last (steady-state) step is aligned with the shown one.
* **routing band** (a mixture of experts, :class:`workbench.prediction.routing.MemoryBand`): the area
  between the predicted total with balanced routing (low) and with the worst-case skew (high), on the step
  clock, each side aligned by phase as the overlay is. Evaluating a band shows it over its low timeline.

10^6 events stay quick: at most ``max_points`` points per trace (the core keeps each bin's largest
total, so the peak is never smoothed away) and at most ``max_bands`` bands (the core joins spans).
Everything renders offline: the PlotView's JavaScript ships with the plotly package, and
:meth:`to_html` inlines plotly.js (``include_plotlyjs=True``), never a CDN.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench import palette
from workbench.display import register_view
from workbench.memory.clock import PhaseClock, phase_clock
from workbench.memory.comparison import MemoryComparison, matching_rank, matching_step
from workbench.memory.timeline import CATEGORIES, PHASES, MemoryTimeline, Peak
from workbench.prediction.routing import MemoryBand
from workbench.units import axis_unit, format_bytes
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

# The core palette (workbench.palette): the JupyterLab memory tab draws with the same colours.
CATEGORY_COLORS = {c: palette.CATEGORY_COLORS[c] for c in CATEGORIES}
PHASE_COLORS = dict(palette.PHASE_COLORS)
OVERLAY_COLOR = palette.OVERLAY_COLOR
TOTAL_COLOR = palette.TOTAL_COLOR
TABLE_ROWS = palette.TABLE_ROWS
BAND_COLOR, BAND_LINE = "rgba(221, 132, 82, 0.25)", "#dd8452"  # the routing band: translucent orange
assert set(CATEGORY_COLORS) == set(CATEGORIES) and set(PHASE_COLORS) == set(PHASES)



class MemoryTimelineView:
    """Explore a :class:`MemoryTimeline` (optionally against ``overlay``). Evaluate to show.

    ``rank`` is the rank shown first (default: the one with the largest peak), ``step`` a step to zoom
    to (None: all), ``mode`` ``"rank"`` or ``"ranks"`` (small multiples). ``x`` is ``"time"`` (each
    timeline's own ``t``), ``"step"`` (the step clock) or ``"auto"`` (step when ``overlay`` comes from a
    different source). ``max_points`` bounds the points of a trace, ``max_bands`` the phase bands,
    ``max_ranks`` the small multiples (``grid_points`` points each). ``band``: a MoE prediction's routing
    band (:class:`MemoryBand`), drawn as the area from its low to its high total (on the step clock).
    Drive it from code with
    :meth:`select_rank`, :meth:`select_step` and :meth:`show`; read ``fig``, ``grid_fig``, ``table``.
    """

    def __init__(self, timeline: MemoryTimeline, overlay: MemoryTimeline | None = None, *, rank: int | None = None,
                 step: int | None = None, mode: str = "rank", x: str = "auto", max_points: int = 2000,
                 max_bands: int = palette.MAX_BANDS, max_ranks: int = 16, grid_points: int = 400,
                 band: MemoryBand | None = None):
        if not timeline.ranks:
            raise ValueError("this memory timeline has no ranks; record one with `workbench train ... --memory`")
        if mode not in ("rank", "ranks"):
            raise ValueError(f"mode={mode!r}: choose 'rank' (one rank in detail) or 'ranks' (small multiples)")
        if x not in ("auto", "time", "step"):
            raise ValueError(f"x={x!r}: choose 'time', 'step' (progress through each step) or 'auto'")
        if max_points < 3 or max_bands < 1 or max_ranks < 1:
            raise ValueError(f"max_points={max_points}, max_bands={max_bands}, max_ranks={max_ranks}: "
                             "ask for at least 3 points, 1 band and 1 rank")
        if band is not None and x == "time":
            raise ValueError("x='time' with a routing band: the band is drawn on the step clock; use x='step' or 'auto'")
        self.timeline, self.overlay, self.band = timeline, overlay, band
        self.x = x if x != "auto" else ("step" if band is not None or (overlay is not None
                                                                       and overlay.source != timeline.source)
                                        else "time")
        self.max_points, self.max_bands = max_points, max_bands
        self.max_ranks, self.grid_points = max_ranks, grid_points
        self._peaks: dict[int, Peak] = {}
        self._clocks: dict[tuple, PhaseClock] = {}
        self._busy = False  # set while the view sets its own controls, so observers don't redraw twice
        best = None
        if rank is None:
            best = timeline.peak()
            self._peaks[best.rank] = best
            rank = best.rank
        self._check_rank(rank)
        self._check_step(step)
        self._rank, self._step, self._mode = rank, step, mode
        self._grid_step: object = ()  # the step the grid was drawn for (() = never drawn)
        self._band_note = ""

        style = {"description_width": "initial"}
        self.controls: dict[str, widgets.ValueWidget] = {
            "rank": widgets.Dropdown(options=[(f"rank {r}", r) for r in timeline.ranks], value=rank,
                                     description="rank", style=style, layout=widgets.Layout(width="170px")),
            "step": widgets.Dropdown(options=[("all steps", -1)] + [(f"step {s}", s) for s in timeline.steps],
                                     value=-1 if step is None else step, description="step", style=style,
                                     layout=widgets.Layout(width="170px")),
            "mode": widgets.ToggleButtons(options=[("one rank", "rank"), ("small multiples", "ranks")], value=mode,
                                          style={"button_width": "120px"}),
        }
        self.header = widgets.HTML(self._header_html(best))
        self.note = widgets.HTML("")
        self.fig = PlotView(layout={
            "height": 480, "width": 1040, "margin": {"l": 70, "r": 20, "t": 50, "b": 50}, "hovermode": "x unified",
            "legend": {"font": {"size": 10}, "tracegroupgap": 12}, "plot_bgcolor": "white",
            "yaxis": {"gridcolor": "#eeeeee", "rangemode": "tozero"}, "xaxis": {"gridcolor": "#eeeeee"}})
        self.grid_fig = PlotView()
        self.table = widgets.HTML("")
        self.rank_box = widgets.VBox([self.fig, self.table])
        self.grid_box = widgets.VBox([self.grid_fig])
        c = self.controls
        c["rank"].observe(lambda ch: None if self._busy else self.select_rank(ch["new"]), "value")
        c["step"].observe(lambda ch: None if self._busy else self.select_step(None if ch["new"] < 0 else ch["new"]),
                          "value")
        c["mode"].observe(lambda ch: None if self._busy else self.show(ch["new"]), "value")
        self.widget = widgets.VBox([self.header, widgets.HBox([c["mode"], c["rank"], c["step"]]), self.note,
                                    self.rank_box, self.grid_box])
        self._redraw()

    # -- notebook display ---------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        at = "all steps" if self._step is None else f"step {self._step}"
        over = f", overlay {self.overlay.source}" if self.overlay is not None else ""
        return (f"MemoryTimelineView({self.timeline.source}, {len(self.timeline.ranks)} ranks, rank {self._rank}, "
                f"{at}, {self._mode}{over})")

    # -- state --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def step(self) -> int | None:
        return self._step

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def grid_ranks(self) -> list[int]:
        """The ranks the small multiples show (the first ``max_ranks``)."""
        return self.timeline.ranks[: self.max_ranks]

    # -- actions ------------------------------------------------------------------------------------
    def select_rank(self, rank: int) -> None:
        """Show ``rank`` in detail (switching to the one-rank mode)."""
        self._check_rank(rank)
        self._rank, self._mode = int(rank), "rank"
        self._redraw()

    def select_step(self, step: int | None) -> None:
        """Zoom to ``step`` (None: every step)."""
        self._check_step(step)
        self._step = step
        self._redraw()

    def show(self, mode: str) -> None:
        """``"rank"``: one rank in detail; ``"ranks"``: the small multiples."""
        if mode not in ("rank", "ranks"):
            raise ValueError(f"mode={mode!r}: choose 'rank' or 'ranks'")
        self._mode = mode
        self._redraw()

    def to_html(self, path: str | Path) -> Path:
        """Write what the view shows now to one self-contained HTML file (plotly.js inlined, no CDN)."""
        fig = self.fig if self._mode == "rank" else self.grid_fig
        body = fig.to_html(full_html=False, include_plotlyjs=True, include_mathjax=False)
        table = self.table.value if self._mode == "rank" else ""
        title = html.escape(repr(self))
        doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
               f"{self.header.value}{self.note.value}{body}{table}</body></html>")
        path = Path(path)
        path.write_text(doc, encoding="utf-8")
        return path

    # -- drawing ------------------------------------------------------------------------------------
    def _redraw(self) -> None:
        self._busy = True
        try:
            self.controls["rank"].value = self._rank
            self.controls["step"].value = -1 if self._step is None else self._step
            self.controls["mode"].value = self._mode
        finally:
            self._busy = False
        one = self._mode == "rank"
        self.rank_box.layout.display = "" if one else "none"
        self.grid_box.layout.display = "none" if one else ""
        if one:
            self._draw_rank()
        elif self._grid_step != self._step:
            self._draw_grid()
        self.note.value = self._note_html()

    def _peak(self, rank: int) -> Peak:
        if rank not in self._peaks:
            self._peaks[rank] = self.timeline.peak(rank)
        return self._peaks[rank]

    def _xs(self, tl: MemoryTimeline, rank: int, t: Any) -> np.ndarray:
        return tl.step_progress(rank, t) if self.x == "step" else np.asarray(t, dtype=np.float64)

    def _overlay_line(self, rank: int, points: int, other: MemoryTimeline | None = None,
                      which: str = "overlay") -> tuple[np.ndarray, np.ndarray, int] | None:
        """x and total bytes of the overlay's rank standing for ``rank`` (at the shown step), and that rank;
        ``other``: another timeline drawn the same way (a band's side, named by ``which``)."""
        other = self.overlay if other is None else other
        if other is None:
            return None
        rep = matching_rank(other, rank)
        if rep is None:
            return None
        step = None
        if self._step is not None:
            step = matching_step(other, self._step) if self.x == "step" else (
                self._step if self._step in other.steps else None)
            if step is None:
                return None
        ds = other.downsample(rep, points, step=step)
        if other is self.timeline and rep == rank:
            x = self._xs(other, rep, ds["t"])
        elif self.x == "step":  # phase against phase on this timeline's step clock (workbench.memory.clock)
            x = self._overlay_clock(rank, rep, step, other, which)(ds["t"])
        else:
            x = self._xs(other, rep, ds["t"])
        return x, ds["total_bytes"].to_numpy(), rep

    def _overlay_clock(self, rank: int, rep: int, step: int | None, other: MemoryTimeline | None = None,
                       which: str = "overlay"):
        """The overlay's rank ``rep`` on rank ``rank``'s step clock, aligned by phase; zoomed to a step the
        overlay lacks, its steady-state ``step`` is aligned with the shown one."""
        step_map = {step: self._step} if step is not None and step != self._step else None
        key = (which, rank, rep, step if step_map else None)
        if key not in self._clocks:
            self._clocks[key] = phase_clock(self.timeline, rank, self.overlay if other is None else other, rep,
                                            step_map=step_map)
        return self._clocks[key]

    def _band_polygon(self, rank: int) -> tuple[np.ndarray, np.ndarray, dict] | None:
        """The routing band of ``rank`` as one closed outline: the high total forward, the low total back
        (x, bytes), and what it stands for (its ranks' low and high peaks, the capacity factor)."""
        if self.band is None:
            return None
        high = self._overlay_line(rank, self.max_points, self.band.high, "band_high")
        low = self._overlay_line(rank, self.max_points, self.band.low, "band_low")
        if high is None or low is None or not len(high[0]) or not len(low[0]):
            return None
        (hx, hy, hrep), (lx, ly, lrep) = high, low
        info = {"role": "band", "rank": lrep, "low_peak": int(self.band.low.peak(lrep).bytes),
                "high_peak": int(self.band.high.peak(hrep).bytes), "capacity_factor": self.band.capacity_factor}
        return np.r_[hx, lx[::-1]], np.r_[hy, ly[::-1]], info

    def _band_trace(self, polygon: tuple[np.ndarray, np.ndarray, dict], scale: float) -> go.Scatter:
        x, y, info = polygon
        lo, hi, cf = format_bytes(info["low_peak"]), format_bytes(info["high_peak"]), info["capacity_factor"]
        return go.Scatter(
            x=x, y=y / scale, mode="lines", fill="toself", fillcolor=BAND_COLOR, line={"width": 0.5, "color": BAND_LINE},
            name=f"routing band: balanced to capacity factor {cf:g}",
            hovertemplate=f"routing band: peak {lo} balanced to {hi} skewed (capacity factor {cf:g})<extra></extra>",
            meta=info)

    def _draw_rank(self) -> None:
        tl, rank, step = self.timeline, self._rank, self._step
        ds = tl.downsample(rank, self.max_points, step=step)
        over = self._overlay_line(rank, self.max_points)
        top = max(int(ds["total_bytes"].max()) if len(ds) else 0, int(over[1].max()) if over and len(over[1]) else 0)
        polygon = self._band_polygon(rank)
        if polygon is not None:
            top = max(top, int(polygon[1].max()))
        unit, scale = axis_unit(top)
        x = self._xs(tl, rank, ds["t"])
        traces = []
        band = self._band_trace(polygon, scale) if polygon is not None else None
        if band is not None:  # first: behind the categories
            traces.append(band)
        for cat in CATEGORIES:
            y = ds[cat].to_numpy()
            if not y.any():
                continue
            traces.append(go.Scatter(
                x=x, y=y / scale, name=cat, stackgroup="bytes", mode="lines",
                line={"width": 0.5, "color": CATEGORY_COLORS[cat]}, fillcolor=CATEGORY_COLORS[cat],
                hovertemplate=f"{cat}: %{{y:.3f}} {unit}<extra></extra>", meta={"role": "category", "category": cat},
                legendgroup="bytes"))
        traces.append(go.Scatter(
            x=x, y=ds["total_bytes"].to_numpy() / scale, name="total", mode="lines",
            line={"width": 1, "color": TOTAL_COLOR}, customdata=np.stack([ds["phase"], ds["step"]], axis=1),
            hovertemplate=f"total: %{{y:.3f}} {unit} (%{{customdata[0]}}, step %{{customdata[1]}})<extra></extra>",
            meta={"role": "total"}, legendgroup="bytes"))
        if over is not None:
            ox, oy, rep = over
            traces.append(go.Scatter(
                x=ox, y=oy / scale, name=f"{self.overlay.source} total (rank {rep})", mode="lines",
                line={"width": 1.5, "color": OVERLAY_COLOR, "dash": "dash"},
                hovertemplate=f"{self.overlay.source}: %{{y:.3f}} {unit}<extra></extra>",
                meta={"role": "overlay", "rank": rep}, legendgroup="bytes"))

        peak = None
        if step is None:
            p = self._peak(rank)
            peak = {"bytes": p.bytes, "t": p.t, "phase": p.phase, "step": p.step, "microbatch": p.microbatch}
        elif len(ds):  # the step's own peak: downsample keeps every bin's largest total, so its maximum is exact
            row = ds.iloc[int(np.argmax(ds["total_bytes"].to_numpy()))]
            peak = {"bytes": int(row["total_bytes"]), "t": float(row["t"]), "phase": str(row["phase"]),
                    "step": int(row["step"]), "microbatch": -1}
        annotations = []
        if peak is not None:
            px = float(self._xs(tl, rank, [peak["t"]])[0])
            where = palette.peak_where(peak["phase"], peak["step"], peak["microbatch"])
            text = f"peak {format_bytes(peak['bytes'])}<br>{where}"
            traces.append(go.Scatter(x=[px], y=[peak["bytes"] / scale], name="peak", mode="markers",
                                     marker={"symbol": "x", "size": 11, "color": "black"},
                                     hovertemplate=f"{text}<extra></extra>", meta={"role": "peak"},
                                     legendgroup="bytes"))
            annotations.append({"x": px, "y": peak["bytes"] / scale, "text": text, "showarrow": True, "arrowhead": 2,
                                "ax": 40, "ay": -30, "bgcolor": "rgba(255,255,255,0.85)", "font": {"size": 11}})
        if traces:
            traces[1 if band is not None and len(traces) > 1 else 0].legendgrouptitle = {"text": "bytes alive"}

        spans = tl.phase_spans(rank, step=step, max_spans=self.max_bands)
        shapes = self._bands(spans, self._xs(tl, rank, spans["t0"]), self._xs(tl, rank, spans["t1"]))
        every = len(tl.phase_spans(rank, step=step))
        self._band_note = ("" if every == len(spans) else
                           f"{every:,} phase spans drawn as {len(spans)} band(s): joined across microbatches or "
                           "steps, and left out where phases alternate faster than the plot can show; pick a "
                           "step to see every one")
        title = (f"Rank {rank}" + ("" if step is None else f", step {step}") + f": memory by category "
                 f"({tl.source}, {tl.device})" + (" vs dashed " + self.overlay.source if over else "")
                 + (", shaded: routing band" if band is not None else ""))
        with self.fig.batch_update():
            self.fig.data = ()
            self.fig.add_traces(traces)
            self.fig.layout.shapes = shapes
            self.fig.layout.annotations = annotations
            self.fig.layout.title = {"text": title, "font": {"size": 14}}
            self.fig.layout.yaxis.title = unit
            self.fig.layout.xaxis.title = self._x_title(tl)
            self.fig.layout.meta = {"rank": rank, "step": step, "peak_bytes": peak and peak["bytes"], "unit": unit,
                                    "x": self.x, "bands": len(shapes), "points": len(ds),
                                    "routing_band": None if band is None else dict(band.meta)}
        self.table.value = self._table_html(rank)

    def _bands(self, spans: pd.DataFrame, x0: np.ndarray, x1: np.ndarray) -> list[dict]:
        """One translucent rectangle per span, behind the data; the first of each phase names it in the legend."""
        named: set[str] = set()
        shapes = []
        for phase, mb, a, b in zip(spans["phase"], spans["microbatch"], x0, x1):
            first = phase not in named
            named.add(phase)
            shapes.append({
                "type": "rect", "xref": "x", "yref": "paper", "x0": float(a), "x1": float(b), "y0": 0, "y1": 1,
                "fillcolor": PHASE_COLORS[phase], "opacity": palette.band_opacity(int(mb)),
                "line": {"width": 0}, "layer": "below", "name": phase, "legendgroup": "phases",
                "showlegend": first, **({"legendgrouptitle": {"text": "phase"}} if not shapes else {})})
        return shapes

    def _draw_grid(self) -> None:
        tl, step = self.timeline, self._step
        ranks = self.grid_ranks
        cols = min(4, len(ranks))
        rows = math.ceil(len(ranks) / cols)
        lines = {r: tl.downsample(r, self.grid_points, step=step) for r in ranks}
        overs = {r: self._overlay_line(r, self.grid_points) for r in ranks}
        polygons = {r: self._band_polygon(r) for r in ranks}
        top = max([int(d["total_bytes"].max()) for d in lines.values() if len(d)]
                  + [int(o[1].max()) for o in overs.values() if o is not None and len(o[1])]
                  + [int(b[1].max()) for b in polygons.values() if b is not None] + [0])
        unit, scale = axis_unit(top)
        titles = [f"rank {r}: peak {format_bytes(d['total_bytes'].max() if len(d) else 0)}" for r, d in lines.items()]
        fig = make_subplots(rows=rows, cols=cols, shared_yaxes="all", subplot_titles=titles,
                            horizontal_spacing=0.03, vertical_spacing=min(0.12, 0.5 / rows))
        for i, r in enumerate(ranks):
            row, col = divmod(i, cols)
            d = lines[r]
            if polygons[r] is not None:
                band = self._band_trace(polygons[r], scale)
                band.showlegend = False
                fig.add_trace(band, row=row + 1, col=col + 1)
            fig.add_scatter(x=self._xs(tl, r, d["t"]), y=d["total_bytes"].to_numpy() / scale, mode="lines",
                            name=f"rank {r}", line={"width": 1, "color": TOTAL_COLOR}, showlegend=False,
                            hovertemplate=f"rank {r}: %{{y:.3f}} {unit}<extra></extra>",
                            meta={"role": "total", "rank": r}, row=row + 1, col=col + 1)
            if overs[r] is not None:
                ox, oy, rep = overs[r]
                fig.add_scatter(x=ox, y=oy / scale, mode="lines", name=f"{self.overlay.source} (rank {rep})",
                                line={"width": 1, "color": OVERLAY_COLOR, "dash": "dash"}, showlegend=False,
                                hovertemplate=f"{self.overlay.source}: %{{y:.3f}} {unit}<extra></extra>",
                                meta={"role": "overlay", "rank": r}, row=row + 1, col=col + 1)
        what = "" if step is None else f", step {step}"
        fig.update_layout(height=160 + 170 * rows, width=1040, margin={"l": 60, "r": 20, "t": 70, "b": 40},
                          title={"text": f"Total memory per rank{what} ({unit}; one y axis)"
                                 + (f", dashed: {self.overlay.source}" if self.overlay is not None else ""),
                                 "font": {"size": 14}},
                          plot_bgcolor="white", meta={"ranks": ranks, "step": step, "unit": unit, "x": self.x})
        fig.update_annotations(font_size=11)
        with self.grid_fig.batch_update():
            self.grid_fig.data = ()
            self.grid_fig.layout = {}
            self.grid_fig.layout.update(fig.layout.to_plotly_json(), overwrite=True)
            self.grid_fig.add_traces(list(fig.data))
        self._grid_step = step

    # -- text ---------------------------------------------------------------------------------------
    def _x_title(self, tl: MemoryTimeline) -> str:
        return palette.memory_x_title(tl.source, self.x, self.overlay is not None)

    def _header_html(self, best: Peak | None) -> str:
        tl = self.timeline
        peak = f" · largest peak {format_bytes(best.bytes)} on rank {best.rank}" if best is not None else ""
        over = ""
        if self.overlay is not None:
            o = self.overlay
            over = (f"<br>dashed: <b>{html.escape(o.source)}</b> ({html.escape(o.device)}, ranks {o.ranks}"
                    f"{', rank_map' if o.meta.get('rank_map') else ''}); x axis: "
                    f"{'step clock, the dashed line aligned by phase' if self.x == 'step' else 'time'}")
        model = " · ".join(html.escape(str(tl.meta[k])) for k in ("model", "layout") if k in tl.meta)
        return (f"<b>Memory timeline</b> ({html.escape(tl.source)}, {html.escape(tl.device)})"
                f"{' · ' + model if model else ''} · {len(tl.ranks)} rank(s) · {len(tl):,} events · "
                f"{len(tl.steps)} step(s){peak}{over}")

    def _note_html(self) -> str:
        notes = [self._band_note] if self._mode == "rank" and self._band_note else []
        if self._mode == "rank" and not self.fig.layout.meta["points"]:
            notes.append(f"rank {self._rank} has no events" + ("" if self._step is None else f" in step {self._step}"))
        if self._mode == "ranks" and len(self.timeline.ranks) > self.max_ranks:
            notes.append(f"showing the first {self.max_ranks} of {len(self.timeline.ranks)} ranks; pick any rank "
                         "in the rank menu to see it alone")
        if self.overlay is not None and self._mode == "rank" and matching_rank(self.overlay, self._rank) is None:
            notes.append(f"the {html.escape(self.overlay.source)} timeline has nothing for rank {self._rank}")
        return "<br>".join(f"<i style='color:#666'>{n}</i>" for n in notes)

    def _table_html(self, rank: int) -> str:
        tl = self.timeline
        p = self._peak(rank)
        alive = tl.alive_at(rank, p.index, top=TABLE_ROWS)  # index -1 (nothing above the base): empty
        mods = tl.modules_at_peak(rank).head(TABLE_ROWS)

        def cell(v: Any) -> str:
            return f"<td>{html.escape(str(v))}</td>"

        def bytes_cell(v: Any) -> str:
            return f"<td style='text-align:right'>{format_bytes(v)}</td>"

        a_rows = "".join(f"<tr>{bytes_cell(r.bytes)}{cell(r.category)}{cell(r.module or '-')}{cell(r.op)}"
                         f"{cell(r.phase)}</tr>" for r in alive.itertuples(index=False))
        m_rows = "".join(f"<tr>{cell(r.module or '(outside any module)')}{bytes_cell(r.bytes)}{cell(r.count)}</tr>"
                         for r in mods.itertuples(index=False))
        cats = " · ".join(f"<span style='color:{CATEGORY_COLORS[c]}'>■</span> {c} {format_bytes(b)}"
                          for c, b in p.by_category.items())
        style = "font-size:11px;line-height:1.25;border-collapse:collapse"
        return (f"<div style='font-size:12px'><b>Alive at rank {rank}'s peak</b>: {format_bytes(p.bytes)} "
                f"({html.escape(p.phase)}, step {p.step}) = {cats}"
                "<div style='display:flex;gap:24px'>"
                f"<table style='{style}'><caption style='text-align:left'>largest allocations</caption>"
                f"<tr><th>bytes</th><th>category</th><th>module</th><th>op</th><th>made in</th></tr>{a_rows}</table>"
                f"<table style='{style}'><caption style='text-align:left'>by module</caption>"
                f"<tr><th>module</th><th>bytes</th><th>allocations</th></tr>{m_rows}</table></div></div>")

    # -- errors -------------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if rank not in self.timeline.ranks:
            raise ValueError(f"rank {rank} is not in this timeline; it has ranks {self.timeline.ranks}")

    def _check_step(self, step: int | None) -> None:
        if step is not None and step not in self.timeline.steps:
            raise ValueError(f"step {step} is not in this timeline; it has steps {self.timeline.steps}")


class MemoryComparisonView:
    """A :class:`MemoryComparison` drawn: each rank's measured and predicted peak side by side, every
    rank's total with the prediction dashed over it (small multiples, one rank in detail from the menu),
    and the per-rank, per-category error table. Evaluate the comparison to show it."""

    def __init__(self, comparison: MemoryComparison, **timeline_view: Any):
        self.comparison = comparison
        peaks = comparison.peaks
        unit, scale = axis_unit(max(int(peaks["measured_peak"].max()), int(peaks["predicted_peak"].max())))
        ranks = [f"rank {r}" for r in peaks["rank"]]
        # a size that agrees while the peaks fall in different phases may agree for different reasons: say so
        errors = [(f"{e:+.1%}" if math.isfinite(e) else "inf") + ("" if same else " ⚠ other phase")
                  for e, same in zip(peaks["error"], peaks["same_phase"])]
        self.peaks_fig = PlotView(layout={
            "title": {"text": f"Peak per rank: measured vs {comparison.predicted.source}", "font": {"size": 14}},
            "barmode": "group", "height": 320, "width": 1040, "yaxis": {"title": unit},
            "margin": {"l": 60, "r": 20, "t": 50, "b": 40},
            "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.02, "yanchor": "bottom"}})
        self.peaks_fig.add_bar(x=ranks, y=peaks["measured_peak"].to_numpy() / scale, name="measured",
                               marker_color="#4c72b0",
                               hovertemplate=f"%{{x}} measured: %{{y:.3f}} {unit}<extra></extra>")
        self.peaks_fig.add_bar(x=ranks, y=peaks["predicted_peak"].to_numpy() / scale,
                               name=comparison.predicted.source, marker_color="#dd8452", text=errors,
                               textposition="outside",
                               hovertemplate=f"%{{x}} predicted: %{{y:.3f}} {unit} (%{{text}})<extra></extra>")
        timeline_view.setdefault("mode", "ranks")
        self.timeline_view = MemoryTimelineView(comparison.measured, overlay=comparison.predicted, **timeline_view)
        self.table = widgets.HTML(comparison._repr_html_())
        self.widget = widgets.VBox([self.peaks_fig, self.timeline_view.widget, self.table])

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        return f"MemoryComparisonView({self.comparison!r})"


def band_view(band: MemoryBand, **kwargs: Any) -> MemoryTimelineView:
    """A routing band shown: its low (balanced) timeline in detail, the band behind it."""
    return MemoryTimelineView(band.low, band=band, **kwargs)


# Registered here, with the view it uses (workbench/widgets/__init__.py registers the other core types).
register_view(MemoryBand, band_view)

__all__ = ["MemoryTimelineView", "MemoryComparisonView", "band_view", "CATEGORY_COLORS", "PHASE_COLORS"]
