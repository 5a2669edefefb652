"""Record a memory timeline of this process: every tensor storage made and freed, with what it is.

The CPU has no caching allocator to ask, so the recorder watches tensors the way the program makes
them: a ``TorchDispatchMode`` sees every operator's outputs and logs each new storage once
(``storage.nbytes()``), and a ``weakref.finalize`` on the storage logs its free. The same recorder runs
on top of ``FakeTensorMode`` for predictions (fake storages have real sizes and lifetimes), so a
prediction and a CPU measurement count the same things in the same way. On CUDA the trainer asks the
caching allocator instead (:func:`cuda_timeline`).

**Categories come from identity, learnt as the program reveals it**, and an allocation takes the
strongest identity its storage ever has (``parameter > optimizer > gradient > checkpoint >
communication > activation > temporary > other``):

    parameter      a storage of a module parameter or buffer: every one when :meth:`MemoryRecorder.track`
                   is given the model, and each module's direct parameters again as it runs forward
                   (FSDP2 swaps the gathered, unsharded parameters in just before)
    gradient       ``p.grad`` of the parameters an optimizer is about to step (a global optimizer
                   step pre-hook, so no training code changes); ``p.grad`` of every parameter a module
                   runs with, as soon as autograd has accumulated it (a post-accumulate-grad hook: FSDP2's
                   gathered parameters get their gradients in backward and hand them to a reduce-scatter
                   before any optimizer sees them); and a copy of a gradient made in backward (``_to_copy``
                   or ``clone`` of a gradient: FSDP2's fp32 copies of bf16 gradients for the reduction)
    optimizer      the optimizer's state tensors after its step (AdamW's exp_avg, exp_avg_sq)
    activation     tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``:
                   the pack hook sees exactly what is saved). Under activation checkpointing the
                   checkpoint's own hooks take over inside the region, and what it keeps for the
                   recomputation is the region's inputs: a checkpointed module's tensor inputs
                   (while grad is enabled) are activations too
    communication  outputs and buffers of collectives (operators of the ``c10d``, ``_c10d_functional``
                   and ``fsdp`` namespaces: FSDP2's all-gather and reduce-scatter buffers, DDP buckets)
    checkpoint     storages made while the code is in ``phase("checkpoint")`` (staging copies)
    temporary      everything else made in forward, backward or the optimizer step
    other          everything else (data batches, outside any phase)

**Phases** come from :mod:`workbench.memory.marks` (the step code marks forward, optimizer, checkpoint,
build, the step and the micro-batch), except backward, which the recorder sees for itself: autograd's
engine is running (this also catches the backward passes a pipeline schedule interleaves).
**Module**: the innermost module whose forward is running (global forward hooks), named by its path
in the tracked model.

Storages resized in place (FSDP2 frees its unsharded parameters with ``storage.resize_(0)`` and
regrows them for the next all-gather) are followed by wrapping ``UntypedStorage.resize_`` while the
recorder runs. Not seen: tensors made inside a tensor subclass's own dispatch (DTensor's short-lived
redistribution buffers) and memory that is not a tensor storage (gloo's own buffers, Python objects).

``blocks=True`` (predictions only) also keeps a :class:`BlockTrace`: which transformer block each
parameter-like storage belongs to and what every operator read, from which ``workbench.prediction.fold``
writes a stage of N identical blocks from a simulation of 4.
"""

from __future__ import annotations

import re
import time
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from workbench import compat
from workbench.memory.marks import MARKS
from workbench.memory.timeline import CATEGORIES, MemoryTimeline, TimelineBuilder

__all__ = ["MemoryRecorder", "STRENGTH"]

# the identity an allocation keeps when it has several (a gathered parameter passes through a collective)
STRENGTH = {c: i for i, c in enumerate(("other", "temporary", "activation", "communication", "checkpoint",
                                        "gradient", "optimizer", "parameter"))}
assert set(STRENGTH) == set(CATEGORIES)
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "fsdp")
# operators whose output is a copy of their first input: a copy of a gradient is a gradient
_COPY_OPS = frozenset({torch.ops.aten._to_copy.default, torch.ops.aten.clone.default})

# operators whose output is as large as their inputs together (a fold grows them: BlockTrace.joined)
_JOIN_OPS = frozenset({torch.ops.aten.stack.default, torch.ops.aten.cat.default})
_BLOCK = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")  # a transformer block's path: layers.<id>
_SCALARS = (torch.device, torch.dtype, int, float, bool)
_Tensor = torch.Tensor

# id(operator) -> (operator, name, collective?, copy?, join?): looked up once per operator, by id, since an
# OpOverload hashes in Python (a set lookup per call cost more than the rest of the bookkeeping)
_FUNC_INFO: dict[int, tuple] = {}


def step_phase(graph_task) -> str:
    """The step phase an operator runs in: the marks' phase (``workbench.memory.marks``), except that
    anything run by autograd's engine (``graph_task()`` is not -1) outside the checkpoint, optimizer and
    build phases is backward. Shared by the memory recorder and the step-time op recorder."""
    p = MARKS.phase
    if p in ("checkpoint", "optimizer", "build"):
        return p
    if graph_task() != -1:
        return "backward"
    return p


def _func_info(func) -> tuple:
    info = (func, _op_name(func), getattr(func, "namespace", "") in _COMM_NAMESPACES, func in _COPY_OPS,
            func in _JOIN_OPS)
    _FUNC_INFO[id(func)] = info
    return info

_ACTIVE: list["MemoryRecorder"] = []


def saves_for_backward(tensors: Iterable[Any]) -> None:
    """Tell the running recorders that ``tensors`` are saved for backward: an op-level checkpointing policy
    keeps them itself, where autograd's saved-tensor hooks do not see them."""
    for rec in _ACTIVE:
        rec.label((t for t in tensors if isinstance(t, torch.Tensor)), "activation")


def _block_of_name(name: str) -> tuple[int, str]:
    """The transformer block a module or parameter path is in (``layers.<id>``; -1 outside them), and the
    path below it."""
    m = _BLOCK.search(name)
    return (int(m.group(1)), name[m.end():]) if m else (-1, name)


class BlockTrace:
    """What folding repeated transformer blocks needs (``workbench.prediction.fold``), kept by a recorder
    made with ``blocks=True``: which block every parameter-like storage belongs to (its parameters, their
    gathered copies, gradients and optimizer state), and, per operator, the storages it read, so that each
    event can be told which block the program was working on when it happened."""

    def __init__(self) -> None:
        # per op: (rows logged before it, idents of its inputs); None: outside any block from here
        self.touched: list[tuple[int, tuple[int, ...] | None]] = []
        self.block_of: dict[int, int] = {}                     # ident -> layer id (-1: a parameter outside them)
        # ident -> what it is within its block: (kind, parameter path below the block, how many of this kind
        # and path the block had before), e.g. ("grad", "attention.wq.weight", 0): the same storage of
        # another block has the same role
        self.role_of: dict[int, tuple[str, str, int]] = {}
        self._roles: dict[tuple[int, str, str], int] = {}
        # stack/cat outputs (row index) -> (output bytes, ((ident, bytes) of each input)): their size is the
        # sum of their inputs', which a fold repeats (the gradient norm stacks one sum per parameter)
        self.joined: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}


def _clean_name(name: str) -> str:
    """A module path as the user wrote the model: without DDP's ``module.`` and wrapper segments."""
    parts = [p for p in name.split(".") if p not in ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")]
    if parts[:1] == ["module"]:
        parts = parts[1:]
    return ".".join(parts)


def _op_name(func) -> str:
    name = getattr(func, "name", None)
    try:
        return name() if callable(name) else str(func)
    except Exception:  # noqa: BLE001 - a name is only a label
        return str(func)


class MemoryRecorder:
    """Logs every storage of this process between ``__enter__`` and ``__exit__``.

    ``clock="wall"`` stamps events with seconds since the start (measured runs); ``"sequence"`` with
    the event's position in microseconds (predictions, whose wall time means nothing).
    Use::

        rec = MemoryRecorder(rank=0)
        with rec:
            model = build(...)            # parameters are logged as they are made
            rec.track(model=model)        # ... and named: parameters, and module paths for activations
            train_step(model, opt)        # activations, gradients, optimizer state, temporaries
        timeline = rec.timeline()         # a MemoryTimeline (workbench.memory.timeline)
    """

    def __init__(self, rank: int = 0, device: str | torch.device = "cpu", *, clock: str = "wall",
                 source: str = "measured", allocator: str | None = None, blocks: bool = False):
        if not compat.check("memory.recorder"):
            compat.require("memory.recorder", "memory recording", "upgrade torch (see `workbench doctor`)")
        self.rank = rank
        self.device = torch.device(device)
        self._device_type = self.device.type if self.device.type in ("cpu", "cuda") else None
        # whose block sizes to count: the device's own, or CUDA's when a prediction made on fake CPU
        # tensors targets a GPU
        self.allocator = allocator or self.device.type
        self.clock = clock
        self.source = source
        self._builder = TimelineBuilder(rank)
        self._library_blocks = 0  # library_block()'s ids: -1, -2, ...
        self._live: dict[int, list] = {}  # id(storage) -> [ident, nbytes, weakref to storage]
        self._final: dict[int, str] = {}  # ident -> strongest identity known
        self._cat_live: dict[str, int] = {c: 0 for c in CATEGORIES}
        self._live_bytes = 0
        self._peak = 0
        self._peak_by_cat: dict[str, int] = {}
        self._step_peak = 0
        self._step_peak_by_cat: dict[str, int] = {}
        self._next_ident = 1
        self._names: dict[int, str] = {}  # id(module) -> qualified name
        self._module_stack: list[str] = []
        self._seq = 0
        self._t0 = 0.0
        self._handles: list[Any] = []
        self._grad_hooked: dict[int, Any] = {}  # id() -> weakref of the parameters with our post-accumulate-grad hook
        self._grad_handles: list[Any] = []
        self._mode = None
        self._saved_hooks = None
        self._resize_orig = None
        self._graph_task = compat.get("current_graph_task_id")  # looked up once: they run for every tensor
        self._is_subclass = compat.get("is_traceable_wrapper_subclass")
        self.overhead_s = 0.0  # time spent inside the recorder's own bookkeeping
        self.blocks = BlockTrace() if blocks else None

    # -- clock, phase ----------------------------------------------------------------------------
    def _now(self) -> float:
        if self.clock == "sequence":
            self._seq += 1
            return self._seq * 1e-6
        return time.perf_counter() - self._t0

    def _phase(self) -> str:
        return step_phase(self._graph_task)

    def _round(self, n: int) -> int:
        """Bytes as the device's allocator hands them out: CUDA's caching allocator rounds every block
        up to a multiple of 512 bytes, and ``max_memory_allocated`` counts the rounded blocks."""
        if self.allocator != "cuda" or n == 0:
            return n
        return -(-n // 512) * 512

    # -- storages --------------------------------------------------------------------------------
    def _storage(self, t: torch.Tensor):
        if self._device_type is not None:
            dev = t.device.type
            if dev != "meta" and dev != self._device_type:
                return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None

    def _see(self, t: torch.Tensor, category: str | None, op: str) -> int | None:
        """Log ``t``'s storage if new; label it ``category`` if that is stronger. Returns its ident."""
        storage = self._storage(t)
        if storage is None:
            return None
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            phase = self._phase()
            cat = category or ("checkpoint" if phase == "checkpoint" else
                               "temporary" if phase in ("forward", "backward", "optimizer") else "other")
            n = self._round(storage.nbytes())
            ident = self._next_ident
            self._next_ident += 1
            module = self._module_stack[-1] if self._module_stack else ""
            # a weak reference that logs the free (kept in the entry: cheaper than weakref.finalize)
            ref = weakref.ref(storage, lambda _, key=key, ident=ident: self._freed(key, ident))
            self._live[key] = entry = [ident, n, cat, module, op, ref]
            self._final[ident] = cat
            self._add(n, cat)
            self._builder.add(self._now(), n, cat, phase, MARKS.step, MARKS.microbatch, module, op, ident)
            return ident
        if category is not None:
            self._relabel(entry, category)
        return entry[0]

    def _relabel(self, entry: list, category: str) -> None:
        ident, n, cat = entry[0], entry[1], entry[2]
        if STRENGTH[category] > STRENGTH[cat]:
            self._cat_live[cat] -= n
            self._cat_live[category] += n
            entry[2] = category
            self._final[ident] = category

    def _add(self, n: int, cat: str) -> None:
        self._live_bytes += n
        self._cat_live[cat] += n
        if self._live_bytes > self._step_peak:
            self._step_peak = self._live_bytes
            self._step_peak_by_cat = dict(self._cat_live)
        if self._live_bytes > self._peak:
            self._peak = self._live_bytes
            self._peak_by_cat = dict(self._cat_live)

    def _freed(self, key: int, ident: int) -> None:
        entry = self._live.get(key)
        if entry is None or entry[0] != ident:
            return
        del self._live[key]
        n, cat = entry[1], entry[2]
        self._live_bytes -= n
        self._cat_live[cat] -= n
        if n:
            self._builder.add(self._now(), -n, cat, self._phase(), MARKS.step, MARKS.microbatch, entry[3],
                              entry[4], ident)

    def _resized(self, storage, nbytes: int) -> None:
        entry = self._live.get(id(storage))
        if entry is None:
            return
        nbytes = self._round(nbytes)
        delta = nbytes - entry[1]
        if not delta:
            return
        entry[1] = nbytes
        if delta > 0:
            self._add(delta, entry[2])
        else:
            self._live_bytes += delta
            self._cat_live[entry[2]] += delta
        module = self._module_stack[-1] if self._module_stack else entry[3]
        self._builder.add(self._now(), delta, entry[2], self._phase(), MARKS.step, MARKS.microbatch, module,
                          "resize_" if delta > 0 else "resize_(free)", entry[0])

    # -- what tensors are --------------------------------------------------------------------------
    def _locals(self, t) -> Iterable[torch.Tensor]:
        if not isinstance(t, torch.Tensor):
            return
        if self._is_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                yield from self._locals(getattr(t, name, None))
        else:
            yield t

    def label(self, tensors: Iterable[Any], category: str) -> None:
        """Say what ``tensors`` are (storages not yet seen are logged now, e.g. made before recording)."""
        for t in tensors:
            for local in self._locals(t):
                self._see(local, category, "(tracked)")

    def track(self, model: nn.Module | Iterable[nn.Module] | None = None, optimizer=None) -> "MemoryRecorder":
        """Learn the model's parameters and module names, and the optimizer's state."""
        models = [] if model is None else [model] if isinstance(model, nn.Module) else list(model)
        for m in models:
            for name, mod in m.named_modules():
                self._names.setdefault(id(mod), _clean_name(name))
            self.label(m.parameters(), "parameter")
            self.label(m.buffers(), "parameter")
            if self.blocks is not None:
                for name, t in (*m.named_parameters(), *m.named_buffers()):
                    self._block_is(t, "param", *_block_of_name(_clean_name(name)))
        if optimizer is not None:
            self._learn_optimizer(optimizer, state=True)
        return self

    def _is_gradient(self, t) -> bool:
        """True when ``t``'s storage is one the recorder already knows as a gradient."""
        if not isinstance(t, torch.Tensor):
            return False
        for local in self._locals(t):
            storage = self._storage(local)
            entry = self._live.get(id(storage)) if storage is not None else None
            if entry is not None and entry[2] == "gradient":
                return True
        return False

    def _hook_gradient(self, p: torch.Tensor) -> None:
        """Learn ``p.grad`` as a gradient as soon as autograd accumulates it (once per parameter object)."""
        seen = self._grad_hooked.get(id(p))
        if (seen is not None and seen() is p) or not (p.requires_grad and p.is_leaf):
            return
        self._grad_hooked[id(p)] = weakref.ref(p)
        try:
            self._grad_handles.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))
        except RuntimeError:  # a tensor autograd cannot hook: its gradient is learnt at the optimizer step
            pass

    def _grad_accumulated(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.label((p.grad,), "gradient")
            if self.blocks is not None:
                self._block_is(p.grad, "grad", *self._block_known(p))

    def _learn_optimizer(self, opt, *, grads: bool = False, state: bool = False) -> None:
        if grads:
            self.label((p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None), "gradient")
        if state:
            for st in opt.state.values():
                self.label((v for v in st.values() if isinstance(v, torch.Tensor)), "optimizer")
        if self.blocks is not None:  # a gradient and the state belong to their parameter's block
            for g in opt.param_groups:
                for p in g["params"]:
                    where = self._block_known(p)
                    if grads and p.grad is not None:
                        self._block_is(p.grad, "grad", *where)
                    if state:
                        for k, v in opt.state.get(p, {}).items():
                            if isinstance(v, torch.Tensor):
                                self._block_is(v, f"state:{k}", *where)

    # -- blocks (folding) ------------------------------------------------------------------------
    def _idents(self, t) -> list[int]:
        out = []
        for local in self._locals(t):
            storage = self._storage(local)
            entry = self._live.get(id(storage)) if storage is not None else None
            if entry is not None:
                out.append(entry[0])
        return out

    def _block_is(self, t, kind: str, block: int | None, path: str) -> None:
        if block is None:
            return
        b = self.blocks
        for ident in self._idents(t):
            if ident not in b.block_of:
                b.block_of[ident] = block
                n = b._roles.get((block, kind, path), 0)
                b._roles[(block, kind, path)] = n + 1
                b.role_of[ident] = (kind, path, n)

    def _block_known(self, t) -> tuple[int | None, str]:
        """The block and path of a parameter the recorder knows (None: it does not)."""
        for ident in self._idents(t):
            block = self.blocks.block_of.get(ident)
            if block is not None:
                return block, self.blocks.role_of[ident][1]
        return None, ""

    def _note_inputs(self, rows: int, args, kwargs) -> None:
        """Note the storages an operator reads (its tensor arguments, and those in list arguments)."""
        idents = []
        live, storage_of, is_subclass = self._live, self._storage, self._is_subclass
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, _Tensor):
                ts = (a,)
            elif isinstance(a, (list, tuple)):
                ts = a
            else:
                continue
            for t in ts:
                if not isinstance(t, _Tensor):
                    continue
                for local in (self._locals(t) if is_subclass(t) else (t,)):
                    storage = storage_of(local)
                    entry = live.get(id(storage)) if storage is not None else None
                    if entry is not None:
                        idents.append(entry[0])
        self.blocks.touched.append((rows, tuple(idents)))

    # -- hooks -----------------------------------------------------------------------------------
    def _make_mode(self):
        tree_flatten = compat.get("pytree").tree_flatten
        rec = self

        is_subclass, see, perf_counter = rec._is_subclass, rec._see, time.perf_counter

        class Recording(compat.unguarded_dispatch_mode()):  # never under torch.compile (TrainConfig)
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                rows = 0  # only the fold reads it
                if rec.blocks is not None:
                    rows = len(rec._builder.rows)
                    rec._note_inputs(rows, args, kwargs)
                out = func(*args, **kwargs) if kwargs else func(*args)
                if out is None or isinstance(out, _SCALARS):
                    return out  # prim::device, sizes, scalars: half of all calls, nothing to count
                t0 = perf_counter()
                _, name, comm, copy, join = _FUNC_INFO.get(id(func)) or _func_info(func)
                label = "communication" if comm else None
                if copy and args and rec._phase() == "backward" and rec._is_gradient(args[0]):
                    label = "gradient"
                if isinstance(out, _Tensor):
                    outs = (out,)
                elif isinstance(out, (list, tuple)) and not any(isinstance(t, (list, tuple, dict)) for t in out):
                    outs = out
                else:
                    outs = tree_flatten(out)[0]
                for t in outs:
                    if isinstance(t, _Tensor):
                        if is_subclass(t):
                            for local in rec._locals(t):
                                see(local, label, name)
                        else:
                            see(t, label, name)
                if comm:  # buffers handed to a collective (DDP buckets, FSDP2's all-gather input)
                    for t in tree_flatten((args, kwargs))[0]:
                        if isinstance(t, _Tensor):
                            for local in rec._locals(t):
                                see(local, "communication", name)
                if rec.blocks is not None:
                    if join and len(rec._builder.rows) == rows + 1:
                        ins = tuple((i, t.numel() * t.element_size()) for t in args[0]
                                    if isinstance(t, torch.Tensor) for i in rec._idents(t)[:1])
                        rec.blocks.joined[rows] = (out.numel() * out.element_size(), ins)
                rec.overhead_s += time.perf_counter() - t0
                return out

        return Recording()

    def _pack(self, t):
        if self._is_subclass(t):
            for local in self._locals(t):
                self._see(local, "activation", "(saved)")
        else:
            self._see(t, "activation", "(saved)")
        return t

    def _pre_forward(self, module, args):
        self._module_stack.append(self._names.get(id(module), type(module).__name__))
        if type(module).__name__ == "CheckpointWrapper" and torch.is_grad_enabled():
            self.label((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), "activation")
        # FSDP2 has just swapped in the gathered parameters: they are parameters, not activations; and
        # their gradients, made in backward and reduced before any optimizer step, are gradients
        for name, p in module._parameters.items():
            if p is not None:
                for local in (self._locals(p) if self._is_subclass(p) else (p,)):
                    self._see(local, "parameter", "(unshard)")
                self._hook_gradient(p)
                if self.blocks is not None:
                    block, path = _block_of_name(self._module_stack[-1])
                    self._block_is(p, "param", block, f"{path}.{name}".lstrip("."))

    def _post_forward(self, module, args, output):
        if self._module_stack:
            self._module_stack.pop()

    def _opt_pre(self, opt, args, kwargs):
        self._learn_optimizer(opt, grads=True)

    def _opt_post(self, opt, args, kwargs):
        self._learn_optimizer(opt, state=True)
        if self.blocks is not None:  # what follows a step (zero_grad) is no block's work
            self.blocks.touched.append((len(self._builder.rows), None))

    def __enter__(self) -> "MemoryRecorder":
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        self._t0 = time.perf_counter()
        _ACTIVE.append(self)
        self._handles = [
            module_mod.register_module_forward_pre_hook(self._pre_forward),
            module_mod.register_module_forward_hook(self._post_forward),
            optimizer_mod.register_optimizer_step_pre_hook(self._opt_pre),
            optimizer_mod.register_optimizer_step_post_hook(self._opt_post),
        ]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        self._wrap_resize()
        self._mode = self._make_mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        self._unwrap_resize()
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(*exc)
            self._saved_hooks = None
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles, self._grad_handles = [], []
        self._grad_hooked.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _wrap_resize(self) -> None:
        """Follow in-place storage resizes (FSDP2's free/regrow of unsharded parameters)."""
        if _ACTIVE and _ACTIVE[0] is not self:
            return  # the outermost recorder wraps once and tells every active recorder
        orig = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = orig(storage, size)
            for rec in list(_ACTIVE):
                rec._resized(storage, int(size))
            return out

        self._resize_orig = orig
        torch.UntypedStorage.resize_ = resize_

    def _unwrap_resize(self) -> None:
        if self._resize_orig is not None:
            torch.UntypedStorage.resize_ = self._resize_orig
            self._resize_orig = None

    # -- results ---------------------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def step_summary(self) -> dict[str, Any]:
        """Live bytes now, and the peak since the last call with its bytes per category (for the
        per-step ``memory`` event the dashboard plots); starts the next step's peak from now."""
        out = {"live_bytes": int(self._live_bytes), "peak_bytes": int(self._step_peak),
               "by_category": {c: int(v) for c, v in self._step_peak_by_cat.items() if v}}
        self._step_peak = self._live_bytes
        self._step_peak_by_cat = dict(self._cat_live)
        return out

    @property
    def events(self) -> list[tuple]:
        """The events so far: (t, delta, category, phase, step, microbatch, module, op, ident) each."""
        return self._builder.rows

    @property
    def categories(self) -> dict[int, str]:
        """ident -> the strongest identity its storage has had."""
        return self._final

    def round_bytes(self, n: int) -> int:
        """``n`` bytes as this recorder's allocator counts them."""
        return self._round(n)

    def set_events(self, rows: list[tuple], categories: dict[int, str]) -> None:
        """Replace the events so far (a prediction folding repeated blocks: ``workbench.prediction.fold``)."""
        self._builder.rows = list(rows)
        self._final = dict(categories)

    def library_block(self, nbytes: int, op: str, phase: str = "forward") -> bool:
        """Count ``nbytes`` that a library takes from the allocator once and keeps (cuBLAS's workspaces) from
        the first event of ``phase`` on, as category 'other'. False when nothing ran in that phase."""
        self._library_blocks += 1
        return self._builder.insert_before_first(phase, nbytes, "other", op, ident=-self._library_blocks)

    def timeline(self, **meta) -> MemoryTimeline:
        """The events so far, each labelled with the strongest identity its storage ever had."""
        return self._builder.timeline(self._final, source=self.source, device=self.allocator,
                                      meta={"recording_overhead_s": round(self.overhead_s, 6), **meta})
