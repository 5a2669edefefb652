"""Min/max reductions on DTensors: values *and* indices through an all-reduce, never an all-gather.

``torch.max(x, dim)`` returns the largest value along ``dim`` and the index of its first occurrence.
When ``x`` is sharded along ``dim``, torch 2.13 all-gathers the whole input first. We reduce locally and
combine the per-rank winners with one all-reduce of the *reduced* shape::

    x = [x_0 | x_1 | ... | x_{n-1}]          sharded along dim, rank r holds x_r at offset o_r
    (v_r, i_r) = max(x_r, dim)               local winner, local index
    key_r = order(v_r) * 2^32 + (2^32 - 1 - (i_r + o_r))      one int64 per output element
    key   = all_reduce(key_r, MAX)           largest value wins; among equal values the smallest
                                             global index wins (torch returns the first occurrence)
    (v, i) = decode(key)                     Replicate on the mesh dims that sharded ``dim``

``order`` maps the float's bit pattern to a signed integer with the same ordering (negative floats
have their magnitude bits flipped); NaN gets the largest key (smallest for min), so NaN propagates and
its first index wins, exactly like torch. ``-0.0`` is keyed as ``+0.0`` (torch treats them as equal),
so a ``-0.0`` winner comes back as ``+0.0``. Dtypes whose key needs more than 32 bits (float64, int64)
use two all-reduces instead: the values (MAX), then the candidate indices (MIN).

Bytes per rank (ring): ``2 (n-1)/n * 8 * |out|`` instead of ``(n-1) * |x_local|``; for a (2048, 1024)
float32 input on 2 gloo ranks, 8 KiB instead of 4 MiB. Where torch's all-gather would be cheaper (a
dim of one or two elements per rank) we hand the call to torch. A mesh dim over which ``x`` is
replicated splits the largest free output dim (as torch's rule does), so it shares the all-reduce
instead of repeating it. Several mesh dims sharding ``dim`` (``[S(0), S(0)]``) are all-reduced one
after the other (exact: max and min are idempotent).

Backward: autograd computes ``grad.new_zeros(x.shape).scatter(dim, indices, grad)``. Our ``scatter``
rule recognises the indices it returned and keeps the gradient sharded like ``x`` (each rank writes
the indices in its own rows): no communication, and no input-sized gradient on every rank.

Full reductions (``torch.max(x)``, ``amax``, ``amin``) need no rule: torch already returns
``Partial("max")`` and reduces with an all-reduce (measured: never more bytes than a rule of ours
would move); we only register conformance cases for them.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from workbench.compat import DTensorSpec, TensorMeta, compute_local_shape_and_global_offset, funcol

from workbench.spmd.registry import Case, case, handler, torch_dispatch

aten = torch.ops.aten

_PACKED_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 16}
_PACKED_INTS = (torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_INT_VIEW = {32: torch.int32, 16: torch.int16}
_KEY_MAX, _KEY_MIN = 2**31 - 1, -(2**31)  # NaN keys: above/below every 32-bit ordered value
_LOW32 = 2**32 - 1


# ---------------------------------------------------------------------------------------------------
# small DTensor helpers (shared with workbench.spmd.indexing)
# ---------------------------------------------------------------------------------------------------
def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(list(shape)):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def wrap(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    """A DTensor over ``local`` with the given global ``shape`` (no communication, no autograd)."""
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def all_reduce(t: torch.Tensor, op: str, mesh, mesh_dims) -> torch.Tensor:
    """All-reduce ``t`` over each of ``mesh_dims`` in turn (exact for the idempotent ``max``/``min``)."""
    for m in mesh_dims:
        t = funcol.all_reduce(t, op, (mesh, m))
        t = t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t
    return t


def shard_shape(shape, mesh, placements) -> list[int]:
    """The largest local shard's shape: the same on every rank, so decisions based on it agree.

    (A rule must never pick a different algorithm on different ranks: their collectives would not
    match and the job would hang. Uneven shards make ``compute_local_shape_and_global_offset`` differ.)
    """
    out = [int(s) for s in shape]
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] = -(-out[p.dim] // mesh.size(m))
    return out


def drop_partial(x: DTensor) -> DTensor:
    """Partial placements -> Replicate (an all-reduce); min/max cannot see through a pending sum."""
    if any(p.is_partial() for p in x.placements):
        return x.redistribute(x.device_mesh, [Replicate() if p.is_partial() else p for p in x.placements])
    return x


def plain_placements(x: DTensor) -> bool:
    """True when every placement is Replicate, Shard or Partial (no _StridedShard and friends)."""
    return all(type(p) in (Replicate, Shard, Partial) for p in x.placements)


# ---------------------------------------------------------------------------------------------------
# min/max with indices
# ---------------------------------------------------------------------------------------------------
def _order_key(v: torch.Tensor, is_max: bool) -> torch.Tensor:
    """int64 keys in the 32-bit signed range whose order is the order of ``v`` (NaN largest for max)."""
    if v.dtype in _PACKED_BITS:
        bits = _PACKED_BITS[v.dtype]
        b = (v + 0).view(_INT_VIEW[bits])  # + 0 turns -0.0 into +0.0
        flip = 2 ** (bits - 1) - 1
        k = torch.where(b >= 0, b, b ^ flip).to(torch.int64)
        return torch.where(torch.isnan(v), _KEY_MAX if is_max else _KEY_MIN, k)
    return v.to(torch.int64)


def _from_key(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _PACKED_BITS:
        bits = _PACKED_BITS[dtype]
        nan = (k == _KEY_MAX) | (k == _KEY_MIN)
        b = k.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).to(_INT_VIEW[bits])
        v = torch.where(b >= 0, b, b ^ (2 ** (bits - 1) - 1)).view(dtype)
        return torch.where(nan, torch.full_like(v, float("nan")), v)
    return k.to(dtype)


def _reduce_packed(vals, gidx, empty, is_max, mesh, mesh_dims):
    """One all-reduce of int64 keys ``order(v) * 2^32 + index part``."""
    ipart = (_LOW32 - gidx) if is_max else gidx
    key = _order_key(vals, is_max) * 2**32 + ipart
    if empty:
        key = torch.full_like(key, torch.iinfo(torch.int64).min if is_max else torch.iinfo(torch.int64).max)
    key = all_reduce(key, "max" if is_max else "min", mesh, mesh_dims)
    ipart = key & _LOW32
    return _from_key(key >> 32, vals.dtype), (_LOW32 - ipart) if is_max else ipart


def _reduce_two_step(vals, gidx, empty, is_max, n, mesh, mesh_dims):
    """float64/int64: all-reduce the values, then the first index holding the winner (NaN first)."""
    floating = vals.dtype.is_floating_point
    worst = (-float("inf") if is_max else float("inf")) if floating else (
        torch.iinfo(vals.dtype).min if is_max else torch.iinfo(vals.dtype).max)
    nan = torch.isnan(vals) if floating else torch.zeros_like(vals, dtype=torch.bool)
    v = torch.where(nan, worst, vals)
    if empty:
        v = torch.full_like(v, worst)
    best = all_reduce(v, "max" if is_max else "min", mesh, mesh_dims)
    # candidate: a NaN's index (< n) beats a winner's index + n, which beats "not here" (2n)
    cand = torch.where(nan, gidx, torch.where(v == best, gidx + n, 2 * n))
    if empty:
        cand = torch.full_like(cand, 2 * n)
    cand = all_reduce(cand, "min", mesh, mesh_dims)
    had_nan = cand < n
    if floating:
        best = torch.where(had_nan, torch.full_like(best, float("nan")), best)
    return best, torch.where(had_nan, cand, cand - n)


def _minmax_dim_args(args, kwargs):
    x, dim = args[0], args[1] if len(args) > 1 else kwargs["dim"]
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return x, dim, bool(keepdim)


def _spread(x: DTensor, dim: int) -> list:
    """Placements for the reduction: ``x``'s, plus each Replicate mesh dim sharding a free tensor dim.

    A mesh dim over which ``x`` is replicated would otherwise compute (and all-reduce) the same output
    on every rank; splitting the largest unsharded non-reduced dim across it divides the all-reduce by
    its size (torch's own rule does the same). The output comes back sharded on that mesh dim.
    """
    mesh, placements = x.device_mesh, list(x.placements)
    taken = {p.dim for p in placements if isinstance(p, Shard)} | {dim}
    for m, p in enumerate(placements):
        if not isinstance(p, Replicate):
            continue
        free = [d for d in range(x.ndim) if d not in taken and x.shape[d] >= mesh.size(m)]
        if free:
            d = max(free, key=lambda d: (x.shape[d], -d))
            placements[m] = Shard(d)
            taken.add(d)
    return placements


def minmax_dim_bytes(x: DTensor, dim: int, placements=None) -> tuple[float, float]:
    """(torch's, ours) estimated bytes sent per rank (ring) for max/min.dim over ``dim``.

    torch: all-gather the input over the mesh dims sharding ``dim``, ``(g-1) * |x_local|``;
    ours: one all-reduce of int64 keys (two, values + indices, for 64-bit dtypes) of the output shard.
    """
    mesh = x.device_mesh
    placements = list(x.placements) if placements is None else placements
    dims = [m for m, p in enumerate(placements) if isinstance(p, Shard) and p.dim == dim]
    local_shape = shard_shape(x.shape, mesh, placements)
    local_numel = 1
    for s in local_shape:
        local_numel *= s
    group = 1
    for m in dims:
        group *= mesh.size(m)
    out_numel = local_numel // max(local_shape[dim], 1)
    key_bytes = 8 if x.dtype in _PACKED_BITS or x.dtype in _PACKED_INTS else x.element_size() + 8
    theirs = (group - 1) * local_numel * x.element_size()
    ours = sum(2 * (mesh.size(m) - 1) / mesh.size(m) for m in dims) * out_numel * key_bytes
    return float(theirs), float(ours)


@handler(
    [aten.max.dim, aten.min.dim],
    "reduction",
    "min/max with indices over a sharded dim: local winner + one all-reduce of (value, first index) "
    "keys, instead of all-gathering the input",
    multi_shard=None,  # several mesh dims sharding ``dim`` are all-reduced one after the other
)
def minmax_dim(op_call, args, kwargs):
    x, dim, keepdim = _minmax_dim_args(args, kwargs)
    if not isinstance(x, DTensor) or not plain_placements(x) or x.ndim == 0 or x.dtype.is_complex:
        return torch_dispatch(op_call, args, kwargs)
    if not -x.ndim <= dim < x.ndim:  # torch's own error (dim out of range), not a wrapped-around answer
        return torch_dispatch(op_call, args, kwargs)
    dim = dim % x.ndim
    x = drop_partial(x)
    mesh = x.device_mesh
    mesh_dims = [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == dim]
    if not mesh_dims or x.shape[dim] == 0:
        return torch_dispatch(op_call, (x, dim, keepdim), {})
    placements = _spread(x, dim)
    theirs, ours = minmax_dim_bytes(x, dim, placements)
    if ours >= theirs:
        return torch_dispatch(op_call, (x, dim, keepdim), {})

    is_max = op_call is aten.max.dim
    local = x._local_tensor
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    if placements != list(x.placements):  # keep this rank's slice of the newly spread dims
        _, have = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
        for d in range(x.ndim):
            if shape[d] != local.shape[d]:
                local = local.narrow(d, offset[d] - have[d], shape[d])
    empty = local.shape[dim] == 0
    if empty:
        red_shape = list(local.shape)
        red_shape[dim] = 1
        vals = torch.zeros(red_shape, dtype=local.dtype, device=local.device)
        idx = torch.zeros(red_shape, dtype=torch.int64, device=local.device)
    else:
        vals, idx = op_call(local, dim, True)
    gidx = idx + offset[dim]
    if (local.dtype in _PACKED_BITS or local.dtype in _PACKED_INTS) and x.shape[dim] < 2**32:
        vals, gidx = _reduce_packed(vals, gidx, empty, is_max, mesh, mesh_dims)
    else:
        vals, gidx = _reduce_two_step(vals, gidx, empty, is_max, x.shape[dim], mesh, mesh_dims)
    out_shape = list(x.shape)
    if keepdim:
        out_shape[dim] = 1
    else:
        del out_shape[dim]
        vals, gidx = vals.squeeze(dim), gidx.squeeze(dim)
    out_placements = []
    for p in placements:
        if isinstance(p, Shard):
            if p.dim == dim:
                p = Replicate()
            elif not keepdim and p.dim > dim:
                p = Shard(p.dim - 1)
        out_placements.append(p)
    _remember_indices(gidx, dim, mesh_dims)
    return (wrap(vals, mesh, out_placements, out_shape), wrap(gidx, mesh, out_placements, out_shape))


# ---------------------------------------------------------------------------------------------------
# the backward: zeros.scatter(dim, indices, grad) into the shard that owns each index
# ---------------------------------------------------------------------------------------------------
# Autograd computes d max(x, dim) / dx as ``grad.new_zeros(x.shape).scatter(dim, indices, grad)``; the
# zeros are built from the (replicated) grad, so torch materialises the whole input-sized gradient on
# every rank. ``minmax_dim`` remembers which mesh dims sharded ``dim`` for the index tensors it returns
# (keyed by their storage, weakly); when those indices reach ``scatter`` the result is kept sharded like
# the input: each rank writes only the indices in its own rows (a spare row takes the others). The
# placement is only a layout choice: the values are right whichever way the hint goes.
_HINTS: dict[int, tuple] = {}


def _remember_indices(local_idx: torch.Tensor, dim: int, mesh_dims: list[int]) -> None:
    key = local_idx.untyped_storage().data_ptr()
    _HINTS[key] = (weakref.ref(local_idx, lambda _r, k=key: _HINTS.pop(k, None)), dim, tuple(mesh_dims))


def _hint(index: DTensor, dim: int) -> tuple[int, ...]:
    """Mesh dims that sharded ``dim`` of the input whose min/max produced ``index`` (or ())."""
    key = index._local_tensor.untyped_storage().data_ptr()
    ref, hdim, mesh_dims = _HINTS.get(key, (None, None, ()))
    alive = ref is not None and ref() is not None and ref().untyped_storage().data_ptr() == key
    return mesh_dims if alive and hdim == dim else ()


def _scatter_placements(x: DTensor, dim: int, index: DTensor, src: DTensor) -> list | None:
    """Output placements for a local scatter along ``dim``, or None when it needs communication."""
    if not all(isinstance(t, DTensor) and plain_placements(t) for t in (x, index, src)):
        return None
    if index.device_mesh != x.device_mesh or src.device_mesh != x.device_mesh:
        return None
    if any(p.is_partial() for t in (x, index, src) for p in t.placements):
        return None
    if tuple(src.shape) != tuple(index.shape) or any(
            index.shape[d] != x.shape[d] for d in range(x.ndim) if d != dim):
        return None
    hint = _hint(index, dim)
    if not hint:
        # A scatter of the user's own: a sharded result would make its backward (gather, scatter of
        # zeros) all-gather the gradient, more than torch's all-gather of ``x`` now. Torch decides.
        return None
    target = list(x.placements)
    for m in hint:
        if isinstance(target[m], Replicate):
            target[m] = Shard(dim)
    if not any(isinstance(p, Shard) and p.dim == dim for p in target):
        return None
    for m, (t, i, s) in enumerate(zip(target, index.placements, src.placements)):
        if i != s:
            return None
        if isinstance(t, Shard) and t.dim == dim:
            if not isinstance(i, Replicate):
                return None
        elif isinstance(t, Replicate) and isinstance(i, Shard):
            target[m] = i  # take the index's block; x is replicated there, a slice is free
        elif t != i:
            return None
    return target


@handler(
    aten.scatter.src,
    "reduction",
    "the backward of min/max over a sharded dim (zeros.scatter(dim, indices, grad)): each rank "
    "scatters the indices in its own rows, so the gradient stays sharded like the input",
    multi_shard=None,
)
def scatter_src(op_call, args, kwargs):
    x, dim, index, src = (list(args) + [kwargs.get(k) for k in ("self", "dim", "index", "src")][len(args):])[:4]
    if (isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and isinstance(index, DTensor)
            and isinstance(src, DTensor)):
        # torch 2.11's min/max.dim backward builds its zeros with ``at::zeros`` (a plain tensor, the
        # same full-size zeros on every rank) where 2.13 uses ``grad.new_zeros``: a replicated
        # DTensor is what it stands for, and torch's own dispatch refuses the mix.
        x = DTensor.from_local(x, index.device_mesh, [Replicate()] * index.device_mesh.ndim, run_check=False)
        args, kwargs = (x, dim, index, src), {k: v for k, v in kwargs.items()
                                              if k not in ("self", "dim", "index", "src")}
    if kwargs.get("reduce") is not None or not isinstance(x, DTensor) or not isinstance(index, DTensor):
        return torch_dispatch(op_call, args, kwargs)
    dim = dim % max(x.ndim, 1)
    target = _scatter_placements(x, dim, index, src) if x.ndim else None
    if target is None:
        return torch_dispatch(op_call, args, kwargs)
    mesh = x.device_mesh
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, target)
    _, have = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    block = x._local_tensor
    for d in range(x.ndim):
        if block.shape[d] != shape[d]:
            block = block.narrow(d, offset[d] - have[d], shape[d])
    idx, vals = index._local_tensor, src._local_tensor
    n, off = shape[dim], offset[dim]
    keep = (idx >= off) & (idx < off + n)
    spill = list(block.shape)
    spill[dim] = 1  # a spare row for the indices other ranks own
    ext = torch.cat([block, block.new_zeros(spill)], dim)
    ext.scatter_(dim, torch.where(keep, idx - off, n), vals)
    return wrap(ext.narrow(dim, 0, n).contiguous(), mesh, target, x.shape)


# ---------------------------------------------------------------------------------------------------
# conformance cases
# ---------------------------------------------------------------------------------------------------
def _ties(gen: torch.Generator) -> list:
    # small integers as floats: many ties, so "first occurrence" is exercised on every row
    return [torch.randint(0, 4, (6, 8), generator=gen).float()]


def _randn(gen: torch.Generator) -> list:
    return [torch.randn(6, 8, generator=gen)]


def _with_nan(gen: torch.Generator) -> list:
    x = torch.randn(6, 8, generator=gen)
    x[1, 5] = float("nan")
    x[4, 2] = float("nan")
    x[4, 6] = float("nan")
    return [x]


def _ints(gen: torch.Generator) -> list:
    return [torch.randint(-3, 3, (6, 8), generator=gen, dtype=torch.int32)]


def _f64(gen: torch.Generator) -> list:
    return [torch.randint(0, 4, (6, 8), generator=gen).double()]


for _name, _fn in (("max", torch.max), ("min", torch.min)):
    _op = aten.max.dim if _name == "max" else aten.min.dim
    for _dim in (0, 1, -1):
        case(Case(f"reduction/{_name}.dim/dim{_dim}", "reduction", (_op,), _randn,
                  (lambda d, f: lambda x: tuple(f(x, d)))(_dim, _fn), requires_grad=(0,)))
    case(Case(f"reduction/{_name}.dim/ties", "reduction", (_op,), _ties,
              (lambda f: lambda x: tuple(f(x, 1)))(_fn), requires_grad=(0,)))
    case(Case(f"reduction/{_name}.dim/ties_keepdim", "reduction", (_op,), _ties,
              (lambda f: lambda x: tuple(f(x, 0, keepdim=True)))(_fn), requires_grad=(0,)))
    case(Case(f"reduction/{_name}.dim/nan", "reduction", (_op,), _with_nan,
              (lambda f: lambda x: tuple(f(x, 1)))(_fn), extra={"nan": True}))
    case(Case(f"reduction/{_name}.dim/int32", "reduction", (_op,), _ints,
              (lambda f: lambda x: tuple(f(x, 1)))(_fn)))
    case(Case(f"reduction/{_name}.dim/float64_ties", "reduction", (_op,), _f64,
              (lambda f: lambda x: tuple(f(x, 0)))(_fn), requires_grad=(0,)))
    case(Case(f"reduction/{_name}/full", "reduction",
              (aten.max.default if _name == "max" else aten.min.default,), _randn,
              (lambda f: lambda x: f(x))(_fn), requires_grad=(0,)))

for _name, _fn, _op in (("amax", torch.amax, aten.amax.default), ("amin", torch.amin, aten.amin.default)):
    case(Case(f"reduction/{_name}/dim1", "reduction", (_op,), _randn,
              (lambda f: lambda x: f(x, 1))(_fn), requires_grad=(0,)))
    case(Case(f"reduction/{_name}/all_dims_ties", "reduction", (_op,), _ties,
              (lambda f: lambda x: f(x, (0, 1)))(_fn), requires_grad=(0,)))


def _scatter_rows(gen: torch.Generator) -> list:
    idx = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(6)])
    return [torch.randn(6, 8, generator=gen), idx, torch.randn(6, 3, generator=gen)]


case(Case("reduction/scatter/into_rows", "reduction", (aten.scatter.src,), _scatter_rows,
          lambda x, i, v: x.scatter(1, i, v), requires_grad=(0, 2)))
