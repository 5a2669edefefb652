"""``CheckpointBrowser``: browse a checkpoint's tensors, where each shard lives, and what would load where.

A thin view over :mod:`workbench.checkpoint` (it holds no checkpoint logic)::

    CheckpointBrowser("runs/r1")          # or just evaluate inspect("runs/r1") in a cell

    +- summary: path, format, step, layout, bytes by kind ---------------------------------------+
    | [filter....] [kind v]   | Tensor | Diff | Load into layout | Verify                          |
    | model.layers.0  (9)     |  shard map: blocks of the global tensor coloured by writer rank   |
    |   attention.wq.weight   |  [Load statistics] [ ] log10 |x| [ ] log count                    |
    | optim.param_groups (1)  |    -> min, max, mean |x|... (the Lab tab's labels) + histogram    |
    |   0  lr=0.001, ... (48) |  Diff: [path] [kind v] [x] values [Compare] -> verdict + changes  |

The key tree takes the room it is given (it grows with the tab; names are not cut at a fixed width).
Optimizer hyper-parameters are one entry per param group (:mod:`workbench.checkpoint.param_groups`),
whether stored one tensor per parameter and name or packed (``optim.hyper.<digest>``, JSON); counts say
values (one per parameter and name), the same for both.

Everything a button does is also a method, so notebooks and tests drive it without clicks:
``select(key)``, ``select_param_group(name)``, ``load_stats(log=...)``, ``run_diff(other, kinds=...)``,
``run_plan(**layout)``, ``run_verify()``.
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
from workbench.checkpoint.labels import format_number, label
from workbench.checkpoint.contents import inspect
from workbench.checkpoint.manifest import KINDS, CheckpointManifest
from workbench.checkpoint.param_groups import (ParamGroup, describe_groups, format_value, listing, matches,
                                               param_groups)
from workbench.checkpoint.stats import tensor_stats
from workbench.checkpoint.plan_load import LoadPlan, plan_load
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.checkpoint.verify import VerifyReport, verify
from workbench.config import ParallelConfig
from workbench.kinds import KIND_COLORS, checkpoint_kind
from workbench.units import format_bytes
from workbench.widgets.controls import read_controls, setting_controls, write_controls
from workbench.widgets.plots import RUN_COLORS
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

__all__ = ["CheckpointBrowser", "group_of", "plot_shard_map"]

_INDEX = re.compile(r"^\d+$")
_PATTERNS = ("", "/", "x", ".", "\\", "+")  # plotly bar patterns: tensor kinds that share a kind's colour


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
                 + (f"<br>{format_bytes(s['byte_length'])} in file" if s.get("byte_length") else ""))
        traces.append(go.Scatter(
            x=[x0, x0 + w, x0 + w, x0, x0], y=[y0, y0, y0 + h, y0 + h, y0], mode="lines", fill="toself",
            fillcolor=_rank_color(rank), opacity=0.75, line={"color": "white", "width": 2}, name=name,
            legendgroup=name, showlegend=name not in seen, hoveron="fills", text=hover, hoverinfo="text"))
        seen.add(name)
    title = f"{row['key']}  {row['dtype']}{shape}  ({len(row['shards'])} shard(s))"
    extra = f" - dims 0, 1 of {len(shape)}" if len(shape) > 2 else ""
    with fig.batch_update() if isinstance(fig, PlotView) else nullcontext():
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

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __init__(self, src: "str | Path | CheckpointManifest", *, max_listed: int = 2000):
        self.manifest = src if isinstance(src, CheckpointManifest) else inspect(src)
        self.max_listed = max_listed
        self._source = None
        self._rows = {r["key"]: r for r in self.manifest.frame.to_dict("records")}
        self.param_groups: list[ParamGroup] = param_groups(self.manifest)
        self._groups = {g.name: g for g in self.param_groups}
        self._listing = listing(self.manifest, self.param_groups).to_dict("records")
        self.selected: str | None = None
        self.stats: dict[str, Any] | None = None
        self.diff_result: CheckpointDiff | None = None
        self.plan_result: LoadPlan | None = None
        self.verify_result: VerifyReport | None = None

        # ---- listing -------------------------------------------------------------------------------
        self.filter = widgets.Text(placeholder="filter keys (substring)", layout={"flex": "1 1 auto", "width": "auto"})
        self.kind = widgets.Dropdown(options=["all"] + [k for k in KINDS if (self.manifest.frame["kind"] == k).any()],
                                     value="all", layout={"width": "110px", "flex": "0 0 auto"})
        # width 100% of a pane that flexes with the tab: a wider tab shows longer names, none cut at 340px
        self.listing = widgets.Select(options=[], rows=22, layout={"width": "100%"})
        self.count = widgets.HTML()
        self.filter.observe(lambda _: self._refresh_listing(), "value")
        self.kind.observe(lambda _: self._refresh_listing(), "value")
        self.listing.observe(self._on_select, "value")

        # ---- tensor panel ----------------------------------------------------------------------------
        self.info = widgets.HTML()
        self.shard_figure = PlotView(layout={"height": 320, "width": 560, "legend": {"orientation": "h"}})
        self.stats_button = widgets.Button(description="Load statistics", icon="bar-chart",
                                           tooltip="read this tensor only and compute its statistics")
        self.stats_button.on_click(lambda _: self.load_stats())
        self.stats_log = widgets.Checkbox(value=False, description="log10 |x|", indent=False,
                                          tooltip="histogram of log10 |x| (zeros left out): values spanning decades")
        self.stats_log.observe(self._on_log, "value")
        # the count axis on a log scale: a few bins holding most values no longer flatten the rest
        self.stats_log_count = widgets.Checkbox(value=False, description="log count", indent=False,
                                                tooltip="histogram counts on a log scale")
        self.stats_log_count.observe(lambda _: self._count_axis(), "value")
        self.stats_html = widgets.HTML()
        self.histogram = PlotView(layout={"height": 220, "width": 560, "margin": {"l": 40, "r": 10, "t": 30, "b": 30},
                                                 "title": {"text": "histogram (load statistics)", "font": {"size": 12}}})
        tensor_panel = widgets.VBox([self.info, self.shard_figure,
                                     widgets.HBox([self.stats_button, self.stats_log, self.stats_log_count]),
                                     self.stats_html, self.histogram])

        # ---- diff panel ------------------------------------------------------------------------------
        self.diff_path = widgets.Text(placeholder="another checkpoint path", layout={"width": "380px"})
        self.diff_values = widgets.Checkbox(value=True, description="compare values", indent=False)
        self.diff_kind = widgets.Dropdown(options=[("all kinds", "all")] + [(k, k) for k in KINDS], value="all",
                                          layout={"width": "120px"}, tooltip="compare only this kind")
        self.diff_button = widgets.Button(description="Compare", icon="exchange")
        self.diff_button.on_click(lambda _: self.run_diff(self.diff_path.value))
        self.diff_html = widgets.HTML()
        self.diff_figure = PlotView(layout={"height": 320, "width": 560, "margin": {"l": 40, "r": 10, "t": 30, "b": 30},
                                                   "title": {"text": "largest value changes per tensor kind",
                                                             "font": {"size": 12}},
                                                   "xaxis": {"type": "log", "title": "||b - a|| / ||a||"},
                                                   "legend": {"orientation": "h"}})
        diff_panel = widgets.VBox([widgets.HBox([self.diff_path, self.diff_kind, self.diff_values, self.diff_button],
                                                layout=widgets.Layout(flex_flow="row wrap")),
                                   self.diff_html, self.diff_figure])

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
        left = widgets.VBox([widgets.HBox([self.filter, self.kind], layout=widgets.Layout(width="100%")), self.count,
                             self.listing], layout=widgets.Layout(flex="1 1 35%", min_width="300px"))
        self.tabs.layout = widgets.Layout(flex="1 1 65%", min_width="0")
        super().__init__([self.header, widgets.HBox([left, self.tabs], layout=widgets.Layout(width="100%"))])
        self._refresh_listing()

    # ---- listing ---------------------------------------------------------------------------------------
    def _header_html(self) -> str:
        s = self.manifest.summary()
        kinds = " &middot; ".join(f"{k} {format_bytes(b)}" for k, b in s["bytes_by_kind"].items())
        hyper = f" + {describe_groups(self.param_groups)}" if self.param_groups else ""
        return (f"<b>{html.escape(s['path'])}</b> ({s['format']}) &mdash; step {s['step']}, "
                f"{s['n_tensors']} tensors{hyper}, {format_bytes(s['total_bytes'])}"
                + (f", layout <b>{html.escape(s['layout_description'])}</b>" if s["layout_description"] else "")
                + (f", {s['world_size']} writer rank(s)" if s["world_size"] else "") + f"<br><small>{kinds}</small>")

    def visible_keys(self) -> list[str]:
        """Keys passing the filter box and the kind dropdown, in checkpoint order (every entry, folded or not)."""
        text, kind = self.filter.value.strip(), self.kind.value
        return [k for k, r in self._rows.items()
                if (kind == "all" or r["kind"] == kind) and (not text or text in k)]

    def visible_rows(self) -> list[dict[str, Any]]:
        """The listing's rows passing the filter and the kind: entries, and one row per param group."""
        text, kind = self.filter.value.strip(), self.kind.value
        return [r for r in self._listing if (kind == "all" or r["kind"] == kind) and matches(r, text)]

    @staticmethod
    def _tree_group(row: dict[str, Any]) -> str:
        g = row.get("group")
        return row["key"].rsplit(".", 1)[0] if g is not None else group_of(row["key"])

    def _refresh_listing(self) -> None:
        rows = self.visible_rows()
        options: list[tuple[str, str]] = []
        group = None
        sizes = Counter(self._tree_group(r) for r in rows)
        for r in rows[: self.max_listed]:
            g = self._tree_group(r)
            if g != group:
                options.append((f"\u25be {g or '(root)'}  ({sizes[g]})", f"group:{g}"))
                group = g
            name = r["key"][len(g) + 1:] if g else r["key"]
            if r["group"] is not None:
                options.append((f"    {name}  {r['group'].label()}", f"param_group:{r['key']}"))
                continue
            shape = "x".join(map(str, r["shape"])) if r["shape"] is not None else "-"
            options.append((f"    {name}   {shape}", r["key"]))
        self.count.value = "<small>" + html.escape(self._count_text(rows)) + (
            f" (first {self.max_listed} listed)" if len(rows) > self.max_listed else "") + "</small>"
        keep = self.listing.value
        self.listing.options = options
        if keep in dict((v, l) for l, v in options):
            self.listing.value = keep

    def _count_text(self, rows: list[dict[str, Any]]) -> str:
        """``5 of 201 tensors, 1 param group (480 hyper-parameter values), 2 plain values``: what is listed."""
        s = self.manifest.summary()
        tensors = sum(1 for r in rows if r["group"] is None and r["shape"] is not None)
        groups = [r["group"] for r in rows if r["group"] is not None]
        plain = sum(1 for r in rows if r["group"] is None and r["shape"] is None)
        text = f"{tensors} of {s['n_tensors']} tensors"
        if groups:
            text += (f", {len(groups)} param group{'s' if len(groups) != 1 else ''} "
                     f"({sum(g.n_values for g in groups)} hyper-parameter values)")
        if plain:
            text += f", {plain} plain value{'s' if plain != 1 else ''}"
        return text

    def _on_select(self, change) -> None:
        value = change["new"]
        if value is None:
            return
        if value.startswith("group:"):
            g = value[len("group:"):]
            rows = [r for r in self.visible_rows() if self._tree_group(r) == g]
            total = sum(int(r["bytes"]) for r in rows)
            self.info.value = f"<b>{html.escape(g or '(root)')}</b>: {len(rows)} entries, {format_bytes(total)}"
            return
        if value.startswith("param_group:"):
            self.select_param_group(value[len("param_group:"):])
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
                           + (f", written by rank(s) {ranks}" if ranks else "")
                           + ("<br>packed optimizer hyper-parameters: UTF-8 JSON, not numbers (no statistics); "
                              "their values are the param groups' entries" if key.startswith("optim.hyper.") else ""))
        if row["shape"] is not None:
            plot_shard_map(row, self.shard_figure)
        else:
            self.shard_figure.data = []
        if self.listing.value != key and key in dict((v, l) for l, v in self.listing.options):
            self.listing.value = key
        return row

    def select_param_group(self, name: str) -> ParamGroup:
        """Show one optimizer param group: every hyper-parameter, and its parameters."""
        if name not in self._groups:
            raise KeyError(f"{name!r} is not a param group of {self.manifest.path}; "
                           f"the groups are {list(self._groups)}")
        g = self._groups[name]
        self.selected = None
        self.stats = None
        self.stats_html.value = ""
        self.histogram.data = []
        self.shard_figure.data = []
        unread = "(could not be read)" if g.packed else "(pickled, not read)"
        hyper = "".join(f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>"
                        f"{html.escape(format_value(v)) if g.values_read else unread}</td></tr>"
                        for k, v in g.hyper.items())
        params = ", ".join(html.escape(p) for p in g.params[:50]) + (" ..." if len(g.params) > 50 else "")
        n = g.n_params
        stored = (f"{g.n_values} hyper-parameter values {html.escape(g.storage())}" if g.packed and g.values_read
                  else f"values {html.escape(g.storage())}, which could not be read" if g.packed
                  else f"{len(g.keys)} stored hyper-parameter entries, {format_bytes(g.bytes)}")
        self.info.value = (f"<b>{html.escape(g.name)}</b> &mdash; optimizer param group: "
                           f"{n if n is not None else 'unknown number of'} parameter(s), {stored}<table>{hyper}</table>"
                           + (f"<details><summary>parameters</summary> <small>{params}</small></details>"
                              if g.params else ""))
        if self.listing.value != f"param_group:{name}":
            options = dict((v, l) for l, v in self.listing.options)
            if f"param_group:{name}" in options:
                self.listing.value = f"param_group:{name}"
        return g

    def _tensor_source(self):
        if self._source is None:
            self._source = open_source(self.manifest)
        return self._source

    def load_stats(self, bins: int | None = None, log: bool | None = None) -> dict[str, Any]:
        """Read the selected tensor (only it) and show its statistics and histogram
        (:func:`workbench.checkpoint.tensor_stats`). ``bins``: default the last call's, first 50. ``log``
        (default: the checkbox): histogram of log10 |x|. Returns the statistics."""
        self._bins = bins = bins if bins is not None else getattr(self, "_bins", 50)
        if log is not None and log != self.stats_log.value:
            self._quiet_log = True
            try:
                self.stats_log.value = log
            finally:
                self._quiet_log = False
        if self.selected is None:
            raise ValueError("select a tensor first (click one in the list, or call select(key))")
        try:
            stats = tensor_stats(self._tensor_source(), self.selected, bins=bins, log=self.stats_log.value)
        except (CheckpointFormatError, KeyError, ValueError) as e:  # ValueError: packed hyper-parameters (JSON)
            self.stats_html.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            self.stats = None
            with self.histogram.batch_update():  # no earlier tensor's histogram under this one's error
                self.histogram.data = []
                self.histogram.layout.title.text = f"{self.selected}: not read"
            raise
        hist = stats.pop("histogram")
        self.stats = stats
        # the Lab tab's words and digits (workbench.checkpoint.labels): mean |x|, not abs_mean; 1.235e-04
        self.stats_html.value = ("<table>" + "".join(
            f"<tr><td>{html.escape(label(k))}</td><td style='text-align:right; white-space:nowrap'>"
            f"{html.escape(format_number(v))}</td></tr>"
            for k, v in stats.items() if k != "key") + "</table>")
        log_scale = hist["scale"] != "linear"
        with self.histogram.batch_update():
            self.histogram.data = []
            if hist["counts"]:
                self.histogram.add_bar(x=hist["centers"], y=hist["counts"], width=hist["width"],
                                       marker_color=RUN_COLORS[0], name=self.selected)
            left_out = f", {hist['excluded']:,} zeros left out" if log_scale and hist["excluded"] else ""
            self.histogram.layout.title.text = f"{self.selected} ({stats['numel']:,} values{left_out})"
            self.histogram.layout.xaxis.title.text = "log10 |x|" if log_scale else "x"
            self._count_axis()
        return stats

    def _count_axis(self) -> None:
        log = self.stats_log_count.value
        self.histogram.update_layout(yaxis={"type": "log" if log else "linear",
                                            "title": {"text": "count (log)" if log else "count"}})

    def _on_log(self, change) -> None:
        if self.stats is not None and self.selected is not None and not getattr(self, "_quiet_log", False):
            self.load_stats()

    def run_diff(self, other: "str | Path | CheckpointManifest", values: bool | None = None,
                 kinds: "list[str] | str | None" = None) -> CheckpointDiff | None:
        """Compare this checkpoint with ``other``: the report, and the largest changes of each tensor kind.

        ``kinds``: checkpoint kinds to compare (``"model"``, ``["optim"]``...; default: the kind dropdown).
        """
        if not other:
            self.diff_html.value = "<span style='color:#cf222e'>enter the path of another checkpoint</span>"
            return None
        try:
            if kinds is not None:
                wanted = [kinds] if isinstance(kinds, str) else list(kinds)
                self.diff_kind.value = checkpoint_kind(wanted[0]) if len(wanted) == 1 else "all"
            else:
                wanted = None if self.diff_kind.value == "all" else [self.diff_kind.value]
            d = diff(self.manifest, other, values=self.diff_values.value if values is None else values,
                     kinds=wanted, progress=False)
        except (CheckpointFormatError, ValueError, KeyError) as e:
            self.diff_html.value = f"<span style='color:#cf222e'>{html.escape(str(e))}</span>"
            self.diff_result = None
            return None
        self.diff_result = d
        self.diff_html.value = d._repr_html_()
        top = d.top(5)
        with self.diff_figure.batch_update():
            self.diff_figure.data = []
            seen: Counter = Counter()
            for tk, rows in reversed(list(top.groupby("tensor_kind", sort=False))):  # the first kind on top
                kind = rows["kind"].iloc[0]  # its colour (workbench.kinds); a pattern tells exp_avg from exp_avg_sq
                self.diff_figure.add_bar(x=rows["rel_norm"].tolist()[::-1], y=rows["key"].tolist()[::-1],
                                         orientation="h", name=tk, marker_color=KIND_COLORS.get(kind, "#7f7f7f"),
                                         marker_pattern_shape=_PATTERNS[seen[kind] % len(_PATTERNS)])
                seen[kind] += 1
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
