"""Multi-node training through torchrun's c10d rendezvous, on one machine: "nodes" are launcher
processes of one rank each that meet at 127.0.0.1, each with its own run directory, as on a cluster.

Real torchrun, real gloo ranks, hard timeouts. The two-node run must match the single-node run of the
same layout (same seed and global batch: gloo sums in the same order, so the losses agree to 1e-6).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

import workbench
from helpers import wait_for as _wait_for  # tests/helpers.py
from workbench.train.events import read_events
from workbench.train.nodes import node_settings, torchrun_args

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(90)]

# tiny, tp=2 over the two nodes, a few short steps
LAYOUT = dict(tp=2, steps=3, seq_len=16, global_batch=2)
FLAGS = ["--tp", "2", "--steps", "3", "--seq-len", "16", "--global-batch", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _pids(run_dir) -> list[int]:
    return [e["pid"] for e in read_events(run_dir) if e["type"] in ("launch", "start")]


def _node_cli(workbench_cli, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*workbench_cli, "train", "tiny", "--nproc", "1", "--nnodes", "2", *args, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, dict, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, json.loads(out), err


def test_two_nodes_of_one_rank_train_what_one_node_of_two_trains(workbench_cli, tmp_path):
    ep = f"127.0.0.1:{_free_port()}"
    # node 1 through the command line, node 0 through the API, the single-node reference beside them
    node1 = _node_cli(workbench_cli, "--node-rank", "1", "--rdzv-endpoint", ep, *FLAGS, "--out", str(tmp_path / "n1"))
    node0 = workbench.launch("tiny", nproc=1, nnodes=2, node_rank=0, rdzv_endpoint=ep, out=tmp_path / "n0", **LAYOUT)
    one = workbench.launch("tiny", nproc=2, out=tmp_path / "one", **LAYOUT)
    rc, summary1, err1 = _finish(node1)
    assert rc == 0, err1[-3000:]
    node0.wait(60)
    one.wait(60)

    reference = one.losses(0)
    assert len(reference) == 3 and one.losses(1) == reference
    ranks0 = sorted(node0.metrics["rank"].unique().tolist())
    ranks1 = [int(r) for r in summary1["losses"]]
    assert len(ranks0) == len(ranks1) == 1 and sorted(ranks0 + ranks1) == [0, 1]  # c10d picks which node is rank 0
    assert node0.losses(ranks0[0]) == pytest.approx(reference, rel=1e-6)
    assert summary1["losses"][str(ranks1[0])] == pytest.approx(reference, rel=1e-6)

    # config.json and the summaries say how the nodes met; every event says which node wrote it
    nodes = json.loads((tmp_path / "n0" / "config.json").read_text())["nodes"]
    assert nodes == {"nnodes": 2, "node_rank": 0, "rdzv_endpoint": ep, "rdzv_id": "workbench",
                     "rdzv_timeout_s": 300.0}
    assert json.loads((tmp_path / "n1" / "config.json").read_text())["nodes"]["node_rank"] == 1
    s0 = node0.summary()["nodes"]
    assert (s0["node_rank"], s0["world_size"], s0["ranks"]) == (0, 2, ranks0) and set(s0["hosts"]) == {0, 1}
    assert summary1["nproc"] == 1 and summary1["nodes"]["ranks"] == ranks1 and summary1["status"] == "succeeded"
    for node in (0, 1):
        events = read_events(tmp_path / f"n{node}")
        assert events and all(e["node"] == node for e in events)
        assert all(e["host"] == socket.gethostname() for e in events if e["type"] in ("launch", "start", "run_end"))
    assert "node" not in read_events(tmp_path / "one")[0]  # one node: the events are as before


@pytest.mark.parametrize("victim", [0, 1], ids=["rendezvous-host-killed", "other-node-killed"])
def test_a_killed_node_is_named_by_the_other_within_30s(tmp_path, victim):
    ep = f"127.0.0.1:{_free_port()}"
    runs = [workbench.launch("tiny", nproc=1, nnodes=2, node_rank=n, rdzv_endpoint=ep, out=tmp_path / f"n{n}",
                             **{**LAYOUT, "steps": 2000}) for n in (0, 1)]
    dead, alive = runs[victim], runs[1 - victim]
    _wait_for(lambda: all(any(e["type"] == "step" for e in read_events(r.run_dir)) for r in runs), 60)
    lost_rank = next(e["rank"] for e in read_events(dead.run_dir) if e["type"] == "start")
    os.killpg(dead.pid, signal.SIGKILL)  # the node's launcher and everything in its process group
    t0 = time.monotonic()
    with pytest.raises(workbench.RunFailed) as info:
        alive.wait(30)
    assert time.monotonic() - t0 < 30
    err = info.value
    # blamed: the node that went away and its rank, not the surviving rank that lost its peer
    assert (err.node, err.rank, err.ranks) == (victim, lost_rank, [lost_rank])
    assert str(err).startswith(f"node {victim} (rank {lost_rank}) failed: it went away")
    assert f"here (node {1 - victim}) lost its connection to it" in err.message
    assert f"see node {victim}'s log for why: {dead.run_dir}/launcher.log on host {socket.gethostname()}" in err.message
    assert "\n" not in err.message and err.traceback == ""
    assert alive.status == "failed" and alive.summary()["error"]["node"] == victim
    dead.wait(10, raise_on_error=False)  # reap the killed launcher
    assert _wait_for(lambda: not any(_alive(p) for r in runs for p in _pids(r.run_dir)), 10)


def test_a_node_alone_gives_up_after_the_rendezvous_timeout_with_one_line(workbench_cli, tmp_path):
    # node 0 waits at its own rendezvous for node 1; node 1 (another job) finds no node 0 to meet
    ep0, ep1 = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    node0 = _node_cli(workbench_cli, "--node-rank", "0", "--rdzv-endpoint", ep0, *FLAGS, "--out", str(tmp_path / "n0"),
                      env={"WORKBENCH_RDZV_TIMEOUT_S": "3"})
    node1 = workbench.launch("tiny", nproc=1, nnodes=2, node_rank=1, rdzv_endpoint=ep1, rdzv_timeout_s=3,
                             out=tmp_path / "n1", **LAYOUT)
    rc, summary, _ = _finish(node0)
    assert rc == 1 and summary["status"] == "failed"
    assert summary["error"]["node"] == 0 and summary["error"]["message"] == (
        f"waited 3 s at {ep0} for 2 nodes, 1 joined; start the same command with --node-rank 1 on the other "
        "node (or raise --rdzv-timeout)")
    with pytest.raises(workbench.RunFailed, match=rf"^node 1 failed: could not reach the rendezvous at {ep1} within "
                       r"3 s; start the same command with --node-rank 0 on the machine at 127\.0\.0\.1"):
        node1.wait(30)
    assert time.monotonic() - t0 < 40


def test_nodes_started_with_different_settings_are_refused(tmp_path):
    ep = f"127.0.0.1:{_free_port()}"
    runs = [workbench.launch("tiny", nproc=1, nnodes=2, node_rank=n, rdzv_endpoint=ep, rdzv_timeout_s=30,
                             out=tmp_path / f"n{n}", **{**LAYOUT, "steps": 3 + n}) for n in (0, 1)]
    for n, run in enumerate(runs):
        mine, theirs = 3 + n, 4 - n
        with pytest.raises(workbench.RunFailed, match=rf"^node {n} failed: node {1 - n} \(host .*\) runs different "
                           rf"settings: train.steps: {mine} here, {theirs} there; start every node with the same "
                           "command, only --node-rank differs$"):
            run.wait(30)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2), r"^--nnodes 2 needs --rdzv-endpoint HOST:PORT: an address of node 0"),
    (dict(nnodes=2, rdzv_endpoint="node0"),
     r"^--rdzv-endpoint 'node0' is not HOST:PORT; .* e\.g\. --rdzv-endpoint node0:29500"),
    (dict(nnodes=2, rdzv_endpoint="node0:99999"), r"port 99999 is outside 1-65535; choose a free port"),
    (dict(nnodes=2, node_rank=2, rdzv_endpoint="node0:29500"), r"^--node-rank 2 is outside 0\.\.1 for --nnodes 2"),
    (dict(node_rank=1), r"^--node-rank 1 needs --nnodes 2 or more"),
    (dict(rdzv_endpoint="node0:29500"), r"^--rdzv-endpoint is for runs over several machines; add --nnodes N"),
    (dict(nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="my job"), r"^--rdzv-id 'my job' must be 1-64 letters"),
    (dict(nnodes=2, rdzv_endpoint="node0:29500", rdzv_timeout_s=0), r"^--rdzv-timeout 0 must be a positive number"),
    (dict(nnodes=0), r"^--nnodes 0 must be at least 1"),
    (dict(nnodes=2, rdzv_endpoint="node0:29500", tp=1, dp_shard=3, global_batch=3),
     r"has 3 ranks, which 2 nodes cannot share equally"),
])
def test_bad_multinode_settings_are_refused_before_anything_starts(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        workbench.launch("tiny", out=tmp_path / "never", **{"tp": 2, **kwargs})
    assert not (tmp_path / "never").exists()


def test_node_settings_and_torchrun_arguments(monkeypatch, capsys):
    assert node_settings() is None  # one node: torchrun --standalone, as before
    monkeypatch.setenv("WORKBENCH_RDZV_TIMEOUT_S", "7")
    nodes = node_settings(3, 2, " [::1]:29500 ")
    assert nodes == {"nnodes": 3, "node_rank": 2, "rdzv_endpoint": "[::1]:29500", "rdzv_id": "workbench",
                     "rdzv_timeout_s": 7.0}
    args = torchrun_args({**nodes, "rdzv_timeout_s": 2.5}, 4)
    assert args == ["--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=[::1]:29500",
                    "--rdzv-id=workbench", "--rdzv-conf=join_timeout=3,read_timeout=3,is_host=0"]
    assert torchrun_args({**nodes, "node_rank": 0}, 1)[-1].endswith("is_host=1")  # node 0 hosts the rendezvous

    from workbench.cli import main

    assert main(["train", "tiny", "--tp", "2", "--nnodes", "2", "--rdzv-endpoint", "node0", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"].startswith("--rdzv-endpoint 'node0' is not HOST:PORT")
