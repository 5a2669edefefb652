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
nothing but ``exp_avg_sq``.

Optimizer hyper-parameters are not tensors to rank. Whatever their storage (one 0-d/1-d tensor per
parameter and name, ``optim.param_groups.<fqn>.<name>``, as saves wrote them before the packing; or packed,
``optim.hyper.<digest>``: every parameter's values as UTF-8 JSON in a uint8 tensor), both sides are decoded
to ``<fqn>.<name> -> value`` and compared parameter by parameter, so a packed checkpoint diffs against an
old one too. Their changes are folded, one row per (name, old value, new value) with the number of
parameters that changed so, in :meth:`CheckpointDiff.hyperparameter_changes`; a packed item's bytes are
never compared, ranked or counted as values (its key is the digest of its content, so it differs whenever
any value does).

The verdict (:attr:`CheckpointDiff.verdict`, one line in :meth:`CheckpointDiff.banner`) is about tensors:

* ``different``: in some tensor kind both sides hold, a value, shape or dtype differs, or a key is on one
  side only; or hyper-parameter values differ where both sides hold them. The banner names those kinds.
* ``equal``: every tensor both sides hold is equal, and what is left are whole kinds that one side does not
  hold at all (a Hugging Face export has no RNG states, scheduler or step counters, and without
  ``--include optimizer`` no optimizer state): "only in A/B", by kind (:attr:`only_in_a`), not a difference.
* ``identical``: equal, and nothing is on one side only. ``not compared``: values not read, keys and
  shapes the same.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

import pandas as pd
import torch
from workbench.progress import tqdm

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
    """Added, removed and changed (shape/dtype) keys of ``b`` relative to ``a``, and value changes.

    ``added``/``removed``: keys of a tensor kind both sides hold, on one side only (a difference).
    ``only_in_a``/``only_in_b``: tensor kind -> keys, for kinds the other side holds none of (a format that
    does not carry them: not a difference); hyper-parameters under ``optimizer hyper-parameter`` (their
    ``<fqn>.<name>`` values when read, else the stored entries).
    """

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, a_dtype, a_shape, b_dtype, b_shape
    values: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, kind, tensor_kind, max_abs, rel_norm, equal
    compared_values: bool = True
    hyper: pd.DataFrame = field(default_factory=pd.DataFrame)  # key, name, a, b (the values of hyper-parameters)
    kinds: list[str] | None = None  # the checkpoint kinds compared (None: all)
    # how the hyper-parameters were compared: "" (neither side has any), "one side" (only one side has any: see
    # only_in_a/b), "values" (decoded, see ``hyper``), or without values: "same" (the same packed items),
    # "differ" (other items or entries), "not compared"
    hyper_status: str = ""
    packed: dict[str, list[str]] = field(default_factory=dict)  # "a"/"b" -> the optim.hyper.* items (JSON)
    only_in_a: dict[str, list[str]] = field(default_factory=dict)  # tensor kind -> keys (kinds b has none of)
    only_in_b: dict[str, list[str]] = field(default_factory=dict)
    kind_of: dict[str, str] = field(default_factory=dict)  # key -> tensor kind, for added/removed/changed keys
    n_common: int = 0  # keys on both sides (compared by name, shape and dtype; by value when values=True)

    @property
    def identical(self) -> bool:
        """Nothing differs in what was compared (no kind in :meth:`kind_differences`), and no kind is on one
        side only. True for the ``not compared`` verdict too: ask :attr:`verdict` whether values were read."""
        return not self.differ_kinds() and not self.only_in_a and not self.only_in_b

    def kind_differences(self) -> pd.DataFrame:
        """Per tensor kind that differs: ``tensor_kind, values_differ, compared, changed, only_in_a, only_in_b``
        (values that differ of those compared, keys whose shape or dtype changed, keys on one side only
        within a kind both sides hold), in checkpoint-kind order; hyper-parameter values as their kind."""
        cols = ["tensor_kind", "values_differ", "compared", "changed", "only_in_a", "only_in_b"]
        rows: dict[str, dict[str, int]] = {}

        def bump(tk: str, col: str, n: int = 1) -> None:
            rows.setdefault(tk, dict.fromkeys(cols[1:], 0))[col] += n

        v = self.values
        for tk, g in (v.groupby("tensor_kind", sort=False) if len(v) else ()):
            bump(tk, "compared", len(g))
            bump(tk, "values_differ", int((~g["equal"]).sum()))
        for k in self.changed["key"] if len(self.changed) else ():
            bump(self.kind_of.get(k, "model"), "changed")
        for col, keys in (("only_in_a", self.removed), ("only_in_b", self.added)):
            for k in keys:
                bump(self.kind_of.get(k, "model"), col)
        if len(self.hyper):
            bump(HYPERPARAMETER, "compared", len(self.hyper))
            bump(HYPERPARAMETER, "values_differ", self.n_hyper_differ)
        elif self.hyper_status == "differ":
            bump(HYPERPARAMETER, "values_differ")
        out = [{"tensor_kind": tk, **r} for tk, r in sorted(rows.items(), key=lambda x: _kind_order(x[0]))
               if r["values_differ"] or r["changed"] or r["only_in_a"] or r["only_in_b"]]
        return pd.DataFrame(out, columns=cols)

    def differ_kinds(self) -> list[str]:
        """The tensor kinds that differ (see :meth:`kind_differences`), in checkpoint-kind order."""
        return list(self.kind_differences()["tensor_kind"])

    @property
    def verdict(self) -> str:
        """``different``, ``equal`` (tensors equal; whole kinds on one side only), ``identical`` or
        ``not compared`` (values not read; keys, shapes and dtypes the same). See the module docstring."""
        if self.differ_kinds():
            return "different"
        if not self.compared_values and self.n_common:
            return "not compared"
        return "equal" if self.only_in_a or self.only_in_b else "identical"

    def banner(self) -> str:
        """The verdict in one line: the kinds that differ, or what was equal and what one side alone holds.

        ``different: model (1 of 47 values differ, 1 only in A); only in A: rng 3, sched 4``
        ``tensors equal: 192 of 192 compared; only in A: sched 4, rng 3, extra 2``
        """
        verdict = self.verdict
        one_sided = "; ".join(f"only in {side}: " + ", ".join(_kind_count(tk, keys, self.compared_values)
                                                               for tk, keys in _ordered(only))
                              for side, only in (("A", self.only_in_a), ("B", self.only_in_b)) if only)
        tail = f"; {one_sided}" if one_sided else ""
        if verdict == "different":
            parts = []
            for r in self.kind_differences().itertuples(index=False):
                what = []
                if r.values_differ:
                    what.append(f"{r.values_differ} of {r.compared} values differ" if r.compared
                                else "values differ")
                if r.changed:
                    what.append(f"{r.changed} changed shape/dtype")
                if r.only_in_a:
                    what.append(f"{r.only_in_a} only in A")
                if r.only_in_b:
                    what.append(f"{r.only_in_b} only in B")
                parts.append(f"{r.tensor_kind} ({', '.join(what)})")
            return "different: " + ", ".join(parts) + tail
        n = len(self.values)
        hyper = f", {len(self.hyper)} hyper-parameter values equal" if len(self.hyper) else ""
        if verdict == "not compared":
            return f"same keys, shapes and dtypes in {self.n_common} tensors; values not compared" + tail
        if verdict == "identical":
            return f"identical: {n} of {n} tensors equal{hyper}"
        return f"tensors equal: {n} of {n} compared{hyper}" + tail

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

    @property
    def n_hyper_differ(self) -> int:
        """Hyper-parameter values (one per parameter and name) that differ; 0 when not compared."""
        h = self.hyper
        return int((h["a"].map(repr) != h["b"].map(repr)).sum()) if len(h) else 0

    def hyperparameter_changes(self) -> pd.DataFrame:
        """Changed optimizer hyper-parameters, folded: ``name, a, b, params`` (how many parameters changed so;
        ``a``/``b`` None where that side does not hold the value). The same for both storage formats."""
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
        return {"a": self.a, "b": self.b, "identical": self.identical, "verdict": self.verdict,
                "banner": self.banner(), "differ_kinds": self.differ_kinds(),
                "kind_differences": self.kind_differences().to_dict("records"),
                "only_in_a": {tk: len(keys) for tk, keys in _ordered(self.only_in_a)},
                "only_in_b": {tk: len(keys) for tk, keys in _ordered(self.only_in_b)},
                "added": self.added, "removed": self.removed,
                "changed": changed.to_dict("records"), "kinds": self.kinds,
                "n_compared": int(len(self.values)), "n_equal": int(self.values["equal"].sum()) if len(self.values) else 0,
                "by_tensor_kind": self.by_tensor_kind().to_dict("records"),
                "top_changes": self.top(top).to_dict("records"),
                "hyperparameters": {"status": self.hyper_status, "n_compared": int(len(self.hyper)),
                                    "n_differ": self.n_hyper_differ, "packed_items": self.packed,
                                    "note": self._hyper_note()},
                "hyperparameter_changes": self.hyperparameter_changes().to_dict("records")}

    def to_json(self, top: int = 10) -> str:
        return json.dumps(self.to_dict(top), indent=2, default=str)

    def _hyper_note(self) -> str:
        """What was done with the hyper-parameters, in words ("" when neither side has any)."""
        packed = any(self.packed.values())
        if self.hyper_status == "values":
            return (f"{self.n_hyper_differ} of {len(self.hyper)} hyper-parameter values differ"
                    + (" (optim.hyper.* JSON, decoded and compared per parameter, not as a tensor)"
                       if packed else ""))
        if self.hyper_status == "same":
            return "optimizer hyper-parameters the same (the same optim.hyper.* items)"
        if self.hyper_status == "differ":
            return ("optimizer hyper-parameters differ (" + ("other optim.hyper.* items" if packed else "other entries")
                    + "; compare values to see which)")
        if self.hyper_status == "not compared":
            return "optimizer hyper-parameters not compared (values not read)"
        if self.hyper_status == "one side":
            return "optimizer hyper-parameters only in " + ("A" if HYPERPARAMETER in self.only_in_a else "B")
        return ""

    def summary_line(self) -> str:
        """``0 added, 0 removed, 0 changed shape/dtype, 245 of 681 values differ, 5 of 750 hyper-parameter
        values differ``: tensor values and hyper-parameter values are counted apart."""
        note = self._hyper_note()
        one_sided = "".join(f", {sum(len(v) for k, v in only.items() if k != HYPERPARAMETER)} only in {side} "
                            f"(kinds {other} has none of)" for side, other, only in
                            (("A", "B", self.only_in_a), ("B", "A", self.only_in_b))
                            if any(k != HYPERPARAMETER for k in only))
        return (f"{len(self.added)} added, {len(self.removed)} removed, {len(self.changed)} changed shape/dtype"
                + (f", {self.n_differ} of {len(self.values)} values differ" if self.compared_values else "")
                + one_sided + (f", {note}" if note else "")
                + (f" (kinds: {', '.join(self.kinds)})" if self.kinds else ""))

    def _repr_html_(self) -> str:
        # Block elements (<p>, <h4>, tables) and spaces around inline ones: the text never runs together,
        # rendered or copied (textContent).
        esc = html.escape
        colour = {"different": "#cf222e", "not compared": "#6e7781"}.get(self.verdict, "#1a7f37")
        parts = [f"<p><b>CheckpointDiff</b> <code>{esc(self.a)}</code> &rarr; <code>{esc(self.b)}</code></p>",
                 f"<p class='wb-diff-verdict' style='color:{colour}; font-weight:600'>{esc(self.banner())}</p>",
                 f"<p>{esc(self.summary_line())}</p>"]
        for title, keys in (("only in B (added)", self.added), ("only in A (removed)", self.removed)):
            if keys:
                parts.append(f"<details><summary>{title} ({len(keys)})</summary> <pre>"
                             + esc("\n".join(keys[:200])) + "</pre></details>")
        for side, only in (("A", self.only_in_a), ("B", self.only_in_b)):
            if only:
                keys = [k for _, ks in _ordered(only) for k in ks]
                parts.append(f"<details><summary>only in {side}, kinds the other has none of: "
                             + esc(", ".join(_kind_count(tk, ks, self.compared_values) for tk, ks in _ordered(only)))
                             + "</summary> <pre>" + esc("\n".join(keys[:200])) + "</pre></details>")
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
    # Hyper-parameters, per-key entries and packed items (optim.hyper.<digest>: JSON, the digest of its
    # content) alike, are compared by value, parameter by parameter, never as tensors.
    ha = [k for k in ra if is_hyperparameter(k)]
    hb = [k for k in rb if is_hyperparameter(k)]
    hyper_a, hyper_b = {k: ra.pop(k) for k in ha}, {k: rb.pop(k) for k in hb}
    kind_of = {k: tensor_kind(k, r["kind"]) for side in (ra, rb) for k, r in side.items()}
    # A key on one side only is a difference when the other side holds tensors of its kind (a layer
    # missing, another rank's RNG state); a whole kind the other side holds none of is what its format
    # does not carry (an HF export: no scheduler, RNG or step counters): "only in", not a difference.
    kinds_a, kinds_b = {kind_of[k] for k in ra}, {kind_of[k] for k in rb}
    only_in_a: dict[str, list[str]] = {}
    only_in_b: dict[str, list[str]] = {}
    for k in ra:
        if k not in rb and kind_of[k] not in kinds_b:
            only_in_a.setdefault(kind_of[k], []).append(k)
    for k in rb:
        if k not in ra and kind_of[k] not in kinds_a:
            only_in_b.setdefault(kind_of[k], []).append(k)
    added = [k for k in rb if k not in ra and kind_of[k] in kinds_a]
    removed = [k for k in ra if k not in rb and kind_of[k] in kinds_b]
    common = [k for k in ra if k in rb]
    changed = [{"key": k, "kind": ra[k]["kind"], "a_dtype": ra[k]["dtype"], "a_shape": ra[k]["shape"],
                "b_dtype": rb[k]["dtype"], "b_shape": rb[k]["shape"]}
               for k in common if ra[k]["shape"] != rb[k]["shape"] or ra[k]["dtype"] != rb[k]["dtype"]]
    rows, hyper = [], []
    status = ("" if not (ha or hb) else "one side" if not (ha and hb)
              else "values" if values else _hyper_status(ha, hb))
    if status == "one side":  # one side holds no hyper-parameters at all (an export without the optimizer)
        va = _hyper_values(sa, hyper_a) if values and ha else dict.fromkeys(ha)
        vb = _hyper_values(sb, hyper_b) if values and hb else dict.fromkeys(hb)
        (only_in_a if ha else only_in_b)[HYPERPARAMETER] = list(va or vb)
    if values:
        same_shape = [k for k in common if ra[k]["shape"] == rb[k]["shape"]]
        for k in tqdm(same_shape, desc="diff", unit="tensor", disable=not progress, leave=False):
            ta, tb = sa.get(k), sb.get(k)
            rows.append({"key": k, "kind": ra[k]["kind"], "tensor_kind": tensor_kind(k, ra[k]["kind"]),
                         **_value_change(ta, tb)})
            del ta, tb
        if ha and hb:
            va, vb = _hyper_values(sa, hyper_a), _hyper_values(sb, hyper_b)
            hyper = [{"key": k, "name": k.rsplit(".", 1)[-1], "a": va.get(k), "b": vb.get(k)}
                     for k in list(va) + [k for k in vb if k not in va]]
    return CheckpointDiff(a=str(sa.manifest.path), b=str(sb.manifest.path), added=added, removed=removed,
                          changed=pd.DataFrame(changed, columns=_CHANGED_COLUMNS),
                          values=pd.DataFrame(rows, columns=_VALUE_COLUMNS), compared_values=values,
                          hyper=pd.DataFrame(hyper, columns=["key", "name", "a", "b"]),
                          kinds=None if kinds is None else list(kinds), hyper_status=status,
                          packed={"a": [k for k in ha if k.startswith(_PACKED)],
                                  "b": [k for k in hb if k.startswith(_PACKED)]},
                          only_in_a=only_in_a, only_in_b=only_in_b, n_common=len(common),
                          kind_of={k: kind_of[k] for k in added + removed + [c["key"] for c in changed]})


_PACKED = "optim.hyper."


def _ordered(only: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    return sorted(only.items(), key=lambda x: _kind_order(x[0]))


def _kind_count(tk: str, keys: list[str], values: bool) -> str:
    """``rng 3``; hyper-parameters as values (one per parameter and name) when read, else stored entries."""
    if tk == HYPERPARAMETER:
        return f"{tk}s ({len(keys)} {'values' if values else 'stored entries'})"
    return f"{tk} {len(keys)}"


def _hyper_status(ha: list[str], hb: list[str]) -> str:
    """Hyper-parameters compared without reading values: packed items are named by the digest of their
    content, so equal names are equal values; per-key entries that differ in name differ."""
    pa, pb = ({k for k in h if k.startswith(_PACKED)} for h in (ha, hb))
    if pa == set(ha) and pb == set(hb):  # packed on both sides (or only on one)
        return "same" if pa == pb else "differ"
    if not pa and not pb:  # per-key on both sides
        return "differ" if set(ha) != set(hb) else "not compared"
    return "not compared"  # one side packed, the other per key: only the values tell


def _hyper_values(source, rows: dict[str, dict]) -> dict[str, Any]:
    """``optim.param_groups.<fqn>.<name> -> value`` of one side: per-key entries as they are, packed items
    decoded (:func:`workbench.checkpoint.state.unpack_hyper`) to the same keys. Every entry is read in one
    go (a few KiB); what that read misses is read on its own, which names the problem if there is one."""
    from workbench.checkpoint.param_groups import _python, _read_values
    from workbench.checkpoint.state import unpack_hyper

    stored = {k: r.get("stored_key", k) for k, r in rows.items()}
    got = _read_values(source.manifest, [{**r, "key": stored[k]} for k, r in rows.items()])
    tensors = {k: got[stored[k]] if stored[k] in got else source.get(k) for k in rows}
    out: dict[str, Any] = {}
    for k, t in tensors.items():
        if not k.startswith(_PACKED):
            out[k] = _plain(t)
    packed = [t for k, t in tensors.items() if k.startswith(_PACKED)]
    try:
        unpacked = unpack_hyper(packed) if packed else {}
    except ValueError as e:  # name the checkpoint: a diff reads two
        raise ValueError(f"{source.manifest.path}: {e}") from None
    for fqn, hyper in unpacked.items():
        for name, v in hyper.items():
            out[f"optim.param_groups.{fqn}.{name}"] = _python(v)
    return out


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
