"""Launcher failure paths, for real: a rank that raises, a rank killed with SIGKILL, stop()."""

from __future__ import annotations

import os
import signal
import time

import pytest

import workbench
from helpers import wait_for as _wait_for  # tests/helpers.py
from workbench.train.agent import FRESH_RANKS_ENV
from workbench.train.events import read_events

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


def _no_ranks_left(run_dir) -> bool:
    pids = [e["pid"] for e in read_events(run_dir) if e["type"] in ("start", "launch")]
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return not alive


@pytest.mark.parametrize("start", ["forked", "fresh"])
def test_rank_that_raises_is_named_with_its_traceback(tmp_path, monkeypatch, start):
    # CPU ranks fork from the agent; CUDA ranks start as fresh interpreters, which the env var forces here.
    if start == "fresh":
        monkeypatch.setenv(FRESH_RANKS_ENV, "1")
    run = workbench.launch("tiny", nproc=2, tp=2, steps=50, out=tmp_path, fail_at={"rank": 1, "step": 2})
    t0 = time.monotonic()
    with pytest.raises(workbench.RunFailed) as info:
        run.wait(60)
    assert time.monotonic() - t0 < 30
    err = info.value
    assert err.rank == 1
    assert "injected failure on rank 1 at step 2" in str(err)
    assert "Traceback (most recent call last)" in err.traceback and "trainer.py" in err.traceback
    assert run.status == "failed" and run.error.rank == 1
    assert _wait_for(lambda: _no_ranks_left(tmp_path), 10)


def test_rank_killed_with_sigkill_is_named_within_seconds(tmp_path):
    run = workbench.launch("small", nproc=2, dp_shard=2, steps=500, seq_len=128, out=tmp_path)
    _wait_for(lambda: any(e["type"] == "step" and e["rank"] == 1 for e in read_events(tmp_path)), 90)
    pid = next(e["pid"] for e in read_events(tmp_path) if e["type"] == "start" and e["rank"] == 1)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(workbench.RunFailed) as info:
        run.wait(30)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1
    assert "SIGKILL" in info.value.message
    assert _wait_for(lambda: _no_ranks_left(tmp_path), 10)


def test_stop_ends_every_rank(tmp_path):
    run = workbench.launch("small", nproc=2, dp_shard=2, steps=500, out=tmp_path)
    _wait_for(lambda: any(e["type"] == "start" for e in read_events(tmp_path)), 90)
    run.stop()
    assert run.done and run.status == "stopped"
    assert _wait_for(lambda: _no_ranks_left(tmp_path), 10)


def test_events_iterator_is_live_and_complete(tmp_path):
    run = workbench.launch("tiny", nproc=2, dp_shard=2, steps=4, out=tmp_path)
    seen = list(run.events())
    types = [e["type"] for e in seen]
    assert types[0] == "launch" and types[-1] == "run_end"
    assert sum(t == "step" for t in types) == 8
    assert all({"type", "rank", "time"} <= set(e) for e in seen)
    assert run.status == "succeeded"
    assert set(run.metrics.columns) >= {"rank", "step", "loss", "tokens_per_s", "step_time_s", "mem_bytes"}
    assert "<table>" in run._repr_html_()


def test_wait_timeout_stops_a_run(tmp_path):
    run = workbench.launch("small", nproc=1, steps=10_000, out=tmp_path)
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        run.wait(3)
    assert run.done


def test_stop_during_startup_is_stopped_not_failed(tmp_path):
    run = workbench.launch("tiny", nproc=2, dp_shard=2, steps=500, out=tmp_path)
    run.stop()  # before torchrun has even installed its signal handlers
    assert run.status == "stopped" and run.error is None
    assert run.started_at <= time.time()


def test_a_model_that_cannot_fit_is_refused_before_launch(tmp_path):
    with pytest.raises(ValueError, match=r"^llama-70b \(68.98B params\) needs at least .* GiB .* choose a smaller model"):
        workbench.launch("llama-70b", nproc=1, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
