"""The CUDA caching allocator model (workbench/memory/allocator.py), and reserved memory in predictions.

Each hand-computed sequence follows from torch's documented rules (c10/cuda/CUDACachingAllocator.cpp):
512-byte rounding, the small pool's 2 MiB segments, 20 MiB segments for large requests under 10 MiB,
splitting (small: >= 512 B left; large: > 1 MiB left), coalescing, max_split_size, expandable segments'
pages, and what happens at a capacity. No GPU is needed; the real-data checks are in docs/memory.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.memory.allocator import (AllocatorConfig, CachingAllocator, OutOfMemory, allocation_size, replay,
                                        replay_timeline, round_size)

MiB = 1 << 20


def _segments(alloc: CachingAllocator) -> list[list]:
    """Every segment's blocks, first to last, found from the pools' free lists and the given live blocks."""
    heads = {}
    for pool in alloc._pools.values():
        for _, _, b in pool.free:
            while b.prev is not None:
                b = b.prev
            heads[b.addr] = b
    out = []
    for b in heads.values():
        chain = []
        while b is not None:
            chain.append(b)
            b = b.next
        out.append(chain)
    return out


def _check_segments(alloc: CachingAllocator) -> None:
    """Blocks of a segment tile it: each starts where the previous ends, two free mapped ones never touch."""
    for chain in _segments(alloc):
        for a, b in zip(chain, chain[1:]):
            assert a.addr + a.size == b.addr and b.prev is a
            assert a.allocated or b.allocated or a.mapped != b.mapped, "free neighbours were not merged"


# -- rounding and segment sizes -------------------------------------------------------------------------

def test_rounding_and_segment_sizes_follow_torch():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert round_size(1200) == 1536
    # power-of-two divisions: 4100 lies between 4096 and 8192, cut in 4 steps of 1024 -> 5120 (512-rounding:
    # 4608); a size up to 512 x divisions keeps plain rounding, as in torch's round_size
    assert round_size(4100, divisions=4) == 5120 and round_size(4100) == 4608
    assert round_size(1200, divisions=4) == 1536
    assert round_size(1 << 20, divisions=4) == 1 << 20  # a power of two stays
    assert allocation_size(512) == 2 * MiB and allocation_size(1 * MiB) == 2 * MiB
    assert allocation_size(1 * MiB + 512) == 20 * MiB and allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB) == 12 * MiB


def test_small_pool_packs_requests_into_2_mib_segments():
    a = CachingAllocator()
    x = a.malloc(1000)  # 1024 B in a new 2 MiB segment, split (>= 512 B left)
    assert (a.reserved, a.allocated, a.segments) == (2 * MiB, 1024, 1)
    a.malloc(1 * MiB)   # fits the 2 MiB - 1 KiB left
    assert (a.reserved, a.segments) == (2 * MiB, 1)
    a.malloc(1 * MiB)   # does not: a second segment
    assert (a.reserved, a.segments) == (4 * MiB, 2)
    a.free(x)
    assert a.reserved == 4 * MiB and a.allocated == 2 * MiB  # freed blocks stay cached
    _check_segments(a)


def test_large_requests_under_10_mib_share_20_mib_segments():
    a = CachingAllocator()
    blocks = [a.malloc(5 * MiB) for _ in range(4)]  # 4 x 5 MiB tile one 20 MiB segment exactly
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 20 * MiB, 1)
    a.malloc(5 * MiB)
    assert (a.reserved, a.segments) == (40 * MiB, 2)
    a.malloc(15 * MiB)  # exactly the second segment's free 15 MiB: no block is left free
    assert (a.reserved, a.allocated) == (40 * MiB, 40 * MiB)
    # coalescing: two neighbours freed make one 10 MiB block, which serves 9 MiB without a new segment
    a.free(blocks[1])
    a.free(blocks[2])
    _check_segments(a)
    a.malloc(9 * MiB)
    assert (a.reserved, a.segments) == (40 * MiB, 2)


def test_large_blocks_split_only_when_more_than_1_mib_remains():
    a = CachingAllocator()
    a.malloc(11 * MiB)  # a 12 MiB segment; 1 MiB left is not split off: the whole block is allocated
    assert (a.reserved, a.allocated) == (12 * MiB, 12 * MiB)
    b = CachingAllocator()
    b.malloc(10 * MiB + 512 * 1024)  # 12 MiB segment, 1.5 MiB left: split
    assert (b.reserved, b.allocated) == (12 * MiB, 10 * MiB + 512 * 1024)


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    a = CachingAllocator()
    big, mid, mid2 = a.malloc(30 * MiB), a.malloc(24 * MiB), a.malloc(24 * MiB)
    for blk in (big, mid2, mid):
        a.free(blk)
    got = a.malloc(23 * MiB)  # 24 MiB fits best; of the two, the lower address; 1 MiB left: no split
    assert got.addr == mid.addr and got.size == 24 * MiB and a.segments == 3


def test_max_split_size_keeps_oversize_blocks_whole():
    a = CachingAllocator(AllocatorConfig(max_split_size=64 * MiB))
    a.free(a.malloc(100 * MiB))
    a.malloc(30 * MiB)  # may not cut the cached 100 MiB block: a segment of its own
    assert a.reserved == 130 * MiB
    a.malloc(70 * MiB)  # oversize, but the cached block is >= 20 MiB larger: a new segment
    assert a.reserved == 200 * MiB
    c = CachingAllocator(AllocatorConfig(max_split_size=64 * MiB))
    c.free(c.malloc(100 * MiB))
    c.malloc(85 * MiB)  # within 20 MiB: served by the whole 100 MiB block, not split
    assert (c.reserved, c.allocated) == (100 * MiB, 100 * MiB)


def test_at_capacity_cached_segments_are_freed_then_it_runs_out():
    a = CachingAllocator(AllocatorConfig(capacity=50 * MiB))
    a.free(a.malloc(40 * MiB))
    a.malloc(45 * MiB)  # 40 + 46 > 50: the cached 40 MiB segment is returned, then 46 MiB fits
    assert (a.reserved, a.segments) == (46 * MiB, 1)
    with pytest.raises(OutOfMemory):
        a.malloc(10 * MiB)  # nothing cached to return: out of memory
    assert a.num_ooms == 1 and a.reserved == 46 * MiB


def test_oversize_segments_are_returned_first_with_max_split_size():
    a = CachingAllocator(AllocatorConfig(max_split_size=32 * MiB, capacity=150 * MiB))
    a.free(a.malloc(5 * MiB))     # a cached 20 MiB segment, all free
    a.free(a.malloc(100 * MiB))   # a cached oversize one: 120 MiB reserved
    a.malloc(60 * MiB)  # the 100 MiB block is 20 MiB or more too large; 120 + 60 > 150: only the oversize
    assert (a.reserved, a.segments) == (80 * MiB, 2)  # segment is returned (not the 20 MiB one), then 60 fits
    b = CachingAllocator(AllocatorConfig(max_split_size=32 * MiB))
    b.free(b.malloc(40 * MiB))
    b.malloc(38 * MiB)  # within 20 MiB of the cached 40 MiB block: reused whole
    assert (b.reserved, b.allocated) == (40 * MiB, 40 * MiB)


def test_expandable_segments_grow_one_segment_by_pages():
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a.malloc(5 * MiB)  # the large pool maps 20 MiB pages
    assert (a.reserved, a.segments) == (20 * MiB, 1)
    a.malloc(30 * MiB)  # 15 MiB free at the end + one more page: still one segment
    assert (a.reserved, a.segments, a.allocated) == (40 * MiB, 1, 35 * MiB)
    a.malloc(1000)  # the small pool: its own segment of 2 MiB pages
    assert (a.reserved, a.segments) == (42 * MiB, 2)
    plain = CachingAllocator()
    plain.malloc(5 * MiB)
    plain.malloc(30 * MiB)
    assert (plain.reserved, plain.segments) == (50 * MiB, 2)


def test_expandable_segments_unmap_free_pages_when_out_of_room():
    a = CachingAllocator(AllocatorConfig(expandable_segments=True, capacity=60 * MiB))
    x, y = a.malloc(20 * MiB), a.malloc(20 * MiB)
    a.free(x)
    a.malloc(30 * MiB)  # 40 reserved + 40 more would pass 60: the free first page is unmapped, then 40 mapped
    assert a.reserved == 60 * MiB and y.allocated
    _check_segments(a)
    a.empty_cache()
    a2 = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a2.free(a2.malloc(50 * MiB))
    a2.empty_cache()  # every page free: unmapped, and the segment released
    assert (a2.reserved, a2.segments) == (0, 0)


def test_allocator_settings_parse_like_pytorch_cuda_alloc_conf():
    cfg = AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4")
    assert cfg == AllocatorConfig(True, 128 * MiB, 4)
    with pytest.raises(ValueError, match="garbage_collection_threshold.*not modelled"):
        AllocatorConfig.parse("garbage_collection_threshold:0.6")
    with pytest.raises(ValueError, match="max_split_size_mb:128"):
        AllocatorConfig.parse("max_split_size_mb")
    with pytest.raises(ValueError, match="more than 20 MiB"):
        AllocatorConfig(max_split_size=8 * MiB)


# -- replays --------------------------------------------------------------------------------------------

def test_replay_follows_ids_resizes_and_a_capacity():
    ids = [1, 2, 1, 3, 3, 2]
    deltas = [5 * MiB, 300 * 1024, -5 * MiB, 8 * MiB, 4 * MiB, -300 * 1024]  # id 3 grows in place
    r = replay(ids, deltas)
    assert r.reserved.tolist() == [20 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 22 * MiB]
    assert r.allocated.tolist() == [5 * MiB, 5 * MiB + 300 * 1024, 300 * 1024, 8 * MiB + 300 * 1024,
                                    12 * MiB + 300 * 1024, 12 * MiB]
    assert r.peak_allocated == 20 * MiB + 300 * 1024  # mid-resize: 8 and 12 MiB alive at once
    assert r.peak_reserved == 22 * MiB and not r.oom
    tight = replay(ids, deltas, AllocatorConfig(capacity=21 * MiB))
    assert tight.oom and tight.oom_index == 1 and tight.peak_reserved == 22 * MiB  # goes on, unbounded
    with_base = replay([7], [-MiB], base_bytes=3 * MiB)
    assert with_base.orphan_frees == 1 and with_base.reserved.tolist() == [3 * MiB]


def test_replay_of_a_generated_torch_snapshot(tmp_path):
    """The alloc/free sequence of a torch-format snapshot (memory/synthetic.py) through the model.

    synthetic.py does not follow torch's segment rules (one segment per live block, 512 B larger, and a
    2 MiB segment per step that nothing uses: its reserved peak is below its allocated peak), so the model
    is not checked against those segment events; only against the allocations, which are exact."""
    from workbench.memory.snapshot import from_snapshot, write_synthetic_snapshot

    truth = write_synthetic_snapshot(tmp_path / "snapshot_rank0.pickle", 2**20)
    tl = from_snapshot(tmp_path / "snapshot_rank0.pickle")
    for cfg in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)):
        r = replay_timeline(tl, cfg)[0]
        assert r.orphan_frees == 2  # the data batch made before the trace, freed by the first step
        assert truth["peak_bytes"] <= r.peak_allocated <= truth["peak_bytes"] * 1.01  # unsplit remainders
        assert (r.reserved >= r.allocated).all() and r.peak_reserved >= r.peak_allocated
        assert r.base_bytes == truth["base_bytes"]
        assert truth["end_bytes"] <= r.allocated[-1] <= truth["end_bytes"] * 1.01  # parameters, AdamW state


_SIZES = st.one_of(st.integers(1, 1 << 20), st.integers((1 << 20) + 1, 12 << 20), st.integers(12 << 20, 200 << 20))
_CONFIGS = st.sampled_from([AllocatorConfig(), AllocatorConfig(expandable_segments=True),
                            AllocatorConfig(max_split_size=48 * MiB), AllocatorConfig(roundup_power2_divisions=4)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.booleans(), _SIZES, st.integers(0, 10_000)), min_size=1, max_size=150), cfg=_CONFIGS)
def test_property_reserved_covers_allocated_and_freeing_all_coalesces(ops, cfg):
    a = CachingAllocator(cfg)
    live: list = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            live.append((a.malloc(size), size))
        else:
            a.free(live.pop(pick % len(live))[0])
        assert a.reserved >= a.allocated >= sum(round_size(s, cfg.roundup_power2_divisions) for _, s in live)
        assert a.allocated == sum(b.size for b, _ in live)
    _check_segments(a)
    for b, _ in live:
        a.free(b)
    assert a.allocated == 0
    for chain in _segments(a):  # everything free: each segment is one block again (or free pages + unmapped)
        assert sum(not b.mapped for b in chain) == len(chain) - 1 if cfg.expandable_segments else len(chain) == 1
    a.empty_cache()
    assert a.reserved == 0 and a.segments == 0


def _random_events(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A training-like stream: allocations of mixed sizes, each freed a while later, ids paired."""
    rng = np.random.default_rng(seed)
    ids, deltas, live = [], [], []
    nxt = 0
    sizes = np.concatenate([rng.integers(512, 1 << 20, n), rng.integers(1 << 20, 64 << 20, n)])
    rng.shuffle(sizes)
    for i in range(n):
        if live and (len(live) > 200 or rng.random() < 0.5):
            k, s = live.pop(int(rng.integers(len(live))))
            ids.append(k)
            deltas.append(-s)
        else:
            s = int(sizes[i]) // 512 * 512 + 512
            live.append((nxt, s))
            ids.append(nxt)
            deltas.append(s)
            nxt += 1
    return np.asarray(ids), np.asarray(deltas)


def test_replay_time_grows_about_linearly():
    small, large = _random_events(10_000, 1), _random_events(40_000, 2)
    replay(*small)  # warm up
    times = []
    for ids, deltas in (small, large):
        t0 = time.process_time()
        replay(ids, deltas)
        times.append(time.process_time() - t0)
    assert times[1] < 8 * max(times[0], 0.01), times  # 4x the events: about 4x the time (a loaded machine)
    assert times[1] < 2.0, times  # 40,000 events well under a second quiet; two on a loaded 2-core box


# -- in predictions, fits and the CLI -------------------------------------------------------------------

SHAPE = dict(global_batch=4, seq_len=128, steps=2)


def test_cuda_predictions_report_reserved_per_rank(tmp_path):
    from workbench.memory.comparison import compare
    from workbench.memory.snapshot import from_snapshot, write_synthetic_snapshot
    from workbench.prediction.memory import predict, reserved_per_rank

    tl = predict("tiny", nproc=2, dp_shard=2, device="cuda", train=dict(SHAPE), progress=False)
    info = tl.meta["allocator"]
    assert set(info["ranks"]) == {str(r) for r in tl.ranks}
    for r in tl.ranks:
        v = info["ranks"][str(r)]
        assert v["peak_reserved"] >= v["peak_allocated"] >= tl.peak(r).bytes
        assert v["segments"] >= 1 and 0 <= v["fragmentation"] < 1
        assert [s["step"] for s in v["steps"]] == tl.steps
        assert v["flagged_steps"] == [s["step"] for s in v["steps"] if s["overhead"] > 0.05]
    peaks = tl.peaks()
    assert (peaks["reserved_bytes"] >= peaks["peak_bytes"]).all()
    assert reserved_per_rank(tl).index.tolist() == [0, 1]
    # a measured CUDA timeline that knows its reserved peak (a snapshot's segment events) compares it too
    write_synthetic_snapshot(tmp_path / "snapshot_rank0.pickle", 2**20)
    measured = from_snapshot(tmp_path / "snapshot_rank0.pickle")
    row = compare(measured, tl).to_frame().iloc[0]
    assert row["measured_reserved"] == measured.meta["reserved_bytes"]["0"]["peak"]
    assert row["predicted_reserved"] == info["ranks"]["0"]["peak_reserved"]
    assert row["reserved_error"] == pytest.approx(row["predicted_reserved"] / row["measured_reserved"] - 1)
    assert "reserved_max_abs_error" in compare(measured, tl).summary()
    cpu = predict("tiny", nproc=1, train=dict(SHAPE), progress=False)
    assert "allocator" not in cpu.meta and "reserved_bytes" not in cpu.peaks().columns


def test_fits_compares_reserved_plus_a_margin_on_cuda():
    from workbench.prediction.memory import fits, predict

    tl = predict("tiny", nproc=1, device="cuda", train=dict(SHAPE), progress=False)
    reserved = tl.meta["allocator"]["ranks"]["0"]["peak_reserved"]
    exact = fits("tiny", reserved + 512 * MiB, device="cuda", nproc=1, train=dict(SHAPE), timeline=tl)
    assert exact.compared == "reserved" and exact.margin_bytes == 512 * MiB and exact.fits
    assert exact.peak_bytes == reserved and exact.needed_bytes == reserved + 512 * MiB
    assert "reserved peak" in str(exact) and "margin" in str(exact)
    assert exact.runs_out is False
    short = fits("tiny", reserved + 512 * MiB - 1, device="cuda", nproc=1, train=dict(SHAPE), timeline=tl)
    assert not short.fits
    allocated = tl.meta["allocator"]["ranks"]["0"]["peak_allocated"]
    starved = fits("tiny", allocated // 2 + 512 * MiB, device="cuda", nproc=1, train=dict(SHAPE), timeline=tl)
    assert not starved.fits and starved.runs_out is True  # below the tensors' own peak: out of memory
    # between the two peaks the allocator may get by, freeing its cache: the replay at that room says
    tight = replay(tl.frame["id"].to_numpy(), tl.frame["delta_bytes"].to_numpy(),
                   AllocatorConfig(capacity=reserved - 1))
    assert short.runs_out is tight.oom
    no_margin = fits("tiny", reserved, device="cuda", margin=0, nproc=1, train=dict(SHAPE), timeline=tl)
    assert no_margin.fits and no_margin.margin_bytes == 0
    with pytest.raises(ValueError, match="margin 'lots'"):
        fits("tiny", "1GiB", device="cuda", margin="lots", nproc=1, train=dict(SHAPE), timeline=tl)
    with pytest.raises(ValueError, match="predicted for cuda, not cpu"):
        fits("tiny", "1GiB", device="cpu", nproc=1, train=dict(SHAPE), timeline=tl)


def test_plan_fits_reuses_the_plans_cached_prediction(monkeypatch):
    import workbench
    import workbench.prediction.memory as pm
    from workbench.config import ParallelConfig

    plan = workbench.plan("tiny", ParallelConfig(dp_shard=2))
    own = plan._job()
    predicted = []
    real = pm.predict

    def counting(job, **kw):
        predicted.append(pm._job(job))
        return real(job, **kw)

    monkeypatch.setattr(pm, "predict", counting)
    plan.predict_memory("cuda")
    peak = int(pm.reserved_per_rank(plan.predict_memory("cuda")).max())
    fit = plan.fits(peak + 2 * 512 * MiB, device="cuda")  # margin: context 512 + 2 x 256 MiB NCCL (world, dp_shard)
    assert predicted.count(own) == 1, "the job as planned was predicted again"
    assert fit.tried[own.train.local_micro_batch(own.parallel.dp)] == peak
    assert plan.fits(peak + 2 * 512 * MiB, device="cuda") is fit and predicted.count(own) == 1


def test_cli_prints_reserved_and_refuses_a_bad_margin():
    run = [sys.executable, "-m", "workbench.cli", "memory", "predict", "tiny", "--nproc", "1", "--device", "cuda",
           "--global-batch", "4", "--seq-len", "128", "--steps", "2"]
    doc = json.loads(subprocess.run(run + ["--json", "--budget", "8GiB", "--margin", "1GiB"], capture_output=True,
                                    text=True, timeout=300, check=True).stdout)
    assert doc["max_reserved_bytes"] >= doc["max_peak_bytes"] and doc["peaks"][0]["reserved_bytes"]
    assert doc["fit"]["compared"] == "reserved" and doc["fit"]["margin_bytes"] == 1 << 30
    assert doc["allocator"]["ranks"]["0"]["peak_reserved"] == doc["max_reserved_bytes"]
    text = subprocess.run(run, capture_output=True, text=True, timeout=300, check=True).stdout
    assert "reserved" in text and "caching allocator reserves" in text
    bad = subprocess.run(run + ["--budget", "8GiB", "--margin", "lots"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "--margin 'lots'" in bad.stderr
