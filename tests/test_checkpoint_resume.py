"""Resume with real torchrun jobs (gloo, 2 ranks): bitwise exactness, SIGKILL mid-save, layout changes.

The bar: 2K steps uninterrupted give bitwise the same losses as K steps + save + resume in a fresh job
+ K steps, for a tp=2 layout and an fsdp (dp_shard=2, async save) layout. The uninterrupted job itself
publishes step K, so it also shows that saving does not perturb training. Checkpoints saved under
tp=2, pp=2 and ep=2 load into other layouts (dp_shard=2, one process). A 2-rank job is SIGKILLed while it writes
async checkpoints every step; ``latest`` must name a complete checkpoint that the next job resumes from.

All jobs of a phase run at the same time (the machine's cores are shared anyway), so the module costs
two job start-ups, not fifteen. Each wait has a hard timeout: a hang fails here, not at the CI limit.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

import workbench
from workbench.checkpoint import CheckpointStore, is_complete, load, read_manifest
from workbench.config import PRESETS
from workbench.models import build_model
from workbench.train.events import read_events

pytestmark = pytest.mark.multirank

K, SEED = 3, 7
TIMEOUT_S = 240
TINY_LR = 1e-9  # layout-change saves: one step this small leaves the weights at their seeded init


def _losses(run_dir, rank=0):
    return [e["loss"] for e in read_events(run_dir) if e["type"] == "step" and e["rank"] == rank]


def _wait_for_checkpoints(run, n, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(e["type"] == "checkpoint" for e in read_events(run.run_dir)) >= n or run.done:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no {n} checkpoints within {timeout} s in {run.run_dir}")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, workbench_cli):
    root = tmp_path_factory.mktemp("resume")
    t0 = time.monotonic()

    def launch(name, model="tiny", **kw):
        return workbench.launch(model, out=root / name, seed=SEED, **kw)

    # Phase 1: the uninterrupted references (which publish step K on the way), the job to kill, and
    # saves under layouts to convert.
    p1 = {
        "full_tp": launch("full_tp", nproc=2, tp=2, steps=2 * K, ckpt_every=K),
        "full_fsdp": launch("full_fsdp", nproc=2, dp_shard=2, steps=2 * K, ckpt_every=K, ckpt_async=True),
        "kill": launch("kill", nproc=2, tp=2, steps=500, ckpt_every=1, ckpt_async=True, keep=3),
        "pp2": launch("pp2", nproc=2, pp=2, steps=1, ckpt_every=1, lr=TINY_LR),
        "int8_tp": launch("int8_tp", nproc=2, tp=2, steps=1, ckpt_every=1, lr=TINY_LR, ckpt_quant="int8"),
        "ep2": launch("ep2", "tiny-moe", nproc=2, dp_shard=2, ep=2, steps=1, ckpt_every=1, lr=TINY_LR),
    }
    kill = p1.pop("kill")
    _wait_for_checkpoints(kill, 2, TIMEOUT_S)
    time.sleep(random.Random(SEED).uniform(0.0, 0.5))  # a moment inside the next async save
    try:
        os.killpg(kill.pid, signal.SIGKILL)  # torchrun dies; its ranks follow it (lifeline)
    except ProcessLookupError:
        pass  # it had already ended (then the assertions below say why)
    kill.wait(30, raise_on_error=False)
    for run in p1.values():
        run.wait(TIMEOUT_S)
    out = {"root": root, "kill_events": read_events(kill.run_dir), "phase1_s": time.monotonic() - t0,
           "full_tp": _losses(root / "full_tp"), "full_fsdp": _losses(root / "full_fsdp"),
           "full_fsdp_events": read_events(root / "full_fsdp")}
    kill_latest = CheckpointStore(root / "kill" / "checkpoints").latest_pointer()
    out["kill_latest"] = kill_latest

    # Phase 2: fresh jobs that have nothing but the step-K checkpoints (tp through the CLI), the tp
    # checkpoint under dp_shard=2, and the killed job resuming in its own run directory.
    step_k = f"step-{K:06d}"
    cli = subprocess.Popen([*workbench_cli, "train", "tiny", "--nproc", "2", "--tp", "2", "--steps", str(2 * K),
                            "--seed", str(SEED), "--resume", str(root / "full_tp" / "checkpoints" / step_k),
                            "--out", str(root / "resume_tp"), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p2 = {
        "resume_fsdp": launch("resume_fsdp", nproc=2, dp_shard=2, steps=2 * K,
                              resume=str(root / "full_fsdp" / "checkpoints" / step_k)),
        "tp_to_fsdp": launch("tp_to_fsdp", nproc=2, dp_shard=2, steps=K + 2,
                             resume=str(root / "full_tp" / "checkpoints" / step_k)),
    }
    if kill_latest is not None:
        step = int(kill_latest.split("-")[1])
        p2["resume_kill"] = launch("kill", nproc=2, tp=2, steps=step + 1, ckpt_every=1, resume="latest")
    for run in p2.values():
        run.wait(TIMEOUT_S)
    stdout, stderr = cli.communicate(timeout=TIMEOUT_S)
    assert cli.returncode == 0, stderr[-3000:]
    out["resume_tp"] = json.loads(stdout)["losses"]["0"]
    out["resume_fsdp"] = _losses(root / "resume_fsdp")
    out["tp_to_fsdp"] = _losses(root / "tp_to_fsdp")
    out["resume_events"] = {name: read_events(run.run_dir) for name, run in p2.items()}
    out["wall_s"] = time.monotonic() - t0
    print(f"resume jobs: phase 1 {out['phase1_s']:.0f} s, total {out['wall_s']:.0f} s")
    return out


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_tp_resume_through_the_cli_is_bitwise_equal(jobs):
    ref, resumed = jobs["full_tp"], jobs["resume_tp"]
    assert len(ref) == 2 * K and len(resumed) == K
    assert resumed == ref[K:]  # exact float equality, not a tolerance
    store = CheckpointStore(jobs["root"] / "full_tp" / "checkpoints")
    assert store.steps() == [K, 2 * K] and store.latest_pointer() == f"step-{2 * K:06d}"


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_fsdp_resume_from_an_async_checkpoint_is_bitwise_equal(jobs):
    assert len(jobs["resume_fsdp"]) == K and jobs["resume_fsdp"] == jobs["full_fsdp"][K:]
    ev = [e for e in jobs["full_fsdp_events"] if e["type"] == "checkpoint"][0]
    assert ev["async"] is True and ev["step"] == K and ev["bytes"] > 0
    assert 0 < ev["blocking_s"] < ev["total_s"]
    steps = [e for e in jobs["full_fsdp_events"] if e["type"] == "step"]
    assert all(e["ckpt_stall_s"] >= 0 for e in steps)  # what checkpointing cost the loop, per step
    assert sum(e["ckpt_stall_s"] for e in steps if e["rank"] == 0) > 0
    (resume,) = [e for e in jobs["resume_events"]["resume_fsdp"] if e["type"] == "resume" and e["rank"] == 0]
    assert resume["step"] == K and resume["skipped"] == []


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_full_state_resume_into_another_layout(jobs):
    """tp=2 checkpoint -> dp_shard=2 job: same weights (the first loss matches), same optimizer state."""
    ref, moved = jobs["full_tp"], jobs["tp_to_fsdp"]
    assert len(moved) == 2
    assert abs(moved[0] - ref[K]) < 1e-5  # loss of the loaded weights; only reduction order differs
    assert abs(moved[1] - ref[K + 1]) < 1e-3  # after one more Adam step from the loaded moments
    (resume,) = [e for e in jobs["resume_events"]["tp_to_fsdp"] if e["type"] == "resume" and e["rank"] == 0]
    assert resume["saved_layout"]["tp"] == 2 and resume["skipped"] == []
    # tp's column shards -> fsdp's row shards: parts of saved chunks, read and narrowed, no torch.load
    assert resume["read"]["path"] == "direct+narrow" and resume["read"]["dcp"] == 0, resume["read"]


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_sigkill_during_async_saves_leaves_a_resumable_latest(jobs):
    published = [e["step"] for e in jobs["kill_events"] if e["type"] == "checkpoint" and e.get("status") == "published"]
    assert len(published) >= 2
    latest = jobs["kill_latest"]
    assert latest is not None and int(latest.split("-")[1]) >= published[-1]
    ckpts = jobs["root"] / "kill" / "checkpoints"
    assert is_complete(ckpts / latest)[0]
    step = int(latest.split("-")[1])
    (resume,) = [e for e in jobs["resume_events"]["resume_kill"] if e["type"] == "resume" and e["rank"] == 0]
    assert resume["step"] == step
    assert CheckpointStore(ckpts).latest_pointer() == f"step-{step + 1:06d}"


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("name,preset,layout", [("pp2", "tiny", "pp=2"), ("ep2", "tiny-moe", "dp_shard=2 x ep=2")])
def test_layout_checkpoint_loads_into_one_process(jobs, name, preset, layout):
    ckpt = jobs["root"] / name / "checkpoints"
    manifest = read_manifest(CheckpointStore(ckpt).latest())
    assert manifest["world_size"] == 2 and manifest["job"]["parallel"][name[:2]] == 2
    model = build_model(PRESETS[preset], seed=123)  # other weights: all of them must come from disk
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    res = load(ckpt, model, opt)  # full state into one process
    assert res.step == 1 and res.skipped == [] and res.read["dcp"] == 0, res.read
    # DCP's own reader (torch.load per item) gives bitwise the same state
    model2 = build_model(PRESETS[preset], seed=321)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    assert load(ckpt, model2, opt2, direct=False).read["path"] == "dcp"
    for (key, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), key
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][name], opt2.state[p2][name]), name
    init = build_model(PRESETS[preset], seed=SEED)  # the run's seeded init; lr=1e-9 moved it by < 1e-8
    for key, value in init.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=1e-7, msg=f"{layout}: {key}")
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape and float(opt.state[p]["step"]) == 1.0


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_int8_optimizer_state_saved_under_tp_loads_into_one_process(jobs):
    """tp=2 shards the moments by rows (colwise) and by columns (rowwise, the quantization blocks' own
    dimension); their int8 codes and scales are DTensors sharded alike, and one process reads them back.
    The pp=2 job took the same first step (same seed, data and gradient), so its fp32 moments are the
    reference: equal within half an int8 step of each block (plus float noise from the reduction order)."""
    from workbench.checkpoint.quant import BLOCKS

    ckpt = CheckpointStore(jobs["root"] / "int8_tp" / "checkpoints").latest()
    info = read_manifest(ckpt)["quant"]
    assert info["mode"] == "int8" and set(info["keys"].values()) <= set(BLOCKS)
    assert any(k.endswith("attention.wo.weight.exp_avg") for k in info["keys"])  # a column-sharded one
    got, ref = {}, {}
    for name, into in (("int8_tp", got), ("pp2", ref)):
        model = build_model(PRESETS["tiny"], seed=123)
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        res = load(jobs["root"] / name / "checkpoints", model, opt)
        assert res.read["dcp"] == 0
        for fqn, p in model.named_parameters():
            into[fqn] = opt.state[p]
    for fqn in ref:
        for moment in ("exp_avg", "exp_avg_sq"):
            a, b = got[fqn][moment], ref[fqn][moment]
            if moment == "exp_avg_sq":
                a, b = a.sqrt(), b.sqrt()
            step = b.abs().max() / (254 if moment == "exp_avg" else 510)
            assert (a - b).abs().max() <= step * 1.01 + 1e-3 * b.abs().max(), (fqn, moment)
