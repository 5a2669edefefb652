"""The registry of our SPMD rules, and the switch that installs them into DTensor.

A rule is one of two kinds:

* a **handler** ``(op_call, args, kwargs) -> result`` that replaces DTensor's dispatch for one aten op.
  Used where the sharded computation is not "run the op on the local shards": batch_norm on a
  batch-sharded input (local sums, all-reduce, normalise locally), min-with-indices over a sharded dim,
  index_put into the shard that owns each index. A handler falls back to torch's own dispatch with
  ``torch_dispatch(op_call, args, kwargs)`` for placements it does not improve.
* a **strategy** ``(OpSchema) -> OpStrategy`` registered with DTensor's sharding propagator, for ops
  whose local computation is the plain op and where only the placement choice differs.

``install()`` puts every registered rule into DTensor (``import workbench`` calls it unless the
environment sets ``WORKBENCH_SPMD=0``), ``uninstall()`` restores torch's rules, and
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
from torch._ops import OpOverload

FAMILIES = ("elementwise", "binary", "reduction", "norm", "index", "masked")

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


@dataclass
class Case:
    """A conformance case: dense inputs, a function of them, and which inputs get placements.

    ``make_inputs(gen)`` returns the dense inputs (tensors or plain values). Inputs at ``shardable`` are
    distributed under every combination of candidate placements (``placements(tensor)``, default:
    Replicate and Shard(d) for every dim), the rest are replicated. ``fn(*inputs)`` must only use public
    torch API so it runs the same on dense tensors and DTensors; it returns a tensor or a tuple of them.
    ``requires_grad`` inputs get gradients checked through ``(out * cotangent).sum().backward()``.
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

_installed: dict[OpOverload, tuple[Any, Any]] = {}  # op -> (torch's handler or None, torch's strategy or None)


def _as_ops(ops: OpOverload | Sequence[OpOverload]) -> list[OpOverload]:
    return [ops] if isinstance(ops, OpOverload) else list(ops)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown rule family {family!r}; choose one of {', '.join(FAMILIES)}")


def handler(ops: OpOverload | Sequence[OpOverload], family: str, summary: str):
    """Decorator: register ``fn(op_call, args, kwargs)`` as our DTensor handler for ``ops``."""
    _check_family(family)

    def deco(fn: Handler) -> Handler:
        for op in _as_ops(ops):
            RULES[op] = Rule(op, family, summary, handler=fn)
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


def case(c: Case) -> Case:
    """Register a conformance case (names must be unique)."""
    _check_family(c.family)
    if c.name in CASES:
        raise ValueError(f"conformance case {c.name!r} is registered twice")
    CASES[c.name] = c
    return c


def _dispatcher():
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def _clear_caches() -> None:
    disp = _dispatcher()
    disp.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def install() -> None:
    """Put every registered rule into DTensor (idempotent)."""
    disp = _dispatcher()
    prop = disp.sharding_propagator
    for op, rule in RULES.items():
        if op in _installed:
            continue
        _installed[op] = (disp._custom_op_handlers.get(op), prop.op_strategy_funcs.get(op))
        if rule.handler is not None:
            disp._custom_op_handlers[op] = rule.handler
        if rule.strategy is not None:
            prop.register_op_strategy(op, rule.strategy, rule.schema_info)
    _clear_caches()


def uninstall() -> None:
    """Restore torch's own rules for every op we replaced."""
    disp = _dispatcher()
    prop = disp.sharding_propagator
    for op, (old_handler, old_strategy) in _installed.items():
        if old_handler is None:
            disp._custom_op_handlers.pop(op, None)
        else:
            disp._custom_op_handlers[op] = old_handler
        if RULES[op].strategy is not None:
            if old_strategy is None:
                prop.op_strategy_funcs.pop(op, None)
            else:
                prop.op_strategy_funcs[op] = old_strategy
    _installed.clear()
    _clear_caches()


def installed() -> bool:
    return bool(_installed)


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


def torch_dispatch(op_call: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op_call`` through torch's own DTensor dispatch, bypassing our handler for it."""
    disp = _dispatcher()
    ours = disp._custom_op_handlers.pop(op_call, None)
    old = _installed.get(op_call, (None, None))[0]
    if old is not None:
        disp._custom_op_handlers[op_call] = old
    try:
        return op_call(*args, **(kwargs or {}))
    finally:
        if ours is not None:
            disp._custom_op_handlers[op_call] = ours
