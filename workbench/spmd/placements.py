"""Placements as text, and DTensors built from a dense tensor with any placements (Partial included).

Text form, one entry per mesh dim, comma separated::

    "S(0),R"        Shard(0) over mesh dim 0, Replicate over mesh dim 1
    "P"             Partial(sum) on a 1-D mesh; also "P(sum)", "P(avg)", "P(max)", "P(min)"

``make_dtensor`` builds a DTensor whose ``full_tensor()`` is exactly the given dense tensor, with no
communication: shards are sliced locally, and a Partial is split into unequal per-rank pieces (so a rule
that forgets to reduce a Partial gives a visibly wrong answer, not an accidentally right one)::

    Partial(sum): rank c of g holds  t * (c+1) / (g(g+1)/2)      (pieces sum to t)
    Partial(avg): rank c holds       t * g (c+1) / (g(g+1)/2)    (pieces average to t)
    Partial(max): rank c holds       t - c                       (rank 0 holds the max)
    Partial(min): rank c holds       t + c
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

_RE = re.compile(r"^(R|S\((-?\d+)\)|P(?:\((sum|avg|max|min)\))?)$")


def parse_placement(text: str) -> Placement:
    m = _RE.match(text.strip().replace(" ", ""))
    if m is None:
        raise ValueError(f"cannot read placement {text!r}; write R, S(<dim>), P, or P(sum|avg|max|min)")
    if m.group(1) == "R":
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return Partial(m.group(3) or "sum")


def parse_placements(text: str | Sequence[Any], ndim: int | None = None) -> tuple[Placement, ...]:
    """``"S(0),R"`` -> ``(Shard(0), Replicate())``; a sequence of Placements passes through."""
    if isinstance(text, str):
        items = [parse_placement(t) for t in text.split(",") if t.strip()]
    else:
        items = [parse_placement(p) if isinstance(p, str) else p for p in text]
    if ndim is not None and len(items) != ndim:
        raise ValueError(f"{format_placements(items)!r} names {len(items)} mesh dims but the mesh has {ndim}; "
                         f"give one placement per mesh dim, e.g. {','.join(['R'] * ndim)!r}")
    return tuple(items)


def format_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        op = p.reduce_op
        return "P" if op == "sum" else f"P({op})"
    return repr(p)


def format_placements(ps: Sequence[Placement]) -> str:
    return ",".join(format_placement(p) for p in ps)


def _partial_piece(t: torch.Tensor, reduce_op: str, coord: int, size: int) -> torch.Tensor:
    if reduce_op in ("sum", "avg"):
        if not t.is_floating_point():
            raise ValueError(f"Partial({reduce_op}) needs a floating-point tensor, got {t.dtype}")
        w = (coord + 1) / (size * (size + 1) / 2)
        return t * (w * size if reduce_op == "avg" else w)
    if reduce_op == "max":
        return t - coord
    if reduce_op == "min":
        return t + coord
    raise ValueError(f"unsupported Partial reduce op {reduce_op!r}")


def make_dtensor(t: torch.Tensor, mesh, placements: Sequence[Placement], requires_grad: bool = False) -> DTensor:
    """A DTensor on ``mesh`` whose full value is ``t``, built from local data only (no collectives)."""
    from workbench.compat import compute_local_shape_and_global_offset

    placements = tuple(placements)
    local = t
    coords = mesh.get_coordinate()
    if coords is None:  # this rank is not in the mesh
        local = t.new_empty((0,))
    else:
        for i, p in enumerate(placements):
            if isinstance(p, Partial):
                local = _partial_piece(local, p.reduce_op, coords[i], mesh.size(i))
        shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        for d, (n, o) in enumerate(zip(shape, offset)):
            local = local.narrow(d, o, n) if local.ndim else local
        local = local.clone(memory_format=torch.contiguous_format)  # never a view of t: ops may write in place
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    if requires_grad:
        dt = dt.detach().requires_grad_(True)
    return dt


def default_candidates(t: Any) -> list[Placement]:
    """Replicate, and Shard(d) for every dim of ``t`` (none for a non-tensor or a 0-dim tensor)."""
    if not isinstance(t, torch.Tensor):
        return [Replicate()]
    return [Replicate()] + [Shard(d) for d in range(t.ndim)]
