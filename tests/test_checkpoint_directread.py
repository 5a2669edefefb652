"""The direct read path: tensor bytes read straight into place, bitwise what DCP's torch.load path gives.

Multi-rank layouts (tp=2 -> dp_shard=2, pp=2 and ep=2 -> one process) are checked in
tests/test_checkpoint_resume.py; here one process, real files, damaged files.
"""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F

from workbench.checkpoint import TrainState, load, save
from workbench.checkpoint.safeload import CheckpointFormatError
from workbench.config import ModelConfig
from workbench.models import build_model

CFG = ModelConfig("direct-test", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128,
                  max_seq_len=64)


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    model = build_model(CFG, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x = torch.randint(0, CFG.vocab_size, (2, 17))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    sched.step()
    return TrainState(model, opt, sched, step=1, consumed_samples=2)


@pytest.fixture
def saved(tmp_path):
    state = _state(0)
    save(tmp_path / "ckpt", state)
    return tmp_path / "ckpt" / "step-000001", state


def _flat(state: TrainState) -> dict[str, torch.Tensor]:
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(state.state_dict(rng=False), "")
    return out


def test_direct_read_is_bitwise_the_dcp_read_and_calls_no_torch_load(saved, monkeypatch):
    path, ref = saved
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = {}
    for direct in (True, False):
        calls.clear()
        target = _state(1)
        res = load(path, target.model, target.optimizer, scheduler=target.scheduler, direct=direct)
        got[direct] = _flat(target)
        if direct:
            assert res.read["path"] == "direct" and res.read["dcp"] == 0 and calls == [], res.read
            assert res.read["bytes"] == sum(t.numel() * t.element_size() for t in got[True].values())
        else:
            assert res.read["path"] == "dcp" and len(calls) == res.read["dcp"] > 60  # one per tensor and Adam state; the hyperparameters are one item
    want = _flat(ref)
    for key, value in want.items():
        if key.startswith("extra."):
            continue
        assert torch.equal(got[True][key], value), key
        assert torch.equal(got[True][key], got[False][key]), key
    model = build_model(CFG, seed=2)  # model only, into a plain module
    res = load(path, model)
    assert res.read["path"] == "direct"
    for key, value in ref.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_truncated_shard_is_one_line_naming_the_file(saved):
    path, _ = saved
    shard = sorted(path.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    target = _state(1)
    with pytest.raises(ValueError) as err:  # the manifest's sizes catch it before any read
        load(path, target.model, target.optimizer, verify=False)
    msg = str(err.value)
    assert "\n" not in msg and shard.name in msg, msg
    # a DCP checkpoint read without a manifest: the direct reader itself refuses, naming the file
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint.load import _one_line
    from workbench.checkpoint.safeload import SafeFileSystemReader

    with pytest.raises(dcp.CheckpointException) as err:  # DCP wraps each rank's error
        dcp.load({"model": target.model.state_dict()}, storage_reader=SafeFileSystemReader(path), no_dist=True)
    one = _one_line(path, err.value)
    assert isinstance(one, CheckpointFormatError) and shard.name in str(one) and "truncated" in str(one), one


def test_a_damaged_archive_inside_a_shard_is_one_line_not_a_traceback(saved):
    """Every item's zip end record overwritten. The tensors' bytes are intact, and the spans the saver
    recorded still locate them: with verification off, the load reads them right. Without spans (a
    checkpoint from before them) the direct reader cannot place the items and DCP's torch.load fails: the
    user gets one line that says what to do. With verification on, the checksum names the damaged file."""
    import json

    path, ref = saved
    shard = sorted(path.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    pos = 0
    while (pos := data.find(b"PK\x05\x06", pos)) != -1:
        data[pos:pos + 4] = b"XXXX"
        pos += 4
    shard.write_bytes(bytes(data))
    target = _state(1)
    assert load(path, target.model, target.optimizer, verify=False).read["path"] == "direct"
    for k, v in ref.model.state_dict().items():
        assert torch.equal(target.model.state_dict()[k], v), k
    manifest = path / "workbench.json"
    doc = json.loads(manifest.read_text())
    for entry in doc["files"].values():
        entry.pop("spans", None)
    manifest.write_text(json.dumps(doc))
    target = _state(1)
    with pytest.raises(ValueError) as err:
        load(path, target.model, target.optimizer, verify=False)
    msg = str(err.value)
    assert "\n" not in msg and "could not be read" in msg and "workbench ckpt verify" in msg, msg
    with pytest.raises(ValueError, match=shard.name):
        load(path, target.model, target.optimizer)


def test_the_archive_parser_reads_what_torch_save_writes():
    import io

    from workbench.checkpoint.directread import _view, parse_item

    cases = [torch.randn(3, 4), torch.randn(30, 40).t().contiguous().t(), torch.tensor(3.0), torch.arange(7),
             torch.randn(5).bfloat16(), torch.zeros(0), torch.randn(4).to(torch.float8_e4m3fn)]
    for t in cases:
        buf = io.BytesIO()
        torch.save(t, buf)
        raw = buf.getvalue()
        st, local = parse_item(memoryview(raw), memoryview(raw), len(raw), t.dtype)
        assert local is None and (st.size, st.stride, st.dtype) == (tuple(t.shape), t.stride(), t.dtype)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)[st.data_offset:st.data_offset + st.data_length]
        assert torch.equal(_view(data, st).float(), t.float())
    assert struct.calcsize("<4sHHHHIIH") == 22
