"""Triton kernels of ``workbench::index_put`` and its backward, on the flattened core case.

:mod:`workbench.kernels.index_put` reduces every call to rows: ``out`` is ``(R, D)`` contiguous, ``rows``
holds K row ids already wrapped and bounds-checked (int32 when R < 2^31, else int64) and ``vals`` is a
``(K, D)`` view with any strides (stride 0 where values were broadcast: never materialised)::

    accumulate, deterministic   out[r] += sum_{k: rows[k] = r} vals[k]     summed in stable-sorted k order
    accumulate, atomics         out[r] += vals[k]  for each k, in whatever order the atomics land
    overwrite                   out[r]  = vals[max{k: rows[k] = r}]        the last writer wins

Deterministic accumulate, a sort and one segmented pass (no atomics)::

    order  = stable_argsort(rows)          s = rows[order]  = [3 3 3 5 8 8 ...]
    lane i starts a segment if i = 0 or s[i] != s[i-1]; it walks its segment in order:
    acc = 0;  acc += vals[order[i]];  acc += vals[order[i+1]];  ...  while s[i+j] = s[i]
    out[s[i]] = round(float(out[s[i]]) + acc)                         one store per distinct row

Each sum is taken left to right in fp32 over the stable order, so it is the same bits on every run and
equal to the torch reference, which sums the same way. The price: a row repeated m times costs its lane
m dependent steps (an embedding's most frequent token sets the pace of its block).

Overwrite, two passes: ``win[r] = atomic_max(k)`` over all writers of r, then only the k with
``win[rows[k]] = k`` stores its row, so duplicates end the same on every run.

All offsets are int64 (``pid.to(tl.int64)``, row ids widened before multiplying by D): R * D may exceed
2^31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels.triton_common import round_to

_TILE = 4096  # elements per program: BLOCK_K * BLOCK_D


def _blocks(k: int, d: int) -> tuple[int, int, tuple[int]]:
    block_d = min(triton.next_power_of_2(max(d, 1)), 128)
    block_k = max(1, min(_TILE // block_d, triton.next_power_of_2(max(k, 1))))
    return block_k, block_d, (triton.cdiv(k, block_k) * triton.cdiv(d, block_d),)


@triton.jit
def _tile(D, BLOCK_D: tl.constexpr):
    # One flat grid axis (2^31 - 1 programs) split into (row block, column block): axis 1 of a CUDA grid
    # stops at 65535 blocks, which a wide D would pass.
    pid = tl.program_id(0).to(tl.int64)
    nd = tl.cdiv(D, BLOCK_D)
    return pid // nd, pid % nd


@triton.jit
def _segment_sum_kernel(out_ptr, sorted_ptr, order_ptr, vals_ptr, K, D, sv0, sv1,
                        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_k, pid_d = _tile(D, BLOCK_D)
    pos = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    inb = pos < K
    row = tl.load(sorted_ptr + pos, mask=inb, other=-1).to(tl.int64)
    prev = tl.load(sorted_ptr + pos - 1, mask=inb & (pos > 0), other=-1).to(tl.int64)
    start = inb & ((pos == 0) | (row != prev))
    # Each segment start walks its own run in sorted order; the other lanes idle.
    acc = tl.zeros((BLOCK_K, BLOCK_D), dtype=tl.float32)
    p = pos
    active = start
    while tl.sum(active.to(tl.int32), axis=0) > 0:
        src = tl.load(order_ptr + p, mask=active, other=0).to(tl.int64)
        v = tl.load(vals_ptr + src[:, None] * sv0 + cols[None, :] * sv1,
                    mask=active[:, None] & cmask[None, :], other=0.0)
        # only active lanes add: acc + 0.0 would turn a -0.0 sum into +0.0, unlike the reference
        acc = tl.where(active[:, None], acc + v.to(tl.float32), acc)
        p += 1
        nxt = tl.load(sorted_ptr + p, mask=active & (p < K), other=-1).to(tl.int64)
        active = active & (p < K) & (nxt == row)
    m = start[:, None] & cmask[None, :]
    optr = out_ptr + row[:, None] * D + cols[None, :]
    old = tl.load(optr, mask=m, other=0.0)
    tl.store(optr, round_to(old.to(tl.float32) + acc, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _atomic_add_kernel(ws_ptr, rows_ptr, vals_ptr, K, D, sv0, sv1,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_k, pid_d = _tile(D, BLOCK_D)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (ks < K)[:, None] & (cols < D)[None, :]
    row = tl.load(rows_ptr + ks, mask=ks < K, other=0).to(tl.int64)
    v = tl.load(vals_ptr + ks[:, None] * sv0 + cols[None, :] * sv1, mask=m, other=0.0)
    tl.atomic_add(ws_ptr + row[:, None] * D + cols[None, :], v.to(tl.float32), mask=m)


@triton.jit
def _last_writer_kernel(win_ptr, rows_ptr, K, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ks = pid * BLOCK + tl.arange(0, BLOCK)
    m = ks < K
    row = tl.load(rows_ptr + ks, mask=m, other=0).to(tl.int64)
    tl.atomic_max(win_ptr + row, ks.to(win_ptr.dtype.element_ty), mask=m)


@triton.jit
def _overwrite_kernel(out_ptr, rows_ptr, win_ptr, vals_ptr, K, D, sv0, sv1,
                      BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_k, pid_d = _tile(D, BLOCK_D)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(rows_ptr + ks, mask=ks < K, other=0).to(tl.int64)
    won = (ks < K) & (tl.load(win_ptr + row, mask=ks < K, other=-1).to(tl.int64) == ks)
    m = won[:, None] & (cols < D)[None, :]
    v = tl.load(vals_ptr + ks[:, None] * sv0 + cols[None, :] * sv1, mask=m)
    tl.store(out_ptr + row[:, None] * D + cols[None, :], v, mask=m)


@triton.jit
def _gather_kernel(dst_ptr, src_ptr, rows_ptr, win_ptr, K, D, ss0, ss1,
                   LAST_WRITER: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_k, pid_d = _tile(D, BLOCK_D)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = (ks < K)[:, None] & (cols < D)[None, :]
    row = tl.load(rows_ptr + ks, mask=ks < K, other=0).to(tl.int64)
    keep = ks < K
    if LAST_WRITER:
        keep = keep & (tl.load(win_ptr + row, mask=ks < K, other=-1).to(tl.int64) == ks)
    v = tl.load(src_ptr + row[:, None] * ss0 + cols[None, :] * ss1, mask=m & keep[:, None], other=0.0)
    tl.store(dst_ptr + ks[:, None] * D + cols[None, :], v, mask=m)


def accumulate_sorted(out: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[rows[k]] += vals[k]``, each row's sum taken in stable-sorted k order in fp32 (in place)."""
    k, d = vals.shape
    srt, order = torch.sort(rows, stable=True)
    bk, bd, grid = _blocks(k, d)
    _segment_sum_kernel[grid](out, srt, order, vals, k, d, vals.stride(0), vals.stride(1),
                              BLOCK_K=bk, BLOCK_D=bd)


def accumulate_atomic(out: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[rows[k]] += vals[k]`` with fp32 atomics (in place). A bf16/fp16 ``out`` accumulates in an
    fp32 copy of itself that is rounded once at the end (fp32 atomics on every GPU, one rounding)."""
    k, d = vals.shape
    ws = out if out.dtype == torch.float32 else out.to(torch.float32)
    bk, bd, grid = _blocks(k, d)
    _atomic_add_kernel[grid](ws, rows, vals, k, d, vals.stride(0), vals.stride(1), BLOCK_K=bk, BLOCK_D=bd)
    if ws is not out:
        out.copy_(ws)


def last_writers(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``win[r]`` = the largest k with ``rows[k] = r`` (-1 where none): the writer that wins row r."""
    k = rows.numel()
    win = torch.full((num_rows,), -1, dtype=torch.int32 if k < 2**31 else torch.int64, device=rows.device)
    block = min(1024, triton.next_power_of_2(max(k, 1)))
    _last_writer_kernel[(triton.cdiv(k, block),)](win, rows, k, BLOCK=block)
    return win


def overwrite(out: torch.Tensor, rows: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[rows[k]] = vals[k]``, the largest k winning each row (in place)."""
    k, d = vals.shape
    win = last_writers(rows, out.shape[0])
    bk, bd, grid = _blocks(k, d)
    _overwrite_kernel[grid](out, rows, win, vals, k, d, vals.stride(0), vals.stride(1), BLOCK_K=bk, BLOCK_D=bd)


def gather_rows(src: torch.Tensor, rows: torch.Tensor, last_writer: bool) -> torch.Tensor:
    """``(K, D)``: ``src[rows[k]]``; with ``last_writer`` only the winning k of each row gets it, the rest 0."""
    k, d = rows.numel(), src.shape[1]
    dst = src.new_empty((k, d))
    win = last_writers(rows, src.shape[0]) if last_writer else rows
    bk, bd, grid = _blocks(k, d)
    _gather_kernel[grid](dst, src, rows, win, k, d, src.stride(0), src.stride(1),
                         LAST_WRITER=last_writer, BLOCK_K=bk, BLOCK_D=bd)
    return dst
