"""Checkpoint tools on real files: inspect, verify, diff, convert, plan-load, and the `workbench ckpt` CLI.

Checkpoints are written the way the trainer writes them (DCP FileSystemWriter + workbench.json, keys
``model.* / optim.* / rng.* / extra.*``): one process without a process group for most tests, and one
real 2-rank gloo FSDP2 job (torchrun) for shards written by different ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from workbench.checkpoint import (CheckpointFormatError, diff, export, inspect, iter_tensors, load_into, plan_load,
                                  read_tensor, verify)
from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
from workbench.models import build_model

TINY = PRESETS["tiny"]


# --------------------------------------------------------------------------------------------------
# fixtures: checkpoints written per the contract
# --------------------------------------------------------------------------------------------------

def _files_manifest(step_dir: Path) -> dict:
    return {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for f in sorted(step_dir.iterdir()) if f.name != "workbench.json"}


def write_checkpoint(run_dir: Path, *, step: int = 1, seed: int = 0, preset: str = "tiny", optim: bool = True,
                     mutate=None) -> Path:
    """One process, no process group: ``run_dir/checkpoints/step-NNNNNN`` + workbench.json + latest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    cfg = PRESETS[preset]
    model = build_model(cfg, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    torch.manual_seed(seed)
    for _ in range(step):
        model(torch.randint(0, cfg.vocab_size, (2, 16))).float().mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    sd = {"model": dict(msd), "rng": {"rank0": {"torch": torch.get_rng_state()}}, "extra": {"step": torch.tensor(step)}}
    if optim:
        sd["optim"] = osd
    if mutate:
        mutate(sd)
    step_dir = run_dir / "checkpoints" / f"step-{step:06d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(step_dir), no_dist=True)
    layout = ParallelConfig(dp_shard=1)
    job = JobConfig(model=cfg, parallel=layout, train=TrainConfig())
    (step_dir / "workbench.json").write_text(json.dumps({
        "format": "workbench-checkpoint", "version": 1, "step": step, "consumed_samples": 8 * step, "world_size": 1,
        "layout": layout.to_dict(), "job": job.to_dict(), "kinds": ["model", "optim", "rng", "extra"],
        "files": _files_manifest(step_dir), "created": time.time(), "ema": False}))
    (run_dir / "checkpoints" / "latest").write_text(step_dir.name)
    return step_dir


_TWO_RANK_WRITER = textwrap.dedent('''
    import hashlib, json, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
    from workbench.mesh import build_mesh
    from workbench.models import build_model
    from workbench.parallel.apply import build_optimizer, parallelize

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pcfg = ParallelConfig(dp_shard=world)
    mesh = build_mesh(pcfg)
    model = parallelize(build_model(PRESETS["tiny"], seed=0), pcfg, mesh)
    opt = build_optimizer(model, pcfg, mesh, lr=1e-3, foreach=False)
    torch.manual_seed(rank)
    model(torch.randint(0, 256, (2, 16))).float().mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    step_dir = out / "checkpoints" / "step-000001"
    dcp.save({"model": msd, "optim": osd, "rng": {f"rank{rank}": {"torch": torch.get_rng_state()}},
              "extra": {"step": torch.tensor(1)}}, checkpoint_id=str(step_dir))
    dist.barrier()
    if rank == 0:
        files = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                 for f in sorted(step_dir.iterdir())}
        job = JobConfig(model=PRESETS["tiny"], parallel=pcfg, train=TrainConfig())
        (step_dir / "workbench.json").write_text(json.dumps({"format": "workbench-checkpoint", "version": 1,
            "step": 1, "consumed_samples": 8, "world_size": world, "layout": pcfg.to_dict(), "job": job.to_dict(),
            "kinds": ["model", "optim", "rng", "extra"], "files": files, "created": time.time(), "ema": False}))
        (out / "checkpoints" / "latest").write_text("step-000001")
    dist.barrier()
    dist.destroy_process_group()
    from workbench.lifeline import exit_now
    exit_now(0)  # a gloo teardown race at interpreter exit can abort a finished rank
''')


@pytest.fixture(scope="module")
def ckpt1(tmp_path_factory) -> Path:
    """A one-process tiny checkpoint (model + AdamW + rng + extra) in a run directory."""
    run = tmp_path_factory.mktemp("run1")
    write_checkpoint(run)
    return run


@pytest.fixture(scope="module")
def ckpt2(tmp_path_factory) -> Path:
    """A real 2-rank gloo FSDP2 (dp_shard=2) checkpoint: every weight is split by rows between two files."""
    run = tmp_path_factory.mktemp("run2")
    script = run / "writer.py"
    script.write_text(_TWO_RANK_WRITER)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(run)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return run


class _Res:
    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _main(capsys, *args) -> _Res:
    """`workbench ckpt ARGS` in this process: the console script's parser and handlers, no interpreter start."""
    from workbench.cli import main

    capsys.readouterr()
    rc = main(["ckpt", *map(str, args)])
    out, err = capsys.readouterr()
    return _Res(rc, out, err)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "workbench.cli", "ckpt", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def _copy_step(run: Path, tmp_path: Path, name="copy") -> Path:
    src = run / "checkpoints" / "step-000001"
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------------
# inspect
# --------------------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_inspect_two_rank_fsdp_checkpoint_names_each_ranks_block(ckpt2):
    m = inspect(ckpt2)  # a run directory resolves through checkpoints/latest
    assert m.format == "workbench" and m.path.name == "step-000001"
    assert list(m.frame.columns) == ["key", "dtype", "shape", "bytes", "kind", "shards"]
    s = m.summary()
    assert s["world_size"] == 2 and s["layout_description"] == "dp_shard=2" and s["step"] == 1
    # model bytes = the parameters, 4 bytes each; AdamW keeps two more of each (+ 4-byte step counters)
    assert s["bytes_by_kind"]["model"] == TINY.n_params * 4
    assert s["bytes_by_kind"]["optimizer"] == 2 * TINY.n_params * 4 + 48 * 4
    assert s["n_params_model"] == TINY.n_params
    wq = m.row("model.layers.0.attention.wq.weight")
    assert wq["shape"] == (128, 128) and wq["dtype"] == "float32" and wq["kind"] == "model"
    blocks = sorted((sh["rank"], sh["file"], tuple(sh["offsets"]), tuple(sh["lengths"])) for sh in wq["shards"])
    assert blocks == [(0, "__0_0.distcp", (0, 0), (64, 128)), (1, "__1_0.distcp", (64, 0), (64, 128))]
    shards = m.shards()
    assert set(shards["rank"]) == {0, 1}
    # every path form resolves to the same step, and the JSON is complete
    for p in (ckpt2 / "checkpoints", ckpt2 / "checkpoints" / "latest", m.path, m.path / ".metadata"):
        assert inspect(p).path == m.path
    doc = json.loads(m.to_json())
    assert len(doc["tensors"]) == len(m) and doc["summary"]["bytes_by_kind"] == s["bytes_by_kind"]


def test_inspect_kinds_and_non_tensor_values(ckpt1):
    m = inspect(ckpt1 / "checkpoints")
    kinds = dict(zip(m.frame["key"], m.frame["kind"]))
    assert kinds["model.norm.weight"] == "model"
    assert kinds["optim.state.norm.weight.exp_avg"] == "optimizer"
    assert kinds["rng.rank0.torch"] == "rng" and kinds["extra.step"] == "extra"
    # AdamW hyperparameters are pickled plain values in DCP: listed with their size, never unpickled
    lr = [r for r in m.frame.to_dict("records") if r["key"].endswith(".lr")]
    assert lr and all(r["dtype"] == "bytes" and r["shape"] is None and r["kind"] == "optimizer" for r in lr)
    with pytest.raises(CheckpointFormatError, match="pickled value, not a tensor"):
        from workbench.checkpoint.formats import open_source

        src = open_source(m)
        src._read_stored(lr[0]["key"])


def test_kind_heuristics_for_other_tools_keys():
    from workbench.checkpoint.manifest import classify

    assert classify("state_dict.encoder.weight") == "model"
    assert classify("optimizer.state.0.exp_avg") == "optimizer"
    assert classify("opt.state.3.momentum_buffer") == "optimizer"
    assert classify("ema.layers.0.w") == "extra" and classify("sched.last_epoch") == "extra"
    assert classify("cuda_rng_state") == "rng" and classify("encoder.layer.0.weight") == "model"
    assert classify("epoch", is_tensor=False) == "extra"


# --------------------------------------------------------------------------------------------------
# safe reading: nothing is ever executed
# --------------------------------------------------------------------------------------------------

class _Exploit:
    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return (self.call, (self.arg,))


def _dotted_global_pickle(module: str, name: str, arg: str) -> bytes:
    """Protocol 4 resolves ``name`` with dots: an allowed module's ``os.system`` is os.system."""
    def s(text: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(text)]) + text.encode()
    return b"\x80\x04" + s(module) + s(name) + pickle.STACK_GLOBAL + s(arg) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP


@pytest.mark.parametrize("how", ["os.system", "builtins.exec", "dotted"])
def test_malicious_metadata_is_refused_without_running_it(capsys, ckpt1, tmp_path, how):
    step = _copy_step(ckpt1, tmp_path)
    marker = tmp_path / "pwned"
    if how == "os.system":
        payload = pickle.dumps(_Exploit(os.system, f"touch {marker}"))
    elif how == "builtins.exec":
        payload = pickle.dumps(_Exploit(exec, f"open({str(marker)!r}, 'w').write('x')"))
    else:  # a module DCP metadata really uses, and a dotted name that walks out of it
        payload = _dotted_global_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}")
    (step / ".metadata").write_bytes(payload)
    # as a user types it (a fresh process) for one payload, in this process for the other
    res = _cli("inspect", step) if how == "os.system" else _main(capsys, "inspect", step)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {step / '.metadata'}: refusing to unpickle")
    assert ("system" in lines[0] or "exec" in lines[0]) and "not DCP metadata" in lines[0]
    # the library paths refuse too: verify reports it, and DCP's own loader never sees a plain pickle.load
    report = verify(step, progress=False)
    assert not report.ok and "refusing to unpickle" in report.problems[0].problem
    from workbench.checkpoint.safeload import SafeFileSystemReader

    with pytest.raises(CheckpointFormatError):
        SafeFileSystemReader(str(step)).read_metadata()
    assert not marker.exists()


def test_truncated_and_garbled_metadata_are_one_line_errors(capsys, ckpt1, tmp_path):
    step = _copy_step(ckpt1, tmp_path)
    md = step / ".metadata"
    md.write_bytes(md.read_bytes()[:200])
    res = _main(capsys, "inspect", step)
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"error: {md}: broken DCP metadata") and "restore it" in res.stderr
    md.write_bytes(b"not a pickle at all")
    res = _main(capsys, "verify", step, "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and doc["ok"] is False and doc["problems"][0]["file"] == str(md)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_safetensors_header_that_lies_is_refused(capsys, tmp_path):
    f = tmp_path / "w.safetensors"
    _write_safetensors(f, {"a": torch.ones(4, 4), "b": torch.zeros(3)})
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["a"]["shape"] = [400, 4]  # claims 6400 bytes; its offsets span 64
    body = json.dumps(header).encode()
    liar = tmp_path / "liar.safetensors"
    liar.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    res = _main(capsys, "inspect", liar)
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"error: {liar}: tensor 'a' F32[400, 4] needs 6400 bytes")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-8])  # the last tensor runs past the end of the file
    res = _main(capsys, "verify", cut)
    assert res.returncode == 1 and "ends at byte" in res.stderr and str(cut) in res.stderr
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointFormatError, match="header claims"):
        inspect(huge)


def test_torch_save_is_read_with_weights_only(capsys, tmp_path):
    f = tmp_path / "ok.pt"
    torch.save({"model": {"w": torch.ones(2, 3)}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2, 3)}}},
                "epoch": 3}, f)
    m = inspect(f)
    rows = {r["key"]: r for r in m.frame.to_dict("records")}
    assert rows["model.w"]["shape"] == (2, 3) and rows["model.w"]["kind"] == "model"
    assert rows["optimizer.state.0.exp_avg"]["kind"] == "optimizer" and rows["epoch"]["kind"] == "extra"
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt"
    torch.save({"x": _Exploit(os.system, f"touch {marker}")}, bad)
    res = _main(capsys, "inspect", bad)
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and "refusing to unpickle" in res.stderr
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------------

def test_verify_catches_truncation_corruption_and_leftovers(capsys, ckpt1, tmp_path):
    step = _copy_step(ckpt1, tmp_path)
    report = verify(step, progress=False)
    assert report.ok, report
    assert report.checked["files_hashed"] == 2 and report.checked["chunks"] >= report.checked["tensors"]
    shard = step / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # one flipped byte
    report = verify(step, progress=False)
    assert [p.problem for p in report.problems] == ["sha256 differs from workbench.json (corrupted bytes)"]
    shard.write_bytes(data[: len(data) // 2])
    res = _main(capsys, "verify", step)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [  # one line per bad file
        f"error: {shard}: has {len(data) // 2} bytes, workbench.json recorded {len(data)}; "
        "the file is truncated or was rewritten; restore it or use another step"]
    res = _main(capsys, "diff", step, ckpt1)  # reading a tensor whose bytes are gone: one line, the file named
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert res.stderr.startswith(f"error: {shard}: cannot read '") and "restore it" in res.stderr
    shard.write_bytes(data)
    (step / "__7_0.distcp").write_bytes(b"x")  # left over from another save
    assert [str(p) for p in verify(step, progress=False).problems] == [
        f"{step / '__7_0.distcp'}: is not listed in workbench.json (not part of this save); remove it; it is left "
        "over from another save"]
    # plain DCP (no workbench.json): truncation is still caught from .metadata's byte ranges
    (step / "workbench.json").unlink()
    shard.write_bytes(data[: len(data) // 2])
    (problem,) = verify(step, progress=False).problems
    assert problem.file == str(shard) and problem.problem.startswith(f"has {len(data) // 2} bytes but .metadata places")
    assert problem.problem.endswith("the file is truncated")


def test_verify_finds_gaps_and_overlaps_in_chunk_tiling(ckpt1, tmp_path):
    from workbench.checkpoint.safeload import read_dcp_metadata
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    step = _copy_step(ckpt1, tmp_path)
    (step / "workbench.json").unlink()
    md = read_dcp_metadata(step)
    key = "model.layers.0.attention.wq.weight"
    chunk = md.state_dict_metadata[key].chunks[0]
    # rewrite the (trusted, locally written) metadata: the chunk now covers only half of the rows
    md.state_dict_metadata[key].chunks = [ChunkStorageMetadata(offsets=chunk.offsets, sizes=torch.Size([64, 128]))]
    (step / ".metadata").write_bytes(pickle.dumps(md))
    report = verify(step, progress=False)
    assert [p.problem for p in report.problems] == [f"{key} chunks cover 8192 of 16384 elements of [128, 128] (gaps)"]
    md.state_dict_metadata[key].chunks = [chunk, ChunkStorageMetadata(offsets=torch.Size([64, 0]),
                                                                      sizes=torch.Size([64, 128]))]
    (step / ".metadata").write_bytes(pickle.dumps(md))
    problems = [p.problem for p in verify(step, progress=False).problems]
    assert f"{key} chunks at [0, 0] and [64, 0] overlap" in problems


@pytest.mark.multirank
def test_verify_two_rank_checkpoint_and_a_missing_rank_file(capsys, ckpt2, tmp_path):
    report = verify(ckpt2, progress=False)
    assert report.ok and report.checked["files_hashed"] == 3
    step = _copy_step(ckpt2, tmp_path)
    (step / "__1_0.distcp").unlink()
    res = _main(capsys, "verify", step, "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 1 and not doc["ok"]
    assert {p["problem"] for p in doc["problems"]} >= {"listed in workbench.json but missing",
                                                       "named by .metadata but missing"}


# --------------------------------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------------------------------

def test_diff_names_added_removed_reshaped_and_the_largest_change(capsys, ckpt1, tmp_path):
    fqn = "layers.2.feed_forward.w2.weight"
    key = "model." + fqn

    def mutate(sd):  # sd["model"] maps FQNs (DCP adds the "model." prefix when it flattens)
        sd["model"][fqn] = sd["model"][fqn] + 0.5
        del sd["model"]["layers.4.ffn_norm.weight"]
        sd["model"]["new.weight"] = torch.ones(3)
        sd["model"]["norm.weight"] = torch.ones(64)

    # the same seed and step as ckpt1, so everything else is bit-identical
    b = write_checkpoint(tmp_path / "b", mutate=mutate)
    d = diff(ckpt1, b, progress=False)
    assert d.added == ["model.new.weight"] and d.removed == ["model.layers.4.ffn_norm.weight"]
    assert d.changed.to_dict("records") == [{"key": "model.norm.weight", "kind": "model", "a_dtype": "float32",
                                            "a_shape": (128,), "b_dtype": "float32", "b_shape": (64,)}]
    top = d.top(3)
    assert top.loc[0, "key"] == key and abs(top.loc[0, "max_abs"] - 0.5) < 1e-6
    a_w = read_tensor(ckpt1, key)
    assert abs(top.loc[0, "rel_norm"] - 0.5 * a_w.numel() ** 0.5 / float(a_w.norm())) < 1e-4
    assert int((~d.values["equal"]).sum()) == 1  # nothing else moved
    assert diff(ckpt1, ckpt1, progress=False).identical
    res = _main(capsys, "diff", ckpt1, b, "--json", "--top", "2")
    doc = json.loads(res.stdout)
    # only keys that changed are ranked (one here), however large --top is
    assert res.returncode == 0 and doc["top_changes"][0]["key"] == key and len(doc["top_changes"]) == 1


# --------------------------------------------------------------------------------------------------
# formats
# --------------------------------------------------------------------------------------------------

def test_export_hf_sharded_with_optimizer_set_and_import_back(capsys, ckpt1, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "hf"
    res = export(ckpt1, out, to="hf", include=["model", "optimizer"], max_shard_size="1MB", names="workbench",
                 progress=False)
    assert res.by_kind == {"model": TINY.n_params * 4, "optimizer": 2 * TINY.n_params * 4 + 48 * 4}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == TINY.n_params * 4
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 5 and files[0] == "model-00001-of-00005.safetensors"
    assert set(index["weight_map"]) == set(build_model(TINY, seed=None, device="meta").state_dict())  # "model." stripped
    opt_index = json.loads((out / "optimizer.safetensors.index.json").read_text())
    assert all(k.startswith("optim.state.") for k in opt_index["weight_map"])
    assert sorted(set(opt_index["weight_map"].values()))[-1].startswith("optimizer-0000")
    for f in files:  # shards respect the size limit, and the safetensors library reads what we wrote
        assert (out / f).stat().st_size <= 1_000_000 + 4096
        with safe_open(str(out / f), "pt") as st:
            for k in st.keys():
                assert torch.equal(st.get_tensor(k), read_tensor(ckpt1, "model." + k))
    assert verify(out, progress=False).ok
    back = tmp_path / "dcp"
    export(out, back, to="dcp", include=["model", "optimizer"], progress=False)
    d = diff(ckpt1, back, kinds=["model", "optimizer"], progress=False)
    assert d.identical and len(d.values) == 48 * 4
    bad = _main(capsys, "convert", ckpt1, out, "--to", "hf")
    assert bad.returncode == 2 and "already exists" in bad.stderr and bad.stderr.count("\n") == 1


def test_export_consolidated_safetensors_torch_and_load_into_a_model(capsys, ckpt1, tmp_path):
    from safetensors.torch import load_file

    st = tmp_path / "model.safetensors"
    res = _main(capsys, "convert", ckpt1, st, "--to", "safetensors", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["tensors"] == 48
    loaded = load_file(str(st))
    ref = dict(iter_tensors(ckpt1, kinds=["model"], progress=False))
    assert loaded.keys() == {k.removeprefix("model.") for k in ref}
    assert all(torch.equal(loaded[k.removeprefix("model.")], v) for k, v in ref.items())
    pt = tmp_path / "model.pt"
    export(ckpt1, pt, to="torch", progress=False)
    sd = torch.load(pt, weights_only=True)
    assert all(torch.equal(sd[k.removeprefix("model.")], v) for k, v in ref.items())
    for src in (st, pt, ckpt1):
        model = build_model(TINY, seed=123)
        assert load_into(model, src, progress=False) == {"missing": [], "unexpected": []}
        assert all(torch.equal(p, ref["model." + n]) for n, p in model.state_dict().items())


def test_hf_llama_names_keep_attention_scores(ckpt1, tmp_path):
    """HF Llama rotates halves, this model rotates pairs: the q/k permutation makes the scores equal."""
    from workbench.models.llama import apply_rope, rope_tables

    out = tmp_path / "llama"
    export(ckpt1, out, to="hf", names="hf-llama", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"] and "lm_head.weight" in index["weight_map"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_key_value_heads"] == TINY.n_kv_heads and cfg["architectures"] == ["LlamaForCausalLM"]
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(set(index["weight_map"].values())):
        hf.update(load_file(str(out / f)))
    wq, wk = read_tensor(ckpt1, "model.layers.0.attention.wq.weight"), read_tensor(ckpt1, "model.layers.0.attention.wk.weight")
    x = torch.randn(1, 10, TINY.dim)
    hd = TINY.head_dim
    cos, sin = rope_tables(hd, 10, TINY.rope_theta)
    q = apply_rope((x @ wq.T).view(1, 10, TINY.n_heads, hd), cos, sin)
    k = apply_rope((x @ wk.T).view(1, 10, TINY.n_kv_heads, hd), cos, sin)

    def rotate_half(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return torch.cat((-t2, t1), dim=-1)

    c2, s2 = torch.cat((cos, cos), -1)[None, :, None, :], torch.cat((sin, sin), -1)[None, :, None, :]
    qh = (x @ hf["model.layers.0.self_attn.q_proj.weight"].T).view(1, 10, TINY.n_heads, hd)
    kh = (x @ hf["model.layers.0.self_attn.k_proj.weight"].T).view(1, 10, TINY.n_kv_heads, hd)
    qh, kh = qh * c2 + rotate_half(qh) * s2, kh * c2 + rotate_half(kh) * s2
    rep = TINY.n_heads // TINY.n_kv_heads
    scores = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(rep, 2))
    scores_hf = torch.einsum("bshd,bthd->bhst", qh, kh.repeat_interleave(rep, 2))
    torch.testing.assert_close(scores_hf, scores, rtol=1e-5, atol=1e-5)
    assert diff(ckpt1, out, kinds=["model"], progress=False).identical  # read back through the inverse mapping


def test_streaming_export_peak_memory_is_far_below_model_size(tmp_path):
    """'small' (25M params, 100 MB fp32): safetensors export holds about one tensor at a time.

    A thread samples the process's anonymous resident memory while exporting; torch.save output, which must hold
    the whole dict, is the control that shows the measurement sees a model-sized allocation.
    """
    run = tmp_path / "small"
    write_checkpoint(run, preset="small", optim=False, step=0)
    measure = textwrap.dedent(f'''
        import json, os, threading, time
        from workbench.checkpoint import export, inspect

        def rss():  # anonymous resident memory: what the process allocated (file-backed pages excluded)
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

        def growth(fn):
            base, peak, done = rss(), [0], threading.Event()
            def sample():
                while not done.is_set():
                    peak[0] = max(peak[0], rss())
                    time.sleep(0.002)
            t = threading.Thread(target=sample); t.start()
            try:
                fn()
            finally:
                done.set(); t.join()
            return max(peak[0], rss()) - base

        m = inspect({str(run)!r})
        export(m, {str(tmp_path / "warm.safetensors")!r}, to="safetensors", include=["rng"], progress=False)
        st = growth(lambda: export(m, {str(tmp_path / "s.safetensors")!r}, to="safetensors", progress=False))
        pt = growth(lambda: export(m, {str(tmp_path / "s.pt")!r}, to="torch", progress=False))
        print(json.dumps({{"safetensors": st, "torch": pt, "model_bytes": m.summary()["bytes_by_kind"]["model"],
                           "largest": int(m.frame["bytes"].max())}}))
    ''')
    res = subprocess.run([sys.executable, "-c", measure], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["model_bytes"] == PRESETS["small"].n_params * 4
    print(f"RSS growth while exporting a {r['model_bytes'] / 1e6:.1f} MB model: safetensors (streaming) "
          f"{r['safetensors'] / 1e6:.1f} MB, torch.save (whole dict) {r['torch'] / 1e6:.1f} MB; "
          f"largest tensor {r['largest'] / 1e6:.1f} MB")
    assert r["torch"] > 0.8 * r["model_bytes"]  # the control: a whole-model allocation is seen
    assert r["safetensors"] < 0.2 * r["model_bytes"], r


# --------------------------------------------------------------------------------------------------
# plan-load
# --------------------------------------------------------------------------------------------------

def test_plan_load_layouts_and_models(capsys, ckpt1):
    p = plan_load(ckpt1, "dp_shard=2,tp=2")
    assert p.loadable and p.world_size == 4 and p.checked == 48 * 4 and not p.missing and not p.reshaped
    assert plan_load(ckpt1, "--dp-shard 2 --tp 2 --sp").target_description == "dp_shard=2 x tp=2 x sp"
    assert any("RNG states of 1 rank" in n for n in p.notes)
    bad = plan_load(ckpt1, ParallelConfig(dp_shard=1, tp=3))
    assert not bad.loadable and bad.layout_error == "tp=3 does not divide n_heads=8; choose tp in {1, 2, 4}"
    other = plan_load(ckpt1, {"dp_shard": 1}, model="small")
    assert not other.loadable
    assert {"key": "model.tok_embeddings.weight", "checkpoint_shape": [256, 128], "target_shape": [256, 512]} in other.reshaped
    assert "model.layers.7.attention.wq.weight" in other.missing
    res = _main(capsys, "plan-load", ckpt1, "--tp", "3", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reasons"][0].startswith("layout: tp=3")
    res = _main(capsys, "plan-load", ckpt1, "--dp-shard", "2", "--tp", "2")
    assert res.returncode == 0 and res.stdout.startswith("loadable:")


def test_plan_load_weights_only_export(ckpt1, tmp_path):
    st = tmp_path / "w.safetensors"
    export(ckpt1, st, to="safetensors", progress=False)
    assert not plan_load(st, "tp=2").loadable  # a resume needs the optimizer state too
    p = plan_load(st, "tp=2", full_state=False)
    assert p.loadable and any("convert to DCP" in n for n in p.notes)


@pytest.mark.multirank
def test_shard_map_figure_colours_blocks_by_rank(ckpt2):
    from workbench.widgets.checkpoint_browser import plot_shard_map

    row = inspect(ckpt2).row("model.layers.1.feed_forward.w1.weight")  # (384, 128) split by rows
    fig = plot_shard_map(row)
    assert [t.name for t in fig.data] == ["rank 0", "rank 1"]
    assert [tuple(t.y) for t in fig.data] == [(0, 0, 192, 192, 0), (192, 192, 384, 384, 192)]
    assert fig.data[0].fillcolor != fig.data[1].fillcolor


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

def test_cli_inspect_text_and_json(capsys, ckpt1):
    res = _main(capsys, "inspect", ckpt1, "--filter", "wq", "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["status"] == "ok" and all("wq" in t["key"] for t in doc["tensors"])
    model = [t for t in doc["tensors"] if t["kind"] == "model"]
    assert len(model) == 5 and all(t["n_shards"] == 1 and t["shape"] == [128, 128] for t in model)
    res = _main(capsys, "inspect", ckpt1, "--kind", "model", "--limit", "3")
    assert res.returncode == 0 and "model.tok_embeddings.weight" in res.stdout and "45 more" in res.stdout
    res = _main(capsys, "inspect", ckpt1 / "nope")
    assert res.returncode == 1 and res.stderr.strip() == f"error: {ckpt1 / 'nope'}: no such file or directory; check the path"


def test_cli_kind_names_are_the_one_vocabulary(capsys, ckpt1, tmp_path):
    """--kind / --include take workbench.kinds' checkpoint kinds, in any case and by key prefix (optim)."""
    from workbench.kinds import CHECKPOINT_KINDS

    res = _main(capsys, "inspect", ckpt1, "--kind", "Optim", "--json")
    kinds = {t["kind"] for t in json.loads(res.stdout)["tensors"]}
    assert res.returncode == 0 and kinds == {"optimizer"}
    with pytest.raises(SystemExit) as exc:  # argparse's usage error
        _main(capsys, "inspect", ckpt1, "--kind", "grads")
    assert exc.value.code == 2 and "grads" in capsys.readouterr().err
    res = _main(capsys, "convert", ckpt1, tmp_path / "out", "--to", "hf", "--include", "OPTIM", "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and {f.split("-")[0].split(".")[0] for f in doc["files"]} >= {"model", "optimizer"}
    res = _main(capsys, "convert", ckpt1, tmp_path / "bad", "--to", "hf", "--include", "gradient")
    assert res.returncode == 2 and str(list(CHECKPOINT_KINDS)) in res.stderr


def test_reads_what_the_trainers_checkpointer_writes(tmp_path):
    """Contract guard: workbench.checkpoint.save (the trainer's writer) -> inspect / verify / plan-load / export."""
    from workbench.checkpoint import TrainState, save

    model = build_model(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    state = TrainState(model, opt, sched, None, rank=0)
    state.step = 3
    save(tmp_path / "checkpoints", state)
    m = inspect(tmp_path)
    assert m.format == "workbench" and m.step == 3
    by_kind = m.summary()["bytes_by_kind"]
    assert by_kind["model"] == TINY.n_params * 4 and by_kind["optimizer"] >= 2 * TINY.n_params * 4
    assert set(m.frame["kind"]) <= {"model", "optimizer", "rng", "extra"}
    assert verify(m, progress=False).ok
    assert plan_load(m, "tp=2", model="tiny").loadable
    st = tmp_path / "w.safetensors"
    export(m, st, to="safetensors", progress=False)
    assert diff(m, st, kinds=["model"], progress=False).identical
    # its hyper-parameters are packed (one JSON item): compared by value, never ranked as a tensor
    (item,) = [k for k in m.keys if k.startswith("optim.hyper.")]
    same = diff(m, m, kinds=["optim"], progress=False)
    assert same.identical and same.packed == {"a": [item], "b": [item]} and len(same.hyper) > 0
    assert item not in set(same.values["key"]) and same.n_hyper_differ == 0
    assert diff(m, m, values=False, progress=False).hyper_status == "same"
