"""Triton kernel for ``set_value`` (``workbench.kernels.set_value``): write a value into a strided region
of a tensor, touching only the region, with int64 offsets throughout (tensors above 2^31 elements).

The region ``x[s_0:e_0:k_0, ..., s_{L-1}:e_{L-1}:k_{L-1}]`` of a tensor with strides S is itself a strided
view: n_d = ceil((e_d - s_d) / k_d) elements along dim d, at::

    offset(c) = base + sum_d c_d * E_d,     base = sum_d s_d * S_d,   E_d = k_d * S_d
    value(c)  =        sum_d c_d * V_d,     V_d = value's stride, 0 where it broadcasts

Dims merge when both maps are linear across them (E_d = n_{d+1} E_{d+1} and V_d = n_{d+1} V_{d+1}), so
``x[a:b] = v`` on a contiguous x is one dim. The last merged dim is the columns of a 2-D tile; the
others (up to 3, more are looped on the host) are its rows. When a tile's column stride is 1 (Triton
specialises an argument equal to 1), its loads and stores are contiguous and vectorise.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

_TILE = 4096          # region elements per program
_ROW_DIMS = 3         # region dims the kernel maps to rows; the host loops over any beyond


@triton.jit
def _region_write_kernel(dst_ptr, v_ptr, base, vbase, n_rows, inner, col_blocks, s1, s2,
                         e0, e1, e2, e_in, v0, v1, v2, v_in,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # every index below is int64
    rb = pid // col_blocks
    cb = pid % col_blocks
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c2 = rows % s2
    r = rows // s2
    c1 = r % s1
    c0 = r // s1
    d_rows = base + c0 * e0 + c1 * e1 + c2 * e2
    v_rows = vbase + c0 * v0 + c1 * v1 + c2 * v2
    ok = (rows < n_rows)[:, None] & (cols < inner)[None, :]
    v = tl.load(v_ptr + v_rows[:, None] + cols[None, :] * v_in, mask=ok)
    tl.store(dst_ptr + d_rows[:, None] + cols[None, :] * e_in, v.to(dst_ptr.dtype.element_ty), mask=ok)


def region_dims(dst: torch.Tensor, value: torch.Tensor, region: list[tuple[int, int, int]]
                ) -> tuple[int, list[tuple[int, int, int]]]:
    """(base offset, merged dims as (n, E, V)) for writing ``value`` into ``region`` of ``dst``.

    ``region`` holds (start, count, step) for every dim of dst; value broadcasts to the counts. Size-1
    dims are dropped (they only move the base); an empty region gives no dims and count 0."""
    counts = [n for _, n, _ in region]
    v_strides = value.expand(counts).stride()
    base = sum(s * st for (s, _, _), st in zip(region, dst.stride()))
    dims: list[tuple[int, int, int]] = []
    for (_, n, k), st, vst in zip(region, dst.stride(), v_strides):
        if n == 1:
            continue
        e = k * st
        if dims and dims[-1][1] == n * e and dims[-1][2] == n * vst:
            dims[-1] = (dims[-1][0] * n, e, vst)
        else:
            dims.append((n, e, vst))
    return base, dims


def write_region(dst: torch.Tensor, value: torch.Tensor, region: list[tuple[int, int, int]]) -> None:
    """``dst[region] = value`` in place; ``region`` is (start, count, step) per dim of dst (normalised)."""
    if any(n == 0 for _, n, _ in region):
        return
    base, dims = region_dims(dst, value, region)
    if not dims:  # a single element
        dims = [(1, 1, 0)]
    value = value.expand([n for _, n, _ in region])  # strides of 0 where the value broadcasts
    inner, e_in, v_in = dims[-1]
    rows = dims[:-1]
    loop, rows = rows[:max(0, len(rows) - _ROW_DIMS)], rows[max(0, len(rows) - _ROW_DIMS):]
    rows = [(1, 0, 0)] * (_ROW_DIMS - len(rows)) + rows
    n_rows = rows[0][0] * rows[1][0] * rows[2][0]
    block_c = min(triton.next_power_of_2(inner), 1024)
    block_r = min(triton.next_power_of_2(n_rows), max(_TILE // block_c, 1))
    col_blocks = triton.cdiv(inner, block_c)
    grid = (triton.cdiv(n_rows, block_r) * col_blocks,)
    # dims beyond what the kernel indexes (rare: > 4 dims that do not merge) are looped over here
    for idx in itertools.product(*(range(n) for n, _, _ in loop)):
        b = base + sum(i * e for i, (_, e, _) in zip(idx, loop))
        vb = sum(i * v for i, (_, _, v) in zip(idx, loop))
        _region_write_kernel[grid](dst, value, b, vb, n_rows, inner, col_blocks, rows[1][0], rows[2][0],
                                   rows[0][1], rows[1][1], rows[2][1], e_in,
                                   rows[0][2], rows[1][2], rows[2][2], v_in,
                                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8)
