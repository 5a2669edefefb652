"""Boolean masks as custom ops: ``masked_fill`` with a value that has a gradient, and boolean-mask
getitem (``mask_select``) and setitem (``mask_assign``) without ``nonzero``'s long indices.

**masked_fill** (mask m broadcastable to x, v a 0-dim tensor)::

    y = where(m, v, x)            dL/dx = where(m, 0, g)        dL/dv = sum_i m_i g_i

Both gradients come from one pass over g (``workbench::masked_fill_backward``): per-block fp32 partial
sums, then one sum in a fixed order, so dL/dv is deterministic.

**Row masks** (m over x's leading dims, ``m.shape == x.shape[:k]``; x seen as rows of the trailing dims)::

    mask_select(x, m)    = x[m]                      (n_true, *x.shape[k:])
    mask_assign(x, m, v) = x with x[m] = v           v 0-dim, or broadcastable to (n_true, *x.shape[k:])

    grads:  select   dL/dx = zeros, with g's rows put back where m is True   (mask_select_backward)
            assign   dL/dx = g with the kept rows zeroed;  dL/dv = g[m] summed to v's shape

The Triton path finds each kept row's position with per-block counts and a prefix sum
(``workbench.kernels.triton_masked``); ``mask_select`` syncs once with the host to size its output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workbench.kernels import backend
from workbench.kernels.cases import KernelCase, register

ops = torch.ops.workbench


def _triton():
    from workbench.kernels import triton_masked  # lazily: `import workbench.kernels` works without Triton

    return triton_masked


# ---------------------------------------------------------------------------------------------------
# checks shared by both backends and the fake implementations
# ---------------------------------------------------------------------------------------------------
def _check_bool(mask: Tensor) -> None:
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}; pass mask.bool() (or mask != 0)")


def _check_fill(x: Tensor, mask: Tensor, value: Tensor) -> None:
    _check_bool(mask)
    try:
        ok = torch.broadcast_shapes(mask.shape, x.shape) == x.shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to self's shape {tuple(x.shape)}")
    if value.dim() != 0:
        raise ValueError(f"masked_fill takes a 0-dim value, got shape {tuple(value.shape)}; "
                         "use torch.where(mask, value, self) for a tensor value")


def _check_rows(x: Tensor, mask: Tensor) -> None:
    _check_bool(mask)
    if mask.dim() > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}: the mask has {mask.dim()} dims")
    for i, (a, b) in enumerate(zip(mask.shape, x.shape)):
        if a != b:
            raise IndexError(f"The shape of the mask {list(mask.shape)} at index {i} does not match the shape of "
                             f"the indexed tensor {list(x.shape)} at index {i}")


def _assign_rows(x: Tensor, mask: Tensor, value: Tensor, know_n: bool = True) -> Tensor:
    """``value`` as (1 or n_true, *tail') with tail' broadcastable to x.shape[k:]; a 0-dim value as is.

    Leading size-1 dims beyond that are dropped, as torch's setitem does. Knowing n_true costs a sync,
    paid only when the value has more than one row (``know_n=False`` in fake mode skips that check)."""
    if value.dim() == 0:
        return value
    tail = tuple(x.shape[mask.dim():])
    v = value
    while v.dim() > len(tail) + 1 and v.shape[0] == 1:
        v = v.squeeze(0)
    v = v.reshape((1,) * (len(tail) + 1 - v.dim()) + tuple(v.shape))
    ok = v.dim() == len(tail) + 1 and all(a in (b, 1) for a, b in zip(v.shape[1:], tail))
    if ok and v.shape[0] != 1 and know_n:
        ok = v.shape[0] == int(mask.sum())
    if not ok:
        rows = (int(mask.sum()), *tail) if know_n else ("n_true", *tail)
        raise ValueError(f"value of shape {tuple(value.shape)} does not broadcast to the masked rows' shape "
                         f"{rows}; give one value per True in the mask, one row, or a 0-dim value")
    return v


def _row_mask(mask: Tensor, x: Tensor) -> Tensor:
    """A row mask as a mask over all of x's dims (trailing size-1 dims broadcast over each row)."""
    return mask.reshape(tuple(mask.shape) + (1,) * (x.dim() - mask.dim()))


def _width(x: Tensor, k: int = 1) -> int:
    """Elements per row of x seen as rows over its first k dims."""
    c = 1
    for s in x.shape[k:]:
        c *= s
    return c


def _sum_to(g: Tensor, shape: torch.Size) -> Tensor:
    """g summed over the dims that ``shape`` broadcasts (leading extra 1s of ``shape`` allowed)."""
    eff = tuple(shape)
    while len(eff) > g.dim() and eff[0] == 1:
        eff = eff[1:]
    return g.sum_to_size(eff).reshape(shape)


# ---------------------------------------------------------------------------------------------------
# masked_fill
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::masked_fill", mutates_args=())
def _masked_fill_op(self: Tensor, mask: Tensor, value: Tensor) -> Tensor:
    _check_fill(self, mask, value)
    mask, value = mask.to(self.device), value.to(self.device)
    if backend.choose(self.device) == "triton":
        return _triton().masked_fill(self, mask, value)
    out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
    return torch.where(mask, value.to(self.dtype), self, out=out)


@_masked_fill_op.register_fake
def _(self, mask, value):
    _check_fill(self, mask, value)
    return torch.empty_like(self, memory_format=torch.contiguous_format)


@torch.library.custom_op("workbench::masked_fill_backward", mutates_args=())
def _masked_fill_backward_op(grad: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    _check_fill(grad, mask, grad.new_zeros(()))
    mask = mask.to(grad.device)
    if backend.choose(grad.device) == "triton":
        return _triton().masked_fill_backward(grad, mask)
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    g_self = torch.where(mask, grad.new_zeros(()), grad, out=out)
    g_value = torch.where(mask, grad, grad.new_zeros(())).sum(dtype=torch.float32).to(grad.dtype)
    return g_self, g_value


@_masked_fill_backward_op.register_fake
def _(grad, mask):
    _check_fill(grad, mask, grad.new_zeros(()))
    return torch.empty_like(grad, memory_format=torch.contiguous_format), grad.new_empty(())


def _fill_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _fill_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    g_self, g_value = ops.masked_fill_backward(grad, mask)
    return (g_self if ctx.needs_input_grad[0] else None), None, (g_value if ctx.needs_input_grad[2] else None)


_masked_fill_op.register_autograd(_fill_backward, setup_context=_fill_setup)


def masked_fill(self: Tensor, mask: Tensor, value: float | int | bool | Tensor) -> Tensor:
    """``where(mask, value, self)``: mask (bool) broadcastable to self; value a number or a 0-dim tensor,
    which may require grad (its gradient is the sum of the output's gradient over the mask)."""
    value = value.to(self.device) if isinstance(value, Tensor) else torch.tensor(value, dtype=self.dtype,
                                                                                 device=self.device)
    return ops.masked_fill(self, mask.to(self.device), value)


# ---------------------------------------------------------------------------------------------------
# mask_select: x[mask]
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::mask_select", mutates_args=())
def _mask_select_op(self: Tensor, mask: Tensor) -> Tensor:
    _check_rows(self, mask)
    mask = mask.to(self.device)
    if backend.choose(self.device) == "triton":
        return _triton().mask_select(self, mask)
    return self[mask]


@_mask_select_op.register_fake
def _(self, mask):
    _check_rows(self, mask)
    n_true = torch.library.get_ctx().new_dynamic_size()
    return self.new_empty((n_true, *self.shape[mask.dim():]))


@torch.library.custom_op("workbench::mask_select_backward", mutates_args=())
def _mask_select_backward_op(grad: Tensor, mask: Tensor) -> Tensor:
    """zeros of shape mask.shape + grad.shape[1:], with grad's rows put where mask is True (grad has one
    row per True, as autograd guarantees; the kernel never reads past grad's rows)."""
    _check_bool(mask)
    mask = mask.to(grad.device)
    shape = tuple(mask.shape) + tuple(grad.shape[1:])
    if backend.choose(grad.device) == "triton":
        src = grad.reshape(grad.shape[0], _width(grad)).contiguous()
        return _triton().merge_rows(None, mask, src, torch.Size(shape), grad.dtype, per_row=True)
    out = grad.new_zeros(shape)
    out[mask] = grad
    return out


@_mask_select_backward_op.register_fake
def _(grad, mask):
    _check_bool(mask)
    return grad.new_empty(tuple(mask.shape) + tuple(grad.shape[1:]))


def _select_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _select_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    return ops.mask_select_backward(grad, mask), None


_mask_select_op.register_autograd(_select_backward, setup_context=_select_setup)


def mask_select(self: Tensor, mask: Tensor) -> Tensor:
    """``self[mask]`` for a bool mask over self's leading dims: shape (n_true, *self.shape[mask.dim():])."""
    return ops.mask_select(self, mask.to(self.device))


# ---------------------------------------------------------------------------------------------------
# mask_assign: y = x.clone(); y[mask] = value
# ---------------------------------------------------------------------------------------------------
@torch.library.custom_op("workbench::mask_assign", mutates_args=())
def _mask_assign_op(self: Tensor, mask: Tensor, value: Tensor) -> Tensor:
    _check_rows(self, mask)
    mask, value = mask.to(self.device), value.to(self.device)
    v = _assign_rows(self, mask, value)
    if backend.choose(self.device) == "triton":
        if v.dim() == 0:  # a scalar fills whole rows: masked_fill with the row mask, no positions needed
            return _triton().masked_fill(self, _row_mask(mask, self), v)
        tail = tuple(self.shape[mask.dim():])
        src = v.expand(v.shape[0], *tail).to(self.dtype).reshape(v.shape[0], _width(self, mask.dim()))
        src = src.contiguous()
        return _triton().merge_rows(self, mask, src, self.shape, self.dtype, per_row=v.shape[0] != 1)
    out = self.clone(memory_format=torch.contiguous_format)
    out[mask] = v.to(self.dtype)
    return out


@_mask_assign_op.register_fake
def _(self, mask, value):
    _check_rows(self, mask)
    _assign_rows(self, mask, value, know_n=False)
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def _assign_setup(ctx, inputs, output):
    x, mask, value = inputs
    ctx.save_for_backward(mask)
    ctx.value_shape, ctx.tail_dims = value.shape, x.dim() - mask.dim()


def _assign_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    mask_b = mask.reshape(tuple(mask.shape) + (1,) * ctx.tail_dims)
    need_self, need_value = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if len(ctx.value_shape) == 0:  # one pass gives both, as for masked_fill
        g_self, g_value = ops.masked_fill_backward(grad, mask_b)
        return (g_self if need_self else None), None, (g_value if need_value else None)
    g_self = ops.masked_fill(grad, mask_b, grad.new_zeros(())) if need_self else None
    g_value = _sum_to(ops.mask_select(grad, mask), ctx.value_shape) if need_value else None
    return g_self, None, g_value


_mask_assign_op.register_autograd(_assign_backward, setup_context=_assign_setup)


def mask_assign(self: Tensor, mask: Tensor, value: float | int | bool | Tensor) -> Tensor:
    """``y = self.clone(); y[mask] = value``, functional. value: a number or 0-dim tensor (fills the kept
    rows), or a tensor broadcastable to (n_true, *self.shape[mask.dim():]); it may require grad."""
    value = value.to(self.device) if isinstance(value, Tensor) else torch.tensor(value, dtype=self.dtype,
                                                                                 device=self.device)
    return ops.mask_assign(self, mask.to(self.device), value)


# ---------------------------------------------------------------------------------------------------
# kernel cases (workbench kernels check|bench)
# ---------------------------------------------------------------------------------------------------
def _gen(device: torch.device, gen: torch.Generator) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen`` (inputs are drawn where they live: no host copies)."""
    if torch.device(gen.device).type == torch.device(device).type:
        return gen
    return torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))


def _inputs(shape, mask_shape, dtype, device, gen, p=0.5, value="scalar", grad_rows=None) -> dict:
    g = _gen(device, gen)
    x = torch.randn(shape, dtype=dtype, device=device, generator=g).requires_grad_()
    mask = torch.rand(mask_shape, device=device, generator=g) < p
    out = {"x": x, "mask": mask}
    tail = tuple(shape[len(mask_shape):])
    n_true = int(mask.sum())
    if value == "scalar":
        out["value"] = torch.tensor(0.5, dtype=dtype, device=device, requires_grad=True)
    elif value == "rows":
        out["value"] = torch.randn((n_true, *tail), dtype=dtype, device=device, generator=g).requires_grad_()
    grad_shape = (n_true, *tail) if grad_rows else tuple(shape)
    out["grad"] = torch.randn(grad_shape, dtype=dtype, device=device, generator=g)
    return out


def _grads(y: Tensor, inp: dict, names: tuple[str, ...]) -> tuple:
    return (y, *torch.autograd.grad(y, tuple(inp[n] for n in names), inp["grad"]))


def _fill_run(inp):
    return _grads(masked_fill(inp["x"], inp["mask"], inp["value"]), inp, ("x", "value"))


def _fill_eager(inp):
    return _grads(inp["x"].masked_fill(inp["mask"], inp["value"]), inp, ("x", "value"))


def _assign_eager(inp):
    y = inp["x"].clone()
    y[inp["mask"]] = inp["value"]
    return _grads(y, inp, ("x", "value"))


def _edges(make_one):
    """Edge inputs for a row-mask case: ``make_one(shape, mask_shape, p, dtype, device, gen)``."""
    def edges(dtype, device, gen):
        yield "all-true", make_one((37, 8), (37,), 1.1, dtype, device, gen)
        yield "all-false", make_one((37, 8), (37,), -0.1, dtype, device, gen)
        yield "empty", make_one((0, 8), (0,), 0.5, dtype, device, gen)
        yield "zero-width", make_one((9, 0), (9,), 0.5, dtype, device, gen)
        yield "3-d, 2-d mask", make_one((6, 5, 7), (6, 5), 0.5, dtype, device, gen)
        inp = make_one((8, 40), (8,), 0.5, dtype, device, gen)
        xt = inp["x"].detach().t().contiguous().t().requires_grad_()  # same values, column-major
        yield "non-contiguous", {**inp, "x": xt}
    return edges


def _rows_shape(size: int, width: int = 64) -> tuple[int, int]:
    return (max(size // width, 1), width)


def _e(t: Tensor) -> int:
    return t.element_size()


register(KernelCase(
    "masked_fill", "forward-backward",
    make=lambda n, dt, dev, g: _inputs((n,), (n,), dt, dev, g),
    run=_fill_run, torch_eager=_fill_eager, backward=True,
    bytes_moved=lambda i: 4 * i["x"].numel() * _e(i["x"]) + 2 * i["mask"].numel(),
    edge_cases=_edges(lambda s, ms, p, dt, dev, g: _inputs(s, ms + (1,) * (len(s) - len(ms)), dt, dev, g, p)),
    note="y = where(m, v, x) and both gradients; baseline Tensor.masked_fill + autograd"))

register(KernelCase(
    "mask_select", "flat",
    make=lambda n, dt, dev, g: _inputs((n,), (n,), dt, dev, g, value=None),
    run=lambda i: mask_select(i["x"].detach(), i["mask"]),
    torch_eager=lambda i: i["x"].detach()[i["mask"]], exact=True,
    bytes_moved=lambda i: i["mask"].numel() + 2 * int(i["mask"].sum()) * _e(i["x"]),
    edge_cases=_edges(lambda s, ms, p, dt, dev, g: _inputs(s, ms, dt, dev, g, p, value=None)),
    note="x[m] for a 1-D bool mask; counts + prefix sum, no nonzero; one host sync for the size"))

register(KernelCase(
    "mask_select", "rows",
    make=lambda n, dt, dev, g: _inputs(_rows_shape(n), _rows_shape(n)[:1], dt, dev, g, value=None, grad_rows=True),
    run=lambda i: _grads(mask_select(i["x"], i["mask"]), i, ("x",)),
    torch_eager=lambda i: _grads(i["x"][i["mask"]], i, ("x",)), exact=True, backward=True,
    bytes_moved=lambda i: (2 * i["mask"].numel()
                           + (3 * int(i["mask"].sum()) * _width(i["x"]) + i["x"].numel()) * _e(i["x"])),
    edge_cases=_edges(lambda s, ms, p, dt, dev, g: _inputs(s, ms, dt, dev, g, p, value=None, grad_rows=True)),
    note="x[m], rows of 64; backward puts the gradient's rows back (zeros elsewhere) in one pass"))

register(KernelCase(
    "mask_assign", "scalar",
    make=lambda n, dt, dev, g: _inputs(_rows_shape(n), _rows_shape(n)[:1], dt, dev, g),
    run=lambda i: _grads(mask_assign(i["x"], i["mask"], i["value"]), i, ("x", "value")),
    torch_eager=_assign_eager, backward=True,
    bytes_moved=lambda i: 2 * i["mask"].numel() + (4 * i["x"].numel()
                                                   - int(i["mask"].sum()) * _width(i["x"])) * _e(i["x"]),
    edge_cases=_edges(lambda s, ms, p, dt, dev, g: _inputs(s, ms, dt, dev, g, p)),
    note="y[m] = v (0-dim v with a gradient): a row-broadcast masked_fill, no positions"))

register(KernelCase(
    "mask_assign", "tensor",
    make=lambda n, dt, dev, g: _inputs(_rows_shape(n), _rows_shape(n)[:1], dt, dev, g, value="rows"),
    run=lambda i: _grads(mask_assign(i["x"], i["mask"], i["value"]), i, ("x", "value")),
    torch_eager=_assign_eager, backward=True, exact=True,
    bytes_moved=lambda i: 3 * i["mask"].numel() + (4 * i["x"].numel()
                                                   + 2 * i["value"].numel()) * _e(i["x"]),
    edge_cases=_edges(lambda s, ms, p, dt, dev, g: _inputs(s, ms, dt, dev, g, p, value="rows")),
    note="y[m] = v, one row of v per True; baseline index_put_ (nonzero) on a clone"))
