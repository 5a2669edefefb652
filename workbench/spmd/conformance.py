"""The conformance harness: every registry case, under every placement combination, equals the dense run.

For each ``Case`` in ``workbench.spmd.registry.CASES`` and each combination of input placements, on a
1-D mesh of 2 ranks and a 2-D mesh of 2x2 ranks::

    dense:   out = fn(*inputs);            loss = sum(out * cot);   grads = d loss / d inputs
    DTensor: out = fn(*distribute(inputs)); same cot, same loss;    grads (DTensors)
    check:   out.full_tensor() == dense out, grad.full_tensor() == dense grad   (case atol/rtol)

and records the bytes the DTensor run communicated, forward and backward (per rank sent, see
``workbench.spmd.comm``). One run spawns 4 gloo processes (hard timeout) that walk the same plan: the
1-D mesh is the inner dim of the 2x2 mesh, so ranks {0,1} and {2,3} each run it; rank 0 reports.

Placement combinations: each shardable input takes Replicate or Shard(d) for each of its dims (a case
may list its own candidates, e.g. Partial for gradients); on the 2-D mesh each input takes a PAIR (one
per mesh dim, ``[S(0),S(0)]`` included: the multi-mesh-dim fallback). The product over inputs explodes
(two 2-D inputs on 2x2: 81 combinations), so above ``cap`` combinations per case and mesh the plan keeps a
deterministic sample that still gives every input every one of its placements at least once (the
all-Replicate combination always included). ``cap=None`` runs the full product.

    report = check()                 # everything; report.ok, report.to_frame(), rich in a notebook
    report = check(family="masked")
    workbench spmd check [--family F] [--json]

Cases come from our registry (``source="registry"``) or from torch's own op samples
(``source="opinfo"``: every OpInfo sample of an op we have a rule for, ``workbench.spmd.opinfo``).
``rules="both"`` walks the same plan under torch's rules, then ours, in the same 4 processes, and
:meth:`ConformanceReport.versus` counts per combination: passes with both, with ours only, with torch's
only, with neither. Such a report is ``ok`` when nothing passes with torch's rules alone.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_CAP = 8
DEFAULT_TIMEOUT_S = 240.0
MESHES = {"1d": (2,), "2d": (2, 2)}
WORLD = 4


# --------------------------------------------------------------------------------------------------
# The plan: which placements each case runs under
# --------------------------------------------------------------------------------------------------


def case_inputs(case, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed + zlib.crc32(case.name.encode()) % 10_000)
    return case.make_inputs(gen)


def candidates(case, inputs: list) -> list[list]:
    """Per shardable input, its candidate placements on ONE mesh dim."""
    from workbench.spmd.placements import default_candidates

    out = []
    for i in case.shardable:
        fn = case.placements or default_candidates
        out.append(list(fn(inputs[i])))
    return out


def combinations(case, inputs: list, mesh_ndim: int, cap: int | None = DEFAULT_CAP) -> list[tuple[tuple, ...]]:
    """Placement combinations: a tuple (one entry per shardable input) of per-mesh-dim placement tuples."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    # DTensor allows one Partial reduce op per tensor: P(sum) on one mesh dim and P(max) on another is
    # not a placement, so those pairs are left out.
    per_input = [[p for p in itertools.product(c, repeat=mesh_ndim)
                  if len({x.reduce_op for x in p if isinstance(x, Partial)}) <= 1]
                 for c in candidates(case, inputs)]
    if not per_input:
        return [()]
    total = 1
    for opts in per_input:
        total *= len(opts)
    rng = random.Random(zlib.crc32(f"{case.name}/{mesh_ndim}".encode()))
    if cap is None or total <= cap:
        return list(itertools.product(*per_input))
    if total <= 20_000:
        pool = list(itertools.product(*per_input))
        rng.shuffle(pool)
    else:
        pool = [tuple(rng.choice(opts) for opts in per_input) for _ in range(4000)]
    # Must-haves: every (input, mesh dim, placement) at least once, and on 2-D every input sharded on one
    # tensor dim over both mesh dims ([S(d), S(d)]: the multi-mesh-dim fallback). Greedy set cover: take
    # the combination that covers the most missing items (first in the seeded order on ties).
    all_r = tuple((Replicate(),) * mesh_ndim for _ in per_input)
    chosen: list = [all_r]
    need: dict = {}  # ordered set: every rank must walk the same plan
    for i, opts in enumerate(per_input):
        for m in range(mesh_ndim):
            for p in dict.fromkeys(o[m] for o in opts):
                if p != Replicate():
                    need[("one", i, m, p)] = None
        if mesh_ndim > 1:
            for o in opts:
                if isinstance(o[0], Shard) and all(q == o[0] for q in o):
                    need[("multi", i, o)] = None

    per_option: list[dict] = [{} for _ in per_input]  # (input, option) -> its items, built once

    def items(combo) -> set:
        got: set = set()
        for i, c in enumerate(combo):
            one = per_option[i].get(c)
            if one is None:
                one = per_option[i][c] = frozenset({("one", i, m, p) for m, p in enumerate(c)} | {("multi", i, c)})
            got |= one
        return got

    def covers(combo) -> set:
        return items(combo) & need.keys()

    pool_items = [items(c) for c in pool]  # once: the greedy loop below rescans the pool per pick
    while need:
        best, best_n = None, 0
        keys = need.keys()
        for c, got in zip(pool, pool_items):
            n = len(got & keys)
            if n > best_n:
                best, best_n = c, n
        if best is None:  # the sampled pool misses it: build a combination for the first missing item
            item = next(iter(need))
            i = item[1]
            pick = item[2] if item[0] == "multi" else next(o for o in per_input[i] if o[item[2]] == item[3])
            best = tuple(pick if j == i else rng.choice(per_input[j]) for j in range(len(per_input)))
        for k in covers(best):
            del need[k]
        if best not in chosen:
            chosen.append(best)
    for p in pool:
        if len(chosen) >= cap:
            break
        if p not in chosen:
            chosen.append(p)
    return chosen


def select_cases(family: str | None = None, names: list[str] | None = None) -> list:
    from workbench.spmd.registry import CASES, FAMILIES

    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    cases = [c for c in CASES.values() if family is None or c.family == family]
    if names:
        unknown = sorted(set(names) - set(CASES))
        if unknown:
            raise ValueError(f"unknown case(s) {unknown}; `workbench spmd rules --json` lists them")
        cases = [c for c in cases if c.name in names]
    return cases


def plan(cases: list, cap: int | None = DEFAULT_CAP, meshes: tuple[str, ...] = ("1d", "2d"), seed: int = 0) -> list:
    """[(case, mesh name, combination)], the exact order every rank walks."""
    out = []
    for case in cases:
        inputs = case_inputs(case, seed)
        for m in meshes:
            for combo in combinations(case, inputs, len(MESHES[m]), cap):
                out.append((case, m, combo))
    return out


# --------------------------------------------------------------------------------------------------
# One combination (runs on every rank)
# --------------------------------------------------------------------------------------------------


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _full(x: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _err(got: Any, want: Any, case) -> tuple[bool, float]:
    """(ok, max abs error) of one output or gradient."""
    if not isinstance(want, torch.Tensor):
        return got == want, 0.0
    if not isinstance(got, torch.Tensor):
        return False, float("inf")
    if got.shape != want.shape:
        return False, float("inf")
    if not want.is_floating_point():
        ok = torch.equal(got, want)
        return ok, 0.0 if ok else float((got.long() - want.long()).abs().max()) if got.numel() else 0.0
    if got.numel() == 0:
        return True, 0.0
    got, want = got.detach(), want.detach()
    diff = (got.double() - want.double()).abs()
    both_nan = torch.isnan(got) & torch.isnan(want)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    ok = torch.allclose(got, want, atol=case.atol, rtol=case.rtol, equal_nan=True)
    return ok, float(diff.nan_to_num(float("inf")).max())


def dense_reference(case, seed: int = 0) -> dict[str, Any]:
    """The single-device run of a case: inputs, outputs, cotangents, input gradients."""
    inputs = case_inputs(case, seed)
    rg = set(case.requires_grad)
    dense = [x.detach().clone().requires_grad_(i in rg) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(inputs)]
    outs = _as_tuple(case.fn(*dense))
    gen = torch.Generator().manual_seed(seed + 1)
    cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if isinstance(o, torch.Tensor)
            and o.is_floating_point() else None for o in outs]
    diff_pairs = [(o, c) for o, c in zip(outs, cots) if c is not None and o.requires_grad]
    if rg and diff_pairs:
        torch.autograd.backward([o for o, _ in diff_pairs], [c for _, c in diff_pairs])
    return {"inputs": inputs, "outs": [o.detach() if isinstance(o, torch.Tensor) else o for o in outs],
            "cots": cots, "grads": {i: dense[i].grad for i in rg}}


def run_combo(case, mesh, combo: tuple, seed: int = 0, ref: dict | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from workbench.spmd.comm import CommBytesMode
    from workbench.spmd.placements import make_dtensor

    ref = ref or dense_reference(case, seed)
    inputs, outs, cots, dense_grads = ref["inputs"], ref["outs"], ref["cots"], ref["grads"]
    rg = set(case.requires_grad)

    # distributed
    pl = dict(zip(case.shardable, combo))
    nd = mesh.ndim
    dts = []
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            dts.append(make_dtensor(x, mesh, pl.get(i, (Replicate(),) * nd), requires_grad=i in rg))
        else:
            dts.append(x)
    with CommBytesMode() as comm:
        douts = _as_tuple(case.fn(*dts))
        fwd = comm.total_bytes
        pairs = []
        for o, c in zip(douts, cots):
            if c is None or not isinstance(o, DTensor) or not o.requires_grad:
                continue
            gp = [Replicate() if isinstance(p, Partial) else p for p in o.placements]
            pairs.append((o, make_dtensor(c, o.device_mesh, gp)))
        if rg and pairs:
            torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
        total = comm.total_bytes
        kinds = comm.bytes_by_kind()

    ok, worst, what = True, 0.0, []
    for k, (got, want) in enumerate(zip(douts, outs)):
        o_ok, e = _err(_full(got), want, case)
        ok &= o_ok
        worst = max(worst, e)
        if not o_ok:
            what.append(f"output {k}")
    for i, want in dense_grads.items():
        got = dts[i].grad
        if want is None and got is None:
            continue
        if want is None:
            want = torch.zeros_like(inputs[i])
        if got is None:
            ok, worst = False, float("inf")
            what.append(f"grad of input {i} missing")
            continue
        g_ok, e = _err(_full(got), want, case)
        ok &= g_ok
        worst = max(worst, e)
        if not g_ok:
            what.append(f"grad of input {i}")
    out_pl = [getattr(o, "placements", None) for o in douts]
    from workbench.spmd.placements import format_placements

    return {
        "ok": bool(ok),
        "max_err": worst,
        "fwd_bytes": fwd,
        "bwd_bytes": total - fwd,
        "comm_bytes": total,
        "bytes_by_kind": kinds,
        "out_placements": " | ".join(format_placements(p) if p is not None else "-" for p in out_pl),
        "error": ("mismatch: " + ", ".join(what)) if what else None,
    }


def combo_str(combo: tuple) -> str:
    from workbench.spmd.placements import format_placements

    return " | ".join(format_placements(p) for p in combo)


# --------------------------------------------------------------------------------------------------
# The 4-process run
# --------------------------------------------------------------------------------------------------


# Every combination ends with the ranks agreeing, through the TCP store (never a collective), on how it went.
# A combination that raises on some ranks before a collective and on others after it (torch's rules on an
# uneven shard) leaves the group's collectives paired off by one: a later combination then waits for good (a
# functional collective's wait ignores the process group's timeout), or the last barrier times out on whichever
# rank finished first. So each rank reports its outcome and how many collectives it issued; when they differ,
# or a collective timed out, or a rank does not report within AGREE_S, the combination fails with the reason
# and the ranks are replaced; the run resumes after it. Rank 0 can spend up to the process group's timeout in a
# collective and AGREE_S waiting for the others before it writes a row: the parent's stall clock (``check``) is
# longer than both, and the other ranks wait longer still for rank 0's verdict.
PG_TIMEOUT_S = 60
AGREE_S = 30
STALL_S = 120.0
VERDICT_S = 180


def _worker(rank: int, world: int, port: int, out: str, spec: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # The store outlives every collective: it is how the ranks agree after each combination.
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=VERDICT_S + 30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec["pg_timeout_s"]))
    import workbench.spmd as spmd

    torch.manual_seed(0)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    meshes = {"1d": mesh2["inner"], "2d": mesh2}
    if spec.get("source", "registry") == "opinfo":
        from workbench.spmd.opinfo import cases as opinfo_cases

        cases = opinfo_cases(spec["opinfo"])
    else:
        cases = select_cases(spec["family"], spec["names"])
    steps = plan(cases, spec["cap"], tuple(spec["meshes"]), spec["seed"])
    sink = open(out, "w") if rank == 0 else None
    if sink is not None:  # the plan is built: from here on a silent minute means a hang (check's stall clock)
        sink.write(json.dumps({"ready": True}) + "\n")
        sink.flush()
    rule_sets = ("torch", "ours") if spec.get("rules", "ours") == "both" else (spec.get("rules", "ours"),)
    agreed = True
    for k, rules in enumerate(rule_sets):
        first = spec.get("start", 0) - k * len(steps)  # a resumed run (after a hang) skips what is done
        if first >= len(steps):
            continue
        if rules == "ours":
            spmd.install()
        else:
            spmd.uninstall()
        agreed = _walk(steps[max(first, 0):], k * len(steps) + max(first, 0), meshes, spec, sink, store, rank, world)
        if not agreed:
            break
    if sink is not None:
        sink.write(json.dumps({"done": True} if agreed else {"replace": True}) + "\n")
        sink.close()
    if rank == 0:  # the store lives in rank 0: it stays until every rank has read its last verdict
        try:
            store.wait([f"bye/{r}" for r in range(1, world)], timedelta(seconds=30))
        except Exception:  # a rank stuck in a collective never says goodbye; it is killed by the parent
            pass
    else:
        store.set(f"bye/{rank}", "1")
    if agreed:
        dist.destroy_process_group()


def _outcome(error: BaseException | None, collectives: int) -> str:
    """What a rank reports of one combination: ``ok`` or the exception's type, and the collectives it issued;
    ``timeout:`` first when a collective timed out (the group is out of step even when every rank says the
    same)."""
    if error is None:
        return f"ok after {collectives} collectives"
    text = str(error).lower()
    return ("timeout:" if "timed out" in text or "timeout" in text else "") + \
        f"{type(error).__name__} after {collectives} collectives"


def _agree(store, index: int, rank: int, world: int, outcome: str) -> tuple[bool, str]:
    """Report this rank's outcome of combination ``index`` and wait for rank 0's verdict:
    (True, "") when the group may go on, (False, why) when it must be replaced."""
    from datetime import timedelta

    store.set(f"c{index}/r{rank}", outcome)
    if rank == 0:
        keys = [f"c{index}/r{r}" for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=AGREE_S))
            said = [store.get(k).decode() for k in keys]
        except Exception:  # the store's timeout: some rank is still inside a collective
            said = []
            for r, k in enumerate(keys):
                said.append(store.get(k).decode() if store.check([k]) else "no answer")
        if len(set(said)) == 1 and not said[0].startswith("timeout:"):
            store.set(f"c{index}/verdict", "go")
            return True, ""
        why = "the ranks fell out of step (" + ", ".join(f"rank {r}: {s}" for r, s in enumerate(said)) + \
              "); they were replaced"
        store.set(f"c{index}/verdict", why)
        return False, why
    try:
        store.wait([f"c{index}/verdict"], timedelta(seconds=VERDICT_S))
        verdict = store.get(f"c{index}/verdict").decode()
    except Exception:  # rank 0 is gone or stuck: the parent replaces every rank
        return False, "no verdict from rank 0"
    return verdict == "go", verdict


def _walk(steps: list, index: int, meshes: dict, spec: dict, sink, store, rank: int, world: int) -> bool:
    """Run ``steps`` (``index`` is the first one's place in the whole plan); False when the ranks fell out
    of step and must be replaced (rank 0 has then written a ``{"replace_after": index}`` line)."""
    import workbench.spmd as spmd
    from workbench.spmd.comm import CommBytesMode

    refs: dict[str, dict] = {}
    for i, (case, m, combo) in enumerate(steps):
        t0 = time.perf_counter()
        error = None
        issued = CommBytesMode()  # every collective this rank issues, those of a combination that raises too
        try:
            if case.name not in refs:
                refs.clear()  # the plan is grouped by case: keep one reference alive
                refs[case.name] = dense_reference(case, spec["seed"])
            with issued:
                res = run_combo(case, meshes[m], combo, spec["seed"], refs[case.name])
        except Exception as e:  # a rule that raises is a failed case, not a crashed run
            error = e
            first = (str(e).strip().splitlines() or [""])[0][:300]
            res = {"ok": False, "max_err": float("inf"), "fwd_bytes": None, "bwd_bytes": None, "comm_bytes": None,
                   "bytes_by_kind": {}, "out_placements": None, "error": f"{type(e).__name__}: {first}"}
        agreed, why = _agree(store, index + i, rank, world, _outcome(error, len(issued.records)))
        if not agreed:
            res = dict(res, ok=False, error=(res["error"] + "; " if res["error"] else "") + why)
        if sink is not None:
            row = {"case": case.name, "family": case.family, "ops": [str(o) for o in case.ops],
                   "mesh": m, "placements": combo_str(combo), **res,
                   "rules": "ours" if spmd.installed() else "torch", "time_s": round(time.perf_counter() - t0, 4)}
            sink.write(json.dumps(row) + "\n")
            if not agreed:
                sink.write(json.dumps({"replace_after": index + i}) + "\n")
            sink.flush()
        if not agreed:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ConformanceReport:
    """Rows of (case, mesh, placements, ok, max_err, comm_bytes, ...), one per combination run."""

    rows: list[dict[str, Any]]
    rules: str  # "ours", "torch" or "both" (each row says which it ran under)
    wall_s: float
    cap: int | None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        if self.rules == "both":  # the contract: whatever torch's rules get right, ours do too
            return bool(self.rows) and not self.versus()["torch_only"]
        return bool(self.rows) and all(r["ok"] for r in self.rows)

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Failing rows (with ``rules="both"``: the combinations that pass with torch's rules only)."""
        if self.rules == "both":
            return self.versus()["torch_only_rows"]
        return [r for r in self.rows if not r["ok"]]

    def versus(self) -> dict[str, Any]:
        """Per combination (case, mesh, placements) run under both rule sets: how many pass with both,
        with ours only, with torch's only, with neither; and the rows of ours for the last three kinds."""
        by: dict[tuple, dict[str, dict]] = {}
        for r in self.rows:
            by.setdefault((r["case"], r["mesh"], r["placements"]), {})[r.get("rules", self.rules)] = r
        out: dict[str, Any] = {"cases": 0, "both": 0, "ours_only": 0, "torch_only": 0, "neither": 0,
                               "ours_only_rows": [], "torch_only_rows": [], "neither_rows": []}
        for pair in by.values():
            if "ours" not in pair or "torch" not in pair:
                continue
            o, t = pair["ours"]["ok"], pair["torch"]["ok"]
            kind = "both" if o and t else "ours_only" if o else "torch_only" if t else "neither"
            out["cases"] += 1
            out[kind] += 1
            if kind != "both":
                row = dict(pair["ours"])
                row["torch_error"] = pair["torch"]["error"]
                out[f"{kind}_rows"].append(row)
        return out

    def to_frame(self):
        import pandas as pd

        cols = ["case", "family", "mesh", "placements", "rules", "ok", "max_err", "fwd_bytes", "bwd_bytes", "comm_bytes",
                "out_placements", "error"]
        return pd.DataFrame(self.rows, columns=cols)

    def _ours(self) -> list[dict[str, Any]]:
        """The rows of our rules (under ``rules="both"`` torch's rows are there too: :meth:`versus`)."""
        return [r for r in self.rows if r.get("rules") == "ours"] if self.rules == "both" else self.rows

    def summary(self) -> dict[str, dict[str, int]]:
        fam: dict[str, dict[str, int]] = {}
        rows = self._ours()
        for r in rows:
            f = fam.setdefault(r["family"], {"cases": 0, "combinations": 0, "passed": 0, "comm_bytes": 0})
            f["combinations"] += 1
            f["passed"] += bool(r["ok"])
            f["comm_bytes"] += r["comm_bytes"] or 0
        for f, d in fam.items():
            d["cases"] = len({r["case"] for r in rows if r["family"] == f})
        return fam

    def to_dict(self) -> dict[str, Any]:
        doc = {"status": "ok" if self.ok else "failed", "rules": self.rules, "wall_s": self.wall_s,
               "cap": self.cap, "combinations": len(self.rows), "passed": sum(bool(r["ok"]) for r in self.rows),
               "summary": self.summary(), "failures": self.failures, "rows": self.rows, **self.meta}
        if self.rules == "both":
            v = self.versus()
            doc["versus"] = {k: v[k] for k in ("cases", "both", "ours_only", "torch_only", "neither")}
            doc["neither"] = v["neither_rows"]
        return doc

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), default=str, **kw)

    def _passed(self) -> tuple[int, int]:
        """(passed, combinations) under our rules."""
        rows = self._ours()
        return sum(bool(r["ok"]) for r in rows), len(rows)

    def __repr__(self) -> str:
        ok, n = self._passed()
        return f"ConformanceReport({ok}/{n} combinations pass, rules={self.rules}, {self.wall_s:.1f}s)"

    def _repr_html_(self) -> str:
        import html

        ok, n = self._passed()
        head = (f"<b>SPMD conformance</b> ({self.rules} rules): {ok}/{n} combinations pass "
                f"over {len({r['case'] for r in self.rows})} cases in {self.wall_s:.1f}s")
        fam = "".join(
            f"<tr><td>{html.escape(f)}</td><td>{d['cases']}</td><td>{d['passed']}/{d['combinations']}</td>"
            f"<td>{d['comm_bytes']:,}</td></tr>" for f, d in self.summary().items())
        table = ("<table><tr><th>family</th><th>cases</th><th>pass</th><th>bytes sent per rank</th></tr>"
                 f"{fam}</table>")
        fails, bad = "", self.failures
        if bad:
            items = "".join(f"<li><code>{html.escape(r['case'])}</code> {r['mesh']} "
                            f"<code>{html.escape(r['placements'])}</code>: {html.escape(str(r['error']))}</li>"
                            for r in bad[:20])
            what = "Pass with torch's rules only" if self.rules == "both" else "Failures"
            fails = f"<p style='color:#b00'>{what}:</p><ul>{items}</ul>"
        return f"<div>{head}{table}{fails}</div>"


def check(family: str | None = None, names: list[str] | None = None, *, cap: int | None = DEFAULT_CAP,
          meshes: tuple[str, ...] = ("1d", "2d"), rules: str = "ours", seed: int = 0,
          timeout: float = DEFAULT_TIMEOUT_S, progress: bool = True, source: str = "registry",
          opinfo: list[str] | None = None, opinfo_samples: int | None = None) -> ConformanceReport:
    """Run the conformance harness in 4 fresh gloo processes and return the report.

    ``rules="torch"`` runs the same plan under torch's default rules (the ranks do not call
    ``workbench.spmd.install()``): the benchmark's baseline; ``rules="both"`` runs torch's, then ours.
    ``source="opinfo"`` takes the cases from torch's OpInfo samples of our rule ops (``opinfo``: only
    these OpInfo names; ``opinfo_samples``: at most that many samples each) instead of the registry;
    ``family`` and ``names`` then do not apply. Raises ``TimeoutError`` (naming the last finished combination)
    if the ranks run past ``timeout`` seconds, and ``RuntimeError`` with the failing rank's last lines
    if a rank crashes.
    """
    if rules not in ("ours", "torch", "both"):
        raise ValueError(f"rules={rules!r}; choose 'ours', 'torch' or 'both'")
    bad = sorted(set(meshes) - set(MESHES))
    if bad:
        raise ValueError(f"unknown mesh(es) {bad}; choose from {list(MESHES)}")
    picks = None
    if source == "opinfo":
        from workbench import compat
        from workbench.spmd import opinfo as _opinfo

        try:
            picks = _opinfo.select(opinfo, opinfo_samples)
        except compat.MissingTorchAPI as e:
            raise ValueError(str(e)) from None
        cases = _opinfo.cases(picks)
        if not cases:
            raise ValueError("no OpInfo sample reaches an op with a workbench rule")
    elif source == "registry":
        cases = select_cases(family, names)
        if not cases:
            raise ValueError(f"no conformance cases registered{' for family ' + repr(family) if family else ''}")
    else:
        raise ValueError(f"source={source!r}; choose 'registry' or 'opinfo'")
    steps = plan(cases, cap, meshes, seed)
    rule_sets = ("torch", "ours") if rules == "both" else (rules,)
    total = len(steps) * len(rule_sets)
    spec = {"family": family, "names": names, "cap": cap, "meshes": list(meshes), "seed": seed,
            "pg_timeout_s": PG_TIMEOUT_S, "rules": rules, "source": source, "start": 0,
            "opinfo": [[p.opinfo, p.index, list(p.ops)] for p in picks] if picks is not None else None}
    # torch's samples find combinations where a rank hangs in a collective for good (torch's rules, group_norm's
    # backward on an uneven shard): with no new row for stall_s, the ranks are replaced and the run resumes
    # after that combination, which counts as failed. Our registry keeps the old contract (a hang is an error).
    # Ranks that fall out of step without hanging say so themselves (_agree) and are replaced the same way.
    stall_s = STALL_S if source == "opinfo" else None
    t0 = time.monotonic()
    rows: list[dict] = []
    bar = None
    if progress:
        from workbench.progress import tqdm

        bar = tqdm(total=total, desc=f"spmd check ({rules} rules)", unit="combo", leave=False)
    try:
        with tempfile.TemporaryDirectory(prefix="wb-spmd-check-") as tmp:
            attempt = 0
            while True:
                got, hung, resume = _run_ranks(Path(tmp), attempt, spec, t0, timeout, stall_s, total, bar)
                rows += got
                if resume is not None:  # the ranks fell out of step: that combination's row says why
                    spec = dict(spec, start=resume)
                    attempt += 1
                    continue
                if hung is None:
                    break
                case, m, combo = steps[hung % len(steps)]
                rows.append({"case": case.name, "family": case.family, "ops": [str(o) for o in case.ops], "mesh": m,
                             "placements": combo_str(combo), "ok": False, "max_err": float("inf"), "fwd_bytes": None,
                             "bwd_bytes": None, "comm_bytes": None, "bytes_by_kind": {}, "out_placements": None,
                             "error": f"hang: no result within {stall_s:.0f}s (the ranks were replaced)",
                             "rules": rule_sets[hung // len(steps)], "time_s": stall_s})
                if bar is not None:
                    bar.update(1)
                spec = dict(spec, start=hung + 1)
                attempt += 1
    finally:
        if bar is not None:
            bar.close()
    return ConformanceReport(rows=rows, rules=rules, wall_s=round(time.monotonic() - t0, 2), cap=cap,
                             meta={"family": family, "meshes": list(meshes), "world_size": WORLD, "source": source,
                                   "cases": len(cases),
                                   "bytes_definition": "per-rank bytes sent, ring algorithm (workbench.spmd.comm)"})


def _run_ranks(tmp: Path, attempt: int, spec: dict, t0: float, timeout: float, stall_s: float | None, total: int,
               bar) -> tuple[list[dict], int | None, int | None]:
    """Run the plan from ``spec["start"]`` in 4 fresh ranks: (rows, None, None); (rows so far, index of the
    step that made no progress for ``stall_s``, None); or (rows so far, None, the index to resume from) when
    the ranks fell out of step."""
    out = tmp / f"rows{attempt}.jsonl"
    spec_path = tmp / f"spec{attempt}.json"  # a file: the OpInfo picks outgrow a command line
    spec_path.write_text(json.dumps(spec))
    port = _free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs, logs = [], []
    for r in range(WORLD):
        log = open(tmp / f"rank{r}.{attempt}.log", "w+")
        logs.append(log)
        cmd = [sys.executable, "-c", "import json,sys; from workbench.spmd.conformance import _worker; "
               "_worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "
               "json.loads(open(sys.argv[5]).read())); "
               "from workbench.lifeline import exit_now; exit_now(0)",
               str(r), str(WORLD), str(port), str(out), str(spec_path)]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    done, hung, resume = 0, None, None
    last_progress = time.monotonic()
    try:
        while True:
            resume = _resume_after(out)
            n = _count_rows(out)
            if n > done:
                if bar is not None:
                    bar.update(n - done)
                last_progress = time.monotonic()
            done = n
            if resume is not None:
                break
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                r = next(i for i, c in enumerate(codes) if c not in (None, 0))
                raise RuntimeError(f"conformance rank {r} exited with code {codes[r]}:\n{_tail(logs[r])}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - t0 > timeout:
                last = _last_row(out)
                where = f"after {last['case']} {last['mesh']} [{last['placements']}]" if last else "before any"
                raise TimeoutError(f"conformance run passed its {timeout:.0f}s limit ({spec['start'] + done}/{total} "
                                   f"combinations, stuck {where}); rank 0 log:\n{_tail(logs[0])}")
            # (the stall clock starts once rank 0 has built the plan: imports and sampling take minutes under load)
            if not done and _ready(out):
                last_progress = max(last_progress, _ready(out))
            if stall_s is not None and _ready(out) and time.monotonic() - last_progress > stall_s:
                hung = spec["start"] + done
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for log in logs:
            log.close()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith('{"case"')] \
        if out.exists() else []
    return rows, hung, resume


def _resume_after(path: Path) -> int | None:
    """The index after the combination the ranks fell out of step on (rank 0's ``replace_after`` line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith('{"replace_after"'):
                    return int(json.loads(line)["replace_after"]) + 1
    except (OSError, ValueError):
        pass
    return None


_READY: dict[str, float] = {}


def _ready(path: Path) -> float:
    """When the parent first saw rank 0's ready line in ``path`` (monotonic clock), or 0.0."""
    key = str(path)
    if key not in _READY:
        try:
            with open(path) as f:
                if f.readline().startswith('{"ready"'):
                    _READY[key] = time.monotonic()
        except OSError:
            pass
    return _READY.get(key, 0.0)


def _count_rows(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.startswith('{"case"'))
    except OSError:
        return 0


def _last_row(path: Path) -> dict | None:
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.startswith('{"case"')]
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None


def _tail(log, n: int = 25) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().splitlines()[-n:])
