"""Issue 28, finding 12: notebook 05's llama-70b prediction took 344 s; the fold makes it about 4x faster.

A stage's identical transformer blocks are simulated as 4 and folded out to all of them
(``workbench.prediction.fold``). The fold must not change a prediction: here, on small models in the
layouts it folds (one process; FSDP2 x TP with bf16, activation checkpointing and accumulation; a
1F1B pipeline of FSDP2 x TP x SP stages, both stages; op-level checkpointing; and, issue 32, groups of k
blocks under layer-level selective checkpointing of every k-th block), the folded timeline is the one
simulating every block, event for event (size, category, phase, step, micro-batch, module, operator, which allocation
each free frees), so the peaks and what they hold are the same. Before the fold, ``predict`` had no
``fold`` and simulated every block (no ``meta["folded"]``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from workbench.config import PRESETS
from workbench.memory import predict
from workbench.memory.recorder import MemoryRecorder
from workbench.prediction.fake import run_fake_steps
from workbench.prediction.fold import FoldError, fold_plan, fold_rows
from workbench.prediction.memory import _job

TINY = PRESETS["tiny"]

LAYOUTS = {
    "one process": (7, dict(nproc=1, train=dict(global_batch=2, seq_len=24, steps=2))),
    "fsdp x tp, bf16, ac, accumulation": (7, dict(nproc=4, dp_shard=2, tp=2, mixed_precision="bf16",
                                                  activation_checkpointing="full",
                                                  train=dict(global_batch=4, micro_batch=1, seq_len=24, steps=2))),
    "op-level ac, fsdp x tp x sp, bf16, accumulation": (7, dict(nproc=4, dp_shard=2, tp=2, sequence_parallel=True,
                                                                mixed_precision="bf16", activation_checkpointing="op",
                                                                train=dict(global_batch=4, micro_batch=1, seq_len=24,
                                                                           steps=2))),
    "1F1B of fsdp x tp x sp": (12, dict(nproc=8, pp=2, dp_shard=2, tp=2, sequence_parallel=True, pp_schedule="1F1B",
                                        microbatches=4, mixed_precision="bf16", activation_checkpointing="full",
                                        train=dict(global_batch=8, seq_len=32, steps=2))),
}
# layer-level selective checkpointing of every k-th block: groups of k blocks repeat, and are folded as units
GROUPED = {
    "selective every 2, one process": (10, dict(nproc=1, activation_checkpointing="selective", ac_every=2,
                                                train=dict(global_batch=2, seq_len=24, steps=2))),
    "selective every 3, fsdp x tp, bf16, accumulation": (15, dict(nproc=4, dp_shard=2, tp=2, mixed_precision="bf16",
                                                                  activation_checkpointing="selective", ac_every=3,
                                                                  train=dict(global_batch=4, micro_batch=1, seq_len=24,
                                                                             steps=2))),
}
COLUMNS = ["delta_bytes", "total_bytes", "category", "phase", "step", "microbatch", "module", "op"]


def _model(n_layers: int):
    return dataclasses.replace(TINY, n_layers=n_layers)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_folded_prediction_is_the_full_one_event_for_event(layout):
    n_layers, settings = LAYOUTS[layout]
    folded = predict(_model(n_layers), progress=False, **settings)
    full = predict(_model(n_layers), progress=False, fold=False, **settings)
    assert "folded" not in full.meta and set(folded.meta["folded"]) == {str(r) for r in full.ranks}
    _assert_same_events(full, folded, layout, group=1)


def _assert_same_events(full, folded, layout: str, group: int) -> None:
    for r in full.ranks:
        info = folded.meta["folded"][str(r)]
        n = 4 * group
        assert info["simulated_layers"] == [n * (info["simulated_layers"][0] // n) + i for i in range(n)]
        assert info.get("group", 1) == group
        assert info["events_simulated"] < info["events"] == len(full.rank(r))
        a, b = full.rank(r).frame, folded.rank(r).frame
        for c in COLUMNS:
            assert (a[c].astype(str).to_numpy() == b[c].astype(str).to_numpy()).all(), (layout, r, c)
        # the same allocations: each free frees the allocation it freed in the full simulation
        pairs = set(zip(a["id"].tolist(), b["id"].tolist()))
        assert len(pairs) == len(set(a["id"])) == len(set(b["id"]))
        assert full.peak(r) == folded.peak(r)


@pytest.mark.parametrize("layout", list(GROUPED))
def test_selective_checkpointing_of_every_kth_block_folds_groups_of_k_event_for_event(layout):
    """Blocks 0, k, 2k, ... are checkpointed, so blocks alternate but groups of k repeat: 4 groups are
    simulated (4k blocks) and groups are folded (the 8B prediction of issue 32 was 44 s unfolded)."""
    n_layers, settings = GROUPED[layout]
    folded = predict(_model(n_layers), progress=False, **settings)
    full = predict(_model(n_layers), progress=False, fold=False, **settings)
    assert "folded" not in full.meta and set(folded.meta["folded"]) == {str(r) for r in full.ranks}
    _assert_same_events(full, folded, layout, group=settings["ac_every"])


def test_the_fold_refuses_blocks_that_do_not_repeat():
    """Simulated with 3 blocks, an FSDP2 stage's middle block is not a middle one (FSDP2 gathers the block
    below while one computes its backward, except below the first block): the checks refuse the fold,
    which is why 4 are simulated, and where they refuse ``predict`` simulates every block."""
    n_layers, settings = LAYOUTS["fsdp x tp, bf16, ac, accumulation"]
    job = _job(_model(n_layers), **settings)
    small = dataclasses.replace(job, model=_model(3))
    rec = MemoryRecorder(rank=0, clock="sequence", source="predicted", blocks=True)
    run_fake_steps(small, 0, steps=1, mode_factory=lambda: rec, microbatches="peak", warm_start=True,
                   on_built=lambda model, opt: rec.track(model=model, optimizer=opt))
    with pytest.raises(FoldError, match="no counterpart"):
        fold_rows(rec.events, rec.categories, rec.blocks, [0, 1, 2], list(range(n_layers)), rec.round_bytes)


def test_where_the_checks_refuse_every_block_is_simulated():
    """FSDP2 that keeps its parameters gathered from forward to backward (zero=2) meets blocks two apart, which
    the fold does not follow: it refuses, and the prediction is the full simulation's."""
    settings = dict(nproc=2, dp_shard=2, zero=2, train=dict(global_batch=4, seq_len=24, steps=2))
    tl = predict(_model(7), progress=False, **settings)
    full = predict(_model(7), progress=False, fold=False, **settings)
    assert "folded" not in tl.meta
    assert tl.frame.drop(columns="id").equals(full.frame.drop(columns="id"))


@pytest.mark.parametrize("settings", [
    dict(model="tiny", nproc=2, dp_replicate=2, dp_shard=1),                  # DDP buckets cut across blocks
    dict(model="tiny", nproc=2, dp_shard=2, zero=1),                          # so do ZeRO-1's partitions
    dict(model="tiny-moe", nproc=2, dp_shard=2, ep=2),                        # a router is not a block's alone
    dict(model="tiny", nproc=1, activation_checkpointing="selective", ac_every=5),  # no whole groups of 5 in 12
    dict(model="tiny", nproc=1, activation_checkpointing="selective", ac_every=3),  # 4 groups: nothing to fold
    dict(model="tiny", nproc=2, pp=2, dp_shard=1, pp_schedule="Interleaved1F1B", microbatches=4),  # 2 stages a rank
    dict(model="tiny", nproc=1, n_layers=4),                                  # nothing to fold
])
def test_layouts_the_fold_cannot_do_exactly_are_simulated_whole(settings):
    settings = dict(settings)
    model = settings.pop("model")
    n_layers = settings.pop("n_layers", 12)
    cfg = dataclasses.replace(PRESETS[model], n_layers=n_layers)
    job = _job(cfg, train=dict(global_batch=4, seq_len=16), **settings)
    assert fold_plan(job, 0) is None
    assert fold_plan(_job(dataclasses.replace(TINY, n_layers=12), nproc=1, train=dict(global_batch=4, seq_len=16)),
                     0) is not None


def test_the_timeline_of_a_fold_names_every_layer():
    n_layers, settings = LAYOUTS["one process"]
    tl = predict(_model(n_layers), progress=False, **settings)
    modules = set(tl.frame["module"].astype(str))
    layers = {int(m.split("layers.")[1].split(".")[0]) for m in modules if "layers." in m}
    assert layers == set(range(n_layers))
    assert np.isfinite(tl.frame["t"]).all() and (np.diff(tl.frame["t"].to_numpy()) > 0).all()


def test_worker_processes_predict_what_one_process_predicts():
    """Distinct ranks shared between this process and a worker (issue 32: forked after the build path is
    imported, or, where a fork is unsafe, e.g. with another thread running, a fresh interpreter): the same
    timeline, event for event, as one process predicting every rank in turn."""
    import threading

    from workbench.prediction.workers import can_fork

    settings = dict(nproc=2, pp=2, dp_shard=1, pp_schedule="1F1B", microbatches=4,
                    train=dict(global_batch=8, seq_len=32, steps=2))
    one = predict(_model(7), progress=False, workers=1, **settings)
    # forked where this process may fork (no other thread running); in a suite where an earlier test left a
    # thread alive it is a fresh interpreter, and the claim below holds for it the same
    forked = predict(_model(7), progress=False, workers=2, **settings)
    spawned = {}
    thread = threading.Thread(target=lambda: spawned.update(fork=can_fork(), tl=predict(_model(7), progress=False,
                                                                                      workers=2, **settings)))
    thread.start()
    thread.join(timeout=300)
    assert len(one.ranks) == 2 and spawned["fork"] is False
    for tl in (forked, spawned["tl"]):
        assert tl.ranks == one.ranks
        for r in one.ranks:
            a, b = one.rank(r).frame, tl.rank(r).frame
            for c in COLUMNS:
                assert (a[c].astype(str).to_numpy() == b[c].astype(str).to_numpy()).all(), (r, c)


def test_worker_processes_replay_the_allocator_as_one_process_does():
    """Issue 32: each part of the distinct ranks replays its own timelines through the caching allocator
    model (in its worker, beside the others) instead of this process replaying every rank after the
    workers finish; the figures are the same. The parts are balanced by the microbatches each rank's
    shortened step runs (1F1B: one more on stage 0) and its pipeline stage, the lightest one kept here."""
    from workbench.prediction.memory import _split

    settings = dict(nproc=4, pp=4, dp_shard=1, pp_schedule="1F1B", microbatches=8,
                    train=dict(global_batch=8, seq_len=32, steps=2))
    # work: 2 per microbatch (5 on stage 0, else 4), 1 for the first stage and 1 for the last
    assert _split(_job(_model(8), **settings), [0, 1, 2, 3], 2, exact=False) == [[1, 3], [0, 2]]
    assert _split(_job(_model(8), **settings), [0, 1, 2, 3], 2, exact=True) == [[0, 1], [2, 3]]  # 8 microbatches
    assert _split(_job(_model(8), **settings), [0, 1, 2, 3], 3, exact=False) == [[3], [0], [1, 2]]
    one = predict(_model(8), device="cuda", progress=False, workers=1, **settings)
    two = predict(_model(8), device="cuda", progress=False, workers=2, **settings)
    a, b = dict(one.meta["allocator"]), dict(two.meta["allocator"])
    assert a.pop("replay_s") >= 0 and b.pop("replay_s") >= 0
    assert list(a["ranks"]) == ["0", "1", "2", "3"] and a == b
