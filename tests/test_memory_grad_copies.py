"""Issue 28, finding 7: gradient copies are gradients, and a peak's table shows every category it holds.

Notebook 05's llama-70b table showed five hand-picked categories adding to 5.55 GiB of a 14.95 GiB peak:
the missing 9.39 GiB were ``temporary``, FSDP2's fp32 copies of the tensor-parallel shards' gradients
(``aten::_to_copy`` in backward), kept while it accumulates gradients over micro batches under bf16 mixed
precision. Here the same layout in small (tiny: fsdp 2 x tp 2, bf16, 2 micro batches per step, predicted
on fake tensors): every such copy, an allocation whose size is the fp32 size of a parameter's
tensor-parallel shard (from the sharding plan), must be a ``gradient``; before the fix they all were
``temporary``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.memory.timeline import CATEGORIES, MemoryTimeline, TimelineBuilder
from workbench.plan.types import local_extents

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def predicted() -> MemoryTimeline:
    from workbench.memory import predict

    return predict("tiny", nproc=4, dp_shard=2, tp=2, mixed_precision="bf16",
                   train=dict(global_batch=4, micro_batch=1, seq_len=24, steps=2), progress=False)


def _fp32_tp_shard_bytes() -> set[int]:
    """fp32 bytes of each parameter's tensor-parallel shard (tp=2, rank 0): what FSDP2 gathers, whole."""
    plan = workbench.plan("tiny", tp=2)
    out = set()
    for t in plan.tensors:
        if t.kind == "parameter":
            lengths, _ = local_extents(t.global_shape, t.splits, np.zeros((1, 4), dtype=np.int64))
            out.add(int(np.prod(lengths[0])) * 4)
    return out


def test_fp32_copies_of_gradients_in_backward_are_gradients(predicted):
    f = predicted.frame
    copies = f[(f["op"] == "aten::_to_copy") & (f["phase"] == "backward") & (f["delta_bytes"] > 0)]
    shard_bytes = _fp32_tp_shard_bytes()
    grad_copies = copies[copies["delta_bytes"].isin(shard_bytes)]
    # one copy per parameter shape at least (every block's weights, the norms), all of them gradients
    assert set(grad_copies["delta_bytes"]) == shard_bytes, sorted(set(copies["delta_bytes"]))
    assert set(grad_copies["category"].astype(str)) == {"gradient"}, \
        grad_copies.groupby("category", observed=True).size().to_dict()
    # the gradients themselves (autograd's output for FSDP2's gathered parameters) are gradients too, and
    # nothing else is: every copy labelled a gradient is one of them, cast (x2, bf16 -> fp32) or cloned
    made = f[(f["category"] == "gradient") & (f["phase"] == "backward") & (f["delta_bytes"] > 0)]
    sources = set(made[~made["op"].isin(["aten::_to_copy", "aten::clone"])]["delta_bytes"])
    assert sources
    labelled = made[made["op"].isin(["aten::_to_copy", "aten::clone"])]["delta_bytes"]
    assert all(b in sources or b // 2 in sources for b in labelled), sorted(set(labelled) - sources)
    # the other copies in backward are casts of activations' gradients: still temporaries
    rest = copies[copies["category"] != "gradient"]
    assert len(rest) and set(rest["category"].astype(str)) == {"temporary"}
    assert not set(rest["delta_bytes"]) & shard_bytes
    assert predicted.peak(0).by_category.get("gradient", 0) > 0


def test_peak_breakdown_drops_no_category_and_adds_up(predicted):
    table = predicted.peak_breakdown()
    peak = predicted.peak(0)
    assert table.loc[0, "peak"] == peak.bytes
    assert list(table.columns) == [c for c in CATEGORIES if peak.by_category.get(c)] + ["peak"]
    assert (table.drop(columns="peak").sum(axis=1) == table["peak"]).all()

    # a base the timeline cannot split by category (an imported one may have one) shows as its own column
    b = TimelineBuilder(rank=0, base_bytes=150)
    b.add(1.0, 40, "activation", "forward", 0, 0, "", "aten::mm", 1)
    b.add(2.0, 10, "temporary", "backward", 0, 0, "", "aten::mm", 2)
    tl = b.timeline(meta={"base_by_category": {"0": {"parameter": 100}}})
    t2 = tl.peak_breakdown()
    assert t2.loc[0].to_dict() == {"parameter": 100, "activation": 40, "temporary": 10, "unattributed": 50,
                                   "peak": 200}


def test_notebook_05_shows_the_whole_peak():
    """The llama-70b cell displays the breakdown (all non-zero categories, summing to the peak), not a
    hand-picked list of columns that left out the largest one."""
    nb = json.loads((ROOT / "notebooks/05_memory.ipynb").read_text())
    (cell,) = [c for c in nb["cells"] if c["cell_type"] == "code" and "llama-70b" in "".join(c["source"])]
    src = "".join(cell["source"])
    assert ".peak_breakdown()" in src and ".peaks()[[" not in src
