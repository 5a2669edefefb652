"""``AdvisorView``: the layout advisor's answer as a scatter of predicted throughput against memory.

A thin view over an ``Advice`` (:func:`workbench.prediction.advise.advise`): every number comes from its
``to_frame()`` and ``pareto()``; a click asks the core for that layout's plan (:func:`workbench.plan.plan`),
memory timeline (:func:`workbench.memory.predict`) and step timeline (:func:`workbench.time.predict`)::

    advice = workbench.time.advise("small", gpus=4, gpu_memory="2GiB", gpu="cpu")
    view = AdvisorView(advice)        # or just evaluate the advice in a notebook
    view.open(0)                      # what a click on the best layout does (row 0 of advice.to_frame())

* **scatter**: x the predicted peak memory per GPU, y the predicted tokens/s; one colour per bound
  (compute, communication, bubble, host, memory: :data:`BOUND_COLORS`); layouts that do not fit are grey
  crosses at their predicted peak (no throughput: a dotted line marks the memory budget). The Pareto front
  (no other layout is both faster and lighter) is joined by a line and ringed.
* **below**: the ranked table (top ``table_rows``), and an output area where a click on a point opens
  that layout's plan, memory and time views, one tab each.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any, Callable

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go

from workbench import palette
from workbench.units import format_bytes
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

__all__ = ["AdvisorView", "BOUND_COLORS", "layout_settings"]

BOUND_COLORS = {"compute": palette.TIME_COLORS["forward"], "communication": palette.TIME_COLORS["communication"],
                "bubble": "#9467bd", "host": palette.TIME_COLORS["data"], "memory": "#d62728"}
OTHER_BOUND = "#7f7f7f"
MAX_SCREEN = 2000  # layouts only screened (not checked) drawn, at most
# the Advice frame's columns, by what they mean; the first name present is used
_COLUMNS = {"layout": ("layout", "describe", "name"), "fits": ("fits",),
            "peak": ("peak_bytes", "predicted_peak_bytes", "memory_bytes", "peak_memory_bytes", "peak"),
            "tps": ("tokens_per_s", "predicted_tokens_per_s", "throughput"), "bound": ("bound",),
            "reason": ("reason", "pruned", "why")}
# columns of a row that are settings of the job, beside the layout itself
_TRAIN_FIELDS = ("micro_batch", "activation_checkpointing", "global_batch", "seq_len", "mixed_precision")
_PARALLEL_FIELDS = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "sequence_parallel", "pp_schedule",
                    "microbatches")
# the advisor's short column names for settings (workbench.prediction.layout_search.Candidate)
_ADVICE_NAMES = {"sp": "sequence_parallel", "schedule": "pp_schedule", "ac": "activation_checkpointing",
                 "micro": "micro_batch"}

Opener = Callable[[str, Any, dict], Any]


def _column(frame: pd.DataFrame, what: str, required: bool = True) -> str | None:
    for c in _COLUMNS[what]:
        if c in frame.columns:
            return c
    if required:
        raise ValueError(f"the advice's table has no {what} column (looked for {list(_COLUMNS[what])}; it has "
                         f"{list(frame.columns)}); pass an Advice from workbench.prediction.advise.advise")
    return None


def _is(value: bool) -> Callable[[Any], bool]:
    """``fits`` holds True, False, or nothing (None, NaN, pd.NA: a layout not checked)."""
    return lambda v: isinstance(v, (bool, np.bool_)) and bool(v) is value


def _attr(advice: Any, name: str, default: Any = None) -> Any:
    v = getattr(advice, name, None)
    if v is None and isinstance(getattr(advice, "meta", None), dict):
        v = advice.meta.get(name)
    return default if v is None else v


def layout_settings(advice: Any, row: pd.Series) -> tuple[Any, dict[str, Any]]:
    """(model, settings) of one row of the advice: the layout's degrees and the job's training shape, as
    keywords of ``workbench.plan.plan`` / ``workbench.memory.predict`` / ``workbench.time.predict``.

    From the row's setting columns (``dp_shard``, ``tp``, ``sp``, ``schedule``, ``ac``, ``micro``...) when
    it has them, else from its ``layout`` text (``"dp_shard=2,tp=2,sp"``); the training shape (global
    batch, sequence length, dtype, mixed precision, ZeRO) from the advice's ``meta``."""
    from workbench.settings import parse_settings, split_settings

    def given(v: Any) -> bool:
        return v is not None and not (isinstance(v, float) and np.isnan(v))

    settings: dict[str, Any] = {}
    if given(row.get("tp")):
        for name in (*_PARALLEL_FIELDS, *_TRAIN_FIELDS, *_ADVICE_NAMES):
            v = row.get(name)
            if given(v):
                settings[_ADVICE_NAMES.get(name, name)] = v.item() if isinstance(v, np.generic) else v
        if int(settings.get("pp", 1)) > 1:
            settings.pop("micro_batch", None)  # under pp the micro-batch count decides it
        else:
            settings.pop("pp_schedule", None)
            settings.pop("microbatches", None)
    else:
        layout = row.get(next((c for c in _COLUMNS["layout"] if c in row.index), "layout"))
        if dataclasses.is_dataclass(layout):
            settings.update({f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)
                             if getattr(layout, f.name) != f.default})
        elif isinstance(layout, dict):
            settings.update(layout)
        elif isinstance(layout, str):
            settings.update(parse_settings(layout.replace(" x ", ",").replace(" ", ","), "parallel"))
        for name in _TRAIN_FIELDS:
            if given(row.get(name)):
                settings.setdefault(name, row.get(name))
    meta = getattr(advice, "meta", None) or {}
    for name in ("global_batch", "seq_len"):
        v = _attr(advice, name)
        if v is not None:
            settings.setdefault(name, v)
    for name, v in (meta.get("train") or {}).items():
        settings.setdefault(name, v)
    if meta.get("zero") is not None:
        settings.setdefault("zero", meta["zero"])
    split_settings(settings)  # one clear ValueError for a name neither config declares
    model = _attr(advice, "model")
    if model is None:
        raise ValueError("the advice does not say which model it is for (no .model); pass an Advice from advise()")
    return model, settings


def default_opener(what: str, advice: Any, row: pd.Series) -> Any:
    """The core object a click shows: ``what`` is "plan", "memory" or "time"."""
    model, settings = layout_settings(advice, row)
    gpu = _attr(advice, "gpu", "cpu")
    device = _attr(advice, "device") or ("cpu" if str(gpu).lower() == "cpu" else "cuda")
    from workbench.settings import split_settings

    parts = split_settings(settings)
    parallel, train = parts["parallel"], parts["train"]
    if what == "plan":
        import workbench.plan

        return workbench.plan.plan(model, **parallel, **train)
    if what == "memory":
        import workbench.memory

        return workbench.memory.predict(model, device=device, progress=False, train=train, **parallel)
    if what == "time":
        import workbench.time

        kw = {"gpu": gpu} if device == "cuda" else {}
        for name in ("nodes", "gpus_per_node"):
            if _attr(advice, name) and device == "cuda":
                kw[name] = _attr(advice, name)
        return workbench.time.predict(model, device=device, progress=False, train=train, **kw, **parallel)
    raise ValueError(f"unknown view {what!r}; choose plan, memory or time")


class AdvisorView:
    """The advice as a scatter (see the module docstring). Evaluate to show; ``open(i)`` is a click.

    ``opener(what, advice, row)`` makes the object shown for ``what`` in ("plan", "memory", "time");
    the default asks the core (:func:`default_opener`). ``views`` picks which of the three a click opens.
    """

    def __init__(self, advice: Any, *, opener: Callable[[str, Any, pd.Series], Any] | None = None,
                 views: tuple[str, ...] = ("plan", "memory", "time"), table_rows: int = 10):
        frame = advice.to_frame()
        if not isinstance(frame, pd.DataFrame):
            raise TypeError("the advice's to_frame() must give a DataFrame; pass an Advice from advise()")
        bad = sorted(set(views) - {"plan", "memory", "time"})
        if bad:
            raise ValueError(f"views={bad}: choose from plan, memory, time")
        self.advice, self.frame = advice, frame.reset_index(drop=True)
        self.opener = opener or default_opener
        self.views, self.table_rows = tuple(views), table_rows
        self.cols = {k: _column(self.frame, k, required=k in ("layout", "peak", "tps"))
                     for k in _COLUMNS}
        self.pareto_rows = self._pareto_rows()
        self.opened: dict[str, Any] = {}
        self.selected: int | None = None
        self._trace_rows: dict[str, list[int]] = {}
        self.header = widgets.HTML(self._header_html())
        self.fig = PlotView()
        self.table = widgets.HTML(self._table_html())
        self.status = widgets.HTML("<i>click a point to open that layout's plan, memory and time views</i>")
        self.output = widgets.Output()
        self.widget = widgets.VBox([self.header, self.fig, self.table, self.status, self.output])
        self._draw()

    # -- notebook display ---------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        return (f"AdvisorView({len(self.frame)} layouts, {int(self._fits().sum())} fit, "
                f"{len(self.pareto_rows)} on the Pareto front)")

    # -- numbers ------------------------------------------------------------------------------------
    def _fits(self) -> pd.Series:
        c = self.cols["fits"]
        tps = pd.to_numeric(self.frame[self.cols["tps"]], errors="coerce")
        fits = self.frame[c].map(_is(True)) if c else pd.Series(True, index=self.frame.index)
        return (fits & tps.notna() & (tps > 0)).astype(bool)

    def _pareto_rows(self) -> list[int]:
        """Rows of the advice's Pareto front (``advice.pareto()``: a frame, rows or layouts)."""
        if not hasattr(self.advice, "pareto"):
            return []
        front = self.advice.pareto()
        lay = self.frame[self.cols["layout"]].astype(str)
        if isinstance(front, pd.DataFrame):
            names = (front[self.cols["layout"]] if self.cols["layout"] in front.columns else
                     front.index.to_series()).astype(str)
        else:
            names = pd.Series([str(getattr(x, "layout", x.get("layout") if isinstance(x, dict) else x))
                               for x in front], dtype=object)
        wanted = set(names)
        return [int(i) for i in self.frame.index[lay.isin(wanted)]]

    # -- actions ------------------------------------------------------------------------------------
    def open(self, row: int) -> dict[str, Any]:
        """Show row ``row``'s plan, memory and time views in the output area (what a click does); returns
        them as ``{"plan": ShardingPlan, "memory": MemoryTimeline, "time": StepTimeline}`` (a view that
        could not be made holds its one-line error instead)."""
        if not 0 <= row < len(self.frame):
            raise ValueError(f"row {row} is not in the advice (it has {len(self.frame)} rows)")
        from IPython.display import display

        r = self.frame.iloc[row]
        layout = str(r[self.cols["layout"]])
        self.selected = row
        self.status.value = f"<b>{html.escape(layout)}</b>: predicting plan, memory and step time…"
        made: dict[str, Any] = {}
        for what in self.views:
            try:
                made[what] = self.opener(what, self.advice, r)
            except (ValueError, RuntimeError, NotImplementedError, ImportError, TypeError) as e:
                made[what] = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.opened = made
        tabs = []
        for what in self.views:
            out = widgets.Output()
            with out:
                obj = made[what]
                display(widgets.HTML(f"<span style='color:#c00'>{html.escape(obj)}</span>")
                        if isinstance(obj, str) else obj)
            tabs.append(out)
        tab = widgets.Tab(children=tabs)
        for i, what in enumerate(self.views):
            tab.set_title(i, what)
        self.output.clear_output()
        with self.output:
            display(tab)
        failed = [w for w, o in made.items() if isinstance(o, str)]
        self.status.value = (f"<b>{html.escape(layout)}</b> (row {row})"
                             + (f": could not make {', '.join(failed)}" if failed else ""))
        self._draw()
        return made

    def _on_click(self, trace: Any, points: Any, _state: Any) -> None:
        rows = self._trace_rows.get((trace.meta or {}).get("key"), [])
        for i in points.point_inds:
            if 0 <= i < len(rows):
                self.open(rows[i])
                return

    # -- drawing ------------------------------------------------------------------------------------
    def _draw(self) -> None:
        f, c = self.frame, self.cols
        peak = pd.to_numeric(f[c["peak"]], errors="coerce").to_numpy(dtype=float)
        tps = pd.to_numeric(f[c["tps"]], errors="coerce").to_numpy(dtype=float)
        fits = self._fits().to_numpy(dtype=bool)
        bound = f[c["bound"]].astype(str).to_numpy() if c["bound"] else np.array(["compute"] * len(f))
        lay = f[c["layout"]].astype(str).to_numpy()
        gib = float(1 << 30)
        traces: list[go.Scatter] = []
        self._trace_rows = {}

        def add(key: str, idx: np.ndarray, **kw: Any) -> None:
            if not len(idx):
                return
            self._trace_rows[key] = [int(i) for i in idx]
            traces.append(go.Scatter(
                x=peak[idx] / gib, y=np.where(np.isnan(tps[idx]), 0.0, tps[idx]), mode="markers",
                customdata=np.stack([lay[idx], bound[idx], idx], axis=1), meta={"key": key, "role": key},
                hovertemplate="%{customdata[0]}<br>peak %{x:.2f} GiB · %{y:,.0f} tokens/s · "
                              "bound: %{customdata[1]}<extra>row %{customdata[2]}</extra>", **kw))

        for b in list(BOUND_COLORS) + sorted(set(bound[fits]) - set(BOUND_COLORS)):
            add(f"bound:{b}", np.flatnonzero(fits & (bound == b)), name=b,
                marker={"color": BOUND_COLORS.get(b, OTHER_BOUND), "size": 9, "line": {"width": 0.5, "color": "white"}})
        checked = f[c["fits"]].map(_is(False)).to_numpy(dtype=bool) if c["fits"] else np.zeros(len(f), dtype=bool)
        add("no fit", np.flatnonzero(checked & ~np.isnan(peak)), name="does not fit",
            marker={"color": "#bbbbbb", "symbol": "x", "size": 8})
        # not checked with the predictors (the advisor's closed-form screen only): faint, the first MAX_SCREEN
        screen = np.flatnonzero(~fits & ~checked & ~np.isnan(peak) & ~np.isnan(tps))[:MAX_SCREEN]
        add("screen", screen, name="screen estimate (not checked)", visible="legendonly",
            marker={"color": "#cccccc", "size": 5})
        front = [i for i in self.pareto_rows if fits[i]]
        if front:
            front = sorted(front, key=lambda i: peak[i])
            idx = np.array(front)
            self._trace_rows["pareto"] = [int(i) for i in idx]
            traces.append(go.Scatter(x=peak[idx] / gib, y=tps[idx], mode="lines+markers", name="Pareto front",
                                     line={"color": "black", "width": 1, "dash": "dot"},
                                     marker={"symbol": "circle-open", "size": 15, "color": "black"},
                                     customdata=np.stack([lay[idx], bound[idx], idx], axis=1),
                                     meta={"key": "pareto", "role": "pareto"},
                                     hovertemplate="Pareto: %{customdata[0]}<extra>row %{customdata[2]}</extra>"))
        if self.selected is not None and not np.isnan(peak[self.selected]):
            s = self.selected
            traces.append(go.Scatter(x=[peak[s] / gib], y=[0.0 if np.isnan(tps[s]) else tps[s]], mode="markers",
                                     name="opened", marker={"symbol": "star", "size": 16, "color": "#ffbf00",
                                                            "line": {"width": 1, "color": "black"}},
                                     hoverinfo="skip", meta={"key": "selected", "role": "selected"}))
        budget = _attr(self.advice, "gpu_memory_bytes", _attr(self.advice, "gpu_memory"))
        shapes = []
        if budget is not None:
            from workbench.units import parse_bytes

            b = parse_bytes(budget) if isinstance(budget, str) else float(budget)
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": b / gib, "x1": b / gib, "y0": 0,
                           "y1": 1, "line": {"dash": "dot", "color": "#d62728", "width": 1}})
        with self.fig.batch_update():
            self.fig.data = ()
            self.fig.add_traces(traces)
            self.fig.layout.shapes = shapes
            self.fig.layout.title = {"text": "Predicted throughput vs memory per GPU (click a point to open it)",
                                     "font": {"size": 14}}
            self.fig.layout.xaxis.title = "predicted peak memory per GPU (GiB)"
            self.fig.layout.yaxis.title = "predicted tokens/s"
            self.fig.layout.update(height=460, width=900, plot_bgcolor="white", hovermode="closest",
                                   legend={"title": {"text": "bound by"}},
                                   meta={"rows": len(f), "fits": int(fits.sum()), "pareto": front,
                                         "selected": self.selected})
        for t in self.fig.data:
            if t.meta and t.meta.get("key") in self._trace_rows:
                t.on_click(self._on_click)

    def _header_html(self) -> str:
        a = self.advice
        if hasattr(a, "summary_line"):
            bits = [html.escape(a.summary_line())]
        else:
            bits = [f"{k} {html.escape(str(v))}" for k in ("model", "gpus", "gpu", "gpu_memory", "nodes")
                    if (v := _attr(a, k)) is not None]
        n = len(self.frame)
        return (f"<div style='font-size:13px'><b>Layout advisor</b>: {', '.join(bits)}<br>{n} layout(s), "
                f"{int(self._fits().sum())} fit, {len(self.pareto_rows)} on the Pareto front</div>")

    def _table_html(self) -> str:
        f, c = self.frame, self.cols
        fits = self._fits()
        top = f[fits].head(self.table_rows)
        head = "<tr><th>row</th><th>layout</th><th>tokens/s</th><th>peak/GPU</th><th>bound</th><th>Pareto</th></tr>"
        rows = []
        for i, r in top.iterrows():
            rows.append(f"<tr><td>{i}</td><td>{html.escape(str(r[c['layout']]))}</td>"
                        f"<td>{float(r[c['tps']]):,.0f}</td><td>{format_bytes(int(r[c['peak']]))}</td>"
                        f"<td>{html.escape(str(r[c['bound']])) if c['bound'] else '-'}</td>"
                        f"<td>{'yes' if i in self.pareto_rows else ''}</td></tr>")
        pruned = int((~fits).sum())
        more = f"<div style='color:#666;font-size:12px'>{pruned} layout(s) do not fit or were pruned</div>" \
            if pruned else ""
        return f"<table style='font-size:12px'>{head}{''.join(rows)}</table>{more}"
