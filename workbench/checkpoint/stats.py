"""``tensor_stats(checkpoint, key)``: the numbers of one stored tensor, read on its own.

    >>> from workbench.checkpoint import tensor_stats
    >>> s = tensor_stats("runs/r1", "model.layers.0.attention.wq.weight", bins=40)
    >>> s["mean"], s["std"], s["histogram"]["counts"][:3]

Only that tensor is read (one DCP chunk set, one safetensors slice), so a 70B checkpoint answers as fast
as a tiny one. Statistics are over the finite values; ``non_finite`` counts the rest.

Any dtype works, FP8 included (``float8_e4m3fn``, ``float8_e5m2``, ``float8_e8m0fnu``): most torch ops and
``.numpy()`` have no float8 kernels, so values are upcast to fp32 first (exact for every 8- and 16-bit
float) and summed in float64.

``log=True`` draws the histogram over ``log10 |x|`` of the finite non-zero values (zeros have no logarithm;
they are counted in ``zeros``): an Adam second moment spans ten decades, and on a linear axis all of it
lands in the first bin::

    >>> tensor_stats("runs/r1", "optim.state.output.weight.exp_avg_sq", bins=40, log=True)["histogram"]
    {"centers": [...], "counts": [...], "width": ..., "scale": "log10|x|", "excluded": 0}

Packed optimizer hyper-parameters (``optim.hyper.<digest>``) are stored as uint8 tensors, but they hold
UTF-8 JSON, not numbers: asking for their statistics is a ValueError that points to ``ckpt inspect``
(:mod:`workbench.checkpoint.param_groups` lists their values, one row per param group).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from workbench.checkpoint.formats import TensorSource, open_source
from workbench.checkpoint.manifest import CheckpointManifest

__all__ = ["tensor_stats"]


MAX_BINS = 10_000  # histogram bins: more than a terminal or a plot can show (and each is a Python float)


def _canonical_key(source: TensorSource, key: str) -> str:
    """Accept the key as the manifest lists it (stored) or as the workbench names it (canonical)."""
    if key in source.keys:
        return key
    for canon, stored in source.keys.items():
        if stored == key:
            return canon
    return key  # source.get raises a KeyError naming close matches


def tensor_stats(src: "str | os.PathLike | CheckpointManifest | TensorSource", key: str,
                 bins: int = 0, log: bool = False) -> dict[str, Any]:
    """``key, numel, dtype, min, max, mean, std, abs_mean, norm, zeros, non_finite`` of one tensor.

    With ``bins > 0`` also ``histogram``: ``{"centers", "counts", "width", "scale", "excluded"}`` over
    ``[min, max]`` of the finite values (``scale`` "linear"), or with ``log=True`` over ``log10 |x|`` of the
    finite non-zero values (``scale`` "log10|x|"; ``excluded`` counts the zeros left out). Empty lists when
    there is nothing to count. ``src`` is anything :func:`inspect` accepts, or an open source (reuse one to
    read many tensors without re-reading the metadata).
    """
    from workbench.checkpoint.state import is_packed_hyper

    if isinstance(bins, bool) or not isinstance(bins, int) or not 0 <= bins <= MAX_BINS:
        raise ValueError(f"bins={bins!r} must be an integer from 0 (no histogram) to {MAX_BINS:,}")
    source = open_source(src)
    canon = _canonical_key(source, key)
    if is_packed_hyper(canon) or is_packed_hyper(key):
        raise ValueError(f"{key!r} is packed optimizer hyper-parameters (UTF-8 JSON in a uint8 tensor), not numbers "
                         f"to summarise; `workbench ckpt inspect {source.manifest.path}` lists their values, one "
                         "row per param group")
    t = source.get(canon).detach()
    x = (t.float() if t.is_floating_point() else t).to(torch.float64)
    finite = x[torch.isfinite(x)]
    n = finite.numel()
    stats: dict[str, Any] = {
        "key": key, "numel": t.numel(), "dtype": str(t.dtype).removeprefix("torch."),
        "min": float(finite.min()) if n else math.nan,
        "max": float(finite.max()) if n else math.nan,
        "mean": float(finite.mean()) if n else math.nan,
        "std": float(finite.std()) if n > 1 else 0.0,
        "abs_mean": float(finite.abs().mean()) if n else math.nan,
        "norm": float(finite.norm()) if n else 0.0,
        "zeros": int((x == 0).sum()), "non_finite": int(t.numel() - n),
    }
    if bins > 0:
        stats["histogram"] = _histogram(finite, bins, log)
    return stats


def _histogram(finite: torch.Tensor, bins: int, log: bool) -> dict[str, Any]:
    values, excluded = finite, 0
    if log:
        nonzero = finite[finite != 0]
        excluded = finite.numel() - nonzero.numel()
        values = nonzero.abs().log10()
    scale = "log10|x|" if log else "linear"
    if not values.numel():
        return {"centers": [], "counts": [], "width": 0.0, "scale": scale, "excluded": excluded}
    lo, hi = float(values.min()), float(values.max())
    hi = hi if hi > lo else lo + 1
    counts = torch.histc(values, bins=bins, min=lo, max=hi)
    width = (hi - lo) / bins
    return {"centers": [lo + (i + 0.5) * width for i in range(bins)], "counts": [int(c) for c in counts.tolist()],
            "width": width, "scale": scale, "excluded": excluded}
