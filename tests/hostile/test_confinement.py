"""Files named by other files stay inside the directory that named them (issue 27, rows 5-8, 11, 12, 14).

Each test builds its hostile layout at test time from a tiny checkpoint written by our own saver and
exporter: an HF index naming a FIFO, ``/etc/passwd`` or ``../x``; a shard linked out of its directory; a
``.metadata`` linked to ``/dev/zero`` or grown past any real size; a ``.metadata`` naming data files out of
its directory; a non-UTF-8 ``workbench.json``; bit-flipped ``.metadata``; a 300k-entry safetensors
header; and, in a real ``jupyter server``, run directories and configs linked out of the root. It checks
what a user relies on: one line naming the problem, no hang (every call runs under a deadline; a call
still blocked in ``open()`` on a FIFO fails the test), nothing outside opened (an audit hook sees every
``open`` from Python), no outside byte echoed, no outside tensor exported, and the server answering an
outside path exactly as a missing one, while it keeps answering.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import threading
import time
import tracemalloc
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(240)

SECRET = 7.25  # the value of every element of the outside tensor: found in an export, it leaked
KEY = "model.output.weight"  # canonical key of a tensor every base holds
HF_KEY = "output.weight"  # its name in a names="workbench" HF export
DEADLINE_S = 30.0  # far above the milliseconds these take; only a hang reaches it

# --------------------------------------------------------------------------------------------------
# every open() from Python while `watching` is on: nothing under an outside directory may be opened
# --------------------------------------------------------------------------------------------------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # (hooks cannot be removed; this one records only inside `watching`)


class watching:
    """Collect the real paths opened from Python inside the block."""

    def __enter__(self) -> list[str]:
        global _OPENED
        _OPENED = []
        return _OPENED

    def __exit__(self, *exc) -> None:
        global _OPENED
        _OPENED = None


def _opened_under(opened: list[str], outside: Path) -> list[str]:
    out = os.path.realpath(outside)
    return [p for p in opened if p == out or p.startswith(out + os.sep)]


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------

MICRO = dict(name="micro", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32, max_seq_len=16)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """A workbench step (DCP + workbench.json), its HF export and an 'outside' directory holding a valid
    safetensors file whose one tensor is all SECRET, a copy of the step's shard and a plain text file."""
    from safetensors.torch import save_file

    from workbench.checkpoint import TrainState, export, save
    from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig
    from workbench.models import build_model

    d = tmp_path_factory.mktemp("confine")
    cfg = ModelConfig(**MICRO)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randint(0, cfg.vocab_size, (2, 8))).float().mean().backward()
    opt.step()
    job = JobConfig(model=cfg, parallel=ParallelConfig(dp_shard=1), train=TrainConfig(steps=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = save(d / "run" / "checkpoints", TrainState(model, opt, step=1),
                    manifest={"job": job.to_dict(), "layout": job.parallel.to_dict(), "step": 1})
    (d / "run" / "config.json").write_text(json.dumps(job.to_dict()))
    export(step, d / "hf", to="hf", names="workbench", progress=False)
    outside = d / "outside"
    outside.mkdir()
    shape = tuple(model.state_dict()["output.weight"].shape)
    save_file({HF_KEY: torch.full(shape, SECRET)}, str(outside / "secret.safetensors"))
    (outside / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n" * 4)
    shutil.copy(next(step.glob("__0_*.distcp")), outside / "__0_0.distcp")
    return {"dir": d, "step": step, "hf": d / "hf", "outside": outside, "run": d / "run"}


def _hf_naming(bases, tmp_path: Path, name: str, target: str | None = None) -> Path:
    """A copy of the HF export whose index maps the output weight to ``name`` (a link to ``target`` if given)."""
    hf = tmp_path / "hf"
    shutil.copytree(bases["hf"], hf)
    index = hf / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][HF_KEY] = name
    index.write_text(json.dumps(doc))
    if target is not None:
        (hf / name).symlink_to(target)
    return hf


def _step_copy(bases, tmp_path: Path) -> Path:
    step = tmp_path / "run" / "checkpoints" / bases["step"].name
    shutil.copytree(bases["step"], step)
    (step.parent / "latest").write_text(step.name + "\n")
    return step


def _deadline(fn, *args, fifo: Path | None = None, **kw):
    """``fn(*args, **kw)`` on a thread: its result or its exception, or the test fails if it is still running
    after DEADLINE_S (a reader blocked opening ``fifo`` is then released by opening the FIFO's other end)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        if fifo is not None:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open() returns, then EOF
            except OSError:
                pass
            t.join(5)
        pytest.fail(f"{getattr(fn, '__name__', fn)}{args} did not return in {DEADLINE_S:.0f} s (blocked)")
    if "error" in box:
        return box["error"]
    return box.get("value")


def _cli(capsys, *args, fifo: Path | None = None) -> tuple[int, str, str]:
    """``workbench ckpt ARGS`` in this process, under the deadline: (exit code, stdout, stderr)."""
    from workbench.cli import main

    capsys.readouterr()
    rc = _deadline(main, ["ckpt", *map(str, args)], fifo=fifo)
    out, err = capsys.readouterr()
    assert isinstance(rc, int), (args, rc)
    return rc, out, err


def _one_line_error(rc: int, err: str, *needles: str) -> str:
    assert rc in (1, 2), (rc, err)
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _commands(src: Path, good: Path, tmp_path: Path) -> list[list]:
    """The six ckpt commands, each reading ``src`` (diff twice: as A and as B)."""
    return [["inspect", src], ["verify", src], ["diff", src, good], ["diff", good, src], ["stats", src, KEY],
            ["convert", src, tmp_path / "export", "--to", "safetensors"], ["plan-load", src]]


# --------------------------------------------------------------------------------------------------
# row 5: a FIFO named by an index, or as .metadata, blocks nothing
# --------------------------------------------------------------------------------------------------

def test_index_or_metadata_naming_a_fifo_is_refused_by_every_command_without_blocking(capsys, bases, tmp_path):
    fifo_in = tmp_path / "a"
    fifo_in.mkdir()
    hf = _hf_naming(bases, fifo_in, "pipe.safetensors")
    os.mkfifo(hf / "pipe.safetensors")
    for args in _commands(hf, bases["hf"], tmp_path):
        rc, _, err = _cli(capsys, *args, fifo=hf / "pipe.safetensors")
        _one_line_error(rc, err, "pipe.safetensors", "FIFO")
        assert not (tmp_path / "export").exists()
    # an absolute name of a FIFO elsewhere on the machine is refused by its text: never opened
    elsewhere = tmp_path / "elsewhere.fifo"
    os.mkfifo(elsewhere)
    b = tmp_path / "b"
    b.mkdir()
    hf = _hf_naming(bases, b, str(elsewhere))
    for args in _commands(hf, bases["hf"], tmp_path):
        rc, _, err = _cli(capsys, *args, fifo=elsewhere)
        _one_line_error(rc, err, "model.safetensors.index.json", "outside its directory")
    # a DCP .metadata that is a FIFO
    c = tmp_path / "c"
    step = _step_copy(bases, c)
    (step / ".metadata").unlink()
    os.mkfifo(step / ".metadata")
    for args in (["inspect", step], ["verify", step], ["stats", step, KEY], ["plan-load", step]):
        rc, _, err = _cli(capsys, *args, fifo=step / ".metadata")
        _one_line_error(rc, err, ".metadata", "FIFO")


# --------------------------------------------------------------------------------------------------
# row 7: a .metadata linked to /dev/zero, or larger than any real one, is not read
# --------------------------------------------------------------------------------------------------

def test_metadata_linked_to_dev_zero_or_huge_is_refused_before_reading(capsys, bases, tmp_path):
    from workbench import safeio
    from workbench.checkpoint import inspect, verify
    from workbench.checkpoint.safeload import CheckpointFormatError

    step = _step_copy(bases, tmp_path / "zero")
    (step / ".metadata").unlink()
    (step / ".metadata").symlink_to("/dev/zero")
    huge = _step_copy(bases, tmp_path / "huge")
    with open(huge / ".metadata", "r+b") as f:  # sparse: no disk used
        f.truncate(safeio.METADATA_MAX + 1)
    for d, words in ((step, "symbolic link"), (huge, "more than a DCP .metadata can be"),
                     (Path("/dev/zero"), "character device")):  # named directly: still never read
        tracemalloc.start()
        t0 = time.perf_counter()
        err = _deadline(inspect, d)
        took = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert isinstance(err, CheckpointFormatError) and words in str(err) and "\n" not in str(err), err
        assert took < 5 and peak < 64 << 20, (took, peak)  # nothing was read: not 5.5 GB, not 1 GiB
        report = _deadline(verify, d, progress=False)
        assert not report.ok and words in report.problems[0].problem
        rc, _, out = _cli(capsys, "inspect", d)
        _one_line_error(rc, out, words)
    assert "1.00 GiB" in str(_deadline(inspect, huge))  # the message names the bound


# --------------------------------------------------------------------------------------------------
# rows 6 and 8: names out of the directory are refused by their text or their link, never opened
# --------------------------------------------------------------------------------------------------

def test_index_naming_files_outside_is_refused_without_opening_them(capsys, bases, tmp_path):
    from workbench.checkpoint import inspect, verify
    from workbench.checkpoint.formats import open_source
    from workbench.checkpoint.safeload import CheckpointFormatError

    outside = bases["outside"]
    cases = {
        "absolute": _hf_naming(bases, tmp_path / "abs", str(outside / "secret.safetensors")),
        "passwd": _hf_naming(bases, tmp_path / "passwd", str(outside / "passwd")),
        "etc": _hf_naming(bases, tmp_path / "etc", "/etc/passwd"),
        "dotdot": _hf_naming(bases, tmp_path / "dotdot", "../../outside/secret.safetensors"),
        "link": _hf_naming(bases, tmp_path / "link", "linked.safetensors", outside / "secret.safetensors"),
        "link_missing": _hf_naming(bases, tmp_path / "lm", "linked.safetensors", outside / "no-such.safetensors"),
        "missing_outside": _hf_naming(bases, tmp_path / "mo", str(outside / "no-such.safetensors")),
    }
    (tmp_path / "outside").symlink_to(outside)  # so ../../outside/ exists from the index's directory
    messages = {}
    for name, hf in cases.items():
        with watching() as opened:
            err = _deadline(inspect, hf)
            report = _deadline(verify, hf, progress=False)
            src_err = _deadline(open_source, hf)
        assert isinstance(err, CheckpointFormatError) and err.reason == "outside", (name, err)
        assert "\n" not in str(err) and not report.ok and isinstance(src_err, CheckpointFormatError)
        assert not _opened_under(opened, outside) and "/etc/passwd" not in opened, (name, opened)
        messages[name] = str(err).replace(str(hf), "HF")
    # the answer depends on the name alone, not on whether the outside file exists or what it holds
    assert messages["absolute"].replace("secret", "no-such") == messages["missing_outside"]
    assert messages["link"] == messages["link_missing"]
    for name, msg in messages.items():
        assert "root:x" not in msg and str((outside / "passwd").stat().st_size) not in msg, msg
    # convert copies nothing from outside: it fails, and no export is left
    for name in ("absolute", "dotdot", "link"):
        dst = tmp_path / f"export-{name}.safetensors"
        rc, _, err = _cli(capsys, "convert", cases[name], dst, "--to", "safetensors")
        _one_line_error(rc, err, "outside")
        assert not dst.exists()


def test_hugging_face_cache_snapshot_links_into_its_blobs_are_read(capsys, bases, tmp_path):
    """huggingface_hub's cache links ``snapshots/<rev>/<file>`` to ``../../blobs/<hash>``: that directory
    reads as a checkpoint, while a link from it to anything but its own repository's blobs is still refused."""
    from workbench.checkpoint import inspect, verify
    from workbench.checkpoint.safeload import CheckpointFormatError

    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(bases["hf"].iterdir())):
        shutil.copy(f, blobs / f"{i:040x}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"{i:040x}"))
    manifest = inspect(snap)
    assert manifest.frame["key"].size == inspect(bases["hf"]).frame["key"].size
    assert verify(snap, progress=False).ok
    rc, out, err = _cli(capsys, "stats", snap, HF_KEY, "--json")
    assert rc == 0 and json.loads(out)["key"] == HF_KEY, err
    # a link from the snapshot to a file beside blobs/, or into another repository's blobs/, is still outside
    shard = next(p for p in snap.iterdir() if p.name.endswith(".safetensors"))
    for target in (repo / "secret.safetensors", tmp_path / "models--other" / "blobs" / "x"):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bases["outside"] / "secret.safetensors", target)
        shard.unlink()
        shard.symlink_to(target)
        err = _deadline(inspect, snap)
        assert isinstance(err, CheckpointFormatError) and err.reason == "outside", (target, err)


def _metadata_naming(step: Path, rel: str) -> None:
    """Rewrite ``step``'s .metadata so that every item lives in ``rel``."""
    import dataclasses
    import pickle

    from workbench.checkpoint.safeload import read_dcp_metadata

    md = read_dcp_metadata(step)
    md.storage_data = {k: dataclasses.replace(v, relative_path=rel) for k, v in md.storage_data.items()}
    (step / ".metadata").write_bytes(pickle.dumps(md))
    (step / "workbench.json").unlink()  # plain DCP: no checksums to catch it first


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link"])
def test_metadata_naming_data_outside_is_refused_by_every_reader(capsys, bases, tmp_path, how):
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint import inspect, read_tensor, verify
    from workbench.checkpoint.safeload import CheckpointFormatError, SafeFileSystemReader

    outside = bases["outside"]
    step = _step_copy(bases, tmp_path)
    if how == "link":
        (step / "linked.distcp").symlink_to(outside / "__0_0.distcp")
        _metadata_naming(step, "linked.distcp")
    else:
        _metadata_naming(step, "../../../outside/__0_0.distcp" if how == "dotdot" else str(outside / "__0_0.distcp"))
        (tmp_path / "outside").symlink_to(outside)  # so the ../ path exists
    with watching() as opened:
        reads = [_deadline(read_tensor, step, KEY), _deadline(verify, step, progress=False)]
        t = torch.empty(MICRO["vocab_size"], MICRO["dim"])
        reads.append(_deadline(dcp.load, {KEY: t}, storage_reader=SafeFileSystemReader(str(step)), no_dist=True))
    assert not _opened_under(opened, outside), opened
    assert isinstance(reads[0], CheckpointFormatError) and "outside" in str(reads[0]) and reads[0].reason == "outside"
    assert not reads[1].ok and "outside" in str(reads[1].problems[0])
    assert isinstance(reads[2], BaseException) and not torch.equal(t, torch.full_like(t, SECRET))  # DCP's load too
    if how != "link":  # a name is refused by its text when the metadata is read, by every command
        assert isinstance(_deadline(inspect, step), CheckpointFormatError)
    for args in (["stats", step, KEY], ["convert", step, tmp_path / "out.safetensors", "--to", "safetensors"]):
        rc, _, err = _cli(capsys, *args)
        _one_line_error(rc, err, "outside")
    assert not (tmp_path / "out.safetensors").exists()


def test_manifest_and_latest_naming_outside_are_not_followed(capsys, bases, tmp_path):
    from workbench.checkpoint import inspect, verify
    from workbench.checkpoint.safeload import CheckpointFormatError
    from workbench.checkpoint.store import is_complete, resolve_checkpoint

    outside = bases["outside"]
    step = _step_copy(bases, tmp_path / "m")
    doc = json.loads((step / "workbench.json").read_text())
    doc["files"]["../../../../outside/passwd"] = {"bytes": (outside / "passwd").stat().st_size, "sha256": "0" * 64}
    (step / "workbench.json").write_text(json.dumps(doc))
    (tmp_path / "outside").symlink_to(outside)
    with watching() as opened:
        report = _deadline(verify, step, progress=False)
        ok, why = is_complete(step)
    assert not _opened_under(opened, outside), opened
    assert not report.ok and any("outside its directory" in p.problem for p in report.problems), report
    assert not ok and "outside its directory" in why
    # latest naming a directory out of the store: not followed
    run = tmp_path / "r"
    _step_copy(bases, run)
    (run / "run" / "checkpoints" / "latest").write_text("../../../outside\n")
    err = _deadline(inspect, run / "run")
    assert isinstance(err, CheckpointFormatError) and "not a step-NNNNNN name" in str(err)
    with pytest.raises(ValueError):
        resolve_checkpoint(run / "run" / "checkpoints" / "latest", complete=False)
    # workbench.json linked out of the step directory
    linked = _step_copy(bases, tmp_path / "l")
    (linked / "workbench.json").unlink()
    (linked / "workbench.json").symlink_to(outside / "passwd")
    err = _deadline(inspect, linked)
    assert isinstance(err, CheckpointFormatError) and "symbolic link" in str(err) and "root:x" not in str(err)


# --------------------------------------------------------------------------------------------------
# row 11: damaged files raise the documented error; verify never raises
# --------------------------------------------------------------------------------------------------

def test_damaged_manifest_and_metadata_raise_only_the_documented_error(bases, tmp_path):
    import random

    from workbench.checkpoint import inspect, verify
    from workbench.checkpoint.safeload import CheckpointFormatError

    step = _step_copy(bases, tmp_path / "utf8")
    raw = (step / "workbench.json").read_bytes()
    (step / "workbench.json").write_bytes(raw[:10] + b"\xff\xfe" + raw[12:])
    err = _deadline(inspect, step)
    assert isinstance(err, CheckpointFormatError) and "not UTF-8" in str(err) and "\\xff" not in str(err), err
    assert not _deadline(verify, step, progress=False).ok

    # 2-bit flips of .metadata, seeded: each read refuses with CheckpointFormatError or succeeds; verify reports.
    # The metadata is re-pickled without its save's uuid and path, so the inputs are the same bytes every run.
    import pickle

    from workbench.checkpoint.safeload import read_dcp_metadata

    good = _step_copy(bases, tmp_path / "flip")
    md = read_dcp_metadata(good)
    md.storage_meta = None
    original = pickle.dumps(md)
    (good / "workbench.json").unlink()  # plain DCP: the flips reach the metadata readers, not the checksums
    rng = random.Random(27)
    undeclared = []
    for i in range(300):
        data = bytearray(original)
        for _ in range(2):
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
        (good / ".metadata").write_bytes(bytes(data))
        for fn in (inspect, lambda p: verify(p, progress=False)):
            got = _deadline(fn, good)
            if isinstance(got, BaseException) and not isinstance(got, CheckpointFormatError):
                undeclared.append((i, type(got).__name__, str(got)[:100]))
    assert not undeclared, undeclared[:5]


def test_verify_reports_rather_than_raises_for_a_damaged_manifest(bases, tmp_path):
    from workbench.checkpoint import verify

    edits = {
        "files_list": lambda d: d.update(files=[".metadata"]),
        "entry_not_object": lambda d: d["files"].update({".metadata": 5}),
        "quant_keys_list": lambda d: d.update(quant={"mode": "int8", "keys": ["x"]}),
        "step_text": lambda d: d.update(step="seven"),
        "job_model_list": lambda d: d.update(job={"model": [1]}),
    }
    for name, edit in edits.items():
        step = _step_copy(bases, tmp_path / name)
        doc = json.loads((step / "workbench.json").read_text())
        edit(doc)
        (step / "workbench.json").write_text(json.dumps(doc))
        report = _deadline(verify, step, progress=False)
        assert not isinstance(report, BaseException), (name, report)
        assert not report.ok and "\n" not in str(report.problems[0]), (name, report)


# --------------------------------------------------------------------------------------------------
# row 12: a 300k-entry safetensors header is refused at once, naming the bound
# --------------------------------------------------------------------------------------------------

def test_a_header_larger_than_its_data_is_refused_at_once(capsys, tmp_path):
    from workbench.checkpoint import inspect
    from workbench.checkpoint.safeload import CheckpointFormatError, read_safetensors_header

    n = 300_000
    raw = ("{" + ",".join(f'"t{i}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
                          for i in range(n)) + "}").encode()  # 20 MB of header for 1.2 MB of data
    f = tmp_path / "many.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * n))
    t0 = time.perf_counter()
    err = _deadline(inspect, f)
    took = time.perf_counter() - t0
    assert isinstance(err, CheckpointFormatError) and "16 MiB" in str(err) and took < 3, (took, err)
    rc, _, out = _cli(capsys, "inspect", f)
    _one_line_error(rc, out, "many.safetensors", "larger than the")
    # a header within the bounds still reads (its data is larger than it)
    ok = tmp_path / "ok.safetensors"
    small = {f"t{i}": {"dtype": "F32", "shape": [64], "data_offsets": [256 * i, 256 * i + 256]} for i in range(1000)}
    raw = json.dumps(small).encode()
    ok.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(256 * 1000))
    assert len(read_safetensors_header(ok)[0]) == 1000


# --------------------------------------------------------------------------------------------------
# rows 5, 6 and 14 in a real jupyter server
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(bases, tmp_path_factory):
    from test_jupyter_server import _start_server, _stop, _wait_ready  # tests/ (the real-server fixtures)

    base = tmp_path_factory.mktemp("jconfine")
    root = base / "root"
    root.mkdir()
    outside = bases["outside"]
    shutil.copytree(bases["hf"], root / "hf")
    for name, target in (("hf_passwd", str(outside / "passwd")), ("hf_missing", str(outside / "no-such")),
                         ("hf_etc", "/etc/passwd"), ("hf_etc_missing", "/etc/no-such-file-27")):
        _hf_naming(bases, root / "tmp", target)
        (root / "tmp" / "hf").rename(root / name)
    _hf_naming(bases, root / "tmp", "pipe.safetensors")
    (root / "tmp" / "hf").rename(root / "hf_fifo")
    os.mkfifo(root / "hf_fifo" / "pipe.safetensors")
    # run directories: one whose events.jsonl and config.json are links out of the root, one without events
    shutil.copytree(bases["run"], root / "run_link")
    (outside / "events.jsonl").write_text(json.dumps({"type": "step", "rank": 0, "step": 0, "loss": SECRET}) + "\n")
    (root / "run_link" / "events.jsonl").symlink_to(outside / "events.jsonl")
    (root / "run_link" / "config.json").unlink()
    (root / "run_link" / "config.json").symlink_to(bases["run"] / "config.json")
    shutil.copytree(bases["run"], root / "run_none")
    # a visible name for a hidden directory
    (root / ".hidden").mkdir()
    (root / ".hidden" / "notes.json").write_text("{}")
    (root / "visible").symlink_to(root / ".hidden", target_is_directory=True)
    srv = _start_server(base, root)
    try:
        _wait_ready(srv)
        yield srv
    finally:
        _stop(srv.proc)


def test_server_answers_outside_as_missing_and_never_opens_a_fifo(server):
    # an index naming a file outside: 404, the same words whether that file exists or not, none of its bytes
    a = server.error("open", 404, path="hf_passwd")
    b = server.error("open", 404, path="hf_missing")
    assert a.replace("hf_passwd", "X").replace("passwd", "no-such") == b.replace("hf_missing", "X")
    c = server.error("checkpoint/manifest", 404, path="hf_etc")
    d = server.error("checkpoint/manifest", 404, path="hf_etc_missing")
    assert c.replace("hf_etc", "X").replace("passwd", "no-such-file-27") == d.replace("hf_etc_missing", "X")
    for msg in (a, c):
        assert "root:x" not in msg and "bytes" not in msg and "header" not in msg, msg
    # 12 requests at a checkpoint whose index names a FIFO: each answered at once, and the server still answers
    endpoints = ["open", "checkpoint/manifest", "checkpoint/verify", "checkpoint/tensor"] * 3
    t0 = time.perf_counter()
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda ep: server.get(ep, path="hf_fifo", key=KEY), endpoints))
    assert time.perf_counter() - t0 < 25
    for status, body in answers:
        assert status == 422 and "FIFO" in body["error"], (status, body)
    assert server.ok("open", path="hf")["format"] == "hf"


def test_server_does_not_follow_run_files_or_hidden_targets_out(server):
    # run/events: an events.jsonl linked out of the root is a run with no events (the same 404 words)
    linked = server.error("run/events", 404, path="run_link")
    none = server.error("run/events", 404, path="run_none")
    assert linked.replace("run_link", "X") == none.replace("run_none", "X")
    # plan-load like=: a run whose config.json is a link out of the root is not read
    msg = server.error("checkpoint/plan-load", 404, path="hf", like="run_link")
    assert "run_link/config.json" in msg
    # a visible link to a hidden directory is hidden (the server does not allow hidden files)
    assert "hidden" in server.error("open", 403, path="visible/notes.json")
    assert server.ok("open", path="hf")["format"] == "hf"


def test_server_refuses_a_fifo_named_directly(server):
    assert "FIFO" in server.error("open", 422, path="hf_fifo/pipe.safetensors")
    assert server.ok("open", path="hf")["format"] == "hf"
