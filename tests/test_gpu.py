"""The CUDA paths, on a machine with a GPU (`make test-gpu`; skipped elsewhere with the reason).

NCCL training on one rank, the fast trainer (fused AdamW, TF32, --compile, MFU), async checkpoints
staged through pinned host buffers and a bitwise resume on CUDA, CUDA memory events and snapshots,
the device preflight against the real GPU count, our Triton kernels compiled for the GPU, and the GPU
benchmarks' smoke runs. Every job has a hard timeout, so a hang fails in minutes, not at a CI limit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import workbench
from workbench.train.events import read_events

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TIMEOUT_S = 400


def _events(run, kind, rank=0):
    return [e for e in read_events(run.run_dir) if e["type"] == kind and e["rank"] == rank]


def test_one_rank_trains_on_cuda_with_nccl_and_reports_mfu(tmp_path):
    run = workbench.launch("tiny", out=tmp_path / "r", nproc=1, steps=6, device="cuda").wait(TIMEOUT_S)
    start = _events(run, "start")[0]
    assert start["device"] == "cuda:0" and start["backend"] == "nccl"
    assert start["optim_impl"] == "fused" and start["precision"] == "tf32"
    assert run.job.device == "cuda"
    steps = _events(run, "step")
    assert len(steps) == 6 and steps[-1]["loss"] < steps[0]["loss"]
    assert all(s["mem_bytes"] > 0 for s in steps)  # torch.cuda.max_memory_allocated
    assert all(s["mem_reserved_bytes"] >= s["mem_bytes"] for s in steps)  # max_memory_reserved (the GPU check's grid)
    if start["peak_flops_per_s"] is not None:  # a GPU in workbench.train.flops' table
        assert all(0 < s["mfu"] < 1 for s in steps[1:])
    summary = run.summary()
    assert summary["status"] == "succeeded"


def test_compiled_bf16_trainer_matches_eager_on_cuda(tmp_path):
    kw = dict(nproc=1, steps=5, seed=7, device="cuda", mixed_precision="bf16")
    eager = workbench.launch("tiny", out=tmp_path / "eager", **kw).wait(TIMEOUT_S)
    compiled = workbench.launch("tiny", out=tmp_path / "compiled", compile=True, **kw).wait(TIMEOUT_S)
    assert _events(compiled, "start")[0]["compiled_blocks"] == 5
    a, b = eager.losses(), compiled.losses()
    assert len(a) == len(b) == 5
    # bf16 compute: inductor fuses differently, so the losses agree to bf16's precision, not bitwise
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2, (a, b)


def test_more_ranks_than_gpus_is_refused_before_anything_starts(tmp_path):
    import torch

    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=rf"--nproc {n} needs {n} GPUs, this machine has {n - 1}"):
        workbench.launch("tiny", out=tmp_path / "r", nproc=n, dp_shard=n)
    assert not (tmp_path / "r").exists()
    # --device cpu runs the same layout as gloo ranks on the GPU machine
    run = workbench.launch("tiny", out=tmp_path / "cpu", nproc=2, tp=2, steps=2, device="cpu").wait(TIMEOUT_S)
    start = _events(run, "start")[0]
    assert start["device"] == "cpu" and start["backend"] == "gloo"


def test_async_checkpoint_with_pinned_staging_resumes_bitwise_on_cuda(tmp_path):
    kw = dict(nproc=1, seed=7, device="cuda", ckpt_every=3, ckpt_async=True)
    whole = workbench.launch("tiny", out=tmp_path / "whole", steps=6, **kw).wait(TIMEOUT_S)
    first = workbench.launch("tiny", out=tmp_path / "first", steps=3, **kw).wait(TIMEOUT_S)
    resumed = workbench.launch("tiny", out=tmp_path / "resumed", steps=6, resume=str(first.run_dir / "checkpoints"),
                               **kw).wait(TIMEOUT_S)
    assert _events(resumed, "resume")[0]["step"] == 3
    assert resumed.losses() == whole.losses()[3:]  # bitwise: CUDA RNG and optimizer state came back
    saves = [e for e in read_events(whole.run_dir) if e["type"] == "checkpoint"]
    assert saves, "no checkpoint events"


def test_memory_events_and_cuda_snapshot(tmp_path, workbench_cli):
    run = workbench.launch("tiny", out=tmp_path / "m", nproc=1, steps=3, device="cuda", memory=True).wait(TIMEOUT_S)
    mem = _events(run, "memory")
    assert len(mem) == 3 and all(e["peak_bytes"] > 0 for e in mem)
    snap = run.run_dir / "memory" / "rank0.cuda_snapshot.pickle"
    assert snap.exists()
    p = subprocess.run([*workbench_cli, "memory", "import", str(snap), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([*workbench_cli, "memory", "compare", str(run.run_dir), "--json"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    print("memory compare on CUDA:", p.stdout[:2000])  # the predicted-vs-measured figures, for the record


def test_triton_kernels_pass_their_checks_on_the_gpu(workbench_cli):
    p = subprocess.run([*workbench_cli, "kernels", "check", "--json"], capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and doc["rows"]
    assert all(r["backend_ran"].startswith("triton") and "interpreter" not in r["backend_ran"]
               for r in doc["rows"] if r["backend_ran"].startswith("triton"))


@pytest.mark.parametrize("script, args", [
    ("bench_gpu_train.py", ["--smoke"]),
    ("bench_kernels.py", ["--quick"]),
])
def test_gpu_benchmarks_smoke(repo, script, args):
    p = subprocess.run([sys.executable, str(repo / "benchmarks" / script), *args], capture_output=True, text=True,
                       timeout=540, cwd=repo)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert not doc.get("skipped"), doc
    print(script, json.dumps(doc)[:3000])
