"""``CheckpointBrowser``: browse a checkpoint's tensors, where each shard lives, and what would load where.

A thin view over :mod:`workbench.checkpoint` (it holds no checkpoint logic)::

    CheckpointBrowser("runs/r1")          # or just evaluate inspect("runs/r1") in a cell

    +- summary: path, format, step, layout, bytes by kind ---------------------------------------+
    | [filter....] [kind v]   | Tensor | Diff | Load into layout | Verify                          |
    | model.layers.0  (9)     |  shard map: blocks of the global tensor coloured by writer rank   |
    |   attention.wq.weight   |  [Load statistics] -> min/max/mean/std + histogram (this tensor)  |
    |   ...                   |                                                                   |

Everything a button does is also a method, so notebooks and tests drive it without clicks:
``select(key)``, ``load_stats()``, ``run_diff(other)``, ``run_plan(**layout)``, ``run_verify()``.
"""

from __future__ import annotations

import html
import re
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.checkpoint.diff import CheckpointDiff, diff
from workbench.checkpoint.formats import open_source
from workbench.checkpoint.contents import inspect
from workbench.checkpoint.manifest import KINDS, CheckpointManifest
from workbench.checkpoint.stats import tensor_stats
from workbench.checkpoint.plan_load import LoadPlan, plan_load
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.checkpoint.verify import VerifyReport, verify
from workbench.config import ParallelConfig
from workbench.units import format_bytes
from workbench.widgets.controls import read_controls, setting_controls, write_controls
from workbench.widgets.plots import RUN_COLORS

__all__ = ["CheckpointBrowser", "group_of", "plot_shard_map"]

_INDEX = re.compile(r"^\d+$")


def group_of(key: str) -> str:
    """The module a key belongs to, for the grouped listing: up to the first layer index, else its parent.

    ``model.layers.3.attention.wq.weight`` -> ``model.layers.3``;
    ``optim.state.layers.3.ffn_norm.weight.exp_avg`` -> ``optim.state.layers.3``; ``model.norm.weight`` -> ``model``.
    """
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if _INDEX.match(p):
            return ".".join(parts[:i + 1])
    return parts[0] if len(parts) > 1 else ""


def _rank_color(rank: int | None) -> str:
    return "#999999" if rank is None else RUN_COLORS[rank % len(RUN_COLORS)]


def plot_shard_map(row: dict[str, Any], fig: go.Figure | None = None) -> go.Figure:
    """Blocks of one tensor's global shape, one rectangle per stored shard, coloured by writer rank.

    Rows are dimension 0 (top to bottom) and columns dimension 1; a 1-D tensor is one row of columns,
    higher dimensions show their first two.
    """
    fig = fig if fig is not None else go.Figure()
    shape = list(row["shape"] or [])
    if len(shape) == 0:
        dims = (1, 1)
    elif len(shape) == 1:
        dims = (1, shape[0])
    else:
        dims = (shape[0], shape[1])
    traces, seen = [], set()
    for s in row["shards"]:
        off, ln = list(s["offsets"]), list(s["lengths"])
        if len(shape) == 0:
            y0, x0, h, w = 0, 0, 1, 1
        elif len(shape) == 1:
            y0, x0, h, w = 0, off[0], 1, ln[0]
        else:
            y0, x0, h, w = off[0], off[1], ln[0], ln[1]
        rank = s.get("rank")
        name = f"rank {rank}" if rank is not None else (s.get("file") or "file")
        hover = (f"{html.escape(str(s.get('file')))}<br>rank {rank}<br>offsets {off}<br>lengths {ln}"
                 + (f"<br>{s['byte_length']:,} bytes in file" if s.get("byte_length") else ""))
        traces.append(go.Scatter(
            x=[x0, x0 + w, x0 + w, x0, x0], y=[y0, y0, y0 + h, y0 + h, y0], mode="lines", fill="toself",
            fillcolor=_rank_color(rank), opacity=0.75, line={"color": "white", "width": 2}, name=name,
            legendgroup=name, showlegend=name not in seen, hoveron="fills", text=hover, hoverinfo="text"))
        seen.add(name)
    title = f"{row['key']}  {row['dtype']}{shape}  ({len(row['shards'])} shard(s))"
    extra = f" - dims 0, 1 of {len(shape)}" if len(shape) > 2 else ""
    with fig.batch_update() if isinstance(fig, go.FigureWidget) else nullcontext():
        fig.data = []
        fig.add_traces(traces)
        fig.update_layout(title={"text": title + extra, "font": {"size": 12}},
                          xaxis={"title": "dim 1" if len(shape) > 1 else ("dim 0" if shape else ""),
                                 "range": [0, dims[1]], "constrain": "domain"},
                          yaxis={"title": "dim 0" if len(shape) > 1 else "", "range": [dims[0], 0]},
                          margin={"l": 50, "r": 10, "t": 40, "b": 40})
    return fig


class CheckpointBrowser(widgets.VBox):
    """Browse ``src`` (a path or a :class:`CheckpointManifest`): keys, shard map, stats, diff, load dry run."""

    def __init__(self, src: "str | Path | CheckpointManifest", *, max_listed: int = 2000):
        self.manifest = src if isinstance(src, CheckpointManifest) else inspect(src)
        self.max_listed = max_listed
        self._source = None
        self._rows = {r["key"]: r for r in self.manifest.frame.to_dict("records")}
        self.selected: str | None = None
        self.stats: dict[str, Any] | None = None
        self.diff_result: CheckpointDiff | None = None
        self.plan_result: LoadPlan | None = None
        self.verify_result: VerifyReport | None = None

        # ---- listing -------------------------------------------------------------------------------
        self.filter = widgets.Text(placeholder="filter keys (substring)", layout={"width": "220px"})
        self.kind = widgets.Dropdown(options=["all"] + [k for k in KINDS if (self.manifest.frame["kind"] == k).any()],
                                     value="all", layout={"width": "110px"})
        self.listing = widgets.Select(options=[], rows=22, layout={"width": "340px"})
        self.count = widgets.HTML()
        self.filter.observe(lambda _: self._refresh_listing(), "value")
        self.kind.observe(lambda _: self._refresh_listing(), "value")
        self.listing.observe(self._on_select, "value")

        # ---- tensor panel ----------------------------------------------------------------------------
        self.info = widgets.HTML()
        self.shard_figure = go.FigureWidget(layout={"height": 320, "width": 560, "legend": {"orientation": "h"}})
        self.stats_button = widgets.Button(description="Load statistics", icon="bar-chart",
                                           tooltip="read this tensor only and compute its statistics")
        self.stats_button.on_click(lambda _: self.load_stats())
        self.stats_html = widgets.HTML()
        self.histogram = go.FigureWidget(layout={"height": 220, "width": 560, "margin": {"l": 40, "r": 10, "t": 30, "b": 30},
                                                 "title": {"text": "histogram (load statistics)", "font": {"size": 12}}})
        tensor_panel = widgets.VBox([self.info, self.shard_figure, widgets.HBox([self.stats_button]), self.stats_html,
                                     self.histogram])

        # ---- diff panel ------------------------------------------------------------------------------
        self.diff_path = widgets.Text(placeholder="another checkpoint path", layout={"width": "380px"})
        self.diff_values = widgets.Checkbox(value=True, description="compare values", indent=False)
        self.diff_button = widgets.Button(description="Compare", icon="exchange")
        self.diff_button.on_click(lambda _: self.run_diff(self.diff_path.value))
        self.diff_html = widgets.HTML()
        self.diff_figure = go.FigureWidget(layout={"height": 260, "width": 560, "margin": {"l": 40, "r": 10, "t": 30, "b": 30},
                                                   "title": {"text": "largest value changes", "font": {"size": 12}}})
        diff_panel = widgets.VBox([widgets.HBox([self.diff_path, self.diff_values, self.diff_button]), self.diff_html,
                                   self.diff_figure])

        # ---- load-into-layout panel ------------------------------------------------------------------
        layout = self.manifest.layout or {}
        self.layout_controls = setting_controls("parallel", layout)  # every ParallelConfig setting
        self.weights_only = widgets.Checkbox(value=False, description="weights only (no optimizer)", indent=False)
        self.plan_button = widgets.Button(description="Dry run", icon="check")
        self.plan_button.on_click(lambda _: self.run_plan())
        self.plan_html = widgets.HTML()
        plan_panel = widgets.VBox([widgets.HBox(list(self.layout_controls.values()),
                                                layout=widgets.Layout(flex_flow="row wrap")),
                                   self.weights_only,
                                   self.plan_button, self.plan_html])

        # ---- verify panel ----------------------------------------------------------------------------
        self.verify_button = widgets.Button(description="Verify", icon="shield",
                                            tooltip="checksums, file sizes, chunk tiling")
        self.verify_button.on_click(lambda _: self.run_verify())
        self.verify_html = widgets.HTML()
        verify_panel = widgets.VBox([self.verify_button, self.verify_html])

        self.tabs = widgets.Tab(children=[tensor_panel, diff_panel, plan_panel, verify_panel])
        for i, t in enumerate(("Tensor", "Diff", "Load into layout", "Verify")):
            self.tabs.set_title(i, t)
        self.header = widgets.HTML(self._header_html())
        left = widgets.VBox([widgets.HBox([self.filter, self.kind]), self.count, self.listing])
        super().__init__([self.header, widgets.HBox([left, self.tabs])])
        self._refresh_listing()

    # ---- listing ---------------------------------------------------------------------------------------
    def _header_html(self) -> str:
        s = self.manifest.summary()
        kinds = " &middot; ".join(f"{k} {format_bytes(b)}" for k, b in s["bytes_by_kind"].items())
        return (f"<b>{html.escape(s['path'])}</b> ({s['format']}) &mdash; step {s['step']}, "
                f"{s['n_tensors']} tensors, {format_bytes(s['total_bytes'])}"
                + (f", layout <b>{html.escape(s['layout_description'])}</b>" if s["layout_description"] else "")
                + (f", {s['world_size']} writer rank(s)" if s["world_size"] else "") + f"<br><small>{kinds}</small>")

    def visible_keys(self) -> list[str]:
        """Keys passing the filter box and the kind dropdown, in checkpoint order."""
        text, kind = self.filter.value.strip(), self.kind.value
        return [k for k, r in self._rows.items()
                if (kind == "all" or r["kind"] == kind) and (not text or text in k)]

    def _refresh_listing(self) -> None:
        keys = self.visible_keys()
        options: list[tuple[str, str]] = []
        group = None
        sizes = Counter(group_of(k) for k in keys)
        for k in keys[: self.max_listed]:
            g = group_of(k)
            if g != group:
                n = sizes[g]
                options.append((f"\u25be {g or '(root)'}  ({n})", f"group:{g}"))
                group = g
            r = self._rows[k]
            shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
            options.append((f"    {k[len(g) + 1:] if g else k}   {shape}", k))
        self.count.value = (f"<small>{len(keys)} of {len(self._rows)} entries"
                            + (f" (first {self.max_listed} listed)" if len(keys) > self.max_listed else "") + "</small>")
        keep = self.listing.value
        self.listing.options = options
        if keep in dict((v, l) for l, v in options):
            self.listing.value = keep

    def _on_select(self, change) -> None:
        value = change["new"]
        if value is None:
            return
        if value.startswith("group:"):
            g = value[len("group:"):]
            keys = [k for k in self.visible_keys() if group_of(k) == g]
            total = sum(self._rows[k]["bytes"] for k in keys)
            self.info.value = f"<b>{html.escape(g or '(root)')}</b>: {len(keys)} entries, {format_bytes(total)}"
            return
        self.select(value)

    # ---- actions (also what the buttons do) ------------------------------------------------------------
    def select(self, key: str) -> dict[str, Any]:
        """Show ``key``: its facts and its shard map. Returns the manifest row."""
        if key not in self._rows:
            self.manifest.row(key)  # raises KeyError with close matches
        row = self._rows[key]
        self.selected = key
        self.stats = None
        self.stats_html.value = ""
        self.histogram.data = []
        ranks = sorted({s["rank"] for s in row["shards"] if s.get("rank") is not None})
        files = sorted({s["file"] for s in row["shards"] if s.get("file")})
        self.info.value = (f"<b>{html.escape(key)}</b> &mdash; {row['kind']}, {row['dtype']}, global shape "
                           f"{list(row['shape']) if row['shape'] is not None else '(pickled value)'}, "
                           f"{format_bytes(row['bytes'])}; {len(row['shards'])} shard(s) in {len(files)} file(s)"
                           + (f", written by rank(s) {ranks}" if ranks else ""))
        if row["shape"] is not None:
            plot_shard_map(row, self.shard_figure)
        else:
            self.shard_figure.data = []
        if self.listing.value != key and key in dict((v, l) for l, v in self.listing.options):
            self.listing.value = key
        return row

    def _tensor_source(self):
        if self._source is None:
            self._source = open_source(self.manifest)
        return self._source

    def load_stats(self, bins: int = 50) -> dict[str, Any]:
        """Read the selected tensor (only it) and show its statistics and histogram
        (:func:`workbench.checkpoint.tensor_stats`). Returns the statistics."""
        if self.selected is None:
            raise ValueError("select a tensor first (click one in the list, or call select(key))")
        try:
            stats = tensor_stats(self._tensor_source(), self.selected, bins=bins)
        except (CheckpointFormatError, KeyError) as e:
            self.stats_html.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            raise
        hist = stats.pop("histogram")
        self.stats = stats
        self.stats_html.value = ("<table>" + "".join(
            f"<tr><td>{k}</td><td style='text-align:right'>{v:.6g}</td></tr>" if isinstance(v, float)
            else f"<tr><td>{k}</td><td style='text-align:right'>{v}</td></tr>"
            for k, v in stats.items() if k != "key") + "</table>")
        if hist["counts"]:
            with self.histogram.batch_update():
                self.histogram.data = []
                self.histogram.add_bar(x=hist["centers"], y=hist["counts"], width=hist["width"],
                                       marker_color=RUN_COLORS[0], name=self.selected)
                self.histogram.layout.title.text = f"{self.selected} ({stats['numel']:,} values)"
        return stats

    def run_diff(self, other: "str | Path | CheckpointManifest", values: bool | None = None) -> CheckpointDiff | None:
        """Compare this checkpoint with ``other``; shows the report and the largest changes."""
        if not other:
            self.diff_html.value = "<span style='color:#cf222e'>enter the path of another checkpoint</span>"
            return None
        try:
            d = diff(self.manifest, other, values=self.diff_values.value if values is None else values, progress=False)
        except (CheckpointFormatError, ValueError, KeyError) as e:
            self.diff_html.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            self.diff_result = None
            return None
        self.diff_result = d
        self.diff_html.value = d._repr_html_()
        top = d.top(10)
        with self.diff_figure.batch_update():
            self.diff_figure.data = []
            if len(top):
                self.diff_figure.add_bar(x=top["rel_norm"].tolist()[::-1], y=top["key"].tolist()[::-1], orientation="h",
                                         marker_color=RUN_COLORS[1], name="||a-b|| / ||a||")
        return d

    def run_plan(self, full_state: bool | None = None, **layout: Any) -> LoadPlan | None:
        """Dry run of loading into the layout in the inputs (``layout`` sets them first: ``tp=2`` ...)."""
        if full_state is not None:
            self.weights_only.value = not full_state
        try:
            write_controls(self.layout_controls, "parallel", **layout)  # tp=0: its one-line ValueError
            target = ParallelConfig(**read_controls(self.layout_controls, "parallel"))
            plan = plan_load(self.manifest, target, full_state=not self.weights_only.value)
        except (ValueError, CheckpointFormatError) as e:
            self.plan_html.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            self.plan_result = None
            return None
        self.plan_result = plan
        self.plan_html.value = plan._repr_html_()
        return plan

    def run_verify(self) -> VerifyReport:
        """Checksums, sizes and chunk tiling of this checkpoint (:func:`workbench.checkpoint.verify`)."""
        report = verify(self.manifest.path, progress=False)
        self.verify_result = report
        self.verify_html.value = report._repr_html_()
        return report
