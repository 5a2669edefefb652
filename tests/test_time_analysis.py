"""Step-time analyses on hand-built timelines with exact answers: breakdown, exposed communication, the
idle split (host / rank / bubble), stragglers and the diff of two timelines."""

from __future__ import annotations

import json
import time

import numpy as np
import pandas as pd
import pytest

from workbench.time import analysis as A
from workbench.time.timeline import CATEGORIES, StepTimeline, span_frame


def tl_of(rows, **kw) -> StepTimeline:
    return StepTimeline(span_frame(rows), **kw)


def row(df: pd.DataFrame, rank: int, step: int = 0) -> dict:
    r = df[(df["rank"] == rank) & (df["step"] == step)]
    assert len(r) == 1, df
    return {k: (pytest.approx(v) if isinstance(v, float) else v) for k, v in r.iloc[0].to_dict().items()}


def fsdp_like() -> StepTimeline:
    """Rank 0 overlaps part of its communication; rank 1 computes longer and never communicates."""
    return tl_of([
        dict(rank=0, start=0.0, end=1.0, category="forward", step=0, stream="compute", name="aten::mm"),
        dict(rank=0, start=0.5, end=1.5, category="communication", step=0, stream="comm", name="all_gather"),
        dict(rank=0, start=2.0, end=3.0, category="backward", step=0),
        dict(rank=0, start=2.5, end=3.5, category="communication", step=0, stream="comm", name="reduce_scatter"),
        dict(rank=0, start=3.5, end=4.0, category="optimizer", step=0),
        dict(rank=1, start=0.0, end=1.8, category="forward", step=0),
        dict(rank=1, start=2.0, end=4.0, category="backward", step=0),
    ])


def test_breakdown_charges_each_instant_once_and_rows_sum_to_the_step_time():
    b = A.breakdown(fsdp_like())
    assert list(b.columns) == A.BREAKDOWN_COLUMNS
    # rank 0: comm alone on [1.0, 1.5] and [3.0, 3.5]; nothing on [1.5, 2.0] (idle)
    assert row(b, 0) == {"rank": 0, "step": 0, "forward": 1.0, "backward": 1.0, "optimizer": 0.5,
                         "communication": 1.0, "data": 0.0, "checkpoint": 0.0, "idle": 0.5, "step_s": 4.0}
    assert row(b, 1)["idle"] == pytest.approx(0.2) and row(b, 1)["forward"] == pytest.approx(1.8)
    np.testing.assert_allclose(b[list(CATEGORIES)].sum(axis=1), b["step_s"])


def test_exposed_communication_is_what_no_compute_of_the_same_rank_covers():
    o = A.communication_overlap(fsdp_like())
    assert list(o.columns) == A.OVERLAP_COLUMNS
    assert row(o, 0) == {"rank": 0, "step": 0, "comm_s": 2.0, "exposed_s": 1.0, "overlapped_s": 1.0,
                         "exposed_fraction": 0.5}
    assert row(o, 1)["comm_s"] == 0 and row(o, 1)["exposed_fraction"] == 0  # no communication: 0, not NaN
    # the breakdown's communication is the exposed part
    assert A.breakdown(fsdp_like())["communication"].tolist() == pytest.approx(o["exposed_s"].tolist())


def test_concurrent_collectives_count_once_and_compute_on_another_stream_hides_them():
    tl = tl_of([
        dict(rank=0, start=0.0, end=4.0, category="communication", stream="comm", name="nccl:all_gather", step=2),
        dict(rank=0, start=1.0, end=3.0, category="communication", stream="cuda:9", name="nccl:all_to_all", step=2),
        dict(rank=0, start=3.0, end=5.0, category="forward", stream="cuda:7", step=2),
    ])
    o = A.communication_overlap(tl)
    assert row(o, 0, 2) == {"rank": 0, "step": 2, "comm_s": 4.0, "exposed_s": 3.0, "overlapped_s": 1.0,
                            "exposed_fraction": 0.75}


def test_idle_split_waits_for_a_busy_peer_or_for_the_host():
    s = A.idle_split(fsdp_like())
    assert list(s.columns) == A.IDLE_COLUMNS
    # rank 0 idles on [1.5, 2.0]: rank 1 still computes until 1.8 -> 0.3 s waiting for a rank, 0.2 for the host
    assert row(s, 0) == {"rank": 0, "step": 0, "host_s": 0.2, "rank_s": 0.3, "bubble_s": 0.0}
    # rank 1 idles on [1.8, 2.0] while rank 0 only communicates: nobody works, that is the host
    assert row(s, 1) == {"rank": 1, "step": 0, "host_s": 0.2, "rank_s": 0.0, "bubble_s": 0.0}


def test_named_idle_spans_keep_their_reason_and_collective_waits_count_as_waiting_for_a_rank():
    tl = tl_of([
        dict(rank=0, start=0.0, end=1.0, category="forward", step=0),
        dict(rank=0, start=1.0, end=1.25, category="idle", name="wait:host", step=0),
        dict(rank=0, start=1.25, end=1.5, category="idle", name="wait:rank", step=0),
        dict(rank=0, start=1.5, end=2.0, category="idle", name="wait:bubble", step=0),
        dict(rank=0, start=2.0, end=2.5, category="communication", name="c10d::wait", stream="compute", step=0),
        dict(rank=0, start=2.5, end=3.0, category="communication", name="all_reduce", stream="compute", step=0),
        dict(rank=0, start=3.0, end=3.5, category="backward", step=0),
        dict(rank=0, start=3.25, end=3.5, category="communication", name="wait:rank", stream="comm", step=0),
    ])
    s = A.idle_split(tl)
    # the wait under backward is hidden; the exposed one (0.5 s) is time blocked on peers
    assert row(s, 0) == {"rank": 0, "step": 0, "host_s": 0.25, "rank_s": 0.25 + 0.5, "bubble_s": 0.5}
    b = row(A.breakdown(tl), 0)
    assert b["idle"] == pytest.approx(1.0) and b["communication"] == pytest.approx(1.0)
    assert A.is_wait_name("_c10d_functional::wait_tensor") and not A.is_wait_name("nccl:all_reduce")


def pipeline_two_stages(meta=None) -> StepTimeline:
    """GPipe, 2 stages, 2 microbatches, 1 s each: stage 1 starts a microbatch late and stage 0 ends one early."""
    rows = []
    for mb in range(2):
        rows.append(dict(rank=0, start=0.0 + mb, end=1.0 + mb, category="forward", microbatch=mb, step=0))
        rows.append(dict(rank=1, start=1.0 + mb, end=2.0 + mb, category="forward", microbatch=mb, step=0))
        rows.append(dict(rank=1, start=3.0 + mb, end=4.0 + mb, category="backward", microbatch=1 - mb, step=0))
        rows.append(dict(rank=0, start=4.0 + mb, end=5.0 + mb, category="backward", microbatch=1 - mb, step=0))
    # both stages' optimizer after the flush; the step window of each rank spans 0..6.5
    rows.append(dict(rank=0, start=6.0, end=6.5, category="optimizer", step=0))
    rows.append(dict(rank=1, start=0.0, end=0.0, category="data", step=0))  # stage 1's step starts at 0 too
    rows.append(dict(rank=1, start=6.0, end=6.5, category="optimizer", step=0))
    return tl_of(rows, meta=meta or {})


def test_pipeline_fill_and_drain_are_the_bubble_and_the_middle_waits_for_the_neighbour():
    s = A.idle_split(pipeline_two_stages())
    # rank 0: idle [2, 4] between its forwards and backwards while rank 1 computes -> waiting for a rank;
    # no fill (it starts at 0), drain none (its last backward ends at 6, then the optimizer)
    assert row(s, 0) == {"rank": 0, "step": 0, "host_s": 0.0, "rank_s": 2.0, "bubble_s": 0.0}
    # rank 1: fill [0, 1] and drain [5, 6] are the bubble; [3, 3] nothing in between
    assert row(s, 1) == {"rank": 1, "step": 0, "host_s": 0.0, "rank_s": 0.0, "bubble_s": 2.0}
    b = A.breakdown(pipeline_two_stages())
    assert row(b, 1)["idle"] == pytest.approx(2.0) and row(b, 0)["idle"] == pytest.approx(2.0)


def test_a_stages_fill_and_drain_are_bubble_whatever_the_idle_is_named_and_blocking_receives_are_waits():
    tl = pipeline_two_stages()
    f = tl.frame
    extra = span_frame([
        dict(rank=1, start=0.0, end=0.5, category="idle", name="wait:host", step=0),       # fill: bubble anyway
        dict(rank=1, start=0.5, end=1.0, category="communication", name="gloo:recv", step=0),  # fill, blocked
        dict(rank=0, start=2.0, end=2.5, category="communication", name="c10d::recv_", step=0),  # middle: a rank
        dict(rank=0, start=2.5, end=3.0, category="idle", name="wait:host", step=0),       # middle, named: host
        dict(rank=1, start=5.0, end=6.0, category="communication", name="nccl:recv", stream="comm", step=0),
    ])
    tl = StepTimeline(pd.concat([f, extra], ignore_index=True))
    s = A.idle_split(tl)
    assert row(s, 1) == {"rank": 1, "step": 0, "host_s": 0.0, "rank_s": 0.0, "bubble_s": 2.0}
    # rank 0 [2, 4]: 0.5 s blocked in a receive and 1.0 s idle while rank 1 computes wait for a rank
    assert row(s, 0) == {"rank": 0, "step": 0, "host_s": 0.5, "rank_s": 1.5, "bubble_s": 0.0}
    b = A.breakdown(tl)
    assert row(b, 1)["idle"] == pytest.approx(0.5) and row(b, 1)["communication"] == pytest.approx(1.5)
    assert A.is_wait_name("gloo:recv") and A.is_wait_name("c10d::recv_") and not A.is_wait_name("gloo:send")


def test_microbatches_of_gradient_accumulation_are_no_bubble_when_the_layout_says_pp_1():
    s = A.idle_split(pipeline_two_stages(meta={"parallel": {"pp": 1}}))
    assert row(s, 1)["bubble_s"] == 0 and row(s, 1)["rank_s"] == pytest.approx(2.0)  # rank 0 busy meanwhile
    assert A.idle_split(pipeline_two_stages(), pipeline=False)["bubble_s"].sum() == 0


def test_a_span_of_the_next_step_inside_a_window_counts_where_it_runs_and_steps_stay_apart():
    tl = tl_of([
        dict(rank=0, start=0.0, end=1.0, category="forward", step=0),
        dict(rank=0, start=1.0, end=3.0, category="communication", stream="comm", name="reduce_scatter", step=0),
        dict(rank=0, start=2.0, end=3.5, category="forward", step=1),
    ])
    b = A.breakdown(tl)
    assert row(b, 0, 0) == {"rank": 0, "step": 0, "forward": 2.0, "backward": 0.0, "optimizer": 0.0,
                            "communication": 1.0, "data": 0.0, "checkpoint": 0.0, "idle": 0.0, "step_s": 3.0}
    assert row(b, 0, 1)["forward"] == pytest.approx(1.5) and row(b, 0, 1)["step_s"] == pytest.approx(1.5)


def test_stragglers_compare_the_work_of_each_rank_with_the_median_rank():
    rows = []
    for r, work in enumerate((1.0, 1.0, 1.02, 1.3)):
        for step in range(3):
            t0 = 2.0 * step
            rows.append(dict(rank=r, start=t0, end=t0 + work, category="forward", step=step))
            # everyone ends the step together in the loss all-reduce
            rows.append(dict(rank=r, start=t0 + work, end=t0 + 1.5, category="communication", name="all_reduce",
                             step=step))
    st = A.stragglers(tl_of(rows))
    assert list(st.columns) == A.STRAGGLER_COLUMNS
    assert st["step_s"].tolist() == pytest.approx([1.5] * 4)  # step times cannot tell them apart
    assert st["median_s"].tolist() == pytest.approx([1.01] * 4)
    assert st["excess"].tolist() == pytest.approx([-0.01 / 1.01, -0.01 / 1.01, 0.01 / 1.01, 0.29 / 1.01])
    assert st["straggler"].tolist() == [False, False, False, True]
    assert A.stragglers(tl_of(rows), threshold=0.5)["straggler"].sum() == 0
    assert A.stragglers(tl_of(rows), by="step")["straggler"].sum() == 0
    with pytest.raises(ValueError, match="threshold"):
        A.stragglers(tl_of(rows), threshold=-1)


def test_diff_gives_per_rank_category_deltas_and_the_step_time_ratio():
    a = fsdp_like()
    f = a.frame.copy()
    f.loc[f["category"] == "backward", "end"] += 1.0  # every backward 1 s longer ...
    f.loc[f["category"] != "backward", ["start", "end"]] += np.where(
        (f.loc[f["category"] != "backward", "start"] >= 3.0).to_numpy()[:, None], 1.0, 0.0)  # ... and what follows moves
    b = StepTimeline(f, source="predicted", device="H100-SXM")
    d = A.diff(a, b)
    fr = d.to_frame()
    r0 = fr[(fr["rank"] == 0) & (fr["category"] == "backward")].iloc[0]
    assert (r0["a_s"], r0["b_s"], r0["delta_s"]) == pytest.approx((1.0, 2.0, 1.0))
    assert d.step_time_ratio == pytest.approx(5.0 / 4.0)
    doc = json.loads(d.to_json())
    assert doc["step_time_ratio"] == pytest.approx(1.25) and doc["b"] == "predicted (H100-SXM)"
    assert doc["categories"]["backward"]["delta_s"] == pytest.approx(1.0)
    assert doc["largest_change"] == "backward"
    assert "TimelineDiff" in d._repr_html_() and "backward" in d._repr_html_()
    from workbench.display import RendersInNotebook

    assert isinstance(d, RendersInNotebook)


def test_diff_follows_a_predictions_rank_map_and_refuses_disjoint_ranks():
    a = fsdp_like()
    pred = StepTimeline(a.select(rank=0).frame, source="predicted", meta={"rank_map": {"0": 0, "1": 0}})
    fr = A.diff(a, pred).to_frame()
    assert sorted(fr["rank"].unique()) == [0, 1] and set(fr["b_rank"]) == {0}
    other = StepTimeline(a.frame.assign(rank=a.frame["rank"] + 5))
    with pytest.raises(ValueError, match="share no rank"):
        A.diff(a, other)
    with pytest.raises(ValueError, match="no spans inside a step"):
        A.diff(a, StepTimeline(span_frame([dict(rank=0, start=0, end=1, category="data")])))


def test_empty_timelines_give_empty_frames_with_the_columns():
    empty = StepTimeline(span_frame([]))
    assert list(A.breakdown(empty).columns) == A.BREAKDOWN_COLUMNS and A.breakdown(empty).empty
    assert A.idle_split(empty).empty and A.communication_overlap(empty).empty and A.stragglers(empty).empty
    with pytest.raises(TypeError, match="StepTimeline"):
        A.breakdown("runs/x")


def test_the_lazy_names_of_workbench_time_reach_the_analyses():
    import workbench.time as wt

    assert wt.breakdown is A.breakdown and wt.diff is A.diff and wt.stragglers is A.stragglers


def test_cost_grows_like_n_log_n():
    def make(n: int, ranks: int = 8) -> StepTimeline:
        rng = np.random.default_rng(0)
        per = n // ranks
        frames = []
        for r in range(ranks):
            start = np.sort(rng.uniform(0, 10, per))
            frames.append(pd.DataFrame({
                "rank": r, "start": start, "end": start + rng.uniform(0, 0.01, per),
                "category": rng.choice(list(CATEGORIES), per), "step": (start // 1).astype(int),
                "stream": rng.choice(["compute", "comm"], per), "name": rng.choice(["", "wait:rank", "c10d::wait"], per)}))
        return StepTimeline(span_frame(pd.concat(frames, ignore_index=True)))

    def cost(tl: StepTimeline) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.process_time()
            A.breakdown(tl)
            best = min(best, time.process_time() - t0)
        return best

    small, big = make(20_000), make(200_000)
    c_small, c_big = cost(small), cost(big)
    assert c_big < 2.0, f"200k spans took {c_big:.2f} s of CPU"
    assert c_big < 25 * max(c_small, 0.01), (c_small, c_big)  # 10x the spans: ~10x, not 100x
    b = A.breakdown(big)
    np.testing.assert_allclose(b[list(CATEGORIES)].sum(axis=1), b["step_s"], rtol=1e-9, atol=1e-9)
