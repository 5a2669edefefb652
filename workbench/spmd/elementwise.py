"""Elementwise, binary and masked ops: where torch's pointwise rules already suffice, and where they don't.

Torch 2.13 describes every pointwise op with a single-dim strategy: shard the output like the inputs
(broadcast dims replicated), plus per-op rows for Partial inputs (``neg`` keeps ``P(sum)``, ``exp`` keeps
``P(max)``, ``fmax`` keeps ``P(max)``...). We measured every seed op (``workbench spmd explain``) and KEEP
TORCH'S RULE wherever it moves no more bytes: unary ops (exp, tanh, sqrt, reciprocal, ...), binary ops
(mul, div, atan2, fmax, fmin, maximum, bitwise_or, ...; benchmarks/bench_spmd.py: the same bytes in every
binary combination). Those ops still get conformance cases below.

Our rules fill the gaps, all of them "a Partial input can stay Partial" facts that torch does not know,
so torch all-reduces the full tensor where nothing (or a scalar) needs to move::

    masked_fill(x, mask, v)       rank c holds x_c; out_c = where(mask, v, x_c)
        P(max) -> P(max), P(min) -> P(min), P(avg) -> P(avg)      for any v  (v op v op ... = v)
        P(sum) -> P(sum)                                           for v == 0 (0 + 0 + ... = 0)
      (its gradient is grad.masked_fill(mask, 0): a Partial(sum) gradient, as tensor parallelism
       produces, now stays Partial instead of being all-reduced)
    masked_fill(x, mask, v: Tensor)  x and v both Partial(r) -> Partial(r), any r
                                  (except where x and the mask are sharded on different dims: there
                                  torch's plan moves fewer bytes, forward + backward, and decides)
    where(cond, a, b)             a, b both Partial(r) -> Partial(r); one side Partial(avg|max|min),
                                  the other replicated -> Partial(same)
    clamp(x, lo, hi), clamp_min, clamp_max, hardtanh   non-decreasing on all of R:
                                  f(max_c x_c) = max_c f(x_c)  so P(max) -> P(max), P(min) -> P(min)
    x + c, x - c (add/sub with a Python number, also in place)   every piece shifts by c:
                                  P(avg) -> P(avg), P(max) -> P(max), P(min) -> P(min)
      (torch all-reduces; in place it raises, which breaks rms_norm's ``mean(x^2) + eps`` when the
       normalised dim is sharded)

and one plain hole: ``hardtanh_backward`` (hardtanh, relu6) has no DTensor rule at all in torch 2.13, so
their backward raises; ours is pointwise, and linear in the gradient (a Partial(sum) gradient stays
Partial).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from workbench.compat import BINARY_ADDITIVE_RULES, RuntimeSchemaInfo, TensorMeta, common_pointwise_single_dim_strategy

from workbench.spmd.registry import (RULES, Case, case, dispatch_past_handler, single_dim_strategy,
                                     torch_strategy_dispatch)

aten = torch.ops.aten

_P = {r: Partial(r) for r in ("sum", "avg", "max", "min")}


def _pointwise(op, args_meta, kwargs_meta, extra_rows):
    """Torch's own pointwise rows (shards follow broadcasting) plus ``extra_rows`` of matching length."""
    return common_pointwise_single_dim_strategy(partial_extra_rules=extra_rows)(op, args_meta, kwargs_meta)


# --------------------------------------------------------------------------------------------------
# masked_fill
# --------------------------------------------------------------------------------------------------


def _is_zero(v) -> bool:
    return isinstance(v, (int, float, bool)) and v == 0


@single_dim_strategy(
    [aten.masked_fill.Scalar, aten.masked_fill_.Scalar], "masked",
    "a Partial(max|min|avg) input stays Partial for any fill value, Partial(sum) for fill 0 "
    "(masked_fill's own gradient): no all-reduce",
    schema_info=RuntimeSchemaInfo(static_argnum=2),
)
def masked_fill_scalar(op, args_meta, kwargs_meta):
    value = args_meta[2] if len(args_meta) > 2 else kwargs_meta.get("value")
    keep = ["avg", "max", "min"] + (["sum"] if _is_zero(value) else [])
    return _pointwise(op, args_meta, kwargs_meta, [[_P[r], _P[r], Replicate()] for r in keep])


@single_dim_strategy(
    [aten.masked_fill.Tensor, aten.masked_fill_.Tensor], "masked",
    "input and fill value Partial(r) -> Partial(r); torch has no rule (decomposes and all-reduces)",
)
def masked_fill_tensor(op, args_meta, kwargs_meta):
    # The 0-dim fill value broadcasts, so torch's rows replicate it wherever shards move.
    extra = [[_P[r], _P[r], Replicate(), _P[r]] for r in ("sum", "avg", "max", "min")]
    for r in ("avg", "max", "min"):
        extra += [[_P[r], _P[r], Replicate(), Replicate()], [_P[r], Replicate(), Replicate(), _P[r]]]
    return _pointwise(op, args_meta, kwargs_meta, extra)


def _misaligned_partial(x, mask, value) -> bool:
    """True when ``x`` (or the fill value) is Partial on some mesh dim AND ``x`` and ``mask`` are sharded on
    different tensor dims of one mesh dim (mask dims aligned to ``x``'s from the right, as broadcasting does).

    There DTensor's cost model (latency per collective, not bytes) takes our Partial row, gathers the
    mask to keep the Partial, and leaves the output sharded like ``x`` but not like the mask: the
    backward (``grad.masked_fill(mask, 0)``, and ``where`` for the value's gradient) then moves the float
    gradient onto the mask's shards, once per op. Torch's rule aligns the output with the mask in the
    forward and moves fewer bytes in all (2x2 mesh, ``x: [S(0), P(max)]``, mask ``[S(1), S(1)]``:
    torch 96 bytes, ours 116). So these placements go to torch's rule.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor) or not isinstance(mask, DTensor):
        return False
    if not any(isinstance(p, Partial) for t in (x, value) if isinstance(t, DTensor) for p in t.placements):
        return False
    off = x.ndim - mask.ndim
    for px, pm in zip(x.placements, mask.placements):
        if isinstance(px, Shard) and isinstance(pm, Shard) and px.dim % x.ndim != pm.dim % max(mask.ndim, 1) + off:
            return True
    return False


def masked_fill_tensor_handler(op_call, args, kwargs):
    """In front of :func:`masked_fill_tensor`: placements where torch's rule moves fewer bytes go to torch's
    rule (:func:`_misaligned_partial`); the rest run through our single-dim strategy."""
    x, mask = args[0], args[1]
    value = args[2] if len(args) > 2 else (kwargs or {}).get("value")
    if _misaligned_partial(x, mask, value):
        return torch_strategy_dispatch(op_call, args, kwargs)
    return dispatch_past_handler(op_call, args, kwargs)


for _op in (aten.masked_fill.Tensor, aten.masked_fill_.Tensor):
    RULES[_op].handler = masked_fill_tensor_handler  # both: the handler routes, the single-dim rule decides


@single_dim_strategy(
    aten.where.self, "masked",
    "both branches Partial(r) -> Partial(r); one branch Partial(avg|max|min), the other replicated -> "
    "Partial(same): no all-reduce",
)
def where_self(op, args_meta, kwargs_meta):
    extra = [[_P[r], Replicate(), _P[r], _P[r]] for r in ("sum", "avg", "max", "min")]
    for r in ("avg", "max", "min"):
        extra += [[_P[r], Replicate(), _P[r], Replicate()], [_P[r], Replicate(), Replicate(), _P[r]]]
    return _pointwise(op, args_meta, kwargs_meta, extra)


# --------------------------------------------------------------------------------------------------
# clamp and friends: non-decreasing everywhere
# --------------------------------------------------------------------------------------------------

_MONOTONE = [[_P["max"], _P["max"]], [_P["min"], _P["min"]]]


@single_dim_strategy(
    [aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default], "elementwise",
    "non-decreasing with scalar bounds: Partial(max) and Partial(min) pass through (torch all-reduces)",
    schema_info=RuntimeSchemaInfo(static_argnum=1),
)
def clamp_scalar(op, args_meta, kwargs_meta):
    return _pointwise(op, args_meta, kwargs_meta, _MONOTONE)


# --------------------------------------------------------------------------------------------------
# Adding a constant: x + c keeps Partial(avg|max|min)
# --------------------------------------------------------------------------------------------------

_SHIFT = [[_P[r], _P[r]] for r in ("avg", "max", "min")]


@single_dim_strategy(
    [aten.add.Scalar, aten.add_.Scalar, aten.sub.Scalar, aten.sub_.Scalar], "elementwise",
    "x + c keeps Partial(avg|max|min) (every piece shifts by c); torch all-reduces, and the in-place form "
    "(rms_norm's `+= eps` on a Partial(avg) mean) raises",
)
def add_scalar(op, args_meta, kwargs_meta):
    return _pointwise(op, args_meta, kwargs_meta, _SHIFT)


@single_dim_strategy(
    [aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor], "elementwise",
    "torch's rule, plus: DTensor + Python number keeps Partial(avg|max|min) (torch all-reduces)",
)
def add_tensor(op, args_meta, kwargs_meta):
    extra = list(BINARY_ADDITIVE_RULES)
    # Only `x + c` / `x - c` with x the DTensor: `c - x` would turn max into min.
    if len(args_meta) > 1 and isinstance(args_meta[0], TensorMeta) and isinstance(args_meta[1], (int, float, bool)):
        extra += _SHIFT
    return _pointwise(op, args_meta, kwargs_meta, extra)


@single_dim_strategy(
    aten.hardtanh_backward.default, "elementwise",
    "torch 2.13 has no rule (hardtanh/relu6 backward raise): pointwise, and linear in the gradient, so a "
    "Partial(sum) gradient stays Partial",
    schema_info=RuntimeSchemaInfo(static_argnum=2),
)
def hardtanh_backward(op, args_meta, kwargs_meta):
    # grad_input = grad_output * (min_val < x < max_val): linear in grad_output with x replicated.
    linear = [[_P[r], _P[r], Replicate()] for r in ("sum", "avg")]
    return _pointwise(op, args_meta, kwargs_meta, linear)


# --------------------------------------------------------------------------------------------------
# Conformance cases
# --------------------------------------------------------------------------------------------------

_SHAPE = (4, 6)


def _rand(*shape):
    return lambda g: [torch.randn(*shape, generator=g)]


def _with_partials(*reduce_ops):
    """Candidate placements: Replicate, Shard(d) for each dim, and the given Partials (float inputs)."""
    def fn(t):
        base = [Replicate()] + [Shard(d) for d in range(t.ndim)]
        return base + [_P[r] for r in reduce_ops] if isinstance(t, torch.Tensor) and t.is_floating_point() else base
    return fn


_UNARY = {
    "exp": (torch.exp, lambda g: [torch.randn(*_SHAPE, generator=g)], ("max",)),
    "neg": (torch.neg, lambda g: [torch.randn(*_SHAPE, generator=g)], ("sum", "max")),
    "tanh": (torch.tanh, lambda g: [torch.randn(*_SHAPE, generator=g)], ("max",)),
    "sqrt": (torch.sqrt, lambda g: [torch.rand(*_SHAPE, generator=g) + 0.5], ()),
    "reciprocal": (torch.reciprocal, lambda g: [torch.rand(*_SHAPE, generator=g) + 0.5], ("sum",)),
    "relu": (torch.relu, lambda g: [torch.randn(*_SHAPE, generator=g)], ("max",)),
    "clamp": (lambda x: torch.clamp(x, -0.5, 0.5), lambda g: [torch.randn(*_SHAPE, generator=g)], ("max", "min")),
    "clamp_min": (lambda x: torch.clamp_min(x, 0.1), lambda g: [torch.randn(*_SHAPE, generator=g)], ("max",)),
    "hardtanh": (torch.nn.functional.hardtanh, lambda g: [torch.randn(*_SHAPE, generator=g)], ("max", "min")),
    "relu6": (torch.nn.functional.relu6, lambda g: [torch.randn(*_SHAPE, generator=g) * 4], ("max",)),
}
_UNARY_OPS = {
    "exp": (aten.exp.default,), "neg": (aten.neg.default,), "tanh": (aten.tanh.default, aten.tanh_backward.default),
    "sqrt": (aten.sqrt.default,), "reciprocal": (aten.reciprocal.default,), "relu": (aten.relu.default,),
    "clamp": (aten.clamp.default,), "clamp_min": (aten.clamp_min.default,), "relu6": (aten.hardtanh.default, aten.hardtanh_backward.default), "hardtanh": (aten.hardtanh.default, aten.hardtanh_backward.default),
}
for _name, (_fn, _mk, _partials) in _UNARY.items():
    case(Case(f"elementwise/{_name}", "elementwise", _UNARY_OPS[_name], _mk, _fn, shardable=(0,),
              requires_grad=(0,), placements=_with_partials(*_partials), atol=1e-5, rtol=1e-4))


def _two(shape_a, shape_b, *, positive_b=False, ints=False):
    def mk(g):
        if ints:
            return [torch.randint(0, 16, shape_a, generator=g), torch.randint(0, 16, shape_b, generator=g)]
        b = torch.randn(*shape_b, generator=g)
        return [torch.randn(*shape_a, generator=g), b.abs() + 0.5 if positive_b else b]
    return mk


_BINARY = [
    # name, fn, make_inputs, ops, grads, partial candidates
    ("add", torch.add, _two(_SHAPE, _SHAPE), (aten.add.Tensor,), (0, 1), ("sum",)),
    ("add_broadcast", torch.add, _two(_SHAPE, (6,)), (aten.add.Tensor,), (0, 1), ()),
    ("mul", torch.mul, _two(_SHAPE, _SHAPE), (aten.mul.Tensor,), (0, 1), ("sum",)),
    ("div", torch.div, _two(_SHAPE, _SHAPE, positive_b=True), (aten.div.Tensor,), (0, 1), ()),
    ("atan2", torch.atan2, _two(_SHAPE, _SHAPE), (aten.atan2.default,), (0, 1), ()),
    ("fmax", torch.fmax, _two(_SHAPE, _SHAPE), (aten.fmax.default,), (0, 1), ("max",)),
    ("fmin", torch.fmin, _two(_SHAPE, _SHAPE), (aten.fmin.default,), (0, 1), ("min",)),
    ("maximum", torch.maximum, _two(_SHAPE, (6,)), (aten.maximum.default,), (0, 1), ("max",)),
    ("bitwise_or", torch.bitwise_or, _two(_SHAPE, _SHAPE, ints=True), (aten.bitwise_or.Tensor,), (), ()),
]
for _name, _fn, _mk, _ops, _rg, _partials in _BINARY:
    case(Case(f"binary/{_name}", "binary", _ops, _mk, _fn, shardable=(0, 1), requires_grad=_rg,
              placements=_with_partials(*_partials), atol=1e-5, rtol=1e-4))


def _x_mask(g, shape=_SHAPE):
    return [torch.randn(*shape, generator=g), torch.rand(*shape, generator=g) > 0.5]


case(Case("masked/masked_fill/zero", "masked", (aten.masked_fill.Scalar,), _x_mask,
          lambda x, m: x.masked_fill(m, 0.0), shardable=(0, 1), requires_grad=(0,),
          placements=_with_partials("sum", "max")))
case(Case("masked/masked_fill/neg_inf", "masked", (aten.masked_fill.Scalar,), _x_mask,
          lambda x, m: x.masked_fill(m, float("-inf")), shardable=(0, 1), requires_grad=(0,),
          placements=_with_partials("sum", "max")))
case(Case("masked/masked_fill/broadcast_mask", "masked", (aten.masked_fill.Scalar,),
          lambda g: [torch.randn(*_SHAPE, generator=g), torch.rand(6, generator=g) > 0.5],
          lambda x, m: x.masked_fill(m, 2.5), shardable=(0, 1), requires_grad=(0,),
          placements=_with_partials("max")))
case(Case("masked/masked_fill/tensor_value", "masked", (aten.masked_fill.Tensor, aten.where.self),
          lambda g: [*_x_mask(g), torch.randn((), generator=g)],
          lambda x, m, v: x.masked_fill(m, v), shardable=(0, 1), requires_grad=(0, 2),
          placements=_with_partials("sum", "max")))
# The tensor-parallel pattern: masked activations into a column-sharded weight. The gradient arriving at
# masked_fill is Partial(sum) (x @ w with w sharded on its input dim), and masked_fill's backward
# (grad.masked_fill(mask, 0)) keeps it Partial under our rule.
case(Case("masked/masked_fill/grad_partial", "masked", (aten.masked_fill.Scalar,),
          lambda g: [*_x_mask(g, (4, 8)), torch.randn(8, 6, generator=g)],
          lambda x, m, w: x.masked_fill(m, 0.0) @ w, shardable=(0, 2), requires_grad=(0, 2),
          atol=1e-5, rtol=1e-4))
case(Case("masked/where", "masked", (aten.where.self,),
          lambda g: [torch.rand(*_SHAPE, generator=g) > 0.5, torch.randn(*_SHAPE, generator=g),
                     torch.randn(*_SHAPE, generator=g)],
          torch.where, shardable=(0, 1, 2), requires_grad=(1, 2), placements=_with_partials("sum", "max")))
# As above for hardtanh: its backward receives a Partial(sum) gradient from the sharded matmul after it.
case(Case("elementwise/hardtanh/grad_partial", "elementwise", (aten.hardtanh_backward.default,),
          lambda g: [torch.randn(4, 8, generator=g) * 2, torch.randn(8, 6, generator=g)],
          lambda x, w: torch.nn.functional.hardtanh(x) @ w, shardable=(0, 1), requires_grad=(0, 1),
          atol=1e-5, rtol=1e-4))
# x + c on Partial(avg|max|min) inputs, out of place and in place (rms_norm's decomposition does `+= eps`).
case(Case("elementwise/add_scalar", "elementwise", (aten.add.Tensor, aten.add.Scalar),
          _rand(*_SHAPE), lambda x: x + 0.5, shardable=(0,), requires_grad=(0,),
          placements=_with_partials("avg", "max", "min")))
case(Case("elementwise/add_scalar_inplace", "elementwise", (aten.add_.Scalar,),
          _rand(*_SHAPE), lambda x: torch.ops.aten.add_.Scalar(x * 1.0, 1e-3), shardable=(0,),
          placements=_with_partials("avg", "max")))
