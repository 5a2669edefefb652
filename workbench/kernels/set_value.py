"""Slice and strided assignment as custom ops, safe on tensors above 2^31 elements.

``set_value(x, key, v)`` is ``y = x.clone(); y[key] = v`` and ``set_value_(x, key, v)`` is ``x[key] = v``,
for a key of python slices (one per leading dim, steps > 0) and v a number or a tensor broadcastable
to the region. The region of slices (s_d, e_d, k_d) holds the elements::

    x[s_0 + c_0 k_0, ..., s_{L-1} + c_{L-1} k_{L-1}, :, ...],    0 <= c_d < n_d = ceil((e_d - s_d) / k_d)

Gradients of the functional op (``y = x`` outside the region, ``v`` inside)::

    dL/dx = g with the region zeroed   (set_value of 0 into g)     dL/dv = g[region] summed to v's shape

The Triton kernel (``workbench.kernels.triton_set_value``) writes only the region, each element's
address computed in int64 from its region coordinates; the functional op first copies self. The
in-place op is for tensors too big to copy, and has no autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workbench.kernels import backend
from workbench.kernels.cases import KernelCase, register

ops = torch.ops.workbench


def _triton():
    from workbench.kernels import triton_set_value  # lazily: `import workbench.kernels` works without Triton

    return triton_set_value


def _region(x: Tensor, starts: list[int], ends: list[int], steps: list[int]) -> list[tuple[int, int, int]]:
    """(start, count, step) for every dim of x, bounds normalised like Python slicing; raises for bad keys."""
    if not len(starts) == len(ends) == len(steps):
        raise ValueError(f"set_value needs one start, end and step per sliced dim; got {len(starts)} starts, "
                         f"{len(ends)} ends and {len(steps)} steps")
    if len(starts) > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}: {len(starts)} slices")
    out = []
    for d, size in enumerate(x.shape):
        if d >= len(starts):
            out.append((0, size, 1))
            continue
        if steps[d] <= 0:
            raise ValueError(f"slice step must be positive, got {steps[d]} for dim {d}; "
                             "flip the tensor (torch.flip) for a reversed assignment")
        s, e, k = slice(starts[d], ends[d], steps[d]).indices(size)
        out.append((s, max(0, -(-(e - s) // k)), k))
    return out


def _check_value(x: Tensor, value: Tensor, region: list[tuple[int, int, int]]) -> None:
    shape = tuple(n for _, n, _ in region)
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"value of shape {tuple(value.shape)} does not broadcast to the region's shape {shape}")


def _key(region: list[tuple[int, int, int]], sliced: int) -> tuple[slice, ...]:
    return tuple(slice(s, s + n * k, k) for s, n, k in region[:sliced])


def _write(x: Tensor, value: Tensor, region: list[tuple[int, int, int]], sliced: int) -> None:
    """x[region] = value in place, on the chosen backend."""
    if backend.choose(x.device) == "triton":
        # a value of another dtype is cast by torch (its rounding; Triton's interpreter truncates)
        _triton().write_region(x, value.to(x.dtype), region)
    else:
        x[_key(region, sliced)] = value


# ---------------------------------------------------------------------------------------------------
# set_value (functional, differentiable)
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::set_value", mutates_args=())
def _set_value_op(self: Tensor, value: Tensor, starts: list[int], ends: list[int], steps: list[int]) -> Tensor:
    region = _region(self, starts, ends, steps)
    _check_value(self, value, region)
    out = self.clone(memory_format=torch.contiguous_format)
    _write(out, value.to(self.device), region, len(starts))
    return out


@_set_value_op.register_fake
def _(self, value, starts, ends, steps):
    _check_value(self, value, _region(self, starts, ends, steps))
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, value, starts, ends, steps = inputs
    ctx.key = (list(starts), list(ends), list(steps))
    ctx.value_shape = value.shape


def _backward(ctx, grad):
    starts, ends, steps = ctx.key
    g_self = g_value = None
    if ctx.needs_input_grad[0]:
        g_self = ops.set_value(grad, grad.new_zeros(()), starts, ends, steps)
    if ctx.needs_input_grad[1]:
        region = _region(grad, starts, ends, steps)
        g_value = grad[_key(region, len(starts))].sum_to_size(ctx.value_shape).contiguous()
    return g_self, g_value, None, None, None


_set_value_op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------------------------------------------
# set_value_ (in place, for tensors too big to copy; no autograd)
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::set_value_", mutates_args=("self",))
def _set_value_inplace_op(self: Tensor, value: Tensor, starts: list[int], ends: list[int],
                          steps: list[int]) -> None:
    region = _region(self, starts, ends, steps)
    _check_value(self, value, region)
    if any(st == 0 and n > 1 for st, n in zip(self.stride(), self.shape)):
        raise ValueError("set_value_ cannot write into a tensor whose elements share memory (an expand()ed "
                         "view); write into a copy (set_value, or .contiguous() first)")
    value = value.to(self.device)
    if value.numel() > 1 and value.untyped_storage().data_ptr() == self.untyped_storage().data_ptr():
        value = value.clone()  # x[a:b] = x[c:d]: read all of the value before writing any of it
    _write(self, value, region, len(starts))


@_set_value_inplace_op.register_fake
def _(self, value, starts, ends, steps):
    _check_value(self, value, _region(self, starts, ends, steps))


# ---------------------------------------------------------------------------------------------------
# python API: keys of slices, values of numbers or tensors
# ---------------------------------------------------------------------------------------------------
def _bound(b, n: int, default: int) -> int:
    """One slice bound as Python normalises it for a positive step: None -> default, negative counts
    from the end, then clamped to [0, n]."""
    if b is None:
        return default
    b = int(b)
    if b < 0:
        b += n
    return min(max(b, 0), n)


def _slice_bounds(k: slice, n: int) -> tuple[int, int, int]:
    """``k.indices(n)`` for a positive step, in plain arithmetic (torch 2.11's compiler cannot trace
    ``slice.indices``)."""
    return _bound(k.start, n, 0), _bound(k.stop, n, n), 1 if k.step is None else int(k.step)


def _parse(x: Tensor, key, value) -> tuple[Tensor, list[int], list[int], list[int]]:
    key = key if isinstance(key, tuple) else (key,)
    for k in key:
        if not isinstance(k, slice):
            raise TypeError(f"set_value takes a slice or a tuple of slices, got {type(k).__name__} ({k!r}); "
                            "write i:i+1 for index i")
    if len(key) > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}: {len(key)} slices")
    starts, ends, steps = [], [], []
    for d, k in enumerate(key):
        if k.step is not None and k.step <= 0:
            raise ValueError(f"slice step must be positive, got {k.step} for dim {d}; "
                             "flip the tensor (torch.flip) for a reversed assignment")
        s, e, st = _slice_bounds(k, int(x.shape[d]))
        starts.append(s)
        ends.append(e)
        steps.append(st)
    if isinstance(value, Tensor):
        value = value.to(x.device)
        n_region = len(x.shape)  # torch's setitem drops leading size-1 dims of a value with too many dims
        while value.dim() > n_region and value.shape[0] == 1:
            value = value.squeeze(0)
    else:
        value = torch.tensor(value, dtype=x.dtype, device=x.device)
    return value, starts, ends, steps


def set_value(self: Tensor, key, value) -> Tensor:
    """``y = self.clone(); y[key] = value`` (differentiable in self and value). key: a slice or a tuple of
    slices (steps > 0; None and negative bounds as in Python); value: a number or a tensor broadcastable
    to the region."""
    value, starts, ends, steps = _parse(self, key, value)
    return ops.set_value(self, value, starts, ends, steps)


def set_value_(self: Tensor, key, value) -> Tensor:
    """``self[key] = value`` in place, writing only the region (for tensors too big to copy); returns self.
    Not differentiable: refuses tensors that require grad while grad mode is on."""
    if torch.is_grad_enabled() and (self.requires_grad or (isinstance(value, Tensor) and value.requires_grad)):
        which = "self" if self.requires_grad else "value"
        raise RuntimeError(f"set_value_ is not differentiable and {which} requires grad; use set_value "
                           "(functional), or call it under torch.no_grad()")
    value, starts, ends, steps = _parse(self, key, value)
    ops.set_value_(self, value, starts, ends, steps)
    return self


# ---------------------------------------------------------------------------------------------------
# kernel cases (workbench kernels check|bench); size = elements of self
# ---------------------------------------------------------------------------------------------------
_COLS = 1024


def _shape(size: int) -> tuple[int, int]:
    cols = _COLS if size >= 8 * _COLS else 64
    return (max(size // cols, 1), cols)


def _gen(device, gen: torch.Generator) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen`` (inputs are drawn where they live)."""
    if torch.device(gen.device).type == torch.device(device).type:
        return gen
    return torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))


def _inputs(shape, key, dtype, device, gen, value="region", base=None) -> dict:
    """x of ``shape`` (or ``base`` viewed as it), and a value: the region's shape, "row" (one row
    broadcast over the region's rows) or "scalar" (0-dim)."""
    g = _gen(device, gen)
    x = torch.randn(shape, dtype=dtype, device=device, generator=g) if base is None else base
    region = tuple(x[key].shape)
    value_shape = {"region": region, "row": (1, *region[1:]), "scalar": ()}[value]
    v = torch.randn(value_shape, dtype=dtype, device=device, generator=g)
    return {"x": x, "key": key, "value": v}


def _slice_key(shape):
    r, c = shape
    return (slice(r // 4, r - r // 4), slice(c // 4, c - c // 4))


def _strided_key(shape):
    r, c = shape
    return (slice(1, None, 3), slice(None, None, 2))


def _eager(inp):
    y = inp["x"].clone()
    y[inp["key"]] = inp["value"]
    return y


def _eager_inplace(inp):
    inp["x"][inp["key"]] = inp["value"]
    return inp["x"]


def _functional_bytes(inp) -> int:
    """Least traffic of y = x with y[key] = v: read x outside the region and v, write y."""
    x, e = inp["x"], inp["x"].element_size()
    region = x[inp["key"]].numel()
    return (2 * x.numel() - region + inp["value"].numel()) * e


def _edges(key_of):
    def edges(dtype, device, gen):
        k = key_of((40, 24))
        yield "scalar value", _inputs((40, 24), k, dtype, device, gen, value="scalar")
        yield "broadcast row", _inputs((40, 24), k, dtype, device, gen, value="row")
        yield "empty region", _inputs((40, 24), (slice(5, 5),), dtype, device, gen)
        yield "empty self", _inputs((0, 24), (slice(None), slice(2, 9, 3)), dtype, device, gen)
        yield "negative bounds", _inputs((40, 24), (slice(-9, -1, 2), slice(-20, None)), dtype, device, gen)
        xt = torch.randn((24, 40), dtype=dtype, device=device, generator=_gen(device, gen)).t()
        yield "non-contiguous", _inputs((40, 24), k, dtype, device, gen, base=xt)
        yield "4-d, every dim strided", _inputs((5, 6, 7, 8), (slice(1, 5, 2), slice(0, 6, 4), slice(None, None, 3),
                                                              slice(1, 8, 2)), dtype, device, gen)
    return edges


register(KernelCase(
    "set_value", "slice",
    make=lambda n, dt, dev, g: _inputs(_shape(n), _slice_key(_shape(n)), dt, dev, g),
    run=lambda i: set_value(i["x"], i["key"], i["value"]), torch_eager=_eager, exact=True,
    bytes_moved=_functional_bytes, edge_cases=_edges(_slice_key),
    bench_sizes=(1 << 24, 1 << 28, 3_200_000_000),
    note="y = x.clone(); y[a:b, c:d] = v; ours: clone, then a kernel that writes only the region"))

register(KernelCase(
    "set_value", "strided",
    make=lambda n, dt, dev, g: _inputs(_shape(n), _strided_key(_shape(n)), dt, dev, g),
    run=lambda i: set_value(i["x"], i["key"], i["value"]), torch_eager=_eager, exact=True,
    bytes_moved=_functional_bytes, edge_cases=_edges(_strided_key),
    bench_sizes=(1 << 24, 1 << 28, 3_200_000_000),
    note="y = x.clone(); y[1::3, ::2] = v (strided rows and columns)"))

register(KernelCase(
    "set_value", "inplace",
    make=lambda n, dt, dev, g: _inputs(_shape(n), _slice_key(_shape(n)), dt, dev, g),
    run=lambda i: set_value_(i["x"], i["key"], i["value"]), torch_eager=_eager_inplace, exact=True,
    bytes_moved=lambda i: (i["x"][i["key"]].numel() + i["value"].numel()) * i["x"].element_size(),
    edge_cases=_edges(_slice_key),
    bench_sizes=(1 << 24, 1 << 28, 3_200_000_000),
    note="x[a:b, c:d] = v in place (no copy of x); writes the same values on every run"))
