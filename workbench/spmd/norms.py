"""Sharding rules for normalisation ops: batch_norm (= SyncBatchNorm), instance_norm, group_norm,
layer_norm and rms_norm.

A norm is "subtract a mean, divide by a spread" over some reduction set ``R``; where the tensor is split
decides what has to cross the wire::

    x : [N, C, *S]   batch_norm / SyncBatchNorm : stats per c,      R = (N, *S)
                     instance_norm              : stats per (n, c), R = (*S)    (batch_norm on [1, N*C, *S])
                     group_norm                 : stats per (n, g), R = (C/G, *S)
                     layer_norm / rms_norm      : stats per row,    R = last dims

    split on a dim OUTSIDE R  (batch_norm: C; group_norm: N, or C when groups align with shards;
                               layer_norm / rms_norm: rows, torch's rules already do this)
        -> every rank owns whole statistics: run the op on the local shard, no communication.
    split on a dim INSIDE R   (batch_norm: N or S; group_norm: S; layer_norm / rms_norm: D)
        -> every rank owns a slice of each statistic: all-reduce the slice sums, nothing else.

        mean = all_reduce(sum_local x) / count                           (count = global numel / #stats)
        var  = all_reduce(sum_local (x - mean)^2) / count                (two-pass: no cancellation)
        y    = (x_local - mean) * rsqrt(var + eps) * w + b               (local, keeps x's placement)

      and in the backward, with xhat = (x - mean) * invstd:

        sum_dy, sum_dy_xhat = all_reduce([sum_local dy, sum_local dy * xhat])       (one collective)
        dx = (dy - sum_dy / count - xhat * sum_dy_xhat / count) * invstd * w         (local)

Torch 2.13 instead all-gathers a batch-sharded batch_norm input (forward and backward) and returns
Replicate; its channel-sharded batch_norm silently drops the running-statistics update of Replicate
buffers; group_norm has no backward rule and all-gathers channel shards. Our rules move ``2 * C`` floats
per all-reduce instead of the activation, keep the input's placement, and update running statistics on
every rank (every rank ends with the global statistics, so Replicate buffers stay replicated).

Parameter gradients: batch_norm's ``dw, db`` come out Replicate for free (they ARE the all-reduced
``sum_dy_xhat, sum_dy``). Where the op itself needs no reduction (group_norm, eval-mode batch_norm),
``dw, db`` leave as ``Partial(sum)`` over the batch/spatial mesh dims, exactly like torch's layer_norm:
the op moves no bytes and the sum happens once, where the gradient is consumed.

A tensor dim sharded over several mesh dims (``[S(0), S(0)]`` on a 2x2 mesh) is handled directly: the
statistics are all-reduced over each of those mesh dims. For group_norm channel shards whose groups do not
align with every shard, we keep the largest mesh dim whose shards align and gather the rest.

SyncBatchNorm: in DTensor terms, synchronising batch statistics across data-parallel ranks IS batch_norm
over the batch-sharded global batch, so ``nn.BatchNorm*d`` on a ``Shard(0)`` DTensor gives SyncBatchNorm's
result through these rules (``nn.SyncBatchNorm`` itself talks to process groups on local tensors and is
not DTensor-aware).

Costs and limits, measured (tests/test_spmd_norms.py):

* Channel-sharded batch_norm with Replicate running stats all-gathers the updated statistics (C floats
  per buffer): every rank must hold every channel's value. Torch moves nothing there because it drops
  the update.
* instance_norm with C sharded: torch's ``view`` to ``[1, N*C, *S]`` gathers the activation (or makes a
  ``_StridedShard``) before our rule runs; CompositeImplicit ops such as ``aten.instance_norm`` never
  reach DTensor, so no rule can intercept earlier. Where the view leaves only channel shards (strided
  or not: C and N both sharded, ``[S(1), S(0)]`` on 2x2) every rank holds whole ``(n, c)`` rows and
  torch's batch_norm rule runs locally with 0 bytes, so those placements stay torch's (our layout
  would gather the strided shard). Batch- and spatial-sharded instance_norm are local / all-reduce only.
* layer_norm / rms_norm: torch's single-dim rules keep every row sharding local with no bytes, so
  those stay torch's. With a normalised dim sharded torch all-gathers x; ours all-reduce two floats
  per row (``sum x``, ``sum (x - mean)^2``) instead. ``F.rms_norm`` on CPU decomposes before DTensor
  (pow, mean, ``add_(eps)``, rsqrt; even ``aten._fused_rms_norm`` decomposes on CPU), which works through
  the elementwise/reduction rules; on GPU ``aten._fused_rms_norm`` is a kernel that reaches our rule,
  whose math the tests check by calling the handler on CPU DTensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from workbench.compat import (AsyncCollectiveTensor, DTensorSpec, TensorMeta, funcol,  # noqa: I001
                              redistribute_local_tensor)

from workbench.spmd.reductions import contiguous_stride
from workbench.spmd.registry import Case, case, handler, torch_dispatch

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------------
# Layouts: which mesh dims split the statistics (channel) and which split the reduction set (reduce)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Where ``x: [N, C, *S]`` is split (or will be, once redistributed to ``placements``), per mesh dim:
    ``batch`` (shard of dim 0), ``channel`` (dim 1), ``spatial`` (dims >= 2); other mesh dims Replicate."""

    mesh: Any
    placements: tuple
    batch: tuple[int, ...]
    channel: tuple[int, ...]
    spatial: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return bool(self.batch or self.channel or self.spatial)

    @property
    def reduce(self) -> tuple[int, ...]:
        """Mesh dims that split batch_norm's reduction set (N, *S)."""
        return tuple(sorted(self.batch + self.spatial))

    def vec(self) -> tuple:
        """Placements of a per-channel vector ``[C]`` (weight, bias, running stats) matching ``x``."""
        return tuple(Shard(0) if i in self.channel else Replicate() for i in range(len(self.placements)))


def _layout(x: DTensor, adopt: tuple = ()) -> _Layout:
    """The layout a norm runs ``x`` in: its Shard placements are kept; Partial and ``_StridedShard``
    (which torch's view creates from instance_norm's ``[N, C] -> [N*C]`` when C is split) are gathered
    first (where the strided shard is the only split besides channels, the handlers leave the op to
    torch's rule instead: :func:`_strided_channels_only`). A mesh dim where ``x`` is Replicate but a
    per-channel vector in ``adopt`` is ``Shard(0)`` becomes a channel shard of ``x`` (a local slice), so
    the vector need not be gathered."""
    batch, channel, spatial, pls = [], [], [], []
    for i, p in enumerate(x.placements):
        if type(p) is Shard:
            d = p.dim % x.ndim
            (batch if d == 0 else channel if d == 1 else spatial).append(i)
            pls.append(p)
        elif isinstance(p, Replicate) and any(
                isinstance(v, DTensor) and type(v.placements[i]) is Shard for v in adopt):
            channel.append(i)
            pls.append(Shard(1))
        else:
            pls.append(Replicate())
    return _Layout(x.device_mesh, tuple(pls), tuple(batch), tuple(channel), tuple(spatial))


def _spec(mesh, placements, shape, dtype, stride=None) -> DTensorSpec:
    shape = torch.Size(shape)
    return DTensorSpec(mesh, tuple(placements),
                       tensor_meta=TensorMeta(shape, tuple(stride or contiguous_stride(shape)), dtype))


def _wrap(local: torch.Tensor | None, mesh, placements, shape, stride=None):
    if local is None:
        return None
    return DTensor(local, _spec(mesh, placements, shape, local.dtype, stride), requires_grad=False)


def _wrap_like(local: torch.Tensor | None, x: DTensor, lay: _Layout):
    """Wrap an output shaped like ``x`` in ``lay``'s placements (``x``'s own spec when they agree)."""
    if local is None:
        return None
    if tuple(lay.placements) == tuple(x.placements) and local.dtype == x.dtype:
        return DTensor(local, x._spec, requires_grad=False)
    return _wrap(local, lay.mesh, lay.placements, x.shape, x.stride())


def _local(t: Any, mesh, placements) -> torch.Tensor | None:
    """``t``'s local shard under ``placements`` (a local slice for Replicate -> Shard; else a collective)."""
    if t is None:
        return None
    if not isinstance(t, DTensor):
        raise TypeError("mixed torch.Tensor and DTensor")
    if tuple(t.placements) == tuple(placements):
        return t._local_tensor
    target = _spec(mesh, placements, t.shape, t.dtype, t.stride())
    return _waited(redistribute_local_tensor(t._local_tensor, t._spec, target))


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _all_reduce(t: torch.Tensor, mesh, mesh_dims) -> torch.Tensor:
    """``t`` summed over each mesh dim in ``mesh_dims`` (one functional all-reduce per mesh dim)."""
    for d in mesh_dims:
        if mesh.size(d) > 1:
            t = _waited(funcol.all_reduce(t, "sum", (mesh, d)))
    return t


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _bcast(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """[c] -> [1, c, 1, ...] for broadcasting against [n, c, *s]."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _strided_channels_only(x: DTensor) -> bool:
    """``x`` carries a ``_StridedShard`` and is otherwise split on channels only (or replicated).

    That is instance_norm's ``[N, C, *S] -> [1, N*C, *S]`` view of a channel-sharded input (with the batch
    sharded too it becomes ``[_StridedShard(1), Shard(1)]``: every rank holds whole (n, c) rows). Our
    layout gathers the strided shard, while torch's batch_norm rule runs it locally, so with nothing in
    the reduction set to all-reduce torch's rule moves no more bytes (2x2 mesh, x ``[S(1), S(0)]``:
    torch 0 bytes, gathering 2880) and these placements stay torch's.
    """
    from workbench.compat import StridedShard as _StridedShard

    ps = x.placements
    return any(isinstance(p, _StridedShard) for p in ps) and all(
        isinstance(p, Replicate) or (isinstance(p, (Shard, _StridedShard)) and p.dim % x.ndim == 1) for p in ps)


def _all_dtensors(values) -> bool:
    return all(v is None or isinstance(v, DTensor) or not isinstance(v, torch.Tensor) for v in values)


# --------------------------------------------------------------------------------------------------
# batch_norm (and instance_norm, which torch lowers to batch_norm on [1, N*C, *S])
# --------------------------------------------------------------------------------------------------

# op -> argument positions: (weight, bias, running_mean, running_var, training, momentum, eps);
# training is True/False for ops that fix it; running stats None for ops without them.
_BN_FWD = {
    aten.native_batch_norm.default: (1, 2, 3, 4, 5, 6, 7),
    aten._native_batch_norm_legit.default: (1, 2, 3, 4, 5, 6, 7),
    aten._native_batch_norm_legit.no_stats: (1, 2, None, None, 3, 4, 5),
    aten._native_batch_norm_legit_functional.default: (1, 2, 3, 4, 5, 6, 7),
    aten._native_batch_norm_legit_no_training.default: (1, 2, 3, 4, False, 5, 6),
    aten._batch_norm_with_update.default: (1, 2, 3, 4, True, 5, 6),
    aten._batch_norm_with_update_functional.default: (1, 2, 3, 4, True, 5, 6),
    aten._batch_norm_no_update.default: (1, 2, 3, 4, False, 5, 6),
}
_BN_FUNCTIONAL = {aten._native_batch_norm_legit_functional.default,
                  aten._batch_norm_with_update_functional.default}
_BN_RESERVE = {aten._batch_norm_with_update.default, aten._batch_norm_with_update_functional.default,
               aten._batch_norm_no_update.default}


def _arg(args, i, default=None):
    if i is None:
        return default
    if isinstance(i, bool):
        return i
    return args[i] if i < len(args) else default


@handler(list(_BN_FWD), family="norm", multi_shard=None,
         summary="batch-sharded input stays sharded: all-reduce 2C floats of statistics instead of "
                 "all-gathering the activation; running stats updated on every rank (also channel-sharded)")
def batch_norm_forward(op_call, args, kwargs):
    if kwargs:
        return torch_dispatch(op_call, args, kwargs)
    x = args[0]
    iw, ib, irm, irv, itr, imo, ieps = _BN_FWD[op_call]
    w, b, rm, rv = (_arg(args, i) for i in (iw, ib, irm, irv))
    training, momentum, eps = bool(_arg(args, itr)), float(_arg(args, imo)), float(_arg(args, ieps))
    if not isinstance(x, DTensor) or x.ndim < 2 or not _all_dtensors((w, b, rm, rv)):
        return torch_dispatch(op_call, args, kwargs)
    if any(type(p) is not Shard and not isinstance(p, Replicate) for v in (rm, rv) if v is not None
           for p in v.placements):  # a Partial running statistic has no meaning to update: torch decides
        return torch_dispatch(op_call, args, kwargs)
    lay = _layout(x, adopt=(w, b, rm, rv))
    if not lay.sharded:  # everything replicated: torch's rule is the local op already
        return torch_dispatch(op_call, args, kwargs)
    if _strided_channels_only(x) and not (training and rm is not None):  # (torch drops a stats update)
        return torch_dispatch(op_call, args, kwargs)

    mesh, vec = lay.mesh, lay.vec()
    reduce_dims = lay.reduce
    C = x.shape[1]
    xl = _local(x, mesh, lay.placements)
    wl, bl, rml, rvl = (_local(v, mesh, vec) for v in (w, b, rm, rv))
    dims = [0] + list(range(2, x.ndim))
    count = x.numel() // C if C else 0
    if training:
        xa = _acc(xl)
        mean = _all_reduce(xa.sum(dims), mesh, reduce_dims) / count
        var = _all_reduce((xa - _bcast(mean, x.ndim)).square().sum(dims), mesh, reduce_dims) / count
        save_mean, save_invstd = mean, torch.rsqrt(var + eps)
        if all(t is None or t.dtype == mean.dtype for t in (xl, wl, bl)):  # the kernel, in eval mode
            out = aten.native_batch_norm(xl, wl, bl, mean, var, False, 0.0, eps)[0]
        else:  # low-precision input: normalise in float32
            scale = save_invstd * (_acc(wl) if wl is not None else 1.0)
            shift = (_acc(bl) if bl is not None else 0.0) - mean * scale
            out = (xa * _bcast(scale, x.ndim) + _bcast(shift, x.ndim)).to(xl.dtype)
        new_rm = new_rv = None
        if rml is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var
            new_rm = rml * (1 - momentum) + mean.to(rml.dtype) * momentum
            new_rv = rvl * (1 - momentum) + unbiased.to(rvl.dtype) * momentum
            if op_call not in _BN_FUNCTIONAL:  # mutate the buffers, in their own placement
                for buf, new in ((rm, new_rm), (rv, new_rv)):
                    if tuple(buf.placements) == vec:
                        buf._local_tensor.copy_(new)
                    else:
                        src = _spec(mesh, vec, buf.shape, buf.dtype)
                        buf._local_tensor.copy_(_waited(redistribute_local_tensor(new, src, buf._spec)))
        stat_pl, stat_shape = vec, (C,)
    else:
        if rml is None:
            return torch_dispatch(op_call, args, kwargs)
        out, save_mean, save_invstd = aten.native_batch_norm(xl, wl, bl, rml, rvl, False, 0.0, eps)
        new_rm, new_rv = rml, rvl
        stat_pl, stat_shape = (Replicate(),) * mesh.ndim, (0,)  # CPU returns empty saves in eval mode

    outs = [_wrap_like(out, x, lay),
            _wrap(save_mean, mesh, stat_pl, stat_shape), _wrap(save_invstd, mesh, stat_pl, stat_shape)]
    if op_call in _BN_RESERVE:
        outs.append(_wrap(xl.new_empty(0, dtype=torch.uint8), mesh, (Replicate(),) * mesh.ndim, (0,)))
    if op_call in _BN_FUNCTIONAL:
        outs += [_wrap(new_rm.clone(), mesh, vec, (C,)), _wrap(new_rv.clone(), mesh, vec, (C,))]
    return tuple(outs)


@handler([aten.native_batch_norm_backward.default, aten.batch_norm_backward.default], family="norm",
         multi_shard=None,
         summary="batch-sharded backward: one all-reduce of [sum dy, sum dy*xhat] (2C floats), dx keeps "
                 "x's placement; eval-mode and channel-sharded backward run locally")
def batch_norm_backward(op_call, args, kwargs):
    if kwargs:
        return torch_dispatch(op_call, args, kwargs)
    go, x, w, rm, rv, save_mean, save_invstd, train, eps, mask = args[:10]
    vecs = (w, rm, rv, save_mean, save_invstd)
    if not isinstance(x, DTensor) or not isinstance(go, DTensor) or x.ndim < 2 or not _all_dtensors(vecs):
        return torch_dispatch(op_call, args, kwargs)
    lay = _layout(x, adopt=vecs)
    if not lay.sharded or _strided_channels_only(x):
        return torch_dispatch(op_call, args, kwargs)
    mesh, vec = lay.mesh, lay.vec()
    C, nd = x.shape[1], x.ndim
    dims = [0] + list(range(2, nd))
    count = x.numel() // C if C else 0
    xl = _acc(_local(x, mesh, lay.placements))
    gol = _acc(_local(go, mesh, lay.placements))
    wl = _local(w, mesh, vec)
    if train:
        mean, invstd = _local(save_mean, mesh, vec), _local(save_invstd, mesh, vec)
    else:
        mean = _local(rm, mesh, vec)
        invstd = torch.rsqrt(_acc(_local(rv, mesh, vec)) + eps)
    mean, invstd = _acc(mean), _acc(invstd)
    xhat = (xl - _bcast(mean, nd)) * _bcast(invstd, nd)
    sums = torch.stack([gol.sum(dims), (gol * xhat).sum(dims)])  # [2, c]: sum dy, sum dy * xhat
    scale = _bcast(invstd * (_acc(wl) if wl is not None else 1.0), nd)
    if train:
        sums = _all_reduce(sums, mesh, lay.reduce)
        gi = (gol - _bcast(sums[0], nd) / count - xhat * _bcast(sums[1], nd) / count) * scale
        grad_pl = vec
    else:  # y = x * scale + shift: dx is local; dw, db are partial sums over the reduce dims
        gi = gol * scale
        grad_pl = tuple(Partial("sum") if i in lay.reduce else p for i, p in enumerate(vec))
    wdtype = w.dtype if w is not None else x.dtype
    gi = _wrap_like(gi.to(x.dtype), x, lay) if mask[0] else None
    gw = _wrap(sums[1].to(wdtype).clone(), mesh, grad_pl, (C,)) if mask[1] else None
    gb = _wrap(sums[0].to(wdtype).clone(), mesh, grad_pl, (C,)) if mask[2] else None
    return gi, gw, gb


# --------------------------------------------------------------------------------------------------
# group_norm
# --------------------------------------------------------------------------------------------------


def _group_layout(lay: _Layout, C: int, G: int) -> _Layout:
    """The layout group_norm runs in: channel shards kept only where every shard holds whole groups
    (else the largest aligned mesh dim, else none); batch and spatial shards kept as they are."""
    mesh, chan = lay.mesh, lay.channel

    def aligned(mesh_dims) -> bool:
        k = math.prod(mesh.size(d) for d in mesh_dims)
        return C % k == 0 and G % k == 0

    if chan and not aligned(chan):
        ok = [d for d in chan if aligned([d])]
        keep = (max(ok, key=lambda d: (mesh.size(d), -d)),) if ok else ()
        pl = tuple(Replicate() if i in chan and i not in keep else p for i, p in enumerate(lay.placements))
        return _Layout(mesh, pl, lay.batch, keep, lay.spatial)
    return lay


def _stat_placements(lay: _Layout) -> tuple:
    """Placements of group_norm's mean/rstd ``[N, G]`` for an input in layout ``lay``."""
    return tuple(Shard(0) if i in lay.batch else Shard(1) if i in lay.channel else Replicate()
                 for i in range(lay.mesh.ndim))


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, c, *s] -> [n, groups, (c / groups) * prod(s)]."""
    return t.reshape(t.shape[0], groups, -1)


@handler(aten.native_group_norm.default, family="norm", multi_shard=None,
         summary="channel shards holding whole groups run locally (torch all-gathers); spatial shards "
                 "all-reduce 2*N*G floats of statistics instead of all-gathering the activation")
def group_norm_forward(op_call, args, kwargs):
    x, w, b, N, C, HxW, G, eps = args
    if kwargs or not isinstance(x, DTensor) or x.ndim < 2 or not _all_dtensors((w, b)):
        return torch_dispatch(op_call, args, kwargs)
    lay = _group_layout(_layout(x, adopt=(w, b)), int(C), int(G))
    mesh, vec = lay.mesh, lay.vec()
    xl = _local(x, mesh, lay.placements)
    wl, bl = _local(w, mesh, vec), _local(b, mesh, vec)
    n, c = xl.shape[0], xl.shape[1]
    g = G * c // C if C else G
    hxw = math.prod(xl.shape[2:])
    if not lay.spatial:
        out, mean, rstd = aten.native_group_norm(xl, wl, bl, n, c, hxw, g, eps)
    else:  # statistics span the spatial shards: all-reduce their partial sums
        count = (C // G) * int(HxW)
        xg = _grouped(_acc(xl), g)
        mean = _all_reduce(xg.sum(-1), mesh, lay.spatial) / count
        var = _all_reduce((xg - mean[..., None]).square().sum(-1), mesh, lay.spatial) / count
        rstd = torch.rsqrt(var + eps)
        y = ((xg - mean[..., None]) * rstd[..., None]).reshape(xl.shape)
        if wl is not None:
            y = y * _bcast(_acc(wl), xl.ndim)
        if bl is not None:
            y = y + _bcast(_acc(bl), xl.ndim)
        out, mean, rstd = y.to(xl.dtype), mean.to(xl.dtype), rstd.to(xl.dtype)
    spl = _stat_placements(lay)
    return (_wrap_like(out, x, lay),
            _wrap(mean, mesh, spl, (x.shape[0], G)), _wrap(rstd, mesh, spl, (x.shape[0], G)))


@handler(aten.native_group_norm_backward.default, family="norm", multi_shard=None,
         summary="group_norm backward for every placement (torch 2.13 has none): batch/aligned-channel "
                 "shards local, spatial shards one all-reduce of 2*N*G floats; dw, db Partial(sum)")
def group_norm_backward(op_call, args, kwargs):
    go, x, mean, rstd, w, N, C, HxW, G, mask = args
    if (kwargs or not isinstance(x, DTensor) or not isinstance(go, DTensor) or x.ndim < 2
            or not _all_dtensors((mean, rstd, w))):
        return torch_dispatch(op_call, args, kwargs)
    lay = _group_layout(_layout(x, adopt=(w,)), int(C), int(G))
    mesh, vec, spl = lay.mesh, lay.vec(), _stat_placements(lay)
    xl, gol = _local(x, mesh, lay.placements), _local(go, mesh, lay.placements)
    ml, rl, wl = _local(mean, mesh, spl), _local(rstd, mesh, spl), _local(w, mesh, vec)
    n, c = xl.shape[0], xl.shape[1]
    g = G * c // C if C else G
    hxw = math.prod(xl.shape[2:])
    nd = xl.ndim
    if not lay.spatial:
        gi, gw, gb = aten.native_group_norm_backward(gol, xl, ml, rl, wl, n, c, hxw, g, mask)
    else:
        count = (C // G) * int(HxW)
        xa, ga, ma, ra = _acc(xl), _acc(gol), _acc(ml), _acc(rl)
        xhat = ((_grouped(xa, g) - ma[..., None]) * ra[..., None]).reshape(xl.shape)
        dyw = ga * _bcast(_acc(wl), nd) if wl is not None else ga
        sums = torch.stack([_grouped(dyw, g).sum(-1), _grouped(dyw * xhat, g).sum(-1)])  # [2, n, g]
        sums = _all_reduce(sums, mesh, lay.spatial)
        gi = (_grouped(dyw, g) - sums[0][..., None] / count
              - _grouped(xhat, g) * sums[1][..., None] / count) * ra[..., None]
        gi = gi.reshape(xl.shape).to(xl.dtype)
        dims = [0] + list(range(2, nd))
        gw = (ga * xhat).sum(dims) if mask[1] else None
        gb = ga.sum(dims) if mask[2] else None
    # dw, db sum over N and S: partial over the mesh dims that split those, sharded like the channels.
    red = lay.reduce
    grad_pl = tuple(Partial("sum") if i in red else p for i, p in enumerate(vec))
    wdtype = w.dtype if w is not None else x.dtype
    return (_wrap_like(gi, x, lay) if mask[0] else None,
            _wrap(gw.to(wdtype), mesh, grad_pl, (C,)) if mask[1] and gw is not None else None,
            _wrap(gb.to(wdtype), mesh, grad_pl, (C,)) if mask[2] and gb is not None else None)


@handler(aten.unsqueeze_.default, family="norm", multi_shard=None,
         summary="in-place unsqueeze_ on DTensors (torch has no rule: group_norm's backward through its "
                 "mean/rstd outputs raised on every placement); local, no bytes")
def unsqueeze_inplace(op_call, args, kwargs):
    """``x.unsqueeze_(d)``: the local shard gets the new size-1 dim, a Shard past ``d`` moves up one dim.

    Autograd's backward of ``native_group_norm`` when its ``mean``/``rstd`` outputs get gradients too
    (``infinitely_differentiable_native_group_norm_backward``, C++) calls ``unsqueeze_`` on DTensors, for
    which torch 2.13 has no rule. Giving it ``unsqueeze``'s rule is not enough: DTensor's in-place path
    returns the tensor unchanged when the placements are (a Replicate input), leaving the wrapper's shape
    behind its local tensor's. So the spec and the wrapper's metadata are updated here.
    """
    from workbench.compat import return_and_correct_aliasing

    x, dim = args[0], args[1]
    if kwargs or not isinstance(x, DTensor) or any(
            type(p) is not Shard and not isinstance(p, (Replicate, Partial)) for p in x.placements):
        return torch_dispatch(op_call, args, kwargs)
    d = dim % (x.ndim + 1)
    pls = tuple(Shard(p.dim + 1) if type(p) is Shard and p.dim % x.ndim >= d else p for p in x.placements)
    shape = torch.Size(list(x.shape[:d]) + [1] + list(x.shape[d:]))
    stride = torch.empty_strided(x.shape, x.stride(), device="meta").unsqueeze(d).stride()
    x._local_tensor.unsqueeze_(d)
    x._spec = DTensorSpec(x.device_mesh, pls, tensor_meta=TensorMeta(shape, stride, x.dtype))
    return return_and_correct_aliasing(op_call, args, kwargs or {}, x)


# --------------------------------------------------------------------------------------------------
# layer_norm / rms_norm with the NORMALISED dims sharded (torch's rules cover the row shardings)
# --------------------------------------------------------------------------------------------------
# x : [*rows, *D] with D the normalised dims. Torch keeps a row sharding local; a shard of D (a
# column-parallel output fed to a norm) makes torch all-gather x. Each row's statistics are two sums
# over D, so all-reducing 2 numbers per row replaces gathering the row's D values.


@dataclass(frozen=True)
class _RowLayout:
    mesh: Any
    placements: tuple  # x's placements to run in
    axis: int  # first normalised dim
    rows: tuple[int, ...]  # mesh dims sharding a row dim
    norm: tuple[int, ...]  # mesh dims sharding a normalised dim

    def param(self) -> tuple:
        """Placements of weight/bias ``[*D]``: split like x's normalised dims."""
        return tuple(Shard(p.dim - self.axis) if i in self.norm else Replicate()
                     for i, p in enumerate(self.placements))

    def stats(self) -> tuple:
        """Placements of mean/rstd ``[*rows, 1, ...]``: split like x's rows."""
        return tuple(p if i in self.rows else Replicate() for i, p in enumerate(self.placements))


def _row_layout(x: Any, k: int) -> _RowLayout | None:
    """None unless a normalised dim of ``x`` is sharded (then torch's rule would gather x)."""
    if not isinstance(x, DTensor):
        return None
    axis = x.ndim - k
    rows, norm, pls = [], [], []
    for i, p in enumerate(x.placements):
        if type(p) is Shard:
            d = p.dim % x.ndim
            (norm if d >= axis else rows).append(i)
            pls.append(Shard(d))
        else:
            pls.append(Replicate())
    if not norm:
        return None
    return _RowLayout(x.device_mesh, tuple(pls), axis, tuple(rows), tuple(norm))


def _row_forward(x, k, w, b, eps, centred):
    lay = _row_layout(x, k)
    if lay is None or not _all_dtensors((w, b)):
        return None
    mesh, nd = lay.mesh, list(range(lay.axis, x.ndim))
    count = math.prod(x.shape[lay.axis:])
    xl = _local(x, mesh, lay.placements)
    xa = _acc(xl)
    if centred:
        mean = _all_reduce(xa.sum(nd, keepdim=True), mesh, lay.norm) / count
        xa = xa - mean
    rstd = torch.rsqrt(_all_reduce(xa.square().sum(nd, keepdim=True), mesh, lay.norm) / count + eps)
    y = xa * rstd
    if w is not None:
        y = y * _acc(_local(w, mesh, lay.param()))
    if b is not None:
        y = y + _acc(_local(b, mesh, lay.param()))
    stat_shape = tuple(x.shape[:lay.axis]) + (1,) * k
    out = _wrap(y.to(xl.dtype), mesh, lay.placements, x.shape, x.stride())
    stat = lambda t, dtype: _wrap(t.to(dtype), mesh, lay.stats(), stat_shape)  # noqa: E731
    return out, (stat(mean, xl.dtype) if centred else None), stat(rstd, xl.dtype if centred else rstd.dtype)


def _row_backward(go, x, k, mean, rstd, w, mask, centred):
    lay = _row_layout(x, k)
    if lay is None or not isinstance(go, DTensor) or not _all_dtensors((mean, rstd, w)):
        return None
    mesh, nd = lay.mesh, list(range(lay.axis, x.ndim))
    count = math.prod(x.shape[lay.axis:])
    xa, ga = _acc(_local(x, mesh, lay.placements)), _acc(_local(go, mesh, lay.placements))
    ra = _acc(_local(rstd, mesh, lay.stats()))
    xhat = (xa - _acc(_local(mean, mesh, lay.stats()))) * ra if centred else xa * ra
    wl = _acc(_local(w, mesh, lay.param())) if w is not None else None
    dyw = ga * wl if wl is not None else ga
    sums = _all_reduce(torch.stack([dyw.sum(nd, keepdim=True), (dyw * xhat).sum(nd, keepdim=True)]),
                       mesh, lay.norm)
    gi = dyw - xhat * sums[1] / count
    if centred:
        gi = gi - sums[0] / count
    gi = _wrap((gi * ra).to(x.dtype), mesh, lay.placements, x.shape, x.stride()) if mask[0] else None
    # dw, db sum over rows: sharded like the weight, partial over the mesh dims that split rows
    grad_pl = tuple(Partial("sum") if i in lay.rows else p for i, p in enumerate(lay.param()))
    rows = list(range(lay.axis))
    # With every dim normalised there are no rows to sum over, and ``sum([])`` would sum over ALL dims
    # (a 0-d shard of a [*D] gradient, which full_tensor() and optimizers then refuse): keep it as is.
    over_rows = (lambda t: t.sum(rows)) if rows else (lambda t: t)  # noqa: E731
    wdtype = w.dtype if w is not None else x.dtype
    dshape = tuple(x.shape[lay.axis:])
    gw = _wrap(over_rows(ga * xhat).to(wdtype), mesh, grad_pl, dshape) if w is not None and mask[1] else None
    gb = _wrap(over_rows(ga).to(wdtype), mesh, grad_pl, dshape) if centred and len(mask) > 2 and mask[2] else None
    return gi, gw, gb


@handler(aten.native_layer_norm.default, family="norm", multi_shard=None,
         summary="normalised dim sharded: all-reduce 2 floats per row instead of all-gathering x; "
                 "row shardings stay torch's (already local)")
def layer_norm_forward(op_call, args, kwargs):
    x, shape, w, b, eps = args
    out = None if kwargs else _row_forward(x, len(shape), w, b, float(eps), centred=True)
    return torch_dispatch(op_call, args, kwargs) if out is None else out


@handler(aten.native_layer_norm_backward.default, family="norm", multi_shard=None,
         summary="normalised dim sharded: one all-reduce of 2 floats per row; dw, db Partial over rows")
def layer_norm_backward(op_call, args, kwargs):
    go, x, shape, mean, rstd, w, b, mask = args
    out = None if kwargs else _row_backward(go, x, len(shape), mean, rstd, w, mask, centred=True)
    return torch_dispatch(op_call, args, kwargs) if out is None else out


@handler(aten._fused_rms_norm.default, family="norm", multi_shard=None,
         summary="normalised dim sharded: all-reduce 1 float per row (sum of squares) instead of "
                 "all-gathering x")
def rms_norm_forward(op_call, args, kwargs):
    x, shape, w = args[:3]
    eps = args[3] if len(args) > 3 else None
    if eps is None and isinstance(x, DTensor):
        eps = torch.finfo(_acc(torch.empty(0, dtype=x.dtype)).dtype).eps
    out = None if kwargs else _row_forward(x, len(shape), w, None, float(eps or 0.0), centred=False)
    return torch_dispatch(op_call, args, kwargs) if out is None else (out[0], out[2])


@handler(aten._fused_rms_norm_backward.default, family="norm", multi_shard=None,
         summary="normalised dim sharded: one all-reduce of 2 floats per row; dw Partial over rows")
def rms_norm_backward(op_call, args, kwargs):
    go, x, shape, rstd, w, mask = args
    out = None if kwargs else _row_backward(go, x, len(shape), None, rstd, w, mask, centred=False)
    return torch_dispatch(op_call, args, kwargs) if out is None else out[:2]


# --------------------------------------------------------------------------------------------------
# Conformance cases: every norm through its public API, forward and backward, against dense
# --------------------------------------------------------------------------------------------------
# Shapes are uneven on purpose: N=6 splits 3/3 over 2 ranks and 2/1 under [S(0), S(0)] on 2x2; H=5 splits
# 3/2. C=4 with 2 groups: [S(1), S(1)] on 2x2 (4 shards of one channel) does not hold whole groups, so
# group_norm falls back to the largest aligned mesh dim.

_X = (6, 4, 5, 3)
_X_IN = (8, 4, 5, 3)  # torch's view rule mis-sizes an UNEVEN [S(0), S(0)] flatten to [1, N*C, ...]
_TOL = dict(atol=1e-4, rtol=1e-4)


def _bn_inputs(gen: torch.Generator, shape=_X) -> list:
    c = shape[1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    w = torch.rand(c, generator=gen) + 0.5
    b = torch.randn(c, generator=gen)
    rm = torch.randn(c, generator=gen) * 0.1
    rv = torch.rand(c, generator=gen) + 0.5
    return [x, w, b, rm, rv]


def _bn_train(x, w, b, rm, rv):
    rm, rv = rm.clone(), rv.clone()  # buffers are updated in place: return them as outputs
    return F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5), rm, rv


def _bn_eval(x, w, b, rm, rv):
    return F.batch_norm(x, rm, rv, w, b, training=False, eps=1e-5)


def _bn_no_stats(x, w, b, rm, rv):  # SyncBatchNorm's math: batch statistics of the global batch
    return F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)


def _bn_legit(x, w, b, rm, rv):  # the op torch.export / compile lower nn.BatchNorm to
    rm, rv = rm.clone(), rv.clone()
    return aten._native_batch_norm_legit(x, w, b, rm, rv, True, 0.1, 1e-5)[0], rm, rv


def _bn_legit_functional(x, w, b, rm, rv):
    out, _, _, new_rm, new_rv = aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
    return out, new_rm, new_rv


def _bn_with_update(x, w, b, rm, rv):
    rm, rv = rm.clone(), rv.clone()
    return aten._batch_norm_with_update(x, w, b, rm, rv, 0.1, 1e-5)[0], rm, rv


def _bn_module(x, w, b, rm, rv):
    """``nn.BatchNorm2d`` as a model uses it (cumulative-average momentum, buffer counter), on the
    tensors given: over a batch-sharded DTensor this IS SyncBatchNorm."""
    from torch.func import functional_call

    bn = torch.nn.BatchNorm2d(x.shape[1], momentum=None, eps=1e-5)
    rm, rv = rm.clone(), rv.clone()
    state = {"weight": w, "bias": b, "running_mean": rm, "running_var": rv,
             "num_batches_tracked": torch.tensor(3)}
    return functional_call(bn, state, (x,)), rm, rv


def _in_stats(x, w, b, rm, rv):
    return F.instance_norm(x, weight=w, bias=b, eps=1e-5)


def _in_running(x, w, b, rm, rv):
    rm, rv = rm.clone(), rv.clone()
    return F.instance_norm(x, rm, rv, w, b, use_input_stats=True, momentum=0.1, eps=1e-5), rm, rv


_BN_FWD_OPS = (aten.native_batch_norm.default,)
_BN_OPS = _BN_FWD_OPS + (aten.native_batch_norm_backward.default,)
_GN_OPS = (aten.native_group_norm.default, aten.native_group_norm_backward.default)

for _name, _fn, _ops in [
    ("batch_norm/train", _bn_train, _BN_OPS),
    ("batch_norm/eval", _bn_eval, _BN_OPS),
    ("batch_norm/no_running_stats", _bn_no_stats, _BN_OPS),
    ("sync_batch_norm/nn_batchnorm2d", _bn_module, _BN_OPS),
    ("sync_batch_norm/native_batch_norm_legit", _bn_legit,
     (aten._native_batch_norm_legit.default, aten.native_batch_norm_backward.default)),
    ("sync_batch_norm/native_batch_norm_legit_functional", _bn_legit_functional,
     (aten._native_batch_norm_legit_functional.default, aten.native_batch_norm_backward.default)),
    ("sync_batch_norm/batch_norm_with_update", _bn_with_update,
     (aten._batch_norm_with_update.default, aten.batch_norm_backward.default)),
    ("instance_norm/input_stats", _in_stats, _BN_OPS),
    ("instance_norm/running_stats", _in_running, _BN_OPS),
]:
    _make = (lambda gen: _bn_inputs(gen, _X_IN)) if _name.startswith("instance") else _bn_inputs
    case(Case(name=f"norm/{_name}", family="norm", ops=_ops, make_inputs=_make, fn=_fn,
              shardable=(0,), requires_grad=(0, 1, 2), **_TOL))

case(Case(name="norm/batch_norm/1d_no_affine", family="norm", ops=_BN_OPS,
          make_inputs=lambda gen: _bn_inputs(gen, (6, 4, 7)),
          fn=lambda x, w, b, rm, rv: F.batch_norm(x, None, None, training=True), requires_grad=(0,), **_TOL))
case(Case(name="norm/batch_norm/sharded_weight", family="norm", ops=_BN_OPS, make_inputs=_bn_inputs,
          fn=_bn_train, shardable=(0, 1), requires_grad=(0, 1, 2),
          placements=lambda t: [Replicate(), Shard(0), Shard(1)] if t.ndim > 1 else [Replicate(), Shard(0)],
          **_TOL))


def _gn_inputs(gen: torch.Generator) -> list:
    x = torch.randn(_X, generator=gen) * 2 + 0.5
    return [x, torch.rand(_X[1], generator=gen) + 0.5, torch.randn(_X[1], generator=gen)]


for _groups in (1, 2, 4):
    case(Case(name=f"norm/group_norm/groups={_groups}", family="norm", ops=_GN_OPS, make_inputs=_gn_inputs,
              fn=lambda x, w, b, _g=_groups: F.group_norm(x, _g, w, b, eps=1e-5),
              shardable=(0,), requires_grad=(0, 1, 2), **_TOL))
case(Case(name="norm/group_norm/no_affine", family="norm", ops=_GN_OPS, make_inputs=_gn_inputs,
          fn=lambda x, w, b: F.group_norm(x, 2, eps=1e-5), requires_grad=(0,), **_TOL))

# layer_norm / rms_norm: torch's rules keep row shardings local (no bytes): those stay torch's. Ours
# take over when a normalised dim is sharded.
_LN_X = (4, 6, 8)


def _ln_inputs(gen: torch.Generator) -> list:
    return [torch.randn(_LN_X, generator=gen), torch.rand(_LN_X[-1], generator=gen) + 0.5,
            torch.randn(_LN_X[-1], generator=gen)]


case(Case(name="norm/layer_norm/last_dim", family="norm",
          ops=(aten.native_layer_norm.default, aten.native_layer_norm_backward.default),
          make_inputs=_ln_inputs, fn=lambda x, w, b: F.layer_norm(x, (_LN_X[-1],), w, b),
          requires_grad=(0, 1, 2), **_TOL))
case(Case(name="norm/layer_norm/last_two_dims", family="norm",
          ops=(aten.native_layer_norm.default, aten.native_layer_norm_backward.default),
          make_inputs=lambda gen: [torch.randn(_LN_X, generator=gen)],
          fn=lambda x: F.layer_norm(x, _LN_X[1:]), requires_grad=(0,), **_TOL))
# Every dim normalised (no rows): the weight and bias gradients are [*D] with nothing to sum over; the
# old rule summed over an empty dim list, i.e. over everything, and returned 0-d shards (issue 29 row 8).
_LN_ALL = (4, 6, 5)
case(Case(name="norm/layer_norm/all_dims", family="norm",
          ops=(aten.native_layer_norm.default, aten.native_layer_norm_backward.default),
          make_inputs=lambda gen: [torch.randn(_LN_ALL, generator=gen), torch.rand(_LN_ALL, generator=gen) + 0.5,
                                   torch.randn(_LN_ALL, generator=gen)],
          fn=lambda x, w, b: F.layer_norm(x, _LN_ALL, w, b), requires_grad=(0, 1, 2), **_TOL))
case(Case(name="norm/rms_norm/last_dim", family="norm",  # reaches _fused_rms_norm on GPU; decomposes on CPU
          ops=(aten._fused_rms_norm.default, aten._fused_rms_norm_backward.default),
          make_inputs=lambda gen: _ln_inputs(gen)[:2], fn=lambda x, w: F.rms_norm(x, (_LN_X[-1],), w, eps=1e-6),
          requires_grad=(0, 1), **_TOL))
