"""The GPU path, as far as a CPU machine can check it: the device preflight, AdamW's implementations,
per-block compilation and TF32. (What needs a GPU is in test_gpu.py, run by ``make test-gpu``.)"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

import workbench
from workbench.config import PRESETS, ParallelConfig, TrainConfig
from workbench.parallel.apply import build_optimizer, layout_groups, optimizer_impl, optimizer_impl_of
from workbench.parallel.build import build_stages
from workbench.parallel.compile import compiled_blocks
from workbench.train.launcher import build_job, resolve_device

# -- the preflight ---------------------------------------------------------------------------------


def test_auto_is_cuda_with_a_gpu_per_rank_and_cpu_without_any(monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEVICE", raising=False)
    assert resolve_device("auto", 1, gpus=0) == "cpu"
    assert resolve_device("auto", 4, gpus=0) == "cpu"
    assert resolve_device("auto", 2, gpus=2) == "cuda"
    assert resolve_device("auto", 1, gpus=8) == "cuda"
    assert resolve_device("cuda", 2, gpus=8) == "cuda"
    assert resolve_device("cpu", 16, gpus=8) == "cpu"  # gloo ranks on a GPU machine
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert resolve_device("auto", 2, gpus=8) == "cpu"


@pytest.mark.parametrize("choice", ["auto", "cuda"])
def test_more_ranks_than_gpus_is_one_line_naming_both_numbers_and_the_fixes(choice):
    with pytest.raises(ValueError) as e:
        resolve_device(choice, 2, gpus=1)
    assert str(e.value) == ("--nproc 2 needs 2 GPUs, this machine has 1; use --nproc 1, or --device cpu to run "
                            "2 ranks on CPU (gloo)")
    with pytest.raises(ValueError, match=r"--nproc 8 needs 8 GPUs, this machine has 4; use --nproc 4"):
        resolve_device(choice, 8, gpus=4)


def test_cuda_without_a_gpu_says_so_and_names_the_fix():
    with pytest.raises(ValueError) as e:
        resolve_device("cuda", 1, gpus=0)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--device cuda needs a GPU, but ")
    assert msg.endswith("use --device cpu to run on CPU (gloo)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_build_job_records_the_device_and_refuses_cuda_here():
    job = build_job("tiny", nproc=2, tp=2)
    assert job.device == "cpu" and job.to_dict()["device"] == "cpu"
    assert build_job("tiny", nproc=2, tp=2, device="cpu").device == "cpu"
    with pytest.raises(ValueError, match="--device cuda needs a GPU"):
        build_job("tiny", nproc=2, tp=2, device="cuda")


def test_nodes_split_the_world_evenly():
    job = build_job("tiny", nproc=1, nnodes=2, tp=2)
    assert job.parallel.world_size == 2
    with pytest.raises(ValueError, match=r"has 2 ranks, which 3 nodes cannot share equally"):
        build_job("tiny", nnodes=3, tp=2)
    with pytest.raises(ValueError, match="nnodes=0 must be a positive integer"):
        build_job("tiny", nnodes=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_cli_refuses_cuda_here_in_one_line_before_anything_starts(workbench_cli, tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([*workbench_cli, "train", "tiny", "--device", "cuda", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and p.stderr.startswith("error: --device cuda needs a GPU")
    assert "Traceback" not in p.stderr and not out.exists()


# -- AdamW's implementations -------------------------------------------------------------------------


def _train_steps(impl: str, steps: int = 3) -> list[torch.Tensor]:
    cfg = PRESETS["tiny"]
    tcfg = TrainConfig(optim_impl=impl, lr=1e-2)
    stages = build_stages(cfg, ParallelConfig(dp_shard=1), tcfg, None, "cpu")
    model = stages.model
    opt = build_optimizer(model, ParallelConfig(dp_shard=1), None, tcfg)
    assert optimizer_impl_of(opt) == ("loop" if impl == "auto" else impl)  # auto on CPU: the loop
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_fused_and_foreach_adamw_match_the_loop():
    """foreach does the loop's arithmetic in the same order: bit-identical. The fused kernel orders its
    arithmetic otherwise, and Adam's g/sqrt(v) amplifies those roundings where gradients are tiny: after
    3 steps at lr 1e-2, measured on 2026-11-23 (CPU, torch 2.13), 52 of 1,049,984 weights differ by more
    than 1e-6, the worst by 8.1e-6 (an update is ~1e-2)."""
    loop = _train_steps("loop")
    assert all(torch.equal(a, b) for a, b in zip(loop, _train_steps("foreach")))
    fused = _train_steps("fused")
    worst = max(float((a - b).abs().max()) for a, b in zip(loop, fused))
    off = sum(int(((a - b).abs() > 1e-6).sum()) for a, b in zip(loop, fused))
    assert worst <= 5e-5 and off <= 1e-3 * sum(p.numel() for p in loop), (worst, off)
    assert all(torch.equal(a, b) for a, b in zip(loop, _train_steps("auto")))


def test_auto_is_fused_on_cuda_tensors_and_the_loop_elsewhere():
    assert optimizer_impl("auto", [torch.zeros(2)]) == "loop"
    assert optimizer_impl("auto", [torch.zeros(2, device="meta")]) == "loop"
    with torch._subclasses.FakeTensorMode():  # a CUDA tensor without a GPU
        p = torch.empty(2, device="cuda")
    assert optimizer_impl("auto", [p]) == "fused"
    with pytest.raises(ValueError, match="optim_impl='fast'; choose one of auto, fused, foreach, loop"):
        optimizer_impl("fast", [p])


@pytest.mark.parametrize("layout, groups", [(dict(tp=2), 2), (dict(dp_shard=2, tp=2), 2), (dict(dp_shard=2), 1)])
def test_fused_adamw_takes_one_param_group_per_layout(layout, groups):
    """Fused and foreach kernels take tensors of one kind: tensor parallelism's plain norm weights
    and its DTensors go into separate groups, FSDP x TP's 1-D and 2-D meshes too."""
    from workbench.prediction.fake import fake_rank

    pcfg = ParallelConfig(**layout).resolved()
    tcfg = TrainConfig(optim_impl="fused")
    with fake_rank(pcfg.world_size, 0, "cpu", pcfg) as fr:
        stages = build_stages(PRESETS["tiny"], pcfg, tcfg, fr.mesh, "meta")
        params = list(stages.model.parameters())
        opt = build_optimizer(stages.model, pcfg, fr.mesh, tcfg)
        assert len(layout_groups(params)) == groups
        assert len(opt.param_groups) == groups
        assert sum(len(g["params"]) for g in opt.param_groups) == len(params)
        assert {g["lr"] for g in opt.param_groups} == {tcfg.lr} and optimizer_impl_of(opt) == "fused"


# -- compile and TF32 ------------------------------------------------------------------------------


def test_compiled_blocks_keep_names_and_match_eager():
    cfg = PRESETS["tiny"]
    eager = build_stages(cfg, ParallelConfig(dp_shard=1), TrainConfig(), None, "cpu").model
    compiled = build_stages(cfg, ParallelConfig(dp_shard=1), TrainConfig(compile=True), None, "cpu").model
    assert compiled_blocks(compiled) == cfg.n_layers and compiled_blocks(eager) == 0
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = eager(x), compiled(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_plans_and_predictions_build_eager_under_compile():
    """A plan (meta) or a memory prediction (fake tensors) never compiles: compile is the trainer's."""
    stages = build_stages(PRESETS["tiny"], ParallelConfig(dp_shard=1), TrainConfig(compile=True), None, "meta")
    assert compiled_blocks(stages.model) == 0


def test_tf32_switch_round_trips():
    from workbench.parallel.precision import set_tf32, tf32_enabled

    before = tf32_enabled()
    try:
        set_tf32(True)
        assert tf32_enabled()
        set_tf32(False)
        assert not tf32_enabled()
    finally:
        set_tf32(before)


def test_launch_api_refuses_cuda_in_one_line_here(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    with pytest.raises(ValueError, match="--device cuda needs a GPU"):
        workbench.launch("tiny", out=tmp_path / "r", device="cuda")
    assert not (tmp_path / "r").exists()


def test_dashboard_has_a_device_control_and_shows_the_preflight_line():
    if torch.cuda.is_available():
        pytest.skip("checks a machine without a GPU")
    from workbench.widgets.dashboard import RunDashboard

    dash = RunDashboard("tiny", nproc=2, tp=2)
    assert dash.controls["device"].value == "auto"
    dash.controls["device"].value = "cuda"
    assert dash.launch() is None and dash.runs == []
    assert "--device cuda needs a GPU" in dash.error_panel.value
    assert "not launched: invalid configuration" in dash.status.value


def test_memory_floor_counts_only_this_machines_ranks():
    """Of 2 nodes each machine runs half the ranks: a budget that 2 local ranks overflow fits 1."""
    from workbench.train.launcher import memory_shortfall, training_state_bytes

    job = build_job("small", nproc=1, nnodes=2, dp_replicate=2, device="cpu")  # 2 ranks, each holding all
    both = training_state_bytes(job)
    budget = int(both * 0.75 / 0.9)  # room for one rank's state, not two
    assert "on 2 local rank(s)" in memory_shortfall(job, available=budget, nnodes=1)
    assert memory_shortfall(job, available=budget, nnodes=2) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_make_test_gpu_runs_the_gpu_tests_which_skip_here_with_the_reason(repo):
    import sys

    dry = subprocess.run(["make", "-n", "test-gpu"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "-m pytest -m gpu" in dry.stdout
    p = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_gpu.py"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:]
    import re

    assert re.search(r"\b\d+ skipped", p.stdout) and "needs a CUDA GPU" in p.stdout and "passed" not in p.stdout


def test_cpu_jobs_hide_the_gpus_from_their_ranks():
    # CPU ranks fork from torchrun's agent: on a GPU machine a fork after anything touched the CUDA driver
    # failed at the first optimizer step ("CUDA error: initialization error", seen on an H200).
    from workbench.train.launcher import agent_env

    cpu = build_job("tiny", nproc=2, tp=2, device="cpu")
    env = agent_env(cpu, base={"CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/elsewhere"})
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"].endswith(os.pathsep + "/elsewhere") and env["PYTHONUNBUFFERED"] == "1"
    import dataclasses

    cuda = dataclasses.replace(cpu, device="cuda")  # build_job refuses cuda here: the recorded field decides
    assert agent_env(cuda, base={"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == "0"
