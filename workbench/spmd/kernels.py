"""DTensor rules for our custom kernel ops (``torch.ops.workbench.*``, see ``workbench.kernels``).

DTensor has no rule for an op it has never seen, so without these a sharded tensor reaching one of our
kernels would fail. Each rule says where the op can run on the local shards, and what the caller pays
where it cannot:

* **dropout_add** (and its backward) is pointwise. The random decision of an element is a function of
  its index in the GLOBAL tensor (``workbench.kernels.dropout``), so every rank runs the op on its shard
  with ``global_shape`` and its shard's ``shard_offset``: no communication, and the mask is the one the
  unsharded tensor would get::

      x = [x_0 | x_1],  residual likewise       y_r = residual_r + x_r * keep(seed, offset + g(c + o_r)) / (1-p)

* **masked_fill** runs locally on self's shard, the mask sliced to that shard (a mask laid out like self
  is used as is). Its backward is linear in the gradient, so a Partial gradient stays Partial, and the
  value's gradient (a sum over the shard) comes out ``Partial(sum)`` over the mesh dims that shard it.
* **index_put** with one index tensor into self sharded along any dims: the shard that owns a row does
  the write (rows outside the shard are filtered out, which keeps their order, so the deterministic
  mode's sums and the last-writer rule are the same as the unsharded op's); a shard of a trailing dim
  takes the matching slice of the values. No communication of self.
* **set_value** into self sharded along any dim: each shard writes the part of the region it owns
  (the slice intersected with the shard, the value sliced to match).
* **index_put's backward** (the values' gradient) gathers, on each shard, the rows it owns and leaves
  zeros for the others: ``Partial(sum)``, no communication (a trailing dim the values span stays
  sharded). With our ``Embedding`` under tensor parallelism this is the weight's gradient path.
* Everything else (boolean-mask select/assign, whose output sizes depend on data) runs **replicated**: the inputs are gathered, every rank computes the whole result, and
  each output takes the placements of the input it is laid out like (Shard kept, so that step is a
  local slice). Correct for any placement, at the cost of an all-gather: ``workbench spmd explain``
  shows it.

A Partial input is reduced first wherever the op is not linear in it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from workbench import compat, kernels
from workbench.compat import (AsyncCollectiveTensor, DTensorSpec, TensorMeta, compute_local_shape_and_global_offset,
                              redistribute_local_tensor)
from workbench.spmd.reductions import contiguous_stride
from workbench.spmd.reductions import wrap as _wrap
from workbench.spmd.registry import Case, case
from workbench.spmd.registry import handler as _register_handler

ops = torch.ops.workbench
_FAMILY = "kernel"


def handler(op_list, family, summary):
    """Register a rule (its redistributions run without autograd: a handler runs inside DTensor's
    dispatch, below the op's own autograd formula). The rules work from each shard's box
    (``compute_local_shape_and_global_offset``), which a dim sharded over several mesh dims
    (``[S(0), S(0)]``) has too, so they take those layouts as they are (no multi-shard folding)."""
    def deco(fn):
        def run(op_call, args, kwargs):
            with torch.no_grad():
                return fn(op_call, args, kwargs)

        run.__name__, run.__doc__ = getattr(fn, "__name__", "rule"), fn.__doc__
        _register_handler(op_list, family, summary, multi_shard=None)(run)
        return fn

    return deco


def _redistribute(x: DTensor, placements) -> DTensor:
    """``x.redistribute(mesh, placements)`` on the local tensor: a handler runs inside DTensor's dispatch,
    where torch 2.11's ``DTensor.redistribute`` (an autograd Function) fails on ``detach_``."""
    placements = tuple(placements)
    if tuple(x.placements) == placements:
        return x
    target = DTensorSpec(x.device_mesh, placements,
                         tensor_meta=TensorMeta(x.shape, contiguous_stride(x.shape), x.dtype))
    local = redistribute_local_tensor(x._local_tensor, x._spec, target)
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return _wrap(local, x.device_mesh, placements, x.shape)


# ---------------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------------
def _mesh_of(args: Any):
    for x in _flat(args):
        if isinstance(x, DTensor):
            return x.device_mesh
    raise RuntimeError("a DTensor rule was called without a DTensor argument")


def _flat(args: Any) -> list:
    out = []
    for x in args:
        if isinstance(x, (list, tuple)):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out


def _schema_args(op_call, args, kwargs) -> list:
    """The op's arguments in schema order, defaults filled in (DTensor passes what the caller passed)."""
    out = list(args)
    for a in compat.op_schema(op_call).arguments[len(args):]:
        if a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TypeError(f"{op_call} is missing its argument {a.name!r}")
    return out


def _full(x: Any) -> Any:
    """A DTensor as the whole tensor on every rank (Partial reduced, shards gathered); others unchanged."""
    if isinstance(x, DTensor):
        return _redistribute(x, [Replicate()] * x.device_mesh.ndim)._local_tensor
    if isinstance(x, (list, tuple)):
        return type(x)(_full(y) for y in x)
    return x


def _no_partial(x: DTensor, linear: bool = False) -> DTensor:
    """Reduce Partial placements (keep Partial(sum) when the op is ``linear`` in ``x``)."""
    keep = (lambda p: linear and p.reduce_op == "sum")
    if any(isinstance(p, Partial) and not keep(p) for p in x.placements):
        pl = [Replicate() if isinstance(p, Partial) and not keep(p) else p for p in x.placements]
        return _redistribute(x, pl)
    return x


def _sharding_only(placements) -> list:
    """Placements an output laid out like an input can take: its Shards; Partial and the rest replicated."""
    return [p if type(p) is Shard else Replicate() for p in placements]


def _local_box(x: DTensor) -> tuple[list[int], list[int]]:
    """This rank's shard of ``x``: its shape and global offset (a Partial mesh dim holds the whole dim)."""
    shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, _sharding_only(x.placements))
    return list(shape), list(offset)


def _slice_to(t: torch.Tensor, full_shape, local_shape, offset) -> torch.Tensor:
    """The part of ``t`` (broadcastable to ``full_shape``) that lines up with the local box; size-1 dims
    stay size 1 (they broadcast)."""
    t = t.reshape((1,) * (len(full_shape) - t.ndim) + tuple(t.shape))
    for d, (n, o) in enumerate(zip(local_shape, offset)):
        if t.shape[d] != 1 and (n != t.shape[d] or o):
            t = t.narrow(d, o, n)
    return t


def replicated(like: dict[int, int] | None = None):
    """A handler that gathers every input, runs the op on whole tensors on every rank, and lays output
    ``i`` out like input ``like[i]`` (its Shard placements; a local slice), the others Replicate."""
    like = like or {}

    def run(op_call, args, kwargs):
        mesh = _mesh_of(list(args) + list(kwargs.values()))
        ins = list(args)
        out = op_call(*_full(tuple(args)), **{k: _full(v) for k, v in kwargs.items()})
        if out is None:
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        wrapped = []
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                wrapped.append(o)
                continue
            src = ins[like[i]] if i in like else None
            rep = _wrap(o, mesh, [Replicate()] * mesh.ndim, o.shape)
            if isinstance(src, DTensor) and tuple(src.shape) == tuple(o.shape):
                rep = _redistribute(rep, _sharding_only(src.placements))
            wrapped.append(rep)
        return tuple(wrapped) if isinstance(out, (tuple, list)) else wrapped[0]

    run.__doc__ = "replicated: gather the inputs, compute everywhere, keep the like-input's shards"
    return run


# ---------------------------------------------------------------------------------------------------
# dropout_add: local, with global coordinates
# ---------------------------------------------------------------------------------------------------
def _pointwise_pair(a: Any, b: Any) -> tuple[DTensor, DTensor | None]:
    """``a`` without Partial, and ``b`` (same shape) moved to ``a``'s placements."""
    a = _no_partial(a)
    if isinstance(b, DTensor):
        b = _no_partial(b)
        if tuple(b.placements) != tuple(a.placements):
            b = _redistribute(b, a.placements)
    return a, b


@handler([ops.dropout_add.default], _FAMILY,
         "runs on each shard with its global offset: the mask a rank draws is the unsharded tensor's, no comm")
def _dropout_add(op_call, args, kwargs):
    x, residual, p, seed, offset, global_shape, shard_offset = _schema_args(op_call, args, kwargs)
    if global_shape or not isinstance(x, DTensor) or not isinstance(residual, DTensor) \
            or tuple(x.shape) != tuple(residual.shape):
        return replicated({0: 0})(op_call, args, kwargs)
    x, residual = _pointwise_pair(x, residual)
    _, off = _local_box(x)
    out = op_call(x._local_tensor, residual._local_tensor, p, seed, offset, list(x.shape), off)
    return _wrap(out, x.device_mesh, x.placements, x.shape)


@handler([ops.dropout_add_backward.default], _FAMILY,
         "regenerates each shard's part of the mask from its global offset: no comm")
def _dropout_add_backward(op_call, args, kwargs):
    grad, p, seed, offset, global_shape, shard_offset = _schema_args(op_call, args, kwargs)
    if global_shape or not isinstance(grad, DTensor):
        return replicated({0: 0})(op_call, args, kwargs)
    grad = _no_partial(grad, linear=True)  # linear in grad: a Partial(sum) piece takes the same mask
    _, off = _local_box(grad)
    out = op_call(grad._local_tensor, p, seed, offset, list(grad.shape), off)
    return _wrap(out, grad.device_mesh, grad.placements, grad.shape)


# ---------------------------------------------------------------------------------------------------
# masked_fill: local on self's shard
# ---------------------------------------------------------------------------------------------------
def _mask_for(mask: Any, x: DTensor, box: tuple[list[int], list[int]]) -> torch.Tensor:
    """The local mask for ``x``'s shard: a mask laid out like ``x`` as is; else the whole mask sliced."""
    if isinstance(mask, DTensor) and tuple(mask.shape) == tuple(x.shape) \
            and tuple(mask.placements) == tuple(x.placements):
        return mask._local_tensor
    return _slice_to(_full(mask), x.shape, *box)


@handler([ops.masked_fill.default], _FAMILY, "fills self's shard with the mask sliced to it: no comm of self")
def _masked_fill(op_call, args, kwargs):
    self_, mask, value = _schema_args(op_call, args, kwargs)
    if not isinstance(self_, DTensor):
        return replicated()(op_call, args, kwargs)
    self_ = _no_partial(self_)
    box = _local_box(self_)
    out = op_call(self_._local_tensor, _mask_for(mask, self_, box), _full(value))
    return _wrap(out, self_.device_mesh, self_.placements, self_.shape)


@handler([ops.masked_fill_backward.default], _FAMILY,
         "local; the value's gradient is Partial(sum) over the mesh dims that shard the gradient")
def _masked_fill_backward(op_call, args, kwargs):
    grad, mask = _schema_args(op_call, args, kwargs)
    if not isinstance(grad, DTensor):
        return replicated()(op_call, args, kwargs)
    grad = _no_partial(grad, linear=True)
    box = _local_box(grad)
    g_self, g_value = op_call(grad._local_tensor, _mask_for(mask, grad, box))
    mesh = grad.device_mesh
    value_pl = [Partial("sum") if isinstance(p, (Shard, Partial)) else Replicate() for p in grad.placements]
    return (_wrap(g_self, mesh, grad.placements, grad.shape), _wrap(g_value, mesh, value_pl, g_value.shape))


# ---------------------------------------------------------------------------------------------------
# index_put: the shard that owns a row writes it
# ---------------------------------------------------------------------------------------------------
@handler([ops.index_put.default], _FAMILY,
         "one index tensor: each shard keeps the writes into its own rows (order kept), no comm of self")
def _index_put(op_call, args, kwargs):
    self_, indices, values, accumulate, deterministic = _schema_args(op_call, args, kwargs)
    idx = [i for i in indices if i is not None]
    simple = (isinstance(self_, DTensor) and len(indices) == 1 and indices[0] is not None
              and indices[0].dtype in (torch.int64, torch.int32) and indices[0].ndim == 1)
    if not simple:
        return replicated({0: 0})(op_call, args, kwargs)
    self_ = _no_partial(self_)
    shape, off = _local_box(self_)
    size0 = self_.shape[0]
    i0 = _full(idx[0]).to(torch.int64)
    if i0.numel():
        lo, hi = int(i0.min()), int(i0.max())
        if lo < -size0 or hi >= size0:
            bad = lo if lo < -size0 else hi
            raise IndexError(f"index {bad} is out of bounds for dimension 0 with size {size0}")
    i0 = torch.where(i0 < 0, i0 + size0, i0)
    vals = _full(values)
    vals = vals.reshape((1,) * (self_.ndim - vals.ndim) + tuple(vals.shape))
    vals = vals.expand((i0.numel(),) + tuple(self_.shape[1:]))
    keep = (i0 >= off[0]) & (i0 < off[0] + shape[0])
    local_i = i0[keep] - off[0]
    local_v = vals[keep]
    local_v = _slice_to(local_v, [local_v.shape[0]] + list(self_.shape[1:]),
                        [local_v.shape[0]] + shape[1:], [0] + off[1:])
    out = op_call(self_._local_tensor, [local_i], local_v.contiguous(), accumulate, deterministic)
    return _wrap(out, self_.device_mesh, self_.placements, self_.shape)


@handler([ops.index_put_backward.default], _FAMILY,
         "one index tensor: each shard gathers the rows it owns; the values' gradient is Partial(sum), no comm")
def _index_put_backward(op_call, args, kwargs):
    grad, indices, values_shape, accumulate = _schema_args(op_call, args, kwargs)
    idx = indices[0] if len(indices) == 1 else None
    lead = grad.ndim - len(values_shape)  # values broadcast over these leading dims (K among them)
    vs = [1] * lead + list(values_shape)  # the values' shape as broadcast against (K, *grad.shape[1:])
    simple = (isinstance(grad, DTensor) and idx is not None and idx.ndim == 1 and lead >= 0
              and idx.dtype in (torch.int64, torch.int32) and vs[0] in (1, idx.shape[0])
              and all(v in (1, g) for v, g in zip(vs[1:], grad.shape[1:])))
    if not simple:
        return replicated()(op_call, args, kwargs)
    grad = _no_partial(grad, linear=True)  # the values' gradient is linear in grad
    mesh = grad.device_mesh
    shape, off = _local_box(grad)
    i0 = _full(idx).to(torch.int64)
    i0 = torch.where(i0 < 0, i0 + grad.shape[0], i0)
    keep = (i0 >= off[0]) & (i0 < off[0] + shape[0])
    # A dim the values were broadcast over sums across shards (Partial); one they span stays sharded.
    trailing = [1 if v == 1 else n for v, n in zip(vs[1:], shape[1:])]
    per_row = vs[0] != 1
    local_vshape = ([int(keep.sum())] if per_row else [1]) + trailing
    part = op_call(grad._local_tensor, [i0[keep] - off[0]], local_vshape[lead:], accumulate)
    if per_row:  # rows this shard does not own get zero here; their owner holds them
        out = part.new_zeros([i0.shape[0]] + trailing)
        out[keep] = part
    else:
        out = part
    pl = []
    for p in grad.placements:
        if isinstance(p, Shard) and p.dim >= 1 and vs[p.dim] != 1:
            pl.append(Shard(p.dim - lead))
        elif isinstance(p, (Shard, Partial)):
            pl.append(Partial("sum"))
        else:
            pl.append(Replicate())
    return _wrap(out, mesh, pl, list(values_shape))


# ---------------------------------------------------------------------------------------------------
# set_value: each shard writes its part of the region
# ---------------------------------------------------------------------------------------------------
def _owned(start: int, end: int, step: int, lo: int, n: int) -> tuple[int, int]:
    """Region positions k (elements start + k*step < end) that land in rows [lo, lo + n)."""
    count = max(0, -(-(end - start) // step))
    k_lo = max(0, -(-(lo - start) // step))
    k_hi = min(count, max(0, -(-(lo + n - start) // step)))
    return k_lo, max(k_lo, k_hi)


def _set_value_local(op_call, self_: DTensor, value: Any, starts, ends, steps, inplace: bool):
    shape, off = _local_box(self_)
    aligned = _aligned_dims(self_, value, starts, ends, steps)
    v = value._local_tensor if aligned else _full(value)
    region = [max(0, -(-(e - s) // k)) for s, e, k in zip(starts, ends, steps)] + list(self_.shape[len(starts):])
    v = v.reshape((1,) * (len(region) - v.ndim) + tuple(v.shape)) if v.ndim else v
    ls, le, lk = [], [], []
    for d, (s, e, k) in enumerate(zip(starts, ends, steps)):
        k_lo, k_hi = _owned(s, e, k, off[d], shape[d])
        first = s + k_lo * k - off[d]
        ls.append(first)
        le.append(first + (k_hi - k_lo - 1) * k + 1 if k_hi > k_lo else first)
        lk.append(k)
        if v.ndim and v.shape[d] != 1 and d not in aligned:
            v = v.narrow(d, k_lo, k_hi - k_lo)
    for d in range(len(starts), self_.ndim):
        if v.ndim and v.shape[d] != 1 and d not in aligned and (shape[d] != v.shape[d] or off[d]):
            v = v.narrow(d, off[d], shape[d])
    ls = [min(max(x, 0), n) for x, n in zip(ls, shape)]
    le = [min(max(x, a), n) for x, a, n in zip(le, ls, shape)]
    return op_call(self_._local_tensor, v.contiguous(), ls, le, lk)


def _aligned_dims(self_: DTensor, value: Any, starts, ends, steps) -> set[int]:
    """The dims a value DTensor shards exactly like self, on dims the region spans whole (so each rank's
    value shard is the part its self shard needs: no gather). Empty when the value must be gathered."""
    if not isinstance(value, DTensor) or value.ndim != self_.ndim \
            or tuple(value.placements) != tuple(self_.placements) \
            or any(isinstance(p, Partial) for p in value.placements):
        return set()
    dims = {p.dim for p in value.placements if isinstance(p, Shard)}
    whole = all(d >= len(starts) or (starts[d] == 0 and ends[d] >= self_.shape[d] and steps[d] == 1) for d in dims)
    same = all(value.shape[d] == self_.shape[d] for d in dims)
    return dims if dims and whole and same else set()


@handler([ops.set_value.default], _FAMILY, "each shard writes the part of the region it owns: no comm of self")
def _set_value(op_call, args, kwargs):
    self_, value, starts, ends, steps = _schema_args(op_call, args, kwargs)
    if not isinstance(self_, DTensor):
        return replicated()(op_call, args, kwargs)
    self_ = _no_partial(self_)
    out = _set_value_local(op_call, self_, value, starts, ends, steps, inplace=False)
    return _wrap(out, self_.device_mesh, self_.placements, self_.shape)


@handler([ops.set_value_.default], _FAMILY, "in place: each shard writes the part of the region it owns")
def _set_value_inplace(op_call, args, kwargs):
    self_, value, starts, ends, steps = _schema_args(op_call, args, kwargs)
    if any(isinstance(p, Partial) for p in self_.placements):
        raise ValueError("set_value_ into a Partial DTensor would write the value once per rank; "
                         "redistribute it to Replicate or Shard first")
    _set_value_local(op_call, self_, value, starts, ends, steps, inplace=True)
    return None


# ---------------------------------------------------------------------------------------------------
# every other op of ours: replicated (correct for any placement)
# ---------------------------------------------------------------------------------------------------
def _register_the_rest() -> None:
    from workbench.spmd.registry import RULES

    for op in kernels.custom_ops():
        if op not in RULES:
            handler([op], _FAMILY, "replicated: gathers its inputs, computes on every rank")(
                replicated({i: 0 for i in range(4)}))


_register_the_rest()


# ---------------------------------------------------------------------------------------------------
# conformance cases: each op on sharded inputs equals the dense op, forward and backward
# ---------------------------------------------------------------------------------------------------
def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


case(Case("kernel/dropout_add/p0.3", _FAMILY, (ops.dropout_add.default, ops.dropout_add_backward.default),
          lambda g: [_randn(g, 6, 8), _randn(g, 6, 8)],
          lambda x, r: kernels.dropout_add(x, r, 0.3, seed=1234, offset=5),
          shardable=(0, 1), requires_grad=(0, 1)))

case(Case("kernel/masked_fill/tensor-value", _FAMILY, (ops.masked_fill.default, ops.masked_fill_backward.default),
          lambda g: [_randn(g, 6, 8), torch.rand(6, 8, generator=g) > 0.5, torch.tensor(0.75)],
          lambda x, m, v: kernels.masked_fill(x, m, v),
          shardable=(0, 1), requires_grad=(0, 2)))

case(Case("kernel/masked_fill/broadcast-mask", _FAMILY, (ops.masked_fill.default, ops.masked_fill_backward.default),
          lambda g: [_randn(g, 6, 8), torch.rand(1, 8, generator=g) > 0.5, torch.tensor(-2.0)],
          lambda x, m, v: kernels.masked_fill(x, m, v),
          shardable=(0,), requires_grad=(0, 2)))

case(Case("kernel/index_put/accumulate-duplicates", _FAMILY, (ops.index_put.default,),
          lambda g: [_randn(g, 8, 4), torch.tensor([0, 7, -1, 3, 3, 0, 5]), _randn(g, 7, 4)],
          lambda x, i, v: kernels.index_put(x, (i,), v, accumulate=True),
          shardable=(0,), requires_grad=(0, 2)))

case(Case("kernel/index_put/overwrite-last-writer", _FAMILY, (ops.index_put.default,),
          lambda g: [_randn(g, 8, 4), torch.tensor([1, 6, -2, 1, 4]), _randn(g, 5, 4)],
          lambda x, i, v: kernels.index_put(x, (i,), v),
          shardable=(0,), requires_grad=(0, 2)))

case(Case("kernel/index_put/broadcast-row", _FAMILY, (ops.index_put.default,),
          lambda g: [_randn(g, 8, 4), torch.tensor([2, 5, 2]), _randn(g, 4)],
          lambda x, i, v: kernels.index_put(x, (i,), v, accumulate=True),
          shardable=(0,), requires_grad=(0, 2)))

case(Case("kernel/mask_select/rows", _FAMILY, (ops.mask_select.default,),
          lambda g: [_randn(g, 6, 4), torch.tensor([True, False, True, True, False, True])],
          lambda x, m: kernels.mask_select(x, m),
          shardable=(0,), requires_grad=(0,)))

case(Case("kernel/mask_assign/tensor", _FAMILY, (ops.mask_assign.default,),
          lambda g: [_randn(g, 6, 4), torch.tensor([True, False, True, True, False, True]), _randn(g, 4, 4)],
          lambda x, m, v: kernels.mask_assign(x, m, v),
          shardable=(0,), requires_grad=(0, 2)))

case(Case("kernel/set_value/strided", _FAMILY, (ops.set_value.default,),
          lambda g: [_randn(g, 9, 6), _randn(g, 3, 6)],
          lambda x, v: kernels.set_value(x, (slice(1, 8, 3),), v),
          shardable=(0, 1), requires_grad=(0, 1)))

case(Case("kernel/set_value/broadcast-2d", _FAMILY, (ops.set_value.default,),
          lambda g: [_randn(g, 8, 6), _randn(g, 1, 2)],
          lambda x, v: kernels.set_value(x, (slice(2, 7), slice(1, 5, 2)), v),
          shardable=(0,), requires_grad=(0, 1)))
