"""Checksums taken while writing (xxh3_128), verified on load in the background; old sha256 manifests still work."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash

import workbench.checkpoint.saver as saver
from workbench.checkpoint import TrainState, is_complete, load, read_manifest, save, verify
from workbench.config import ModelConfig
from workbench.models import build_model

CFG = ModelConfig("sum-test", dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_hidden=64, vocab_size=64,
                  max_seq_len=16)


def _save_steps(root: Path, steps=(1, 2)) -> torch.nn.Module:
    model = build_model(CFG, seed=0)
    for s in steps:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        save(root, TrainState(model, step=s))
    return model


def _flip_a_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_digests_are_taken_while_writing_and_match_the_files(tmp_path, monkeypatch):
    def no_reread(*a, **k):
        raise AssertionError("a saved file was read back to hash it")

    monkeypatch.setattr(saver, "file_digest", no_reread)  # the save must not need it
    _save_steps(tmp_path, steps=(1,))
    doc = read_manifest(tmp_path / "step-000001")
    assert doc["checksum"] == "xxh3_128"
    # one file per writer thread, each with its digest taken on the way out
    assert set(doc["files"]) == {".metadata"} | {f"__0_{i}.distcp" for i in range(saver.WRITE_THREADS)}
    for name, entry in doc["files"].items():
        data = (tmp_path / "step-000001" / name).read_bytes()
        spans = entry.pop("spans", [])  # where the saver's large writes went (tests/test_checkpoint_mmap.py)
        assert entry == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
        assert len(spans) % 2 == 0 and all(o + n <= len(data) for o, n in zip(spans[0::2], spans[1::2]))
        assert (name == ".metadata") == (not spans)  # every shard of this model has a tensor over 4 KiB


def test_a_damaged_latest_is_found_while_loading_and_the_previous_step_loads(tmp_path):
    _save_steps(tmp_path)
    _flip_a_byte(tmp_path / "step-000002" / "__0_0.distcp")
    fresh = build_model(CFG, seed=3)
    assert load(tmp_path, fresh).step == 1  # the run dir: falls back past the damaged step
    ref = load(tmp_path / "step-000001", build_model(CFG, seed=4))
    assert ref.step == 1
    with pytest.raises(ValueError, match=r"cannot resume from .*step-000002: .*__0_0\.distcp: xxh3_128 differs from "
                                         r"the manifest; the file is damaged; pick another step directory"):
        load(tmp_path / "step-000002", build_model(CFG, seed=3))
    report = verify(tmp_path / "step-000002", progress=False)
    assert [p.problem for p in report.problems] == ["xxh3_128 differs from workbench.json (corrupted bytes)"]


def test_sha256_manifests_of_older_saves_still_verify_and_load(tmp_path):
    model = _save_steps(tmp_path, steps=(1,))
    step = tmp_path / "step-000001"
    doc = json.loads((step / "workbench.json").read_text())  # rewritten as saves before xxh3 wrote it
    doc.pop("checksum")
    doc["files"] = {n: {"bytes": e["bytes"], "sha256": hashlib.sha256((step / n).read_bytes()).hexdigest()}
                    for n, e in doc["files"].items()}
    (step / "workbench.json").write_text(json.dumps(doc))
    assert is_complete(step) == (True, "ok")
    assert verify(step, progress=False).ok
    fresh = build_model(CFG, seed=7)
    load(tmp_path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    _flip_a_byte(step / "__0_0.distcp")
    ok, why = is_complete(step)
    assert not ok and why.endswith("__0_0.distcp: sha256 differs from the manifest; the file is damaged")
    assert "sha256 differs from workbench.json" in str(verify(step, progress=False).problems[0])


@pytest.mark.parametrize("damaged", ["none", "largest", "smallest", "unmapped"])
def test_background_verification_names_the_damaged_file_whichever_thread_hashed_it(tmp_path, monkeypatch, damaged):
    """The checksum threads (at a lowered priority) and the caller of result() take the files one at a time;
    result() names the damaged file whoever hashed it. Mapped files are hashed in place."""
    import mmap
    import os
    import threading

    import workbench.checkpoint.store as store

    _save_steps(tmp_path, steps=(1,))
    step = tmp_path / "step-000001"
    shards = sorted(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert len(shards) == saver.WRITE_THREADS >= 3
    bad = {"largest": shards[-1], "smallest": shards[0]}.get(damaged)
    if bad is not None:
        _flip_a_byte(bad)
    maps = {}
    if damaged != "unmapped":
        for p in shards:
            with open(p, "rb") as f:
                maps[p.name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    hashed = []  # (mapping, thread, its nice): every file is hashed through buffer_digest (file_digest maps it)
    real = store.buffer_digest

    def spy(buf, *a, **k):
        hashed.append((buf, threading.current_thread().name,
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(buf, *a, **k)
    monkeypatch.setattr(store, "buffer_digest", spy)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    checker = store.BackgroundVerify(step, manifest=read_manifest(step), mapped=maps)
    why = checker.result()
    assert len(hashed) == len(shards) + 1  # the shards and .metadata, each once
    assert sum(any(x is m for m in maps.values()) for x, _, _ in hashed) == len(maps)  # the given mappings
    for _, thread, nice in hashed:
        assert nice == (mine if thread == threading.current_thread().name else min(mine + store._NICE, 19)), thread
    if bad is None:
        assert why is None and is_complete(step) == (True, "ok")
    else:
        assert why == f"{bad}: xxh3_128 differs from the manifest; the file is damaged"
        assert is_complete(step) == (False, why)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is untouched


def test_a_file_that_cannot_be_hashed_is_never_counted_intact(tmp_path):
    """A hashing thread that meets an unexpected error (here a mapping closed under it) records the file as
    unverified: a thread that died instead would leave that file's result empty, which reads as intact."""
    import mmap

    import workbench.checkpoint.store as store

    _save_steps(tmp_path, steps=(1,))
    step = tmp_path / "step-000001"
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "rb") as f:
        closed = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    closed.close()
    why = store.BackgroundVerify(step, manifest=read_manifest(step), mapped={shard.name: closed}).result()
    assert why is not None and why.startswith(f"{shard}: cannot be verified (ValueError"), why
    assert "\n" not in why
    assert store.BackgroundVerify(step, manifest=read_manifest(step)).result() is None  # the files are fine
