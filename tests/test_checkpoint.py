"""Checkpoints in one process: exact round trips, atomic publishing under SIGKILL, rotation, refusals.

DCP runs without a process group here (one process), through the same save/load code the trainer uses.
The crash test kills a saving process with SIGKILL 20 times at random moments; each time ``latest``
must name a complete, checksum-valid checkpoint and the next process must resume from it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import workbench
from workbench.checkpoint import (EMA, Checkpointer, CheckpointError, CheckpointStore, TrainState, is_complete, load,
                                  read_manifest, save)
from workbench.checkpoint.load import read_metadata
from workbench.checkpoint.saver import WRITE_THREADS
from workbench.config import ModelConfig
from workbench.models import build_model

CFG = ModelConfig("ckpt-test", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128,
                  max_seq_len=64)


def _setup(seed: int = 0, ema: float = 0.0):
    torch.manual_seed(seed)
    model = build_model(CFG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return TrainState(model, opt, sched, EMA(model, ema) if ema else None)


def _step(state: TrainState) -> float:
    """One training step on batch number ``state.step`` (data indexed by step, like the trainer)."""
    gen = torch.Generator().manual_seed(1000 + state.step)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=gen)
    loss = F.cross_entropy(state.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    if state.ema is not None:
        state.ema.update()
    state.step += 1
    state.consumed_samples += 2
    return float(loss.detach())


def _weights(state: TrainState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def test_full_state_round_trip_continues_bitwise(tmp_path):
    a = _setup(ema=0.9)
    for _ in range(3):
        _step(a)
    random.seed(11)
    np.random.seed(12)
    path = save(tmp_path, a)
    assert path == tmp_path / "step-000003" and (tmp_path / "latest").read_text().strip() == "step-000003"
    py_next, np_next, torch_next = random.random(), np.random.rand(), torch.rand(3)

    b = _setup(seed=99, ema=0.9)  # different weights, fresh optimizer: everything must come from disk
    random.seed(0)
    np.random.seed(0)
    res = load(tmp_path, b.model, b.optimizer, scheduler=b.scheduler, ema=b.ema, rng=True)
    assert (res.step, res.consumed_samples, res.skipped) == (3, 6, [])
    assert (random.random(), np.random.rand()) == (py_next, np_next) and torch.equal(torch.rand(3), torch_next)
    assert b.scheduler.last_epoch == 3 and b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    assert b.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    for k, v in a.ema.shadow.items():
        assert torch.equal(v, b.ema.shadow[k]), k
    b.step, b.consumed_samples = res.step, res.consumed_samples
    assert [_step(a) for _ in range(3)] == [_step(b) for _ in range(3)]  # bitwise: floats compare exactly
    for k, v in _weights(a).items():
        assert torch.equal(v, _weights(b)[k]), k

    doc = read_manifest(path)
    assert doc["format"] == "workbench-checkpoint" and doc["version"] == 1 and doc["step"] == 3
    assert set(doc["files"]) == {".metadata"} | {f"__0_{i}.distcp" for i in range(WRITE_THREADS)} and doc["ema"] is True
    assert doc["files"]["__0_0.distcp"]["bytes"] == (path / "__0_0.distcp").stat().st_size
    keys = set(read_metadata(path).state_dict_metadata)
    for key in ("model.layers.0.attention.wq.weight", "optim.state.layers.1.feed_forward.w2.weight.exp_avg",
                "ema.norm.weight", "sched.last_epoch",
                "rng.rank0.python", "rng.rank0.numpy", "rng.rank0.torch", "extra.step", "extra.consumed_samples"):
        assert key in keys, key
    # the hyperparameters: one packed item (JSON), not one tensor per parameter and value
    assert sum(k.startswith("optim.hyper.") for k in keys) == 1 and not any("param_groups" in k for k in keys)


def test_model_only_load_and_refusal_naming_the_key(tmp_path):
    a = _setup()
    _step(a)
    save(tmp_path, a)
    fresh = build_model(CFG, seed=5)
    res = load(tmp_path / "step-000001", fresh)  # no optimizer: weights only
    assert res.kinds == ["extra", "model"]
    for k, v in _weights(a).items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    wider = build_model(ModelConfig(**{**CFG.to_dict(), "ffn_hidden": 192}), seed=0)
    with pytest.raises(ValueError, match=r"layers\.0\.feed_forward\.w1\.weight is \(128, 64\) in the checkpoint "
                                         r"but \(192, 64\) here"):
        load(tmp_path, wider)


def test_rotation_latest_and_incomplete_checkpoints_are_never_picked(tmp_path):
    state = _setup()
    for _ in range(6):
        _step(state)
        save(tmp_path, state, keep=2, keep_every=3)
    store = CheckpointStore(tmp_path)
    assert store.steps() == [3, 5, 6]  # newest 2, plus every 3rd step
    assert store.latest() == tmp_path / "step-000006"
    # A save killed before its manifest: a stray tmp dir (cleaned by the next save) and latest untouched.
    (tmp_path / ".tmp-step-000007-dead").mkdir()
    assert store.latest() == tmp_path / "step-000006"
    # Damage step 6's shard: the checksum catches it and resume falls back to the newest complete one.
    shard = tmp_path / "step-000006" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    ok, why = is_complete(tmp_path / "step-000006")
    assert not ok and "xxh3_128 differs from the manifest" in why
    assert store.latest() == tmp_path / "step-000005"
    (tmp_path / "step-000005" / "workbench.json").unlink()  # manifest missing: incomplete
    assert store.latest() == tmp_path / "step-000003"
    assert load(tmp_path, build_model(CFG, seed=0)).step == 3
    _step(state)
    save(tmp_path, state, keep=2)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_metadata_is_never_unpickled_beyond_dcp_classes(tmp_path):
    state = _setup()
    _step(state)
    path = save(tmp_path, state)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match="refusing to unpickle"):
        read_metadata(path)
    assert not marker.exists()


def test_async_and_zero_stall_saves_hold_the_state_of_their_step(tmp_path):
    for mode in ("async", "zero_stall"):
        root = tmp_path / mode
        events = []
        state = _setup(ema=0.5)
        ckpt = Checkpointer(root, every=2, mode=mode, emit=lambda type, **f: events.append({"type": type, **f}))
        expected = {}
        for _ in range(6):
            _step(state)
            ckpt.after_step(state)  # zero-stall snapshots every step; the training keeps mutating weights
            if state.step % 2 == 0:
                expected[state.step] = _weights(state)
        ckpt.close()
        assert [e["step"] for e in events] == [2, 4, 6] and all(e["async"] for e in events)
        assert all(e["blocking_s"] <= e["total_s"] for e in events)
        for step, weights in expected.items():
            fresh = build_model(CFG, seed=1)
            load(root / f"step-{step:06d}", fresh)
            for k, v in weights.items():
                assert torch.equal(fresh.state_dict()[k], v), (mode, step, k)


def test_the_next_optimizer_step_waits_for_the_background_copy(tmp_path):
    """The copy runs beside the next forward/backward; the optimizer step that would overwrite the state
    waits for it (a slowed copy makes the race certain), and that wait counts as the save's blocking."""
    for mode in ("async", "zero_stall"):
        state = _setup()
        _step(state)
        ckpt = Checkpointer(tmp_path / mode, every=2, mode=mode)
        for buffers in ckpt._buffers:
            real = buffers.stage
            buffers.stage = lambda sd, real=real: (time.sleep(0.4), real(sd))[1]
        _step(state)
        expected = _weights(state)
        t0 = time.perf_counter()
        ckpt.after_step(state)
        returned = time.perf_counter() - t0
        _step(state)  # its optimizer.step() must wait for the copy before it writes the weights
        ckpt.close()
        assert returned < 0.3, (mode, returned)  # the loop went on at once
        assert ckpt.saves[0]["blocking_s"] >= 0.3, (mode, ckpt.saves)  # and then waited for the copy
        fresh = build_model(CFG, seed=1)
        load(tmp_path / mode / "step-000002", fresh)
        for k, v in expected.items():
            assert torch.equal(fresh.state_dict()[k], v), (mode, k)


def test_a_failing_writer_is_reported_not_silent(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    events = []
    state = _setup()
    ckpt = Checkpointer(blocker, every=1, mode="async", emit=lambda type, **f: events.append({"type": type, **f}))
    _step(state)
    ckpt.after_step(state)  # returns at once; the writer fails in the background
    with pytest.raises(CheckpointError, match="checkpoint at step 1 failed"):
        ckpt.close()
    assert events and events[0]["status"] == "failed" and "step 1" in events[0]["error"]


def test_ema_is_the_moving_average():
    state = _setup(ema=0.8)
    manual = {k: v.clone() for k, v in state.model.named_parameters()}
    for _ in range(3):
        _step(state)
        for k, p in state.model.named_parameters():
            manual[k] = 0.8 * manual[k] + 0.2 * p.detach()
    for k, v in manual.items():
        torch.testing.assert_close(state.ema.shadow[k], v, rtol=1e-6, atol=1e-7)


# -- crash safety ----------------------------------------------------------------------------------


def _crash_child(root: str, mode: str, started, progress) -> None:
    """Resume from latest (if any), then train and save every step until killed."""
    torch.set_num_threads(1)
    state = _setup()
    store = CheckpointStore(Path(root))
    if store.latest_pointer() is not None:
        res = load(root, state.model, state.optimizer, scheduler=state.scheduler, rng=True)
        state.step, state.consumed_samples = res.step, res.consumed_samples
    progress.value = state.step
    ckpt = Checkpointer(root, every=1, mode=mode, keep=2)
    started.set()
    while True:
        _step(state)
        ckpt.after_step(state)


@pytest.mark.timeout(120)
def test_sigkill_during_saves_never_breaks_latest(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "workbench", "workbench.checkpoint", "workbench.models", __name__])
    rnd = random.Random(0)
    resumed_from = []
    kills = 20
    for i in range(kills):
        started, progress = ctx.Event(), ctx.Value("i", -1)
        proc = ctx.Process(target=_crash_child, args=(str(tmp_path), ("sync", "async")[i % 2], started, progress))
        proc.start()
        if not started.wait(60):
            proc.kill()
            pytest.fail(f"kill {i}: the process did not resume from latest (exit code {proc.exitcode})")
        resumed_from.append(progress.value)
        time.sleep(rnd.uniform(0.02, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        store = CheckpointStore(tmp_path)
        name = store.latest_pointer()
        if name is not None:
            ok, why = is_complete(tmp_path / name)
            assert ok, f"kill {i}: latest -> {name}, which is incomplete: {why}"
    assert resumed_from == sorted(resumed_from) and resumed_from[-1] > 0  # progress survived the kills
    final = build_model(CFG, seed=3)
    assert load(tmp_path, final).step >= resumed_from[-1]
    assert json.loads((CheckpointStore(tmp_path).latest() / "workbench.json").read_text())["step"] >= 1


def test_launch_refuses_to_resume_another_model_before_starting(tmp_path, workbench_cli):
    state = _setup()
    _step(state)
    save(tmp_path / "run" / "checkpoints", state)
    with pytest.raises(ValueError, match=r"does not fit this model: model\.tok_embeddings\.weight is \(128, 64\) "
                                         r"in the checkpoint but \(256, 128\) here"):
        workbench.launch("tiny", out=tmp_path / "run", resume="latest")
    assert not (tmp_path / "run" / "config.json").exists()  # refused before anything was written or started
    proc = subprocess.run([*workbench_cli, "train", "tiny", "--out", str(tmp_path / "empty"), "--resume", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no checkpoint found" in json.loads(proc.stdout)["error"]
