"""``diff(a, b)``: what changed between two checkpoints, in names, shapes and values.

Keys are compared under canonical names (see :mod:`workbench.checkpoint.formats`), so a DCP step
directory diffs cleanly against its own safetensors export. Structure comes from metadata; values are
read one key at a time (two tensors in memory at once), and for each common key of equal shape::

    max_abs  = max |a - b|
    rel_norm = ||a - b||_2 / max(||a||_2, tiny)

The largest changes (by ``rel_norm``) answer "which layers moved most between step 100 and 200?".
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.checkpoint.formats import open_source
from workbench.kinds import checkpoint_kind

__all__ = ["diff", "CheckpointDiff"]


@dataclass
class CheckpointDiff:
    """Added, removed and changed (shape/dtype) keys of ``b`` relative to ``a``, and value changes."""

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, a_dtype, a_shape, b_dtype, b_shape
    values: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, max_abs, rel_norm, equal
    compared_values: bool = True

    @property
    def identical(self) -> bool:
        return (not self.added and not self.removed and self.changed.empty
                and (self.values.empty or bool(self.values["equal"].all())))

    def top(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` keys whose values changed most (relative norm of the difference)."""
        if self.values.empty:
            return self.values
        return self.values.sort_values(["rel_norm", "max_abs"], ascending=False).head(n).reset_index(drop=True)

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        changed = self.changed.assign(a_shape=self.changed.get("a_shape", pd.Series(dtype=object)).map(_list),
                                      b_shape=self.changed.get("b_shape", pd.Series(dtype=object)).map(_list))
        return {"a": self.a, "b": self.b, "identical": self.identical, "added": self.added, "removed": self.removed,
                "changed": changed.to_dict("records"),
                "n_compared": int(len(self.values)), "n_equal": int(self.values["equal"].sum()) if len(self.values) else 0,
                "top_changes": self.top(top).to_dict("records")}

    def to_json(self, top: int = 10) -> str:
        return json.dumps(self.to_dict(top), indent=2, default=str)

    def _repr_html_(self) -> str:
        head = (f"<b>CheckpointDiff</b> <code>{html.escape(self.a)}</code> &rarr; <code>{html.escape(self.b)}</code><br>"
                f"{len(self.added)} added, {len(self.removed)} removed, {len(self.changed)} changed shape/dtype"
                + (f", {int((~self.values['equal']).sum())} of {len(self.values)} values differ" if len(self.values) else ""))
        parts = [head]
        for title, keys in (("added", self.added), ("removed", self.removed)):
            if keys:
                parts.append(f"<details><summary>{title} ({len(keys)})</summary><pre>"
                             + html.escape("\n".join(keys[:200])) + "</pre></details>")
        if len(self.changed):
            parts.append(self.changed.to_html(index=False))
        if len(self.values):
            parts.append("<b>largest value changes</b>" + self.top(10).to_html(index=False, float_format="%.3e"))
        return "<div>" + "".join(parts) + "</div>"

    def __repr__(self) -> str:
        n = int((~self.values["equal"]).sum()) if len(self.values) else 0
        return (f"CheckpointDiff(added={len(self.added)}, removed={len(self.removed)}, changed={len(self.changed)}, "
                f"values_differ={n}/{len(self.values)})")


def _list(shape) -> list | None:
    return None if shape is None else list(shape)


def diff(a, b, *, values: bool = True, kinds: Iterable[str] | None = None, progress: bool = True) -> CheckpointDiff:
    """Compare checkpoints ``a`` and ``b`` (paths or manifests, any formats). ``values=False``: metadata only."""
    sa, sb = open_source(a), open_source(b)
    ra = {r["key"]: r for r in sa.canonical_rows()}
    rb = {r["key"]: r for r in sb.canonical_rows()}
    if kinds is not None:
        kinds = {checkpoint_kind(k) for k in kinds}  # "optim" -> "optimizer"; unknown: ValueError
        ra = {k: r for k, r in ra.items() if r["kind"] in kinds}
        rb = {k: r for k, r in rb.items() if r["kind"] in kinds}
    added = [k for k in rb if k not in ra]
    removed = [k for k in ra if k not in rb]
    common = [k for k in ra if k in rb]
    changed = [{"key": k, "kind": ra[k]["kind"], "a_dtype": ra[k]["dtype"], "a_shape": ra[k]["shape"],
                "b_dtype": rb[k]["dtype"], "b_shape": rb[k]["shape"]}
               for k in common if ra[k]["shape"] != rb[k]["shape"] or ra[k]["dtype"] != rb[k]["dtype"]]
    rows = []
    if values:
        same_shape = [k for k in common if ra[k]["shape"] == rb[k]["shape"]]
        for k in tqdm(same_shape, desc="diff", unit="tensor", disable=not progress, leave=False):
            ta, tb = sa.get(k), sb.get(k)
            rows.append({"key": k, "kind": ra[k]["kind"], **_value_change(ta, tb)})
            del ta, tb
    return CheckpointDiff(a=str(sa.manifest.path), b=str(sb.manifest.path), added=added, removed=removed,
                          changed=pd.DataFrame(changed, columns=["key", "kind", "a_dtype", "a_shape", "b_dtype", "b_shape"]),
                          values=pd.DataFrame(rows, columns=["key", "kind", "max_abs", "rel_norm", "equal"]),
                          compared_values=values)


def _value_change(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    if not (a.is_floating_point() or b.is_floating_point()):
        equal = bool(torch.equal(a, b))
        d = (a.long() - b.long()).abs() if a.numel() else torch.zeros(1)
        return {"max_abs": float(d.max()) if d.numel() else 0.0, "rel_norm": 0.0 if equal else 1.0, "equal": equal}
    # in fp32 (float8 has no arithmetic kernels; fp32 holds every 8/16-bit float exactly). A NaN in the same
    # place of both is no change: FP8 checkpoints carry them (e4m3fn's only non-finite value).
    a32, b32 = a.float(), b.float()
    d = (a32 - b32).masked_fill(a32.isnan() & b32.isnan(), 0.0)
    max_abs = float(d.abs().max()) if d.numel() else 0.0
    na = float(a32[a32.isfinite()].norm()) if a32.numel() else 0.0
    rel = float(d.norm()) / max(na, 1e-12) if d.numel() else 0.0
    if a.dtype == b.dtype:  # bit for bit, so that identical NaNs compare equal
        equal = bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    else:
        equal = max_abs == 0.0
    return {"max_abs": max_abs, "rel_norm": rel, "equal": equal}
