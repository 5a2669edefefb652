"""Measured and predicted memory timelines of real jobs, and the `workbench memory` commands.

A real 2-rank run records with ``memory=True``; the predictor runs the same job on fake tensors; the
peaks agree. Byte counts that can be worked out by hand are checked exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import workbench
import workbench.memory as memory
from workbench.config import PRESETS
from workbench.memory.timeline import CATEGORIES, MemoryTimeline
from workbench.train.events import read_events

SHAPE = dict(steps=3, global_batch=8, seq_len=64)
TINY = PRESETS["tiny"]


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mem") / "fsdp"
    run = workbench.launch("tiny", out=out, dp_shard=2, memory=True, **SHAPE)
    run.wait(timeout=300)
    return run


@pytest.mark.multirank
def test_a_recorded_run_matches_its_prediction(fsdp_run):
    measured = memory.load(fsdp_run.run_dir)
    assert measured.ranks == [0, 1] and measured.source == "measured"
    assert measured.steps == [0, 1, 2]
    # every rank wrote a per-step memory event, whose peaks the timeline contains
    mem_events = [e for e in read_events(fsdp_run.run_dir) if e["type"] == "memory"]
    assert {(e["rank"], e["step"]) for e in mem_events} == {(r, s) for r in (0, 1) for s in range(3)}
    assert max(e["peak_bytes"] for e in mem_events if e["rank"] == 0) == measured.peak(0).bytes
    phases = set(measured.frame["phase"].astype(str))
    assert {"build", "forward", "backward", "optimizer"} <= phases
    predicted = memory.predict(fsdp_run.job, progress=False)
    result = memory.compare(measured, predicted)
    assert result.summary()["max_abs_error"] <= 0.02, result.to_frame()
    # the FSDP2 rank holds half the parameters and half of AdamW's state: exactly (hand count)
    n, buffers, tensors = TINY.n_params, 2 * TINY.max_seq_len * (TINY.head_dim // 2), 48
    peak = measured.peak(0).by_category
    assert peak["optimizer"] == 2 * (n // 2) * 4 + tensors * 4  # exp_avg, exp_avg_sq shards; a step counter each
    assert peak["parameter"] >= (n // 2 + buffers) * 4


@pytest.mark.multirank
def test_memory_cli_show_and_compare_a_run(fsdp_run):
    proc = _cli("memory", "show", str(fsdp_run.run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["source"] == "measured" and doc["ranks"] == [0, 1]
    assert doc["alive_at_peak"]["0"][0]["bytes"] > 0
    proc = _cli("memory", "compare", str(fsdp_run.run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["max_abs_error"] <= 0.02 and len(doc["ranks"]) == 2
    text = _cli("memory", "show", str(fsdp_run.run_dir), "--rank", "1")
    assert text.returncode == 0 and "largest allocations alive at the peak" in text.stdout


@pytest.mark.multirank
def test_checkpoint_staging_is_its_own_category(tmp_path):
    run = workbench.launch("tiny", out=tmp_path / "ckpt", nproc=1, memory=True, ckpt_every=1, ckpt_async=True,
                           **SHAPE)
    run.wait(timeout=300)
    tl = memory.load(run.run_dir)
    staged = tl.frame[(tl.frame["category"] == "checkpoint") & (tl.frame["delta_bytes"] > 0)]
    assert set(staged["phase"].astype(str)) == {"checkpoint"}
    # the host copy holds at least the model's float32 weights
    assert staged["delta_bytes"].sum() >= TINY.n_params * 4


def test_ddp_buckets_are_communication_buffers_of_the_whole_model():
    tl = memory.predict("tiny", dp_replicate=2, dp_shard=1, train=dict(SHAPE), progress=False)
    peak = tl.peak(0).by_category
    assert peak["communication"] == TINY.n_params * 4  # DDP's flat buckets: one float32 copy of every gradient
    assert peak["optimizer"] == 2 * TINY.n_params * 4 + 48 * 4


def test_predict_covers_every_rank_of_a_pipeline_and_knows_the_schedules():
    gpipe = memory.predict("tiny", pp=2, dp_shard=1, microbatches=8, pp_schedule="GPipe",
                           train=dict(global_batch=8, seq_len=128, steps=2), progress=False)
    f1b = memory.predict("tiny", pp=2, dp_shard=1, microbatches=8, pp_schedule="1F1B",
                         train=dict(global_batch=8, seq_len=128, steps=2), progress=False)
    assert list(memory.peak_per_rank(gpipe).index) == [0, 1]
    assert memory.peak_per_rank(f1b)[0] < memory.peak_per_rank(gpipe)[0]
    exact = memory.predict("tiny", pp=2, dp_shard=1, microbatches=8, pp_schedule="1F1B", exact=True,
                           train=dict(global_batch=8, seq_len=128, steps=2), progress=False)
    # the shortened step reaches the same peak as every microbatch of two steps (token ids aside)
    assert abs(memory.peak_per_rank(exact)[0] - memory.peak_per_rank(f1b)[0]) < 64 * 1024
    mbs = set(exact.frame["microbatch"].tolist())
    assert set(range(8)) <= mbs


def test_activation_checkpointing_shrinks_predicted_activations():
    act = {}
    for ac in ("none", "selective", "full"):
        tl = memory.predict("tiny", nproc=1, activation_checkpointing=ac,
                            train=dict(global_batch=4, seq_len=128, steps=2), progress=False)
        act[ac] = tl.peak(0).by_category["activation"]
    assert act["full"] < act["selective"] < act["none"]


def test_cuda_predictions_round_blocks_like_the_caching_allocator():
    tl = memory.predict("tiny", nproc=1, device="cuda", train=dict(SHAPE), progress=False)
    assert tl.device == "cuda"
    sizes = tl.frame["delta_bytes"].abs()
    assert (sizes % 512 == 0).all()
    assert tl.peak(0).bytes >= memory.predict("tiny", nproc=1, train=dict(SHAPE), progress=False).peak(0).bytes


def test_fits_finds_the_largest_micro_batch():
    answer = memory.fits("tiny", "64MiB", nproc=1, train=dict(global_batch=16, seq_len=128, steps=2))
    assert answer.micro_batch is not None
    assert answer.peak_at_micro_batch <= 64 * 2**20
    bigger = [m for m, peak in answer.tried.items() if m > answer.micro_batch]
    assert all(answer.tried[m] > 64 * 2**20 for m in bigger)
    assert "largest micro batch that fits" in str(answer)
    with pytest.raises(ValueError, match="80GiB"):
        memory.fits("tiny", "eighty gigs", nproc=1)


def test_memory_cli_predict_and_import(tmp_path):
    proc = _cli("memory", "predict", "tiny", "--tp", "2", "--dp-shard", "1", "--steps", "2", "--budget", "1GiB",
                "--out", str(tmp_path / "pred"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc["peak_bytes_per_rank"]) == {"0", "1"} and doc["fit"]["fits"] is True
    saved = MemoryTimeline.load(tmp_path / "pred")
    assert saved.source == "predicted" and saved.peak(0).bytes == doc["max_peak_bytes"]
    from workbench.memory.snapshot import write_synthetic_snapshot

    truth = write_synthetic_snapshot(tmp_path / "snapshot_rank0.pickle", 2**20)
    proc = _cli("memory", "import", str(tmp_path / "snapshot_rank0.pickle"), "--out", str(tmp_path / "imp"), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["source"] == "snapshot" and doc["peaks"][0]["peak_bytes"] == truth["peak_bytes"]
    bad = tmp_path / "hostile.pickle"
    bad.write_bytes(b"cos\nsystem\n(S'touch /tmp/pwned-by-test'\ntR.")
    proc = _cli("memory", "import", str(bad))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "refusing" in proc.stderr
    proc = _cli("memory", "show", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2 and proc.stderr.startswith("error:")
    assert set(CATEGORIES) >= set(saved.frame["category"].astype(str))


@pytest.mark.multirank
def test_a_crashed_rank_keeps_the_timeline_it_recorded(tmp_path):
    run = workbench.launch("tiny", out=tmp_path / "crash", nproc=1, memory=True, fail_at={"rank": 0, "step": 2},
                           **SHAPE)
    run.wait(timeout=300, raise_on_error=False)
    assert run.status == "failed"
    tl = memory.load(run.run_dir)
    assert tl.steps == [0, 1]  # everything up to the failure, nothing after
    assert tl.peak(0).by_category["optimizer"] > 0


def test_cuda_predictions_count_cublas_workspaces(monkeypatch):
    # On an H200 the measured max_memory_allocated of seven configs stood 64-74 MiB above the tensors'
    # predicted peak: two 32 MiB cuBLAS workspaces (gpu/check.py's memory part).
    from workbench.prediction.memory import cublas_workspace_bytes, predict

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes((9, 0)) == 64 << 20 and cublas_workspace_bytes((10, 0)) == 64 << 20
    assert cublas_workspace_bytes((8, 0)) == 2 * ((8 << 20) + (128 << 10))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # torch's documented deterministic setting
    assert cublas_workspace_bytes((9, 0)) == 2 * ((8 << 20) + (128 << 10))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "nonsense")  # not torch's form: the default for the GPU
    assert cublas_workspace_bytes((9, 0)) == 64 << 20
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")

    kw = dict(nproc=1, global_batch=2, seq_len=64, progress=False)
    cpu, cuda = predict("tiny", device="cpu", **kw), predict("tiny", device="cuda", **kw)
    assert cuda.meta["library_bytes"] == {"cuBLAS workspaces": 64 << 20} and "library_bytes" not in cpu.meta
    f = cuda.frame
    block = f[f["op"] == "cuBLAS workspaces"]
    assert len(block) == 1 and int(block["delta_bytes"].iloc[0]) == 64 << 20
    first_forward = f.index[f["phase"] == "forward"][0]
    assert block.index[0] == first_forward and block["category"].iloc[0] == "other"
    assert cuda.peak(0).bytes - cpu.peak(0).bytes >= 64 << 20
