"""Checkpoint and config readers meet absurd integers and impossible names in one line (issue 27; the classes
the project's fuzzer still found after the safe-reader layer: ``fuzz:dcp:0:1193``, ``:5725``,
``fuzz:hf:0:5105``, ``:3427``, ``fuzz:safetensors:0:1838``, ``fuzz:config:0:9137``, ``fuzz:torch:1:1031``).

* a DCP ``.metadata`` whose chunk has no storage entry, or whose tensor claims more elements than its
  chunks cover or more bytes than its data files hold: refused before the tensor is allocated, in every
  reader that allocates from a claimed shape (read_tensor, tensor_stats, diff, export, param_groups, load);
* an HF index naming a file no filesystem can hold (a lone surrogate, a component past NAME_MAX, a path
  past PATH_MAX): refused by its text, like a name leading outside;
* safetensors shapes whose sizes multiply past what torch can count, or numbers of thousands of digits;
* a config.json with a 400-digit or absurd ``rope_theta``: refused by the schema's bounds;
* a torch.save zip whose end record makes ``zipfile.is_zipfile`` raise instead of answering.

Each input is built at test time from a tiny checkpoint written by torch's or our own writer. Reads that
would try a huge allocation on a reader without the bound run in a forked child under ``RLIMIT_AS``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import struct
import warnings
from pathlib import Path

import pytest
import torch
import xxhash

pytestmark = pytest.mark.timeout(120)

W = "model.w"  # a 16 x 32 float32 tensor of the DCP base: 2 KiB of data


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------

def _dcp(d: Path) -> Path:
    """A plain DCP checkpoint written by torch.distributed.checkpoint (one process)."""
    import torch.distributed.checkpoint as dcp

    d.mkdir(parents=True)
    sd = {W: torch.arange(512, dtype=torch.float32).reshape(16, 32), "model.b": torch.ones(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
    return d


def _rewrite_metadata(d: Path, change) -> None:
    """``change(metadata)`` applied to the checkpoint's ``.metadata`` (read with our restricted unpickler and
    written back as DCP writes it: a plain pickle of the Metadata)."""
    from workbench.checkpoint.safeload import read_dcp_metadata

    md = read_dcp_metadata(d)
    change(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def _set_size(md, key: str, size, chunk_size=None) -> None:
    """The tensor ``key`` claims ``size``; its (first) chunk ``chunk_size``, at offset 0 of the same rank."""
    meta = md.state_dict_metadata[key]
    meta.size = torch.Size(size)
    if chunk_size is not None:
        chunk = meta.chunks[0]
        if len(chunk_size) != len(chunk.offsets):
            assert not any(chunk.offsets)
            idx = next(i for i in md.storage_data if i.fqn == key and i.offset == chunk.offsets)
            chunk.offsets = torch.Size([0] * len(chunk_size))
            md.storage_data[type(idx)(key, chunk.offsets)] = md.storage_data.pop(idx)
        chunk.sizes = torch.Size(chunk_size)


def _in_capped_child(fn, headroom: int = 1 << 30) -> tuple[str, str]:
    """``fn()`` in a forked child whose address space may grow ``headroom`` bytes past what it maps now:
    ``("ok", "")`` or ``(exception type, message)``. A reader that allocates what a file claims then fails
    there (as a RuntimeError from torch's allocator) instead of taking the machine's memory."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running pytest's exit handlers
        code = 0
        try:
            os.close(r)
            with open("/proc/self/statm") as f:
                vm = int(f.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
            try:
                fn()
                out = ("ok", "")
            except BaseException as e:  # noqa: BLE001 - whatever it was, the parent judges it
                out = (type(e).__name__, str(e))
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    assert data, "the child died without an answer"
    kind, msg = json.loads(data)
    return kind, msg


def _safetensors(path: Path, change) -> Path:
    """A safetensors file (written by the safetensors library) whose header ``change(header)`` edited."""
    from safetensors.torch import save_file

    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    text = change(header)
    body = (text if isinstance(text, str) else json.dumps(header)).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    return path


def _hf(d: Path, shard_name: str) -> Path:
    """An HF export (our exporter) whose index names ``shard_name`` for one of its tensors."""
    from safetensors.torch import save_file

    from workbench.checkpoint import export

    d.mkdir(parents=True)
    save_file({"model.w": torch.ones(4, 4), "model.v": torch.zeros(3)}, str(d / "m.safetensors"))
    export(d / "m.safetensors", d / "hf", to="hf", progress=False)
    index = d / "hf" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = shard_name
    index.write_text(json.dumps(doc))
    return d / "hf"


def _one_line(e: BaseException, *words: str) -> str:
    msg = str(e)
    assert msg.strip() and "\n" not in msg.strip(), msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# --------------------------------------------------------------------------------------------------
# DCP .metadata: claims checked against the chunks and the data files before anything is allocated
# --------------------------------------------------------------------------------------------------

def test_dcp_chunk_without_a_storage_entry_is_one_line_in_every_tensor_reader(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from workbench.checkpoint import CheckpointFormatError, diff, export, read_tensor, tensor_stats, verify

    d = _dcp(tmp_path / "c")
    good = _dcp(tmp_path / "good")

    def move_entry(md):  # the storage index of W's chunk names another offset (fuzz:dcp:0:1193: one int changed)
        idx = next(i for i in md.storage_data if i.fqn == W)
        md.storage_data[MetadataIndex(W, torch.Size([0, 7]))] = md.storage_data.pop(idx)

    _rewrite_metadata(d, move_entry)
    calls = {"read_tensor": lambda: read_tensor(d, W), "tensor_stats": lambda: tensor_stats(d, W),
             "diff": lambda: diff(good, d, progress=False),
             "export": lambda: export(d, tmp_path / "out.safetensors", to="safetensors", progress=False)}
    for name, call in calls.items():  # before: TypeError (PosixPath / None) from formats._bad_file
        with pytest.raises(CheckpointFormatError) as e:
            call()
        _one_line(e.value, str(d / ".metadata"), repr(W), "no storage entry")
    assert not (tmp_path / "out.safetensors").exists()
    report = verify(d, progress=False)  # verify names the same damage in its report, as before
    assert not report.ok and any("has no storage entry" in p.problem for p in report.problems)


def test_dcp_shape_beyond_its_chunks_is_refused_before_the_allocation(tmp_path):
    """One changed size: 16 x 32 claims 16 x 2**31 (128 GiB of float32; fuzz:dcp:0:5725). Refused by the
    chunks' coverage before torch.empty; a reader that allocated first fails under the child's cap."""
    from workbench.checkpoint import CheckpointFormatError, read_tensor, tensor_stats

    d = _dcp(tmp_path / "c")
    _rewrite_metadata(d, lambda md: _set_size(md, W, (16, 2 ** 31)))
    for call in (lambda: read_tensor(d, W), lambda: tensor_stats(d, W, bins=10)):
        kind, msg = _in_capped_child(call)
        assert kind == "CheckpointFormatError", (kind, msg)
        assert "cover 512 of the 34,359,738,368 elements" in msg and str(d / ".metadata") in msg, msg
    # in this process too (nothing is allocated on the way to the refusal)
    with pytest.raises(CheckpointFormatError, match="a rank's shards are missing"):
        read_tensor(d, W)


def test_dcp_claim_beyond_its_data_files_is_refused_before_the_allocation(tmp_path):
    """Size and chunk both say 16 x 2**26 (4 GiB): the chunk covers the claim, but the one data file holding
    it has a few KiB. Refused by the bytes the files hold, not after a 4 GiB buffer was made and read into."""
    from workbench.checkpoint import CheckpointFormatError, read_tensor

    d = _dcp(tmp_path / "c")
    _rewrite_metadata(d, lambda md: _set_size(md, W, (16, 2 ** 26), (16, 2 ** 26)))
    kind, msg = _in_capped_child(lambda: read_tensor(d, W))
    assert kind == "CheckpointFormatError", (kind, msg)
    assert "claims 4.00 GiB" in msg and "data file(s) holding it have" in msg, msg
    # a chunk that reaches past the shape it belongs to is named as that
    _rewrite_metadata(d, lambda md: _set_size(md, W, (16, 32), (16, 33)))
    with pytest.raises(CheckpointFormatError, match="lies outside its shape"):
        read_tensor(d, W)


def test_dcp_shape_torch_cannot_count_is_refused_by_inspect(tmp_path):
    """Sizes whose product passes 2**63 (with a 0 among them, so the claim is "empty"): torch cannot make
    such a tensor ("numel: integer multiplication overflow"), so the metadata is damaged."""
    from workbench.checkpoint import CheckpointFormatError, inspect

    d = _dcp(tmp_path / "c")
    _rewrite_metadata(d, lambda md: _set_size(md, W, (2 ** 62, 2 ** 62, 0), (2 ** 62, 2 ** 62, 0)))
    with pytest.raises(CheckpointFormatError) as e:
        inspect(d)
    _one_line(e.value, ".metadata", "more than a tensor can hold")


def _workbench_step(d: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    """A micro model's train state saved by our saver (model, AdamW with its packed hyper-parameters)."""
    from workbench.checkpoint import TrainState, save
    from workbench.config import ModelConfig
    from workbench.models import build_model

    cfg = ModelConfig(name="micro", dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, vocab_size=32,
                      max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randint(0, cfg.vocab_size, (2, 8))).float().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = save(d, TrainState(model, opt, step=1), manifest={"step": 1})
    return step, model, opt


def test_packed_hyperparameters_claiming_a_terabyte_are_refused_by_load_and_listing(tmp_path):
    """The packed hyper-parameters (optim.hyper.<digest>, a uint8 tensor) are the one load target allocated
    at the checkpoint's own shape; param_groups reads them from the metadata alone. 2**40 bytes claimed."""
    from workbench.checkpoint import load, param_groups

    step, model, opt = _workbench_step(tmp_path / "ckpts")
    hyper = []

    def inflate(md):
        for key, meta in md.state_dict_metadata.items():
            if key.startswith("optim.hyper."):
                hyper.append(key)
                _set_size(md, key, (2 ** 40,), (2 ** 40,))

    honest = (step / ".metadata").read_bytes()
    _rewrite_metadata(step, inflate)
    assert hyper
    manifest = json.loads((step / "workbench.json").read_text())
    if ".metadata" in manifest.get("files", {}):  # keep the recorded size: the load's cheap check passes
        manifest["files"][".metadata"]["bytes"] = (step / ".metadata").stat().st_size
    # The saver's index of where each tensor lies (workbench.checkpoint.index) would stand in for .metadata in
    # a load in one process: without it, the load reads the inflated .metadata.
    index = json.loads(manifest.pop("index"))
    digest = manifest.pop("index_xxh3_64")
    (step / "workbench.json").write_text(json.dumps(manifest))
    kind, msg = _in_capped_child(lambda: load(step, model, opt, verify=False))
    assert kind == "CheckpointFormatError", (kind, msg)
    assert repr(hyper[0]) in msg and "claims 1.00 TiB" in msg, msg
    # The same claim made by the index itself (signed, and its item as long as the claim), beside the honest
    # .metadata, is refused alike.
    (step / ".metadata").write_bytes(honest)
    manifest["files"][".metadata"]["bytes"] = len(honest)
    entry = index["tensors"][hyper[0]]
    entry[2], entry[4] = 2 ** 40, [2 ** 40]
    text = json.dumps(index)
    assert xxhash.xxh3_64_hexdigest(text.encode()) != digest
    manifest.update(index=text, index_xxh3_64=xxhash.xxh3_64_hexdigest(text.encode()))
    (step / "workbench.json").write_text(json.dumps(manifest))
    kind, msg = _in_capped_child(lambda: load(step, model, opt, verify=False))
    assert kind == "CheckpointFormatError", (kind, msg)
    assert repr(hyper[0]) in msg and "claims 1.00 TiB" in msg, msg
    kind, msg = _in_capped_child(lambda: param_groups(step))  # the listing: names only, no values
    assert kind == "ok", (kind, msg)


# --------------------------------------------------------------------------------------------------
# HF index names no filesystem can hold: refused by their text, like a name leading outside
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, words", [
    ("\ud800x.safetensors", "that no file can have (not encodable"),  # fuzz:hf:0:5105 (UnicodeEncodeError)
    ("x" * 70_000, "longer than a file name can be"),  # fuzz:hf:0:3427 (OSError: file name too long)
    ("x" * 256 + ".safetensors", "longer than a file name can be"),  # one component past NAME_MAX
    ("a/" * 2100 + "x.safetensors", "longer than a file name can be"),  # short components, past PATH_MAX
])
def test_hf_index_naming_an_impossible_file_is_refused_like_an_outside_name(tmp_path, name, words):
    from workbench.checkpoint import CheckpointFormatError, inspect, plan_load, read_tensor, verify

    hf = _hf(tmp_path / "c", name)
    index = hf / "model.safetensors.index.json"
    for call in (lambda: inspect(hf), lambda: read_tensor(hf, "model.w"),
                 lambda: plan_load(hf, "dp_shard=1", model="tiny")):
        with pytest.raises(CheckpointFormatError) as e:
            call()
        assert e.value.reason == "outside", e.value  # the server answers it as it answers ../x: not found
        _one_line(e.value, str(index), words)
    report = verify(hf, progress=False)  # documented never to raise
    assert not report.ok and words in report.problems[0].problem


def test_check_name_keeps_names_a_filesystem_can_hold():
    from workbench import safeio

    # a non-UTF-8 file name as Python spells it (surrogate-escaped bytes) is a real name, and 255 bytes fit
    for name in ("shard-\udcff.safetensors", "x" * 255, "sub/" + "y" * 255):
        assert safeio.check_name(name, "/tmp/index.json") == name
    with pytest.raises(safeio.FileRefused, match="longer than a path can be"):  # a short name, a deep base
        safeio.confine("/tmp/" + ("d" * 200 + "/") * 21, "x.bin", "/tmp/index.json")


# --------------------------------------------------------------------------------------------------
# safetensors headers with absurd integers (verify is documented never to raise)
# --------------------------------------------------------------------------------------------------

def test_safetensors_shape_of_thousands_of_sizes_is_one_line(tmp_path):
    """fuzz:safetensors:0:1838: one size repeated 5,000 times; its product has 7,500 digits, and a message
    with it raised ValueError (Python converts at most 4,300 digits to text)."""
    from workbench.checkpoint import CheckpointFormatError, inspect, verify

    f = _safetensors(tmp_path / "m.safetensors", lambda h: h["a"].update(shape=[32] * 5000))
    with pytest.raises(CheckpointFormatError) as e:
        inspect(f)
    _one_line(e.value, str(f), "'a'", "more elements than a tensor can hold")
    report = verify(f, progress=False)
    assert not report.ok and "more elements than a tensor can hold" in report.problems[0].problem


@pytest.mark.parametrize("edit, words", [
    (lambda h: '{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 64]}}',
     "a number of thousands of digits"),
    (lambda h: h["a"].update(shape=[2 ** 62, 2 ** 62, 0], data_offsets=[0, 0]), "more elements than a tensor"),
    # 4,300 digits each (what json reads); their difference has 4,301, more than str() of an int writes
    (lambda h: h["a"].update(data_offsets=[-9 * 10 ** 4299, 9 * 10 ** 4299]), "span <an integer of 14,286 bits>"),
])
def test_safetensors_absurd_integers_are_one_line(tmp_path, edit, words):
    from workbench.checkpoint import CheckpointFormatError, inspect, verify

    f = _safetensors(tmp_path / "m.safetensors", edit)
    with pytest.raises(CheckpointFormatError) as e:
        inspect(f)
    _one_line(e.value, str(f), words)
    assert not verify(f, progress=False).ok


def test_json_of_checkpoints_with_a_number_of_thousands_of_digits_is_one_line(tmp_path):
    """An HF index (safeio.read_json) and a safetensors file's __metadata__ model record."""
    from workbench.checkpoint import CheckpointFormatError, inspect

    hf = _hf(tmp_path / "c", "model-00001-of-00001.safetensors")
    index = hf / "model.safetensors.index.json"
    doc = index.read_text()
    index.write_text(doc[:doc.rindex("}")] + ', "x": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointFormatError) as e:
        inspect(hf)
    _one_line(e.value, str(index), "a number too long to read")
    f = _safetensors(tmp_path / "meta.safetensors",
                     lambda h: h.update(__metadata__={"model": '{"dim": ' + "9" * 5000 + "}"}))
    assert "model" not in inspect(f).info  # a model record that does not read is no model record


def test_torch_file_whose_zip_end_record_makes_is_zipfile_raise_is_one_line(tmp_path, monkeypatch):
    """A zip64 locator naming disk 1: zipfile.is_zipfile raises BadZipFile ("zipfiles that span multiple
    disks are not supported") instead of answering (fuzz:torch:1:1031). torch's own reader would read the
    archive, but Python's cannot, so its data.pkl cannot be scanned first: refused, never unpickled."""
    from workbench.checkpoint import CheckpointFormatError, export, inspect, verify

    unpickled = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (unpickled.append(a), real_load(*a, **k))[1])

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    raw = bytearray(buf.getvalue())
    loc = raw.rfind(b"PK\x06\x07")
    assert loc > 0
    raw[loc + 4:loc + 8] = struct.pack("<I", 1)
    f = tmp_path / "model.pt"
    f.write_bytes(bytes(raw))
    for call in (lambda: inspect(f), lambda: export(f, tmp_path / "o.safetensors", to="safetensors", progress=False)):
        with pytest.raises(CheckpointFormatError) as e:
            call()
        _one_line(e.value, str(f), "damaged zip archive")
    assert not verify(f, progress=False).ok
    assert not unpickled


# --------------------------------------------------------------------------------------------------
# config.json: float settings have finite, sane bounds
# --------------------------------------------------------------------------------------------------

_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


@pytest.mark.parametrize("key, value, words", [
    ("rope_theta", 10 ** 400, "rope_theta=<an integer of 1329 bits> must be a positive finite number"),
    ("rope_theta", 1e20, "rope_theta=1e+20 is over the limit of 1,000,000,000,000"),
    ("rope_theta", 1e300, "rope_theta=1e+300 is over the limit of 1,000,000,000,000"),
])
def test_config_json_with_absurd_floats_is_refused_before_torch_sees_them(tmp_path, key, value, words):
    """fuzz:config:0:9137: a 400-digit rope_theta reached torch inside workbench.plan (OverflowError)."""
    import workbench
    from workbench.config import ModelConfig, ParallelConfig

    f = tmp_path / "config.json"
    f.write_text(json.dumps({**_LLAMA, key: value}))
    for call in (lambda: ModelConfig.from_hf_config(f),
                 lambda: workbench.plan(str(f), ParallelConfig(dp_shard=1), seq_len=16)):
        with pytest.raises(ValueError) as e:
            call()
        _one_line(e.value, str(f), words)


def test_float_settings_keep_every_published_value_and_refuse_what_no_float_holds():
    from workbench.config import ModelConfig, TrainConfig

    for theta in (10_000.0, 500_000.0, 1e6, 3_580_165_449.0):  # Llama 2, Llama 3, Mixtral, a 1M-context Llama 3
        assert ModelConfig(rope_theta=theta).rope_theta == theta
    assert ModelConfig(n_experts=4, router_aux_coef=0.02).router_aux_coef == 0.02
    with pytest.raises(ValueError, match=r"router_aux_coef=1e\+300 is over the limit of 100"):
        ModelConfig(router_aux_coef=1e300)
    with pytest.raises(ValueError, match="lr=<an integer of 1329 bits> must be"):  # a float setting given an int
        TrainConfig(lr=10 ** 400)
