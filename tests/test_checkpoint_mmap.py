"""Zero-copy loads (``load(..., mmap=True)``), packed optimizer hyperparameters and 64-byte aligned items:
real saves, real files, one process (multi-rank layouts keep the copying paths: test_checkpoint_resume.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from workbench.checkpoint import TrainState, load, save, verify
import workbench.checkpoint.state as state_module
from helpers import train_step
from workbench.checkpoint.load import read_metadata
from workbench.checkpoint.state import encode_hyper, pack_hyper, unpack_hyper
from workbench.config import ModelConfig
from workbench.models import build_model

CFG = ModelConfig("mmap-test", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=128,
                  max_seq_len=64)
X = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))


def _state(seed: int, lr: float = 1e-2, wd: float = 0.1, steps: int = 1) -> TrainState:
    """Two param groups (norms without weight decay) with values other than AdamW's defaults."""
    model = build_model(CFG, seed=seed)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = torch.optim.AdamW([{"params": rest, "weight_decay": wd}, {"params": norms, "weight_decay": 0.0}],
                            lr=lr, betas=(0.8, 0.95), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    st = TrainState(model, opt, sched)
    for _ in range(steps):
        _step(st)
    return st


def _step(st: TrainState) -> float:
    return train_step(st, X)


def _flat(st: TrainState) -> dict[str, torch.Tensor]:
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else out.__setitem__(f"{prefix}{k}", v)

    walk(st.state_dict(rng=False), "")
    return out


def _groups(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_mapped_load_is_bitwise_and_training_continues_as_after_a_copying_load(tmp_path):
    ref = _state(0, steps=3)
    save(tmp_path / "ckpt", ref)
    ckpt = tmp_path / "ckpt" / "step-000003"
    mapped, copied = _state(7, lr=0.5, wd=0.3), _state(8, lr=0.5, wd=0.3)
    res = load(ckpt, mapped.model, mapped.optimizer, scheduler=mapped.scheduler, mmap=True)
    res2 = load(ckpt, copied.model, copied.optimizer, scheduler=copied.scheduler)
    assert res.read["path"] == "mmap" and res.read["direct"] > 0 and res2.read["path"] == "direct"
    mapped.step, copied.step = res.step, res2.step  # load() restores objects; the step comes back in the result
    want = _flat(ref)
    for name, st in (("mapped", mapped), ("copied", copied)):
        got = _flat(st)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)
        assert _groups(st.optimizer) == _groups(ref.optimizer), name  # both groups' lr, betas, weight decay
        assert st.scheduler.last_epoch == ref.scheduler.last_epoch == 3
    # parameters keep their identity: the optimizer still steps the model's own tensors
    ids = {id(p) for g in mapped.optimizer.param_groups for p in g["params"]}
    assert ids == {id(p) for p in mapped.model.parameters()}
    # two more steps: the mapped state (copy-on-write) trains exactly as the copied one and the original
    for _ in range(2):
        a, b, c = _step(ref), _step(mapped), _step(copied)
        assert a == b == c
    for k, v in _flat(ref).items():
        assert torch.equal(_flat(mapped)[k], v), k
    # writes went to private pages: the files are what was saved
    assert verify(ckpt).ok


def test_mapped_load_refuses_a_damaged_file_before_touching_the_model(tmp_path):
    save(tmp_path / "ckpt", _state(0))
    ckpt = tmp_path / "ckpt" / "step-000001"
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh = _state(5)
    before = {k: v.clone() for k, v in _flat(fresh).items()}
    try:
        load(ckpt, fresh.model, fresh.optimizer, mmap=True)
    except ValueError as e:
        assert "damaged" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("a damaged file was loaded")
    for k, v in _flat(fresh).items():
        assert torch.equal(v, before[k]), k


def test_mapped_load_falls_back_where_it_cannot_map(tmp_path):
    st = _state(0)
    save(tmp_path / "q", st, quant="int8")
    fresh = _state(3)
    assert load(tmp_path / "q", fresh.model, fresh.optimizer, mmap=True).read["path"] == "direct"
    model_only = build_model(CFG, seed=4)
    res = load(tmp_path / "q", model_only, mmap=True)  # the weights alone are stored plainly
    assert res.read["path"] == "mmap"
    for k, v in st.model.state_dict().items():
        assert torch.equal(model_only.state_dict()[k], v), k


def test_hyperparameters_are_one_item_per_distinct_set_and_old_per_key_checkpoints_load(tmp_path, monkeypatch):
    st = _state(0)
    save(tmp_path / "new", st)
    keys = list(read_metadata(tmp_path / "new" / "step-000001").state_dict_metadata)
    packed = [k for k in keys if k.startswith("optim.hyper.")]
    assert len(packed) == 1 and not any("param_groups" in k for k in keys)
    osd = st.state_dict(encode=False)["optim"]
    doc = unpack_hyper([pack_hyper(osd)[packed[0][len("optim."):]]])
    assert {d["weight_decay"] for d in doc.values()} == {0.1, 0.0} and doc["norm.weight"]["betas"] == [0.8, 0.95]
    # identical content, identical key: data-parallel ranks' items dedupe into one
    assert pack_hyper(osd).keys() == pack_hyper(_state(0).state_dict(encode=False)["optim"]).keys()
    # a checkpoint as saves wrote it before the packing: one tensor per parameter and hyperparameter
    with monkeypatch.context() as m:
        m.setattr(state_module, "encode_optim",
                  lambda osd: {k: t for k, v in osd.items() if (t := encode_hyper(v)) is not None})
        save(tmp_path / "old", st)
    keys = read_metadata(tmp_path / "old" / "step-000001").state_dict_metadata
    assert sum(".param_groups." in k for k in keys) > 50 and not any(k.startswith("optim.hyper.") for k in keys)
    for mmap in (False, True):
        fresh = _state(9, lr=0.3, wd=0.5)
        res = load(tmp_path / "old", fresh.model, fresh.optimizer, scheduler=fresh.scheduler, mmap=mmap)
        assert _groups(fresh.optimizer) == _groups(st.optimizer), mmap
        assert res.read["path"] == ("mmap" if mmap else "direct")


def test_items_start_aligned_and_every_reader_still_reads_them(tmp_path):
    st = _state(0)
    save(tmp_path / "c", st)
    ckpt = tmp_path / "c" / "step-000001"
    md = read_metadata(ckpt)
    assert md.storage_data and all(info.offset % 64 == 0 for info in md.storage_data.values())
    # the padding ends each item; torch.load (DCP's own reader) and the direct reader both read past it
    for direct in (False, True):
        fresh = _state(2)
        load(ckpt, fresh.model, fresh.optimizer, scheduler=fresh.scheduler, direct=direct)
        for k, v in _flat(st).items():
            assert torch.equal(_flat(fresh)[k], v), (direct, k)


def test_repeated_state_dicts_reuse_the_fqn_walk_and_stay_live(tmp_path, monkeypatch):
    """A periodic save's state dict equals torch's own walk at every step (values live, hyperparameters
    fresh), though torch's walk runs once; a load that repoints the tensors makes it walk again."""
    import workbench.checkpoint.state as state_module
    from torch.distributed.checkpoint.state_dict import get_state_dict

    st = _state(0)
    walks = []
    real = state_module.get_state_dict
    monkeypatch.setattr(state_module, "get_state_dict", lambda *a, **k: (walks.append(1), real(*a, **k))[1])
    for i in range(3):
        _step(st)
        st.optimizer.param_groups[1]["lr"] = 0.01 * (i + 1)  # a hyperparameter changed by hand, too
        got = st.state_dict(rng=False, encode=False)
        msd, osd = get_state_dict(st.model, st.optimizer, options=state_module._OPTIONS)
        assert got["model"].keys() == msd.keys() and got["optim"].keys() == osd.keys()
        for k, v in msd.items():
            assert torch.equal(got["model"][k], v), k
        for k, v in osd.items():
            assert (torch.equal(got["optim"][k], v) if isinstance(v, torch.Tensor) else got["optim"][k] == v), k
    assert len(walks) == 1
    save(tmp_path / "c", st)
    load(tmp_path / "c", st.model, st.optimizer, mmap=True)  # the parameters now map the file
    st.state_dict(rng=False)
    assert len(walks) == 2  # the save reused the walk; after the repointing it walked again


def test_recorded_spans_locate_every_tensor_as_the_parser_does(tmp_path, monkeypatch):
    """The saver records where its large writes went; a mapped load takes large tensors from them and small
    ones from their data record's header, parsing no item, and gets exactly what the parser gets."""
    import workbench.checkpoint.mmapload as mm
    from workbench.checkpoint.store import read_manifest

    st = _state(0, steps=2)
    save(tmp_path / "c", st)
    ckpt = tmp_path / "c" / "step-000002"
    md, manifest = read_metadata(ckpt), read_manifest(ckpt)
    assert all("spans" in e for n, e in manifest["files"].items() if n.endswith(".distcp"))
    targets = {"model": st.model.state_dict(), "optim": {k[len("optim."):]: v for k, v in _flat(st).items()
                                                         if k.startswith("optim.state.")}}
    parsed, _ = mm.mapped_tensors(ckpt, md, targets)
    calls = []
    real = mm.parse_item
    monkeypatch.setattr(mm, "parse_item", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    located, _ = mm.mapped_tensors(ckpt, md, targets, manifest=manifest)
    assert calls == [] and located.keys() == parsed.keys()
    assert any(t.numel() * t.element_size() > 4096 for t in located.values())
    assert any(0 < t.numel() * t.element_size() <= 4096 for t in located.values())
    for k, v in parsed.items():
        assert torch.equal(located[k], v) and located[k].dtype == v.dtype, k
    # Spans that do not fit (hostile or stale: wrong lengths, beyond the item, not numbers) are not used:
    # each item is parsed instead, and the values are still right.
    for bad in ([0, 1 << 40], ["x", 3], [-64, 64], [8, 8, 16]):
        doc = {**manifest, "files": {n: {**e, "spans": bad} for n, e in manifest["files"].items()}}
        got, _ = mm.mapped_tensors(ckpt, md, targets, manifest=doc)
        for k, v in parsed.items():
            assert torch.equal(got[k], v), (bad, k)


def test_a_save_with_a_non_dense_tensor_records_no_spans_and_loads_right(tmp_path):
    """A tensor whose stored bytes are not its row-major values (here a transposed buffer, the same size
    as its storage) must not be read through spans: the saver records none for that save."""
    from workbench.checkpoint.store import read_manifest

    st = _state(0)
    st.model.register_buffer("transposed", torch.arange(4096.0).reshape(64, 64).t())
    save(tmp_path / "c", st)
    ckpt = tmp_path / "c" / "step-000001"
    assert not any("spans" in e for e in read_manifest(ckpt)["files"].values())
    fresh = _state(3)
    fresh.model.register_buffer("transposed", torch.zeros(64, 64))
    load(ckpt, fresh.model, fresh.optimizer, mmap=True)
    assert torch.equal(fresh.model.transposed, torch.arange(4096.0).reshape(64, 64).t())


def test_the_direct_state_walk_is_torchs_walk_and_steps_aside_for_wrappers(tmp_path, monkeypatch):
    """Loads in one process take the model's and optimizer's tensors without torch's FQN walk: the same
    keys and tensors. A wrapped model (torch.compile's ``_orig_mod``) goes through torch's walk; if the
    direct walk ever names keys the checkpoint lacks, the load uses torch's walk too."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    st = _state(0)
    msd, osd = st._plain_state(optimizer=True)
    tmsd, tosd = get_state_dict(st.model, st.optimizer, options=state_module._OPTIONS)
    assert msd.keys() == tmsd.keys() and all(msd[k].data_ptr() == tmsd[k].data_ptr() for k in msd)
    tstate = {k: v for k, v in tosd.items() if k.startswith("state.")}
    assert osd.keys() == tstate.keys() and all(osd[k] is tstate[k] for k in osd)
    assert TrainState(torch.compile(build_model(CFG, seed=0)))._plain_state(optimizer=False) is None
    assert TrainState(build_model(CFG, seed=0), torch.optim.AdamW(build_model(CFG, seed=0).parameters())
                      )._plain_state(optimizer=True) is None  # no optimizer state yet: torch's walk makes it
    save(tmp_path / "c", st)
    monkeypatch.setattr(state_module, "_WRAPPER_NAMES", frozenset())  # the direct walk now misnames keys
    compiled = torch.compile(build_model(CFG, seed=5))
    load(tmp_path / "c", compiled, mmap=True)
    for k, v in st.model.state_dict().items():
        assert torch.equal(compiled._orig_mod.state_dict()[k], v), k


def test_the_save_stream_starts_writeback_and_its_fsync_sees_every_byte(tmp_path):
    """What DCP fsyncs is the stream's fileno(), before it closes the stream: the small writes gathered
    in the stream (and Python's buffer) must be in the file by then."""
    import os

    from workbench.checkpoint.saver import WRITEBACK_BYTES, _HashingStream
    from workbench.checkpoint.store import start_writeback

    path = tmp_path / "f"
    with open(path, "wb") as raw:
        assert start_writeback(raw.fileno(), 0, 1) in (True, False)
        s = _HashingStream(raw)
        s.write(b"x" * 100)  # gathered
        s.write(bytes(WRITEBACK_BYTES + 5000))  # large: straight through, a span, and writeback started
        s.write(b"tail")
        fd = s.fileno()
        assert os.path.getsize(path) == 100 + WRITEBACK_BYTES + 5000 + 4
        assert s.spans == [(100, WRITEBACK_BYTES + 5000)] and s.tell() % 64 == 0
        os.fsync(fd)
        s.close()


def test_an_export_with_the_optimizer_carries_its_param_groups_as_readable_json(tmp_path):
    """The packed hyperparameter item stays a tensor in an export (it loads back exactly); the groups also
    go into the optimizer files' metadata as JSON, readable without workbench."""
    import json

    from safetensors import safe_open

    from workbench.checkpoint import export

    st = _state(0)
    save(tmp_path / "c", st)
    export(tmp_path / "c", tmp_path / "hf", to="hf", include=("model", "optimizer"), names="workbench", progress=False)
    export(tmp_path / "c", tmp_path / "one.safetensors", to="safetensors", include=("model", "optimizer"),
           progress=False)
    index = json.loads((tmp_path / "hf" / "optimizer.safetensors.index.json").read_text())
    groups = index["metadata"]["param_groups"]
    by_wd = {g["hyper"]["weight_decay"]: g for g in groups}
    assert set(by_wd) == {0.1, 0.0} and "norm.weight" in by_wd[0.0]["params"]
    assert by_wd[0.1]["hyper"]["betas"] == [0.8, 0.95] and by_wd[0.1]["hyper"]["lr"] == st.optimizer.param_groups[0]["lr"]
    assert "param_groups" not in json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["metadata"]
    shard = tmp_path / "hf" / sorted(set(index["weight_map"].values()))[0]
    for f in (shard, tmp_path / "one.safetensors"):
        with safe_open(str(f), "pt") as sf:
            assert json.loads(sf.metadata()["optimizer_param_groups"]) == groups


# -- the default load (mmap=None): copies into memory that exists, maps what needs new memory -----------


def _fresh(seed: int) -> TrainState:
    """What a resumed run loads into: the model as built, an optimizer with no state yet (same groups)."""
    model = build_model(CFG, seed=seed)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = torch.optim.AdamW([{"params": rest, "weight_decay": 0.5}, {"params": norms, "weight_decay": 0.5}],
                            lr=0.3, betas=(0.5, 0.5), foreach=False)
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)))


def _mapped_files(t: torch.Tensor) -> set[str]:
    """The files whose mapping holds ``t``'s first byte (``/proc/self/maps``): what the process shows, not
    what the loader says."""
    ptr, found = t.data_ptr(), set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi and len(parts) == 6:
                found.add(parts[5].strip())
    return found


def _moments(st: TrainState) -> list[torch.Tensor]:
    return [v for s in st.optimizer.state.values() for k, v in s.items() if k != "step"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped files are left in place on Linux only")
def test_a_resume_maps_the_new_optimizer_state_copies_the_weights_and_trains_bitwise(tmp_path):
    ref = _state(0, steps=3)
    save(tmp_path / "c", ref)
    ckpt = tmp_path / "c" / "step-000003"
    shards = {str(p) for p in ckpt.glob("*.distcp")}
    default, copying, mapped = _fresh(7), _fresh(8), _fresh(9)
    own = {n: p.data_ptr() for n, p in default.model.named_parameters()}
    res = load(ckpt, default.model, default.optimizer, scheduler=default.scheduler)
    res_copy = load(ckpt, copying.model, copying.optimizer, scheduler=copying.scheduler, mmap=False)
    res_map = load(ckpt, mapped.model, mapped.optimizer, scheduler=mapped.scheduler, mmap=True)
    read = res.read
    assert read["mmap"] == "auto" and read["path"] == "mmap" and "not_mapped" not in read, read
    assert read["mapped"] > 0 and read["copied"] > 0 and read["mapped"] + read["copied"] == res_copy.read["copied"]
    assert read["mapped_bytes"] == sum(t.numel() * t.element_size() for t in _moments(default)
                                       if t.numel() * t.element_size() > 4096)
    assert res_copy.read["mmap"] == "off" and res_copy.read["path"] == "direct" and res_copy.read["mapped"] == 0
    assert res_map.read["mmap"] == "on" and res_map.read["path"] == "mmap"
    # The weights were copied into the model's own memory; the moments point into the checkpoint's files.
    assert {n: p.data_ptr() for n, p in default.model.named_parameters()} == own
    assert all(not _mapped_files(p) & shards for p in default.model.parameters())
    assert all(_mapped_files(t) & shards for t in _moments(default) if t.numel() * t.element_size() > 4096)
    assert all(not _mapped_files(t) & shards for t in _moments(copying))
    assert all(_mapped_files(p) & shards for p in mapped.model.parameters() if p.numel() * p.element_size() > 4096)
    want = _flat(ref)
    for name, st, r in (("default", default, res), ("copying", copying, res_copy), ("mapped", mapped, res_map)):
        st.step = r.step
        got = _flat(st)
        assert got.keys() == want.keys(), name
        for k in want:
            assert torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype, (name, k)
        assert _groups(st.optimizer) == _groups(ref.optimizer), name  # lr, betas, weight decay of both groups
        assert st.scheduler.last_epoch == 3, name
    # Training continues bitwise alike after each (the mapped pages take their writes copy-on-write).
    for _ in range(2):
        losses = {_step(ref), _step(default), _step(copying), _step(mapped)}
        assert len(losses) == 1, losses
    for name, st in (("default", default), ("copying", copying), ("mapped", mapped)):
        for k, v in _flat(ref).items():
            assert torch.equal(_flat(st)[k], v), (name, k)
    assert verify(ckpt).ok  # no write reached the files


def test_a_load_into_a_state_that_has_its_memory_copies_into_it(tmp_path):
    """A reload into a live train state (every tensor already has memory): copying is cheaper than the
    copy-on-write the next step would pay, so nothing is mapped, and the report says why."""
    ref = _state(0, steps=2)
    save(tmp_path / "c", ref)
    live = _state(4, steps=1)
    ptrs = [t.data_ptr() for t in [*live.model.parameters(), *_moments(live)]]
    res = load(tmp_path / "c", live.model, live.optimizer, scheduler=live.scheduler)
    assert res.read["path"] == "direct" and res.read["mapped"] == 0 and res.read["mmap"] == "auto"
    assert res.read["not_mapped"] == "every tensor has memory of its own here: copied into it"
    assert [t.data_ptr() for t in [*live.model.parameters(), *_moments(live)]] == ptrs
    live.step = res.step
    for k, v in _flat(ref).items():
        assert torch.equal(_flat(live)[k], v), k


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped files are left in place on Linux only")
@pytest.mark.parametrize("mode,who", [(0o020, "its group"), (0o002, "others")])
def test_files_someone_else_may_rewrite_are_copied_not_mapped(tmp_path, mode, who):
    """A mapping shows later writes to its file (and a truncation takes the pages away): a checkpoint others
    may write is read by copy, and the load says why; explicit mmap=True still maps it."""
    ref = _state(0, steps=1)
    save(tmp_path / "c", ref)
    ckpt = tmp_path / "c" / "step-000001"
    shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.chmod(shard.stat().st_mode | mode)
    fresh = _fresh(3)
    res = load(ckpt, fresh.model, fresh.optimizer, scheduler=fresh.scheduler)
    assert res.read["path"] == "direct" and res.read["mapped"] == 0, res.read
    assert res.read["not_mapped"] == f"{shard}: writable by {who}, who could rewrite it under the mapping"
    assert all(not _mapped_files(t) & {str(shard)} for t in _moments(fresh))
    fresh.step = res.step
    for k, v in _flat(ref).items():
        assert torch.equal(_flat(fresh)[k], v), k
    forced = _fresh(4)
    assert load(ckpt, forced.model, forced.optimizer, mmap=True).read["path"] == "mmap"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mapped files are left in place on Linux only")
def test_a_disk_without_room_for_what_a_mapping_would_keep_gets_a_copy(tmp_path, monkeypatch):
    """Mapped files keep their blocks until the process exits, after rotation has deleted them too: on a disk
    with less free space than the checkpoint holds, the default load copies."""
    import shutil

    import workbench.checkpoint.mmapload as mmapload

    ref = _state(0, steps=1)
    save(tmp_path / "c", ref)
    real = shutil.disk_usage
    monkeypatch.setattr(mmapload.shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    fresh = _fresh(3)
    res = load(tmp_path / "c", fresh.model, fresh.optimizer, scheduler=fresh.scheduler)
    assert res.read["path"] == "direct" and res.read["mapped"] == 0, res.read
    assert "its disk has 4,096 bytes free" in res.read["not_mapped"] and "after rotation deletes them" in \
        res.read["not_mapped"], res.read
    fresh.step = res.step
    for k, v in _flat(ref).items():
        assert torch.equal(_flat(fresh)[k], v), k


def test_where_nothing_can_be_mapped_the_load_says_why(tmp_path):
    st = _state(0)
    save(tmp_path / "q", st, quant="int8")
    fresh = _fresh(1)
    res = load(tmp_path / "q", fresh.model, fresh.optimizer, mmap=True)
    assert res.read["path"] == "direct" and res.read["not_mapped"] == "moments stored quantized: dequantized into place"
    wide = build_model(CFG, seed=2).double()  # float64 here, float32 in the checkpoint: read and cast
    res = load(tmp_path / "q", wide, mmap=True)
    assert res.read["path"] != "mmap" and "torch.float32" in res.read["not_mapped"] \
        and "torch.float64" in res.read["not_mapped"], res.read
    for k, v in st.model.state_dict().items():
        assert torch.equal(wide.state_dict()[k], v.double()), k
    assert "not_mapped" not in load(tmp_path / "q", build_model(CFG, seed=3), mmap=False).read


def test_the_manifest_index_stands_in_for_the_metadata_pickle_and_a_damaged_one_is_not_used(tmp_path, monkeypatch):
    """A save writes where each whole tensor lies into workbench.json (JSON, with a checksum of its own); a
    load in one process then reads no .metadata pickle. An index that is damaged, out of form, or that the
    saver could not write (a tensor in pieces) is not used: the load reads .metadata, and is as right."""
    import json

    import xxhash
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

    from workbench.checkpoint.index import index_metadata, manifest_index
    from workbench.checkpoint.store import MANIFEST, read_manifest

    ref = _state(0, steps=1)
    save(tmp_path / "c", ref)
    ckpt = tmp_path / "c" / "step-000001"
    manifest = read_manifest(ckpt)
    md, indexed = read_metadata(ckpt), index_metadata(manifest)
    tensors = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert indexed is not None and indexed.state_dict_metadata.keys() == md.state_dict_metadata.keys()
    for k, v in tensors.items():
        got = indexed.state_dict_metadata[k]
        assert (got.size, got.properties.dtype, got.chunks) == (v.size, v.properties.dtype, v.chunks), k
    assert {i.fqn: (s.relative_path, s.offset, s.length) for i, s in indexed.storage_data.items()} == \
        {i.fqn: (s.relative_path, s.offset, s.length) for i, s in md.storage_data.items() if i.fqn in tensors}

    reads = []
    real = sys.modules["workbench.checkpoint.load"].read_metadata
    monkeypatch.setattr(sys.modules["workbench.checkpoint.load"], "read_metadata",
                        lambda *a, **k: (reads.append(1), real(*a, **k))[1])

    def load_fresh() -> TrainState:
        st = _fresh(5)
        res = load(ckpt, st.model, st.optimizer, scheduler=st.scheduler)
        st.step = res.step
        for k, v in _flat(ref).items():
            assert torch.equal(_flat(st)[k], v), k
        return st

    load_fresh()
    assert reads == []
    def signed(text: str) -> dict[str, str]:
        return {"index": text, "index_xxh3_64": xxhash.xxh3_64_hexdigest(text.encode())}

    text = manifest["index"]
    outside = json.dumps({**json.loads(text), "files": ["../x.distcp"] * len(json.loads(text)["files"])})
    bad = [{"index": text.replace('"float32"', '"float64"', 1)},  # changed, its checksum not: damaged
           signed("[]"), signed(outside), signed(text.replace('"float32"', '"complex32"', 1)), {"index": None}]
    for change in bad:
        doc = {**manifest, **change}
        assert index_metadata(doc) is None, change
        (ckpt / MANIFEST).write_text(json.dumps(doc))
        reads.clear()
        load_fresh()
        assert reads == [1], change
    chunked = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        tensors[next(iter(tensors))].properties, torch.Size([4]),
        [ChunkStorageMetadata(torch.Size([0]), torch.Size([2])), ChunkStorageMetadata(torch.Size([2]), torch.Size([2]))])},
        storage_data={})
    assert manifest_index(chunked) is None  # saved in pieces (tp, fsdp): loads read .metadata
