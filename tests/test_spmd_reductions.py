"""Min/max-with-indices and index_put rules on real gloo ranks: values, gradients and bytes vs torch.

One torchrun job of 4 CPU ranks (this file is also the worker) runs the "reduction" and "index"
conformance cases of the ops we have rules for (mirror images such as min-of-max left to the full
``workbench spmd check``) on a 1-D mesh of 2 ranks and on a 2x2 mesh, under every Replicate/Shard
combination of the shardable inputs, forward and backward, against the dense single-process result.
Each combination also runs under torch's own rules, and the bytes every collective sends (ring, per
rank, ``workbench.spmd.comm``) are compared: never more than torch, strictly fewer and no all-gather
for min/max over a sharded dim and for index_put along a sharded dim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from workbench import compat

TIMEOUT_S = 150
FAMILIES = ("reduction", "index")
CAP = int(os.environ.get("SPMD_TEST_CAP", "9"))  # placement combinations per case and mesh
SKIP = {"reduction/min.dim/dim0", "reduction/max.dim/dim-1", "reduction/min.dim/dim-1", "reduction/max.dim/ties",
        "reduction/max.dim/ties_keepdim", "reduction/min.dim/nan", "reduction/max.dim/int32",
        "reduction/min.dim/float64_ties", "reduction/min.dim/dim1", "reduction/scatter/into_rows"}


# ------------------------------------------------------------------------------------------------
# worker (runs under torchrun)
# ------------------------------------------------------------------------------------------------
def _one(case, mesh, combo) -> dict:
    from workbench.spmd.conformance import run_combo

    try:
        r = run_combo(case, mesh, combo)
    except Exception as e:  # noqa: BLE001 - reported per combination
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}
    return {k: r[k] for k in ("ok", "error", "comm_bytes", "bytes_by_kind", "out_placements")}


def _max_grad_placements(meshes) -> dict:
    """Placements of d max(x, 0)/dx for x sharded along dim 0: sharded like x, not replicated."""
    import torch
    from torch.distributed.tensor import Shard

    from workbench.spmd.placements import make_dtensor

    out = {}
    for m, pl in (("1d", [Shard(0)]), ("2d", [Shard(0), Shard(0)])):
        x = make_dtensor(torch.arange(64.0).reshape(8, 8) % 5, meshes[m], pl, requires_grad=True)
        torch.max(x, 0).values.sum().backward()
        out[m] = [str(p) for p in x.grad.placements]
    return out


def worker(out_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import workbench.spmd as spmd
    from workbench.spmd.conformance import combo_str, plan, select_cases
    from workbench.spmd.registry import RULES, torch_rules

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatched collective fails
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    meshes = {"1d": mesh2["inner"], "2d": mesh2}
    spmd.install()  # import alone leaves DTensor as torch made it
    assert spmd.installed()
    # Cases of ops we have a rule for (amax & co. keep torch's rule), minus the mirror images (min of
    # max, dim -1 of dim 1): `workbench spmd check` runs every case; this file keeps to its time budget.
    cases = [c for f in FAMILIES for c in select_cases(f)
             if any(op in RULES for op in c.ops) and c.name not in SKIP]
    results = {}
    t0 = time.perf_counter()
    for case, m, combo in plan(cases, cap=CAP):
        t1 = time.perf_counter()
        ours = _one(case, meshes[m], combo)
        with torch_rules():
            theirs = _one(case, meshes[m], combo)
        results[f"{case.name}|{m}|{combo_str(combo)}"] = {"ours": ours, "torch": theirs,
                                                          "s": time.perf_counter() - t1}
    results["_total_s"] = time.perf_counter() - t0
    results["_grad_placements"] = _max_grad_placements(meshes)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd_red") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           __file__, str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 4-rank SPMD job hung for {TIMEOUT_S}s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


pytestmark = pytest.mark.multirank


def _combos(results: dict) -> dict:
    return {k: r for k, r in results.items() if not k.startswith("_")}


def _kinds(r: dict) -> dict:
    return r.get("bytes_by_kind") or {}


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_every_case_matches_dense_forward_and_backward(results):
    bad = {k: r["ours"]["error"] for k, r in _combos(results).items() if not r["ours"]["ok"]}
    assert not bad, json.dumps(bad, indent=1)[:4000]
    assert len(_combos(results)) > (100 if compat.available("spmd.indexing") else 60)  # 84 reduction combos alone


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_never_more_bytes_than_torch(results):
    worse = {k: (r["ours"]["comm_bytes"], r["torch"]["comm_bytes"]) for k, r in _combos(results).items()
             if r["torch"]["ok"] and r["ours"]["comm_bytes"] > r["torch"]["comm_bytes"]}
    assert not worse, worse


def _first_input_sharded_on(key: str, dim: int) -> bool:
    return f"S({dim})" in key.split("|", 2)[2].split(" | ")[0]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_minmax_over_sharded_dim_all_reduces_instead_of_gathering(results):
    keys = [k for k in _combos(results) if k.split("|")[0] in ("reduction/max.dim/dim0", "reduction/min.dim/ties_keepdim",
                                                               "reduction/max.dim/float64_ties")
            and _first_input_sharded_on(k, 0)]
    assert len(keys) >= 15
    for k in keys:
        ours, theirs = results[k]["ours"], results[k]["torch"]
        assert ours["ok"] and "all_gather" not in _kinds(ours), (k, ours)
        if theirs["ok"]:  # torch 2.11's own max.dim backward fails on DTensors (it builds plain zeros)
            assert "all_gather" in _kinds(theirs), (k, theirs)
            assert ours["comm_bytes"] < theirs["comm_bytes"], (k, ours, theirs)


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.skipif(not compat.available("spmd.indexing"),
                    reason=f"SPMD rule family 'indexing': {compat.skip_reason('spmd.indexing')}")
def test_index_put_along_sharded_dim_moves_nothing(results):
    keys = [k for k in _combos(results) if k.startswith("index/index_put") and _first_input_sharded_on(k, 0)]
    assert keys
    for k in keys:
        ours, theirs = results[k]["ours"], results[k]["torch"]
        if " | " not in k.split("|", 2)[2]:  # only x sharded (values replicated): nothing moves at all
            assert ours["comm_bytes"] == 0, (k, ours)
        if theirs["ok"]:  # torch's own backward fails for accumulate=False and for masks
            assert ours["comm_bytes"] < theirs["comm_bytes"], (k, ours, theirs)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_minmax_gradient_stays_sharded_like_the_input(results):
    assert results["_grad_placements"] == {"1d": ["S(0)"], "2d": ["S(0)", "S(0)"]}


if __name__ == "__main__":
    from workbench.lifeline import exit_now

    worker(sys.argv[1])
    exit_now(0)  # a gloo teardown race at interpreter exit can abort a finished rank
