"""The Triton kernels of ``workbench::dropout_add`` and its backward (imported lazily by
``workbench.kernels.dropout``; the math and the random stream are described there).

A kernel sees the local tensor as ``rows x n_inner`` (the layout ``dropout._merged_layout`` folds it
into): up to three outer dimensions and one inner run, with ``g = base + c0 t0 + c1 t1 + c2 t2 +
inner * t_in`` the global index of an element. One program handles ``BLOCK`` elements of one row, so the
row's outer coordinates are a few scalar divisions per program, never per element.

Each Philox4x32-10 call yields four 32-bit words, one for each of four consecutive global indices
``4q .. 4q+3``. Where every row starts on a multiple of 4 and the inner run is contiguous in ``g``
(``ALIGNED``, the common case), a program draws ``BLOCK/4`` counters and interleaves the four words:
one Philox per 4 elements, which keeps a memory-bound kernel memory-bound. Elsewhere each element draws
its own counter ``g >> 2`` and picks word ``g & 3``: the same bits, four times the arithmetic.

Offsets are int64 throughout (``pid`` is widened first), so tensors above 2^31 elements index right.
``enable_fp_fusion=False`` keeps ``residual + x * scale`` a rounded product then a rounded sum, as torch
computes it, so the outputs equal the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.triton_common import round_to

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _keep_block(seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner, threshold,
                ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """(keep, local offsets, in-bounds mask) of this program's BLOCK elements."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // nblk
    blk = pid % nblk
    c2 = row % so2
    r1 = row // so2
    c1 = r1 % so1
    c0 = r1 // so1
    grow = base + c0 * t0 + c1 * t1 + c2 * t2      # global index of the row's first element
    start = blk * BLOCK
    inner = start + tl.arange(0, BLOCK)
    in_bounds = inner < n_inner
    local = row * n_inner + inner
    if ALIGNED:
        # t_in == 1 and grow % 4 == 0: words of counter q cover elements 4q..4q+3 of this block in order
        q = ((grow + start) >> 2) + tl.arange(0, BLOCK // 4)
        r0, r1w, r2, r3 = tl.randint4x(seed, q)
        r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1w, r3)), [BLOCK])
    else:
        g = grow + inner * t_in
        r0, r1w, r2, r3 = tl.randint4x(seed, g >> 2)
        j = g & 3
        r = tl.where(j == 0, r0, tl.where(j == 1, r1w, tl.where(j == 2, r2, r3)))
    # 24 random bits against a 24-bit integer threshold: drop iff bits < round(p * 2^24)
    keep = (r >> 8).to(tl.int32) >= threshold
    return keep, local, in_bounds


@triton.jit
def _dropout_add_fwd(x_ptr, res_ptr, out_ptr, seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner,
                     threshold, scale, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    keep, local, m = _keep_block(seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner, threshold,
                                 ALIGNED, BLOCK)
    x = tl.load(x_ptr + local, mask=m, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + local, mask=m, other=0.0).to(tl.float32)
    out = res + tl.where(keep, x * scale, 0.0)
    tl.store(out_ptr + local, round_to(out, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dropout_bwd(grad_ptr, out_ptr, seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner,
                 threshold, scale, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    keep, local, m = _keep_block(seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner, threshold,
                                 ALIGNED, BLOCK)
    g = tl.load(grad_ptr + local, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + local, round_to(tl.where(keep, g * scale, 0.0), out_ptr.dtype.element_ty), mask=m)


def _launch(kernel, tensors, layout, seed: int, threshold: int, scale: float) -> None:
    base, sizes, strides = layout
    n_inner = sizes[-1]
    rows = 1
    for s in sizes[:-1]:
        rows *= s
    # pad the outer dimensions to three at the front (size 1, stride 0)
    outer = [(1, 0)] * (4 - len(sizes)) + list(zip(sizes[:-1], strides[:-1]))
    (_, t0), (so1, t1), (so2, t2) = outer
    t_in = strides[-1]
    aligned = t_in == 1 and base % 4 == 0 and all(t % 4 == 0 for t in (t0, t1, t2))
    nblk = triton.cdiv(n_inner, BLOCK)
    grid = (rows * nblk,)
    kernel[grid](*tensors, seed, base, nblk, so1, so2, t0, t1, t2, t_in, n_inner, threshold, scale,
                 ALIGNED=aligned, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, layout, seed: int,
                threshold: int, scale: float) -> None:
    """out = residual + x * keep * scale (``out`` contiguous, the inputs made contiguous here)."""
    _launch(_dropout_add_fwd, (x.contiguous(), residual.contiguous(), out), layout, seed, threshold, scale)


def dropout_backward(grad: torch.Tensor, out: torch.Tensor, layout, seed: int, threshold: int,
                     scale: float) -> None:
    """out = grad * keep * scale, with the forward's keep regenerated from (seed, g)."""
    _launch(_dropout_bwd, (grad.contiguous(), out), layout, seed, threshold, scale)
