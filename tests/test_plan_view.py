"""ShardingPlanView without a browser: real plans from ``workbench.plan``, read back from the figures.

Every plan here is simulated by the core (fake process group, meta tensors); the view must draw exactly
what ``plan.blocks`` / ``plan.local`` / ``plan.rank_bytes`` say, and stay quick on 1024 ranks.
"""

from __future__ import annotations

import dataclasses
import html
import re
import time

import numpy as np
import pytest

import workbench
from workbench.config import ParallelConfig
from workbench.plan import ShardingPlan
from workbench.widgets import ShardingPlanView
from workbench.units import format_bytes
from workbench.widgets.plan_view import ABSENT_COLOR, COLOR_LEVELS, LABEL_BLOCKS_MAX


@pytest.fixture(scope="module")
def plans() -> dict[str, ShardingPlan]:
    return {
        "1d": workbench.plan("tiny", ParallelConfig(dp_shard=4)),
        "2d": workbench.plan("tiny", ParallelConfig(dp_shard=2, tp=2)),
        "3d": workbench.plan("tiny", ParallelConfig(pp=2, dp_shard=2, tp=2)),
        "tp": workbench.plan("tiny", ParallelConfig(tp=2)),
    }


@pytest.fixture(scope="module")
def big_plan() -> ShardingPlan:
    return workbench.plan("llama-70b", ParallelConfig(dp_shard=128, tp=8))


def _rectangles(view: ShardingPlanView) -> list[tuple[float, float, float, float, str]]:
    """Every block drawn in the tensor figure: (x0, x1, y0, y1, state), read from the traces' polygons."""
    rects = []
    for trace in view.tensor_fig.data:
        if (trace.meta or {}).get("role") != "blocks":
            continue
        xs = np.asarray(trace.x, dtype=float).reshape(-1, 6)  # 5 corners + the NaN gap
        ys = np.asarray(trace.y, dtype=float).reshape(-1, 6)
        assert np.isnan(xs[:, 5]).all()
        for x, y in zip(xs, ys):
            rects.append((x[:5].min(), x[:5].max(), y[:5].min(), y[:5].max(), trace.meta["state"]))
    return sorted(rects)


def _expected_rectangles(plan: ShardingPlan, name: str, kind: str, xdim: int, ydim: int | None):
    """The distinct (offsets, lengths, state) of plan.blocks, as rectangles over the drawn dims."""
    frame = plan.blocks(name, kind=kind)
    frame = frame[frame["state"] != "absent"]
    out = set()
    for off, ln, state in zip(frame["offsets"], frame["lengths"], frame["state"]):
        y = (off[ydim], off[ydim] + ln[ydim]) if ydim is not None else (0, 1)
        out.add((off[xdim], off[xdim] + ln[xdim], *y, state))
    return sorted(out)


def _mesh_z(view: ShardingPlanView) -> np.ndarray:
    return np.stack([np.asarray(t.z, dtype=float) for t in view.mesh_fig.data if (t.meta or {}).get("role") == "mesh"])


def test_1d_mesh_draws_one_row_and_every_block(plans):
    plan = plans["1d"]
    view = ShardingPlanView(plan)
    assert _mesh_z(view).shape == (1, 1, 4)  # dp_shard 4: one row of 4
    assert view.tensor.name == "tok_embeddings.weight" and view.tensor.kind == "parameter"
    # (256, 128) embedding, S(0) over dp_shard: four 64-row blocks, one per rank, rows drawn down.
    assert _rectangles(view) == _expected_rectangles(plan, "tok_embeddings.weight", "parameter", 1, 0)
    assert [r[2:4] for r in _rectangles(view)] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert list(view.blocks["replicas"]) == [1, 1, 1, 1]
    # Each mesh cell is coloured by the block its rank holds.
    assert _mesh_z(view)[0, 0].tolist() == [0, 1, 2, 3]
    # Evaluating the view in a notebook shows the widget.
    bundle = view._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == view.widget.model_id
    # A 1-D tensor is a bar along its only dim.
    view.select_tensor("norm.weight")
    assert _rectangles(view) == [(0, 32, 0, 1, "sharded"), (32, 64, 0, 1, "sharded"), (64, 96, 0, 1, "sharded"),
                                 (96, 128, 0, 1, "sharded")]


def test_2d_mesh_blocks_rank_selection_and_bytes(plans):
    plan = plans["2d"]
    view = ShardingPlanView(plan, tensor="layers.1.attention.wo.weight", kind="gradient")
    assert _mesh_z(view).shape == (1, 2, 2)  # x = dp_shard, y = tp
    # wo is row-parallel: tp shards dim 1, FSDP shards dim 0: four distinct quarter blocks.
    rects = _rectangles(view)
    assert rects == _expected_rectangles(plan, "layers.1.attention.wo.weight", "gradient", 1, 0)
    assert len(rects) == 4 and {(r[1] - r[0], r[3] - r[2]) for r in rects} == {(64, 64)}

    # Selecting a rank through its control: the rank panel and the highlight follow plan.local.
    view.controls["rank"].value = 3
    assert view.rank == 3
    shape, offsets = plan.local("layers.1.attention.wo.weight", 3, kind="gradient")
    assert f"local shape {shape}, offsets {offsets}" in view.rank_info.value
    (hi,) = view.tensor_fig.layout.shapes
    assert (hi.x0, hi.x1, hi.y0, hi.y1) == (offsets[1], offsets[1] + shape[1], offsets[0], offsets[0] + shape[0])
    (cell,) = view.mesh_fig.layout.shapes  # rank 3 = (dp_shard 1, tp 1)
    assert (cell.x0 + cell.x1) / 2 == 1 and (cell.y0 + cell.y1) / 2 == 1
    # Byte totals of the selected rank, and one stacked bar per rank and category.
    rb = plan.rank_bytes()
    for cat in ("parameter", "gradient", "optimizer", "total"):
        assert f"<td>{cat}</td><td style='text-align:right'>{format_bytes(rb.loc[3, cat])}</td>" in view.rank_info.value
    bars = {t.name: np.asarray(t.y) for t in view.bytes_fig.data}
    assert set(bars) == {"parameter", "gradient", "optimizer", "master"}
    for cat, y in bars.items():
        assert np.allclose(y * 2**20, rb[cat].to_numpy())
    # A 4 MiB model's bytes are drawn in MiB, not as slivers of a GiB.
    assert view.bytes_unit == ("MiB", 2**20) and view.bytes_fig.layout.yaxis.title.text == "MiB"
    (bar_hi,) = view.bytes_fig.layout.shapes
    assert bar_hi.x0 == 2.5 and bar_hi.x1 == 3.5
    with pytest.raises(ValueError, match="rank=4 is outside the plan's 4 ranks; choose 0..3"):
        view.select_rank(4)


def test_replicated_and_partial_are_drawn_distinctly(plans):
    plan = plans["tp"]  # tp=2 alone: norms are replicated on both ranks
    view = ShardingPlanView(plan, tensor="norm.weight")
    (block,) = [t for t in view.tensor_fig.data if (t.meta or {}).get("role") == "blocks"]
    assert block.meta["state"] == "replicated" and block.fillpattern.shape == "/"
    legend = [t for t in view.tensor_fig.data if (t.meta or {}).get("role") == "legend"]
    assert [t.name for t in legend] == ["replicated: a full copy"]
    assert [a.text for a in view.tensor_fig.layout.annotations] == ["×2"]  # one block, two replicas
    assert view.blocks["ranks"].tolist() == [(0, 1)]

    view.select_tensor("layers.0.attention.wq.weight")  # colwise: a slice per rank, drawn solid
    blocks = [t for t in view.tensor_fig.data if (t.meta or {}).get("role") == "blocks"]
    assert {t.meta["state"] for t in blocks} == {"sharded"} and all(not t.fillpattern.shape for t in blocks)
    assert sorted(a.text for a in view.tensor_fig.layout.annotations) == ["r0", "r1"]

    # No layout of ours leaves a partial tensor after backward, so mark one gradient P(sum) by hand
    # (as a pre-reduction gradient would be) and check that the view draws the summands distinctly.
    g = plan.tensor("layers.0.attention.wo.weight", "gradient")
    partial = dataclasses.replace(g, placements=("R", "R", "R", "P(sum)"), splits=())
    tensors = [partial if t is g else t for t in plan.tensors]
    pplan = ShardingPlan(plan.model_name, plan.parallel, plan.train, tensors, model=plan.model)
    view = ShardingPlanView(pplan, tensor=g.name, kind="gradient")
    (block,) = [t for t in view.tensor_fig.data if (t.meta or {}).get("role") == "blocks"]
    assert block.meta["state"] == "partial" and block.fillpattern.shape == "x" and block.line.dash == "dot"
    assert [t.name for t in view.tensor_fig.data if (t.meta or {}).get("role") == "legend"] == [
        "partial: a summand of the whole"]


def test_3d_mesh_facets_over_pp_and_absent_ranks(plans):
    plan = plans["3d"]
    view = ShardingPlanView(plan, tensor="tok_embeddings.weight")
    z = _mesh_z(view)
    assert z.shape == (2, 2, 2)  # two facets (pp=0, pp=1), each dp_shard x tp
    # The embedding lives on stage 0: stage 1's facet is dotted grey and says so, unlike a replica.
    assert [a.text for a in view.mesh_fig.layout.annotations] == ["pp=0", "pp=1 · not on this stage"]
    assert np.isnan(z[1]).all() and np.isfinite(z[0]).all()
    absent = [t for t in view.mesh_fig.data if (t.meta or {}).get("role") == "absent"]
    assert [t.name for t in absent if t.showlegend] == ["not on this stage"]
    assert all(t.fillcolor == ABSENT_COLOR for t in absent)
    assert len(_rectangles(view)) == 4
    view.select_rank(7)  # a stage-1 rank
    assert "holds none of <b>tok_embeddings.weight</b> (it lives on stage 0)" in view.rank_info.value
    assert view.tensor_fig.layout.shapes == ()
    view.select_tensor("output.weight")
    z = _mesh_z(view)
    assert np.isnan(z[0]).all() and np.isfinite(z[1]).all()
    assert [a.text for a in view.mesh_fig.layout.annotations] == ["pp=0 · not on this stage", "pp=1"]
    (cell,) = view.mesh_fig.layout.shapes
    assert cell.xref == "x2" and cell.yref == "y2"  # rank 7's cell is in the second facet


def test_filter_kind_regex_and_list_cap(plans):
    plan = plans["2d"]
    view = ShardingPlanView(plan, max_list=10)
    names = [(t.name, t.kind) for t in plan.tensors]
    assert len(view.matches) == len(names) and len(view.controls["tensor"].options) == 10
    assert f"of {len(names):,} tensors match (showing the first 10)" in view.count_label.value

    view.controls["filter"].value = "Attention.WQ"  # case-insensitive substring
    expected = [n for n in names if "attention.wq" in n[0]]
    assert [(t.name, t.kind) for t in view.matches] == expected
    assert f"<b>{len(expected)}</b> of {len(names):,}" in view.count_label.value
    assert view.tensor.name.startswith("layers.0.attention.wq")  # the selection followed the filter

    view.controls["kind"].value = "optimizer"
    assert {t.kind for t in view.matches} == {"optimizer"}
    assert len(view.matches) == sum(1 for n, k in names if "attention.wq" in n and k == "optimizer")

    view.controls["kind"].value = "all"
    view.controls["regex"].value = True
    view.controls["filter"].value = r"^layers\.[01]\..*norm\.weight$"
    expected = [n for n in names if re.search(r"^layers\.[01]\..*norm\.weight$", n[0])]
    assert [(t.name, t.kind) for t in view.matches] == expected and len(expected) == 8  # 2 norms x 2 layers x 2 kinds

    # Picking an entry in the list shows that tensor.
    label, index = view.controls["tensor"].options[-1]
    view.controls["tensor"].value = index
    assert (view.tensor.name, view.tensor.kind) == expected[-1]
    assert view.tensor.name in view.tensor_fig.layout.title.text

    view.controls["filter"].value = "layers.(["
    assert "invalid regex" in view.count_label.value and view.matches == []
    assert view.tensor.name == expected[-1][0]  # the last good selection stays on screen
    with pytest.raises(ValueError, match="no parameter tensor named 'nope'"):
        view.select_tensor("nope")


def test_llama_70b_on_1024_ranks_stays_quick(big_plan):
    plan = big_plan
    assert plan.world_size == 1024
    t0 = time.perf_counter()
    view = ShardingPlanView(plan)
    construct = time.perf_counter() - t0
    assert _mesh_z(view).shape == (1, 8, 64)  # dp_shard 128 across (2 ranks a cell), tp 8 down
    assert all(len(t.x) == 1024 for t in view.bytes_fig.data)
    # 1024 ranks x 4 categories are not 4096 bars: one stacked area per category, same values.
    assert {t.type for t in view.bytes_fig.data} == {"scatter"}
    assert {t.stackgroup for t in view.bytes_fig.data} == {"bytes"}
    rb = plan.rank_bytes()
    for t in view.bytes_fig.data:
        assert np.allclose(np.asarray(t.y) * view.bytes_unit[1], rb[t.name].to_numpy())
    assert view.bytes_unit[0] == ("GiB" if rb["total"].max() >= 2**30 else "MiB")

    t0 = time.perf_counter()
    view.select_tensor("layers.40.feed_forward.w2.weight", "gradient")
    switch = time.perf_counter() - t0
    # 1024 distinct blocks are drawn once each, in a handful of traces (not one shape per rank).
    rects = _rectangles(view)
    assert len(rects) == 1024 and len(view.tensor_fig.data) <= COLOR_LEVELS + 3
    assert rects == _expected_rectangles(plan, "layers.40.feed_forward.w2.weight", "gradient", 1, 0)
    assert len(view.tensor_fig.layout.annotations) <= LABEL_BLOCKS_MAX  # a few evenly spaced labels

    view.select_tensor("layers.40.ffn_norm.weight")  # S(0) over dp_shard, replicated over tp
    assert len(view.blocks) == 128 and set(view.blocks["replicas"]) == {8}
    assert len(view.blocks) > LABEL_BLOCKS_MAX

    t0 = time.perf_counter()
    view.controls["filter"].value = "layers.7"
    filtering = time.perf_counter() - t0
    expected = sum(1 for t in plan.tensors if "layers.7" in t.name)
    assert len(view.matches) == expected and f"<b>{expected}</b>" in view.count_label.value
    assert len(view.controls["tensor"].options) == min(expected, 200)

    t0 = time.perf_counter()
    view.select_rank(1000)
    rank = time.perf_counter() - t0
    shape, _ = plan.local(view.tensor.name, 1000, kind=view.tensor.kind)
    assert f"local shape {shape}" in view.rank_info.value
    print(f"\nllama-70b dp_shard=128 x tp=8: construct {construct:.3f}s, switch tensor {switch:.3f}s, "
          f"filter {filtering:.3f}s, select rank {rank:.4f}s")
    # Generous bounds (2 shared CI cores); typical figures are in the report.
    assert construct < 10 and switch < 3 and filtering < 3 and rank < 3



# --------------------------------------------------------------------------------------------------
# predicted memory: the "Predict memory" button
# --------------------------------------------------------------------------------------------------


def test_predict_button_draws_every_ranks_peak_and_each_distinct_ranks_categories():
    from workbench.models.llama import Transformer
    from workbench.config import PRESETS

    plan = workbench.plan("tiny", ParallelConfig(pp=2, dp_shard=2))  # 4 ranks, 2 distinct (one per stage)
    view = ShardingPlanView(plan)
    assert view.predicted is None and view.memory_box.children == ()
    assert "Predict memory" in view.memory_note.value
    assert view.controls["device"].value == "cuda"  # plans are for GPU jobs

    # A typo in the budget is one line under the button, and so is a plan that cannot be predicted.
    view.controls["budget"].value = "80 gigs"
    view._on_predict(view.predict_button)
    assert "ValueError: memory budget '80 gigs'" in html.unescape(view.memory_note.value)
    assert view.predicted is None and not view.predict_button.disabled
    factory_view = ShardingPlanView(workbench.plan(lambda: Transformer(PRESETS["tiny"]), ParallelConfig(tp=2)))
    factory_view.predict(device="cpu")
    note = html.unescape(factory_view.memory_note.value)
    assert "ValueError: plan of '<lambda>' was made from a model factory" in note and "\n" not in note

    view.controls["budget"].value = ""
    view.controls["device"].value = "cpu"
    view._on_predict(view.predict_button)  # what a click does
    peaks = plan.predicted_peaks("cpu")
    assert list(peaks.index) == [0, 1, 2, 3]
    (line,) = [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "predicted"]
    assert list(line.x) == [0, 1, 2, 3] and np.allclose(np.asarray(line.y) * 2**20, peaks.to_numpy())
    assert view.predicted.equals(peaks)
    # The plan's own per-rank bytes stay, and a prediction includes more than they count (activations).
    bars = {t.name: np.asarray(t.y) * 2**20 for t in view.bytes_fig.data if t.type == "bar"}
    assert set(bars) == {"parameter", "gradient", "optimizer", "master"}
    assert (peaks.to_numpy() > sum(bars.values())).all()
    assert not [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "budget"]  # no budget given

    # One stacked bar per distinct rank (one per pipeline stage), its categories summing to its peak.
    timeline = plan.predict_memory("cpu")
    table = timeline.peaks().set_index("rank")
    assert view.memory_box.children == (view.memory_fig,)
    assert view.memory_fig.layout.yaxis.title.text == "MiB"
    stacked = {t.name: np.asarray(t.y) * 2**20 for t in view.memory_fig.data}
    assert "activation" in stacked and all(len(y) == len(table) == 2 for y in stacked.values())
    assert np.allclose(sum(stacked.values()), table["peak_bytes"].to_numpy())
    assert list(view.memory_fig.data[0].x) == [f"rank {r} (×2)" for r in table.index]
    assert view.memory_fig.layout.shapes == ()
    note = html.unescape(view.memory_note.value)
    assert "predicted peak (cpu, activations included)" in note and format_bytes(peaks.max()) in note
    view.select_rank(3)
    assert f"<td>predicted peak (cpu)</td><td style='text-align:right'>{format_bytes(peaks[3])}</td>" \
        in view.rank_info.value


def test_predict_with_a_budget_draws_the_line_and_the_largest_micro_batch_that_fits():
    plan = workbench.plan("tiny", ParallelConfig(dp_shard=2))
    view = ShardingPlanView(plan)
    peak = int(plan.predicted_peaks("cpu").max())
    budget = peak - 1  # one byte short: the job as planned does not fit, a smaller micro batch does
    view.predict(device="cpu", budget=str(budget))
    fit = plan.fits(budget, device="cpu")  # cached: the answer the view got
    assert view.fit is fit and not fit.fits and fit.peak_bytes == peak
    assert fit.micro_batch is not None and fit.micro_batch < 4 and fit.peak_at_micro_batch <= budget
    (line,) = [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "budget"]
    assert list(line.y) == [budget / 2**20] * 2 and list(line.x) == [-0.5, 1.5]
    (shape,) = view.memory_fig.layout.shapes
    assert shape.y0 == shape.y1 == budget / 2**20
    note = html.unescape(view.memory_note.value)
    assert "does not fit</b> in " + format_bytes(budget) in note
    assert f"largest micro batch that fits: <b>{fit.micro_batch}</b> (peak {format_bytes(fit.peak_at_micro_batch)})" \
        in note

    # Clicking again (answers cached by the plan) redraws the lines, it does not add more.
    view.predict()
    assert view.fit is fit
    roles = [(t.meta or {}).get("role") for t in view.bytes_fig.data]
    assert roles.count("predicted") == 1 and roles.count("budget") == 1


def test_a_cuda_prediction_draws_the_reserved_peak_beside_the_allocated_one():
    """What fits() compares on CUDA is the caching allocator's reserve: the view draws it per rank, and a CPU
    prediction (no allocator) draws none."""
    plan = workbench.plan("tiny", ParallelConfig(pp=2, dp_shard=2))  # 4 ranks, 2 distinct
    view = ShardingPlanView(plan)
    view.predict(device="cuda")
    timeline = plan.predict_memory("cuda")
    (line,) = [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "reserved"]
    want = [timeline.reserved_peak(int(timeline.meta["rank_map"][str(r)])) for r in range(4)]
    assert list(line.x) == [0, 1, 2, 3] and np.allclose(np.asarray(line.y) * 2**20, want)
    (alloc,) = [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "predicted"]
    assert (np.asarray(line.y) >= np.asarray(alloc.y)).all()  # the allocator reserves at least what it hands out
    view.predict(device="cpu")
    assert not [t for t in view.bytes_fig.data if (t.meta or {}).get("role") == "reserved"]
