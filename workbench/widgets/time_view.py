"""``StepTimelineView``: where each rank's step time goes, drawn from a :class:`StepTimeline`.

A thin view: the bars come from :meth:`StepTimeline.bars` (spans joined and binned so that 10^5 spans
draw as a few thousand bars), the totals from :meth:`StepTimeline.totals` and ``step_times``, the straggler
and exposed-communication columns from :mod:`workbench.time.analysis` when it is installed::

    view = StepTimelineView(measured)                        # or just evaluate the timeline in a notebook
    view = StepTimelineView(measured, predicted=predicted)   # the prediction as thin bars in each rank's row
    view.select_step(3)                                      # or the step dropdown (None: every step)
    view.to_html("time.html")                                # one offline file, plotly.js inlined

* **timeline** (left): one row per rank (rank 0 on top). The upper lane holds the rank's compute spans
  (forward, backward, optimizer, data, checkpoint, idle), the lane under it its communication, each
  category in one colour (:data:`workbench.palette.TIME_COLORS`). A prediction is the thin lane at the
  bottom of the row: the rank that stands for this one (its ``meta["rank_map"]``), its matching step (the
  same step, else its last: the steady state) started where the measured step starts, so a longer bar
  reads as "slower than predicted" at a glance.
* **totals** (right): seconds per category and rank, stacked (per step: the mean over the steps shown;
  streams overlap, so a stack may pass the step time), the measured step time as a black tick and the
  predicted one as an open diamond.
* **table**: per rank the step time measured and predicted and the error, exposed communication and idle
  time, and whether the rank straggles (:func:`workbench.time.analysis.stragglers`: slower than the
  median rank by more than its threshold).
"""

from __future__ import annotations

import html
import importlib
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench import palette
from workbench.time.timeline import CATEGORIES, StepTimeline
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

__all__ = ["StepTimelineView", "TIME_COLORS", "matching_rank", "matching_step"]

TIME_COLORS = dict(palette.TIME_COLORS)
assert set(TIME_COLORS) == set(CATEGORIES)
# the lanes of one rank's row, in y units around the rank (the axis is reversed: negative is higher up)
LANES = {"compute": (-0.42, 0.40), "comm": (0.0, 0.20), "predicted": (0.24, 0.16)}
MAX_OVERLAY_STEPS = 64  # steps a prediction is repeated over, at most, when every step is shown


def matching_rank(predicted: StepTimeline, rank: int) -> int | None:
    """The rank of ``predicted`` that stands for ``rank``: its ``rank_map`` entry, else the rank itself."""
    rank_map = predicted.meta.get("rank_map") or {}
    rep = rank_map.get(str(rank), rank_map.get(rank)) if isinstance(rank_map, dict) else None
    if rep is not None and int(rep) in predicted.ranks:
        return int(rep)
    return rank if rank in predicted.ranks else None


def matching_step(predicted: StepTimeline, step: int | None) -> int | None:
    """The step of ``predicted`` to draw against a measured ``step``: the same, else its last (steady) one."""
    steps = predicted.steps
    if not steps:
        return None
    return step if step in steps else steps[-1]


def _analysis() -> Any | None:
    """:mod:`workbench.time.analysis` when it is installed (the view then shows stragglers), else None."""
    try:
        return importlib.import_module("workbench.time.analysis")
    except ImportError:
        return None


class StepTimelineView:
    """Explore a :class:`StepTimeline`, optionally against a ``predicted`` one. Evaluate to show.

    ``step``: the step shown first (default: the last step, the steady state; None with ``step="all"``:
    every step). ``max_bars`` bounds the bars of each rank's lane (see :meth:`StepTimeline.bars`),
    ``max_ranks`` the rows. Drive it from code with :meth:`select_step`; read ``fig``, ``table``.
    """

    def __init__(self, timeline: StepTimeline, predicted: StepTimeline | None = None, *,
                 step: int | str | None = "last", max_bars: int = 1500, max_ranks: int = 64):
        if not isinstance(timeline, StepTimeline):
            raise TypeError(f"StepTimelineView shows a StepTimeline, not {type(timeline).__name__}; "
                            "make one with workbench.time.import_trace(...) or workbench.time.predict(...)")
        if predicted is not None and not isinstance(predicted, StepTimeline):
            raise TypeError(f"predicted= takes a StepTimeline, not {type(predicted).__name__}")
        if not len(timeline):
            raise ValueError("this step timeline has no spans; profile a run with `workbench train ... --profile 2`")
        if max_bars < 10 or max_ranks < 1:
            raise ValueError(f"max_bars={max_bars}, max_ranks={max_ranks}: ask for at least 10 bars and 1 rank")
        self.timeline, self.predicted = timeline, predicted
        self.max_bars, self.max_ranks = max_bars, max_ranks
        if step == "last":
            step = timeline.steps[-1] if timeline.steps else None
        elif step == "all":
            step = None
        self._check_step(step)
        self._step: int | None = step
        self._busy = False
        self._analysis = _analysis()

        self.controls = {"step": widgets.Dropdown(
            options=[("all steps", -1)] + [(f"step {s}", s) for s in timeline.steps],
            value=-1 if step is None else step, description="step", layout=widgets.Layout(width="170px"))}
        self.controls["step"].observe(
            lambda ch: None if self._busy else self.select_step(None if ch["new"] < 0 else ch["new"]), "value")
        self.header = widgets.HTML(self._header_html())
        self.note = widgets.HTML("")
        self.fig = PlotView()
        self.table = widgets.HTML("")
        self.widget = widgets.VBox([self.header, widgets.HBox([self.controls["step"]]), self.note, self.fig,
                                    self.table])
        self._redraw()

    # -- notebook display ---------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        at = "all steps" if self._step is None else f"step {self._step}"
        over = f", predicted {self.predicted.device}" if self.predicted is not None else ""
        return f"StepTimelineView({self.timeline.source}, {len(self.timeline.ranks)} ranks, {at}{over})"

    @property
    def step(self) -> int | None:
        return self._step

    @property
    def ranks(self) -> list[int]:
        """The ranks drawn (the first ``max_ranks``)."""
        return self.timeline.ranks[: self.max_ranks]

    def select_step(self, step: int | None) -> None:
        """Show ``step`` (None: every step)."""
        self._check_step(step)
        self._step = step
        self._redraw()

    def to_html(self, path: str | Path) -> Path:
        """What the view shows now, as one self-contained HTML file (plotly.js inlined, no CDN)."""
        body = self.fig.to_html(full_html=False, include_plotlyjs=True, include_mathjax=False)
        doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(repr(self))}</title></head>"
               f"<body>{self.header.value}{self.note.value}{body}{self.table.value}</body></html>")
        path = Path(path)
        path.write_text(doc, encoding="utf-8")
        return path

    # -- numbers ------------------------------------------------------------------------------------
    def _check_step(self, step: int | None) -> None:
        if step is not None and step not in self.timeline.steps:
            raise ValueError(f"step {step} is not in this timeline; its steps are {self.timeline.steps}")

    def _shown(self) -> StepTimeline:
        tl = self.timeline if self._step is None else self.timeline.select(step=self._step)
        ranks = self.ranks
        return tl if len(ranks) == len(self.timeline.ranks) else tl._new(tl.frame[tl.frame["rank"].isin(ranks)])

    def _measured_steps(self) -> pd.DataFrame:
        """Per shown step: where it starts (its first span on any rank)."""
        st = self.timeline.step_times()
        if self._step is not None:
            st = st[st["step"] == self._step]
        return st.groupby("step")["start"].min().reset_index().head(MAX_OVERLAY_STEPS)

    def _predicted_bars(self) -> pd.DataFrame:
        """The prediction's bars, placed at each shown measured step (or at the timeline's start)."""
        pred = self.predicted
        if pred is None or not len(pred):
            return pd.DataFrame()
        starts = self._measured_steps()
        pieces = []
        if starts.empty or not pred.steps:  # no steps to align: start where the measurement starts
            b = pred.bars(self.max_bars)
            pieces.append(b.assign(start=b["start"] - pred.frame["start"].min() + self.timeline.frame["start"].min(),
                                   end=b["end"] - pred.frame["start"].min() + self.timeline.frame["start"].min()))
        else:
            cache: dict[int, pd.DataFrame] = {}
            for s, t0 in zip(starts["step"], starts["start"]):
                ps = matching_step(pred, int(s))
                if ps not in cache:
                    sel = pred.select(step=ps)
                    b = sel.bars(max(10, self.max_bars // max(1, len(starts))))
                    cache[ps] = b.assign(start=b["start"] - sel.frame["start"].min(),
                                         end=b["end"] - sel.frame["start"].min())
                b = cache[ps]
                pieces.append(b.assign(start=b["start"] + t0, end=b["end"] + t0, step=int(s)))
        bars = pd.concat(pieces, ignore_index=True)
        rows = []
        for r in self.ranks:
            rep = matching_rank(pred, r)
            if rep is not None:
                rows.append(bars[bars["rank"] == rep].assign(rank=r, stands_for=rep))
        return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()

    def rank_table(self) -> pd.DataFrame:
        """Per shown rank: step time measured (median of the shown steps) and predicted, the error, exposed
        communication, idle, and straggling (the last three need :mod:`workbench.time.analysis`)."""
        st = self.timeline.step_times()
        if self._step is not None:
            st = st[st["step"] == self._step]
        out = pd.DataFrame({"rank": self.ranks}).set_index("rank")
        out["step_s"] = st.groupby("rank")["step_s"].median().reindex(out.index)
        if self.predicted is not None:
            pred = {}
            all_pst = self.predicted.step_times()
            ps = matching_step(self.predicted, self._step if self._step is not None else -1)
            for r in self.ranks:
                rep = matching_rank(self.predicted, r)
                if rep is None:
                    continue
                pst = all_pst[(all_pst["rank"] == rep) & (all_pst["step"] == ps)]
                pred[r] = float(pst["step_s"].iloc[0]) if len(pst) else self.predicted.step_time(rep)
            out["predicted_s"] = pd.Series(pred, dtype=float).reindex(out.index)
            out["error"] = out["predicted_s"] / out["step_s"] - 1.0
        an = self._analysis
        if an is not None and self.timeline.steps:
            ov = an.communication_overlap(self.timeline)
            idle = an.idle_split(self.timeline)
            if self._step is not None:
                ov, idle = ov[ov["step"] == self._step], idle[idle["step"] == self._step]
            out["exposed_comm_s"] = ov.groupby("rank")["exposed_s"].median().reindex(out.index)
            out["idle_s"] = idle.assign(total=idle[["host_s", "rank_s", "bubble_s"]].sum(axis=1)).groupby(
                "rank")["total"].median().reindex(out.index)
            strag = an.stragglers(self.timeline if self._step is None else self.timeline.select(step=self._step))
            out["straggler"] = strag.set_index("rank")["straggler"].reindex(out.index).fillna(False).astype(bool)
            out["excess"] = strag.set_index("rank")["excess"].reindex(out.index)
        return out.reset_index()

    # -- drawing ------------------------------------------------------------------------------------
    def _redraw(self) -> None:
        self._busy = True
        try:
            self.controls["step"].value = -1 if self._step is None else self._step
        finally:
            self._busy = False
        shown = self._shown()
        bars = shown.bars(self.max_bars)
        lo, hi = float(shown.frame["start"].min()), float(shown.frame["end"].max())
        pbars = self._predicted_bars()
        if len(pbars):
            hi = max(hi, float(pbars["end"].max()))
        unit, scale = ("ms", 1e3) if hi - lo < 2.0 else ("s", 1.0)
        table = self.rank_table()
        fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.74, 0.26], horizontal_spacing=0.02,
                            subplot_titles=(self._title(unit), self._totals_title(unit)))
        named: set[str] = set()
        for cat in CATEGORIES:
            for lane in ("compute", "comm"):
                sel = bars[(bars["category"] == cat) & ((bars["category"] == "communication") == (lane == "comm"))]
                if len(sel):
                    fig.add_trace(self._bar_trace(sel, cat, lane, unit, scale, cat not in named), row=1, col=1)
                    named.add(cat)
        for cat in CATEGORIES:
            sel = pbars[pbars["category"] == cat] if len(pbars) else pbars
            if len(sel):
                fig.add_trace(self._bar_trace(sel, cat, "predicted", unit, scale, False), row=1, col=1)
        self._add_totals(fig, shown, table, unit, scale)
        ranks = self.ranks
        labels = [f"rank {r}" + (" ⚠ straggler" if "straggler" in table and bool(
            table.set_index("rank").loc[r, "straggler"]) else "") for r in ranks]
        fig.update_yaxes(tickmode="array", tickvals=ranks, ticktext=labels, autorange="reversed", showgrid=False,
                         row=1, col=1)
        fig.update_xaxes(title_text=f"{unit} since the trace began", gridcolor="#eeeeee", row=1, col=1)
        fig.update_xaxes(title_text=f"{unit} per step" if self._step is None else unit, gridcolor="#eeeeee",
                         row=1, col=2)
        fig.update_layout(barmode="overlay", height=max(320, 150 + 42 * len(ranks)), width=1100, plot_bgcolor="white",
                          margin={"l": 120, "r": 20, "t": 60, "b": 50}, legend={"font": {"size": 10}},
                          meta={"step": self._step, "ranks": ranks, "unit": unit, "bars": int(len(bars)),
                                "predicted_bars": int(len(pbars)), "spans": int(len(shown))})
        fig.update_annotations(font_size=12)
        with self.fig.batch_update():
            self.fig.data = ()
            self.fig.layout = {}
            self.fig.layout.update(fig.layout.to_plotly_json(), overwrite=True)
            self.fig.add_traces(list(fig.data))
        self.table.value = self._table_html(table)
        self.note.value = self._note_html(shown, bars)

    def _bar_trace(self, sel: pd.DataFrame, cat: str, lane: str, unit: str, scale: float, legend: bool) -> go.Bar:
        offset, width = LANES[lane]
        pred = lane == "predicted"
        custom = np.stack([sel["name"].astype(str).to_numpy(), sel["spans"].to_numpy(),
                           (sel["busy_s"].to_numpy() * scale).round(4), sel["step"].to_numpy(),
                           sel["stands_for"].to_numpy() if pred else sel["rank"].to_numpy()], axis=1)
        who = "predicted (rank %{customdata[4]})" if pred else "rank %{y}"
        return go.Bar(
            orientation="h", y=sel["rank"].to_numpy(), base=sel["start"].to_numpy() * scale,
            x=((sel["end"] - sel["start"]).to_numpy() * scale), offset=offset, width=width,
            marker={"color": TIME_COLORS[cat], "opacity": 0.55 if pred else 1.0,
                    "line": {"width": 0}},
            name=cat if not pred else "predicted (thin lane)", legendgroup="predicted" if pred else cat,
            showlegend=legend or (pred and cat == "forward"), customdata=custom,
            hovertemplate=(f"{who}: {cat}, step %{{customdata[3]}}<br>%{{base:.3f}} to %{{x:.3f}} {unit} long"
                           f"<br>%{{customdata[0]}} (%{{customdata[1]}} span(s), busy %{{customdata[2]}} {unit})"
                           "<extra></extra>"),
            meta={"role": "predicted" if pred else "measured", "category": cat, "lane": lane})

    def _add_totals(self, fig: go.Figure, shown: StepTimeline, table: pd.DataFrame, unit: str, scale: float) -> None:
        tot = shown.totals().reindex(self.ranks, fill_value=0.0)
        per = max(1, len(shown.steps)) if self._step is None else 1
        base = np.zeros(len(tot))
        for cat in CATEGORIES:
            v = tot[cat].to_numpy() / per * scale
            if not v.any():
                continue
            fig.add_trace(go.Bar(orientation="h", y=tot.index.to_numpy(), x=v, base=base.copy(), width=0.7,
                                 marker={"color": TIME_COLORS[cat]}, name=cat, legendgroup=cat, showlegend=False,
                                 hovertemplate=f"rank %{{y}}: {cat} %{{x:.3f}} {unit}<extra></extra>",
                                 meta={"role": "total", "category": cat}), row=1, col=2)
            base += v
        t = table.set_index("rank")
        if t["step_s"].notna().any():
            fig.add_trace(go.Scatter(x=t["step_s"].to_numpy() * scale, y=t.index.to_numpy(), mode="markers",
                                     marker={"symbol": "line-ns", "size": 18, "line": {"width": 3, "color": "black"}},
                                     name="measured step", hovertemplate=f"rank %{{y}}: step %{{x:.3f}} {unit}"
                                     "<extra></extra>", meta={"role": "step_time"}), row=1, col=2)
        if "predicted_s" in t and t["predicted_s"].notna().any():
            fig.add_trace(go.Scatter(x=t["predicted_s"].to_numpy() * scale, y=t.index.to_numpy(), mode="markers",
                                     marker={"symbol": "diamond-open", "size": 11, "color": palette.OVERLAY_COLOR},
                                     name="predicted step", hovertemplate=f"rank %{{y}}: predicted %{{x:.3f}} {unit}"
                                     "<extra></extra>", meta={"role": "predicted_step_time"}), row=1, col=2)

    # -- text ---------------------------------------------------------------------------------------
    def _title(self, unit: str) -> str:
        at = "every step" if self._step is None else f"step {self._step}"
        over = ", thin bars: predicted" if self.predicted is not None else ""
        return f"Where each rank's time goes, {at} (upper lane: compute; lower: communication{over})"

    def _totals_title(self, unit: str) -> str:
        return "per rank, " + ("mean per step" if self._step is None else "this step") + f" ({unit})"

    def _header_html(self) -> str:
        tl = self.timeline
        s = f"<b>Step timeline</b> ({html.escape(tl.source)}, {html.escape(tl.device)}): {len(tl.ranks)} rank(s), " \
            f"{len(tl):,} spans, steps {tl.steps if len(tl.steps) <= 12 else f'{tl.steps[0]}..{tl.steps[-1]}'}"
        if tl.steps:
            s += f" · median step {tl.step_time() * 1e3:.2f} ms (slowest rank per step)"
        p = self.predicted
        if p is not None:
            dm = p.meta.get("device_model")
            model = dm.get("name", dm) if isinstance(dm, dict) else dm
            calibrated = dm.get("calibrated") if isinstance(dm, dict) else None
            s += (f"<br>predicted: {html.escape(str(p.device))}" + (f", device model {html.escape(str(model))}"
                                                                    if model else "")
                  + (" (uncalibrated)" if calibrated is False else "")
                  + (f", step {p.step_time() * 1e3:.2f} ms" if p.steps else ""))
        return f"<div style='font-size:13px'>{s}</div>"

    def _note_html(self, shown: StepTimeline, bars: pd.DataFrame) -> str:
        notes = []
        if len(bars) < len(shown):
            notes.append(f"{len(shown):,} spans drawn as {len(bars):,} bars (neighbours of one category joined, "
                         "spans shorter than the resolution gathered); pick a step for more detail")
        if len(self.ranks) < len(self.timeline.ranks):
            notes.append(f"the first {len(self.ranks)} of {len(self.timeline.ranks)} ranks shown (max_ranks)")
        if self._analysis is None:
            notes.append("stragglers and exposed communication need workbench.time.analysis, not installed here")
        return "".join(f"<div style='color:#666;font-size:12px'>{html.escape(n)}</div>" for n in notes)

    def _table_html(self, table: pd.DataFrame) -> str:
        def ms(v: Any) -> str:
            return "-" if v is None or pd.isna(v) else f"{float(v) * 1e3:.2f}"

        cols = [("rank", "rank"), ("step_s", "step (ms)")]
        cols += [(c, n) for c, n in (("predicted_s", "predicted (ms)"), ("error", "error"),
                                     ("exposed_comm_s", "exposed comm (ms)"), ("idle_s", "idle (ms)"),
                                     ("straggler", "straggler")) if c in table]
        head = "".join(f"<th>{n}</th>" for _, n in cols)
        rows = []
        for _, row in table.iterrows():
            cells = []
            for c, _ in cols:
                v = row[c]
                if c == "rank":
                    cells.append(f"<td>{int(v)}</td>")
                elif c == "error":
                    cells.append("<td>-</td>" if pd.isna(v) else f"<td>{float(v):+.1%}</td>")
                elif c == "straggler":
                    ex = row.get("excess")
                    cells.append(f"<td style='color:#c00'>yes (+{float(ex):.0%})</td>" if bool(v) and not pd.isna(ex)
                                 else "<td style='color:#c00'>yes</td>" if bool(v) else "<td>no</td>")
                else:
                    cells.append(f"<td>{ms(v)}</td>")
            rows.append(f"<tr>{''.join(cells)}</tr>")
        return (f"<table class='pw-time-table' style='font-size:12px'><tr>{head}</tr>{''.join(rows)}</table>")
