"""Plain torchrun as a client (issue 29, rows 5 and 6): the command lines torchtitan users type, run for real
(gloo on CPU, 1-2 ranks, 2 steps of tiny), each with a hard timeout.

* ``torchrun -m workbench.torchrun`` trains, rank 0 owning the run directory and the other rank joining it;
* ``torchrun $(which workbench) train ...`` trains the same way instead of starting a launcher per rank (which
  raced for --out and exited 1), and a stray LOCAL_RANK without torchrun's other variables is one line;
* the per-rank worker refuses a config.json whose layout needs more ranks than it has, in one line, instead
  of training unsharded under the config's label.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.train.events import read_events

PROC_TIMEOUT_S = 240  # two ranks starting on a loaded 2-core machine; a passing run takes ~20 s


def _torchrun(*args: str, nproc: int = 2, timeout: float = PROC_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free port: tests run side by side) with the test environment's Python."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # this process is no rank
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "--max-restarts=0", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _own_lines(stderr: str) -> list[str]:
    """The ``error:`` lines the ranks printed (torchrun adds its own report around them)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _check_tp2_run(out: Path, steps: int) -> list[dict]:
    """A finished 2-rank tp=2 run directory as `workbench train` writes one, read by the run tab's reader."""
    from workbench.jupyter.runs import _run_summary
    from workbench.train.rundir import run_id_of

    events = read_events(out)
    starts = {e["rank"]: e for e in events if e["type"] == "start"}
    assert sorted(starts) == [0, 1]
    assert all(e["layout"] == "tp=2" and e["world_size"] == 2 for e in starts.values())
    for rank in (0, 1):
        assert [e["step"] for e in events if e["type"] == "step" and e["rank"] == rank] == list(range(steps))
    launches = [e for e in events if e["type"] == "launch"]
    ends = [e for e in events if e["type"] == "run_end"]
    assert len(launches) == 1 and launches[0]["rank"] == -1  # one launcher's worth, not one per rank
    assert len(ends) == 1 and ends[0]["rank"] == -1 and ends[0]["status"] == "succeeded"
    assert json.loads((out / "config.json").read_text())["parallel"]["tp"] == 2
    assert run_id_of(out) is not None
    summary = _run_summary(out, events)
    assert (summary["status"], summary["layout"], summary["ranks"], summary["steps_logged"]) == \
        ("succeeded", "tp=2", [0, 1], steps)
    return events


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_module_entry_trains_tp2_with_rank0_owning_the_run_dir(tmp_path):
    out = tmp_path / "run"
    res = _torchrun("-m", "workbench.torchrun", "tiny", "--tp", "2", "--steps", "2", "--ckpt-every", "2",
                    "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr[-4000:]
    doc = json.loads(res.stdout)  # rank 0 alone prints, one JSON document
    assert doc["status"] == "succeeded" and doc["layout"] == "tp=2" and doc["steps_logged"] == 2
    assert doc["run_dir"] == str(out)
    events = _check_tp2_run(out, steps=2)
    # the checkpoint is saved by both ranks into the directory rank 0 claimed for this run
    assert [e["step"] for e in events if e["type"] == "checkpoint" and e["rank"] == 0] == [2]
    from workbench.checkpoint.store import CheckpointStore

    store = CheckpointStore(out / "checkpoints")
    assert store.steps() == [2] and store.owner()["run_id"] == json.loads((out / "run.json").read_text())["run_id"]

    # Rank 0 refuses to reuse the directory, as workbench train does; the other rank learns it through the
    # group and exits with it, silently: one line in all, and the earlier run untouched.
    before = (out / "events.jsonl").read_bytes()
    res = _torchrun("-m", "workbench.torchrun", "tiny", "--tp", "2", "--steps", "2", "--out", str(out))
    assert res.returncode != 0
    lines = _own_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: {out} already holds a run"), res.stderr[-3000:]
    assert "--resume" in lines[0] and "--overwrite" in lines[0]
    assert "exitcode  : 2" in res.stderr and (out / "events.jsonl").read_bytes() == before


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_workbench_train_under_torchrun_trains_as_its_rank(workbench_cli, tmp_path):
    if len(workbench_cli) != 1:
        pytest.skip("needs the workbench console script (torchrun runs a script, not -m, here)")
    out = tmp_path / "run"
    res = _torchrun(workbench_cli[0], "train", "tiny", "--tp", "2", "--steps", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("done: 2 steps") == 1, res.stdout
    _check_tp2_run(out, steps=2)


def test_workbench_train_with_a_stray_local_rank_is_one_line(workbench_cli, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    res = subprocess.run([*workbench_cli, "train", "tiny", "--out", str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=60, env={**env, "LOCAL_RANK": "0"})
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "-m workbench.torchrun" in res.stderr and "unset LOCAL_RANK" in res.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_worker_refuses_a_layout_its_world_size_cannot_hold(tmp_path):
    from workbench.train.launcher import build_job

    run = tmp_path / "run"
    run.mkdir()
    job = build_job("tiny", nproc=2, tp=2, steps=2, device="cpu")
    (run / "config.json").write_text(json.dumps(job.to_dict()))
    expected = (f"error: {run / 'config.json'}: the layout tp=2 needs 2 ranks, but this job has 1 process "
                "(WORLD_SIZE=1); start 2 processes")

    res = _torchrun("-m", "workbench.train.worker", str(run), nproc=1)
    assert res.returncode != 0, res.stderr[-3000:]  # it used to train unsharded and exit 0
    lines = _own_lines(res.stderr)
    assert len(lines) == 1 and lines[0].startswith(expected), res.stderr[-3000:]
    assert "exitcode  : 2" in res.stderr  # the rank's own exit code, in torchrun's report
    events = read_events(run)
    assert not [e for e in events if e["type"] in ("start", "step")]  # nothing trained under a wrong label
    assert [e["message"] for e in events if e["type"] == "error"] == [lines[0].removeprefix("error: ")]

    # the same entry started by hand, as one process with no torchrun around it: the same one line
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-m", "workbench.train.worker", str(run)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [lines[0]], res.stderr[-3000:]
