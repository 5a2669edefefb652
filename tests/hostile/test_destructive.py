"""Destructive operations and disk trouble never lose data (issue 27, rows 3, 4 and part of 15).

* ``ckpt convert SRC DST --force`` refuses a DST that is, holds or lies inside SRC (symbolic links
  resolved), and a non-empty directory that is not an export of ours; a convert killed or failing
  mid-write leaves the old DST as it was. Every refusal is checked against the bytes of every file
  before and after.
* A checkpoint directory belongs to one run: a second run saving into it is refused in one line before
  any step, and the first run's checkpoints are untouched; resuming the same run, resuming from another
  run's checkpoint into a directory of one's own, and adopting a directory on purpose all work.
* ``--ckpt-dir``/``--out`` that is a file, lies under one, is read-only or has no room is refused before
  any rank starts.
* A save out of space says so (``no space left on device ...``), sync and async, with nothing
  published: real ENOSPC from writes to ``/dev/full`` (any user, Linux), and from a full tmpfs where
  this user may mount one (root).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import workbench
from workbench.checkpoint import (Checkpointer, CheckpointError, CheckpointStore, TrainState, is_complete, load, save)
from workbench.checkpoint.destination import MARKER
from workbench.checkpoint.formats import export
from workbench.checkpoint.saver import WRITE_THREADS
from workbench.cli import main as cli_main
from workbench.config import ModelConfig
from workbench.disk import StorageError
from workbench.models import build_model
from workbench.train.rundir import CheckpointDirInUse

pytestmark = pytest.mark.timeout(600)
CFG = ModelConfig("destructive-test", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128,
                  max_seq_len=64)
TIMEOUT_S = 240


# -- helpers ---------------------------------------------------------------------------------------


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = build_model(CFG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return TrainState(model, opt, sched)


def _step(state: TrainState) -> None:
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(state.step))
    F.cross_entropy(state.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1
    state.consumed_samples += 2


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root`` (links not followed): a file's bytes, a link's target, a directory."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def _one_line(captured: str) -> str:
    lines = captured.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured, captured
    return lines[0]


@pytest.fixture
def workdir(tmp_path):
    """A run directory with one checkpoint (``run/checkpoints/step-000001``), an export of it as one
    safetensors file, and a directory of the user's own, all under ``tmp_path`` (the cwd)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": CFG.to_dict()}))
    st = _state()
    _step(st)
    save(run / "checkpoints", st, {"job": {"model": CFG.to_dict()}})
    export(run, tmp_path / "model.safetensors", to="safetensors", progress=False)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "results.txt").write_text("three weeks of numbers")
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


# -- convert --force -------------------------------------------------------------------------------

STEP = "run/checkpoints/step-000001"


@pytest.mark.parametrize("src,dst,to,how", [
    ("run", "run", "hf", "is the source"),                          # the issue: the whole run was deleted
    (STEP, "run", "hf", "contains the source"),                     # DST = the run holding SRC
    (STEP, "run/checkpoints", "hf", "contains the source"),         # DST = SRC's parent
    ("run", f"{STEP}/export", "hf", "lies inside the source"),      # DST inside SRC
    ("run", "run/export.safetensors", "safetensors", "lies inside the source"),
    ("model.safetensors", "model.safetensors", "safetensors", "is the source"),  # the issue: the source went
    ("model.safetensors", "link.pt", "torch", "is the source"),     # DST a link to the source file
    (STEP, "runlink", "hf", "contains the source"),                 # DST a link to the run directory
])
def test_convert_force_refuses_the_source_and_what_holds_or_lies_in_it(workdir, capsys, src, dst, to, how):
    (workdir / "link.pt").symlink_to("model.safetensors")
    (workdir / "runlink").symlink_to("run", target_is_directory=True)
    before = _snapshot(workdir)
    assert cli_main(["ckpt", "convert", src, dst, "--to", to, "--force"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert how in line and dst in line and "choose a destination outside the source" in line
    assert _snapshot(workdir) == before  # nothing deleted, nothing written
    with pytest.raises(ValueError, match=how):  # the Python API, overwrite=True
        export(src, dst, to=to, overwrite=True, progress=False)
    assert _snapshot(workdir) == before


def test_convert_force_replaces_only_our_exports_and_empty_directories(workdir, capsys):
    before = _snapshot(workdir)
    assert cli_main(["ckpt", "convert", "run", "notes", "--to", "hf", "--force"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "notes is a directory that is not an export of ours (it holds results.txt)" in line
    assert "delete it yourself" in line and MARKER in line
    with pytest.raises(ValueError, match="not an export of ours"):
        export("run", "notes", to="hf", overwrite=True, progress=False)
    with pytest.raises(ValueError, match="not an export of ours"):  # a file export over a directory, too
        export("run", "notes", to="safetensors", overwrite=True, progress=False)
    assert _snapshot(workdir) == before

    # Our own export is replaced (here by one with more files), and nothing is left beside it.
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf"]) == 0
    assert json.loads((workdir / "hf" / MARKER).read_text())["files"] == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf", "--include", "optimizer", "--force"]) == 0
    assert "optimizer.safetensors.index.json" in json.loads((workdir / "hf" / MARKER).read_text())["files"]
    assert not [p for p in workdir.iterdir() if p.name.startswith(".hf.")]
    # ... but not once the user has put a file of their own into it
    (workdir / "hf" / "my-eval.txt").write_text("mine")
    capsys.readouterr()
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf", "--force"]) == 2
    assert "also holds my-eval.txt, which the export did not write" in _one_line(capsys.readouterr().err)
    assert (workdir / "hf" / "my-eval.txt").read_text() == "mine"
    # An HF export written before exports were marked is still recognised by its own layout and index.
    (workdir / "hf" / "my-eval.txt").unlink()
    (workdir / "hf" / MARKER).unlink()
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf", "--force"]) == 0
    # An empty directory and a plain file are replaced.
    (workdir / "empty").mkdir()
    assert cli_main(["ckpt", "convert", "model.safetensors", "empty", "--to", "dcp", "--force"]) == 0
    assert (workdir / "empty" / ".metadata").is_file()
    (workdir / "plain.pt").write_bytes(b"an older export")
    export("run", "plain.pt", to="torch", overwrite=True, progress=False)
    assert set(torch.load(workdir / "plain.pt", weights_only=True)) >= {"layers.0.attention.wq.weight"}
    assert (workdir / "notes" / "results.txt").read_text() == "three weeks of numbers"


def _convert_in_child(args: list[str], limit: int, die: bool) -> subprocess.CompletedProcess:
    """``workbench ckpt convert`` in a child whose files may not grow past ``limit`` bytes: with ``die`` the
    kernel kills it mid-write (SIGXFSZ, no cleanup runs, like SIGKILL), else its write fails (EFBIG)."""
    code = ("import resource, signal, sys\n"
            f"signal.signal(signal.SIGXFSZ, signal.{'SIG_DFL' if die else 'SIG_IGN'})\n"
            "from workbench.cli import main\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
            f"sys.exit(main({args!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)


def test_a_killed_or_failing_convert_leaves_the_old_destination_whole(workdir):
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf", "--max-shard-size", "100KiB"]) == 0
    old_hf, old_st = _snapshot(workdir / "hf"), (workdir / "model.safetensors").read_bytes()
    assert len(old_hf) > 3 and len(old_st) > 300_000

    # Killed mid-write, directory and file exports: the old DST is as it was, no partial DST.
    for dst, to in (("hf", "hf"), ("model.safetensors", "safetensors")):
        res = _convert_in_child(["ckpt", "convert", "run", dst, "--to", to, "--include", "optimizer", "--force"],
                                limit=150_000, die=True)
        assert res.returncode == -signal.SIGXFSZ, res.stderr[-2000:]
    assert _snapshot(workdir / "hf") == old_hf and (workdir / "model.safetensors").read_bytes() == old_st
    left = sorted(p.name for p in workdir.iterdir() if p.name.startswith("."))
    assert left and all(".tmp-" in n for n in left)  # the dead converts' temporaries, hidden beside DST

    # A write that fails: one line, exit 1, the old DST as it was, and its temporary gone.
    res = _convert_in_child(["ckpt", "convert", "run", "hf", "--to", "hf", "--include", "optimizer", "--force"],
                            limit=150_000, die=False)
    assert res.returncode == 1 and "too large" in _one_line(res.stderr)
    assert _snapshot(workdir / "hf") == old_hf
    # The next convert to the same DST removes the dead ones' temporaries and replaces DST whole.
    assert cli_main(["ckpt", "convert", "run", "hf", "--to", "hf", "--include", "optimizer", "--force"]) == 0
    assert cli_main(["ckpt", "convert", "run", "model.safetensors", "--to", "safetensors", "--force"]) == 0
    assert not [p for p in workdir.iterdir() if p.name.startswith(".")]
    assert "optimizer.safetensors.index.json" in os.listdir(workdir / "hf")


# -- saves that run out of space -------------------------------------------------------------------


def _full_save(root: Path, mode: str, files: range) -> tuple[CheckpointError, list[dict]]:
    """A save whose writer files ``files`` go to /dev/full (a real ENOSPC for any user on Linux): the
    Checkpointer's temporary directory for step 1 is made first, with those names linked there."""
    events: list[dict] = []
    state = _state()
    ckpt = Checkpointer(root, every=1, mode=mode, emit=lambda type, **f: events.append({"type": type, **f}))
    tmp = CheckpointStore(root).tmp_path(1, ckpt.nonce)
    tmp.mkdir(parents=True)
    for i in files:
        (tmp / f"__0_{i}.distcp").symlink_to("/dev/full")
    _step(state)
    with pytest.raises(CheckpointError) as exc:
        ckpt.after_step(state)
        ckpt.close()
    return exc.value, events


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_save_out_of_space_says_so_and_publishes_nothing(tmp_path, mode):
    root = tmp_path / "ckpt"
    err, events = _full_save(root, mode, range(WRITE_THREADS))
    msg = str(err)
    assert msg.startswith(f"checkpoint at step 1 failed: no space left on device writing checkpoint step 1 to {root} "
                          "(needs ~"), msg
    assert "free there); free space there or choose another --ckpt-dir" in msg
    assert "unexpected pos" not in msg and "CheckpointException" not in msg  # what the issue saw
    if mode == "sync":  # raised from the named error itself, an OSError with its errno
        assert isinstance(err.__cause__, StorageError) and err.__cause__.errno == errno.ENOSPC
    else:
        (failed,) = [e for e in events if e["type"] == "checkpoint"]
        assert failed["status"] == "failed" and failed["error"] == msg
    store = CheckpointStore(root)
    assert store.steps() == [] and store.latest_pointer() is None


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_save_whose_one_writer_thread_fails_is_not_published(tmp_path):
    # DCP writes a rank's files from WRITE_THREADS threads and only prints an extra thread's exception: a
    # full disk met by one of them went on to publish (here: to hash /dev/full forever). Each file in turn.
    for i in range(WRITE_THREADS):
        root = tmp_path / f"ckpt{i}"
        err, _ = _full_save(root, "sync", range(i, i + 1))
        assert "no space left on device writing checkpoint step 1" in str(err), (i, str(err))
        assert CheckpointStore(root).steps() == [] and CheckpointStore(root).latest_pointer() is None


def test_a_run_whose_directory_was_taken_over_stops_saving_there(tmp_path):
    root = tmp_path / "ckpt"
    state = _state()
    ckpt = Checkpointer(root, every=1, mode="sync", owner="run-a")
    _step(state)
    ckpt.after_step(state)  # no owner.json yet: nothing to disagree with
    CheckpointStore(root).claim({"run_id": "run-b", "run_dir": "/runs/b"}, exclusive=True)
    _step(state)
    with pytest.raises(CheckpointError, match=r"now belongs to another run \(/runs/b, owner.json\)"):
        ckpt.after_step(state)
    assert CheckpointStore(root).steps() == [1]


# -- one run per checkpoint directory ------------------------------------------------------------


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """Run A: 1 rank, 2 steps, a checkpoint every step into a --ckpt-dir outside its run directory."""
    base = tmp_path_factory.mktemp("owners")
    out, shared = base / "a", base / "shared"
    workbench.launch("tiny", out=out, nproc=1, steps=2, ckpt_every=1, ckpt_dir=str(shared), seed=3).wait(TIMEOUT_S)
    assert CheckpointStore(shared).steps() == [1, 2]
    return out, shared


@pytest.mark.multirank
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_second_run_into_the_same_ckpt_dir_is_refused_before_any_step(run_a, tmp_path, capsys):
    out_a, shared = run_a
    before, before_a = _snapshot(shared), _snapshot(out_a)
    owner = json.loads((shared / "owner.json").read_text())
    assert owner["run_dir"] == str(out_a.resolve())
    assert owner["run_id"] == json.loads((out_a / "run.json").read_text())["run_id"]
    out_b = tmp_path / "b"
    argv = ["train", "tiny", "--nproc", "1", "--steps", "2", "--ckpt-every", "1", "--ckpt-dir", str(shared),
            "--out", str(out_b)]
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--ckpt-dir {shared} belongs to the run in {out_a.resolve()}" in line
    assert "--adopt-ckpt-dir" in line and f"--resume {shared}" in line
    assert cli_main(argv + ["--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "error"
    with pytest.raises(CheckpointDirInUse, match="belongs to the run in"):
        workbench.launch("tiny", out=out_b, nproc=1, steps=2, ckpt_every=1, ckpt_dir=str(shared))
    assert not out_b.exists()  # nothing was written or started
    # --overwrite of run A does not delete a --ckpt-dir outside it, so its new run may not save there
    with pytest.raises(CheckpointDirInUse, match="never deletes a --ckpt-dir outside the run directory"):
        workbench.launch("tiny", out=out_a, nproc=1, steps=2, ckpt_every=1, ckpt_dir=str(shared), overwrite=True)
    assert _snapshot(shared) == before and _snapshot(out_a) == before_a


@pytest.mark.multirank
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_resuming_the_run_another_runs_checkpoint_or_an_adopted_directory(run_a, tmp_path):
    out_a, shared = run_a
    # A run directory and its checkpoints moved together are still one run: it resumes and saves there.
    a2, shared2 = tmp_path / "a2", tmp_path / "shared2"
    shutil.copytree(out_a, a2)
    shutil.copytree(shared, shared2)
    before = _snapshot(shared)
    workbench.launch("tiny", out=a2, nproc=1, steps=3, ckpt_every=1, ckpt_dir=str(shared2), seed=3,
                     resume="latest").wait(TIMEOUT_S)
    assert CheckpointStore(shared2).steps() == [1, 2, 3]
    assert json.loads((shared2 / "owner.json").read_text())["run_dir"] == str(a2.resolve())

    # Another run starts from A's checkpoint on purpose, saving into a directory of its own.
    b = tmp_path / "b"
    run = workbench.launch("tiny", out=b, nproc=1, steps=3, ckpt_every=1, seed=3,
                           resume=str(shared / "step-000002")).wait(TIMEOUT_S)
    assert run.resumed.step == 2 and CheckpointStore(b / "checkpoints").steps() == [3]
    assert _snapshot(shared) == before

    # Adopting a directory: this run becomes its owner and continues there; the former owner is refused.
    c = tmp_path / "c"
    workbench.launch("tiny", out=c, nproc=1, steps=4, ckpt_every=1, ckpt_dir=str(shared2), seed=3, resume="latest",
                     adopt_ckpt_dir=True).wait(TIMEOUT_S)
    owner = json.loads((shared2 / "owner.json").read_text())
    assert owner["run_dir"] == str(c.resolve()) and owner["adopted_from"] == str(a2.resolve())
    assert CheckpointStore(shared2).steps() == [1, 2, 3, 4] and is_complete(shared2 / "step-000004")[0]
    with pytest.raises(CheckpointDirInUse, match=f"belongs to the run in {c.resolve()}"):
        workbench.launch("tiny", out=a2, nproc=1, steps=5, ckpt_every=1, ckpt_dir=str(shared2), resume="latest")


def test_checkpoints_no_run_owns_are_resumed_or_adopted_not_mixed(tmp_path, capsys):
    shared = tmp_path / "old"
    st = _state()
    _step(st)
    save(shared, st)  # workbench.checkpoint.save: no run, no owner
    before = _snapshot(shared)
    argv = ["train", "tiny", "--nproc", "1", "--steps", "2", "--ckpt-every", "1", "--ckpt-dir", str(shared),
            "--out", str(tmp_path / "r")]
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--ckpt-dir {shared} already holds checkpoints (step-000001) that no run owns" in line
    assert _snapshot(shared) == before and not (tmp_path / "r").exists()


def test_the_embedding_trainer_claims_its_checkpoint_directory_too(tmp_path):
    from workbench.embedding import train_embedding

    shared = tmp_path / "shared"
    CheckpointStore(shared).claim({"run_id": uuid.uuid4().hex, "run_dir": "/runs/other"}, exclusive=True)
    with pytest.raises(CheckpointDirInUse, match="belongs to the run in /runs/other"):
        train_embedding("tiny", out=tmp_path / "e", steps=1, ckpt_every=1, ckpt_dir=str(shared), in_process=True,
                        progress=False)
    assert not (tmp_path / "e").exists() and os.listdir(shared) == ["owner.json"]


# -- --ckpt-dir and --out that cannot be written, refused before any rank starts ------------------


def _refused_before_start(argv: list[str], out: Path, capsys) -> str:
    assert cli_main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert not out.exists()  # no config.json, no events: nothing started
    return line


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", "tiny", "--nproc", "1", "--steps", "2", "--ckpt-every", "1", "--out", str(out), *extra]


def test_a_file_or_a_path_under_a_file_as_ckpt_dir_is_refused_before_any_step(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    out = tmp_path / "run"
    line = _refused_before_start(_train(out, "--ckpt-dir", str(afile)), out, capsys)
    assert f"--ckpt-dir {afile} is a file, not a directory" in line
    line = _refused_before_start(_train(out, "--ckpt-dir", str(afile / "x")), out, capsys)
    assert f"lies under {afile}, which is a file" in line  # refused for root too
    with pytest.raises(ValueError, match="is a file, not a directory"):
        workbench.launch("tiny", out=out, nproc=1, steps=2, ckpt_every=1, ckpt_dir=str(afile))
    assert afile.read_text() == "not a directory" and not out.exists()


def test_a_read_only_ckpt_dir_is_refused_before_any_step(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        probe = ro / "probe"
        try:
            probe.write_text("x")
        except PermissionError:
            pass
        else:
            probe.unlink()
            pytest.skip("this user writes into a chmod 0500 directory anyway (root); the read-only mount below "
                        "and the file cases cover it")
        out = tmp_path / "run"
        line = _refused_before_start(_train(out, "--ckpt-dir", str(ro / "ckpt")), out, capsys)
        assert "cannot be written: permission denied" in line
    finally:
        ro.chmod(0o700)


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A small tmpfs at ``path`` (needs root: skipped otherwise)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_read_only_and_full_file_systems_are_refused_before_any_step(tmp_path, capsys):
    out = tmp_path / "run"
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        line = _refused_before_start(_train(out, "--ckpt-dir", str(ro / "ckpt")), out, capsys)
        assert "cannot be written: read-only file system" in line
        assert cli_main(_train(ro / "run")) == 2  # --out there
        assert "--out" in _one_line(capsys.readouterr().err) and not (ro / "run").exists()
    with _tmpfs(tmp_path / "small", "size=256k") as small:
        line = _refused_before_start(_train(out, "--ckpt-dir", str(small)), out, capsys)
        assert f"--ckpt-dir {small} has 256.00 KiB free, and this job needs ~" in line
        assert os.listdir(small) == []


@pytest.mark.multirank
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_an_async_save_that_fills_the_disk_names_it_and_keeps_the_last_checkpoint(tmp_path, workbench_cli):
    # Room for the first checkpoint of tiny (~13 MB) but not the second: the preflight passes, step 2's
    # async save meets a full disk on both ranks.
    with _tmpfs(tmp_path / "disk", "size=20m") as disk:
        res = subprocess.run([*workbench_cli, "train", "tiny", "--nproc", "2", "--dp-shard", "2", "--steps", "3",
                              "--ckpt-every", "1", "--ckpt-async", "--ckpt-dir", str(disk), "--out",
                              str(tmp_path / "run")], capture_output=True, text=True, timeout=TIMEOUT_S)
        assert res.returncode == 1, res.stderr[-3000:]
        last = res.stderr.strip().splitlines()[-1]
        assert f"no space left on device writing checkpoint step 2 to {disk}" in last, res.stderr[-3000:]
        assert "unexpected pos" not in res.stderr
        store = CheckpointStore(disk)
        assert store.latest_pointer() == "step-000001" and is_complete(disk / "step-000001")[0]
        model = build_model(ModelConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text())["model"]),
                            seed=0)
        assert load(disk, model).step == 1
