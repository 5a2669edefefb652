"""torch's own op samples (its OpInfo database) as conformance cases, for every op we have a rule for.

Our registry's cases are shapes we chose. torch's test suite describes each op with an ``OpInfo`` whose
``sample_inputs`` cover what its authors thought of: odd ranks, 0-d tensors, broadcasting, keyword
arguments, every dim. This module turns those samples into :class:`~workbench.spmd.registry.Case` objects
that the harness runs exactly like its own (every placement combination it enumerates, Partial inputs
included, forward and gradients, against the dense run), under our rules and under torch's:

    OpInfos for our ops   an OpInfo whose name is one of our rule ops' (``native_layer_norm`` ->
                          ``native_layer_norm`` and ``nn.functional.layer_norm``; a few aliases below)
    samples               each float32 CPU sample that, run densely, reaches one of our rule ops forward
                          or backward (found by recording the aten ops it dispatches), and runs
    inputs                the sample's tensors (contiguous); everything else stays as the sample has it
    placements            Replicate, Shard(d) for every dim, and Partial(sum), Partial(max) for floats
    gradients             for the tensors the sample itself marks requires_grad

Case names are ``opinfo/<opinfo name>[.<variant>]/<sample index>``. Every rank rebuilds the same
samples: generation is seeded (``torch.manual_seed(0)``) per OpInfo.

    workbench spmd check --source opinfo --rules both     # torch's rules and ours, compared per case

torch's OpInfo database lives in ``torch.testing._internal`` and needs the test-only package
``expecttest``; without it the source is refused in one line (``workbench.compat.op_db``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from workbench import compat
from workbench.spmd.registry import RULES, Case

DTYPE = torch.float32
TOL = dict(atol=1e-4, rtol=1e-4)
SEED = 0

# Rule ops whose OpInfos carry another name: aten.index.Tensor is what tensor[idx] calls; _fused_rms_norm
# is F.rms_norm's kernel; instance_norm is batch_norm on a reshaped input; relu6 is hardtanh(0, 6).
_ALIASES = {"index": ("__getitem__",), "fused_rms_norm": ("rms_norm",), "batch_norm": ("instance_norm",),
            "hardtanh": ("relu6",)}


def _key(name: str) -> str:
    """``aten._native_batch_norm_legit_functional`` and ``nn.functional.batch_norm`` -> one stem each."""
    name = name.rsplit(".", 1)[-1] if name.startswith("nn.functional.") else name
    name = name.lstrip("_")
    if name.startswith("native_"):
        name = name[len("native_"):]
    for suffix in ("_backward", "_functional"):
        if name.endswith(suffix):
            name = name[:-len(suffix)]
    return name.rstrip("_")


def rule_stems() -> set[str]:
    """The names an OpInfo of one of our rule ops may carry (aten ops only: ours have no OpInfo)."""
    stems = set()
    for op in RULES:
        if op.namespace != "aten":
            continue
        stem = _key(op._opname)
        stems.add(stem)
        stems.update(_key(a) for a in _ALIASES.get(stem, ()))
    return stems


def opinfo_key(info: Any) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def rule_opinfos(names: list[str] | None = None) -> list:
    """The OpInfos of our rule ops (``names``: only these OpInfo names, e.g. ``nn.functional.layer_norm``
    or ``max.reduction_with_dim``). Raises ``compat.MissingTorchAPI`` where torch's OpInfos cannot load,
    ``ValueError`` naming an unknown or unrelated name."""
    stems = rule_stems()
    infos = [o for o in compat.op_db() if (_key(o.name) in stems or _key(o.aten_name or "") in stems)
             and DTYPE in o.supported_dtypes("cpu")]
    if names:
        by_key = {opinfo_key(o): o for o in infos}
        bad = [n for n in names if n not in by_key and not any(o.name == n for o in infos)]
        if bad:
            raise ValueError(f"no OpInfo of an op with a workbench rule is named {bad[0]!r}; choose from "
                             f"{', '.join(sorted(by_key))}")
        infos = [o for o in infos if o.name in names or opinfo_key(o) in names]
    return infos


@functools.lru_cache(maxsize=64)
def _samples(key: str) -> tuple:
    """The OpInfo ``key``'s float32 CPU samples, seeded: identical on every rank."""
    info = next(o for o in compat.op_db() if opinfo_key(o) == key)
    with torch.random.fork_rng(devices=[]):  # the caller's generator (a notebook's) is left as it was
        torch.manual_seed(SEED)
        return info, tuple(info.sample_inputs("cpu", DTYPE, requires_grad=info.supports_autograd))


def _split(sample: Any) -> tuple[list, Any, list[int]]:
    """(tensor leaves made contiguous, a rebuild function, indices of the leaves that need gradients)."""
    pytree = compat.get("pytree")
    flat, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    slots = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    tensors = [flat[i].detach().contiguous() for i in slots]
    grads = [k for k, i in enumerate(slots) if flat[i].requires_grad]

    def rebuild(*ts):
        vals = list(flat)
        for i, t in zip(slots, ts):
            vals[i] = t
        return pytree.tree_unflatten(vals, spec)

    return tensors, rebuild, grads


class _Recorder(compat.get("TorchDispatchMode")):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def reached_rule_ops(info: Any, sample: Any) -> tuple[str, ...] | None:
    """Our rule ops a dense run of ``sample`` dispatches, forward and backward; None if it cannot run
    (sparse or complex inputs, or the dense run raises)."""
    tensors, rebuild, grads = _split(sample)
    if any(t.layout != torch.strided or t.is_complex() for t in tensors):
        return None
    leaves = [t.clone().requires_grad_(k in grads) for k, t in enumerate(tensors)]
    rec = _Recorder()
    try:
        with rec:
            inp, args, kwargs = rebuild(*leaves)
            out = info.op(inp, *args, **kwargs)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
            if outs and grads:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    except Exception:  # noqa: BLE001 - a sample that cannot run densely is no conformance case
        return None
    return tuple(sorted(str(op) for op in rec.ops if op in RULES))


@dataclass(frozen=True)
class Pick:
    """One OpInfo sample chosen for the harness (what the parent sends its ranks)."""

    opinfo: str  # opinfo_key
    index: int  # position in the seeded sample list
    ops: tuple[str, ...]  # our rule ops it reaches

    @property
    def name(self) -> str:
        return f"opinfo/{self.opinfo}/{self.index}"


def _name_and_index(text: str) -> tuple[str, int | None]:
    """``"native_layer_norm/3"`` -> ("native_layer_norm", 3); a name without ``/INDEX`` -> (name, None)."""
    name, sep, idx = text.rpartition("/")
    if sep and idx.isdigit():
        return name, int(idx)
    return text, None


def select(names: list[str] | None = None, max_samples: int | None = None) -> list[Pick]:
    """Every sample of our rule ops' OpInfos that reaches one of our rule ops (at most ``max_samples``
    per OpInfo, the first ones). ``names`` entries are OpInfo names, or ``NAME/INDEX`` for one sample
    (as a case name ``opinfo/NAME/INDEX`` gives it)."""
    wanted: dict[str, set[int] | None] = {}
    for text in names or ():
        name, idx = _name_and_index(text)
        if idx is None:
            wanted[name] = None
        elif wanted.get(name, set()) is not None:
            wanted.setdefault(name, set()).add(idx)
    picks = []
    for info in rule_opinfos(list(wanted) or None):
        key = opinfo_key(info)
        only = wanted.get(key, wanted.get(info.name)) if wanted else None
        _, samples = _samples(key)
        if only is not None and max(only) >= len(samples):
            raise ValueError(f"OpInfo {key!r} has {len(samples)} samples; no sample {max(only)}")
        n = 0
        for i, s in enumerate(samples):
            if max_samples is not None and n >= max_samples:
                break
            if only is not None and i not in only:
                continue
            ops = reached_rule_ops(info, s)
            if ops:
                picks.append(Pick(key, i, ops))
                n += 1
    return picks


def _candidates(t: Any) -> list:
    from torch.distributed.tensor import Partial

    from workbench.spmd.placements import default_candidates

    extra = [Partial("sum"), Partial("max")] if isinstance(t, torch.Tensor) and t.is_floating_point() else []
    return default_candidates(t) + extra


def make_case(pick: Pick) -> Case:
    info, samples = _samples(pick.opinfo)
    tensors, rebuild, grads = _split(samples[pick.index])

    def fn(*ts):
        inp, args, kwargs = rebuild(*ts)
        return info.op(inp, *args, **kwargs)

    ops = tuple(o for o in RULES if str(o) in pick.ops)
    return Case(name=pick.name, family="opinfo", ops=ops, make_inputs=lambda gen: list(tensors), fn=fn,
                shardable=tuple(range(len(tensors))), requires_grad=tuple(grads), placements=_candidates,
                **TOL)


def cases(picks: list) -> list[Case]:
    return [make_case(p if isinstance(p, Pick) else Pick(p[0], int(p[1]), tuple(p[2]))) for p in picks]
