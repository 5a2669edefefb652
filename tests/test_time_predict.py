"""Predicted step time (workbench.prediction.step_time) and device profiles (workbench.time.devices).

The predictions run the trainer's own step on fake tensors for `small` on 4 ranks (dp, fsdp, tp, tp+sp, pp)
and check the timeline's structure: streams never overlap themselves, FSDP's all-gathers overlap compute,
TP's collectives are exposed on the compute stream, a pipeline shows its bubble, and the bytes on the wire
are the plan's (``ShardingPlan.comm_bytes_per_step``).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from workbench.time.devices import DeviceProfile, Link, device_profile, profile_names

SHIPPED = ("H100-SXM", "H200", "A100-SXM-80GB")


# -- device profiles ------------------------------------------------------------------------------


def test_shipped_profiles_load_uncalibrated_with_their_data_sheet():
    assert set(SHIPPED) <= set(profile_names())
    for name in SHIPPED:
        p = device_profile(name)
        assert p.name == name and p.kind == "cuda"
        assert p.calibrated is False
        assert "data sheet" in p.source
        assert {"matmul", "elementwise", "collective"} <= set(p.assumptions)
        assert p.matmul_flops["bf16"] > p.matmul_flops["tf32"] > p.matmul_flops["fp32"]
    h100, h200, a100 = (device_profile(n) for n in SHIPPED)
    # NVLink 900 / 600 GB/s bidirectional -> one direction
    assert h100.links["intra"].bytes_per_s == 450e9 and a100.links["intra"].bytes_per_s == 300e9
    assert h100.links["inter"].bytes_per_s == 50e9  # 400 Gb/s InfiniBand per GPU
    assert h200.elementwise_bytes_per_s > h100.elementwise_bytes_per_s  # HBM3e 4.8 TB/s vs 3.35
    assert h100.matmul_flops["bf16"] == pytest.approx(989.4e12)


def test_profile_round_trips_and_a_saved_cpu_profile_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE_PROFILE_DIR", str(tmp_path))
    default = device_profile("cpu")
    assert default.calibrated is False and default.kind == "cpu" and default.op_overhead_s > 0
    mine = DeviceProfile(**{**default.__dict__, "calibrated": True, "source": "measured here",
                            "matmul_flops": {"fp32": 1.23e10}})
    path = mine.save(tmp_path / "cpu.json")
    assert DeviceProfile.load(path) == mine
    assert DeviceProfile.from_json(mine.to_json()) == mine
    got = device_profile("cpu")
    assert got.calibrated is True and got.matmul_flops == {"fp32": 1.23e10}
    assert device_profile(str(path)) == mine


def test_collective_time_ring_and_tree():
    a, b, e = 1e-5, 100e9, 0.5
    ring = DeviceProfile(name="x", calibrated=False, source="t", matmul_flops={"fp32": 1e12},
                         elementwise_bytes_per_s=1e12, efficiency={"collective": e}, op_overhead_s=0.0,
                         links={"intra": Link(a, b), "inter": Link(a, b, "tree")})
    n, N = 8, 1 << 30
    assert ring.collective_time("all_reduce", N, n, True) == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * N / (b * e))
    assert ring.collective_time("all_gather", N, n, True) == pytest.approx((n - 1) * a + (n - 1) / n * N / (b * e))
    assert ring.collective_time("all_reduce", N, n, False) == pytest.approx(2 * 3 * a + 2 * (n - 1) / n * N / (b * e))
    assert ring.collective_time("send/recv", N, 2, True) == pytest.approx(a + N / (b * e))
    assert ring.collective_time("all_reduce", N, 1, True) == 0.0
    with pytest.raises(ValueError, match="unknown"):
        ring.collective_time("gossip", N, n, True)


@pytest.mark.parametrize("text", ["{not json", '{"format": "workbench.device_profile", "version": 1, "name": "x"}',
                                  '{"format": "something else"}', "\xff\xfe"])
def test_a_damaged_profile_is_one_line_error(tmp_path, text):
    bad = tmp_path / "bad.json"
    bad.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        device_profile(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and "bad.json" in msg


def test_cli_damaged_profile_and_unknown_gpu_are_one_line(tmp_path, workbench_cli):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "workbench.device_profile", "version": 1, "links": 3}')
    for extra, want in ((["--profile", str(bad)], "bad.json"), (["--device", "cuda", "--gpu", "B200"], "H100-SXM")):
        r = subprocess.run([*workbench_cli, "time", "predict", "tiny", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and want in lines[0], r.stderr
    assert all(n in lines[0] for n in SHIPPED)  # the unknown --gpu lists the choices


def test_unknown_gpu_in_python_lists_the_choices():
    from workbench.prediction.step_time import predict_time

    with pytest.raises(ValueError, match="choose one of.*H100-SXM"):
        predict_time("tiny", device="cuda", gpu="B200")
    with pytest.raises(ValueError, match="device='cuda'"):
        predict_time("tiny", gpu="H100-SXM")


# -- predictions ----------------------------------------------------------------------------------

def test_tiny_fsdp_on_two_ranks_overlaps_its_gathers_with_compute():
    """The quick one (`make test`): a prediction's shape, and FSDP's backward prefetch hidden under compute."""
    from workbench.prediction.step_time import predict_time

    tl = predict_time("tiny", dp_shard=2, device="cuda", gpu="H100-SXM")
    m = tl.meta
    assert tl.source == "predicted" and tl.device == "H100-SXM" and m["device_model"]["calibrated"] is False
    assert m["rank_map"] == {"0": 0, "1": 0} and m["bound"]["0"] in ("compute", "communication", "host")
    f = tl.frame
    for _, spans in f.groupby("stream"):
        spans = spans.sort_values("start")
        assert (spans["start"].to_numpy()[1:] >= spans["end"].to_numpy()[:-1] - 1e-12).all()
    gathers = f[(f["name"] == "all_gather") & (f["phase"] == "backward")]
    assert len(gathers) and (gathers["stream"] == "comm").all()
    assert _overlap(gathers, f[f["category"] == "backward"]) > 0
    assert m["step_time_s"] == pytest.approx(tl.step_time()) and m["tokens_per_s"] > 0


LAYOUTS = {
    "dp": dict(dp_replicate=4),
    "fsdp": dict(dp_shard=4),
    "tp": dict(tp=4),
    "tp_sp": dict(dp_shard=2, tp=2, sequence_parallel=True),
    "pp": dict(pp=2, dp_shard=2, pp_schedule="1F1B", microbatches=4),
}
_PREDICTED: dict[str, object] = {}


def _predict(name: str):
    if name not in _PREDICTED:
        from workbench.prediction.step_time import predict_time

        _PREDICTED[name] = predict_time("small", **LAYOUTS[name])
    return _PREDICTED[name]


def _overlap(a, b) -> float:
    """Seconds spans of frame ``a`` overlap spans of frame ``b``."""
    total = 0.0
    for s, e in zip(a["start"], a["end"]):
        inside = b[(b["start"] < e) & (b["end"] > s)]
        total += float(((inside["end"].clip(upper=e)) - (inside["start"].clip(lower=s))).sum())
    return total


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_timeline_is_well_formed(name):
    tl = _predict(name)
    assert tl.source == "predicted" and tl.device == "cpu"
    m = tl.meta
    assert m["device_model"]["name"] == "cpu" and "calibrated" in m["device_model"]
    assert m["layout"] == tl.meta["layout"] and m["world_size"] == 4
    assert set(m["rank_map"]) == {"0", "1", "2", "3"}
    train = m["job"]["train"]
    assert m["tokens_per_s"] == pytest.approx(train["global_batch"] * train["seq_len"] / m["step_time_s"])
    assert m["step_time_s"] == pytest.approx(max(m["step_time_s_by_rank"].values()))
    for r in tl.ranks:
        assert m["bound"][str(r)] in ("compute", "communication", "bubble", "host")
        assert m["flops"][str(r)] > 1e9
        for stream, spans in tl.frame[tl.frame["rank"] == r].groupby("stream"):
            spans = spans.sort_values("start")
            assert (spans["start"].to_numpy()[1:] >= spans["end"].to_numpy()[:-1] - 1e-12).all(), (name, r, stream)
        assert tl.step_time(r) == pytest.approx(m["step_time_s_by_rank"][str(r)], rel=1e-6)
    assert {"forward", "backward", "optimizer"} <= set(tl.frame["category"].astype(str))


def test_fsdp_all_gathers_overlap_compute():
    f = _predict("fsdp").frame
    comm = f[(f["category"] == "communication")]
    gathers = comm[comm["name"] == "all_gather"]
    assert len(gathers) and (gathers["stream"] == "comm").all()
    assert ((comm["name"] == "reduce_scatter") & (comm["stream"] == "comm")).any()
    compute = f[f["category"].isin(["forward", "backward"])]
    assert _overlap(gathers[gathers["phase"] == "backward"], compute) > 0  # backward prefetch hides them


def test_ddp_all_reduce_overlaps_backward():
    f = _predict("dp").frame
    ar = f[(f["category"] == "communication") & (f["name"] == "all_reduce") & (f["phase"] == "backward")]
    assert len(ar) and (ar["stream"] == "comm").all()


@pytest.mark.parametrize("name", ["tp", "tp_sp"])
def test_tp_collectives_are_exposed_on_the_compute_stream(name):
    f = _predict(name).frame
    tp = f[(f["category"] == "communication") & (f["phase"] == "forward") & (f["stream"] == "compute")]
    assert len(tp) >= 8  # at least one per block
    if name == "tp":  # no FSDP: every collective of the step is TP's, and all wait on the compute stream
        comm = f[f["category"] == "communication"]
        assert (comm["stream"] == "compute").all()


def test_pipeline_has_its_bubble():
    tl = _predict("pp")
    f = tl.frame
    stage_of = {r: (0 if r < 2 else 1) for r in tl.ranks}
    assert sorted(stage_of.values()) == [0, 1]
    for r in tl.ranks:
        idle = f[(f["rank"] == r) & (f["category"] == "idle")]
        assert len(idle) and set(idle["name"]) == {"wait:bubble"} and (idle["stream"] == "compute").all()
        assert tl.meta["seconds"][str(r)]["bubble_s"] > 0
    sends = f[(f["name"] == "send") & (f["rank"] == min(tl.ranks))]
    last = f[(f["rank"] == max(tl.ranks)) & (f["category"] == "forward") & (f["microbatch"] == 0)]
    assert len(sends) == 4  # stage 0 sends one activation per microbatch
    assert last["start"].min() >= sends["end"].min() - 1e-12  # stage 1 starts microbatch 0 once stage 0 sent it


def test_comm_bytes_are_the_plans():
    """Bytes one rank sends per step, against the plan's formulas (workbench.plan.comm): equal within 1% where
    the plan counts the calls the trainer makes (FSDP, DDP, TP with sequence parallelism). Where it does not:
    under pp the plan counts FSDP's gathers per microbatch, an upper bound it states (pipelining keeps units
    gathered between microbatches); TP without SP: the plan counts one backward all-reduce per attention / FFN
    input, the trainer's ColwiseParallel makes one per linear (wq, wk, wv; w1, w3), 7 calls per block, not 4."""
    import workbench

    for name in LAYOUTS:
        tl = _predict(name)
        train = tl.meta["job"]["train"]
        plan = workbench.plan("small", global_batch=train["global_batch"], seq_len=train["seq_len"], **LAYOUTS[name])
        planned = plan.comm_bytes_per_step()
        predicted = max(tl.meta["comm_bytes"].values())
        if name == "pp":
            assert planned * 0.5 <= predicted <= planned
        elif name == "tp":
            assert planned * 1.5 <= predicted <= planned * 1.8
        else:
            assert predicted == pytest.approx(planned, rel=0.01), name


def test_fold_predicts_what_the_whole_stage_does():
    """small's 8 blocks simulated as 4 and unrolled: the same FLOPs, bytes on the wire and step time."""
    from workbench.prediction.step_time import predict_time

    full = predict_time("small", fold=False, **LAYOUTS["fsdp"])
    folded = _predict("fsdp")
    assert folded.meta["simulated"]["0"].get("folded")
    assert folded.meta["flops"]["0"] == pytest.approx(full.meta["flops"]["0"], rel=1e-9)
    assert folded.meta["comm_bytes"]["0"] == pytest.approx(full.meta["comm_bytes"]["0"], rel=1e-6)
    assert folded.meta["step_time_s"] == pytest.approx(full.meta["step_time_s"], rel=0.02)
    assert len(folded) == pytest.approx(len(full), rel=0.05)


def test_cli_predicts_tiny_as_json(tmp_path, workbench_cli):
    r = subprocess.run([*workbench_cli, "time", "predict", "tiny", "--dp-shard", "2",
                        "--device", "cuda", "--gpu", "A100-SXM-80GB", "--json", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["status"] == "ok" and doc["device_model"] == {"name": "A100-SXM-80GB", "calibrated": False,
                                                            "source": device_profile("A100-SXM-80GB").source}
    assert doc["step_time_s"] > 0 and math.isfinite(doc["tokens_per_s"])
    from workbench.time.timeline import StepTimeline

    saved = StepTimeline.load(tmp_path / "p")
    assert saved.source == "predicted" and saved.meta["step_time_s"] == pytest.approx(doc["step_time_s"])


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_pipeline_simulated_with_fewer_microbatches_predicts_the_whole_step(schedule):
    """A pipeline of 8 microbatches simulated with fewer (1F1B: pp + 2, GPipe: 3) and unrolled in the schedule's
    order gives the step of simulating all 8: the same operators, bytes, bubble and step time."""
    from workbench.prediction.step_time import predict_time

    kw = dict(pp=2, dp_shard=2, pp_schedule=schedule, microbatches=8, global_batch=16)
    short, full = predict_time("small", **kw), predict_time("small", fold=False, **kw)
    assert short.meta["simulated"]["0"]["microbatches_simulated"] < 8
    for key in ("flops", "comm_bytes"):
        for r, v in full.meta[key].items():
            assert short.meta[key][r] == pytest.approx(v, rel=1e-6), (key, r)
    for r, v in full.meta["step_time_s_by_rank"].items():
        assert short.meta["step_time_s_by_rank"][r] == pytest.approx(v, rel=0.01), r
        assert short.meta["seconds"][r]["bubble_s"] == pytest.approx(full.meta["seconds"][r]["bubble_s"], rel=0.01)
    f = short.frame
    for r in short.ranks:  # every microbatch's forward and backward, in order
        for cat in ("forward", "backward"):
            mbs = f[(f["rank"] == r) & (f["category"] == cat) & (f["microbatch"] >= 0)].sort_values("start")["microbatch"]
            assert sorted(set(mbs)) == list(range(8)) and mbs.is_monotonic_increasing
