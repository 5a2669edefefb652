"""Record what one rank's fake training step computes and communicates, operator by operator, in order.

:class:`OpRecorder` is a dispatch mode that sits on top of ``FakeTensorMode`` in a fake step
(``workbench.prediction.fake.run_fake_steps``, the trainer's own build and step code) and logs one
:class:`Op` per operator on plain (local) tensors:

    compute      FLOPs from ``torch.utils.flop_counter``'s formulas (matmuls, attention), bytes read and
                 written from the tensors' sizes, the class that prices it (matmul, attention, elementwise,
                 view: an operator that only makes a view moves nothing) and the dtype
    collective   kind (``workbench.spmd.comm``'s tables of functional and c10d collectives, plus send and
                 recv), the full buffer ``N`` (``workbench.parallel.collectives.full_buffer_bytes``), the
                 group's global ranks, and how the step waits for it (``mode``)

Operators on DTensors are handed to DTensor first (``NotImplemented``, as ``CommDebugMode`` does), so the
recorder sees what DTensor runs: the local operators and the collectives of its redistributions.

``mode`` of a collective is how the technique that issued it overlaps it with compute:

    sync        the compute stream waits for it at once: functional collectives (DTensor's TP/SP
                redistributions, the EP all-to-all), and c10d calls outside the rules below
    prefetch    FSDP2's all-gathers (c10d all-gather ops): the next compute waits for it; it may start
                early (forward: while the previous unit computes; backward: FSDP2 prefetches itself)
    async       gradient reductions issued in backward (FSDP2's reduce-scatter, HSDP's and DDP's
                all-reduce): waited for at the end of backward
    send, recv  pipeline point-to-point (``peer``: the other rank)

Each op also carries its phase, step and micro-batch (``workbench.memory.marks``; backward: autograd's
engine is running) and module: the innermost module whose forward runs, and in backward the transformer
block (or top-level module) whose backward runs (a pre-hook on its output's autograd node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench import compat
from workbench.memory.marks import MARKS
from workbench.memory.recorder import step_phase
from workbench.parallel.collectives import full_buffer_bytes

__all__ = ["Op", "OpRecorder", "op_class_of"]

_Tensor = torch.Tensor
_SCALARS = (torch.device, torch.dtype, int, float, bool)
_TOP = re.compile(r"(?:^|\.)layers\.\d+$|^[^.]+$")  # modules whose backward is tracked: blocks and top-level ones
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
_ATTENTION = ("attention", "sdpa")


@dataclass(slots=True)
class Op:
    """One operator or collective of a rank's step (see the module docstring)."""

    cls: str          # matmul | attention | elementwise | view | collective
    name: str
    phase: str
    step: int
    microbatch: int
    module: str
    flops: float = 0.0
    nbytes: int = 0   # compute: bytes read + written; collective: the full buffer N of the call
    dtype: str = "fp32"
    kind: str = ""    # collective kind (all_gather, ...)
    group: tuple = ()  # collective: the global ranks of its group; send/recv: (self, peer)
    mode: str = ""    # sync | prefetch | async | send | recv
    peer: int = -1


def op_class_of(name: str, flops: float) -> str:
    if flops and any(a in name for a in _ATTENTION):
        return "attention"
    return "matmul" if flops else "elementwise"


def _nbytes(x: Any) -> int:
    if isinstance(x, _Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _first_tensor(x: Any):
    if isinstance(x, _Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


class _FuncInfo:
    """Per operator, looked up once: its name, whether it is a view, a collective (kind, tensor and group
    argument positions) and its FLOP formula."""

    __slots__ = ("name", "view", "coll", "flop", "namespace", "alloc")

    def __init__(self, func) -> None:
        from torch.utils.flop_counter import flop_registry

        from workbench.spmd.comm import _C10D, _FUNCOL

        self.namespace = getattr(func, "namespace", "")
        try:
            self.name = f"{self.namespace}::{func._schema.name.split('::')[-1]}"
        except AttributeError:
            self.name = str(func)
        schema = getattr(func, "_schema", None)
        rets = list(getattr(schema, "returns", []) or [])
        self.view = bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
        packet = getattr(func, "_overloadpacket", None)
        self.alloc = str(packet) in _ALLOCATING  # memory handed out, nothing computed or moved
        self.coll = None
        if packet in _FUNCOL:
            kind, gi = _FUNCOL[packet]
            self.coll = (kind, 0, gi)
        elif packet in _C10D:
            kind, ti, gi = _C10D[packet]
            self.coll = (kind, ti, gi)
        elif packet is torch.ops.c10d.send:
            self.coll = ("send", 0, 1)
        elif packet is torch.ops.c10d.recv_:
            self.coll = ("recv", 0, 1)
        self.flop = flop_registry.get(packet) if packet is not None else None
        if self.flop is None and packet is not None:
            self.flop = _EXTRA_FLOPS.get(str(packet))


def _cpu_sdpa(query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_val=None, **kwargs):
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_ALLOCATING = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty",
                         "aten.new_empty_strided", "aten.resize_", "aten.set_", "aten.lift_fresh"})


# attention kernels torch's FLOP counter has no formula for (CPU's flash attention)
_EXTRA_FLOPS = {"aten._scaled_dot_product_flash_attention_for_cpu": _cpu_sdpa,
                "aten._scaled_dot_product_flash_attention_for_cpu_backward": _cpu_sdpa_backward}


class OpRecorder:
    """Logs every operator and collective of this rank's step (``ops``) while entered; see the module."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.ops: list[Op] = []
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._bwd_module = ""
        self._infos: dict[int, _FuncInfo] = {}
        self._handles: list[Any] = []
        self._mode = None
        self._graph_task = compat.get("current_graph_task_id")
        self._ranks_cache: dict[Any, tuple] = {}
        self.params_by_block: dict[int, int] = {}  # transformer block (-1: none) -> local parameter elements
        try:
            self._unbox = compat.get("process_group_unbox")
        except compat.MissingTorchAPI:  # c10d ops' groups then go unnamed: sized from their tensors
            self._unbox = None

    # -- what the program is doing -------------------------------------------------------------
    def track(self, model=None, optimizer=None) -> "OpRecorder":
        from workbench.memory.recorder import _clean_name

        from workbench.memory.recorder import _block_of_name

        models = [] if model is None else [model] if isinstance(model, torch.nn.Module) else list(model)
        for m in models:
            for name, mod in m.named_modules():
                self._names.setdefault(id(mod), _clean_name(name))
            for name, p in m.named_parameters():
                local = compat.local_tensor(p) if hasattr(p, "to_local") else p
                block = _block_of_name(_clean_name(name))[0]
                self.params_by_block[block] = self.params_by_block.get(block, 0) + local.numel()
        return self

    def optimizer_scale(self, plan) -> float:
        """How many times more parameters the real stage of a fold ``plan`` holds than the simulated one
        (the optimizer's foreach operators work on all of them at once)."""
        blocks = {b: n for b, n in self.params_by_block.items() if b >= 0}
        other = self.params_by_block.get(-1, 0)
        if not blocks:
            return 1.0
        per_block = sum(blocks.values()) / len(blocks)
        return (other + per_block * len(plan.real)) / (other + per_block * len(blocks))

    def _phase(self) -> str:
        return step_phase(self._graph_task)

    def _module(self, phase: str) -> str:
        if self._stack:
            return self._stack[-1]
        return self._bwd_module if phase == "backward" else ""

    def _pre_forward(self, module, args):
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post_forward(self, module, args, output):
        name = self._stack.pop() if self._stack else ""
        if name and torch.is_grad_enabled() and _TOP.match(name):
            t = _first_tensor(output)
            fn = getattr(t, "grad_fn", None) if t is not None else None
            if fn is not None:
                def enter(grad_outputs, name=name):
                    self._bwd_module = name
                fn.register_prehook(enter)

    def _group_ranks(self, group: Any) -> tuple:
        """The global ranks of a collective's group: a functional collective names it, a c10d op holds it as a
        script object (unboxed, then named: a transient object's id may be reused by another group)."""
        pg = group
        if not isinstance(group, str):
            if not hasattr(group, "size") and self._unbox is not None:
                pg = self._unbox(group)
            name = getattr(pg, "group_name", None)
            if not isinstance(name, str):
                return self._ranks_of(pg)
            group = name
        ranks = self._ranks_cache.get(group)
        if ranks is None:
            if pg is group:
                pg = compat.get("resolve_process_group")(group)
            ranks = self._ranks_cache[group] = self._ranks_of(pg)
        return ranks

    @staticmethod
    def _ranks_of(pg: Any) -> tuple:
        try:
            return tuple(dist.get_process_group_ranks(pg))
        except (RuntimeError, ValueError, KeyError, AttributeError, TypeError):
            return tuple(range(pg.size())) if hasattr(pg, "size") else ()

    # -- recording -----------------------------------------------------------------------------
    def _record(self, func, args, kwargs, out) -> None:
        if isinstance(out, _SCALARS):
            return  # prim::device, sizes, scalars: no kernel
        info = self._infos.get(id(func))
        if info is None:
            info = self._infos[id(func)] = _FuncInfo(func)
        phase = self._phase()
        if phase == "build":
            return
        module = self._module(phase)
        if info.coll is not None:
            self._record_coll(info, args, kwargs, phase, module)
            return
        if info.namespace in ("c10d", "_c10d_functional", "c10d_functional", "profiler"):  # waits, bookkeeping
            self.ops.append(Op("view", info.name, phase, MARKS.step, MARKS.microbatch, module))
            return
        if info.view or info.alloc:
            self.ops.append(Op("view", info.name, phase, MARKS.step, MARKS.microbatch, module))
            return
        flops = 0.0
        if info.flop is not None:
            try:
                flops = float(info.flop(*args, **(kwargs or {}), out_val=out))
            except Exception:  # noqa: BLE001 - an unexpected signature: price it by its bytes
                flops = 0.0
        nbytes = 0
        for a in args:
            nbytes += _nbytes(a)
        if kwargs:
            for a in kwargs.values():
                nbytes += _nbytes(a)
        # an in-place operator returning nothing (foreach, fused optimizers) writes what it reads, about
        nbytes += _nbytes(out) if out is not None else nbytes
        t = _first_tensor(args)
        dtype = _DTYPES.get(t.dtype, "fp32") if t is not None else "fp32"
        self.ops.append(Op(op_class_of(info.name, flops), info.name, phase, MARKS.step, MARKS.microbatch, module,
                           flops, nbytes, dtype))

    def _record_coll(self, info: _FuncInfo, args, kwargs, phase: str, module: str) -> None:
        kind, ti, gi = info.coll
        group = args[gi] if len(args) > gi else (kwargs or {}).get("group_name")
        ranks = self._group_ranks(group) if group is not None else ()
        inp = args[ti] if len(args) > ti else None
        step, mb = MARKS.step, MARKS.microbatch
        if kind in ("send", "recv"):
            peer_local = args[2] if len(args) > 2 else -1
            peer = ranks[peer_local] if isinstance(peer_local, int) and 0 <= peer_local < len(ranks) else -1
            self.ops.append(Op("collective", info.name, phase, step, mb, module, 0.0, _nbytes(inp), "", "send/recv",
                               (self.rank, peer), kind, peer))
            return
        n = len(ranks) or 1
        full = full_buffer_bytes(kind, _nbytes(inp), n)
        if info.namespace != "c10d":
            mode = "sync"
        elif kind == "all_gather" and phase in ("forward", "backward"):
            mode = "prefetch"
        elif phase == "backward" and kind in ("reduce_scatter", "all_reduce"):
            mode = "async"
        else:
            mode = "sync"
        self.ops.append(Op("collective", info.name, phase, step, mb, module, 0.0, full, "", kind, ranks, mode))

    def _make_mode(self):
        rec = self

        class Recording(compat.unguarded_dispatch_mode()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                for t in types:
                    if t is not _Tensor and hasattr(t, "__tensor_flatten__") and not _is_fake_type(t):
                        return NotImplemented  # DTensor: let it run, and see its local operators
                out = func(*args, **kwargs) if kwargs else func(*args)
                rec._record(func, args, kwargs, out)
                return out

        return Recording()

    def __enter__(self) -> "OpRecorder":
        from torch.nn.modules import module as module_mod

        self._handles = [module_mod.register_module_forward_pre_hook(self._pre_forward),
                         module_mod.register_module_forward_hook(self._post_forward)]
        self._mode = self._make_mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []


_FAKE_TYPES: dict[type, bool] = {}


def _is_fake_type(t: type) -> bool:
    known = _FAKE_TYPES.get(t)
    if known is None:
        known = _FAKE_TYPES[t] = issubclass(t, compat.get("FakeTensor"))
    return known
