"""The registry of our SPMD rules, and the switch that installs them into DTensor.

A rule is one of two kinds:

* a **handler** ``(op_call, args, kwargs) -> result`` that replaces DTensor's dispatch for one aten op.
  Used where the sharded computation is not "run the op on the local shards": batch_norm on a
  batch-sharded input (local sums, all-reduce, normalise locally), min-with-indices over a sharded dim,
  index_put into the shard that owns each index. A handler falls back to torch's own dispatch with
  ``torch_dispatch(op_call, args, kwargs)`` for placements it does not improve.
* a **strategy** ``(OpSchema) -> OpStrategy`` registered with DTensor's sharding propagator, for ops
  whose local computation is the plain op and where only the placement choice differs.
* a **single-dim strategy** ``(op, args_meta, kwargs_meta) -> [[out, *inputs], ...]``: the valid
  placements over ONE mesh dimension (torch expands them over every mesh dimension and picks the
  cheapest). This is how torch 2.13 itself describes pointwise ops, so extending one of torch's rules
  (e.g. "masked_fill keeps Partial(max)") is a few extra rows.

Torch consults single-dim strategies before full strategies, so installing one of our strategies for an
op also takes torch's single-dim entry out of the way (and ``uninstall`` puts it back).

Multi-mesh-dim fallback: an input sharded on one tensor dim over several mesh dims (``[S(0), S(0)]`` on a
2x2 mesh) is legal DTensor, but most hand-written rules reason about one shard per tensor dim. Every
handler is therefore wrapped with :func:`normalize_multi_shard`, which keeps such a shard on the LARGEST
of those mesh dims and replicates over the others (one all-gather over the smaller dims) instead of
failing. Pass ``multi_shard=None`` to ``handler`` for a rule that handles these layouts itself.

``install()`` puts every registered rule into DTensor (``import workbench`` does not: training jobs
call it, and plans, ``explain`` and ``check`` for their duration), ``uninstall()`` restores torch's rules, and
``torch_rules()`` is a context manager that runs a block under torch's defaults (used by the benchmark
and by ``explain`` to compare).

Every op family also registers conformance ``Case``s: dense inputs, a function of them, and which inputs
may be sharded. The harness (``workbench.spmd.conformance``) runs each case under every combination of
placements on a 1-D and a 2-D mesh and compares the DTensor result, forward and backward, with the dense
single-device result.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench import compat
from workbench.compat import OpOverload

FAMILIES = ("elementwise", "binary", "reduction", "norm", "index", "masked", "kernel")

Handler = Callable[[OpOverload, tuple, dict], Any]


@dataclass
class Rule:
    """One aten op whose DTensor behaviour we decide."""

    op: OpOverload
    family: str
    summary: str  # one line: what our rule does that torch's does not
    handler: Handler | None = None
    strategy: Callable | None = None
    schema_info: Any = None  # torch RuntimeSchemaInfo for strategies with non-tensor args that matter
    single_dim: Callable | None = None  # (op, args_meta, kwargs_meta) -> list of [out, *inputs] placements

    @property
    def kind(self) -> str:
        if self.single_dim is not None:  # a handler next to it only routes placements to torch's rule
            return "single_dim"
        return "handler" if self.handler is not None else "strategy" if self.strategy is not None else "single_dim"


@dataclass
class Case:
    """A conformance case: dense inputs, a function of them, and which inputs get placements.

    ``make_inputs(gen)`` returns the dense inputs (tensors or plain values). Inputs at ``shardable`` are
    distributed under every combination of candidate placements (``placements(tensor)``, default:
    Replicate and Shard(d) for every dim), the rest are replicated. ``fn(*inputs)`` must only use public
    torch API so it runs the same on dense tensors and DTensors; it returns a tensor or a tuple of them.
    ``requires_grad`` inputs get gradients checked through ``(out * cotangent).sum().backward()``.
    ``placements`` may offer ``Partial(...)`` for floating-point inputs: the harness splits the value into
    unequal per-rank pieces (``workbench.spmd.placements.make_dtensor``), so an op that forgets to reduce
    a Partial gives a visibly wrong answer.
    """

    name: str  # unique, "family/op/variant"
    family: str
    ops: tuple[OpOverload, ...]  # the registry ops this case exercises
    make_inputs: Callable[[torch.Generator], list]
    fn: Callable[..., Any]
    shardable: tuple[int, ...] = (0,)
    requires_grad: tuple[int, ...] = ()
    placements: Callable[[torch.Tensor], list] | None = None
    atol: float = 1e-5
    rtol: float = 1e-5
    extra: dict = field(default_factory=dict)


RULES: dict[OpOverload, Rule] = {}
CASES: dict[str, Case] = {}

# op -> what torch had before install: {"handler", "strategy", "single_dim", "schema_info", "schema_info_sd"}
_installed: dict[OpOverload, dict[str, Any]] = {}
_MISSING = object()


def _as_ops(ops: OpOverload | Sequence[OpOverload]) -> list[OpOverload]:
    return [ops] if isinstance(ops, OpOverload) else list(ops)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown rule family {family!r}; choose one of {', '.join(FAMILIES)}")


def handler(ops: OpOverload | Sequence[OpOverload], family: str, summary: str, multi_shard: str | None = "largest"):
    """Decorator: register ``fn(op_call, args, kwargs)`` as our DTensor handler for ``ops``.

    With ``multi_shard="largest"`` (default) the handler never sees a tensor dim sharded over several mesh
    dims: :func:`normalize_multi_shard` folds it onto the largest one first. The decorated function itself
    is returned unchanged.
    """
    _check_family(family)
    if multi_shard not in (None, "largest"):
        raise ValueError(f"multi_shard={multi_shard!r}; choose 'largest' or None")

    def deco(fn: Handler) -> Handler:
        wrapped = fn if multi_shard is None else with_multi_shard_fallback(fn)
        for op in _as_ops(ops):
            RULES[op] = Rule(op, family, summary, handler=wrapped)
        return fn

    return deco


def strategy(ops: OpOverload | Sequence[OpOverload], family: str, summary: str, schema_info: Any = None):
    """Decorator: register ``fn(op_schema) -> OpStrategy`` as our sharding strategy for ``ops``."""
    _check_family(family)

    def deco(fn: Callable) -> Callable:
        for op in _as_ops(ops):
            RULES[op] = Rule(op, family, summary, strategy=fn, schema_info=schema_info)
        return fn

    return deco


def single_dim_strategy(ops: OpOverload | Sequence[OpOverload], family: str, summary: str,
                        schema_info: Any = None):
    """Decorator: register ``fn(op, args_meta, kwargs_meta) -> [[out, *inputs], ...]`` for ``ops``.

    Each row lists the placements over ONE mesh dim: the output's, then each tensor input's, in
    argument order; ``Shard(d)`` or torch's sharding placeholders for shards. All-Replicate is implied.
    ``schema_info`` (a ``RuntimeSchemaInfo``) must name the non-tensor arguments the rows depend on
    (e.g. ``static_argnum=2`` for masked_fill's value), or DTensor's cache reuses a stale decision.
    """
    _check_family(family)

    def deco(fn: Callable) -> Callable:
        for op in _as_ops(ops):
            RULES[op] = Rule(op, family, summary, single_dim=fn, schema_info=schema_info)
        return fn

    return deco


def case(c: Case) -> Case:
    """Register a conformance case (names must be unique)."""
    _check_family(c.family)
    if c.name in CASES:
        raise ValueError(f"conformance case {c.name!r} is registered twice")
    CASES[c.name] = c
    return c


def _clear_caches() -> None:
    compat.clear_sharding_caches()


def _single_dim_info(fn: Callable, torch_info: Any = None) -> Any:
    """Wrap ``fn`` for DTensor; where torch had a single-dim rule for the op, keep its flags (uneven and
    unbacked-symint sharding, inputs on other meshes) so only the rows change."""
    return compat.single_dim_strategy_info(fn, None if torch_info is _MISSING else torch_info)


def install() -> None:
    """Put every registered rule into DTensor (idempotent). ``import workbench`` does not call this:
    training jobs do (``TrainConfig.spmd_rules``), and plans, ``explain`` and ``check`` for their duration.

    A rule family whose private torch API the running torch lacks was never registered
    (``workbench.spmd.FAMILY_MODULES``); it is named here in one stderr line, once per process."""
    from workbench.spmd import warn_skipped_families

    if not compat.check("spmd.registry"):
        return
    warn_skipped_families()
    handlers = compat.custom_op_handlers()
    prop = compat.sharding_propagator()
    for op, rule in RULES.items():
        if op in _installed:
            continue
        _installed[op] = {
            "handler": handlers.get(op, _MISSING),
            "strategy": prop.op_strategy_funcs.get(op, _MISSING),
            "single_dim": prop.op_single_dim_strategy_funcs.get(op, _MISSING),
            "schema_info": prop.op_to_schema_info.get(op, _MISSING),
            "schema_info_sd": prop.op_to_schema_info_for_single_dim_strategy.get(op, _MISSING),
        }
        if rule.handler is not None:
            handlers[op] = rule.handler
        if rule.strategy is not None:
            # torch consults single-dim strategies first: take torch's out of the way.
            prop.op_single_dim_strategy_funcs.pop(op, None)
            prop.op_to_schema_info_for_single_dim_strategy.pop(op, None)
            prop.register_op_strategy(op, rule.strategy, rule.schema_info)
        if rule.single_dim is not None:
            info = _single_dim_info(rule.single_dim, _installed[op]["single_dim"])
            prop.register_single_dim_op_strategy(op, info, rule.schema_info)
    _clear_caches()


def _restore(d: dict, op: OpOverload, old: Any) -> None:
    if old is _MISSING:
        d.pop(op, None)
    else:
        d[op] = old


def uninstall() -> None:
    """Restore torch's own rules for every op we replaced."""
    if not _installed:
        return
    handlers = compat.custom_op_handlers()
    prop = compat.sharding_propagator()
    for op, old in _installed.items():
        _restore(handlers, op, old["handler"])
        _restore(prop.op_strategy_funcs, op, old["strategy"])
        _restore(prop.op_single_dim_strategy_funcs, op, old["single_dim"])
        _restore(prop.op_to_schema_info, op, old["schema_info"])
        _restore(prop.op_to_schema_info_for_single_dim_strategy, op, old["schema_info_sd"])
    _installed.clear()
    _clear_caches()


def torch_rule_kind(op: OpOverload) -> str | None:
    """How torch itself decides ``op`` on DTensors: 'handler', 'single_dim', 'strategy', 'rule',
    'decomposition', or None (no rule: DTensor raises)."""
    handlers = compat.custom_op_handlers()
    prop = compat.sharding_propagator()
    saved = _installed.get(op)

    def had(d: dict, key: str) -> bool:
        if saved is not None:
            return saved[key] is not _MISSING
        return op in d

    if had(handlers, "handler"):
        return "handler"
    if had(prop.op_single_dim_strategy_funcs, "single_dim"):
        return "single_dim"
    if had(prop.op_strategy_funcs, "strategy"):
        return "strategy"
    if op in prop.op_to_rules:
        return "rule"
    try:
        if compat.get("DecompShardingStrategy").has_decomp(op):
            return "decomposition"
    except compat.MissingTorchAPI:  # torch 2.11 has no decomposition-based propagation
        pass
    if compat.has_composite_implicit_kernel(op):
        return "decomposition"
    return None


def installed() -> bool:
    return bool(_installed)


@contextlib.contextmanager
def our_rules() -> Iterator[None]:
    """Run a block with our rules installed, then leave DTensor as it was (for plans, explain, check)."""
    was = installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


@contextlib.contextmanager
def torch_rules() -> Iterator[None]:
    """Run a block under torch's default rules, then put ours back if they were installed."""
    was = installed()
    uninstall()
    try:
        yield
    finally:
        if was:
            install()


_FALLBACKS = [0]  # how many times a handler handed a call back to torch (explain reports who decided)


def torch_dispatch(op_call: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op_call`` through torch's own DTensor dispatch, bypassing our handler for it."""
    _FALLBACKS[0] += 1
    return dispatch_past_handler(op_call, args, kwargs)


def dispatch_past_handler(op_call: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op_call`` through DTensor's sharding propagation, skipping our handler for it (our strategy or
    single-dim rule for it, if any, still decides; not counted as a fallback to torch)."""
    handlers = compat.custom_op_handlers()
    ours = handlers.pop(op_call, None)
    old = _installed.get(op_call, {}).get("handler", _MISSING)
    if old is not _MISSING:
        handlers[op_call] = old
    try:
        return op_call(*args, **(kwargs or {}))
    finally:
        if ours is not None:
            handlers[op_call] = ours
        elif old is not _MISSING:
            handlers.pop(op_call, None)


def torch_strategy_dispatch(op_call: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op_call`` under torch's own rules only: for a handler in front of one of our strategies that
    sends the placements where torch's plan moves fewer bytes back to torch.

    Every rule of ours is out for the call (:func:`torch_rules`), not just the one for ``op_call``:
    where torch has no rule for an op it propagates through the op's decomposition, whose ops may be
    ours (masked_fill.Tensor -> where). Costs two cache clears per call, so keep it to rare placements.
    """
    _FALLBACKS[0] += 1
    with torch_rules():
        return op_call(*args, **(kwargs or {}))


# --------------------------------------------------------------------------------------------------
# Multi-mesh-dim fallback
# --------------------------------------------------------------------------------------------------


def multi_shard_target(placements: Sequence[Any], mesh_shape: Sequence[int]) -> tuple | None:
    """Placements that keep each multiply-sharded tensor dim on its largest mesh dim only, or None.

    ``[S(0), S(0)]`` on a (2, 4) mesh -> ``(R, S(0))``: tensor dim 0 stays split 4 ways over mesh dim 1
    and is gathered over mesh dim 0 (ties go to the first mesh dim). None when no tensor dim is sharded
    over more than one mesh dim (nothing to do).
    """
    from torch.distributed.tensor import Replicate, Shard

    by_dim: dict[int, list[int]] = {}
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim, []).append(i)
    if all(len(v) < 2 for v in by_dim.values()):
        return None
    out = list(placements)
    for dim, mesh_dims in by_dim.items():
        if len(mesh_dims) < 2:
            continue
        keep = max(mesh_dims, key=lambda i: (mesh_shape[i], -i))
        for i in mesh_dims:
            if i != keep:
                out[i] = Replicate()
    # A plain Shard keeps its mesh-dim order semantics only when it is the sole shard of that dim.
    out = [Shard(p.dim) if isinstance(p, Shard) else p for p in out]
    return tuple(out)


def normalize_multi_shard(args: Any) -> Any:
    """``args`` with every DTensor sharded on one tensor dim over several mesh dims folded onto the
    largest of those mesh dims (see :func:`multi_shard_target`); anything else is returned as is.

    Works on any pytree (tuples, lists, dicts of args), so a handler can call
    ``args, kwargs = normalize_multi_shard((args, kwargs))``.
    """
    from torch.distributed.tensor import DTensor

    pytree = compat.get("pytree")

    def fix(x: Any) -> Any:
        if isinstance(x, DTensor):
            target = multi_shard_target(x.placements, x.device_mesh.shape)
            if target is not None:
                return x.redistribute(x.device_mesh, target)
        return x

    return pytree.tree_map(fix, args)


def with_multi_shard_fallback(fn: Handler) -> Handler:
    """Wrap a handler so it only ever sees one mesh dim per sharded tensor dim."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard

    def needs(x: Any) -> bool:
        if not isinstance(x, DTensor):
            return False
        dims = [p.dim for p in x.placements if isinstance(p, Shard)]
        return len(dims) != len(set(dims))

    def wrapped(op_call: OpOverload, args: tuple, kwargs: dict) -> Any:
        flat = list(args) + list((kwargs or {}).values())
        flat += [y for x in flat if isinstance(x, (list, tuple)) for y in x]
        if any(needs(x) for x in flat):
            args, kwargs = normalize_multi_shard((tuple(args), dict(kwargs or {})))
        return fn(op_call, args, kwargs)

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped.__name__ = getattr(fn, "__name__", "handler")
    wrapped.__doc__ = fn.__doc__
    return wrapped
