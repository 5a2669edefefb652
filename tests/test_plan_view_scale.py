"""ShardingPlanView from 8 to 16,384 ranks: the figures stay bounded and legible (issue 16, item 1).

Real plans simulated by the core (fake process group, meta tensors), read back from the figures: how
many mesh cells are drawn, how many labels, that block colours come from one continuous scale with a
colour bar, that ep is a mesh dim, that another pipeline stage is "not on this stage" (not a replica),
and that the block table's columns say what they hold.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.colors
import pytest

import workbench
from workbench.config import ParallelConfig
from workbench.widgets import ShardingPlanView
from workbench.widgets.plan_view import (BLOCK_COLORSCALE, COLOR_LEVELS, LABEL_BLOCKS_MAX, MESH_X_MAX, MESH_Y_MAX,
                                         TENSOR_RASTER)


def _mesh(view: ShardingPlanView) -> list:
    return [t for t in view.mesh_fig.data if (t.meta or {}).get("role") == "mesh"]


def _drawn_cells(view: ShardingPlanView) -> int:
    return sum(np.asarray(t.z, dtype=float).size for t in _mesh(view))


def _absent(view: ShardingPlanView) -> list:
    return [t for t in view.mesh_fig.data if (t.meta or {}).get("role") == "absent"]


def _continuous(scale) -> bool:
    """A plotly colourscale that is the named continuous scale (many stops, no repeated steps)."""
    expected = plotly.colors.make_colorscale(getattr(plotly.colors.sequential, BLOCK_COLORSCALE))
    positions = [p for p, _ in scale]
    return (len(scale) == len(expected) >= 8 and np.allclose(positions, [p for p, _ in expected])
            and [c.lower() for _, c in scale] == [c.lower() for _, c in expected]
            and len({c for _, c in scale}) == len(scale))


@pytest.fixture(scope="module")
def plan_8():
    return workbench.plan("tiny", ParallelConfig(pp=2, dp_shard=2, tp=2))


@pytest.fixture(scope="module")
def plan_1024():
    return workbench.plan("llama-70b", ParallelConfig(dp_shard=128, tp=8))


@pytest.fixture(scope="module")
def plan_8192():
    return workbench.plan("llama-70b", ParallelConfig(dp_shard=1024, tp=8))


def test_8_ranks_every_rank_a_cell_and_another_stage_is_not_a_replica(plan_8):
    view = ShardingPlanView(plan_8, tensor="tok_embeddings.weight")
    assert _drawn_cells(view) == 8  # pp 2 facets x dp_shard 2 x tp 2, one rank per cell
    (first, second) = _mesh(view)
    assert first.showscale and _continuous(first.colorscale) and first.colorbar.title.text == "block"
    # The embedding lives on stage 0. Stage 1 is dotted grey, titled and listed as "not on this stage".
    assert [a.text for a in view.mesh_fig.layout.annotations] == ["pp=0", "pp=1 · not on this stage"]
    (absent,) = _absent(view)
    assert absent.name == "not on this stage" and absent.showlegend and absent.fillpattern.shape == "."
    assert absent.xaxis == "x2"  # drawn over the second facet
    assert second.text[0][0].endswith("not on this stage (it lives on stage 0)")  # the hover of a cell
    # pp is not a placement: a stage copies nothing. The info names the stage instead.
    info = html.unescape(view.tensor_info.value)
    assert "pp=R" not in info and "pp=" not in info.split("placements:")[1].split(";")[0]
    assert "on stage 0 of pp=2 only" in info and "4 rank(s) not on this stage" in info
    # Labels: one per block, four blocks.
    assert sorted(a.text for a in view.tensor_fig.layout.annotations) == ["r0", "r1", "r2", "r3"]
    # A replicated tensor over tp is coloured, not grey, on its own stage; the table says replicas and ranks.
    view.select_tensor("layers.0.attention_norm.weight")
    table = view.tensor_info.value
    assert "<th>replicas</th><th>ranks</th>" in table
    blocks = view.blocks
    for reps, ranks in zip(blocks["replicas"], blocks["ranks"]):
        assert reps == len(ranks)
    assert view.tensor_fig.data[-1].marker.colorscale is not None  # the tensor panel's colour bar


def test_ep_is_a_mesh_dim_and_a_rank_coordinate():
    plan = workbench.plan("tiny-moe", ParallelConfig(dp_shard=4, ep=2))
    view = ShardingPlanView(plan)
    assert "dp_shard_mod_ep 2 x ep 2 = 4 ranks" in view.mesh_fig.layout.title.text
    assert view.mesh_fig.layout.yaxis.title.text == "ep"
    assert view.mesh_fig.layout.xaxis.title.text == "dp_shard_mod_ep"
    # A rank's ep index is its dp_shard index mod ep.
    for rank in range(4):
        view.select_rank(rank)
        s = plan.coords(rank)[2]
        assert f"dp_shard={s}, ep={s % 2}," in view.rank_info.value
    (cell,) = view.mesh_fig.layout.shapes  # rank 3: dp_shard 3 = (dp_shard_mod_ep 1, ep 1)
    assert (cell.x0 + cell.x1) / 2 == 1 and (cell.y0 + cell.y1) / 2 == 1
    assert "ep 2" in html.unescape(view.tensor_info.value)
    # Without expert parallelism ep is still named (0 everywhere).
    view = ShardingPlanView(workbench.plan("tiny", ParallelConfig(dp_shard=2)))
    assert "ep=0" in view.rank_info.value


def test_32_blocks_are_labelled_sparsely_in_distinct_colours():
    plan = workbench.plan("llama-70b", ParallelConfig(dp_shard=4, tp=8))
    view = ShardingPlanView(plan, tensor="layers.0.attention.wq.weight")
    assert len(view.blocks) == 32
    labels = view.tensor_fig.layout.annotations
    assert 2 <= len(labels) <= LABEL_BLOCKS_MAX
    ys = sorted(a.y for a in labels)
    gaps = np.diff(ys)
    assert gaps.min() > 0 and gaps.max() <= 2.5 * gaps.min()  # evenly spaced, not piled up
    fills = {t.fillcolor for t in view.tensor_fig.data if (t.meta or {}).get("role") == "blocks"}
    assert len(fills) == min(32, COLOR_LEVELS)  # not ten colours repeating


def test_1024_ranks_bounded_cells_labels_and_continuous_scale(plan_1024):
    view = ShardingPlanView(plan_1024)
    assert _drawn_cells(view) <= MESH_X_MAX * MESH_Y_MAX
    (mesh,) = _mesh(view)
    assert _continuous(mesh.colorscale) and mesh.showscale
    z = np.asarray(mesh.z, dtype=float)
    # A gradient over the blocks, not 10 colours; the few last ranks hold empty shards (32000 rows / 1024).
    assert np.isfinite(z).mean() > 0.9 and len(np.unique(z[np.isfinite(z)])) > 20
    assert "(2 per cell)" in view.mesh_fig.layout.xaxis.title.text
    view.select_tensor("layers.40.feed_forward.w2.weight", "gradient")  # 1024 distinct blocks
    assert len(view.tensor_fig.layout.annotations) <= LABEL_BLOCKS_MAX
    assert sum(1 for t in view.tensor_fig.data if (t.meta or {}).get("role") == "blocks") <= COLOR_LEVELS
    # Clicking a mesh cell selects its first rank.
    view._on_mesh_click(mesh, type("P", (), {"xs": [3], "ys": [5]})(), None)
    assert view.rank == int(view._grid[0, 5, 3]) and plan_1024.coords(view.rank)[2] // 2 == 3


def test_8192_ranks_mesh_is_aggregated_and_tensor_panel_is_drawn(plan_8192):
    plan = plan_8192
    view = ShardingPlanView(plan)
    assert view.tensor.name == "tok_embeddings.weight" and len(view.blocks) == 8000
    # The mesh: 1024 x 8 ranks in at most 64 x 16 cells, 16 dp_shard ranks each, and a real size.
    cells = _drawn_cells(view)
    assert cells == 64 * 8 and cells <= MESH_X_MAX * MESH_Y_MAX
    assert "(16 per cell)" in view.mesh_fig.layout.xaxis.title.text
    assert "each cell 16 ranks" in view.mesh_fig.layout.title.text
    assert view.mesh_fig.layout.height >= 150 and view.mesh_fig.layout.width >= 400
    (mesh,) = _mesh(view)
    z = np.asarray(mesh.z, dtype=float)
    assert np.isfinite(z).sum() > 0.9 * z.size and len(np.unique(z[np.isfinite(z)])) > 100
    assert len(mesh.x) == 64 and len(mesh.y) == 8
    # The x ticks name the dp_shard coordinate at the start of a cell, at most 8 of them.
    assert len(view.mesh_fig.layout.xaxis.ticktext) <= 8 and view.mesh_fig.layout.xaxis.ticktext[1] == "128"
    # The tensor: 8000 blocks as one bounded raster, every cell coloured, with the colour bar.
    (raster,) = view.tensor_fig.data
    assert raster.type == "heatmap" and raster.showscale and _continuous(raster.colorscale)
    rz = np.asarray(raster.z, dtype=float)
    assert rz.size <= TENSOR_RASTER ** 2 and np.isfinite(rz).all()
    # Each raster row is the block covering its middle (~31 blocks a row): from the first blocks to the last.
    assert rz.min() < 32 and rz.max() > 8000 - 32 and (np.diff(rz[:, 0]) > 0).all()
    assert len(view.tensor_fig.layout.annotations) <= LABEL_BLOCKS_MAX
    assert "drawn as" in view.tensor_fig.layout.title.text
    # Selecting a rank highlights its cell and its block.
    view.select_rank(8191)
    (cell,) = view.mesh_fig.layout.shapes
    assert (cell.x0 + cell.x1) / 2 == 63 and (cell.y0 + cell.y1) / 2 == 7
    assert "ep=0" in view.rank_info.value


def test_16384_ranks_with_pp_stays_bounded():
    plan = workbench.plan("llama-70b", ParallelConfig(pp=4, dp_shard=512, tp=8))
    assert plan.world_size == 16384
    view = ShardingPlanView(plan)
    assert len(_mesh(view)) == 4 and _drawn_cells(view) <= 4 * MESH_X_MAX * MESH_Y_MAX
    assert [a.text for a in view.mesh_fig.layout.annotations] == [
        "pp=0", "pp=1 · not on this stage", "pp=2 · not on this stage", "pp=3 · not on this stage"]
    # Other stages are "not on this stage"; on stage 0 the last dp_shard ranks got empty shards (32000 rows
    # over 4096 ranks), which is "holds none of it", a different thing.
    absent = {(t.name, t.meta["facet"]) for t in _absent(view)}
    assert absent == {("not on this stage", 1), ("not on this stage", 2), ("not on this stage", 3),
                      ("holds none of it", 0)}
    info = html.unescape(view.tensor_info.value)
    assert "12,288 rank(s) not on this stage" in info


def test_pp_is_always_a_facet_never_a_grid_axis():
    # pp x dp_shard: two dims only, yet pp stays the facet (a stage is other layers, not other blocks).
    view = ShardingPlanView(workbench.plan("tiny", ParallelConfig(pp=2, dp_shard=4)))
    assert [np.asarray(t.z).shape for t in _mesh(view)] == [(1, 4), (1, 4)]
    assert [a.text for a in view.mesh_fig.layout.annotations] == ["pp=0", "pp=1 · not on this stage"]
    assert [(t.name, t.meta["facet"]) for t in _absent(view)] == [("not on this stage", 1)]
