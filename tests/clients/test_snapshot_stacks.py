"""Snapshot categories from real stacks (issue 29, row 7).

`workbench memory import` labels a CUDA snapshot's allocations by their Python frames. The CUDA caching
allocator records, for every allocation, the Python frames alive at that moment (code name, file, line;
innermost first) with torch's own traceback gatherer. These tests record the same frames without a GPU:
the real code paths run on the CPU under the installed torch, inside a dispatch mode that takes
``sys._getframe()`` whenever an operator makes a new storage (and a ``weakref.finalize`` takes its free).
The events become a dict shaped like ``torch.cuda.memory._snapshot()`` (``device_traces`` of
``alloc``/``free_completed`` entries; ``segments`` holding the blocks still alive), which the importer reads
like a GPU's, from a pickle as ``workbench memory import`` does.

* ``with torch.device(...)`` (our own ``build_model``), a torch layer's factory kwargs, and blocks alive
  before the recording started: the weights and buffers are ``parameter``, the constructor's scratch
  ``other`` (they all were ``other``).
* meta init, ``to_empty``, ``reset_parameters``; FSDP2's ``fully_shard`` of a real model and of a meta one,
  FSDP1's flat parameters (gloo, one rank): parameters.
* an FSDP2 training step: the reduce-scatter output that ``param.grad`` views is ``gradient`` (it was
  ``communication``); the reduce-scatter input stays ``communication``.
* stacks a CPU cannot make, built from the recorded ones: FSDP2's lazy init re-padding a shard in the
  first forward (the call chain recorded by a profile hook), C++ frames of ``stacks="all"``, Python 3.12's
  inlined comprehensions; and ``set_default_device`` in a training loop does not make parameters.

The recorded stacks were checked once against torch's own gatherer
(``torch._C._profiler.gather_traceback(python=True, script=True, cpp=False)``, what the allocator calls)
taken at the same moment: equal, frame for frame, past the recording's own frames.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
import weakref

import torch
from torch import nn

from workbench import compat
from workbench.config import PRESETS
from workbench.memory.snapshot import classify_frames, from_snapshot, import_snapshots
from workbench.memory.timeline import MemoryTimeline
from workbench.models.llama import build_model


def _is_capture_wrapper(code) -> bool:
    """The frames a Python dispatch mode adds around its own ``__torch_dispatch__`` (torch disables dynamo
    there): artefacts of recording on the CPU, absent from the CUDA allocator's stacks."""
    f = code.co_filename.replace("\\", "/")
    return ((f.endswith("torch/_dynamo/eval_frame.py") and code.co_name == "_fn")
            or (f.endswith("torch/_compile.py") and code.co_name == "inner"))


def _stack(frame) -> list[dict]:
    """Innermost first, as torch's gatherer records Python frames: co_filename, co_name, the current line."""
    while frame is not None and _is_capture_wrapper(frame.f_code):
        frame = frame.f_back
    out = []
    while frame is not None:
        out.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return out


class _Allocations(compat.get("TorchDispatchMode")):
    """Every storage an operator makes (outputs that share no storage with the inputs), with its stack, and
    its free. DTensor runs its own local ops under this mode (NotImplemented hands the op to it), as the
    CUDA allocator sees DTensor's local allocations; fake tensors (DTensor's sharding propagation) are not
    memory and pass through."""

    def __init__(self):
        super().__init__()
        self.trace: list[dict] = []
        self.live: dict[int, dict] = {}

    def _event(self, action: str, addr: int, size: int, frames: list[dict]) -> dict:
        e = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 1_000 + len(self.trace),
             "frames": frames}
        self.trace.append(e)
        return e

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if any(t not in (torch.Tensor, nn.Parameter) for t in types):
            return out
        flat = compat.get("pytree").tree_flatten
        seen = {a.untyped_storage().data_ptr() for a in flat((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in flat(out)[0]:
            plain = isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter)
            if not plain or t.device.type == "meta":
                continue
            s = t.untyped_storage()
            addr, size = s.data_ptr(), s.nbytes()
            if size and addr not in seen:
                seen.add(addr)
                self.live[addr] = self._event("alloc", addr, size, _stack(sys._getframe(1)))
                weakref.finalize(s, self._freed, addr, size)
        return out

    def _freed(self, addr: int, size: int) -> None:
        if self.live.pop(addr, None) is not None:
            self._event("free_completed", addr, size, _stack(sys._getframe(2)))  # past weakref's __call__

    def snapshot(self) -> dict:
        """torch's snapshot shape: the trace, and a segment per block still allocated (with its stack)."""
        blocks = [{"address": e["addr"], "size": e["size"], "requested_size": e["size"], "state": "active_allocated",
                   "frames": e["frames"]} for e in self.live.values()]
        return {"segments": [{"device": 0, "address": b["address"], "total_size": b["size"], "stream": 0,
                              "segment_type": "small", "blocks": [b]} for b in blocks],
                "device_traces": [list(self.trace)], "allocator_settings": {}, "external_annotations": []}


def _record(build):
    """``build()`` under the recorder: (its result, the snapshot dict) while the result is alive."""
    rec = _Allocations()
    with rec:
        kept = build()
    return kept, rec.snapshot()


def _imported(snap: dict, tmp_path) -> MemoryTimeline:
    """The timeline as `workbench memory import` makes it: from a pickle file, torch's own way of saving."""
    path = tmp_path / "rank0.pickle"
    path.write_bytes(pickle.dumps(snap))
    return import_snapshots([path], progress=False)


def _net(tl) -> dict[str, int]:
    """Bytes still allocated at the end of the trace, by category."""
    sums = tl.frame.groupby("category", observed=True)["delta_bytes"].sum()
    return {str(k): int(v) for k, v in sums.items() if v}


def _state_bytes(module: nn.Module) -> int:
    """Parameters and buffers of ``module``, local shards for DTensors, each storage once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        s = local.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# --------------------------------------------------------------------------------------------------
# Real stacks: the code paths run here, under the installed torch
# --------------------------------------------------------------------------------------------------

def test_our_build_idiom_under_a_device_context_makes_parameters(tmp_path):
    # workbench.models.build_model: `with torch.device(device): Transformer(cfg)` (nn.Linear's empty, our
    # RMSNorm's ones, the rotary tables); "cpu" takes the same DeviceContext path "cuda" does
    model, snap = _record(lambda: build_model(PRESETS["tiny"], seed=None, device="cpu"))
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert "__torch_function__" in names  # the device context is on the recorded stacks
    tl = _imported(snap, tmp_path)
    net = _net(tl)
    assert net == {"parameter": _state_bytes(model)}, net  # was {"other": ...}: parameter = 0
    assert set(tl.frame[tl.frame["delta_bytes"] > 0]["phase"].astype(str)) == {"build"}
    # the rotary tables' intermediates, freed while building, are no parameters
    freed = tl.frame[tl.frame["delta_bytes"] < 0]
    assert len(freed) and set(freed["category"].astype(str)) == {"other"}
    assert tl.peak().by_category["parameter"] == _state_bytes(model)


def test_factory_kwargs_and_blocks_from_before_the_recording(tmp_path):
    def build():  # a user's build function: torch layers given their device directly, no context
        return nn.Sequential(nn.Embedding(11, 8, device="cpu"), nn.Linear(8, 16, device="cpu"),
                             nn.LayerNorm(16, device="cpu"))

    model, snap = _record(build)
    assert _net(_imported(snap, tmp_path)) == {"parameter": _state_bytes(model)}
    # the recording started after the build: the weights are only blocks of the segments, with their stacks
    _, snap = _record(lambda: build_model(PRESETS["tiny"], seed=None, device="cpu"))
    late = copy.deepcopy(snap)
    late["device_traces"] = [[]]
    tl = from_snapshot(late)
    assert tl.meta["base_by_category"]["0"] == {"parameter": sum(b["size"] for s in late["segments"]
                                                                 for b in s["blocks"])}


def test_meta_init_then_to_empty_and_reset_parameters(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    def materialize():
        model.to_empty(device="cpu")
        for m in model:
            m.reset_parameters()
        return model

    _, snap = _record(materialize)
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"to_empty", "_apply", "<lambda>"} <= names
    assert _net(_imported(snap, tmp_path)) == {"parameter": _state_bytes(model)}


def _fsdp_model(mesh, device: str | None = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device(device) if device else torch.device("cpu"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_fsdp2_sharded_init_makes_parameters(one_rank_mesh, tmp_path):
    # fully_shard of a built model: each FSDPParam._init_sharded_param pads its shard into a new storage,
    # and the unsharded weights the build made are freed as fully_shard returns
    model, snap = _record(lambda: _fsdp_model(one_rank_mesh))
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"_init_sharded_param", "fully_shard"} <= names
    tl = _imported(snap, tmp_path)
    assert _net(tl) == {"parameter": _state_bytes(model)}
    built = tl.frame[(tl.frame["delta_bytes"] > 0) & (tl.frame["op"].astype(str) == "__init__")]
    assert set(built["category"].astype(str)) == {"other"}  # the unsharded originals, freed by fully_shard

    # meta init: fully_shard on meta, then to_empty (FSDPModule._apply re-pads with reset_sharded_param)
    meta = _fsdp_model(one_rank_mesh, "meta")

    def materialize():
        meta.to_empty(device="cpu")
        for m in (meta[0], meta[2]):
            m.reset_parameters()
        return meta

    _, snap = _record(materialize)
    assert _net(_imported(snap, tmp_path)) == {"parameter": _state_bytes(meta)}


def test_fsdp1_flat_parameters_are_parameters(one_rank_mesh, tmp_path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    def wrap():  # FSDP1 flattens (and with more ranks shards) the weights in its constructor
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)

    model, snap = _record(wrap)
    names = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"_init_param_handle_from_module", "flatten_tensors"} <= names
    assert _net(_imported(snap, tmp_path)) == {"parameter": _state_bytes(model)}  # was other


def test_fsdp2_reduce_scatter_output_is_the_gradient(one_rank_mesh, tmp_path):
    model = _fsdp_model(one_rank_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def step():
        model(x).square().mean().backward()
        grads = _state_bytes(nn.ParameterList([nn.Parameter(p.grad) for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grads

    grad_bytes, snap = _record(step)
    tl = _imported(snap, tmp_path)
    ev = tl.frame
    # foreach_reduce allocates two buffers: the reduce-scatter input (the collective's) and its output,
    # which param.grad views until the optimizer has stepped
    allocs = ev[(ev["delta_bytes"] > 0) & (ev["op"].astype(str) == "allocate")]
    cats = allocs.groupby(allocs["category"].astype(str))["delta_bytes"].sum().to_dict()
    assert cats == {"gradient": grad_bytes, "communication": grad_bytes}, cats  # was all communication
    assert set(allocs["phase"].astype(str)) == {"backward"}


# --------------------------------------------------------------------------------------------------
# Stacks a CPU run cannot make, built from the recorded ones
# --------------------------------------------------------------------------------------------------

def _recorded_call_chain(run, name: str) -> list[dict]:
    """The Python stack at the first call of a function named ``name`` while ``run()`` runs, innermost first
    (a profile hook, so no wrapper of ours is on it)."""
    found: list[list[dict]] = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name == name and not found:
            found.append(_stack(frame))

    before = sys.getprofile()
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(before)
    assert found, f"{name} was not called"
    return found[0]


def _snapshot_of(*events: tuple[str, int, int, list[dict]]) -> dict:
    trace = [{"action": a, "addr": addr, "size": size, "stream": 0, "time_us": 10 * i, "frames": fr}
             for i, (a, addr, size, fr) in enumerate(events)]
    return {"segments": [], "device_traces": [trace]}


# what torch's gatherer puts before the Python frames with _record_memory_history(stacks="all") on CUDA
_CPP = [{"filename": "??", "line": 0,
         "name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"},
        {"filename": "/__w/pytorch/pytorch/aten/src/ATen/native/cuda/EmptyTensor.cpp", "line": 48,
         "name": "at::detail::empty_cuda(c10::ArrayRef<long>, c10::ScalarType, std::optional<c10::Device>)"},
        {"filename": "??", "line": 0, "name": "at::_ops::empty_memory_format::call(c10::ArrayRef<c10::SymInt>)"},
        {"filename": "/__w/pytorch/pytorch/torch/csrc/autograd/generated/python_torch_functions_0.cpp",
         "line": 0, "name": "torch::autograd::THPVariable_empty(_object*, _object*, _object*)"}]


def test_fsdp2_lazy_init_repad_in_the_first_forward_is_parameter(one_rank_mesh):
    # With uneven shards, FSDP's lazy init (the root's first forward) re-pads a shard that _apply or
    # load_state_dict(assign=True) replaced: local_tensor.new_zeros in reset_sharded_param. One rank has no
    # uneven shard, so the call chain is recorded and the allocation placed on it.
    model = _fsdp_model(one_rank_mesh)
    chain = _recorded_call_chain(lambda: model(torch.randn(2, 8)), "reset_sharded_param")
    assert {"_lazy_init", "_root_pre_forward", "_call_impl"} <= {f["name"] for f in chain}
    before = _stack(sys._getframe())
    snap = _snapshot_of(("alloc", 0x1000, 4096, chain),
                        ("alloc", 0x2000, 512, [dict(chain[0], name="forward")] + chain[1:]),  # an activation
                        ("free_completed", 0x2000, 512, before))
    cats = from_snapshot(snap).frame["category"].astype(str).tolist()
    assert cats[0] == "parameter", cats  # was an activation of the forward (a temporary with no backward)
    assert classify_frames([(f["filename"], f["line"], f["name"]) for f in chain])[:2] == ("forward", "parameter")


def test_cuda_shaped_stacks_of_other_torch_and_python_versions():
    model, snap = _record(lambda: build_model(PRESETS["tiny"], seed=None, device="cpu"))
    first = snap["device_traces"][0][0]["frames"]
    assert [f["name"] for f in first[:2]] == ["__torch_function__", "__init__"]
    variants = {
        "cuda, stacks='all'": _CPP + first,
        # Python 3.12+ inlines comprehensions: no <dictcomp> frame between the blocks and the model
        "python 3.12": [f for f in first if not f["name"].startswith("<") or f["name"] == "<module>"],
        # a site-packages torch (2.11/2.12 wheels), nothing else changed on these paths
        "site-packages": [dict(f, filename=f["filename"].replace(os.path.dirname(os.path.dirname(torch.__file__)),
                                                                 "/usr/lib/python3.12/site-packages"))
                          for f in first],
    }
    for what, frames in variants.items():
        got = classify_frames([(f["filename"], f["line"], f["name"]) for f in frames])
        assert got[:2] == ("build", "parameter"), (what, got)

    # set_default_device in a training loop: the device context is on the loss's stack too, but no
    # constructor is: not a parameter, and the forward's own allocations stay the forward's
    site = os.path.dirname(torch.__file__)
    devctx = {"filename": f"{site}/utils/_device.py", "line": 122, "name": "__torch_function__"}
    loss = [devctx, {"filename": f"{site}/nn/functional.py", "line": 3462, "name": "cross_entropy"},
            {"filename": "/w/train.py", "line": 30, "name": "train_step"},
            {"filename": "/w/train.py", "line": 60, "name": "<module>"}]
    assert classify_frames([(f["filename"], f["line"], f["name"]) for f in loss])[:2] == ("other", None)
    fwd = [devctx, {"filename": f"{site}/nn/modules/linear.py", "line": 134, "name": "forward"},
           {"filename": f"{site}/nn/modules/module.py", "line": 1884, "name": "_call_impl"}] + loss[2:]
    assert classify_frames([(f["filename"], f["line"], f["name"]) for f in fwd])[:2] == ("forward", None)
    # a module built inside a forward (rare) stays the forward's
    inner = [devctx, {"filename": f"{site}/nn/modules/linear.py", "line": 109, "name": "__init__"}] + fwd[1:]
    assert classify_frames([(f["filename"], f["line"], f["name"]) for f in inner])[0] == "forward"
    del model
