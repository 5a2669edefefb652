"""What views ask the core, answered by the core: rank coordinates, block groups, root cause, tensor
statistics, byte formatting and the display registry (no widgets, no processes)."""

from __future__ import annotations

import signal

import pytest

import workbench
from test_checkpoint_tools import write_checkpoint  # tests/: checkpoints written per the key contract
from workbench import display
from workbench.checkpoint import read_tensor, tensor_stats
from workbench.config import ParallelConfig
from workbench.train.outcome import RunFailed, root_cause
from workbench.units import format_bytes


def test_rank_coords_follow_the_mesh_order_and_refuse_a_rank_outside():
    p = ParallelConfig(pp=2, dp_replicate=1, dp_shard=3, tp=2)
    assert [p.rank_coords(r) for r in (0, 1, 2, 5, 6, 11)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 2, 1), (1, 0, 0, 0), (1, 0, 2, 1)]
    every = p.all_rank_coords()
    assert every.shape == (12, 4) and [tuple(int(c) for c in row) for row in every] == [p.rank_coords(r) for r in range(12)]
    with pytest.raises(ValueError, match=r"rank=12 is outside the 12 ranks .* choose 0..11"):
        p.rank_coords(12)


def test_block_groups_name_each_distinct_block_once():
    plan = workbench.plan("tiny", ParallelConfig(dp_replicate=2, tp=2))
    groups = plan.block_groups("layers.0.attention.wq.weight")
    # wq is column-parallel: tp halves dim 0, dp_replicate copies each half to 2 ranks
    assert groups["offsets"].tolist() == [(0, 0), (64, 0)] and groups["lengths"].tolist() == [(64, 128)] * 2
    assert groups["ranks"].tolist() == [(0, 2), (1, 3)] and groups["replicas"].tolist() == [2, 2]
    assert plan.coords(3) == ParallelConfig(dp_replicate=2, dp_shard=1, tp=2).rank_coords(3) == (0, 1, 0, 1)


def test_root_cause_blames_the_rank_that_raised_not_the_peers_that_lost_it():
    errors = {0: {"time": 1.0, "message": "RuntimeError: Connection closed by peer"},
              2: {"time": 2.0, "message": "ValueError: bad batch"}}
    assert root_cause(errors) == 2  # live: rank 0's error is a consequence
    exits = {0: (1, 1.0), 1: (-int(signal.SIGTERM), 0.5), 2: (1, 2.0), 3: (-int(signal.SIGKILL), 3.0)}
    assert root_cause({}, exits) == 3  # SIGKILL is never torchrun's clean-up
    assert root_cause(errors, exits) == 2  # a real error and a crash are alike: the earlier one (rank 2) wins
    assert root_cause({}) is None
    err = RunFailed(2, "ValueError: bad batch", "Traceback ...")
    assert str(err) == "rank 2 failed: ValueError: bad batch" and workbench.RunFailed is RunFailed


def test_tensor_stats_read_one_tensor(tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run)
    key = "model.layers.1.attention.wo.weight"
    s = tensor_stats(run, key, bins=8)
    t = read_tensor(run, key).double()
    assert s["numel"] == t.numel() and s["non_finite"] == 0 and s["dtype"] == "float32"
    assert s["mean"] == pytest.approx(float(t.mean())) and s["max"] == float(t.max())
    assert sum(s["histogram"]["counts"]) == t.numel() and len(s["histogram"]["centers"]) == 8
    assert "histogram" not in tensor_stats(run, key)
    with pytest.raises(KeyError, match="did you mean"):
        tensor_stats(run, "model.layers.1.attention.wo.weigth")


def test_format_bytes_is_binary():
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 * 2**20, -3 * 2**30, 2**50)] == [
        "0 B", "1023 B", "1.00 KiB", "5.00 MiB", "-3.00 GiB", "1.00 PiB"]


def test_registry_finds_views_by_type_and_falls_back_when_a_plugin_is_missing(monkeypatch):
    class Thing(display.RendersInNotebook):
        def _repr_html_(self):
            return "<b>thing</b>"

    class Special(Thing):
        pass

    monkeypatch.setattr(display, "_views", {})
    monkeypatch.setattr(display, "VIEW_PLUGINS", ["workbench_no_such_view_package"])
    monkeypatch.setattr(display, "_loaded", {})
    assert display.view_for(Thing()) is None  # the plug-in cannot be imported: no view, no error
    assert display._loaded == {"workbench_no_such_view_package": False}
    display.register_view(Thing, lambda obj: ("view of", type(obj).__name__))
    assert display.view_for(Special()) == ("view of", "Special")  # a subclass gets its base's view
