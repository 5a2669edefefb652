"""Views over :mod:`workbench.kernels.bench`: ``KernelBenchView`` (speed over sizes) and ``KernelCheckView``.

Thin: every number comes from the core object (``KernelBench.plot``, ``.where``, ``KernelCheck.where``);
the views only pick what to draw::

    KernelBenchView(bench())        # op, dtype and metric dropdowns; one line per implementation; the table
    KernelCheckView(check())        # headline, a row per kernel, failing rows; the rest folded

Evaluating a ``KernelBench`` or ``KernelCheck`` in a notebook shows these (``workbench.display``).
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
import pandas as pd

from workbench.kernels.bench import METRICS, KernelBench, KernelCheck
from workbench.kernels.check import _html_table
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

# One colour per implementation in every kernel plot; copy_ is the bandwidth ceiling, drawn dashed.
IMPL_STYLE = {"ours": {"color": "#d62728"}, "torch eager": {"color": "#1f77b4"},
              "torch.compile": {"color": "#2ca02c"}, "copy_": {"color": "#7f7f7f", "dash": "dash"}}


def _style(implementation: str) -> dict[str, Any]:
    return IMPL_STYLE["ours" if implementation.startswith("ours") else implementation]


class KernelBenchView:
    """Explore a :class:`KernelBench`: pick an op (case), a dtype and a metric; read ``fig`` and ``table``.

    Drive it from code with :meth:`select`. Without a GPU the bench holds CPU reference times only, and
    the view says so above the plot.
    """

    def __init__(self, result: KernelBench, *, case: str | None = None, dtype: str | None = None,
                 metric: str = "time"):
        cases = result.cases
        if not cases:
            raise ValueError("this KernelBench has no rows; run workbench.kernels.bench.bench() with some ops")
        self.result = result
        self._case, self._dtype, self._metric = case or cases[0], dtype, metric
        self._check(self._case, self._metric)
        self._busy = False
        style = {"description_width": "initial"}
        self.controls = {
            "case": widgets.Dropdown(options=cases, value=self._case, description="op", style=style),
            "dtype": widgets.Dropdown(options=self._dtypes(self._case), description="dtype", style=style,
                                      layout=widgets.Layout(width="150px")),
            "metric": widgets.Dropdown(options=[(label, m) for m, (label, _) in METRICS.items()], value=metric,
                                       description="metric", style=style),
        }
        self.header = widgets.HTML(f"<b>{html.escape(repr(result))}</b><br><i>{html.escape(result.note)}</i>")
        self.fig = PlotView(layout={
            "height": 420, "width": 900, "margin": {"l": 70, "r": 20, "t": 50, "b": 50}, "plot_bgcolor": "white",
            "xaxis": {"type": "log", "title": "size (elements, or rows)", "gridcolor": "#eeeeee"},
            "yaxis": {"gridcolor": "#eeeeee", "rangemode": "tozero"}, "hovermode": "x unified"})
        self.table = widgets.HTML("")
        for name in ("case", "dtype", "metric"):
            self.controls[name].observe(lambda ch, n=name: None if self._busy else self.select(**{n: ch["new"]}),
                                        "value")
        self.widget = widgets.VBox([self.header, widgets.HBox(list(self.controls.values())), self.fig, self.table])
        self.select(dtype=dtype)

    def _check(self, case: str, metric: str) -> None:
        if case not in self.result.cases:
            raise ValueError(f"case {case!r} is not in this bench; choose one of {', '.join(self.result.cases)}")
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r}: choose one of {', '.join(METRICS)}")

    def _dtypes(self, case: str) -> list[str]:
        return list(dict.fromkeys(self.result.where(case).rows["dtype"]))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        return f"KernelBenchView({self._case}, {self._dtype}, {self._metric})"

    def select(self, case: str | None = None, dtype: str | None = None, metric: str | None = None) -> None:
        """Show ``case`` (its first dtype unless ``dtype`` is given) and ``metric``."""
        case, metric = case or self._case, metric or self._metric
        self._check(case, metric)
        dtypes = self._dtypes(case)
        if dtype is None:
            dtype = self._dtype if case == self._case and self._dtype in dtypes else dtypes[0]
        if dtype not in dtypes:
            raise ValueError(f"dtype {dtype!r} was not benchmarked for {case}; choose one of {', '.join(dtypes)}")
        self._case, self._dtype, self._metric = case, dtype, metric
        self._busy = True
        try:
            self.controls["case"].value = case
            self.controls["dtype"].options = dtypes
            self.controls["dtype"].value = dtype
            self.controls["metric"].value = metric
        finally:
            self._busy = False
        self._draw()

    def _draw(self) -> None:
        data = self.result.plot(self._metric, case=self._case, dtype=self._dtype)
        label = METRICS[self._metric][0]
        with self.fig.batch_update():
            self.fig.data = ()
            for impl, g in data.groupby("implementation", sort=False):
                g = g.sort_values("size")
                self.fig.add_scatter(x=g["size"], y=g["value"], name=impl, mode="lines+markers", line=_style(impl),
                                     hovertemplate=f"{impl}: %{{y:.4g}}<extra></extra>")
            self.fig.layout.title = {"text": f"{self._case} ({self._dtype}): {label}", "font": {"size": 14}}
            self.fig.layout.yaxis.title = label
            if data.empty:
                self.fig.layout.annotations = [{"text": "nothing timed for this op (see the notes in the table)",
                                                "showarrow": False, "xref": "paper", "yref": "paper",
                                                "x": 0.5, "y": 0.5}]
            else:
                self.fig.layout.annotations = []
        self.table.value = self.result.where(self._case, self._dtype)._repr_html_()


class KernelCheckView:
    """A :class:`KernelCheck`, summary first: the headline once, one row per kernel (op: rows passed,
    failed and skipped, the largest error; failing kernels first), the failing rows open, and folded
    below them the same per case, the skipped rows and the passing rows. Each table scrolls inside a
    bounded height, so 300 passing rows cost one line. Filter by op, or show only one status."""

    def __init__(self, result: KernelCheck, *, op: str | None = None, status: str | None = None):
        self.result = result
        ops = list(dict.fromkeys(result.rows["op"]))
        color = "#1a7f37" if result.ok else "#cf222e"
        self.header = widgets.HTML(f"<b style='color:{color}'>{html.escape(result.headline())}</b>")
        self.controls = {
            # "" for all: a None value shows as no choice at all (a blank dropdown, no button pressed)
            "op": widgets.Dropdown(options=[("all ops", "")] + [(o, o) for o in ops], value=op or "", description="op"),
            "status": widgets.ToggleButtons(options=[("all", ""), ("failures", "fail"), ("skipped", "skip")],
                                            value=status or "", style={"button_width": "90px"}),
        }
        self.summary = widgets.HTML("")
        self.table = widgets.HTML("")
        for name in ("op", "status"):
            self.controls[name].observe(lambda ch: self._draw(), "value")
        self.widget = widgets.VBox([self.header, widgets.HBox(list(self.controls.values()),
                                                              layout=widgets.Layout(flex_flow="row wrap")),
                                    self.summary, self.table])
        self._draw()

    def select(self, op: str | None = None, status: str | None = None) -> None:
        self.controls["op"].value = op or ""
        self.controls["status"].value = status or ""  # each observer redraws

    def _draw(self) -> None:
        status = self.controls["status"].value or None
        shown = self.result.where(None, self.controls["op"].value or None)
        self.summary.value = _scrolling(_html_table(_failing_first(shown.by_op()), _KERNEL_COLUMNS, "per kernel"))
        rows = {s: shown.where(s).rows for s in ("fail", "skip", "pass") if status in (None, s)}
        sections = []
        if len(rows.get("fail", ())):
            sections.append(_section(rows["fail"], _ROW_COLUMNS, "failing row", opened=True))
        if status is None:
            sections.append(_section(_failing_first(shown.by_case()), _CASE_COLUMNS, "case", opened=False))
        for s, noun in (("skip", "skipped row"), ("pass", "passing row")):
            if len(rows.get(s, ())):
                sections.append(_section(rows[s], _ROW_COLUMNS, noun, opened=False))
        self.table.value = "".join(sections) or "<i>no rows</i>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        return f"KernelCheckView({self.result.headline()})"


# The columns of each table, and the tallest a table may draw before it scrolls: the summary, the
# failures and each folded section stay within a screen.
_KERNEL_COLUMNS = ["op", "status", "cases", "rows", "passed", "failed", "skipped", "max_abs_err"]
_CASE_COLUMNS = ["case", "status", "rows", "passed", "failed", "skipped", "max_abs_err", "vs_torch_err", "seconds"]
_ROW_COLUMNS = ["case", "dtype", "size", "label", "status", "max_abs_err", "max_rel_err", "vs_torch_err", "seconds",
                "note"]
_MAX_HEIGHT_PX = 360


def _scrolling(table: str) -> str:
    return f"<div style='max-height:{_MAX_HEIGHT_PX}px;overflow-y:auto'>{table}</div>"


def _failing_first(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("failed", ascending=False, kind="stable")


def _section(frame: pd.DataFrame, columns: list[str], noun: str, opened: bool) -> str:
    """``frame``'s rows under a ``<details>`` line that counts them: open for failures, folded otherwise."""
    n = len(frame)
    return (f"<details{' open' if opened else ''}><summary>{n} {noun}{'s' if n != 1 else ''}</summary>"
            f"{_scrolling(_html_table(frame, columns, ''))}</details>")
