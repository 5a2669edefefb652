"""Profiler traces -> step timelines (workbench.time.trace.import_trace), on real traces.

* a real torch.profiler trace of a tiny model (3 profiled steps with a schedule): steps, categories, each
  step's main-thread spans tiling it exactly, all of the optimizer's and data loader's ranges theirs, modules;
  the workbench labels (the trainer's, workbench.time.labels) beat the heuristics; a profile object imports
  without a file;
* a real 2-rank gloo DDP job whose per-rank traces (Kineto's names, gzip; and a run's profile/) import into
  one timeline on one clock, with each collective's payload counted once, in bytes;
* a synthetic GPU-shaped trace: kernels on their streams take their launching op's category and step,
  NCCL kernels are communication, a gap while a collective is in flight is wait:rank;
* max_spans merges spans keeping every category's seconds; hostile files are one-line ValueErrors.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import spawn_ranks  # tests/helpers.py

from workbench.time.timeline import CATEGORIES, StepTimeline
from workbench.time.trace import import_trace

PARAMS = 16 * 32 + 32 + 32 * 4 + 4  # the tiny model's parameters: DDP's one gradient bucket


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _profile_steps(labels: bool = False):
    """5 steps of a tiny model under a schedule that records steps 2, 3 and 4; returns the stopped profile."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    model = _tiny()
    opt = torch.optim.AdamW(model.parameters())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 16), torch.randn(40, 4)),
                                       batch_size=8)
    it = iter(data)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3),
                 record_shapes=True, with_stack=not labels) as prof:
        for _ in range(5):
            x, y = next(it)
            if labels:
                with record_function("workbench.forward#mb1"):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                with record_function("workbench.checkpoint"):
                    torch.ones(64).mul(2)
                with record_function("workbench.data"):  # a label beats the heuristics (a matmul is forward)
                    x @ x.T
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return prof


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.pt.trace.json"
    _profile_steps().export_chrome_trace(str(path))
    return path


def _x(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _check_streams(tl: StepTimeline) -> None:
    """Spans of one stream never overlap; times are finite and ordered."""
    f = tl.frame
    assert np.isfinite(f[["start", "end"]].to_numpy()).all() and (f["end"] >= f["start"]).all()
    for _, g in f.groupby(["rank", "stream"]):
        s = g.sort_values(["start", "end"])
        assert (s["start"].to_numpy()[1:] >= s["end"].to_numpy()[:-1] - 1e-12).all()


def test_a_real_trace_tiles_each_step_by_category(real_trace):
    tl = import_trace(real_trace)
    assert (tl.source, tl.device, tl.ranks, tl.steps) == ("imported", "cpu", [0], [2, 3, 4])
    _check_streams(tl)
    f = tl.frame.assign(d=lambda d: d["end"] - d["start"])
    assert {"forward", "backward", "optimizer", "data", "idle"} <= set(f["category"].astype(str))
    # the profiler's own ranges, read straight from the file
    events = _x(real_trace)
    origin = min(e["ts"] for e in events if e.get("cat") != "Trace")
    steps = {int(e["name"].split("#")[1]): e for e in events if e["name"].startswith("ProfilerStep#")}
    compute = f[f["stream"] == "compute"]
    for n, e in steps.items():
        mine = compute[compute["step"] == n]
        step_s = e["dur"] * 1e-6
        # the main thread's leaves tile the step: no hole, no overlap, nothing outside it
        # (to the trace's own resolution, a nanosecond a timestamp)
        assert mine["d"].sum() == pytest.approx(e["dur"] * 1e-6, abs=1e-8)
        assert mine["start"].min() == pytest.approx((e["ts"] - origin) * 1e-6, abs=1e-9)
        inside = [x for x in events if e["ts"] <= x["ts"] < e["ts"] + e["dur"] and x["tid"] == e["tid"]]
        by = mine.groupby("category", observed=False)["d"].sum()
        # all the time inside the optimizer's and the data loader's ranges is theirs (and a little more: a
        # Python function that returns after its range ends)
        for prefix, cat in (("Optimizer.", "optimizer"), ("enumerate(DataLoader)", "data")):
            ranges = [x for x in inside if x["name"].startswith(prefix)]
            for x in ranges:
                lo, hi = (x["ts"] - origin) * 1e-6, (x["ts"] + x["dur"] - origin) * 1e-6
                overlap = (np.minimum(mine["end"], hi) - np.maximum(mine["start"], lo)).clip(lower=0)
                assert mine.loc[overlap > 1e-9, "category"].eq(cat).all()
                assert overlap.sum() == pytest.approx(x["dur"] * 1e-6, abs=1e-8)
            assert sum(x["dur"] for x in ranges) * 1e-6 - 1e-8 <= by[cat] < step_s
        assert by["forward"] > 0 and by["backward"] > 0
        assert sum(by[c] for c in CATEGORIES) == pytest.approx(e["dur"] * 1e-6, abs=1e-8)
    # backward is autograd's work; gaps with nothing running are the host's; modules are named
    bwd = compute[compute["category"] == "backward"]
    assert bwd["name"].str.contains("Backward|run_backward|AccumulateGrad|evaluate_function|aten::|detach").all()
    assert set(compute.loc[compute["category"] == "idle", "name"]) == {"wait:host"}
    assert {"Linear_0", "Linear_1"} <= set(compute.loc[compute["category"] == "forward", "module"])
    # one summary of it all
    s = tl.summary()
    assert s["steps"] == [2, 3, 4] and s["step_time_s"] > 0


def test_gzip_json_and_profile_objects_read_the_same(real_trace, tmp_path):
    gz = tmp_path / "t.pt.trace.json.gz"
    with open(real_trace, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    assert import_trace(gz).frame.equals(import_trace(real_trace).frame)
    assert import_trace(str(real_trace), ranks=[3]).ranks == [3]  # a trace that names no rank takes the one asked
    prof = _profile_steps()
    tl = import_trace(prof)  # a stopped profile, never written by the caller
    assert tl.steps == [2, 3, 4] and tl.meta["files"] == {"0": "profile"}
    _one_line(import_trace, prof, match="torch exports a profile once")


def test_workbench_labels_beat_the_heuristics():
    tl = import_trace(_profile_steps(labels=True))
    f = tl.frame[tl.frame["stream"] == "compute"]
    assert tl.steps == [2, 3, 4]
    mm = f[f["name"] == "aten::mm"]
    assert (mm.loc[mm["microbatch"] == 1, "category"] == "forward").all()  # the model's matmuls, microbatch 1
    assert (mm.loc[mm["microbatch"] == -1, "category"].astype(str).isin(["data", "backward"])).all()
    assert "data" in set(mm["category"].astype(str))                       # x @ x.T inside workbench.data
    assert set(f.loc[f["name"] == "aten::mul", "category"].astype(str)) >= {"checkpoint"}
    for n in tl.steps:
        assert f[(f["step"] == n) & (f["category"] == "checkpoint")]["end"].sub(
            f["start"]).sum() > 0


def test_the_trainers_labels_are_the_ones_read():
    from workbench.time import labels
    from workbench.time.trace_rules import match

    for name in labels.LABELS:
        assert match(name)[:2] == ("label", name.split(".")[1])
        assert match(f"{name}{labels.MICROBATCH_SEP}3") == ("label", name.split(".")[1], -1, 3, "")
    assert match("ProfilerStep#12")[:3] == ("step", "", 12)
    assert match("aten::mm") is None and match("workbench.forwardish") is None


def test_labelled_steps_without_a_schedule(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    model = _tiny()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for n in (7, 8):
            with record_function(f"workbench.step#{n}"):
                with record_function("workbench.forward"):
                    loss = model(torch.randn(4, 16)).sum()
                with record_function("workbench.backward"):
                    loss.backward()
    tl = import_trace(prof)
    assert tl.steps == [7, 8]
    f = tl.frame
    assert set(f.loc[f["step"] >= 0, "category"].astype(str)) <= {"forward", "backward", "idle"}
    assert set(f.loc[f["name"] == "aten::addmm", "category"].astype(str)) == {"forward"}


def test_max_spans_merges_and_keeps_every_categorys_seconds(real_trace):
    full = import_trace(real_trace)
    for cap in (1000, 400, 60, 5):
        tl = import_trace(real_trace, max_spans=cap)
        _check_streams(tl)
        # no more merged than it takes (down to one span per category and step: 3 steps here)
        assert cap // 2 < len(tl) <= cap if cap >= 400 else len(tl) <= max(cap, len(CATEGORIES) * 3)
        if cap >= 400:  # merged spans keep the name of the operator that took the most time
            assert set(tl.frame["name"]) <= set(full.frame["name"])
        pd_full, pd_cap = full.totals(), tl.totals()
        assert np.allclose(pd_cap.to_numpy(), pd_full.to_numpy(), rtol=1e-9, atol=1e-12), (cap, pd_cap, pd_full)
        per_step = [t.frame.assign(d=t.frame["end"] - t.frame["start"]).groupby(
            ["step", "category"], observed=True)["d"].sum() for t in (full, tl)]
        assert np.allclose(per_step[0].sort_index(), per_step[1].sort_index(), rtol=1e-9, atol=1e-12)
        assert tl.meta["spans_merged"] == len(full) - len(tl)
    with pytest.raises(ValueError, match="max_spans must be a positive int"):
        import_trace(real_trace, max_spans=0)


# -- a real 2-rank gloo job ----------------------------------------------------------------------------------

WORLD = 2


def _ddp_worker(rank: int, out: str, result: str) -> None:
    import torch.distributed as dist
    from torch.profiler import (
        ProfilerActivity,
        profile,
        schedule,
        tensorboard_trace_handler,
    )

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), WORLD), rank=rank,
                                world_size=WORLD)
        model = torch.nn.parallel.DistributedDataParallel(_tiny())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3),
                     record_shapes=True, on_trace_ready=tensorboard_trace_handler(os.path.join(out, "kineto"),
                                                                                  use_gzip=True)) as prof:
            for _ in range(4):
                # a send and a receive in flight across the forward and backward (40 bytes each), as a pipeline's
                buf = torch.empty(10)
                p2p = [dist.isend(torch.ones(10), dst=1 - rank), dist.irecv(buf, src=1 - rank)]
                model(torch.randn(8, 16)).sum().backward()  # DDP all-reduces one bucket of PARAMS floats
                for work in p2p:
                    work.wait()
                t = torch.ones(100)
                dist.all_reduce(t)                           # 400 bytes
                dist.all_gather_into_tensor(torch.empty(100 * WORLD), t)  # gathers 800 bytes
                opt.step()
                opt.zero_grad()
                prof.step()
        dist.barrier()
        dist.destroy_process_group()
        Path(result).write_text(json.dumps({"ok": True}))
    except BaseException:
        Path(result).write_text(json.dumps({"ok": False, "traceback": traceback.format_exc()}))
        raise


@pytest.fixture(scope="module")
def gloo_traces(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    results = [out / f"rank{r}.result" for r in range(WORLD)]
    spawn_ranks(_ddp_worker, lambda r: (r, str(out), str(results[r])), results, 120)
    return out / "kineto"


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_real_two_rank_gloo_job_imports_on_one_clock_with_bytes(gloo_traces, tmp_path):
    files = sorted(gloo_traces.glob("*.pt.trace.json.gz"))
    assert len(files) == WORLD  # Kineto's <host>_<pid>.<n>.pt.trace.json.gz, the rank inside each
    tl = import_trace(gloo_traces)
    assert tl.ranks == [0, 1] and tl.steps == [1, 2, 3] and tl.source == "imported"
    assert tl.meta["distributed"] == {"backend": "gloo", "world_size": 2}
    _check_streams(tl)
    f = tl.frame
    assert f["start"].min() == 0.0  # one origin: the first event of any rank
    firsts = f.groupby("rank")["start"].min()
    assert firsts.max() < 1.0       # the ranks ran side by side, on one clock
    for r in (0, 1):
        mine = f[f["rank"] == r]
        comm = mine[mine["category"] == "communication"]
        assert {"compute", "comm"} <= set(comm["stream"])  # host calls (exposed) and gloo's worker threads
        for n in (1, 2, 3):
            payloads = comm[(comm["step"] == n) & (comm["bytes"] > 0)]
            # each collective counted once, on its host call: the send and receive, DDP's bucket, our all-reduce,
            # our all-gather (and in the first step DDP's broadcasts of its bucket layout)
            want = [40, 40, 400, 4 * 100 * WORLD, 4 * PARAMS]
            got = sorted(payloads["bytes"])
            assert got == want or n == 1 and set(want) <= set(got), got
            assert payloads["stream"].eq("compute").all()
        on_comm = set(comm.loc[comm["stream"] == "comm", "name"])
        assert {"gloo:all_reduce", "gloo:send", "gloo:recv"} <= on_comm  # runs, and the p2p ops' lifetimes
        # the forward ran while the send was in flight: its work is forward, not communication
        assert set(mine.loc[mine["name"] == "aten::addmm", "category"].astype(str)) == {"forward"}
        assert (mine.loc[mine["category"] == "backward", "stream"] == "compute").all()
    assert set(f.loc[f["category"] == "idle", "name"]) <= {"wait:host", "wait:rank"}
    # the same files as a list, as a run's profile/, and one rank of them
    assert import_trace(files).frame.equals(f)
    run = tmp_path / "run"
    (run / "profile").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    for p in files:
        rank = json.loads(gzip.decompress(p.read_bytes()))["distributedInfo"]["rank"]
        shutil.copy(p, run / "profile" / f"rank{rank}.pt.trace.json.gz")
    measured = import_trace(run)
    assert measured.source == "measured" and measured.frame.equals(f)
    assert import_trace(run / "profile").source == "measured"
    one = import_trace(run, ranks=[1])
    assert one.ranks == [1] and list(one.meta["files"]) == ["1"]
    with pytest.raises(ValueError, match="none of ranks"):
        import_trace(gloo_traces, ranks=[5])
    shutil.copy(files[0], gloo_traces / "copy.pt.trace.json.gz")
    try:
        with pytest.raises(ValueError, match="both hold rank"):
            import_trace(gloo_traces)
    finally:
        (gloo_traces / "copy.pt.trace.json.gz").unlink()


# -- a GPU-shaped trace (no GPU here): kernels, their launches, NCCL ------------------------------------------

def _gpu_trace(rank: int = 0, base_ns: int = 1_000_000_000) -> dict:
    host = dict(ph="X", pid=100, tid=100)

    def op(name, ts, dur, cat="cpu_op", **args):
        return {**host, "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    def launch(ts, corr, ext):
        return op("cudaLaunchKernel", ts, 5, "cuda_runtime", correlation=corr, **{"External id": ext})

    def kernel(name, ts, dur, corr, stream=7, **args):
        return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"correlation": corr, "stream": stream, "device": 0, **args}}

    events = [
        op("ProfilerStep#5", 1000, 1000, "user_annotation"),
        op("aten::addmm", 1100, 200, **{"External id": 10}), launch(1150, 77, 10),
        op("autograd::engine::evaluate_function: AddmmBackward0", 1400, 320),  # DDP's hook all-reduces inside
        op("aten::mm", 1450, 100, **{"External id": 11}), launch(1500, 78, 11),
        op("record_param_comms", 1650, 50, **{"External id": 12, "In msg nelems": 1024, "Out msg nelems": 1024,
                                               "dtype": "BFloat16", "Collective name": "allreduce"}),
        launch(1660, 79, 12),
        op("nccl:all_reduce", 1670, 240, "user_annotation"),  # the collective's lifetime, issue to completion
        op("Optimizer.step#AdamW.step", 1800, 150, "user_annotation"),
        op("aten::_foreach_add_", 1810, 100, **{"External id": 13}), launch(1820, 80, 13),
        kernel("ampere_sgemm_128x64_tn", 1200, 300, 77),
        kernel("void at::native::gemm_kernel", 1520, 120, 78),
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 1700, 200, 79, stream=13,
               **{"In msg nelems": 1024, "dtype": "BFloat16"}),
        kernel("multi_tensor_apply_kernel", 1990, 110, 80),  # runs past the step's end: still its step
        {"ph": "M", "name": "thread_name", "pid": 100, "tid": 100, "args": {"name": "thread 100 (python)"}},
    ]
    return {"traceEvents": events, "baseTimeNanoseconds": base_ns,
            "distributedInfo": {"rank": rank, "world_size": 2, "backend": "nccl"}}


def test_a_gpu_shaped_trace_puts_kernels_on_their_streams(tmp_path):
    """Kernels take the category and step of the host op that launched them (found by ``correlation``), NCCL
    kernels are communication, and ranks line up by ``baseTimeNanoseconds``."""
    (tmp_path / "a.pt.trace.json").write_text(json.dumps(_gpu_trace(0)))
    (tmp_path / "b.pt.trace.json").write_text(json.dumps(_gpu_trace(1, base_ns=1_000_500_000)))  # +500 us
    tl = import_trace(tmp_path)
    assert tl.device == "cuda" and tl.ranks == [0, 1] and tl.steps == [5]
    _check_streams(tl)
    f = tl.frame
    r0 = f[f["rank"] == 0].set_index("name")
    assert r0.loc["ampere_sgemm_128x64_tn", ["category", "stream", "step"]].tolist() == ["forward", "cuda:7", 5]
    assert r0.loc["void at::native::gemm_kernel", "category"] == "backward"
    assert r0.loc["multi_tensor_apply_kernel", ["category", "step"]].tolist() == ["optimizer", 5]
    nccl = r0.loc["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert nccl[["category", "stream", "bytes"]].tolist() == ["communication", "cuda:13", 0]  # counted on the host
    host = f[(f["rank"] == 0) & (f["name"] == "record_param_comms")]  # (in two pieces: a launch inside)
    assert host[["category", "phase", "stream"]].astype(str).drop_duplicates().values.tolist() == [
        ["communication", "backward", "compute"]]
    assert host["bytes"].tolist() == [2048, 0]  # the call's payload, once: 1024 bf16
    idle = f[(f["rank"] == 0) & (f["category"] == "idle")]
    # the gap while the all-reduce runs on the GPU is a wait for the other rank; the others the host's
    assert idle.loc[idle["name"] == "wait:rank", "end"].sub(idle["start"]).sum() == pytest.approx(80e-6)
    assert "wait:host" in set(idle["name"])
    # the backend's range is the collective in flight: on the comm stream, never around the optimizer's work
    assert r0.loc["nccl:all_reduce", ["category", "stream", "bytes"]].tolist() == ["communication", "comm", 0]
    assert set(map(tuple, r0.loc[["aten::_foreach_add_"], ["category", "stream"]].astype(str).values)) == {
        ("optimizer", "compute")}
    # rank 1 started 500 us later on the same clock
    first = f.groupby("rank")["start"].min()
    assert first[0] == 0.0 and first[1] == pytest.approx(500e-6)
    # without host calls, the kernel carries the payload
    doc = _gpu_trace(0)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e["name"] != "record_param_comms"]
    (tmp_path / "c.json").write_text(json.dumps(doc))
    k = import_trace(tmp_path / "c.json").frame
    assert k.loc[k["name"].str.startswith("ncclDevKernel"), "bytes"].tolist() == [2048]
    assert k["bytes"].sum() == 2048  # once


# -- hostile files: one line each ----------------------------------------------------------------------------

def _one_line(fn, *args, match: str = "", **kw) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600 and match in msg, msg
    return msg


def test_hostile_files_are_one_line_each(tmp_path, real_trace):
    good = json.loads(real_trace.read_text())
    bomb = tmp_path / "bomb.json.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as g:  # 64 MiB of JSON in ~64 KiB
        g.write(b'{"traceEvents": [')
        for _ in range(64):
            g.write(b" " * (1 << 20))
        g.write(b"]}")
    _one_line(import_trace, bomb, match="inflates to more than")
    deep = tmp_path / "deep.json"
    deep.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _one_line(import_trace, deep, match="not readable JSON")
    huge = tmp_path / "huge.json"
    huge.write_text('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1' + "0" * 5000 + ', "dur": 1}]}')
    _one_line(import_trace, huge, match="not readable JSON")
    for ts, dur in ((1e300, 1), (0, 1e200), ("0", 1), (0, [1]), (True, 1), (0, float("nan"))):
        doc = {"traceEvents": [{"ph": "X", "name": "a", "ts": ts, "dur": dur}]}
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        _one_line(import_trace, bad, match="not a time in microseconds")
    truncated = tmp_path / "trunc.json.gz"
    truncated.write_bytes(gzip.compress(real_trace.read_bytes())[:2000])
    _one_line(import_trace, truncated, match="damaged gzip")
    cut = tmp_path / "cut.json"
    cut.write_bytes(real_trace.read_bytes()[:3000])
    _one_line(import_trace, cut, match="not readable JSON")
    for doc, what in (([1, 2], "no 'traceEvents'"), ({"traceEvents": {}}, "no 'traceEvents'"),
                      ({**good, "distributedInfo": {"rank": "0"}}, "distributedInfo.rank")):
        wrong = tmp_path / "wrong.json"
        wrong.write_text(json.dumps(doc))
        _one_line(import_trace, wrong, match=what)
    # wrong types inside events are ignored, not fatal: a name, args or pid that is a list
    odd = {"traceEvents": [{"ph": "X", "name": ["x"], "ts": 0, "dur": 5, "args": [1], "pid": [1], "tid": {}},
                           7, None, {"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 10, "pid": 1, "tid": 1}]}
    (tmp_path / "odd.json").write_text(json.dumps(odd))
    assert import_trace(tmp_path / "odd.json").steps == [1]
    # a FIFO, a directory with a FIFO and a link leading out of it, a missing file, a wrong source
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _one_line(import_trace, fifo, match="FIFO")
    d = tmp_path / "profile"
    d.mkdir()
    os.mkfifo(d / "rank0.pt.trace.json")
    _one_line(import_trace, d, match="FIFO")
    (d / "rank0.pt.trace.json").unlink()
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(real_trace, outside / "secret.json")
    (d / "rank1.pt.trace.json").symlink_to(outside / "secret.json")
    _one_line(import_trace, d, match="leads outside")
    (d / "rank1.pt.trace.json").unlink()
    _one_line(import_trace, d, match="holds no profiler traces")
    (tmp_path / "link_run").mkdir()
    (tmp_path / "link_run" / "profile").symlink_to(outside)  # a run whose profile/ is a link elsewhere
    shutil.copy(real_trace, outside / "rank0.pt.trace.json")
    _one_line(import_trace, tmp_path / "link_run", match="leads outside")
    _one_line(import_trace, tmp_path / "missing.json", match="no such file")
    _one_line(import_trace, 42, match="cannot import a trace from a int")
    _one_line(import_trace, [], match="no trace files")
    _one_line(import_trace, real_trace, ranks=["0"], match="ranks must be")
