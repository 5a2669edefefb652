"""Zero-copy loads (``load(..., mmap=True)``), packed optimizer hyperparameters and 64-byte aligned items:
real saves, real files, one process (multi-rank layouts keep the copying paths: test_checkpoint_resume.py)."""

from __future__ import annotations

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
