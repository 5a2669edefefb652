"""The CLI as a user types it: the issue's "done when" commands, verbatim where possible."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from workbench.train.events import read_events


def _cli(workbench_cli, *args, timeout=150, **kw):
    return subprocess.run([*workbench_cli, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_train_tp2_json_writes_20_steps_per_rank_and_loss_falls(workbench_cli, tmp_path):
    out = tmp_path / "r"
    res = _cli(workbench_cli, "train", "tiny", "--nproc", "2", "--tp", "2", "--steps", "20", "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)  # exactly one JSON document on stdout
    assert doc["status"] == "succeeded" and doc["layout"] == "tp=2" and doc["steps_logged"] == 20
    steps = [e for e in read_events(out) if e["type"] == "step"]
    for rank in (0, 1):
        losses = [e["loss"] for e in steps if e["rank"] == rank]
        assert len(losses) == 20
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert json.loads((out / "config.json").read_text())["parallel"]["tp"] == 2


def test_bad_layout_is_one_line_and_starts_nothing(workbench_cli, tmp_path):
    out = tmp_path / "never"
    res = _cli(workbench_cli, "train", "tiny", "--nproc", "2", "--tp", "3", "--out", str(out), timeout=60)
    assert res.returncode == 2
    assert res.stderr.strip() == "error: tp=3 does not divide n_heads=8; choose tp in {1, 2, 4}"
    assert not out.exists()  # no run directory, no processes
    res = _cli(workbench_cli, "train", "tiny", "--nproc", "2", "--tp", "3", "--json", timeout=60)
    assert res.returncode == 2 and json.loads(res.stdout)["error"].startswith("tp=3 does not divide")


def test_usage_errors_are_one_line(workbench_cli):
    res = _cli(workbench_cli, "train", "tiny", "--steps", "many", timeout=60)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "invalid int value: 'many'" in res.stderr


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_same_samples_whatever_the_layout(workbench_cli, tmp_path):
    """`--nproc 1` and `--nproc 2 --dp-shard 2` with one seed log the same losses (|diff| <= 1e-3)."""
    a = _cli(workbench_cli, "train", "tiny", "--nproc", "1", "--steps", "5", "--seed", "7", "--out", str(tmp_path / "a"), "--json")
    b = _cli(workbench_cli, "train", "tiny", "--nproc", "2", "--dp-shard", "2", "--steps", "5", "--seed", "7",
             "--out", str(tmp_path / "b"), "--json")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    la, lb = json.loads(a.stdout)["losses"]["0"], json.loads(b.stdout)["losses"]["0"]
    assert len(la) == len(lb) == 5
    assert max(abs(x - y) for x, y in zip(la, lb)) <= 1e-3


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_killed_rank_fails_the_command_within_30s_naming_it(workbench_cli, tmp_path):
    out = tmp_path / "k"
    proc = subprocess.Popen([*workbench_cli, "train", "small", "--nproc", "2", "--dp-shard", "2", "--steps", "500",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        pid = None
        while pid is None and time.monotonic() < deadline:
            ev = read_events(out) if out.exists() else []
            if any(e["type"] == "step" and e["rank"] == 1 for e in ev):
                pid = next(e["pid"] for e in ev if e["type"] == "start" and e["rank"] == 1)
            time.sleep(0.1)
        assert pid is not None, "rank 1 never logged a step"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
        assert proc.returncode != 0
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("error: rank 1 failed: killed by SIGKILL"), last
    finally:
        if proc.poll() is None:
            proc.kill()


def test_presets_json(workbench_cli):
    res = _cli(workbench_cli, "presets", "--json", timeout=60)
    assert res.returncode == 0
    doc = json.loads(res.stdout)
    assert set(doc) >= {"tiny", "small", "llama-7b", "llama-70b"}
    assert 0.8e6 < doc["tiny"]["n_params"] < 1.3e6


def test_output_cut_short_by_head_ends_quietly_with_status_0(workbench_cli):
    """`workbench ... | head`: the reader goes away after a few bytes; no BrokenPipeError, no traceback, exit 0."""
    proc = subprocess.Popen([*workbench_cli, "plan", "tiny", "--dp-shard", "2", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.read(10)  # 10 bytes of a ~90 KB document (more than a pipe buffer holds), then close
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Error" not in err and "Traceback" not in err, err
