"""``index_put``: ``self[indices] = values`` (or ``+=``) as a functional custom op, duplicates made
deterministic.

Every call is brought to one core case. The indexed dims of ``self`` go first (a permutation when they
are not), the K broadcast index tuples become row ids, everything else is a row of D elements::

    self  (s0, s1 | t0, t1)  ->  (R, D)     R = s0*s1,  D = t0*t1
    row[k] = i0[k]*s1 + i1[k]              i < 0 wraps to i + size; i outside [-size, size) raises
    values -> (K, D)                        broadcast like torch (stride 0, never materialised)

Then, with ``r = row[k]``::

    accumulate, deterministic=True    out[r] = self[r] + sum_k vals[k]   one fp32 sum per row, taken in
                                                                         stable-sorted k order, rounded once
    accumulate, deterministic=False   out[r] = self[r] + vals[k], ...    fp32 atomics (order varies)
    overwrite                         out[r] = vals[max k with row[k] = r]   the last writer wins

The deterministic mode gives the same bits on every run, on both backends (the torch reference sums in
the same order, see ``_reference``). The overwrite mode is deterministic too, unlike torch's CUDA
``index_put_`` with duplicates. Backward::

    d values[k] = d out[row[k]]      (overwrite: only the winning k; the losers get 0), summed over the
                                      dims where values were broadcast
    d self      = d out              (accumulate)   or   d out with the written rows zeroed (overwrite)

Index patterns: any mix of None and integer index tensors (torch's rules: adjacent index tensors keep
their place in the result, separated ones move to the front); boolean masks become integer indices
(``nonzero``) in :func:`index_put`. Layouts where the indexed dims do not lead cost a permuted copy of
``self`` in and out.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch

from workbench.kernels import backend
from workbench.kernels.cases import KernelCase, register

_INT = (torch.int64, torch.int32)


def index_put(self: torch.Tensor, indices, values, accumulate: bool = False, *,
              deterministic: bool = True) -> torch.Tensor:
    """A new tensor equal to ``self`` with ``self[indices] = values`` (``+=`` when ``accumulate``).

    ``indices``: a tuple of index tensors (int64/int32), ``None`` (the whole dim), or boolean masks (each
    covering as many dims as it has). ``values``: a tensor or a Python number, broadcast to
    ``self[indices].shape``. ``deterministic`` (accumulate only): sort + fixed-order sums (bit
    reproducible) or atomics (faster, order varies). Without accumulate the last writer of a duplicated
    index wins, always. An index out of range raises ``IndexError`` on every backend.
    """
    if not isinstance(self, torch.Tensor):
        raise TypeError(f"index_put: self must be a tensor, got {type(self).__name__}")
    idx = _normalize(self, indices)
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=self.dtype, device=self.device)
    elif values.ndim == 0 and values.device != self.device:
        values = values.to(self.device)
    return torch.ops.workbench.index_put(self, idx, values, bool(accumulate), bool(deterministic))


def _normalize(self: torch.Tensor, indices) -> list[torch.Tensor | None]:
    """Torch's index tuple as a list of None / integer tensors on self's device (masks -> nonzero)."""
    if indices is None or isinstance(indices, torch.Tensor):
        indices = (indices,)
    if not isinstance(indices, (tuple, list)):
        raise TypeError(f"index_put: indices must be a tuple of index tensors or None, got {type(indices).__name__}")
    out: list[torch.Tensor | None] = []
    for i in indices:
        if i is not None and not isinstance(i, torch.Tensor):
            i = torch.as_tensor(i)
        if i is None or i.dtype in _INT:
            out.append(i if i is None else i.to(self.device))
            continue
        if i.dtype not in (torch.bool, torch.uint8):
            raise IndexError(f"tensors used as indices must be long, int, byte or bool tensors, got {i.dtype}")
        if i.ndim == 0:
            raise IndexError("index_put: a 0-dim boolean index is not supported; index with a mask over dims")
        dim = len(out)
        for j, n in enumerate(i.shape):
            if dim + j >= self.ndim or self.shape[dim + j] != n:
                raise IndexError(f"The shape of the mask {list(i.shape)} at index {j} does not match the shape "
                                 f"of the indexed tensor {list(self.shape)} at index {dim + j}")
        out.extend(i.to(self.device).nonzero().unbind(1))
    return out


# ---------------------------------------------------------------------------------------------------
# the core case: layout, row ids, values as (K, D)
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Core:
    dims: tuple[int, ...]       # indexed dims of self, in order
    perm: tuple[int, ...]       # self.permute(perm) = (indexed dims, the rest)
    bshape: tuple[int, ...]     # broadcast shape of the index tensors: K = prod(bshape)
    rest: tuple[int, ...]       # sizes of the other dims: D = prod(rest)
    result: tuple[int, ...]     # torch's shape of self[indices]
    vperm: tuple[int, ...]      # result.permute(vperm) = (bshape, rest)

    @property
    def k(self) -> int:
        return math.prod(self.bshape)

    @property
    def d(self) -> int:
        return math.prod(self.rest)


def _core(shape, indices) -> _Core:
    n = len(shape)
    if len(indices) > n:
        raise IndexError(f"too many indices for tensor of dimension {n} (got {len(indices)})")
    dims = tuple(j for j, i in enumerate(indices) if i is not None)
    if not dims:
        raise IndexError("index_put needs at least one index tensor; for a whole-tensor write use copy_ or where")
    try:
        bshape = tuple(torch.broadcast_shapes(*(indices[j].shape for j in dims)))
    except RuntimeError:
        shapes = ", ".join(str(list(indices[j].shape)) for j in dims)
        raise IndexError("shape mismatch: indexing tensors could not be broadcast together with shapes "
                         f"{shapes}") from None
    others = tuple(j for j in range(n) if j not in dims)
    rest = tuple(shape[j] for j in others)
    nb = len(bshape)
    if dims == tuple(range(dims[0], dims[-1] + 1)):   # adjacent: the index result stays in place
        p0 = dims[0]
        result = tuple(shape[:p0]) + bshape + tuple(shape[dims[-1] + 1:])
        vperm = tuple(range(p0, p0 + nb)) + tuple(range(p0)) + tuple(range(p0 + nb, len(result)))
    else:                                             # separated: the index result moves to the front
        result = bshape + rest
        vperm = tuple(range(len(result)))
    return _Core(dims, dims + others, bshape, rest, result, vperm)


def _row_ids(shape, indices, core: _Core) -> torch.Tensor:
    """(K,) row ids into ``(R, D)``: negatives wrapped, out of range raised (one host sync for all)."""
    ts = [indices[j] for j in core.dims]
    for t in ts:
        if t.dtype not in _INT:
            raise IndexError(f"workbench::index_put takes int64/int32 index tensors, got {t.dtype}; "
                             "call workbench.kernels.index_put.index_put for boolean masks")
    sizes = [shape[j] for j in core.dims]
    if core.k and any(t.numel() for t in ts):
        ext = torch.stack([torch.stack(t.aminmax()).to(torch.int64) for t in ts if t.numel()]).tolist()
        for (lo, hi), j, n in zip(ext, [j for j, t in zip(core.dims, ts) if t.numel()], sizes):
            if lo < -n or hi >= n:
                raise IndexError(f"index {lo if lo < -n else hi} is out of bounds for dimension {j} with size {n}")
    rows, stride = None, 1
    for t, n in zip(reversed(ts), reversed(sizes)):
        t = t.to(torch.int64)
        term = torch.where(t < 0, t + n, t) * stride
        rows = term if rows is None else rows + term
        stride *= n
    rows = rows.expand(core.bshape).reshape(core.k).contiguous()
    # int32 row ids where they fit: half the bytes to sort and read.
    return rows.to(torch.int32) if stride < 2**31 else rows


def _values_2d(values: torch.Tensor, core: _Core) -> torch.Tensor:
    try:
        v = values.expand(core.result)
    except RuntimeError:
        raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                           f"indexing result of shape {list(core.result)}") from None
    return v.permute(core.vperm).reshape(core.k, core.d)


def _check(self: torch.Tensor, indices, values: torch.Tensor) -> None:
    if values.dtype != self.dtype:
        raise TypeError(f"index_put: values are {values.dtype} but self is {self.dtype}; cast with "
                        "values.to(self.dtype)")
    for t in [values] + [i for i in indices if i is not None]:
        if t.device != self.device:
            raise ValueError(f"index_put: self is on {self.device} but an index or values tensor is on "
                             f"{t.device}; move them to {self.device}")


def _inverse(perm) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _impl(device: torch.device):
    if backend.choose(device) == "triton":
        return importlib.import_module("workbench.kernels.triton_index_put")
    return _reference


# ---------------------------------------------------------------------------------------------------
# the torch reference (plain torch ops, any device): same contract as triton_index_put
# ---------------------------------------------------------------------------------------------------
class _reference:
    @staticmethod
    def accumulate_sorted(out, rows, vals):
        """Each row's sum in stable-sorted order, left to right in fp32: the Triton kernel's order."""
        k = rows.numel()
        srt, order = torch.sort(rows, stable=True)
        start = torch.ones(k, dtype=torch.bool, device=rows.device)
        start[1:] = srt[1:] != srt[:-1]
        starts = start.nonzero().squeeze(1)
        lens = torch.diff(starts, append=starts.new_tensor([k]))
        acc = torch.zeros((starts.numel(), vals.shape[1]), dtype=torch.float32, device=out.device)
        seg, r = torch.arange(starts.numel(), device=rows.device), 0
        while seg.numel():   # step r adds the r-th value of every segment that has one
            acc[seg] += vals[order[starts[seg] + r]].to(torch.float32)
            r += 1
            seg = seg[lens[seg] > r]
        dst = srt[starts].to(torch.int64)
        out[dst] = (out[dst].to(torch.float32) + acc).to(out.dtype)

    @staticmethod
    def accumulate_atomic(out, rows, vals):
        ws = out if out.dtype == torch.float32 else out.to(torch.float32)
        ws.index_add_(0, rows, vals.to(torch.float32))
        if ws is not out:
            out.copy_(ws)

    @staticmethod
    def last_writers(rows, num_rows):
        win = torch.full((num_rows,), -1, dtype=torch.int64, device=rows.device)
        k = torch.arange(rows.numel(), device=rows.device)
        return win.scatter_reduce_(0, rows.to(torch.int64), k, "amax")  # max is order-free: deterministic

    @staticmethod
    def won(rows, num_rows):
        """(K,) bool: k is the last writer of its row."""
        k = torch.arange(rows.numel(), device=rows.device)
        return _reference.last_writers(rows, num_rows)[rows.to(torch.int64)] == k

    @staticmethod
    def overwrite(out, rows, vals):
        won = _reference.won(rows, out.shape[0])
        out[rows[won].to(torch.int64)] = vals[won]

    @staticmethod
    def gather_rows(src, rows, last_writer):
        g = src[rows.to(torch.int64)]
        if last_writer:
            g.masked_fill_(~_reference.won(rows, src.shape[0])[:, None], 0)
        return g


# ---------------------------------------------------------------------------------------------------
# the custom ops
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::index_put", mutates_args=())
def _index_put_op(self: torch.Tensor, indices: list[torch.Tensor | None], values: torch.Tensor,
                  accumulate: bool = False, deterministic: bool = True) -> torch.Tensor:
    _check(self, indices, values)
    core = _core(self.shape, indices)
    rows = _row_ids(self.shape, indices, core)
    vals = _values_2d(values, core)
    identity = core.perm == tuple(range(self.ndim))
    out = (self if identity else self.permute(core.perm)).clone(memory_format=torch.contiguous_format)
    impl = _impl(self.device)
    out2d = out.view(-1, core.d) if core.d else out.view(math.prod(out.shape[:len(core.dims)]), 0)
    if core.k and core.d:
        if not accumulate:
            impl.overwrite(out2d, rows, vals)
        elif deterministic:
            impl.accumulate_sorted(out2d, rows, vals)
        else:
            impl.accumulate_atomic(out2d, rows, vals)
    return out if identity else out.permute(_inverse(core.perm)).contiguous()


@_index_put_op.register_fake
def _(self, indices, values, accumulate=False, deterministic=True):
    return torch.empty_like(self, memory_format=torch.contiguous_format)


@torch.library.custom_op("workbench::index_put_backward", mutates_args=())
def _index_put_backward_op(grad: torch.Tensor, indices: list[torch.Tensor | None], values_shape: list[int],
                           accumulate: bool) -> torch.Tensor:
    """The values' gradient: grad's rows at the indices (overwrite: the winning writer's only), summed
    over the dims where values were broadcast."""
    core = _core(grad.shape, indices)
    rows = _row_ids(grad.shape, indices, core)
    identity = core.perm == tuple(range(grad.ndim))
    g2d = (grad if identity else grad.permute(core.perm)).reshape(math.prod(grad.shape[j] for j in core.dims), core.d)
    gathered = _impl(grad.device).gather_rows(g2d, rows, not accumulate)
    g = gathered.view(core.bshape + core.rest).permute(_inverse(core.vperm))
    return g.sum_to_size(values_shape).contiguous()


@_index_put_backward_op.register_fake
def _(grad, indices, values_shape, accumulate):
    return grad.new_empty(values_shape)


def _setup_context(ctx, inputs, output):
    self_, indices, values, accumulate, _deterministic = inputs
    ctx.index_present = [i is not None for i in indices]
    ctx.save_for_backward(*[i for i in indices if i is not None])
    ctx.values_shape = list(values.shape)
    ctx.accumulate = accumulate


def _backward(ctx, grad):
    saved = iter(ctx.saved_tensors)
    indices = [next(saved) if present else None for present in ctx.index_present]
    grad_self = grad_values = None
    if ctx.needs_input_grad[0]:
        # overwrite: what was written came from values, so self's gradient there is 0.
        grad_self = grad if ctx.accumulate else torch.ops.workbench.index_put(
            grad, indices, grad.new_zeros(()), False, True)
    if ctx.needs_input_grad[2]:
        grad_values = torch.ops.workbench.index_put_backward(grad, indices, ctx.values_shape, ctx.accumulate)
    # one entry per input as the dispatcher passed them (a list for the index list; trailing defaults
    # may have been left off)
    needs = ctx.needs_input_grad
    index_grads = [None] * len(needs[1]) if isinstance(needs[1], (list, tuple)) else None
    return (grad_self, index_grads, grad_values) + (None,) * (len(needs) - 3)


_index_put_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------
# kernel cases: size = K, the number of indices (1-D: K into K elements; rows: K into K x 128)
# ---------------------------------------------------------------------------------------------------
_WIDTH = 128
_MODES = {"accumulate-deterministic": (True, True), "accumulate-atomic": (True, False), "overwrite": (False, True)}


def _rand(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)


def _make(accumulate: bool, deterministic: bool, rows: bool, grad: bool = False):
    def make(size, dtype, device, gen):
        trail = (_WIDTH,) if rows else ()
        if accumulate:   # random rows: duplicates, as in an embedding gradient
            idx = torch.randint(0, size, (size,), generator=gen, device=gen.device)
        else:            # a permutation, so torch's own index_put_ (racy on duplicates) is comparable
            idx = torch.randperm(size, generator=gen, device=gen.device)
        inp = {"self": _rand(gen, (size,) + trail, dtype, device), "indices": (idx.to(device),),
               "values": _rand(gen, (size,) + trail, dtype, device),
               "accumulate": accumulate, "deterministic": deterministic}
        if grad:
            inp["self"].requires_grad_(True)
            inp["values"].requires_grad_(True)
            inp["grad"] = _rand(gen, (size,) + trail, dtype, device)
        return inp
    return make


def _run(inp):
    return index_put(inp["self"], inp["indices"], inp["values"], inp["accumulate"],
                     deterministic=inp["deterministic"])


def _eager(inp):
    # aten's schema takes None entries (x[:, i] patterns); Tensor.index_put_ does not
    return torch.ops.aten.index_put_(inp["self"].clone(), list(inp["indices"]), inp["values"], inp["accumulate"])


def _with_grad(fn):
    def run(inp):
        out = fn(inp)
        g_self, g_values = torch.autograd.grad(out, (inp["self"], inp["values"]), inp["grad"])
        return out.detach(), g_self, g_values
    return run


def _eager_grad(inp):
    return torch.ops.aten.index_put(inp["self"], list(inp["indices"]), inp["values"], inp["accumulate"])


def _bytes(inp) -> int:
    """Clone of self (read + write), the indices, the values, and the K rows written (read too when
    accumulating): the least a functional index_put moves."""
    s, e = inp["self"], inp["self"].element_size()
    idx = sum(i.numel() * i.element_size() for i in inp["indices"] if i is not None and i.dtype in _INT)
    k = max((i.numel() for i in inp["indices"] if i is not None), default=0)
    d = s.numel() // max(s.shape[0], 1)
    return 2 * s.numel() * e + idx + k * d * e * (3 if inp["accumulate"] else 2)


def _edges(accumulate: bool, deterministic: bool, rows: bool):
    def edges(dtype, device, gen):
        trail = (8,) if rows else ()
        r = lambda *shape: _rand(gen, shape, dtype, device)  # noqa: E731
        t = lambda *v: torch.tensor(v, device=device)  # noqa: E731
        case = lambda s, i, v: {"self": s, "indices": i, "values": v,  # noqa: E731
                                "accumulate": accumulate, "deterministic": deterministic}
        yield "empty-indices", case(r(16, *trail), (t(0)[:0],), r(0, *trail))
        yield "zero-element-self", case(r(0, *trail), (t(0)[:0],), r(0, *trail))
        yield "negative-indices", case(r(16, *trail), (t(-1, -16, 3, -5),), r(4, *trail))
        yield "int32-indices", case(r(16, *trail), (t(2, 7, 11).to(torch.int32),), r(3, *trail))
        yield "scalar-value", case(r(16, *trail), (t(1, 4, 9),), r())
        yield "non-contiguous", case(r(*trail, 16).t() if rows else r(32)[::2], (t(3, 0, 15),),
                                     r(*trail, 3).t() if rows else r(6)[::2])
        yield "mask-all-true", case(r(16, *trail), (torch.ones(16, dtype=torch.bool, device=device),), r(16, *trail))
        yield "mask-all-false", case(r(16, *trail), (torch.zeros(16, dtype=torch.bool, device=device),), r(*trail))
        if accumulate or device.type == "cpu":   # torch's own overwrite picks a winner at random on CUDA
            yield "duplicates", case(r(16, *trail), (t(5, 5, 5, 2, 5, 2),), r(6, *trail))
        if rows:
            yield "indexed-middle-dim", case(r(4, 16, 8), (None, t(3, -1, 0)), r(4, 3, 8))
            yield "separated-index-tensors", case(r(5, 4, 6), (t(1, 4), None, t(0, 5)), r(2, 4))
            yield "broadcast-index-tensors", case(r(5, 6, 8), (t(0, 2, 4)[:, None], t(1, 5)[None, :]), r(3, 2, 8))
    return edges


for _mode, (_acc, _det) in _MODES.items():
    for _shape, _rows_case in (("1d", False), ("rows", True)):
        register(KernelCase(
            op="index_put", variant=f"{_mode}-{_shape}", make=_make(_acc, _det, _rows_case), run=_run,
            bytes_moved=_bytes, torch_eager=_eager, exact=_det,
            tol={torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (5e-3, 5e-3)},
            check_sizes=(64, 257) if _rows_case else (1000, 4099),
            bench_sizes=(1 << 20,) if _rows_case else (1 << 20, 1 << 24),
            edge_cases=_edges(_acc, _det, _rows_case),
            note=(f"baseline self.clone().index_put_(idx, v, accumulate={_acc}); "
                  + ("index_add_ is the other torch way" if _acc else "torch races on duplicates, we do not"))))

for _mode, _acc in (("accumulate", True), ("overwrite", False)):
    register(KernelCase(
        op="index_put", variant=f"{_mode}-backward-rows", make=_make(_acc, True, True, grad=True),
        run=_with_grad(_run), bytes_moved=lambda inp: 2 * _bytes(inp), torch_eager=_with_grad(_eager_grad),
        backward=True, exact=True, check_sizes=(64,), bench_sizes=(1 << 20,),
        tol={torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-2, 2e-2), torch.float16: (5e-3, 5e-3)},
        note="baseline torch autograd of self.index_put(idx, v, accumulate)"))
