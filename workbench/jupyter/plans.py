"""Plan answers: a plan JSON read back into a ShardingPlan once, its per-rank table paged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.jupyter.files import FileCache, Refused, read_json, relative, stamp

__all__ = ["looks_like_plan", "plan_table"]

_PLANS = FileCache(8)


def looks_like_plan(doc: Any) -> bool:
    """Whether ``doc`` has a plan's shape (an object ``summary``, an object ``parallel``, a list ``tensors``):
    what ``open`` decides the view by, before :func:`_load_plan` checks every field."""
    return isinstance(doc, dict) and isinstance(doc.get("summary"), dict) and isinstance(doc.get("parallel"), dict) \
        and isinstance(doc.get("tensors"), list)


def _load_plan(root: Path, p: Path):
    from workbench.plan.types import ShardingPlan

    def make():
        doc = read_json(p)
        if not looks_like_plan(doc):
            raise Refused(422, f"{relative(root, p)}: not a workbench plan (needs summary, parallel and tensors); "
                          "write one with `workbench plan MODEL --json > plan.json`")
        try:  # every field checked (workbench.plan.plan_json): a damaged plan is one line naming the field
            plan = ShardingPlan.from_dict(doc, relative(root, p))
        except ValueError as e:
            raise Refused(422, str(e)) from None
        plan.rank_bytes()  # computed once, while cached
        return plan, doc

    return _PLANS.get((str(p), stamp(p)), make)


def plan_table(root: Path, p: Path, offset: int = 0, limit: int = 256) -> dict[str, Any]:
    from workbench.plan.types import KINDS
    from workbench.train.outcome import rank_span

    plan, doc = _load_plan(root, p)
    rb = plan.rank_bytes()
    cols = [*KINDS, "total"]
    coords = plan.all_coords()
    values = rb[cols].to_numpy()
    rows = []
    for r in range(offset, min(offset + limit, plan.world_size)):
        rows.append({"rank": r, "coords": dict(zip(plan.mesh_dim_names, (int(c) for c in coords[r]))),
                     **{c: int(values[r, j]) for j, c in enumerate(cols)}})
    groups: dict[tuple, list[int]] = {}
    for r, v in enumerate(map(tuple, values.tolist())):
        groups.setdefault(v, []).append(r)
    distinct = [{"ranks": rank_span(rs), "count": len(rs), **dict(zip(cols, v))}
                for v, rs in sorted(groups.items(), key=lambda kv: -kv[0][-1])[:100]]
    comm = plan.comm()
    out = {"path": relative(root, p), "summary": plan.summary(), "layout": plan.layout,
           "parallel": plan.parallel.to_dict(), "mesh": dict(zip(plan.mesh_dim_names, plan.mesh_shape)),
           "categories": cols, "world_size": plan.world_size, "offset": offset, "limit": limit, "rows": rows,
           "distinct": distinct, "n_distinct": len(groups), "comm": comm.to_dict("records"), "notes": plan.notes}
    peaks = doc.get("predicted_peak_bytes")
    if isinstance(peaks, dict) and all(type(v) is int for v in peaks.values()):  # rank -> bytes, as to_json writes
        out["predicted_peak_bytes"] = peaks
    return out
