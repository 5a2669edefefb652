"""The mesh panel of :class:`~workbench.widgets.plan_view.ShardingPlanView`: every rank as a cell of the
device mesh (faceted by pipeline stage), coloured by which block of the tensor it holds; a click selects
the rank. A mixin: it reads the view's plan and state, and draws into its ``mesh_fig``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.widgets.plotly_view import PlotView

# Block b of n is drawn at b / (n - 1) on one continuous scale (a colour bar says which is which).
BLOCK_COLORSCALE = "Viridis"
ABSENT_COLOR = "#dddddd"  # a mesh cell whose rank holds none of the tensor (another stage or owner), dotted
ABSENT_PATTERN = "."  # unlike "/" (replicated) and "x" (partial): holding nothing is not holding a copy
MESH_X_MAX = 64  # mesh cells drawn across; more ranks than this share a cell (aggregated)
MESH_Y_MAX = 16  # mesh cells drawn down
MESH_FACETS_MAX = 8  # facets beyond this fold their dims into the x axis (pp always stays a facet)


def _ints(v: Any) -> tuple[int, ...] | None:
    if type(v) is tuple:  # what plan.blocks gives: already plain ints (the common, fast path)
        return v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return tuple(int(x) for x in v)


def _with_gaps(z: np.ndarray) -> list:
    """A heatmap's cells as nested lists with None where ``z`` is NaN (a gap). A 2-D array goes to the browser
    as JSON, which has no NaN: the kernel would warn ("Out of range float values are not JSON compliant")
    into the notebook under the view."""
    return np.where(np.isnan(z), None, z).tolist()


class MeshPanel:
    """The mesh methods of ShardingPlanView (see the module docstring)."""

    def _mesh_dims(self) -> list[tuple[str, int, np.ndarray]]:
        """(name, size, coordinate of every rank) per mesh dim, ep included: ep is not a dim of the device
        mesh but a split of dp_shard (a rank's ep index is ``s % ep``, its dp_shard_mod_ep ``s // ep``)."""
        ep = int(getattr(getattr(self.plan, "parallel", None), "ep", 1) or 1)
        out = []
        for d, (name, size) in enumerate(zip(self.plan.mesh_dim_names, self.plan.mesh_shape)):
            col = self._coords[:, d].astype(np.int64)
            if name == "dp_shard" and ep > 1 and size % ep == 0:
                out += [("dp_shard_mod_ep", size // ep, col // ep), ("ep", ep, col % ep)]
            else:
                out.append((name, int(size), col))
        return out

    def _rank_coords(self, rank: int) -> str:
        """Every mesh coordinate of ``rank``, ep included (0 without expert parallelism)."""
        parts = []
        for d, name in enumerate(self.plan.mesh_dim_names):
            s = int(self._coords[rank][d])
            parts.append(f"{name}={s}")
            if name == "dp_shard":
                parts.append(f"ep={s % self._ep}")
        return ", ".join(parts)

    def _layout_mesh(self) -> None:
        """Place every rank in the picture: facets (pp first), x (one or more dims, flattened) and y, then
        aggregate to at most MESH_X_MAX x MESH_Y_MAX cells per facet."""
        dims = self._mesh_dims()
        shown = [d for d in dims if d[1] > 1]
        self._shown_dims = shown
        # pp is always a facet: a stage is a different set of layers, not a coordinate of one block grid.
        stages = [d for d in shown if d[0] == "pp"]
        rest = [d for d in shown if d[0] != "pp"]
        x, y = (rest[-2:-1], rest[-1:]) if len(rest) >= 2 else (rest, [])  # one dim: a row
        facets = stages + rest[:-2]
        while math.prod(f[1] for f in facets) > MESH_FACETS_MAX and any(f[0] != "pp" for f in facets):
            x.insert(0, facets.pop())  # fold the innermost facet dim into x
        self._facet_dims, self._x_dims, self._y_dims = facets, x, y

        def flat(group):
            idx = np.zeros(self.world_size, dtype=np.int64)
            for _, size, col in group:
                idx = idx * size + col
            return idx, math.prod(g[1] for g in group)

        fi, nf = flat(facets)
        xi, nx = flat(x)
        yi, ny = flat(y)
        self._bx, self._by = math.ceil(nx / MESH_X_MAX), math.ceil(ny / MESH_Y_MAX)
        nxb, nyb = math.ceil(nx / self._bx), math.ceil(ny / self._by)
        self._rank_cell = np.stack([fi, xi // self._bx, yi // self._by], axis=1)
        flat_cell = (fi * nyb + yi // self._by) * nxb + xi // self._bx
        self._cell_of = flat_cell
        first = np.full(nf * nyb * nxb, self.world_size, dtype=np.int64)
        np.minimum.at(first, flat_cell, np.arange(self.world_size))
        self._cell_count = np.bincount(flat_cell, minlength=nf * nyb * nxb)
        self._grid = first.reshape(nf, nyb, nxb)  # the first rank of each cell: what a click selects
        sizes = [f[1] for f in facets]
        self._facet_titles = [" · ".join(f"{n}={v}" for (n, _, _), v in zip(facets, np.unravel_index(k, sizes)))
                              for k in range(nf)] if facets else [""]

    def _cell(self, rank: int) -> tuple[int, int, int]:
        """(facet index, x, y) of ``rank``'s cell in the mesh picture."""
        f, x, y = self._rank_cell[rank]
        return int(f), int(x), int(y)

    @staticmethod
    def _axis_title(group: list, per_cell: int) -> str:
        name = " · ".join(n for n, _, _ in group)
        return name + (f" ({per_cell} per cell)" if per_cell > 1 else "")

    def _mesh_figure(self) -> PlotView:
        self._ep = int(getattr(getattr(self.plan, "parallel", None), "ep", 1) or 1)
        self._layout_mesh()
        rows, nyb, nxb = self._grid.shape
        has_facets = bool(self._facet_dims)
        fig = make_subplots(rows=rows, cols=1, subplot_titles=self._facet_titles if has_facets else None,
                            vertical_spacing=min(0.3 / max(rows - 1, 1), 0.12))

        def ticks(n_cells, per_cell):
            step = max(1, math.ceil(n_cells / 8))
            vals = list(range(0, n_cells, step))
            return {"tickmode": "array", "tickvals": vals, "ticktext": [f"{v * per_cell:,}" for v in vals]}

        for f in range(rows):
            fig.add_trace(go.Heatmap(
                z=_with_gaps(np.full((nyb, nxb), np.nan)), x=list(range(nxb)), y=list(range(nyb)), customdata=self._grid[f],
                colorscale=BLOCK_COLORSCALE, zmin=0, zmax=1, showscale=f == 0, xgap=1 if nxb <= 64 else 0,
                ygap=1 if nyb <= 32 else 0, hoverinfo="text", meta={"facet": f, "role": "mesh"},
                colorbar={"title": {"text": "block", "side": "right"}, "thickness": 10, "len": 0.8,
                          "tickformat": ",d"}), row=f + 1, col=1)
            fig.update_yaxes(range=[nyb - 0.5, -0.5], row=f + 1, col=1, showgrid=False, zeroline=False,
                             title_text=self._axis_title(self._y_dims, self._by) if self._y_dims else "",
                             showticklabels=bool(self._y_dims), **ticks(nyb, self._by))
            fig.update_xaxes(range=[-0.5, nxb - 0.5], row=f + 1, col=1, showgrid=False, zeroline=False,
                             **ticks(nxb, self._bx),
                             title_text=self._axis_title(self._x_dims, self._bx) if (self._x_dims and f == rows - 1)
                             else "")
        # Cells whose ranks hold none of the tensor: dotted grey, with their own legend entry.
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", fill="toself", fillcolor=ABSENT_COLOR,
                                 fillpattern={"shape": ABSENT_PATTERN, "bgcolor": ABSENT_COLOR, "fgcolor": "#666666",
                                              "size": 6},
                                 line={"color": "#999999", "width": 0.5}, hoverinfo="skip", name="holds none of it",
                                 showlegend=True, meta={"role": "absent"}), row=1, col=1)
        cell = max(8, min(40, 480 // max(nxb, 1)))
        band = max(nyb * cell, 40) + (34 if has_facets else 0)
        fig.update_layout(height=min(1400, 135 + rows * band), width=max(420, min(680, 170 + nxb * cell)),
                          margin={"l": 70, "r": 10, "t": 85 if has_facets else 70, "b": 45},
                          plot_bgcolor="white", legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0,
                                                        "yanchor": "bottom", "font": {"size": 10}},
                          title={"text": self._mesh_title(), "font": {"size": 12}, "x": 0.01, "xanchor": "left"})
        fig.update_annotations(font_size=11)
        return PlotView(fig)

    def _mesh_title(self) -> str:
        dims = " x ".join(f"{n} {s}" for n, s, _ in self._shown_dims) or "1 rank"
        agg = f"; each cell {self._bx * self._by:,} ranks (hover: which)" if self._bx * self._by > 1 else ""
        return (f"Mesh: {dims} = {self.world_size:,} ranks<br><span style='font-size:10px'>colour: the block each "
                f"rank holds (scale at right){agg}</span>")

    def _color_mesh(self, t: Any, per_rank: pd.DataFrame, uniq: pd.DataFrame) -> None:
        block_of: dict[tuple, int] = {}
        for b, off, ln, state in uniq[["block", "offsets", "lengths", "state"]].itertuples(index=False):
            block_of[(off, ln, state)] = b
        n = self.world_size
        z = np.full(n, np.nan)  # "holds none of it" unless set below
        state_of = np.empty(n, dtype=object)
        where_of = np.empty(n, dtype=object)
        for rank, off, ln, state in per_rank[["rank", "offsets", "lengths", "state"]].itertuples(index=False):
            rank = int(rank)
            state_of[rank] = state
            if state == "absent":
                continue
            off, ln = _ints(off), _ints(ln)
            b = block_of.get((off, ln, state))
            if b is not None:
                z[rank] = b
            where_of[rank] = ", ".join(f"{o}:{o + m}" for o, m in zip(off or (), ln or ()))
        names = list(self.plan.mesh_dim_names)
        stage = getattr(t, "stage", None)
        pp_col = names.index("pp") if "pp" in names else None
        staged = stage is not None and pp_col is not None and self.plan.mesh_shape[pp_col] > 1
        off_stage = (self._coords[:, pp_col] != stage) if staged else np.zeros(n, dtype=bool)

        def absent_text(r: int) -> str:
            return f"not on this stage (it lives on stage {stage})" if off_stage[r] else "holds none of it"
        # Per cell: the first rank's block colours it; the hover gives the range its ranks hold.
        cells = len(self._cell_count)
        held = np.isfinite(z)
        zz = np.where(held, z, 0)
        lo = np.full(cells, np.inf)
        hi = np.full(cells, -np.inf)
        np.minimum.at(lo, self._cell_of[held], zz[held])
        np.maximum.at(hi, self._cell_of[held], zz[held])
        n_held = np.bincount(self._cell_of[held], minlength=cells)
        first = self._grid.ravel()
        cell_z = np.where(n_held > 0, z[first], np.nan)
        cell_z = np.where(np.isnan(cell_z) & (n_held > 0), lo, cell_z)
        single = self._bx * self._by == 1
        text = np.empty(cells, dtype=object)
        for c in range(cells):
            r = int(first[c])
            if r >= n:
                text[c] = ""
                continue
            if single:
                head = f"rank {r} · {self._rank_coords(r)}"
                if state_of[r] == "absent" or state_of[r] is None:
                    text[c] = f"{head}<br>{absent_text(r)}"
                else:
                    b = "?" if np.isnan(z[r]) else int(z[r])
                    text[c] = f"{head}<br>block {b} [{where_of[r]}] · {state_of[r]}"
            else:
                head = f"{self._cell_count[c]:,} ranks from rank {r} ({self._rank_coords(r)})"
                if n_held[c] == 0:
                    text[c] = f"{head}<br>{absent_text(r)}"
                else:
                    blocks = f"block {int(lo[c])}" if lo[c] == hi[c] else f"blocks {int(lo[c])}-{int(hi[c])}"
                    none = f"; {self._cell_count[c] - n_held[c]:,} hold none" if n_held[c] < self._cell_count[c] else ""
                    text[c] = f"{head}<br>{blocks}{none}"
        nf, nyb, nxb = self._grid.shape
        cell_z = cell_z.reshape(nf, nyb, nxb)
        text = text.reshape(nf, nyb, nxb)
        empty = (n_held == 0).reshape(nf, nyb, nxb)
        # Cells that hold nothing: dotted grey. A facet of another pipeline stage is "not on this stage" (one
        # rectangle); on the tensor's own stage, a cell whose ranks got empty shards "holds none of it".
        rects_by_name: dict[str, list[tuple[int, float, float, float, float]]] = {}
        facet_empty = []
        for f in range(nf):
            facet_off = bool(off_stage[self._grid[f, 0, 0]])  # a facet is within one stage (pp is a facet)
            facet_empty.append(facet_off)
            if empty[f].all():
                rects = [(-0.5, nxb - 0.5, -0.5, nyb - 0.5)]
            else:
                yy, xx = np.nonzero(empty[f])
                rects = [(x - 0.5, x + 0.5, y - 0.5, y + 0.5) for y, x in zip(yy.tolist(), xx.tolist())]
            name = "not on this stage" if facet_off else "holds none of it"
            rects_by_name.setdefault(name, []).extend((f, *r) for r in rects)
        absent_traces = []
        for name, rects in rects_by_name.items():
            for f in range(nf):
                rx: list[float | None] = []
                ry: list[float | None] = []
                for ff, a, b, c, d in rects:
                    if ff == f:
                        rx += [a, b, b, a, a, None]
                        ry += [c, c, d, d, c, None]
                if rx:
                    absent_traces.append((f, name, rx, ry))
        cmax = max(self._n_blocks - 1, 1)
        with self.mesh_fig.batch_update():
            meshes = [tr for tr in self.mesh_fig.data if (tr.meta or {}).get("role") == "mesh"]
            for f, trace in enumerate(meshes):
                trace.z = _with_gaps(cell_z[f])
                trace.text = text[f]
                trace.zmax = cmax
            self.mesh_fig.data = tuple(meshes)
            named: set[str] = set()
            for f, name, rx, ry in absent_traces:
                axis = "" if f == 0 else str(f + 1)
                self.mesh_fig.add_trace(go.Scatter(
                    x=rx, y=ry, xaxis=f"x{axis}", yaxis=f"y{axis}", mode="lines", fill="toself",
                    fillcolor=ABSENT_COLOR, fillpattern={"shape": ABSENT_PATTERN, "bgcolor": ABSENT_COLOR,
                                                         "fgcolor": "#666666", "size": 6},
                    line={"color": "#999999", "width": 0.5}, hoverinfo="skip", name=name, legendgroup=name,
                    showlegend=name not in named, meta={"role": "absent", "facet": f}))
                named.add(name)
            if self._facet_dims:
                for f, ann in enumerate(self.mesh_fig.layout.annotations[:nf]):
                    ann.text = self._facet_titles[f] + (" · not on this stage" if facet_empty[f] else "")
        self._facet_empty = facet_empty

    def _on_mesh_click(self, trace: Any, points: Any, selector: Any) -> None:
        if points.xs:
            f = (trace.meta or {}).get("facet", 0)
            rank = int(self._grid[f, int(points.ys[0]), int(points.xs[0])])
            if rank < self.world_size:
                self.select_rank(rank)
