"""Triton kernels for ``masked_fill`` and the boolean-mask ops (``workbench.kernels.masked``).

**masked_fill**, one read/write pass each way (flat over self, which is made contiguous)::

    forward    out_i = m_i ? v : x_i                       reads x, m; writes out
    backward   gx_i  = m_i ? 0 : g_i                       reads g, m; writes gx
               gv    = sum_b P_b,  P_b = sum_{i in block b} m_i * g_i   (fp32, fixed order: deterministic)

A mask that broadcasts to self is read through its strides (0 on broadcast dims), after merging the
dims it can, so a ``(B, 1, S)`` mask against ``(B, H, S)`` costs B*S bytes, not B*H*S.

**Row masks** (mask over self's leading dims; self seen as R rows of C elements). The position of a
kept row in the output is the number of kept rows before it, found without ``nonzero``::

    counts_b = sum_{r in block b} m_r                      (kernel 1: reads the mask only)
    start_b  = counts_0 + ... + counts_{b-1}                (exclusive prefix sum in int64: torch.cumsum)
    pos_r    = start_b + #(kept rows before r in block b)   (kernel 2: tl.cumsum inside the block)

    select     out[pos_r] = x[r]             for kept r      (output size = sum counts: one host sync)
    merge      out[r] = m_r ? src[pos_r] : base[r]           (mask_assign: base = self, src = value;
                                                              mask_select backward: base = 0, src = grad)

A source of one row broadcast to every kept row needs no positions (no counts, no prefix sum). The
grids are flat over (row block, column block), and every offset is int64 (``pid`` is cast first), so
tensors above 2^31 elements are safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLAT_BLOCK = 4096    # elements per program in the flat kernels (16 per thread at 8 warps)
_TILE = 4096          # elements per program in the row kernels (rows x columns)
_MAX_MASK_DIMS = 4    # mask dims the flat kernels index by strides; more are materialised (rare)


# ---------------------------------------------------------------------------------------------------
# masked_fill
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _mask_offsets(i, s1, s2, s3, t0, t1, t2, t3):
    """Offsets into a mask with strides (t0..t3) for flat indices ``i`` into a tensor of shape
    (*, s1, s2, s3): a broadcast mask dim has stride 0. ``i`` is int64, so is the result."""
    c3 = i % s3
    i = i // s3
    c2 = i % s2
    i = i // s2
    c1 = i % s1
    c0 = i // s1
    return c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3


@triton.jit
def _block_and_mask(m_ptr, n, s1, s2, s3, t0, t1, t2, t3, MASK_FLAT: tl.constexpr, SMALL: tl.constexpr,
                    BLOCK: tl.constexpr):
    """This program's flat offsets (int64), which of them are in bounds, and the mask there.

    A broadcast mask needs each element's coordinates: a few divisions per element, which in int64 are
    long software routines on a GPU. ``SMALL`` (the tensor has fewer than 2^31 elements) does them in
    int32, where they are short."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    if MASK_FLAT:
        moffs = offs
    elif SMALL:
        moffs = _mask_offsets(offs.to(tl.int32), s1, s2, s3, t0, t1, t2, t3)
    else:
        moffs = _mask_offsets(offs, s1, s2, s3, t0, t1, t2, t3)
    m = tl.load(m_ptr + moffs, mask=inb, other=0) != 0
    return offs, inb, m


@triton.jit
def _masked_fill_kernel(x_ptr, m_ptr, v_ptr, out_ptr, n, s1, s2, s3, t0, t1, t2, t3,
                        MASK_FLAT: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr):
    offs, inb, m = _block_and_mask(m_ptr, n, s1, s2, s3, t0, t1, t2, t3, MASK_FLAT, SMALL, BLOCK)
    x = tl.load(x_ptr + offs, mask=inb, other=0)  # all of x: a per-element mask would stop vector loads
    v = tl.load(v_ptr)
    tl.store(out_ptr + offs, tl.where(m, v, x), mask=inb)


@triton.jit
def _masked_fill_backward_kernel(g_ptr, m_ptr, gx_ptr, part_ptr, n, s1, s2, s3, t0, t1, t2, t3,
                                 MASK_FLAT: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr):
    offs, inb, m = _block_and_mask(m_ptr, n, s1, s2, s3, t0, t1, t2, t3, MASK_FLAT, SMALL, BLOCK)
    g = tl.load(g_ptr + offs, mask=inb, other=0)
    tl.store(gx_ptr + offs, tl.where(m, tl.zeros_like(g), g), mask=inb)
    # This block's share of the value's gradient, in fp32; the host sums the partials in a fixed order.
    tl.store(part_ptr + tl.program_id(0), tl.sum(tl.where(m, g.to(tl.float32), 0.0), axis=0))


def _mask_layout(shape: torch.Size, mask: torch.Tensor) -> tuple[torch.Tensor, bool, list[int], list[int]]:
    """The mask as bytes, whether it is laid out like a contiguous self (flat), else the sizes (s1, s2, s3)
    and strides (t0..t3) of at most 4 merged dims through which the kernels read it."""
    m = mask.expand(shape)
    dims: list[list[int]] = []
    for size, stride in zip(shape, m.stride()):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:  # merges with the dim before it (stride-0 pairs too)
            dims[-1] = [dims[-1][0] * size, stride]
        else:
            dims.append([size, stride])
    if len(dims) > _MAX_MASK_DIMS:
        m, dims = m.contiguous(), [[m.numel(), 1]]
    flat = len(dims) == 0 or (len(dims) == 1 and dims[0][1] == 1)
    dims = [[1, 0]] * (_MAX_MASK_DIMS - len(dims)) + dims
    return m.view(torch.uint8), flat, [d[0] for d in dims[1:]], [d[1] for d in dims]


def masked_fill(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``where(mask, value, x)`` into a new contiguous tensor (mask broadcastable to x, value 0-dim)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    m, flat, sizes, strides = _mask_layout(x.shape, mask)
    value = value.to(x.dtype)  # rounded by torch (the interpreter's casts truncate), one element
    grid = (triton.cdiv(n, _FLAT_BLOCK),)
    _masked_fill_kernel[grid](x, m, value, out, n, *sizes, *strides, MASK_FLAT=flat, SMALL=n < 2**31,
                              BLOCK=_FLAT_BLOCK, num_warps=8)
    return out


def masked_fill_backward(grad: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad with masked positions zeroed, sum of grad over the mask in grad's dtype)."""
    grad = grad.contiguous()
    gx = torch.empty_like(grad)
    n = grad.numel()
    if n == 0:
        return gx, grad.new_zeros(())
    m, flat, sizes, strides = _mask_layout(grad.shape, mask)
    blocks = triton.cdiv(n, _FLAT_BLOCK)
    partials = torch.empty(blocks, dtype=torch.float32, device=grad.device)
    _masked_fill_backward_kernel[(blocks,)](grad, m, gx, partials, n, *sizes, *strides, MASK_FLAT=flat,
                                            SMALL=n < 2**31, BLOCK=_FLAT_BLOCK, num_warps=8)
    return gx, partials.sum().to(grad.dtype)


# ---------------------------------------------------------------------------------------------------
# row masks: counts, positions, select, merge
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _count_rows_kernel(m_ptr, counts_ptr, R, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    m = tl.load(m_ptr + rows, mask=rows < R, other=0) != 0
    tl.store(counts_ptr + pid, tl.sum(m.to(tl.int32), axis=0))


@triton.jit
def _select_rows_kernel(x_ptr, m_ptr, start_ptr, out_ptr, R, C, col_blocks,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program per (block of rows, block of columns); the grid is flat, so neither count is capped.
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // col_blocks
    cb = pid % col_blocks
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.load(m_ptr + rows, mask=rows < R, other=0) != 0
    mi = m.to(tl.int32)
    pos = tl.load(start_ptr + rb) + (tl.cumsum(mi, axis=0) - mi).to(tl.int64)
    ok = m[:, None] & (cols < C)[None, :]
    vals = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=ok)
    tl.store(out_ptr + pos[:, None] * C + cols[None, :], vals, mask=ok)


@triton.jit
def _merge_rows_kernel(base_ptr, m_ptr, start_ptr, src_ptr, out_ptr, R, C, n_src, col_blocks,
                       HAS_BASE: tl.constexpr, USE_POS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // col_blocks
    cb = pid % col_blocks
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    rin = rows < R
    m = tl.load(m_ptr + rows, mask=rin, other=0) != 0
    if USE_POS:
        mi = m.to(tl.int32)
        pos = tl.load(start_ptr + rb) + (tl.cumsum(mi, axis=0) - mi).to(tl.int64)
    else:  # one source row, broadcast to every kept row
        pos = tl.zeros([BLOCK_R], dtype=tl.int64)
    src_ok = m & (pos < n_src)  # never reads past the source, whatever the caller passed
    inb = rin[:, None] & (cols < C)[None, :]
    v = tl.load(src_ptr + pos[:, None] * C + cols[None, :], mask=inb & src_ok[:, None], other=0)
    v = v.to(out_ptr.dtype.element_ty)
    offs = rows[:, None] * C + cols[None, :]
    if HAS_BASE:  # rows that are not kept keep self's values; kept rows need not be read
        b = tl.load(base_ptr + offs, mask=inb & ~m[:, None], other=0)
        v = tl.where(m[:, None], v, b)
    tl.store(out_ptr + offs, v, mask=inb)


def _tile(C: int) -> tuple[int, int]:
    """(rows, columns) per program: up to 256 columns, at least 16 rows (one row per element if C == 1)."""
    block_c = min(triton.next_power_of_2(max(C, 1)), 256)
    return max(_TILE // block_c, 16), block_c


def _rows(x: torch.Tensor, m: int) -> tuple[int, int]:
    R = 1
    for s in x.shape[:m]:
        R *= s
    C = 1
    for s in x.shape[m:]:
        C *= s
    return R, C


def row_starts(mask: torch.Tensor, block_r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``block_r`` mask rows: (kept rows before the block (int64), kept rows up to its end)."""
    R = mask.numel()
    blocks = triton.cdiv(R, block_r)
    counts = torch.empty(blocks, dtype=torch.int32, device=mask.device)
    _count_rows_kernel[(blocks,)](mask, counts, R, BLOCK_R=block_r, num_warps=4)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    return ends - counts, ends


def _flat_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape(-1).contiguous().view(torch.uint8)


def mask_select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x[mask]`` (mask over x's leading dims): counts, prefix sum, one sync for the size, then a copy."""
    k = mask.dim()
    tail = tuple(x.shape[k:])
    R, C = _rows(x, k)
    if R == 0:
        return x.new_empty((0, *tail))
    mflat = _flat_mask(mask)
    block_r, block_c = _tile(C)
    starts, ends = row_starts(mflat, block_r)
    n_true = int(ends[-1])  # the one host sync: the output's size depends on the data
    out = x.new_empty((n_true, *tail))
    if n_true and C:
        col_blocks = triton.cdiv(C, block_c)
        _select_rows_kernel[(starts.numel() * col_blocks,)](x.contiguous(), mflat, starts, out, R, C,
                                                            col_blocks, BLOCK_R=block_r, BLOCK_C=block_c,
                                                            num_warps=8)
    return out


def merge_rows(base: torch.Tensor | None, mask: torch.Tensor, src: torch.Tensor, shape: torch.Size,
               dtype: torch.dtype, per_row: bool) -> torch.Tensor:
    """out[r] = mask[r] ? src[pos_r] : (base[r] if base is given else 0), out of ``shape`` and ``dtype``.

    ``src`` is (n_src, C) contiguous: one row per kept row (``per_row``; the caller has checked that
    n_src = n_true), or one row for every kept row."""
    k = mask.dim()
    out = torch.empty(shape, dtype=dtype, device=mask.device)
    R, C = _rows(out, k)
    if R == 0 or C == 0:
        return out
    mflat = _flat_mask(mask)
    block_r, block_c = _tile(C)
    blocks, col_blocks = triton.cdiv(R, block_r), triton.cdiv(C, block_c)
    # `out` stands in for pointers the kernel does not read (no positions, no base, an empty source)
    starts = row_starts(mflat, block_r)[0] if per_row else out
    base_arg = base.contiguous() if base is not None else out
    src_arg = src if src.numel() else out
    n_src = src.shape[0] if src.numel() else 0
    _merge_rows_kernel[(blocks * col_blocks,)](base_arg, mflat, starts, src_arg, out, R, C, n_src, col_blocks,
                                               HAS_BASE=base is not None, USE_POS=per_row,
                                               BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8)
    return out
