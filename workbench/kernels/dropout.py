"""Fused dropout + residual add: ``out = residual + dropout(x)``, with no mask ever stored.

The keep decision of an element is a pure function of the seed and the element's index ``g`` in the
GLOBAL tensor, so the forward, the backward and any shard of the tensor draw the same bits::

    g       = offset + sum_d (c_d + shard_offset_d) * gstride_d        c: local coordinates, gstride:
                                                                        row-major strides of global_shape
    w       = Philox4x32-10(key = seed, counter = (q_lo, q_hi, 0, 0))[g mod 4],   q = g div 4
    keep    = (w >> 8) >= round(p * 2^24)                               24 random bits, integer threshold
    out     = residual + (keep ? x / (1-p) : 0)                         computed in fp32, stored in
                                                                        result_type(x, residual)
    dL/dx   = keep ? dL/dout / (1-p) : 0          dL/dresidual = dL/dout      (the mask regenerated)

``w`` is word ``g mod 4`` of ``tl.randint4x(seed, g >> 2)`` (Triton 3.6): one Philox call serves four
consecutive elements, which is what lets the kernel keep up with memory. The torch reference computes the
same Philox with int64 tensors held to 32 bits, so both paths give bit-identical masks (and, with the
product rounded before the sum on both, bit-identical outputs).

``global_shape``/``shard_offset`` empty mean "this tensor is the whole tensor" (the fast path). A DTensor
rule (``workbench.spmd.kernels``) fills them for a shard, so a sharded tensor drops what the unsharded
one would.

In the model, each residual add of each layer draws its own seed from the training seed, the step, the
layer and the site, and its offset from the global index of the micro-batch's first sequence
(:func:`dropout_scope`, set by the training step around forward *and* backward, so activation
checkpointing recomputes the same masks). Hence data-parallel layouts and gradient accumulation drop
exactly what the single-process run drops. Tensor parallelism without sequence parallelism holds the
whole residual stream on every tp rank: same masks. Under sequence parallelism today's plan hands the
blocks plain local tensors (a slice of the sequence), so the masks are valid dropout but not the
single-process ones (a plan keeping the stream a Shard(1) DTensor would get those through the DTensor
rule). Under pipeline parallelism the offset adds the schedule's microbatch
index times the microbatch's rows, which equals the single-process sample index because the schedule
splits the local batch into equal contiguous chunks; a different chunking would give other masks.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.kernels import backend
from workbench.kernels.cases import KernelCase, register

__all__ = ["dropout_add", "keep_mask", "philox4x32", "philox_rounds", "dropout_scope", "DropoutScope",
           "residual_rng"]

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57      # Philox4x32 multipliers
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85          # Weyl key increments
_CHUNK = 1 << 22                                 # reference: elements per pass (bounds its temporaries)
_MAX_KERNEL_DIMS = 4                             # merged dimensions the Triton kernel takes


def _threshold(p: float) -> int:
    return int(round(p * (1 << 24)))


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p)


# ---------------------------------------------------------------------------------------------------
# the torch reference: Philox4x32-10 on int64 tensors held to 32 bits
# ---------------------------------------------------------------------------------------------------
def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of ``a * b`` for ``a`` < 2^32 (int64) and a constant ``b`` < 2^32; ``a`` is split
    in 16-bit halves so no product exceeds 2^48."""
    hi_part, lo_part = (a >> 16) * b, (a & 0xFFFF) * b
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return hi, lo


def philox4x32(seed: int, q: torch.Tensor) -> list[torch.Tensor]:
    """The four 32-bit words (int64 tensors) of Philox4x32-10 at counters ``(q_lo, q_hi, 0, 0)``, key
    ``(seed_lo, seed_hi)``: what ``tl.randint4x(seed, q)`` returns for an int64 ``q``."""
    zero = torch.zeros_like(q)
    return philox_rounds(seed & _M32, (seed >> 32) & _M32, q & _M32, (q >> 32) & _M32, zero, zero)


def philox_rounds(k0: int, k1: int, c0, c1, c2, c3) -> list[torch.Tensor]:
    """Philox4x32-10 of counter words ``c0..c3`` (int64 tensors < 2^32) under key ``(k0, k1)``."""
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, _ROUND_B)
        hi_a, lo_a = _mulhilo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return [c0, c1, c2, c3]


def _global_strides(global_shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for s in reversed(list(global_shape)):
        strides.append(acc)
        acc *= int(s)
    return strides[::-1]


def keep_mask(shape: Sequence[int], p: float, seed: int, offset: int = 0, global_shape: Sequence[int] = (),
              shard_offset: Sequence[int] = (), device: torch.device | str = "cpu") -> torch.Tensor:
    """The bool keep-mask of a local tensor of ``shape``, straight from the definition (the reference)."""
    shape = [int(s) for s in shape]
    gshape = [int(s) for s in global_shape] or shape
    soff = [int(o) for o in shard_offset] or [0] * len(shape)
    gstride = _global_strides(gshape)
    n = math.prod(shape)
    keep = torch.empty(n, dtype=torch.bool, device=device)
    threshold = _threshold(p)
    for start in range(0, n, _CHUNK):
        rest = torch.arange(start, min(n, start + _CHUNK), dtype=torch.int64, device=device)
        g = torch.full_like(rest, offset)
        for d in reversed(range(len(shape))):   # unravel the local linear index, innermost first
            rest, c = rest.div(shape[d], rounding_mode="floor"), rest % shape[d]
            g += (c + soff[d]) * gstride[d]
        words = philox4x32(seed, g >> 2)
        w = torch.stack(words, -1).gather(-1, (g & 3).unsqueeze(-1)).squeeze(-1)
        keep[start:start + len(g)] = (w >> 8) >= threshold
    return keep.view(shape)


def _merged_layout(shape, global_shape, shard_offset, offset) -> tuple[int, list[int], list[int]]:
    """(base, sizes, gstrides): the local tensor folded into as few dimensions as its global strides
    allow, with ``g = base + sum_d c_d * gstrides_d`` (what the kernel takes)."""
    shape = [int(s) for s in shape]
    if not global_shape:
        return int(offset), [max(1, math.prod(shape))], [1]
    gstride = _global_strides(global_shape)
    base = int(offset) + sum(int(o) * s for o, s in zip(shard_offset, gstride))
    sizes: list[int] = []
    strides: list[int] = []
    for size, stride in zip(shape, gstride):
        if size == 1:
            continue  # its coordinate is always 0
        if sizes and strides[-1] == size * stride:  # contiguous with the previous dim: one run
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return base, sizes or [1], strides or [1]


# ---------------------------------------------------------------------------------------------------
# the custom ops
# ---------------------------------------------------------------------------------------------------
def _triton_layout(shape, global_shape, shard_offset, offset):
    """The kernel's layout, or None where it has too many dimensions (a shard split on 4+ inner dims),
    which the reference then computes (the same bits)."""
    layout = _merged_layout(shape, global_shape, shard_offset, offset)
    return layout if len(layout[1]) <= _MAX_KERNEL_DIMS else None


@torch.library.custom_op("workbench::dropout_add", mutates_args=(), schema=(
    "(Tensor x, Tensor residual, float p, int seed, int offset, SymInt[] global_shape, SymInt[] shard_offset)"
    " -> Tensor"))
def _dropout_add_op(x, residual, p, seed, offset, global_shape, shard_offset):
    dtype = torch.result_type(x, residual)
    if backend.choose(x.device) == "triton" and x.numel():
        layout = _triton_layout(x.shape, global_shape, shard_offset, offset)
        if layout is not None:
            from workbench.kernels import triton_dropout

            out = torch.empty(x.shape, dtype=dtype, device=x.device)
            triton_dropout.dropout_add(x, residual, out, layout, seed, _threshold(p), _scale(p))
            return out
    keep = keep_mask(x.shape, p, seed, offset, global_shape, shard_offset, x.device)
    kept = torch.where(keep, x.float() * _scale(p), 0.0)
    return (residual.float() + kept).to(dtype)


@_dropout_add_op.register_fake
def _(x, residual, p, seed, offset, global_shape, shard_offset):
    return x.new_empty(x.shape, dtype=torch.result_type(x, residual))


@torch.library.custom_op("workbench::dropout_add_backward", mutates_args=(), schema=(
    "(Tensor grad, float p, int seed, int offset, SymInt[] global_shape, SymInt[] shard_offset) -> Tensor"))
def _dropout_add_backward_op(grad, p, seed, offset, global_shape, shard_offset):
    if backend.choose(grad.device) == "triton" and grad.numel():
        layout = _triton_layout(grad.shape, global_shape, shard_offset, offset)
        if layout is not None:
            from workbench.kernels import triton_dropout

            out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
            triton_dropout.dropout_backward(grad, out, layout, seed, _threshold(p), _scale(p))
            return out
    keep = keep_mask(grad.shape, p, seed, offset, global_shape, shard_offset, grad.device)
    return torch.where(keep, grad.float() * _scale(p), 0.0).to(grad.dtype)


@_dropout_add_backward_op.register_fake
def _(grad, p, seed, offset, global_shape, shard_offset):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, residual, p, seed, offset, global_shape, shard_offset = inputs
    ctx.rng = (p, seed, offset, list(global_shape), list(shard_offset))
    ctx.dtypes = (x.dtype, residual.dtype)


def _backward(ctx, grad):
    x_dtype, res_dtype = ctx.dtypes
    grad_x = torch.ops.workbench.dropout_add_backward(grad, *ctx.rng)
    grad_x = grad_x if grad_x.dtype == x_dtype else grad_x.to(x_dtype)
    grad_res = grad if grad.dtype == res_dtype else grad.to(res_dtype)
    return grad_x, grad_res, None, None, None, None, None


_dropout_add_op.register_autograd(_backward, setup_context=_setup)


def _setup_bwd(ctx, inputs, output):
    ctx.rng = tuple(inputs[1:])


def _backward_bwd(ctx, grad):  # the backward is linear in its gradient, with the same mask
    return torch.ops.workbench.dropout_add_backward(grad, *ctx.rng), None, None, None, None, None


_dropout_add_backward_op.register_autograd(_backward_bwd, setup_context=_setup_bwd)


# ---------------------------------------------------------------------------------------------------
# the Python API
# ---------------------------------------------------------------------------------------------------
def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, *, seed: int, offset: int = 0,
                training: bool = True, global_shape: Sequence[int] | None = None,
                shard_offset: Sequence[int] | None = None) -> torch.Tensor:
    """``residual + dropout(x, p)``: element ``g`` (its index in the global tensor, from ``offset``) is kept
    iff Philox(seed, g) says so, and scaled by 1/(1-p). ``p == 0`` or ``training=False``: the plain add.

    ``global_shape``/``shard_offset``: ``x`` is the block of a larger tensor starting at ``shard_offset``
    (default: ``x`` is the whole tensor). Same mask on every backend and every layout.
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"dropout p={p!r} must be a probability in [0, 1); use p=0 for no dropout")
    if tuple(x.shape) != tuple(residual.shape):
        raise ValueError(f"dropout_add: x has shape {tuple(x.shape)} but residual has {tuple(residual.shape)}; "
                         "pass tensors of the same shape")
    if x.device != residual.device:
        raise ValueError(f"dropout_add: x is on {x.device} but residual is on {residual.device}; "
                         "move them to one device")
    if not (x.is_floating_point() and residual.is_floating_point()):
        raise TypeError(f"dropout_add takes floating-point tensors, got {x.dtype} and {residual.dtype}")
    if not training or p == 0:
        return residual + x
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise ValueError(f"dropout_add: seed={seed!r} must be an integer in [0, 2^63)")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"dropout_add: offset={offset!r} must be an integer >= 0")
    gshape, soff = list(global_shape or []), list(shard_offset or [])
    if gshape or soff:
        soff = soff or [0] * x.dim()
        if len(gshape) != x.dim() or len(soff) != x.dim() or any(
                o < 0 or o + s > g for o, s, g in zip(soff, x.shape, gshape)):
            raise ValueError(f"dropout_add: a block of shape {tuple(x.shape)} at shard_offset={soff} does not fit "
                             f"in global_shape={gshape}; give both with one entry per dimension")
    return torch.ops.workbench.dropout_add(x, residual, float(p), seed, offset, gshape, soff)


# ---------------------------------------------------------------------------------------------------
# the training scope: which seed and offset each residual add of the model draws
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DropoutScope:
    """What a model's dropout needs from the training step: the run's seed, the step, and the index in
    the global batch of this rank's first sequence of the micro-batch. ``microbatch``: under a pipeline
    schedule, a function giving the index of the microbatch running now (its rows are added).
    ``seq_shard = (rank, ways)``: under sequence parallelism the residual stream a block sees is chunk
    ``rank`` of ``ways`` along the sequence (dim 1), so its masks are drawn at their global positions."""

    seed: int
    step: int
    first_sample: int
    microbatch: Callable[[], int] | None = None
    seq_shard: tuple[int, int] | None = None


# Process-wide, not thread-local: autograd runs CUDA backward (and so activation checkpointing's
# recomputation) on its own device threads, which must see the step's scope.
_SCOPES: list[DropoutScope] = []
_UNSCOPED = [0]


@contextmanager
def dropout_scope(*, seed: int, step: int, first_sample: int, microbatch: Callable[[], int] | None = None,
                  seq_shard: tuple[int, int] | None = None) -> Iterator[DropoutScope]:
    """Around each micro-batch's forward and backward (``workbench.train.step`` sets it)."""
    if seq_shard is not None and not (isinstance(seq_shard, tuple) and len(seq_shard) == 2
                                      and 0 <= seq_shard[0] < seq_shard[1]):
        raise ValueError(f"seq_shard={seq_shard!r} must be (rank, ways) with 0 <= rank < ways")
    scope = DropoutScope(int(seed), int(step), int(first_sample), microbatch, seq_shard)
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.pop()


def _mix(*parts: int) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def residual_rng(layer: int, site: int, x: torch.Tensor) -> dict:
    """The keyword arguments of :func:`dropout_add` (seed, offset, and where ``x`` sits in the global
    tensor) for residual add ``site`` (0 attention, 1 feed-forward) of block ``layer`` on the input ``x``
    (batch, seq, ...): the seed mixes (run seed, step, layer, site); the offset starts at the micro-batch's
    first global sample; under sequence parallelism ``x`` is one sequence chunk of the global tensor.

    Outside a scope (a loop of your own) each call draws a fresh seed from ``torch.initial_seed()`` and a
    counter: reproducible after ``torch.manual_seed``, but activation checkpointing then recomputes other
    masks; wrap forward and backward in :func:`dropout_scope` for that.
    """
    if not _SCOPES:
        _UNSCOPED[0] += 1
        return {"seed": _mix("unscoped", torch.initial_seed(), _UNSCOPED[0], layer, site), "offset": 0}
    scope = _SCOPES[-1]
    rows = int(x.shape[0])
    sample = scope.first_sample + (max(0, scope.microbatch()) * rows if scope.microbatch is not None else 0)
    seed = _mix(scope.seed, scope.step, layer, site)
    if scope.seq_shard is None or x.dim() < 2 or scope.seq_shard[1] == 1:
        return {"seed": seed, "offset": sample * (x.numel() // max(1, rows))}
    rank, ways = scope.seq_shard
    gshape = [rows, int(x.shape[1]) * ways, *map(int, x.shape[2:])]
    per_sample = math.prod(gshape[1:])
    return {"seed": seed, "offset": sample * per_sample, "global_shape": gshape,
            "shard_offset": [0, rank * int(x.shape[1])] + [0] * (x.dim() - 2)}


# ---------------------------------------------------------------------------------------------------
# kernel cases (workbench kernels check|bench)
# ---------------------------------------------------------------------------------------------------
_P, _SEED = 0.1, 20240611


def _make(size, dtype, device, gen):
    x = torch.randn(size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    residual = torch.randn(size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return {"x": x, "residual": residual, "p": _P, "seed": _SEED, "offset": 0}


def _forward(inp):
    return dropout_add(inp["x"], inp["residual"], inp["p"], seed=inp["seed"], offset=inp["offset"],
                       global_shape=inp.get("global_shape"), shard_offset=inp.get("shard_offset"))


def _forward_backward(inp):
    x, residual = (inp[k].detach().requires_grad_(True) for k in ("x", "residual"))
    out = _forward({**inp, "x": x, "residual": residual})
    grad = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view(out.shape)
    return (out.detach(), *torch.autograd.grad(out, (x, residual), grad))


def _eager_forward(inp):
    return inp["residual"] + F.dropout(inp["x"], inp["p"])


def _eager_forward_backward(inp):
    x, residual = (inp[k].detach().requires_grad_(True) for k in ("x", "residual"))
    out = residual + F.dropout(x, inp["p"])
    grad = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view(out.shape)
    return (out.detach(), *torch.autograd.grad(out, (x, residual), grad))


def _bytes(inp, backward=False):
    x, r = inp["x"], inp["residual"]
    out = torch.result_type(x, r).itemsize
    fwd = x.numel() * (x.element_size() + r.element_size() + out)
    return fwd + (x.numel() * (out + x.element_size()) if backward else 0)  # backward: read grad, write dx


def _edge_cases(dtype, device, gen):
    def make(shape, **kw):
        x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        r = torch.randn(shape, generator=gen).to(device=device, dtype=kw.pop("res_dtype", dtype))
        return {"x": x, "residual": r, "p": _P, "seed": _SEED, "offset": 0, **kw}

    yield "empty", make((0,))
    yield "zero-rows", make((0, 7))
    yield "one element", make((1,))
    t = make((24, 10))
    yield "non-contiguous", {**t, "x": t["x"].t(), "residual": t["residual"].t()}
    yield "unaligned offset", make((5, 37), offset=3)
    yield "p=0.9", make((33, 31), p=0.9)
    yield "shard of a (6, 40) tensor", make((3, 20), global_shape=[6, 40], shard_offset=[3, 20])
    yield "column shard, odd width", make((4, 3), global_shape=[4, 7], shard_offset=[0, 2], offset=1)
    yield "fp32 residual", make((9, 13), res_dtype=torch.float32)


_NOTE = ("baseline residual + F.dropout(x, p) draws other random bits: its values are not comparable, "
         "it is for timing only")

for _variant, _run, _eager, _bwd in (("forward", _forward, _eager_forward, False),
                                     ("forward-backward", _forward_backward, _eager_forward_backward, True)):
    register(KernelCase(
        "dropout_add", _variant, _make, _run,
        bytes_moved=(lambda inp, b=_bwd: _bytes(inp, b)), torch_eager=_eager, compare_eager=False,
        backward=_bwd, exact=True,
        dtypes=(torch.float32, torch.bfloat16), bench_sizes=(1 << 20, 1 << 24, 1 << 26, 1 << 28),
        edge_cases=_edge_cases, note=_NOTE))
