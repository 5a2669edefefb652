"""Bytes communicated by our SPMD rules, as a ratio to torch's default DTensor rules, measured in the same run.

    python benchmarks/bench_spmd.py                     # every registry case, both meshes
    python benchmarks/bench_spmd.py --family masked
    python benchmarks/bench_spmd.py --quick             # smoke test: a few combinations, 1-D mesh only

For every conformance case in the registry (``workbench.spmd.registry.CASES``, so each rule family's cases
are included as soon as they are registered) and every placement combination the conformance harness
runs (the same deterministic plan: a 2-rank 1-D mesh and a 2x2 mesh), the forward and backward of the
case run twice, in separate 4-process gloo runs (``workbench.spmd.check(rules=...)``): once under torch's
own rules, the baseline (the ranks import workbench but never call ``workbench.spmd.install()``, and
importing workbench changes nothing in DTensor), and once with ours (each rank calls
``workbench.spmd.install()``). Every row records which rules its rank actually ran under
(``workbench.spmd.installed()``), and the comparison refuses a run whose rows say otherwise. Each run
records the bytes its collectives moved (``workbench.spmd.comm.CommBytesMode``: bytes ONE rank sends under
the ring algorithm of each collective).

Ratios are ours / torch. A combination counts in a ratio only when both runs completed and matched the
dense result; those where torch's rules fail or give a wrong answer are counted separately
(``torch_failed``). Combinations where both move 0 bytes add 0 to both sums, so only sums carry meaning
(per case, per family, total), not per-combination ratios. Per-combination figures are printed too.

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import _log, machine_info  # noqa: E402  (shared machine facts)

BASELINE = "torch"


def _ratio(ours: int, base: int) -> float | None:
    if base == 0:
        return None if ours == 0 else float("inf")
    return ours / base


def compare(torch_rows: list[dict], our_rows: list[dict]) -> dict[str, Any]:
    """Join the two runs row by row (case, mesh, placements) and sum bytes per case, family and total."""
    key = lambda r: (r["case"], r["mesh"], r["placements"])  # noqa: E731
    base = {key(r): r for r in torch_rows}
    rows, cases, families = [], {}, {}
    total = {"ours_bytes": 0, "torch_bytes": 0, "combinations": 0, "torch_failed": 0, "ours_failed": 0}
    for rules, run in ((BASELINE, torch_rows), ("ours", our_rows)):
        wrong = [key(r) for r in run if r.get("rules") != rules]
        if wrong:
            raise RuntimeError(f"the {rules!r} run has {len(wrong)} row(s) measured under other rules, first "
                               f"{wrong[0]}: its ranks did not run under {rules}'s rules")
    for r in our_rows:
        t = base.get(key(r))
        if t is None:
            raise RuntimeError(f"torch's run has no row for {key(r)}: the two runs walked different plans")
        row = {"case": r["case"], "family": r["family"], "mesh": r["mesh"], "placements": r["placements"],
               "ours_bytes": r["comm_bytes"], "torch_bytes": t["comm_bytes"], "ours_ok": r["ok"], "torch_ok": t["ok"],
               "ours_out": r["out_placements"], "torch_out": t["out_placements"],
               "ours_time_s": r.get("time_s"), "torch_time_s": t.get("time_s")}
        if not t["ok"]:
            row["torch_error"] = t["error"]
        if not r["ok"]:
            row["ours_error"] = r["error"]
        rows.append(row)
        for agg in (cases.setdefault(r["case"], {"family": r["family"], "ours_bytes": 0, "torch_bytes": 0,
                                                 "combinations": 0, "torch_failed": 0, "ours_failed": 0}),
                    families.setdefault(r["family"], {"ours_bytes": 0, "torch_bytes": 0, "combinations": 0,
                                                      "torch_failed": 0, "ours_failed": 0}),
                    total):
            agg["combinations"] += 1
            if not r["ok"]:
                agg["ours_failed"] += 1
            elif not t["ok"]:
                agg["torch_failed"] += 1
            else:
                agg["ours_bytes"] += r["comm_bytes"]
                agg["torch_bytes"] += t["comm_bytes"]
    for agg in (*cases.values(), *families.values(), total):
        agg["ratio"] = _ratio(agg["ours_bytes"], agg["torch_bytes"])
    return {"rows": rows, "cases": cases, "families": families, "total": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default=None, help="only this rule family (default: all)")
    p.add_argument("--case", action="append", default=[], help="only this case (repeatable)")
    p.add_argument("--cap", type=int, default=None,
                   help="placement combinations per case and mesh (default: the conformance harness's)")
    p.add_argument("--mesh", action="append", choices=["1d", "2d"], default=None)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds allowed per run (torch's own sharding propagation of some backward ops "
                        "on the 2x2 mesh takes minutes per placement)")
    p.add_argument("--quick", action="store_true", help="smoke test: cap 3, 1-D mesh only")
    args = p.parse_args(argv)

    import torch

    from workbench.spmd import conformance

    cap = args.cap if args.cap is not None else (3 if args.quick else conformance.DEFAULT_CAP)
    meshes = tuple(args.mesh or (["1d"] if args.quick else ["1d", "2d"]))
    try:
        cases = conformance.select_cases(args.family, args.case or None)
    except ValueError as e:
        p.error(str(e))
    if not cases:
        p.error("no conformance cases selected")
    n = len(conformance.plan(cases, cap, meshes))
    t0 = time.time()
    runs = {}
    for rules in (BASELINE, "ours"):  # separate processes: torch's rules first, then ours
        _log(f"{rules:>5} rules: {len(cases)} cases, {n} placement combinations on {'+'.join(meshes)} ...")
        rep = conformance.check(args.family, args.case or None, cap=cap, meshes=meshes, rules=rules,
                                timeout=args.timeout, progress=False)
        _log(f"       {len(rep.rows) - len(rep.failures)}/{len(rep.rows)} match the dense run, "
             f"{sum(r['comm_bytes'] or 0 for r in rep.rows):,} bytes sent per rank in all, {rep.wall_s:.1f}s")
        runs[rules] = rep
    cmp = compare(runs[BASELINE].rows, runs["ours"].rows)
    for fam, d in cmp["families"].items():
        r = d["ratio"]
        _log(f"  {fam:<12} ours {d['ours_bytes']:>9,} B  torch {d['torch_bytes']:>9,} B  ratio "
             f"{'n/a' if r is None else f'{r:.3f}'}  (torch failed {d['torch_failed']}, ours failed {d['ours_failed']})")
    tot = cmp["total"]
    _log(f"  total        ours {tot['ours_bytes']:>9,} B  torch {tot['torch_bytes']:>9,} B  ratio "
         f"{'n/a' if tot['ratio'] is None else format(tot['ratio'], '.3f')}")
    doc = {
        "benchmark": "bench_spmd",
        "metric": "bytes sent per rank (ring algorithm per collective, workbench.spmd.comm), forward + backward, "
                  "summed over placement combinations; ratio = ours / torch",
        "baseline": BASELINE,
        "baseline_note": f"torch {torch.__version__}'s own DTensor rules (ranks that never call "
                         "workbench.spmd.install()), measured in the same run",
        "quick": args.quick,
        "cap": cap,
        "meshes": list(meshes),
        "world_size": conformance.WORLD,
        "family": args.family,
        "wall_s": round(time.time() - t0, 1),
        "machine": machine_info(),
        "runs": {k: {"combinations": len(v.rows), "passed": len(v.rows) - len(v.failures), "wall_s": v.wall_s,
                     "rules_installed": sorted({str(r.get("rules")) for r in v.rows})}
                 for k, v in runs.items()},
        "total": tot,
        "families": cmp["families"],
        "cases": cmp["cases"],
        "rows": cmp["rows"],
    }
    print(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
