"""Importing torch's own memory records into the one timeline schema.

* A hand-built snapshot in torch's format, small enough to add up by hand: exact totals, the free paired
  with the allocation at a reused address, the peak and its breakdown, categories and phases from the
  stack frames, ``base_bytes`` from the segments, identities a recorder knows.
* Reading is plain data only: a pickle whose payload would create a file is refused with one line and
  the file is not created; a truncated, a damaged and a wrong-shaped file each get one line.
* Every pickle protocol, and torch's two ways of recording free stacks, give the same timeline.
* Several ranks in one timeline; downsampling keeps the exact peak; a real CPU profile of a tiny model's
  forward, backward and AdamW step imports with the profiler's own peak; the synthetic generator writes
  what ``pickle.load`` reads as torch's structure, and its known peak comes back.
"""

from __future__ import annotations

import copy
import json
import pickle
import pickletools
import subprocess
import sys

import numpy as np
import pytest
import torch

from workbench.memory.profiler_trace import import_profiler_trace
from workbench.memory.snapshot import (ReadProgress, classify_frames, from_snapshot, identify_memory_file,
                                       import_snapshots, write_synthetic_snapshot)
from workbench.memory.timeline import MemoryTimeline

SITE = "/usr/lib/python3/site-packages/torch"


def _frames(*names: str) -> list[dict]:
    table = {
        "init": [(f"{SITE}/nn/modules/linear.py", 118, "reset_parameters"), ("/w/model.py", 20, "__init__")],
        "fwd": [(f"{SITE}/nn/modules/linear.py", 125, "forward"), (f"{SITE}/nn/modules/module.py", 1784, "_call_impl"),
                ("/w/model.py", 61, "forward"), ("/w/train.py", 9, "step")],
        "bwd": [(f"{SITE}/autograd/graph.py", 829, "_engine_run_backward"), (f"{SITE}/_tensor.py", 648, "backward"),
                ("/w/train.py", 10, "step")],
        "engine": [],
        "nccl": [(f"{SITE}/distributed/distributed_c10d.py", 2800, "all_reduce"),  # DDP's hook, autograd's thread
                 (f"{SITE}/distributed/algorithms/ddp_comm_hooks/default_hooks.py", 40, "allreduce_hook")],
        "state": [(f"{SITE}/optim/adamw.py", 150, "_init_group"), (f"{SITE}/optim/adamw.py", 210, "step"),
                  ("/w/train.py", 12, "step")],
        "adam": [(f"{SITE}/optim/adam.py", 610, "_multi_tensor_adam"), ("/w/train.py", 12, "step")],
        "zero": [(f"{SITE}/optim/optimizer.py", 950, "zero_grad"), ("/w/train.py", 13, "step")],
    }
    (name,) = names
    return [{"filename": f, "line": line, "name": n} for f, line, n in table[name]]


def _entries(action: str, addr: int, size: int, frames: str, t: int) -> list[dict]:
    acts = ["free_requested", "free_completed"] if action == "free" else [action]
    return [{"action": a, "addr": addr, "size": size, "stream": 0, "time_us": 1_000_000 + 10 * t,
             "frames": _frames(frames)} for a in acts]


# (action, addr, size, stack, expected category, expected phase); base: a parameter of 4096 bytes at 0x1000
# (still allocated at the end), and 250 bytes at 0x9000 freed in the trace without being allocated in it
EVENTS = [
    ("alloc", 0x2000, 1000, "fwd", "activation", "forward"),    # freed in backward: an activation
    ("alloc", 0x3000, 500, "fwd", "temporary", "forward"),      # freed within forward
    ("free", 0x3000, 500, "fwd", "temporary", "forward"),
    ("alloc", 0x4000, 2000, "bwd", "gradient", "backward"),     # alive into the optimizer: a gradient
    ("alloc", 0x5000, 300, "engine", "temporary", "backward"),  # autograd's thread: no frames, still backward
    ("free", 0x5000, 300, "engine", "temporary", "backward"),
    ("free", 0x2000, 1000, "engine", "activation", "backward"),
    ("alloc", 0x3000, 800, "nccl", "communication", "backward"),  # 0x3000 again: a new allocation
    ("free", 0x3000, 800, "nccl", "communication", "backward"),
    ("alloc", 0x6000, 700, "state", "optimizer", "optimizer"),  # AdamW state: never freed
    ("alloc", 0x7000, 100, "adam", "temporary", "optimizer"),
    ("free", 0x7000, 100, "adam", "temporary", "optimizer"),
    ("free", 0x9000, 250, "zero", "other", "optimizer"),        # allocated before the trace
    ("free", 0x4000, 2000, "zero", "gradient", "optimizer"),
]


def hand_snapshot() -> dict:
    trace = []
    for t, (action, addr, size, frames, _, _) in enumerate(EVENTS):
        trace += _entries(action, addr, size, frames, t)
    trace.insert(0, {"action": "segment_alloc", "addr": 0x6000, "size": 2 << 20, "stream": 0, "time_us": 999_990,
                     "frames": _frames("state")})
    blocks = [{"address": 0x1000, "size": 4096, "requested_size": 4096, "state": "active_allocated",
               "frames": _frames("init")},
              {"address": 0x2000, "size": 16384, "requested_size": 0, "state": "inactive", "frames": []},
              {"address": 0x6000, "size": 1024, "requested_size": 700, "state": "active_allocated",
               "frames": _frames("state")}]
    return {"segments": [{"device": 0, "address": 0x1000, "total_size": 4 << 20, "allocated_size": 4796,
                          "active_size": 4796, "requested_size": 4796, "stream": 0, "segment_type": "large",
                          "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}],
            "device_traces": [trace], "allocator_settings": {}, "external_annotations": []}


@pytest.fixture(scope="module")
def hand_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "snapshot_rank0.pickle"
    with open(path, "wb") as f:
        pickle.dump(hand_snapshot(), f)  # what torch.cuda.memory._dump_snapshot does
    return path


def test_hand_built_snapshot_adds_up(hand_file):
    tl = from_snapshot(hand_file)
    assert (tl.source, tl.device, tl.ranks) == ("snapshot", "cuda", [0])
    assert tl.base_bytes == {0: 4096 + 250}
    assert tl.meta["base_by_category"]["0"] == {"parameter": 4096, "other": 250}
    ev = tl.frame
    deltas = [size if a == "alloc" else -size for a, _, size, _, _, _ in EVENTS]
    assert ev["delta_bytes"].tolist() == deltas
    assert ev["total_bytes"].tolist() == (4346 + np.cumsum(deltas)).tolist()
    assert ev["category"].astype(str).tolist() == [c for *_, c, _ in EVENTS]
    assert ev["phase"].astype(str).tolist() == [p for *_, p in EVENTS]
    assert ev["t"].tolist() == pytest.approx([1e-5 * i for i in range(len(EVENTS))])

    # pairing: a free carries its allocation's id; the reused address 0x3000 made two allocations
    ids = ev["id"].tolist()
    assert ids[1] == ids[2] and ids[7] == ids[8] and ids[1] != ids[7]
    assert ids[0] == ids[6] and ids[3] == ids[13]
    assert ids[12] not in ids[:12]  # the free of a pre-trace allocation has an id of its own
    assert ev["op"].astype(str).tolist()[:3] == ["forward", "forward", "(free)"]
    assert ev["module"].astype(str).iloc[0] == "linear.py:125"

    peak = tl.peak()
    assert (peak.bytes, peak.index, peak.phase) == (7646, 4, "backward")
    assert peak.by_category == {"parameter": 4096, "other": 250, "activation": 1000, "gradient": 2000,
                                "temporary": 300}
    assert tl.meta["reserved_bytes"]["0"] == {"start": 2 << 20, "peak": 4 << 20, "end": 4 << 20}
    # the live dict (what a recorder passes) gives the very same timeline
    assert from_snapshot(hand_snapshot()).frame.equals(ev)


def test_identities_label_what_is_alive_at_the_snapshot():
    tl = from_snapshot(hand_snapshot(), identities={0x6000: "checkpoint", 0x1000: "other", 0x3000: "parameter"})
    cats = tl.frame["category"].astype(str).tolist()
    assert cats[9] == "checkpoint"             # the allocation alive at 0x6000
    assert cats[1] == "temporary" and cats[7] == "communication"  # 0x3000's allocations were freed before
    assert tl.meta["base_by_category"]["0"] == {"other": 4096 + 250}
    with pytest.raises(ValueError, match="unknown memory category 'weights'"):
        from_snapshot(hand_snapshot(), identities={0x6000: "weights"})


def test_frames_name_phases_and_categories():
    f = lambda rows: [(a, 1, b) for a, b in rows]  # noqa: E731
    assert classify_frames([]) == (None, None, "", "")
    cpp_and_python = f([("??", "at::_ops::mm::call(at::Tensor const&)"), (f"{SITE}/optim/adam.py", "step")])
    assert classify_frames(cpp_and_python)[::3] == ("optimizer", "aten::mm")
    assert classify_frames(f([(f"{SITE}/distributed/checkpoint/state_dict_saver.py", "save")]))[:2] == \
        ("checkpoint", "checkpoint")
    assert classify_frames(f([("??", "torch::autograd::AccumulateGrad::apply")]))[:2] == ("backward", "gradient")
    assert classify_frames(f([(f"{SITE}/nn/modules/module.py", "_apply"), ("/w/m.py", "main")]))[:2] == \
        ("build", "parameter")
    # library frames only (a hook on autograd's thread): no phase of its own
    assert classify_frames(f([(f"{SITE}/distributed/distributed_c10d.py", "all_gather_into_tensor")]))[:2] == \
        (None, "communication")
    assert classify_frames(f([("/w/data.py", "__next__")]))[0] == "other"


def test_every_protocol_and_both_free_stacks_read_the_same(hand_file, tmp_path):
    ref = from_snapshot(hand_file).frame
    snap = hand_snapshot()
    for proto in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{proto}.pickle"
        path.write_bytes(pickle.dumps(snap, protocol=proto))
        assert from_snapshot(path).frame.equals(ref), proto
    # torch's context="alloc": a free records its allocation's stack, the very same list object
    shared = copy.deepcopy(snap)
    live: dict[int, list] = {}
    for e in shared["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e["frames"]
        elif e["addr"] in live:
            e["frames"] = live[e["addr"]]
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps(shared))
    tl = from_snapshot(path).frame
    assert tl["total_bytes"].tolist() == ref["total_bytes"].tolist()
    assert tl["category"].tolist() == ref["category"].tolist()


def _payload(target) -> bytes:
    """A protocol-0 pickle that calls os.system: running it creates ``target``."""
    return f"cos\nsystem\n(S'touch {target}'\ntR.".encode()


class _OpensAFile:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_hostile_pickle_is_refused_and_not_run(tmp_path):
    # the payloads are real: unpickled in another process, they do create their file
    for make in (_payload, lambda t: pickle.dumps({"segments": [], "device_traces": [[_OpensAFile(t)]]})):
        proof = tmp_path / "proof"
        subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({make(proof)!r})"], check=True)
        assert proof.exists()
        proof.unlink()

    target = tmp_path / "pwned"
    hostile = tmp_path / "snapshot.pickle"
    hostile.write_bytes(_payload(target))
    with pytest.raises(ValueError) as err:
        from_snapshot(hostile)
    assert str(err.value) == (f"{hostile} is not a plain-data torch memory snapshot: it refers to os.system; "
                              "refusing to load it")
    # deep inside an otherwise ordinary snapshot, in torch's protocol
    snap = hand_snapshot()
    snap["device_traces"][0][3]["frames"].append(_OpensAFile(target))
    hostile.write_bytes(pickle.dumps(snap))
    with pytest.raises(ValueError, match=r"it refers to io\.open; refusing to load it$"):
        import_snapshots([hostile])
    assert not target.exists()


def test_damaged_files_get_one_line(tmp_path, hand_file):
    data = hand_file.read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError) as err:
        from_snapshot(cut)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{cut} ends early") and "_dump_snapshot" in msg

    bad = tmp_path / "bad.pickle"
    ops = [pos for _, _, pos in pickletools.genops(data)]
    at = ops[len(ops) // 2]
    bad.write_bytes(data[:at] + b"\xff" + data[at + 1:])  # an opcode byte that is no opcode
    with pytest.raises(ValueError, match=rf"^{bad} is not a readable pickle: .*no pickle opcode"):
        from_snapshot(bad)

    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(ValueError, match=r"is a pickle but not a torch memory snapshot .*'device_traces'"):
        from_snapshot(other)

    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        from_snapshot(empty)


def test_every_rank_of_a_job_in_one_timeline(tmp_path):
    truth = {}
    for rank, seed in ((1, 5), (0, 4)):
        truth[rank] = write_synthetic_snapshot(tmp_path / f"snapshot_rank{rank}.pickle", 150_000, seed=seed)
    (tmp_path / "notes.txt").write_text("not a snapshot")
    tl = import_snapshots(tmp_path, progress=False)
    assert tl.ranks == [0, 1]
    for rank, info in truth.items():
        assert tl.peak(rank).bytes == info["peak_bytes"]
        assert tl.base_bytes[rank] == info["base_bytes"]
        assert tl.rank(rank).frame["total_bytes"].iloc[-1] == info["end_bytes"]
    assert tl.frame["t"].min() == 0.0  # one clock for all ranks
    assert set(tl.meta["files"]) == {"0", "1"}

    # no rank in the names: the order decides; a process that saw two GPUs must say which one
    a, b = tmp_path / "a.pickle", tmp_path / "b.pickle"
    write_synthetic_snapshot(a, 50_000, seed=1, devices=2, device=1)
    b.write_bytes(a.read_bytes())
    assert import_snapshots([a, b], progress=False).ranks == [0, 1]
    two = hand_snapshot()
    two["device_traces"].append(copy.deepcopy(two["device_traces"][0]))
    with pytest.raises(ValueError, match=r"allocations on devices \[0, 1\]; choose one with device=0"):
        from_snapshot(two)
    assert from_snapshot(two, device=1).peak().bytes == 7646


def test_downsampling_keeps_totals_and_the_exact_peak(tmp_path):
    info = write_synthetic_snapshot(tmp_path / "s.pickle", 400_000, seed=2)
    full = from_snapshot(tmp_path / "s.pickle")
    assert "downsampled" not in full.meta and full.peak().bytes == info["peak_bytes"]
    for budget in (2000, 200):
        small = from_snapshot(tmp_path / "s.pickle", max_events=budget)
        assert len(small) <= budget < len(full)
        assert small.meta["downsampled"]["0"]["events"] == len(full)
        assert small.peak().bytes == full.peak().bytes and small.peak().by_category == full.peak().by_category
        assert small.frame["total_bytes"].max() == full.frame["total_bytes"].max()  # nothing merged rises above
        assert small.frame["total_bytes"].iloc[-1] == full.frame["total_bytes"].iloc[-1]
        # the events kept whole keep their exact totals
        kept = small.frame[small.frame["id"] >= 0]
        at = full.frame.set_index(["id", np.sign(full.frame["delta_bytes"])])["total_bytes"]
        assert (at.loc[list(zip(kept["id"], np.sign(kept["delta_bytes"])))].to_numpy()
                == kept["total_bytes"].to_numpy()).all()
        cats = small.category_bytes(0).iloc[-1]
        assert (cats == full.category_bytes(0).iloc[-1]).all()


def test_synthetic_snapshot_is_torchs_structure(tmp_path):
    path = tmp_path / "synthetic.pickle"
    info = write_synthetic_snapshot(path, 100_000, seed=0, n_frames=20)
    assert abs(info["bytes"] - 100_000) < 60_000
    with open(path, "rb") as f:
        snap = pickle.load(f)  # the real unpickler reads it as torch's dict
    assert list(snap) == ["segments", "device_traces", "allocator_settings", "external_annotations"]
    (trace,) = snap["device_traces"]
    assert len(trace) == info["entries"]
    assert {tuple(e) for e in trace} == {("action", "addr", "size", "stream", "time_us", "frames")}
    assert {e["action"] for e in trace} == {"alloc", "free_requested", "free_completed", "segment_alloc",
                                            "segment_free"}
    framed = [e for e in trace if e["frames"]]
    assert {tuple(fr) for e in framed for fr in e["frames"]} == {("filename", "line", "name")}
    assert framed[0]["frames"][-1] is framed[-1]["frames"][-1]  # frame dicts shared, as torch's are
    assert set(snap["segments"][0]["blocks"][0]) == {"address", "size", "requested_size", "state", "frames"}
    # replaying it with pickle's own result gives the generator's ground truth, and so does the import
    total, peak = info["base_bytes"], info["base_bytes"]
    for e in trace:
        total += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        peak = max(peak, total)
    assert (peak, total) == (info["peak_bytes"], info["end_bytes"])
    tl = from_snapshot(path)
    assert tl.peak().bytes == info["peak_bytes"] and tl.base_bytes[0] == info["base_bytes"]
    assert from_snapshot(snap).frame.equals(tl.frame)
    phases = set(tl.frame["phase"].astype(str))
    assert {"forward", "backward", "optimizer"} <= phases
    assert {"activation", "gradient", "optimizer", "temporary", "communication"} <= set(
        tl.frame["category"].astype(str))


def test_repeated_steps_are_torchs_framed_pickle_and_read_the_same(tmp_path):
    """Beyond ``simulate_bytes`` the writer copies the last step as bytes (how a 1 GB test file takes
    seconds): still a protocol-4 pickle whose frames end between opcodes (pickle's pure-Python reader
    checks that), whose entries replay to the generator's truth, with times rising, read alike by us."""
    path = tmp_path / "repeated.pickle"
    info = write_synthetic_snapshot(path, 300_000, seed=2, n_frames=10, simulate_bytes=60_000)
    data = path.read_bytes()
    snap = pickle._loads(data)  # the Python unpickler: a frame cut inside an opcode fails here
    ops = [op.name for op, _, _ in pickletools.genops(data)]
    assert ops[0] == "PROTO" and ops.count("FRAME") > 4
    (trace,) = snap["device_traces"]
    assert len(trace) == info["entries"] and info["steps"] > 5
    times = np.array([e["time_us"] for e in trace])
    assert (np.diff(times) > 0).all()
    total, peak, allocs = info["base_bytes"], info["base_bytes"], 0
    live: set[int] = set()
    for e in trace:
        if e["action"] == "alloc":
            assert e["addr"] not in live  # a copied step allocates only free addresses
            live.add(e["addr"])
            total += e["size"]
            allocs += 1
        elif e["action"] == "free_completed":
            live.discard(e["addr"])
            total -= e["size"]
        peak = max(peak, total)
    assert (peak, total, allocs) == (info["peak_bytes"], info["end_bytes"], info["allocations"])
    tl = from_snapshot(path)
    assert from_snapshot(snap).frame.equals(tl.frame)
    assert tl.peak().bytes == info["peak_bytes"]


def test_progress_callback_sees_the_rows_read(tmp_path):
    """``progress=callback`` gets, as the file is read, each allocation and completed free once: their
    running sum is the timeline's total minus its base (what a server draws before the read ends)."""
    path = tmp_path / "snapshot_rank0.pickle"
    write_synthetic_snapshot(path, 200_000, seed=4, n_frames=10)
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    calls: list[tuple[int, int, int]] = []

    def callback(rp: ReadProgress) -> None:
        calls.append((rp.rank, rp.bytes_read, rp.bytes_total))
        seen.extend(rp.new_events())

    tl = import_snapshots(path, progress=callback)
    assert calls[-1] == (0, path.stat().st_size, path.stat().st_size)
    when = np.concatenate([w for w, _ in seen])
    delta = np.concatenate([d for _, d in seen])
    assert np.array_equal(delta, tl.frame["delta_bytes"].to_numpy())
    assert np.array_equal(np.cumsum(delta) + tl.base_bytes[0], tl.frame["total_bytes"].to_numpy())
    assert np.allclose((when - when[0]) * 1e-6, tl.frame["t"].to_numpy(), rtol=0, atol=1e-6)  # to the µs


def _profile_a_step() -> torch.profiler.profile:
    """A real CPU profile of a tiny model's forward, backward and first AdamW step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as prof:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return prof


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    prof = _profile_a_step()
    path = tmp_path_factory.mktemp("prof") / "trace.json"
    prof.export_chrome_trace(str(path))
    return prof, path


def test_a_real_cpu_profile_imports_with_the_profilers_peak(cpu_profile):
    prof, path = cpu_profile
    tl = import_profiler_trace(path)
    memory = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    assert (tl.source, tl.device) == ("profiler", "cpu")
    assert len(tl) == len(memory)
    # our running total is the allocator's own "Total Allocated" after every event
    assert tl.peak().bytes == max(e["args"]["Total Allocated"] for e in memory)
    assert tl.meta["profiler_total_mismatch_bytes"] == 0
    ev = tl.frame
    assert {"forward", "backward", "optimizer"} <= set(ev["phase"].astype(str))
    assert {"activation", "gradient", "optimizer", "temporary"} <= set(ev["category"].astype(str))
    # AdamW's state, 2 tensors per parameter, is optimizer memory still alive at the end
    param_bytes = 4 * (32 * 64 + 64 + 64 * 8 + 8)
    assert tl.category_bytes(0).iloc[-1]["optimizer"] >= 2 * param_bytes
    assert {"Linear_0", "ReLU_0", "Linear_1"} <= set(ev["module"].astype(str))
    # the innermost ATen op, else the Python function (AdamW wraps Python numbers before its op starts)
    allocs = ev[ev["delta_bytes"] > 0]
    assert (allocs["op"].astype(str) != "").all()
    assert allocs.loc[allocs["phase"] == "forward", "op"].astype(str).str.startswith("aten::").all()
    import workbench.memory
    assert workbench.memory.import_profiler_trace(path).frame.equals(ev)  # the package's entry point
    # a profile object, without a file (a second run of the same step: the same allocations)
    assert import_profiler_trace(_profile_a_step()).frame["delta_bytes"].tolist() == ev["delta_bytes"].tolist()
    with pytest.raises(ValueError, match="cannot be exported again"):
        import_profiler_trace(prof)


def test_profiler_errors_and_file_kinds(tmp_path, cpu_profile, hand_file):
    _, trace = cpu_profile
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}))
    with pytest.raises(ValueError, match="has no memory events; profile with .*profile_memory=True"):
        import_profiler_trace(plain)
    with pytest.raises(ValueError, match="has no cuda memory events; it has \\['cpu'\\]"):
        import_profiler_trace(trace, device="cuda")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a profiler trace"):
        import_profiler_trace(tmp_path / "x.json")
    with pytest.raises(ValueError, match="is JSON, not a pickle"):
        from_snapshot(trace)

    saved = from_snapshot(hand_file).save(tmp_path / "tl")
    assert MemoryTimeline.load(saved).peak().bytes == 7646
    assert identify_memory_file(hand_file) == "snapshot"
    assert identify_memory_file(hand_file.parent) == "snapshot"
    assert identify_memory_file(trace) == "profiler"
    assert identify_memory_file(saved) == "timeline"
    assert identify_memory_file(saved / "rank0.json") == "timeline"
    assert identify_memory_file(saved.parent) is None
    assert identify_memory_file(tmp_path / "x.json") is None
    assert identify_memory_file(tmp_path / "missing") is None
