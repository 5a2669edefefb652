"""``ShardingPlanView``: what each rank holds, drawn from a :class:`workbench.plan.ShardingPlan`.

A thin view: every number comes from the plan (``plan.blocks``, ``plan.block_groups``, ``plan.local``,
``plan.coords``, ``plan.rank_bytes``); the view only draws them. Four linked parts::

    view = ShardingPlanView(plan)          # or just evaluate the plan in a notebook
    view.controls["filter"].value = "layers.3.attention"   # search (substring, or regex when ticked)
    view.select_tensor("layers.3.attention.wq.weight")      # pick a tensor
    view.select_rank(17)                                    # or click a cell of the mesh

* **mesh**: the device mesh as a grid of ranks, every dim shown (ep included: it splits dp_shard into
  dp_shard_mod_ep x ep, a rank's ep index being ``s % ep``). Dims of size 1 are dropped; the last two
  remaining dims are the grid (x = the outer one, y = the inner one, e.g. dp_shard x tp), the ones before
  them become small multiples stacked top to bottom (pp always; others fold into x beyond 8 facets). Past
  64 x 16 cells a cell stands for several neighbouring ranks (the axis titles say how many), so 16,384
  ranks stay as legible as 8. Each cell is coloured by the index of the block of the selected tensor its
  (first) rank holds, on one continuous scale with a colour bar. A facet of another pipeline stage is
  dotted grey and titled "not on this stage", which is not the same as a replica (pp copies nothing, so
  pp is never listed as a placement).
* **tensor**: the selected tensor partitioned into the blocks the ranks hold. A 2-D tensor is a rectangle
  (rows down, columns across), a 1-D tensor a bar; an N-D tensor is drawn over its two sharded (else
  largest) dims and the other dims are named in the title. Each *distinct* block is drawn once, coloured
  on the mesh's scale, and at most 16 evenly spaced blocks are labelled with who holds them ("r3", or "x8"
  for 8 replicas; the hover says it for every block). Beyond 1024 blocks the tensor is a raster of at most
  256 x 256 cells, each coloured by the block covering it (thousands of sub-pixel strips draw nothing)::

        placements (dp_shard=S(0), tp=S(1)) on a 2 x 2 mesh:      state per block
        +---------+---------+                                      solid       sharded: a slice
        | r0      | r1      |   rows 0:n/2                         hatched /   replicated: a full copy
        +---------+---------+                                      hatched x   partial: a summand of
        | r2      | r3      |   rows n/2:n                                     the full tensor
        +---------+---------+
  The block table beside it gives each block's replica count and the ranks holding it.
* **bytes per rank**: parameter, gradient, optimizer and master bytes stacked, one bar per rank.
* **rank**: the selected rank's coordinates, its local shape and offsets of the selected tensor, and its
  byte totals.
* **predicted memory** (the "Predict memory" button, or :meth:`predict`): ``plan.predict_memory(device)``
  runs one training step on fake tensors (seconds to minutes); the predicted peak of every rank,
  activations included, is drawn as a line over the bytes per rank, each distinct rank's peak is drawn
  stacked by category, and a budget ("80GiB") is a horizontal line with ``plan.fits(budget, device)``'s
  answer: whether it fits, and the largest micro batch that does.

The tensor list never holds more than ``max_list`` entries (the first matches), so a plan with thousands
of tensors stays quick to search.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.colors

from workbench.kinds import STATE_KINDS
from workbench.palette import CATEGORY_COLORS as PALETTE_COLORS
from workbench.units import parse_bytes
from workbench.memory.timeline import CATEGORIES as MEMORY_CATEGORIES
from workbench.plan.types import group_blocks
from workbench.units import axis_unit, format_bytes
from workbench.widgets.plan_mesh import (ABSENT_COLOR, ABSENT_PATTERN, BLOCK_COLORSCALE, MESH_FACETS_MAX, MESH_X_MAX,  # noqa: F401
                                         MESH_Y_MAX, MeshPanel, _ints, _with_gaps)
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

CATEGORIES = STATE_KINDS
# One palette in the core (workbench.palette): a plan, a memory timeline and the Lab tabs share colours.
CATEGORY_COLORS = {k: PALETTE_COLORS[k] for k in STATE_KINDS}
MEMORY_COLORS = {c: PALETTE_COLORS[c] for c in MEMORY_CATEGORIES}
# The tensor panel quantizes the block colour scale (BLOCK_COLORSCALE: block b of n at b / (n - 1), so a colour
# names one block or a run of neighbours, never ten blocks at once) into at most COLOR_LEVELS traces.
COLOR_LEVELS = 32
# How a block's state is drawn: solid for a slice, hatched for a full copy, cross-hatched and dotted
# outline for a summand (a partial value every rank of the group adds to).
STATE_STYLE = {
    "sharded": {"pattern": "", "dash": "solid", "label": "sharded: a slice"},
    "replicated": {"pattern": "/", "dash": "solid", "label": "replicated: a full copy"},
    "partial": {"pattern": "x", "dash": "dot", "label": "partial: a summand of the whole"},
}
BLOCKS_CACHE = 64  # tensors whose blocks the view keeps, so going back and forth is instant
LABEL_BLOCKS_MAX = 16  # at most this many blocks are labelled (evenly spaced); the rest say who in the hover
TENSOR_POLYGONS_MAX = 1024  # above this many blocks the tensor is drawn as a raster of block indices
AREA_ABOVE_RANKS = 256  # above this many ranks, bytes per rank are stacked step areas rather than one bar per rank
TENSOR_RASTER = 256  # cells per side of that raster
PREDICTED_COLOR = "#000000"  # the predicted peak per rank, over the bytes per rank
BUDGET_COLOR = "#d62728"



def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 8, 9]`` -> ``"0-2, 5, 8-9"`` (at most 6 runs shown)."""
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:6])
    return text + (", …" if len(runs) > 6 else "")


def _sharded_dims(placements: tuple[str, ...]) -> list[int]:
    dims: list[int] = []
    for p in placements:
        m = re.fullmatch(r"_?S\((\d+)\)", p.strip())
        if m and int(m.group(1)) not in dims:
            dims.append(int(m.group(1)))
    return dims


def drawn_dims(shape: tuple[int, ...], placements: tuple[str, ...]) -> tuple[int, ...]:
    """The (at most two) tensor dims the picture shows: the sharded ones first, then the largest.

    Returned in tensor order, so for two dims the first is drawn down (rows) and the second across.
    """
    if len(shape) <= 2:
        return tuple(range(len(shape)))
    picked = [d for d in _sharded_dims(placements) if d < len(shape)][:2]
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if len(picked) == 2:
            break
        if d not in picked:
            picked.append(d)
    return tuple(sorted(picked))


class ShardingPlanView(MeshPanel):
    """Explore a :class:`ShardingPlan`: the mesh, one tensor's blocks, bytes per rank. Evaluate to show.

    ``tensor`` (a name) and ``kind`` pick the first tensor shown (default: the first tensor of ``kind``);
    ``rank`` the first selected rank; ``max_list`` caps the tensor list. Drive it from code through
    ``controls`` (``filter``, ``regex``, ``kind``, ``tensor``, ``rank``, ``device``, ``budget``),
    :meth:`select_tensor`, :meth:`select_rank` and :meth:`predict` (what the "Predict memory" button
    does); read back ``tensor``, ``rank``, ``matches``, ``blocks``, ``predicted`` and ``fit``.
    """

    def __init__(self, plan: Any, *, tensor: str | None = None, kind: str = "parameter", rank: int = 0,
                 max_list: int = 200):
        self.plan = plan
        self.max_list = max_list
        self.world_size = int(plan.world_size)
        if not 0 <= rank < self.world_size:
            raise ValueError(self._rank_error(rank))
        self._tensors = list(plan.tensors)
        self._names = [t.name for t in self._tensors]
        self._kinds = np.array([t.kind for t in self._tensors])
        self._index = {(t.name, t.kind): i for i, t in enumerate(self._tensors)}
        self._blocks_cache: dict[int, tuple[pd.DataFrame, pd.DataFrame]] = {}
        self._matches: list[int] = []
        self._current: int | None = None
        self._rank = rank
        self._busy = False  # set while the view updates its own controls, so observers don't re-enter
        self._predicted: tuple[str, pd.Series] | None = None  # (device, peak bytes per rank) once predicted
        self._fit: Any = None

        self.rank_bytes = plan.rank_bytes()
        # Mesh picture (see _layout_mesh): size-1 dims dropped, ep split out of dp_shard, cells aggregated.
        self._coords = plan.all_coords()  # coords(rank) for every rank at once, row = rank
        self._n_blocks = 1

        style = {"description_width": "initial"}
        self.controls: dict[str, widgets.ValueWidget] = {
            "filter": widgets.Text("", description="filter", placeholder="part of a name, e.g. layers.3.attention",
                                   continuous_update=True, style=style, layout=widgets.Layout(width="290px")),
            "regex": widgets.Checkbox(False, description="regex", indent=False, layout=widgets.Layout(width="80px")),
            "kind": widgets.Dropdown(options=["all", *CATEGORIES], value="all", description="kind", style=style,
                                     layout=widgets.Layout(width="160px")),
            "tensor": widgets.Select(options=[], rows=10, layout=widgets.Layout(width="440px")),
            "rank": widgets.BoundedIntText(rank, min=0, max=self.world_size - 1, description="rank", style=style,
                                           layout=widgets.Layout(width="140px")),
            # Plans are for GPU jobs: cuda (max_memory_allocated) first, predicted on any machine.
            "device": widgets.Dropdown(options=["cuda", "cpu"], value="cuda", description="target",
                                       style=style, layout=widgets.Layout(width="140px")),
            "budget": widgets.Text("", description="budget per rank", placeholder="e.g. 80GiB", style=style,
                                   layout=widgets.Layout(width="230px")),
        }
        c = self.controls
        self.count_label = widgets.HTML("")
        self.header = widgets.HTML(self._header_html())
        self.tensor_info = widgets.HTML("")
        self.rank_info = widgets.HTML("")
        self.mesh_fig = self._mesh_figure()
        self.tensor_fig = PlotView(layout={
            "height": 420, "width": 620, "margin": {"l": 70, "r": 10, "t": 60, "b": 50},
            "plot_bgcolor": "#f4f4f4", "legend": {"orientation": "h", "y": -0.12, "font": {"size": 10}},
            "hovermode": "closest"})
        self.bytes_fig = self._bytes_figure()
        self.predict_button = widgets.Button(description="Predict memory", button_style="primary",
                                             tooltip="run one training step on fake tensors: the peak of every "
                                                     "rank, activations included")
        self.memory_note = widgets.HTML(
            "<span style='font-size:12px;color:#555'>Predict memory: each rank's peak, activations included "
            "(one training step on fake tensors; seconds to minutes)</span>")
        self.memory_fig = PlotView(layout={
            "barmode": "stack", "height": 300, "width": 1080, "margin": {"l": 60, "r": 10, "t": 50, "b": 40},
            "yaxis": {"title": "GiB"}, "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1,
                                                  "xanchor": "right"}})
        self.memory_box = widgets.VBox([])  # holds memory_fig once there is a prediction
        self.predict_button.on_click(self._on_predict)

        c["filter"].observe(lambda _: self._refilter(), "value")
        c["regex"].observe(lambda _: self._refilter(), "value")
        c["kind"].observe(lambda _: self._refilter(), "value")
        c["tensor"].observe(self._on_tensor_control, "value")
        c["rank"].observe(lambda ch: None if self._busy else self.select_rank(ch["new"]), "value")
        for trace in self.mesh_fig.data:
            if (trace.meta or {}).get("role") == "mesh":
                trace.on_click(self._on_mesh_click)

        self.widget = widgets.VBox([
            self.header,
            widgets.HBox([
                widgets.VBox([widgets.HBox([c["filter"], c["regex"]]), widgets.HBox([c["kind"], self.count_label]),
                              c["tensor"],
                              self.tensor_info], layout=widgets.Layout(width="460px")),
                self.tensor_fig,
            ]),
            widgets.HBox([widgets.VBox([self.mesh_fig]), widgets.VBox([c["rank"], self.rank_info],
                                                                      layout=widgets.Layout(width="380px"))]),
            self.bytes_fig,
            widgets.HBox([self.predict_button, c["device"], c["budget"]]),
            self.memory_note,
            self.memory_box,
        ])

        self._refilter(redraw=False)
        start = self._index.get((tensor, kind)) if tensor is not None else None
        if tensor is not None and start is None:
            raise ValueError(f"the plan has no {kind} tensor named {tensor!r}; see plan.to_frame() for the names")
        if start is None:  # the first tensor of that kind (the embedding's parameter, in our models)
            start = next((i for i, k in enumerate(self._kinds) if k == kind), 0 if self._tensors else None)
        if start is not None:
            self._show_tensor(start)
        self._show_rank()

    def _rank_error(self, rank: int) -> str:
        return f"rank={rank} is outside the plan's {self.world_size} ranks; choose 0..{self.world_size - 1}"

    # -- notebook display ---------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

    def __repr__(self) -> str:
        t = self.tensor
        what = f"{t.name} [{t.kind}]" if t is not None else "no tensor"
        return f"ShardingPlanView({self.plan.model_name}, {self.world_size} ranks, {what}, rank {self._rank})"

    # -- state --------------------------------------------------------------------------------------
    @property
    def tensor(self) -> Any:
        """The selected :class:`TensorPlan` (None for a plan without tensors)."""
        return None if self._current is None else self._tensors[self._current]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def matches(self) -> list:
        """Every tensor the filter and kind select (the list control shows the first ``max_list``)."""
        return [self._tensors[i] for i in self._matches]

    @property
    def blocks(self) -> pd.DataFrame:
        """The distinct blocks of the selected tensor, as drawn (:meth:`ShardingPlan.block_groups`)."""
        return self._blocks(self._current)[1]

    @property
    def predicted(self) -> pd.Series | None:
        """The predicted peak bytes per rank drawn (``plan.predicted_peaks``), or None before a prediction."""
        return None if self._predicted is None else self._predicted[1].copy()

    @property
    def fit(self) -> Any:
        """``plan.fits(budget, device)`` of the last prediction with a budget (a FitAnswer), else None."""
        return self._fit

    # -- actions ------------------------------------------------------------------------------------
    def select_tensor(self, name: str, kind: str = "parameter") -> None:
        """Show tensor ``name`` of ``kind`` (it need not match the filter)."""
        i = self._index.get((name, kind))
        if i is None:
            raise ValueError(f"the plan has no {kind} tensor named {name!r}; see plan.to_frame() for the names")
        self._show_tensor(i)

    def select_rank(self, rank: int) -> None:
        """Highlight ``rank`` in every figure and show what it holds."""
        rank = int(rank)
        if not 0 <= rank < self.world_size:
            raise ValueError(self._rank_error(rank))
        self._rank = rank
        if self.controls["rank"].value != rank:
            self._busy = True
            try:
                self.controls["rank"].value = rank
            finally:
                self._busy = False
        self._show_rank()

    def predict(self, device: str | None = None, budget: str | None = None) -> None:
        """Predict every rank's peak memory and draw it (the "Predict memory" button). ``device`` and
        ``budget`` set the controls first. A failure shows as one line under the button."""
        if device is not None:
            self.controls["device"].value = device
        if budget is not None:
            self.controls["budget"].value = str(budget)
        self._on_predict(self.predict_button)

    def _on_predict(self, button: Any = None) -> None:
        device = self.controls["device"].value
        budget = self.controls["budget"].value.strip()
        self.predict_button.disabled = True
        self._fit = None
        try:
            budget_bytes = parse_bytes(budget) if budget else None  # a typo fails before the prediction
            self._note(f"predicting memory for {device} (one step on fake tensors)…", busy=True)
            timeline = self.plan.predict_memory(device)
            self._predicted = (device, self.plan.predicted_peaks(device))
            self._draw_predicted(timeline, budget_bytes)
            if budget_bytes is not None:
                self._note(f"searching the largest micro batch that fits in {format_bytes(budget_bytes)}…",
                           busy=True)
                self._fit = self.plan.fits(budget, device=device)
            self.memory_note.value = self._memory_html(budget_bytes)
        except Exception as exc:  # a view answers in one line, never a traceback
            lines = str(exc).strip().splitlines()
            self._note(f"{type(exc).__name__}: {lines[0] if lines else 'failed'}", error=True)
        finally:
            self.predict_button.disabled = False
        self._show_rank()

    def _note(self, text: str, busy: bool = False, error: bool = False) -> None:
        color = "#d62728" if error else "#555"
        icon = "⏳ " if busy else ""
        self.memory_note.value = f"<span style='font-size:12px;color:{color}'>{icon}{html.escape(text)}</span>"

    def _draw_predicted(self, timeline: Any, budget_bytes: int | None) -> None:
        device, peaks = self._predicted
        ranks = peaks.index.to_numpy()
        unit, scale = self.bytes_unit
        budget = [] if budget_bytes is None else [dict(
            type="scatter", x=[-0.5, self.world_size - 0.5], y=[budget_bytes / scale] * 2, mode="lines",
            name=f"budget {format_bytes(budget_bytes)}", line={"color": BUDGET_COLOR, "dash": "dash", "width": 2},
            hovertemplate=f"budget {format_bytes(budget_bytes)}<extra></extra>", meta={"role": "budget"})]
        # A CUDA prediction also knows what the caching allocator reserves (what fits() compares with the
        # budget, with the margin): drawn dashed beside the allocated peak.
        rank_map = timeline.meta.get("rank_map") or {}
        held = [timeline.reserved_peak(int(rank_map.get(str(r), r))) for r in ranks.tolist()]
        reserved = [] if not held or None in held else [dict(
            type="scatter", x=ranks.tolist(), y=[b / scale for b in held],
            mode="lines+markers" if self.world_size <= 64 else "lines",
            line={"shape": "hvh", "width": 2, "color": PREDICTED_COLOR, "dash": "dot"}, marker={"size": 5},
            name="predicted reserved (caching allocator)", customdata=[format_bytes(b) for b in held],
            hovertemplate="rank %{x}<br>predicted reserved: %{customdata}<extra></extra>",
            meta={"role": "reserved", "device": device})]
        with self.bytes_fig.batch_update():
            self.bytes_fig.data = [t for t in self.bytes_fig.data
                                   if (t.meta or {}).get("role") not in ("predicted", "reserved", "budget")]
            self.bytes_fig.add_traces([dict(
                type="scatter", x=ranks.tolist(), y=(peaks.to_numpy() / scale).tolist(),
                mode="lines+markers" if self.world_size <= 64 else "lines", line={"shape": "hvh", "width": 2,
                                                                                   "color": PREDICTED_COLOR},
                marker={"size": 6}, name=f"predicted peak ({device}, activations included)",
                customdata=[format_bytes(b) for b in peaks.tolist()],
                hovertemplate="rank %{x}<br>predicted peak: %{customdata}<extra></extra>",
                meta={"role": "predicted", "device": device}), *reserved, *budget])
        # Each distinct rank's peak, stacked by category; the ranks it stands for in its label.
        table = timeline.peaks()
        stands_for: dict[int, list[int]] = {}
        for r, rep_ in (timeline.meta.get("rank_map") or {}).items():
            stands_for.setdefault(int(rep_), []).append(int(r))
        labels = [f"rank {r}" + (f" (×{len(stands_for[r])})" if len(stands_for.get(r, ())) > 1 else "")
                  for r in table["rank"].tolist()]
        hover = [f"rank {r}: peak {format_bytes(b)} in {ph} (step {st})<br>stands for ranks "
                 f"{_rank_ranges(sorted(stands_for.get(r, [r])))}"
                 for r, b, ph, st in zip(table["rank"].tolist(), table["peak_bytes"].tolist(),
                                         table["phase"].tolist(), table["step"].tolist())]
        munit, mscale = axis_unit(max(int(table["peak_bytes"].max()), budget_bytes or 0))
        traces = [dict(type="bar", x=labels, y=(table[c].to_numpy() / mscale).tolist(), name=c,
                       marker={"color": MEMORY_COLORS[c], "line": {"width": 0}}, hovertext=hover,
                       hovertemplate=f"%{{hovertext}}<br>{c}: %{{y:.3f}} {munit}<extra></extra>", meta={"role": c})
                  for c in MEMORY_CATEGORIES if table[c].any()]
        line = [] if budget_bytes is None else [{  # across the whole plot, however few bars
            "type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": budget_bytes / mscale,
            "y1": budget_bytes / mscale, "line": {"color": BUDGET_COLOR, "dash": "dash", "width": 2}}]
        note = [] if budget_bytes is None else [{
            "xref": "paper", "x": 1, "xanchor": "right", "yref": "y", "y": budget_bytes / mscale, "yanchor": "bottom",
            "text": f"budget {format_bytes(budget_bytes)}", "showarrow": False, "font": {"color": BUDGET_COLOR}}]
        with self.memory_fig.batch_update():
            self.memory_fig.data = ()
            self.memory_fig.add_traces(traces)
            self.memory_fig.layout.shapes = line
            self.memory_fig.layout.annotations = note
            self.memory_fig.layout.yaxis.title.text = munit
            self.memory_fig.layout.title = {
                "text": f"Predicted peak of each distinct rank by category ({device}; {len(table)} distinct of "
                        f"{self.world_size:,} ranks)", "font": {"size": 13}}
            self.memory_fig.layout.xaxis = {"title": "rank (the ranks each stands for in the hover)"}
        self.memory_box.children = (self.memory_fig,)

    def _memory_html(self, budget_bytes: int | None) -> str:
        device, peaks = self._predicted
        worst = int(peaks.max())
        spread = (f"{format_bytes(worst)} on every rank" if peaks.min() == worst else
                  f"{format_bytes(peaks.min())} to {format_bytes(worst)} per rank (rank {int(peaks.idxmax())} highest)")
        text = f"predicted peak ({html.escape(device)}, activations included): {spread}"
        if budget_bytes is not None:
            fits = worst <= budget_bytes
            verdict = (f"<b style='color:{'#2ca02c' if fits else BUDGET_COLOR}'>"
                       f"{'fits' if fits else 'does not fit'}</b> in {format_bytes(budget_bytes)}")
            if self._fit is not None:
                mb = self._fit.micro_batch
                verdict += (f"; largest micro batch that fits: <b>{mb}</b> (peak "
                            f"{format_bytes(self._fit.peak_at_micro_batch)})" if mb else "; no micro batch fits")
            text += f"<br>{verdict}"
        return f"<div style='font-size:12px;line-height:1.4'>{text}</div>"

    # -- filtering ----------------------------------------------------------------------------------
    def _refilter(self, redraw: bool = True) -> None:
        if self._busy:
            return
        text, kind = self.controls["filter"].value.strip(), self.controls["kind"].value
        candidates = range(len(self._tensors)) if kind == "all" else np.flatnonzero(self._kinds == kind).tolist()
        error = ""
        if not text:
            matches = list(candidates)
        elif self.controls["regex"].value:
            try:
                pattern = re.compile(text)
            except re.error as exc:
                pattern, error = None, f"invalid regex: {exc}; untick regex to search for the text itself"
            matches = [i for i in candidates if pattern.search(self._names[i])] if pattern else []
        else:
            low = text.lower()
            matches = [i for i in candidates if low in self._names[i].lower()]
        self._matches = matches
        shown = matches[: self.max_list]
        if error:
            self.count_label.value = f"<span style='color:#d62728'>{html.escape(error)}</span>"
        else:
            more = f" (showing the first {len(shown)})" if len(matches) > len(shown) else ""
            self.count_label.value = f"<b>{len(matches):,}</b> of {len(self._tensors):,} tensors match{more}"
        options = [(self._option_label(i), i) for i in shown]
        self._busy = True
        try:
            self.controls["tensor"].options = options
            self.controls["tensor"].value = self._current if self._current in shown else None
        finally:
            self._busy = False
        if redraw and shown and self._current not in shown:
            self._show_tensor(shown[0])

    def _option_label(self, i: int) -> str:
        t = self._tensors[i]
        return f"{t.name} · {t.kind} · {'x'.join(map(str, t.global_shape)) or 'scalar'}"

    def _on_tensor_control(self, change: dict) -> None:
        if not self._busy and change["new"] is not None:
            self._show_tensor(change["new"])

    # -- tensor -------------------------------------------------------------------------------------
    def _blocks(self, i: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
        if i is None:
            empty = pd.DataFrame(columns=["block", "offsets", "lengths", "state", "ranks", "replicas"])
            return pd.DataFrame(columns=["rank", "offsets", "lengths", "state"]), empty
        if i not in self._blocks_cache:
            t = self._tensors[i]
            per_rank = self.plan.blocks(t.name, kind=t.kind)
            if len(self._blocks_cache) >= BLOCKS_CACHE:  # a frame per rank each: keep the recent ones only
                self._blocks_cache.pop(next(iter(self._blocks_cache)))
            self._blocks_cache[i] = (per_rank, group_blocks(per_rank))  # = plan.block_groups, one blocks() call
        return self._blocks_cache[i]

    def _show_tensor(self, i: int) -> None:
        self._current = i
        if self.controls["tensor"].value != i and any(v == i for _, v in self.controls["tensor"].options):
            self._busy = True
            try:
                self.controls["tensor"].value = i
            finally:
                self._busy = False
        t = self._tensors[i]
        per_rank, uniq = self._blocks(i)
        self._draw_tensor(t, uniq)
        self._color_mesh(t, per_rank, uniq)
        self.tensor_info.value = self._tensor_html(t, uniq, per_rank)
        self._show_rank()

    def _draw_tensor(self, t: Any, uniq: pd.DataFrame) -> None:
        shape = tuple(t.global_shape) or (1,)  # a scalar is drawn as a bar of one element
        dims = drawn_dims(shape, tuple(t.placements))
        ydim, xdim = (dims[0], dims[1]) if len(dims) == 2 else (None, dims[0])
        nd = len(shape)
        off = np.array([o or (0,) for o in uniq["offsets"]], dtype=np.int64).reshape(-1, nd)
        ln = np.array([n or (1,) for n in uniq["lengths"]], dtype=np.int64).reshape(-1, nd)
        keep = ln.prod(axis=1) > 0  # an empty shard has nothing to draw (the info panel counts it)
        blocks, states = uniq["block"].to_numpy()[keep], uniq["state"].to_numpy()[keep]
        ranks, reps = uniq["ranks"].to_numpy()[keep], uniq["replicas"].to_numpy()[keep]
        off, ln = off[keep], ln[keep]
        x0, x1 = off[:, xdim], off[:, xdim] + ln[:, xdim]
        if ydim is None:
            y0, y1 = np.zeros(len(off)), np.ones(len(off))
        else:
            y0, y1 = off[:, ydim], off[:, ydim] + ln[:, ydim]
        n_blocks = max(len(uniq), 1)
        self._n_blocks = n_blocks
        cmax = max(n_blocks - 1, 1)
        colorbar = {"title": {"text": "block", "side": "right"}, "thickness": 10, "len": 0.8,
                    "tickformat": ",d"}
        traces: list[dict] = []
        labels: list[dict] = []
        self._raster = None
        if len(off) > TENSOR_POLYGONS_MAX:
            traces = self._tensor_raster(shape, xdim, ydim, blocks, ranks, x0, x1, y0, y1, cmax, colorbar)
        else:
            # Every block a closed rectangle, NaN between rectangles: one trace draws many of them.
            gap = np.full(len(off), np.nan)
            xs = np.stack([x0, x1, x1, x0, x0, gap], axis=1).astype(float)
            ys = np.stack([y0, y0, y1, y1, y0, gap], axis=1).astype(float)
            levels = min(n_blocks, COLOR_LEVELS)
            level = np.rint(blocks / cmax * (levels - 1)).astype(np.int64) if levels > 1 else np.zeros(len(off), int)
            palette = plotly.colors.sample_colorscale(BLOCK_COLORSCALE, [i / max(levels - 1, 1) for i in range(levels)])
            outline = 0.6 if len(off) <= 64 else 0  # outlines of hundreds of thin strips hide the colours
            for state in [s for s in STATE_STYLE if s in set(states)] + sorted(set(states) - set(STATE_STYLE)):
                st = STATE_STYLE.get(state, STATE_STYLE["sharded"])
                for lv in sorted(set(level[states == state].tolist())):
                    sel = (states == state) & (level == lv)
                    traces.append(dict(
                        type="scatter", x=xs[sel].ravel(), y=ys[sel].ravel(), mode="lines", fill="toself",
                        fillcolor=palette[lv],
                        fillpattern={"shape": st["pattern"], "bgcolor": palette[lv], "fgcolor": "white",
                                     "fgopacity": 0.9, "size": 10} if st["pattern"] else None,
                        line={"color": "black", "width": outline, "dash": st["dash"]}, hoverinfo="skip",
                        showlegend=False, meta={"role": "blocks", "state": state}))
                traces.append(dict(  # the legend entry for this state (a bar: legends show its pattern)
                    type="bar", x=[None], y=[None], name=st["label"], meta={"role": "legend", "state": state},
                    marker={"color": "#bbbbbb", "pattern": {"shape": st["pattern"], "fgcolor": "white"},
                            "line": {"color": "black", "width": 0.6}}))
            hover = [f"block {b} [{', '.join(f'{o}:{o + n}' for o, n in zip(o_, n_))}] · {s}<br>"
                     f"held by {r} rank(s): {_rank_ranges(list(rk))}"
                     for b, o_, n_, s, r, rk in zip(blocks.tolist(), off.tolist(), ln.tolist(), states, reps.tolist(),
                                                    ranks)]
            centres_x, centres_y = (x0 + x1) / 2, (y0 + y1) / 2
            traces.append(dict(  # invisible markers at the block centres: the hover text, a click target, and
                # the colour bar of the block scale
                type="scatter", x=centres_x, y=centres_y, mode="markers", hovertext=hover, hoverinfo="text",
                customdata=np.stack([blocks.astype(np.int64), np.array([rk[0] for rk in ranks], dtype=np.int64)],
                                    axis=1) if len(off) else None,
                marker={"size": 14, "opacity": 0, "color": blocks.astype(float), "colorscale": BLOCK_COLORSCALE,
                        "cmin": 0, "cmax": cmax, "showscale": n_blocks > 1, "colorbar": colorbar},
                showlegend=False, meta={"role": "centres"}))
            # Labels on at most LABEL_BLOCKS_MAX blocks, evenly spaced: "r3" for one rank, "x8" for 8 replicas.
            pick = sorted(set(np.linspace(0, len(off) - 1, min(len(off), LABEL_BLOCKS_MAX)).round().astype(int)
                              .tolist())) if len(off) else []
            labels = [{"x": float(centres_x[i]), "y": float(centres_y[i]),
                       "text": f"×{reps[i]}" if reps[i] > 1 else f"r{ranks[i][0]}", "showarrow": False,
                       "font": {"size": 11, "color": "black"}, "bgcolor": "rgba(255,255,255,0.75)"} for i in pick]
        rep_set = sorted(set(uniq["replicas"]))
        rep_text = (f"each block held by {rep_set[0]} rank(s)" if len(rep_set) == 1
                    else f"blocks held by {rep_set[0]}-{rep_set[-1]} ranks") if rep_set else "held by no rank"
        rest = [f"dim {d}={shape[d]}" for d in range(len(shape)) if d not in dims]
        raster = ""
        if self._raster:
            per = self._raster["per_cell"]
            raster = (f"; drawn as {self._raster['cells']:,} cells, ~{per:,.0f} block(s) each" if per >= 1.5
                      else f"; drawn as {self._raster['cells']:,} cells, each block over ~{1 / per:,.0f}" if per
                      else f"; drawn as {self._raster['cells']:,} cells")
        title = (f"<b>{html.escape(t.name)}</b> [{t.kind}] {tuple(t.global_shape)}<br>"
                 f"<span style='font-size:11px'>{len(uniq):,} distinct block(s), {rep_text}{raster}"
                 f"{'; not drawn (whole in every block): ' + ', '.join(rest) if rest else ''}</span>")
        with self.tensor_fig.batch_update():
            self.tensor_fig.data = ()
            self.tensor_fig.add_traces(traces)
            target = self.tensor_fig.data[-1]
            target.on_click(self._on_raster_click if self._raster else self._on_block_click)
            self.tensor_fig.layout.title = {"text": title, "font": {"size": 13}}
            self.tensor_fig.layout.annotations = labels
            self.tensor_fig.layout.xaxis = {"title": f"dim {xdim} ({shape[xdim]:,})", "range": [0, shape[xdim]],
                                            "zeroline": False, "showgrid": False}
            if ydim is None:
                self.tensor_fig.layout.yaxis = {"range": [0, 1], "showticklabels": False, "title": "",
                                                "showgrid": False, "zeroline": False}
            else:
                self.tensor_fig.layout.yaxis = {"title": f"dim {ydim} ({shape[ydim]:,})", "range": [shape[ydim], 0],
                                                "zeroline": False, "showgrid": False}
        self._xy_dims = (xdim, ydim)

    def _tensor_raster(self, shape, xdim, ydim, blocks, ranks, x0, x1, y0, y1, cmax, colorbar) -> list[dict]:
        """Thousands of blocks as one heatmap: each cell is coloured by the block that covers its centre.

        Sub-pixel rectangles draw nothing in a browser; a raster of at most TENSOR_RASTER^2 cells always
        shows every block's place on the scale, whatever the rank count."""
        w = shape[xdim]
        h = shape[ydim] if ydim is not None else 1
        nx, ny = min(w, TENSOR_RASTER), min(h, TENSOR_RASTER) if ydim is not None else 1
        cx = (np.arange(nx) + 0.5) * w / nx
        cy = (np.arange(ny) + 0.5) * h / ny
        z = np.full((ny, nx), np.nan)
        owner = np.full((ny, nx), -1, dtype=np.int64)
        xi0, xi1 = np.searchsorted(cx, x0), np.searchsorted(cx, x1)
        yi0, yi1 = np.searchsorted(cy, y0), np.searchsorted(cy, y1)
        for b, rk, a, bb, c, d in zip(blocks.tolist(), ranks, xi0.tolist(), xi1.tolist(), yi0.tolist(), yi1.tolist()):
            z[c:d, a:bb] = b
            owner[c:d, a:bb] = rk[0]
        self._raster = {"cells": nx * ny, "per_cell": len(blocks) / max(np.isfinite(z).sum(), 1),
                        "x": cx, "y": cy, "owner": owner}
        text = np.where(np.isfinite(z), np.char.add("block ", np.nan_to_num(z, nan=-1).astype(np.int64).astype(str)),
                        "")
        return [dict(type="heatmap", z=_with_gaps(z), x=cx, y=cy if ydim is not None else [0.5], text=text,
                     colorscale=BLOCK_COLORSCALE, zmin=0, zmax=cmax, showscale=True, colorbar=colorbar,
                     customdata=owner, hovertemplate="%{text} (first held by rank %{customdata})<extra></extra>",
                     meta={"role": "raster"})]

    def _on_raster_click(self, trace: Any, points: Any, selector: Any) -> None:
        if points.xs and self._raster is not None:
            ix = int(np.argmin(np.abs(self._raster["x"] - points.xs[0])))
            iy = int(np.argmin(np.abs(self._raster["y"] - points.ys[0]))) if len(self._raster["y"]) > 1 else 0
            rank = int(self._raster["owner"][iy, ix])
            if rank >= 0:
                self.select_rank(rank)

    def _on_block_click(self, trace: Any, points: Any, selector: Any) -> None:
        if points.point_inds:
            self.select_rank(trace.customdata[points.point_inds[0]][1])

    # -- bytes --------------------------------------------------------------------------------------
    def _bytes_figure(self) -> PlotView:
        rb = self.rank_bytes
        ranks = list(range(self.world_size))
        fig = PlotView()
        distinct = len(rb[list(c for c in CATEGORIES if c in rb.columns)].drop_duplicates())
        # The axis unit follows the largest rank's total: MiB for a tiny model, GiB for a 70B one.
        self.bytes_unit = unit, scale = axis_unit(rb["total"].max() if "total" in rb.columns else 0)
        with fig.batch_update():
            for cat in CATEGORIES:
                if cat not in rb.columns:
                    continue
                y = (rb[cat].to_numpy() / scale).tolist()
                hover = f"rank %{{x}}<br>{cat}: %{{y:.3f}} {unit}<extra></extra>"
                if self.world_size <= AREA_ABOVE_RANKS:
                    fig.add_bar(x=ranks, y=y, name=cat, marker={"color": CATEGORY_COLORS[cat], "line": {"width": 0}},
                                hovertemplate=hover)
                else:  # thousands of bars are thousands of SVG paths: one stacked step area per category
                    fig.add_scatter(x=ranks, y=y, name=cat, mode="lines", stackgroup="bytes",
                                    line={"color": CATEGORY_COLORS[cat], "width": 0, "shape": "hvh"},
                                    fillcolor=CATEGORY_COLORS[cat], hovertemplate=hover)
            fig.update_layout(
                barmode="stack", bargap=0 if self.world_size > 64 else 0.15, height=300, width=1080,
                title={"text": f"Bytes per rank by category ({distinct} distinct pattern(s) over "
                               f"{self.world_size:,} ranks)", "font": {"size": 13}},
                xaxis={"title": "rank"}, yaxis={"title": unit}, margin={"l": 60, "r": 10, "t": 50, "b": 40},
                legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"})
        return fig

    # -- rank ---------------------------------------------------------------------------------------
    def _show_rank(self) -> None:
        rank = self._rank
        f, x, y = self._cell(rank)
        mesh_axis = "" if f == 0 else str(f + 1)
        self.mesh_fig.layout.shapes = [{"type": "rect", "xref": f"x{mesh_axis}", "yref": f"y{mesh_axis}",
                                        "x0": x - 0.5, "x1": x + 0.5, "y0": y - 0.5, "y1": y + 0.5,
                                        "line": {"color": "black", "width": 3}}]
        self.bytes_fig.layout.shapes = [{"type": "rect", "xref": "x", "yref": "paper", "x0": rank - 0.5,
                                         "x1": rank + 0.5, "y0": 0, "y1": 1, "fillcolor": "rgba(0,0,0,0.12)",
                                         "line": {"color": "black", "width": 1}}]
        local = None
        t = self.tensor
        if t is not None:
            local = self.plan.local(t.name, rank, kind=t.kind)
            shapes = []
            if local is not None and math.prod(local[0]) > 0:
                xdim, ydim = self._xy_dims
                ln, off = local[0] or (1,), local[1] or (0,)
                y0, y1 = (off[ydim], off[ydim] + ln[ydim]) if ydim is not None else (0, 1)
                shapes = [{"type": "rect", "x0": off[xdim], "x1": off[xdim] + ln[xdim], "y0": y0, "y1": y1,
                           "line": {"color": "black", "width": 3}}]
            self.tensor_fig.layout.shapes = shapes
        self.rank_info.value = self._rank_html(rank, t, local)

    # -- text ---------------------------------------------------------------------------------------
    def _header_html(self) -> str:
        p = self.plan
        parallel = getattr(p, "parallel", None)
        layout = parallel.describe() if hasattr(parallel, "describe") else ""
        total = self.rank_bytes["total"] if "total" in self.rank_bytes.columns else self.rank_bytes.sum(axis=1)
        return (f"<b>Sharding plan</b>: {html.escape(str(p.model_name))} · {html.escape(layout)} · "
                f"{self.world_size:,} ranks · {len(self._tensors):,} tensors · per-rank bytes "
                f"{format_bytes(total.min())} to {format_bytes(total.max())}")

    def _placements_text(self, t: Any) -> str:
        """Placements over the mesh dims that split or copy data. pp is not one of them: a pipeline stage
        holds its own layers and copies nothing, so the tensor's stage is named instead."""
        names, shape = self.plan.mesh_dim_names, self.plan.mesh_shape
        parts = []
        for d, p in enumerate(t.placements):
            if shape[d] <= 1 or names[d] == "pp":
                continue
            part = f"{names[d]}={p}"
            if names[d] == "dp_shard" and self._ep > 1:
                part += f" (dp_shard = dp_shard_mod_ep {shape[d] // self._ep} x ep {self._ep})"
            parts.append(part)
        text = ", ".join(parts) or "one rank"
        if "pp" in names and shape[names.index("pp")] > 1:
            stage = getattr(t, "stage", None)
            pp = shape[names.index("pp")]
            text += (f"; on stage {stage} of pp={pp} only" if stage is not None
                     else f"; on every stage of pp={pp}")
        return text

    def _tensor_html(self, t: Any, uniq: pd.DataFrame, per_rank: pd.DataFrame) -> str:
        absent = int((per_rank["state"] == "absent").sum())
        stage = f" · stage {t.stage}" if getattr(t, "stage", None) is not None else ""
        rows = "".join(
            f"<tr><td>{b}</td><td>{html.escape(str(off))}</td><td>{html.escape(str(ln))}</td><td>{st}</td>"
            f"<td>{reps:,}</td><td>{html.escape(_rank_ranges(list(rk)))}</td></tr>"
            for b, off, ln, st, reps, rk in uniq[["block", "offsets", "lengths", "state", "replicas", "ranks"]].head(4)
            .itertuples(index=False))
        more = f"<tr><td colspan=6>… {len(uniq) - 4:,} more (hover the blocks)</td></tr>" if len(uniq) > 4 else ""
        names = list(self.plan.mesh_dim_names)
        off_stage = 0
        if getattr(t, "stage", None) is not None and "pp" in names and self.plan.mesh_shape[names.index("pp")] > 1:
            off_stage = int((self._coords[:, names.index("pp")] != t.stage).sum())
        where = (f"{off_stage:,} rank(s) not on this stage, {absent - off_stage:,} hold none of it" if off_stage
                 else f"{absent:,} rank(s) hold none of it")
        return (f"<div style='font-size:12px;line-height:1.4'><b>{html.escape(t.name)}</b> [{t.kind}] {t.dtype} "
                f"{tuple(t.global_shape)} = {format_bytes(t.nbytes)}{stage}<br>placements: "
                f"{html.escape(self._placements_text(t))}"
                f"<br>{len(uniq):,} distinct block(s); {where}"
                f"<table style='font-size:11px;line-height:1.2'><tr><th>block</th><th>offsets</th><th>lengths</th>"
                f"<th>state</th><th>replicas</th><th>ranks</th></tr>{rows}{more}</table></div>")

    def _rank_html(self, rank: int, t: Any, local: Any) -> str:
        coords = self._rank_coords(rank)
        if t is None:
            holds = ""
        elif local is None:
            where = f" (it lives on stage {t.stage})" if getattr(t, "stage", None) is not None else ""
            holds = f"holds none of <b>{html.escape(t.name)}</b>{where}"
        else:
            ln, off = local
            holds = (f"holds <b>{html.escape(t.name)}</b> [{t.kind}]: local shape {tuple(ln)}, offsets "
                     f"{tuple(off)} = {format_bytes(math.prod(ln) * t.itemsize)}")
        row = self.rank_bytes.loc[rank]
        cells = "".join(f"<tr><td>{c}</td><td style='text-align:right'>{format_bytes(row[c])}</td></tr>"
                        for c in (*CATEGORIES, "total") if c in row.index)
        if self._predicted is not None:
            device, peaks = self._predicted
            cells += (f"<tr><td>predicted peak ({html.escape(device)})</td>"
                      f"<td style='text-align:right'>{format_bytes(peaks.loc[rank])}</td></tr>")
        return (f"<div style='font-size:12px;line-height:1.4'><b>rank {rank}</b> ({coords})<br>{holds}"
                f"<table style='font-size:12px;line-height:1.2'>{cells}</table></div>")


__all__ = ["ShardingPlanView", "drawn_dims"]
