"""``diff(a, b)``: what changed between two checkpoints, in names, shapes and values.

Keys are compared under canonical names (see :mod:`workbench.checkpoint.formats`), so a DCP step
directory diffs cleanly against its own safetensors export. Structure comes from metadata; values are
read one key at a time (two tensors in memory at once), and for each common key of equal shape::

    max_abs  = max |a - b|
    rel_norm = ||a - b||_2 / max(||a||_2, tiny)

The largest changes (by ``rel_norm``) answer "which layers moved most between step 100 and 200?". They
are ranked within each *tensor kind* (:func:`tensor_kind`: ``model``, ``optimizer exp_avg``, ``optimizer
exp_avg_sq``, ``optimizer step``, ``rng``, ``ema``, ...), because an optimizer's second moment can move by
tens of times its norm in one step while the weights move by a few percent: one global ranking would show
nothing but ``exp_avg_sq``. Optimizer hyper-parameters are not ranked; their changes are folded, one row
per (name, old value, new value), in :meth:`CheckpointDiff.hyperparameter_changes`.
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
from workbench.checkpoint.manifest import is_hyperparameter
from workbench.kinds import CHECKPOINT_KINDS, checkpoint_kind

__all__ = ["diff", "CheckpointDiff", "tensor_kind", "HYPERPARAMETER"]

HYPERPARAMETER = "optimizer hyper-parameter"
_QUANT_PARTS = ("q", "qscale")  # optim.state.<fqn>.exp_avg.q|qscale (workbench.checkpoint.quant)


def tensor_kind(key: str, kind: str) -> str:
    """What a tensor is, finer than its checkpoint kind: the optimizer state's name, ema/sched apart.

    ``optim.state.layers.0.attention.wq.weight.exp_avg_sq`` -> ``optimizer exp_avg_sq``;
    ``model.norm.weight`` -> ``model``; ``ema.norm.weight`` -> ``ema``; ``optim.param_groups.x.lr`` ->
    ``optimizer hyper-parameter``.
    """
    if is_hyperparameter(key):
        return HYPERPARAMETER
    parts = key.split(".")
    if kind == "optimizer" and len(parts) > 1:
        name = parts[-1]
        if name in _QUANT_PARTS and len(parts) > 2:
            name = f"{parts[-2]}.{name}"
        return f"optimizer {name}"
    if kind == "extra" and parts[0] in ("ema", "sched"):
        return parts[0]
    return kind


_CHANGED_COLUMNS = ["key", "kind", "a_dtype", "a_shape", "b_dtype", "b_shape"]
_VALUE_COLUMNS = ["key", "kind", "tensor_kind", "max_abs", "rel_norm", "equal"]


def _kind_order(tk: str) -> tuple[int, str]:
    kind = tk.split(" ", 1)[0]
    kind = {"ema": "extra", "sched": "extra"}.get(kind, kind)
    return (CHECKPOINT_KINDS.index(kind) if kind in CHECKPOINT_KINDS else len(CHECKPOINT_KINDS), tk)


@dataclass
class CheckpointDiff:
    """Added, removed and changed (shape/dtype) keys of ``b`` relative to ``a``, and value changes."""

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, a_dtype, a_shape, b_dtype, b_shape
    values: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, tensor_kind, max_abs, rel_norm, equal
    compared_values: bool = True
    hyper: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, name, a, b (the values of hyper-parameters)
    kinds: list[str] | None = None  # the checkpoint kinds compared (None: all)

    @property
    def identical(self) -> bool:
        return (not self.added and not self.removed and self.changed.empty
                and (self.values.empty or bool(self.values["equal"].all())) and self.hyperparameter_changes().empty)

    @property
    def n_differ(self) -> int:
        return int((~self.values["equal"]).sum()) if len(self.values) else 0

    def _ranked(self) -> pd.DataFrame:
        v = self.values
        if v.empty:
            return v
        return v[~v["equal"] & (v["tensor_kind"] != HYPERPARAMETER)]

    def top(self, n: int = 10, *, per_kind: bool = True, kind: str | None = None) -> pd.DataFrame:
        """The keys whose values changed most (relative norm of the difference), unchanged keys left out.

        ``per_kind``: the ``n`` largest of each tensor kind (:func:`tensor_kind`), kinds in checkpoint-kind
        order; else the ``n`` largest overall. ``kind``: only this checkpoint kind (``model``, ``optim``...).
        Hyper-parameters are not ranked (see :meth:`hyperparameter_changes`).
        """
        v = self._ranked()
        if not v.empty and kind is not None:
            v = v[v["kind"] == checkpoint_kind(kind)]
        if v.empty:
            return v.reset_index(drop=True)
        v = v.sort_values(["rel_norm", "max_abs"], ascending=False, kind="stable")
        if not per_kind:
            return v.head(n).reset_index(drop=True)
        parts = [g.head(n) for _, g in sorted(v.groupby("tensor_kind", sort=False), key=lambda x: _kind_order(x[0]))]
        return pd.concat(parts).reset_index(drop=True)

    def by_tensor_kind(self) -> pd.DataFrame:
        """Per tensor kind: ``tensor_kind, kind, compared, changed, max_rel_norm`` (the largest change)."""
        cols = ["tensor_kind", "kind", "compared", "changed", "max_rel_norm"]
        v = self.values
        if v.empty:
            return pd.DataFrame(columns=cols)
        rows = []
        for tk, g in sorted(v.groupby("tensor_kind", sort=False), key=lambda x: _kind_order(x[0])):
            moved = g[~g["equal"]]
            rows.append({"tensor_kind": tk, "kind": g["kind"].iloc[0], "compared": len(g), "changed": len(moved),
                         "max_rel_norm": float(moved["rel_norm"].max()) if len(moved) else 0.0})
        return pd.DataFrame(rows, columns=cols)

    def hyperparameter_changes(self) -> pd.DataFrame:
        """Changed optimizer hyper-parameters, folded: ``name, a, b, params`` (how many entries changed so)."""
        cols = ["name", "a", "b", "params"]
        h = self.hyper
        if h.empty:
            return pd.DataFrame(columns=cols)
        moved = h[h["a"].map(repr) != h["b"].map(repr)]
        rows: dict[tuple, dict] = {}
        for r in moved.itertuples(index=False):
            k = (r.name, repr(r.a), repr(r.b))
            rows.setdefault(k, {"name": r.name, "a": r.a, "b": r.b, "params": 0})["params"] += 1
        return pd.DataFrame(list(rows.values()), columns=cols)

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        changed = self.changed.assign(a_shape=self.changed.get("a_shape", pd.Series(dtype=object)).map(_list),
                                      b_shape=self.changed.get("b_shape", pd.Series(dtype=object)).map(_list))
        return {"a": self.a, "b": self.b, "identical": self.identical, "added": self.added, "removed": self.removed,
                "changed": changed.to_dict("records"), "kinds": self.kinds,
                "n_compared": int(len(self.values)), "n_equal": int(self.values["equal"].sum()) if len(self.values) else 0,
                "by_tensor_kind": self.by_tensor_kind().to_dict("records"),
                "top_changes": self.top(top).to_dict("records"),
                "hyperparameter_changes": self.hyperparameter_changes().to_dict("records")}

    def to_json(self, top: int = 10) -> str:
        return json.dumps(self.to_dict(top), indent=2, default=str)

    def summary_line(self) -> str:
        """``0 added, 0 removed, 0 changed shape/dtype, 245 of 681 values differ``."""
        return (f"{len(self.added)} added, {len(self.removed)} removed, {len(self.changed)} changed shape/dtype"
                + (f", {self.n_differ} of {len(self.values)} values differ" if self.compared_values else "")
                + (f" (kinds: {', '.join(self.kinds)})" if self.kinds else ""))

    def _repr_html_(self) -> str:
        # Block elements (<p>, <h4>, tables) and spaces around inline ones: the text never runs together,
        # rendered or copied (textContent).
        esc = html.escape
        parts = [f"<p><b>CheckpointDiff</b> <code>{esc(self.a)}</code> &rarr; <code>{esc(self.b)}</code></p>",
                 f"<p>{esc(self.summary_line())}</p>"]
        for title, keys in (("added", self.added), ("removed", self.removed)):
            if keys:
                parts.append(f"<details><summary>{title} ({len(keys)})</summary> <pre>"
                             + esc("\n".join(keys[:200])) + "</pre></details>")
        if len(self.changed):
            parts.append("<h4>changed shape or dtype</h4> " + self.changed.to_html(index=False))
        if len(self.values):
            kinds = self.by_tensor_kind()
            parts.append("<h4>values by tensor kind</h4> " + kinds.to_html(index=False, float_format="%.3e"))
        top = self.top(5)
        if len(top):
            parts.append("<h4>largest value changes per tensor kind (||b - a|| / ||a||)</h4> "
                         + top[["tensor_kind", "key", "rel_norm", "max_abs"]].to_html(index=False, float_format="%.3e"))
        hyper = self.hyperparameter_changes()
        if len(hyper):
            from workbench.checkpoint.param_groups import format_value

            parts.append("<h4>optimizer hyper-parameters changed</h4> <ul>" + "".join(
                f"<li>{esc(r.name)}: {esc(format_value(r.a))} &rarr; {esc(format_value(r.b))} ({r.params} params)</li>"
                for r in hyper.itertuples(index=False)) + "</ul>")
        return "<div>" + "\n".join(parts) + "</div>"

    def __repr__(self) -> str:
        return (f"CheckpointDiff(added={len(self.added)}, removed={len(self.removed)}, changed={len(self.changed)}, "
                f"values_differ={self.n_differ}/{len(self.values)})")


def _list(shape) -> list | None:
    return None if shape is None else list(shape)


def diff(a, b, *, values: bool = True, kinds: Iterable[str] | None = None, progress: bool = True) -> CheckpointDiff:
    """Compare checkpoints ``a`` and ``b`` (paths or manifests, any formats). ``values=False``: metadata only.

    ``kinds``: only these checkpoint kinds (``model``, ``optim``/``optimizer``, ``master``, ``rng``, ``extra``).
    """
    sa, sb = open_source(a), open_source(b)
    ra = {r["key"]: r for r in sa.canonical_rows()}
    rb = {r["key"]: r for r in sb.canonical_rows()}
    if kinds is not None:
        kinds = [k for k in CHECKPOINT_KINDS if k in {checkpoint_kind(k) for k in kinds}]  # "optim" -> "optimizer"
        ra = {k: r for k, r in ra.items() if r["kind"] in kinds}
        rb = {k: r for k, r in rb.items() if r["kind"] in kinds}
    # Packed hyperparameters (optim.hyper.<digest>: JSON, the digest of its content) are compared by value,
    # parameter by parameter, never as bytes: their keys differ whenever a value does.
    pa = [k for k in ra if k.startswith(_PACKED)]
    pb = [k for k in rb if k.startswith(_PACKED)]
    ra = {k: r for k, r in ra.items() if not k.startswith(_PACKED)}
    rb = {k: r for k, r in rb.items() if not k.startswith(_PACKED)}
    added = [k for k in rb if k not in ra]
    removed = [k for k in ra if k not in rb]
    common = [k for k in ra if k in rb]
    changed = [{"key": k, "kind": ra[k]["kind"], "a_dtype": ra[k]["dtype"], "a_shape": ra[k]["shape"],
                "b_dtype": rb[k]["dtype"], "b_shape": rb[k]["shape"]}
               for k in common if ra[k]["shape"] != rb[k]["shape"] or ra[k]["dtype"] != rb[k]["dtype"]]
    rows, hyper = [], []
    if values:
        same_shape = [k for k in common if ra[k]["shape"] == rb[k]["shape"]]
        for k in tqdm(same_shape, desc="diff", unit="tensor", disable=not progress, leave=False):
            ta, tb = sa.get(k), sb.get(k)
            tk = tensor_kind(k, ra[k]["kind"])
            rows.append({"key": k, "kind": ra[k]["kind"], "tensor_kind": tk, **_value_change(ta, tb)})
            if tk == HYPERPARAMETER and ta.numel() <= 64:
                hyper.append({"key": k, "name": k.rsplit(".", 1)[-1], "a": _plain(ta), "b": _plain(tb)})
            del ta, tb
        if pa or pb:
            hyper += _packed_changes([sa.get(k) for k in pa], [sb.get(k) for k in pb])
    elif bool(pa) != bool(pb) or (pa and set(pa) != set(pb)):
        changed.append({"key": "optim.hyper", "kind": "optimizer", "a_dtype": "json", "a_shape": None,
                        "b_dtype": "json", "b_shape": None})
    return CheckpointDiff(a=str(sa.manifest.path), b=str(sb.manifest.path), added=added, removed=removed,
                          changed=pd.DataFrame(changed, columns=_CHANGED_COLUMNS),
                          values=pd.DataFrame(rows, columns=_VALUE_COLUMNS), compared_values=values,
                          hyper=pd.DataFrame(hyper, columns=["key", "name", "a", "b"]),
                          kinds=None if kinds is None else list(kinds))


_PACKED = "optim.hyper."


def _packed_changes(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[dict[str, Any]]:
    """One row per parameter and hyper-parameter in either side's packed items (``a``/``b`` None where a
    side lacks it), keyed as the per-key format would be."""
    from workbench.checkpoint.param_groups import _python
    from workbench.checkpoint.state import unpack_hyper

    ha, hb = unpack_hyper(a), unpack_hyper(b)
    rows = []
    for fqn in sorted(set(ha) | set(hb)):
        va, vb = ha.get(fqn, {}), hb.get(fqn, {})
        for name in sorted(set(va) | set(vb)):
            rows.append({"key": f"optim.param_groups.{fqn}.{name}", "name": name,
                         "a": _python(va.get(name)), "b": _python(vb.get(name))})
    return rows


def _plain(t: torch.Tensor) -> Any:
    """A small tensor as a Python value: 0-d -> scalar, else a tuple (hyper-parameters: lr, betas)."""
    return t.item() if t.dim() == 0 else tuple(t.reshape(-1).tolist())


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
