"""Triton helpers our kernels share (imported only by the ``triton_*`` kernel modules)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(v, ty: tl.constexpr):
    """fp32 -> ``ty``, round to nearest even, like torch. bfloat16 is rounded on its bits (NaN -> 0x7FC0:
    the add could carry a NaN payload into inf) because Triton's interpreter truncates that conversion;
    on a GPU the result is the same as ``v.to(ty)``, and the reference path's exact bits hold everywhere."""
    if ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
        bits = tl.where(v != v, 0x7FC0, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(ty)
