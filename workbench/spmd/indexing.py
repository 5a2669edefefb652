"""index_put and advanced indexing into a DTensor sharded along an indexed dim: the shard that owns an
index does the work, nobody all-gathers.

``y = x.index_put((i,), v)`` writes ``y[i[k]] = v[k]``. With ``x`` sharded along the indexed dim and the
indices and values replicated, every rank already knows every write; it keeps the ones that land in its
own rows and shifts them to local coordinates::

    x = [x_0 | x_1 | ... ]       rank r owns rows [o_r, o_r + n_r)
    keep = (o_r <= i) & (i < o_r + n_r)
    y_r  = x_r.index_put((i[keep] - o_r,), v[keep], accumulate)      no communication
                                                                     y keeps x's placements

torch 2.13 all-gathers ``x`` instead (and its backward for ``accumulate=False`` fails: the zeros it
writes into the gradient are a plain tensor). Boolean masks become ``mask.nonzero()`` indices first;
negative indices wrap; an out-of-range index raises ``IndexError`` like torch. Duplicate indices with
``accumulate=False`` are nondeterministic in torch too; with ``accumulate=True`` they add up locally.

``y = x[i]`` (``aten.index``) is the transpose, and the gradient of ``index_put`` with respect to its
values. Each rank gathers the entries it owns and writes zeros elsewhere, so the result is
``Partial(sum)`` over the mesh dims that sharded ``x`` along an indexed dim::

    y_r = where(keep, x_r[clamp(i - o_r)], 0)        sum_r y_r = x[i]

That costs one all-reduce of ``|y|`` when (if) someone needs it replicated, against an all-gather of
``|x|`` now; we take it only when it is the smaller of the two, and leave the rest to torch.

Gradients: d/dx of ``index_put(accumulate=False)`` is ``grad.index_put(i, 0)`` (this rule again, local),
d/dv is ``grad[i]`` (the ``aten.index`` rule: Partial, summed by whoever needs it).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from workbench.compat import compute_local_shape_and_global_offset

from workbench.spmd.reductions import plain_placements, shard_shape, wrap
from workbench.spmd.registry import Case, case, handler, torch_dispatch

aten = torch.ops.aten
_PUT_OPS = (aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
_INPLACE = (aten.index_put_.default, aten._index_put_impl_.default)


# ---------------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------------
def _full(t):
    """The whole tensor on every rank: a plain tensor is taken as replicated; a DTensor is gathered."""
    if not isinstance(t, DTensor):
        return t
    if all(isinstance(p, Replicate) for p in t.placements):
        return t._local_tensor
    return t.full_tensor()


def _indexed_dims(indices, ndim: int) -> list[int]:
    """Tensor dims that ``indices`` index (a k-dim mask at position p covers p .. p+k-1): shapes only,
    so every rank gets the same answer without looking at data."""
    dims, pos = [], 0
    for t in indices:
        if t is None:
            pos += 1
            continue
        k = t.ndim if t.dtype in (torch.bool, torch.uint8) else 1
        dims.extend(range(pos, pos + k))
        pos += k
    return [d for d in dims if d < ndim]


def _long_indices(indices, shape) -> list:
    """Per tensor dim: None or a long index tensor in [0, size), masks expanded, negatives wrapped."""
    out, pos = [], 0
    for t in indices:
        if t is None:
            out.append(None)
            pos += 1
            continue
        t = _full(t)
        if t.dtype in (torch.bool, torch.uint8):
            for d, sz in enumerate(t.shape):
                if sz != shape[pos + d]:
                    raise IndexError(f"the boolean mask's shape {tuple(t.shape)} does not match the indexed "
                                     f"tensor's shape {tuple(shape[pos:pos + t.ndim])} at dim {pos + d}")
            out.extend(t.bool().nonzero().unbind(1))
            pos += t.ndim
            continue
        size = shape[pos]
        if t.numel() and (int(t.min()) < -size or int(t.max()) >= size):
            raise IndexError(f"index out of range for dim {pos} of size {size}")
        out.append(torch.where(t < 0, t + size, t).long())
        pos += 1
    return out + [None] * (len(shape) - len(out))


class _Layout:
    """Where the broadcast index block sits in ``x[indices]`` (torch's advanced-indexing rule)."""

    def __init__(self, idx: list, shape):
        self.indexed = [d for d, t in enumerate(idx) if t is not None]
        self.others = [d for d, t in enumerate(idx) if t is None]
        self.bshape = list(torch.broadcast_shapes(*[idx[d].shape for d in self.indexed]))
        first, last = self.indexed[0], self.indexed[-1]
        contiguous = last - first + 1 == len(self.indexed)
        self.at = first if contiguous else 0  # torch moves a split index block to the front
        before = [d for d in self.others if d < self.at] if contiguous else []
        after = [d for d in self.others if d not in before]
        self.before, self.after = before, after

    def pos(self, d: int) -> int:
        """Position of the non-indexed tensor dim ``d`` in the result."""
        if d in self.before:
            return self.before.index(d)
        return len(self.before) + len(self.bshape) + self.after.index(d)

    def result_shape(self, shape) -> list[int]:
        return [shape[d] for d in self.before] + self.bshape + [shape[d] for d in self.after]

    def mask_view(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` over the index block, reshaped to broadcast against the result."""
        return mask.reshape([1] * len(self.before) + self.bshape + [1] * len(self.after))


def _owned(idx: list, layout: _Layout, offset, local_shape) -> torch.Tensor:
    """Over the index block: True where every indexed coordinate falls in this rank's shard."""
    keep = None
    for d in layout.indexed:
        i = idx[d].expand(layout.bshape)
        k = (i >= offset[d]) & (i < offset[d] + local_shape[d])
        keep = k if keep is None else keep & k
    return keep


def _sharded_indexed(x: DTensor, dims) -> list[int]:
    return [m for m, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim in dims]


def _for_torch(args, mesh):
    """``args`` as torch's DTensor rules can take them: plain tensors (e.g. the zeros torch's own
    index_put backward writes) become replicated DTensors, and boolean masks become their replicated
    ``nonzero()`` indices (DTensor has no rule for nonzero)."""
    rep = [Replicate()] * mesh.ndim

    def fix(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return wrap(t, mesh, rep, t.shape)
        return t

    def fix_indices(ix):
        out = []
        for t in ix:
            if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8):
                out.extend(wrap(i.contiguous(), mesh, rep, i.shape) for i in _full(t).bool().nonzero().unbind(1))
            else:
                out.append(fix(t))
        return out

    return tuple(fix_indices(a) if k == 1 and isinstance(a, (list, tuple)) else fix(a)
                 for k, a in enumerate(args))


# ---------------------------------------------------------------------------------------------------
# index_put
# ---------------------------------------------------------------------------------------------------
def _put_args(op_call, args, kwargs):
    names = ("self", "indices", "values", "accumulate", "unsafe")
    a = dict(zip(names, args))
    a.update(kwargs or {})
    return a["self"], list(a["indices"]), a["values"], bool(a.get("accumulate", False))


@handler(
    list(_PUT_OPS),
    "index",
    "index_put into a tensor sharded along an indexed dim: each rank writes the indices it owns "
    "(local, no all-gather); also accepts the plain-tensor zeros torch's own backward passes",
    multi_shard=None,  # a dim split over several mesh dims is just a smaller block per rank
)
def index_put(op_call, args, kwargs):
    x, indices, values, accumulate = _put_args(op_call, args, kwargs)
    if not isinstance(x, DTensor):
        return torch_dispatch(op_call, args, kwargs)
    mesh = x.device_mesh
    dims = _indexed_dims(indices, x.ndim)
    big_values = isinstance(values, DTensor) and values.placements != tuple([Replicate()] * mesh.ndim) \
        and values.numel() >= x.numel()
    if (not plain_placements(x) or any(p.is_partial() for p in x.placements)
            or not _sharded_indexed(x, dims) or big_values or not dims):
        return torch_dispatch(op_call, _for_torch(args, mesh), kwargs)

    idx = _long_indices(indices, x.shape)
    layout = _Layout(idx, x.shape)
    local = x._local_tensor
    local_shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    keep = _owned(idx, layout, offset, local_shape).reshape(-1).nonzero().squeeze(1)

    v = _full(values).to(local.device)
    rshape = layout.result_shape(x.shape)
    while v.ndim > len(rshape) and v.shape[0] == 1:
        v = v[0]
    try:
        v = v.expand(rshape)
    except RuntimeError:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(_full(values).shape)} cannot be "
                           f"broadcast to indexing result of shape {rshape}") from None
    for d in layout.others:  # this rank's slice of the non-indexed dims
        if local_shape[d] != x.shape[d]:
            v = v.narrow(layout.pos(d), offset[d], local_shape[d])
    nb = len(layout.bshape)
    lead = len(layout.before)
    v = v.reshape(list(v.shape[:lead]) + [-1] + list(v.shape[lead + nb:])).index_select(lead, keep)
    local_idx = [None if t is None else (t.expand(layout.bshape).reshape(-1)[keep] - offset[d])
                 for d, t in enumerate(idx)]
    while local_idx and local_idx[-1] is None:
        local_idx.pop()

    if op_call in _INPLACE:
        aten.index_put_.default(local, local_idx, v, accumulate)
        return x
    out = aten.index_put_.default(local.clone(), local_idx, v, accumulate)
    return wrap(out, mesh, x.placements, x.shape)


# ---------------------------------------------------------------------------------------------------
# index (gather): x[indices]
# ---------------------------------------------------------------------------------------------------
def index_bytes(x: DTensor, layout: _Layout) -> tuple[float, float]:
    """(torch's, ours) estimated bytes per rank: all-gather of ``x`` over the mesh dims sharding an
    indexed dim, against one later all-reduce of the (Partial) result over them."""
    mesh = x.device_mesh
    mdims = _sharded_indexed(x, layout.indexed)
    group = 1
    for m in mdims:
        group *= mesh.size(m)
    local = shard_shape(x.shape, mesh, x.placements)
    x_local = 1
    for s in local:
        x_local *= s
    out_local = 1
    for s in layout.bshape:
        out_local *= s
    for d in layout.others:
        out_local *= local[d]
    es = x.element_size()
    return float((group - 1) * x_local * es), float(2 * (group - 1) / group * out_local * es)


@handler(
    aten.index.Tensor,
    "index",
    "x[indices] with x sharded along an indexed dim: each rank gathers what it owns, zeros elsewhere "
    "-> Partial(sum), instead of all-gathering x (when the result is the smaller)",
    multi_shard=None,
)
def index(op_call, args, kwargs):
    x, indices = args[0], list(args[1] if len(args) > 1 else kwargs["indices"])
    if not isinstance(x, DTensor):
        return torch_dispatch(op_call, args, kwargs)
    mesh = x.device_mesh
    dims = _indexed_dims(indices, x.ndim)
    if (not dims or not plain_placements(x) or any(p.is_partial() for p in x.placements)
            or not _sharded_indexed(x, dims) or x.dtype == torch.bool or x.dtype.is_complex):
        return torch_dispatch(op_call, _for_torch(args, mesh), kwargs)
    idx = _long_indices(indices, x.shape)  # indices are replicated: every rank sees the same
    layout = _Layout(idx, x.shape)
    theirs, ours = index_bytes(x, layout)
    if ours >= theirs:
        return torch_dispatch(op_call, _for_torch(args, mesh), kwargs)

    local = x._local_tensor
    local_shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    out_shape = layout.result_shape(x.shape)
    if any(local_shape[d] == 0 for d in layout.indexed):
        out = local.new_zeros(layout.result_shape(local_shape))
    else:
        keep = _owned(idx, layout, offset, local_shape)
        local_idx = [None if t is None else (t - offset[d]).clamp(0, local_shape[d] - 1)
                     for d, t in enumerate(idx)]
        out = aten.index.Tensor(local, local_idx)
        out = torch.where(layout.mask_view(keep), out, torch.zeros((), dtype=out.dtype, device=out.device))
    placements = []
    for p in x.placements:
        if isinstance(p, Shard):
            p = Partial("sum") if p.dim in layout.indexed else Shard(layout.pos(p.dim))
        placements.append(p)
    return wrap(out.contiguous(), mesh, placements, out_shape)


# ---------------------------------------------------------------------------------------------------
# conformance cases
# ---------------------------------------------------------------------------------------------------
def _rows(gen, idx, vshape=None):
    x = torch.randn(16, 4, generator=gen)
    i = torch.tensor(idx)
    v = torch.randn(vshape if vshape is not None else (len(idx), 4), generator=gen)
    return [x, i, v]


def _setitem(index_fn):
    def fn(x, *rest):
        y = x.clone()
        *ix, v = rest
        y[index_fn(*ix)] = v
        return y
    return fn


_P = aten.index_put.default
_PI = aten.index_put_.default
_IX = aten.index.Tensor
_RG = (0, 2)

case(Case("index/index_put/rows", "index", (_P, _IX),
          lambda g: _rows(g, [1, 9, -1]), lambda x, i, v: x.index_put((i,), v), requires_grad=_RG))
case(Case("index/index_put/rows_accumulate_duplicates", "index", (_P, _IX),
          lambda g: _rows(g, [1, 9, 1, 15, 15]),
          lambda x, i, v: x.index_put((i,), v, accumulate=True), requires_grad=_RG))
case(Case("index/index_put/rows_values_sharded", "index", (_P, _IX),
          lambda g: _rows(g, [0, 3, 8, 12]), lambda x, i, v: x.index_put((i,), v, accumulate=True),
          shardable=(0, 2), requires_grad=_RG))
case(Case("index/index_put/scalar_value", "index", (_P,),
          lambda g: _rows(g, [2, 4, 11], vshape=()), lambda x, i, v: x.index_put((i,), v),
          requires_grad=_RG))
case(Case("index/index_put/points_accumulate", "index", (_P, _IX),
          lambda g: [torch.randn(8, 6, generator=g), torch.tensor([0, 3, 3, 7, -2]),
                     torch.tensor([5, 0, 0, 2, 1]), torch.randn(5, generator=g)],
          lambda x, i, j, v: x.index_put((i, j), v, accumulate=True), requires_grad=(0, 3)))
case(Case("index/index_put/mask", "index", (_P,),
          lambda g: [torch.randn(8, 6, generator=g), torch.tensor([1, 0, 0, 1, 0, 0, 0, 1]).bool(),
                     torch.randn(6, generator=g)],
          lambda x, m, v: x.index_put((m,), v), requires_grad=_RG))
case(Case("index/index_put_/setitem_cols", "index", (_PI, _IX),
          lambda g: [torch.randn(4, 16, generator=g), torch.tensor([14, 0, 3]), torch.randn(4, 3, generator=g)],
          _setitem(lambda i: (slice(None), i)), requires_grad=_RG))
case(Case("index/index_put_/setitem_split_block", "index", (_PI, _IX),
          lambda g: [torch.randn(4, 6, 4, generator=g), torch.tensor([0, 3, 3]), torch.tensor([1, 2, 1]),
                     torch.randn(3, 6, generator=g)],
          _setitem(lambda i, j: (i, slice(None), j)), requires_grad=(0, 3)))
case(Case("index/index/rows_duplicates", "index", (_IX,),
          lambda g: [torch.randn(16, 4, generator=g), torch.tensor([15, 0, 15])],
          lambda x, i: x[i], requires_grad=(0,)))
case(Case("index/index/points", "index", (_IX,),
          lambda g: [torch.randn(8, 6, generator=g), torch.tensor([[0, 7], [3, 3]]), torch.tensor([5, -1])],
          lambda x, i, j: x[i, j], requires_grad=(0,)))
case(Case("index/index/mask_rows", "index", (_IX,),
          lambda g: [torch.randn(8, 6, generator=g), torch.tensor([0, 1, 0, 0, 1, 0, 0, 0]).bool()],
          lambda x, m: x[m], requires_grad=(0,)))
