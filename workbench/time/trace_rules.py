"""What a profiler event means for step time: the rules :mod:`workbench.time.trace` reads names by.

Each event of a torch.profiler (Kineto / chrome) trace is matched against :data:`RULES`, first match wins.
An event passes what it tells to everything nested inside it on its thread; a leaf span is classified by
the chain of events enclosing it (innermost facts win), in this order:

1. inside a collective (``comm``) or a wait for one (``wait``): **communication**. On the main thread that is
   exposed communication: the host can do nothing else until the call returns;
2. inside a workbench label (``workbench.forward`` ... ``workbench.checkpoint``, written by the trainer):
   that category. Labels beat every heuristic below;
3. inside an event of a known phase (``autograd::engine::evaluate_function: ...`` is backward,
   ``Optimizer.step#...`` optimizer, ``enumerate(DataLoader)#...`` data): that phase;
4. on a backward thread (one whose events are autograd's; CUDA runs backward on its own thread): backward;
5. otherwise by position in its step: before the step's first backward event forward, after its last
   one optimizer (gradient clipping, scaler and scheduler run there), between them backward.

A stretch of the main thread inside a step where nothing but the step marker is open is a gap: an
``idle`` span named ``wait:rank`` where a collective of this rank is in flight on its communication
stream meanwhile (the host waits for its peers), else ``wait:host``.

A backend's own range on the thread that issued it (``gloo:send``, ``nccl:all_reduce``) lasts from issue to
completion while that thread runs on (a pipeline stage computes while its send is in flight): it is the
collective in flight, a span of the ``comm`` stream, and encloses nothing. gloo's worker threads and NCCL's
kernels are ``comm`` / ``cuda:<stream>`` spans too. A collective's payload (``bytes``) is counted once per
call: on the host call (``c10d::allreduce_``, ``record_param_comms``), else on its run or kernel.

Workbench labels (``torch.profiler.record_function`` names the trainer writes)::

    workbench.step[#N]                            a step (N: its number; else ProfilerStep#N around it)
    workbench.forward[#mbM] ... workbench.checkpoint[#mbM]   a phase, of microbatch M
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["RULES", "match", "collective_kind", "itemsize", "payload_bytes"]

_N = r"(?P<{}>\d{{1,9}})"  # a number that fits an int32

# (kind, value, pattern on the whole event name). kind: step | label | wait | comm | phase | mb | module.
# Named groups: step, mb (microbatch), module, cat (a label's category).
RULES: tuple[tuple[str, str, str], ...] = (
    ("step", "", r"ProfilerStep#" + _N.format("step")),
    ("step", "", r"workbench\.step(?:#" + _N.format("step") + r")?"),
    ("label", "", r"workbench\.(?P<cat>forward|backward|optimizer|data|checkpoint)(?:#mb" + _N.format("mb")
     + r")?(?:[#:. ].*)?"),
    # waiting for a collective another call issued (async collectives, FSDP's reduce-scatter wait)
    ("wait", "", r"(?:aten|c10d|_c10d_functional|c10d_functional)::wait(?:_tensor)?|gloo:wait.*"
     r"|FSDP::\w{0,64}?wait\w{0,64}(?: \(?(?P<module>[^()]{0,512})\)?)?"),
    # collectives: host-side calls, gloo's worker threads, NCCL's ranges and kernels
    ("comm", "", r"FSDP::(?:all_gather|post_backward_reduce)(?: \((?P<module>[^()]{0,512})\))?"),
    ("comm", "", r"(?:c10d|_c10d_functional|c10d_functional)::\w+|record_param_comms|nccl:\w+|gloo:\w+"),
    ("comm", "", r"nccl(?:Dev)?Kernel_\w*"),
    ("phase", "backward", r"autograd::engine::evaluate_function: .*"),
    ("phase", "optimizer", r"Optimizer\.(?:step|zero_grad)#.*"),
    ("phase", "data", r"enumerate\(DataLoader\)#.*"),
    # pipeline schedules (torch.distributed.pipelining): "Forward 3", "Backward 3", "PP:0F3", "PP:1B2"
    ("phase", "forward", r"Forward " + _N.format("mb")),
    ("phase", "backward", r"Backward " + _N.format("mb")),
    ("phase", "forward", r"PP:\d{1,6}F" + _N.format("mb")),
    ("phase", "backward", r"PP:\d{1,6}[BIW]" + _N.format("mb")),
    ("module", "", r"nn\.Module: (?P<module>.{1,512})"),
    ("module", "", r"FSDP::\w+ \((?P<module>[^()]{0,512})\)"),
)
_COMPILED = [(kind, value, re.compile(rx)) for kind, value, rx in RULES]
_PREFILTER = re.compile(r"ProfilerStep|workbench\.|wait|c10d|nccl|gloo|record_param|FSDP|autograd::engine|Optimizer\."
                        r"|DataLoader|Forward |Backward |PP:|nn\.Module")


def match(name: str) -> tuple[str, str, int, int, str] | None:
    """``(kind, value, step, microbatch, module)`` of the first rule whose pattern matches all of ``name``,
    or None (an operator with nothing to say: ``aten::mm``). A label's ``value`` is its category."""
    if not _PREFILTER.search(name):  # most events are plain operators: one search instead of fifteen
        return None
    for kind, value, rx in _COMPILED:
        m = rx.fullmatch(name)
        if m:
            g = m.groupdict()
            return (kind, g.get("cat") or value, int(g["step"]) if g.get("step") else -1,
                    int(g["mb"]) if g.get("mb") else -1, g.get("module") or "")
    return None


# -- collectives' payloads ---------------------------------------------------------------------------------

_KINDS = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "barrier", "reduce", "gather",
          "scatter", "send", "recv")


def collective_kind(name: str) -> str:
    """``c10d::_allgather_base_`` / ``gloo:all_gather`` / ``ncclDevKernel_AllGather_RING_LL`` -> ``allgather``
    (what pairs a host call with its worker-thread run); "" when the name says none."""
    low = re.sub(r"[^a-z]", "", name.rsplit("::", 1)[-1].rsplit(":", 1)[-1].lower())
    low = low.removeprefix("nccldevkernel").removeprefix("ncclkernel")
    for k in _KINDS:
        if low.startswith(k):
            return k
    for k in _KINDS:
        if k in low:
            return k
    return ""


# bytes per element, by the names the profiler writes: C++ types in "Input type", ScalarType in "dtype"
_ITEMSIZE = {
    "float": 4, "double": 8, "half": 2, "bfloat16": 2, "long int": 8, "long": 8, "int": 4, "short int": 2,
    "short": 2, "signed char": 1, "char": 1, "unsigned char": 1, "byte": 1, "bool": 1, "complex<float>": 8,
    "complex<double>": 16, "complexfloat": 8, "complexdouble": 16, "complex<half>": 4, "complexhalf": 4,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "unsigned int": 4, "unsigned long": 8, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8,
}
_MAX_BYTES = 1 << 60  # a payload past this is not a tensor any machine holds: treated as unknown


def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype name (``float``, ``c10::BFloat16``, ``Float``, ``long int``), or 0."""
    if type(dtype) is not str:
        return 0
    return _ITEMSIZE.get(dtype.lower().removeprefix("c10::").strip()[:32], 0)


def _numel(dims: Any) -> int:
    """Elements of one tensor's dims ``[d0, d1, ...]`` (non-negative ints), or -1."""
    if type(dims) is not list or len(dims) > 64 or any(type(d) is not int or not 0 <= d < _MAX_BYTES for d in dims):
        return -1
    n = math.prod(dims)
    return n if n < _MAX_BYTES else -1


def _tensor_sizes(args: dict) -> tuple[list[int], str]:
    """The element counts of the tensors among an op's inputs (a TensorList's summed) and the first tensor
    dtype named ("" for a TensorList: the profiler records no dtype for one)."""
    dims, types = args.get("Input Dims"), args.get("Input type")
    if type(dims) is not list:
        return [], ""
    types = types if type(types) is list else []
    sizes, dtype = [], ""
    for i, d in enumerate(dims[:64]):
        t = types[i] if i < len(types) else ""
        if type(d) is list and d and all(type(x) is list for x in d):  # a TensorList
            parts = [_numel(x) for x in d[:4096]]
            if parts and min(parts) >= 0:
                sizes.append(sum(parts))
        elif type(d) is list and d:
            n = _numel(d)
            if n >= 0:
                sizes.append(n)
                if not dtype and itemsize(t):
                    dtype = t
    return sizes, dtype


def payload_bytes(args: Any, fallback_dtype: str = "") -> tuple[int, str]:
    """A collective call's payload from its event's args: the full (gathered / reduced) tensor in bytes, as
    :mod:`workbench.plan.comm` counts it (``tensor_bytes``): the larger of input and output. Returns
    ``(bytes, dtype)``; 0 when the args say nothing (e.g. a barrier).

    NCCL's ``record_param_comms`` and kernels name ``In msg nelems``/``Out msg nelems`` and ``dtype``; c10d ops
    and gloo's runs name ``Input Dims`` and ``Input type`` (a TensorList has no dtype: ``fallback_dtype``, the
    dtype of the same collective's worker-thread run, else 4 bytes)."""
    if type(args) is not dict:
        return 0, ""
    nel = [args.get(k) for k in ("In msg nelems", "Out msg nelems")]
    nel = [n for n in nel if type(n) is int and 0 <= n < _MAX_BYTES]
    if nel:
        size = itemsize(args.get("dtype")) or itemsize(fallback_dtype) or 4
        b = max(nel) * size
        return (b if b < _MAX_BYTES else 0), str(args.get("dtype")) if itemsize(args.get("dtype")) else ""
    sizes, dtype = _tensor_sizes(args)
    if not sizes:
        return 0, ""
    size = itemsize(dtype) or itemsize(fallback_dtype) or 4
    b = max(sizes) * size
    return (b if b < _MAX_BYTES else 0), dtype
