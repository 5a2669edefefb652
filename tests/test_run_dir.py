"""One run per run directory, and resumed runs that say what they resumed from.

Real torchrun jobs (tiny, 1-2 gloo ranks, a few steps) and the real CLI:

* re-using ``--out`` is refused, in one line naming the directory, ``--resume`` and ``--overwrite`` (exit 2,
  ``{"status": "error"}`` under ``--json``; ``RunDirInUse`` naming ``resume=``/``overwrite=True`` in
  Python), and the earlier run's files are left as they were;
* ``--resume`` into the same directory says the step, the checkpoint and the layout change (single
  process -> dp_shard=2), and its progress bar starts at the resumed step;
* ``Run.resumed`` / ``Run.start_step`` / ``summary()["resumed_from"]`` in the Python API;
* ``overwrite=True`` deletes the earlier run, checkpoints included (kept when it also resumes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

import workbench
from workbench.checkpoint import CheckpointStore
from workbench.cli import main as cli_main
from workbench.train.events import read_events
from workbench.train.resumed import Resumed, layout_changes
from workbench.train.rundir import RunDirInUse, check_reusable, clear_run

pytestmark = pytest.mark.multirank
TIMEOUT_S = 120
FIRST_STEPS = 2  # the first run saves its last step, the one every resume below starts from


def _snapshot(run_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A finished 1-rank run with a checkpoint of its last step; tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("first") / "run"
    run = workbench.launch("tiny", out=out, nproc=1, steps=FIRST_STEPS, ckpt_every=FIRST_STEPS, seed=3)
    run.wait(TIMEOUT_S)
    assert CheckpointStore(out / "checkpoints").steps() == [FIRST_STEPS]
    return out


def _copy(first_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(first_run, dst)
    return dst


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_reusing_out_is_refused_naming_the_directory_and_both_fixes(first_run, workbench_cli, capsys):
    before = _snapshot(first_run)
    # The command a user types twice.
    res = subprocess.run([*workbench_cli, "train", "tiny", "--nproc", "1", "--steps", "2", "--out", str(first_run)],
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: {first_run} already holds a run (config.json, events.jsonl)")
    assert "--resume" in lines[0] and "--overwrite" in lines[0] and "Traceback" not in res.stderr
    # --json: one document with status "error", the same exit code (called in-process: same parser, same code)
    assert cli_main(["train", "tiny", "--nproc", "1", "--out", str(first_run), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "error" and str(first_run) in doc["error"] and "--overwrite" in doc["error"]
    # The Python API says it in Python.
    with pytest.raises(RunDirInUse, match=r'resume="latest" .* overwrite=True') as exc:
        workbench.launch("tiny", out=first_run, nproc=1, steps=2)
    assert isinstance(exc.value, ValueError) and exc.value.run_dir == first_run
    assert _snapshot(first_run) == before  # nothing was written, truncated or started
    assert CheckpointStore(first_run / "checkpoints").steps() == [FIRST_STEPS]


def test_which_directories_hold_a_run(tmp_path):
    check_reusable(tmp_path / "absent", resume=False, overwrite=False)  # created by the launch
    check_reusable(tmp_path, resume=False, overwrite=False)  # empty: the dashboard's mkdtemp
    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    check_reusable(tmp_path, resume=False, overwrite=False)  # checkpoints only: not a run's records
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RunDirInUse, match=r"holds a run \(config\.json\)"):
        check_reusable(tmp_path, resume=False, overwrite=False)
    check_reusable(tmp_path, resume=True, overwrite=False)
    check_reusable(tmp_path, resume=False, overwrite=True)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "rank0.npz").write_bytes(b"x")
    (tmp_path / "launcher.log").write_text("old")
    (tmp_path / "notes.txt").write_text("the user's own file")
    # --overwrite --resume: the checkpoints stay, to resume from
    assert clear_run(tmp_path, keep_checkpoints=True) == ["config.json", "launcher.log", "memory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "notes.txt"]
    (tmp_path / "events.jsonl").write_text("{}\n")
    assert clear_run(tmp_path) == ["events.jsonl", "checkpoints"]  # --overwrite alone: the whole earlier run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_cli_resume_into_the_same_out_says_step_checkpoint_and_layout(first_run, tmp_path, workbench_cli):
    out = _copy(first_run, tmp_path)
    res = subprocess.run([*workbench_cli, "train", "tiny", "--nproc", "2", "--dp-shard", "2", "--steps", "4",
                          "--seed", "3", "--resume", "--out", str(out)],
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    err = res.stderr.replace("\r", "\n")
    ckpt = out / "checkpoints" / f"step-{FIRST_STEPS:06d}"
    assert (f"resumed from step {FIRST_STEPS} ({ckpt}); layout changed: single process -> dp_shard=2 "
            "(dp_shard 1 -> 2)") in err
    bars = re.findall(r"\b(\d)/4\b", err)  # every state the progress bar drew
    assert bars and bars[0] == "2" and "0" not in bars and bars[-1] == "4", err
    assert f"done: 2 steps (steps {FIRST_STEPS}-3, resumed)" in res.stdout
    events = read_events(out)
    (resume,) = [e for e in events if e["type"] == "resume" and e["rank"] == 0]
    assert resume["step"] == FIRST_STEPS and resume["path"] == str(ckpt)
    assert resume["layout_changed"] is True and resume["layout_changes"] == {"dp_shard": [1, 2]}
    assert resume["saved_layout_desc"] == "single process" and resume["layout_desc"] == "dp_shard=2"
    assert resume["saved_world_size"] == 1 and resume["world_size"] == 2
    assert sorted({e["step"] for e in events if e["type"] == "step"}) == [2, 3]  # a fresh event stream


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
def test_api_run_says_what_it_resumed_from_and_overwrite_starts_afresh(first_run, tmp_path):
    out = _copy(first_run, tmp_path)
    run = workbench.launch("tiny", out=out, nproc=1, steps=FIRST_STEPS + 1, seed=3, resume="latest")
    assert run.start_step == FIRST_STEPS  # known at launch, before the ranks have loaded anything
    run.wait(TIMEOUT_S)
    # One process: the default load copied the weights into the model and left the fresh optimizer's state on
    # the mapped checkpoint files (tests/test_checkpoint_mmap.py), and the resume event says so.
    (resume,) = [e for e in read_events(out) if e["type"] == "resume"]
    assert resume["read"]["mmap"] == "auto" and resume["read"]["path"] == "mmap", resume["read"]
    assert resume["read"]["mapped"] > 0 and resume["read"]["copied"] > 0, resume["read"]
    resumed = run.resumed
    assert isinstance(resumed, Resumed) and resumed.step == FIRST_STEPS and run.start_step == FIRST_STEPS
    assert resumed.path == str(out / "checkpoints" / f"step-{FIRST_STEPS:06d}")
    assert resumed.layout_changed is False and resumed.changes == {}
    assert resumed.describe().endswith("; same layout (single process)")
    summary = run.summary()
    assert summary["resumed_from"]["step"] == FIRST_STEPS and summary["resumed_from"]["layout_changed"] is False
    assert run.metrics["step"].tolist() == [FIRST_STEPS]

    # overwrite=True: a new run from step 0; the earlier run goes, its checkpoints included.
    (out / "memory").mkdir()
    (out / "memory" / "rank0.npz").write_bytes(b"an earlier run's timeline")
    again = workbench.launch("tiny", out=out, nproc=1, steps=1, seed=3, overwrite=True)
    assert again.start_step == 0
    again.wait(TIMEOUT_S)
    assert again.resumed is None and "resumed_from" not in again.summary()
    # The earlier Run object still describes its own run, not the one that replaced its events.
    assert run.metrics["step"].tolist() == [FIRST_STEPS] and run.resumed.step == FIRST_STEPS
    assert run.status == "succeeded"
    events = read_events(out)
    assert [e["step"] for e in events if e["type"] == "step"] == [0]
    assert not [e for e in events if e["type"] == "resume"]
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 1
    assert not (out / "memory").exists() and not (out / "checkpoints").exists()


def test_layout_change_of_a_checkpoint_without_a_recorded_layout():
    now = {"tp": 2, "dp_shard": 1}
    assert layout_changes(None, now) is None and layout_changes({"tp": 2}, now) == {}
    r = Resumed(step=5, path="/c/step-000005", saved_layout=None, layout=now, changes=None)
    assert r.layout_changed is None and "does not record its layout" in r.describe()
