"""SPMD rules: the conformance harness over every registry case, explain, the CLI, and the fallback rule.

The harness test is the contract of issue 4: for every case in the registry and every placement
combination of its plan (1-D mesh of 2 ranks, 2x2 mesh; real gloo processes), the DTensor result equals
the dense single-device result, forward and backward.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from workbench import compat
from workbench.spmd import registry

# These tests use the elementwise family's rules and cases (masked_fill, hardtanh_backward), which a
# torch without its single-dim pointwise helpers (2.11) skips: see workbench.compat.
needs_elementwise = pytest.mark.skipif(not compat.available("spmd.elementwise"),
                                       reason=f"SPMD rule family 'elementwise': {compat.skip_reason('spmd.elementwise')}")


# --------------------------------------------------------------------------------------------------
# Conformance: every registry case, one spawn of 4 gloo processes
# --------------------------------------------------------------------------------------------------


@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_every_registry_case_matches_the_dense_run_forward_and_backward(workbench_cli):
    """`workbench spmd check` (one spawn of 4 gloo ranks) over the whole registry, read from its JSON."""
    from workbench.spmd.conformance import ConformanceReport, plan, select_cases

    # --cap 4: beyond the must-haves (every placement of every input on every mesh dim, every [S(d),S(d)]
    # layout, all-Replicate) at most 4 combinations per case and mesh; the CLI's default is 8.
    p = subprocess.run([*workbench_cli, "spmd", "check", "--cap", "4", "--json", "--rows", "--timeout", "400"],
                       capture_output=True, text=True, timeout=410)
    doc = json.loads(p.stdout)
    fails = "\n".join(f"{r['case']} [{r['mesh']}] {r['placements']}: {r['error']}" for r in doc["failures"][:40])
    assert p.returncode == 0 and doc["status"] == "ok", f"{len(doc['failures'])} combinations fail:\n{fails}"
    report = ConformanceReport(rows=doc["rows"], rules=doc["rules"], wall_s=doc["wall_s"], cap=doc["cap"])
    assert report.ok and report.rules == "ours" and doc["passed"] == doc["combinations"] == len(report.rows)

    # Every case ran on both meshes, and the plan it ran is the plan the harness promises.
    assert len(report.rows) == len(plan(select_cases(), cap=4))
    ran = {(r["case"], r["mesh"]) for r in report.rows}
    for name in registry.CASES:
        assert (name, "1d") in ran and (name, "2d") in ran, name
    # The multi-mesh-dim layouts ([S(d),S(d)] on 2x2) are part of the plan and pass.
    multi = [r for r in report.rows if r["mesh"] == "2d" and any(
        p.split(",")[0] == p.split(",")[1] and p.startswith("S(") for p in r["placements"].split(" | "))]
    assert len(multi) >= len(registry.CASES) // 2
    # Bytes are measured: something moved somewhere (sharded-vs-replicated mixes need collectives).
    assert sum(r["comm_bytes"] for r in report.rows) > 0
    assert set(report.summary()) == {c.family for c in registry.CASES.values()}
    frame = report.to_frame()
    assert list(frame.columns[:7]) == ["case", "family", "mesh", "placements", "rules", "ok", "max_err"]
    assert set(frame["rules"]) == {"ours"}
    assert len(frame) == len(report.rows) and "combinations pass" in report._repr_html_()


@needs_elementwise
def test_plan_covers_every_placement_of_every_input_and_is_deterministic():
    from torch.distributed.tensor import Replicate, Shard

    from workbench.spmd.conformance import candidates, case_inputs, combinations

    c = registry.CASES["masked/masked_fill/zero"]
    inputs = case_inputs(c)
    a = combinations(c, inputs, 2, cap=1)  # the must-haves only
    assert a == combinations(c, inputs, 2, cap=1)  # every rank walks the same plan
    assert len(a) < 15  # a cover, not the product (23 x 9 pairs)
    assert len(combinations(c, inputs, 2, cap=8)) == max(8, len(a))
    for i, cands in enumerate(candidates(c, inputs)):
        for m in range(2):
            assert {combo[i][m] for combo in a} >= set(cands), (i, m)
        for d in range(inputs[c.shardable[i]].ndim):  # the multi-mesh-dim layout of every tensor dim
            assert any(combo[i] == (Shard(d), Shard(d)) for combo in a)
    assert a[0] == tuple((Replicate(), Replicate()) for _ in c.shardable)
    full = combinations(c, inputs, 1, cap=None)
    assert len(full) == 5 * 3  # x: R, S(0), S(1), P, P(max); mask: R, S(0), S(1)


# --------------------------------------------------------------------------------------------------
# The multi-mesh-dim fallback
# --------------------------------------------------------------------------------------------------


def test_multi_shard_target_keeps_the_largest_mesh_dim():
    from torch.distributed.tensor import Partial, Replicate, Shard

    S0, S1, R = Shard(0), Shard(1), Replicate()
    assert registry.multi_shard_target([S0, S0], (2, 4)) == (R, S0)
    assert registry.multi_shard_target([S0, S0], (4, 2)) == (S0, R)
    assert registry.multi_shard_target([S0, S0], (2, 2)) == (S0, R)  # tie: the first mesh dim
    assert registry.multi_shard_target([S1, S0, S1], (2, 2, 8)) == (R, S0, S1)
    assert registry.multi_shard_target([S0, S1], (2, 2)) is None
    assert registry.multi_shard_target([Partial(), S0], (2, 2)) is None


@pytest.fixture
def fake_world():
    """A fake 8-rank process group in this process (placements and bytes only; no data moves)."""
    import torch.distributed as dist
    from workbench.compat import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_handlers_see_multi_shard_inputs_folded_onto_the_largest_mesh_dim(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    from workbench.spmd.placements import format_placements, make_dtensor, parse_placements

    mesh = init_device_mesh("cpu", (2, 4))
    x = make_dtensor(torch.randn(8, 6), mesh, parse_placements("S(0),S(0)"))
    seen = []

    def handler(op, args, kwargs):
        seen.append(format_placements(args[0].placements))
        return args[0]

    wrapped = registry.with_multi_shard_fallback(handler)
    y = wrapped(torch.ops.aten.exp.default, (x,), {})
    wrapped(torch.ops.aten.exp.default, (make_dtensor(torch.randn(8, 6), mesh, parse_placements("S(0),S(1)")),), {})
    assert seen == ["R,S(0)", "S(0),S(1)"]  # folded onto the 4-way dim; a plain 2-D shard untouched
    assert tuple(y.shape) == (8, 6) and y.to_local().shape == (2, 6)
    n = registry.normalize_multi_shard({"a": [x], "b": 3})
    assert format_placements(n["a"][0].placements) == "R,S(0)" and n["b"] == 3
    # The registry's handler decorator applies the fallback unless told not to.
    assert registry.handler.__defaults__ == ("largest",)


@needs_elementwise
def test_install_and_uninstall_swap_torch_and_our_rules_for_an_op():
    from torch.distributed.tensor import DTensor

    op = torch.ops.aten.masked_fill.Scalar
    prop = DTensor._op_dispatcher.sharding_propagator
    before = prop.op_single_dim_strategy_funcs[op]
    assert not registry.installed() and op in registry.RULES  # import alone installs nothing
    with registry.our_rules():
        assert registry.installed()
        ours = prop.op_single_dim_strategy_funcs[op]
        assert ours.func is registry.RULES[op].single_dim
        with registry.torch_rules():
            theirs = prop.op_single_dim_strategy_funcs[op]
            assert theirs is before and theirs.func is not registry.RULES[op].single_dim
        assert prop.op_single_dim_strategy_funcs[op] is not theirs  # ours again
        assert registry.torch_rule_kind(op) == "single_dim"
    assert not registry.installed() and prop.op_single_dim_strategy_funcs[op] is before  # as torch made it


# --------------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------------


@needs_elementwise
def test_explain_reports_placements_redistributions_bytes_and_who_decided():
    import torch.distributed as dist

    from workbench.spmd import explain

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    a = explain("masked_fill.Scalar", "P,R", "R,R", mesh="2x2").to_dict()
    b = explain(torch.ops.aten.mul.Tensor, "S(0)", "S(1)", mesh="2").to_dict()
    e = explain("hardtanh_backward", "P", "R", mesh="4")
    c = e.to_dict()
    assert not dist.is_initialized()  # explain's fake group is gone again
    # Ours: masked_fill(P(sum), mask, 0) stays Partial and moves nothing; torch all-reduces the activation.
    assert a["decided"] == "ours" and a["rule_kind"] == "single_dim"
    assert a["outputs"] == ["P,R"] and a["total_bytes"] == 0 and a["redistributions"] == []
    assert a["torch"]["outputs"] == ["R,R"]
    # 4x6 float32 all-reduced over the 2 ranks of mesh dim 0: 2 * (2-1)/2 * 96 bytes
    assert a["torch"]["total_bytes"] == 96
    assert a["example"] == "case masked/masked_fill/zero"
    # Torch's: S(0) * S(1) moves the second input to S(0) (gloo: all-gather of a 4x3 shard: 48 bytes).
    assert b["decided"] == "torch" and b["rule"] is None and b["torch_rule"] == "single_dim"
    assert b["outputs"] == ["S(0)"]
    [red] = b["redistributions"]
    assert (red["input"], red["from"], red["to"]) == (1, "S(1)", "S(0)")
    assert red["bytes"] == b["total_bytes"] == 48
    # A hole in torch: hardtanh_backward has no rule there; ours keeps the Partial gradient.
    assert c["decided"] == "ours" and c["outputs"] == ["P"] and c["total_bytes"] == 0
    assert "does not have a sharding strategy" in c["torch"]["error"]
    assert "decided" in e._repr_html_() and "decided: ours" in repr(e)
    assert json.loads(e.to_json())["op"] == "aten.hardtanh_backward.default"


def test_explain_rejects_bad_input_with_one_line():
    from workbench.spmd import explain

    with pytest.raises(ValueError, match=r"cannot read placement 'Q\(0\)'"):
        explain("exp", "Q(0),R", mesh="2x2")
    with pytest.raises(ValueError, match="names 1 mesh dims but the mesh has 2"):
        explain("exp", "S(0)", mesh="2x2")
    with pytest.raises(ValueError, match="no op 'not_an_op'"):
        explain("not_an_op", "R")
    with pytest.raises(ValueError, match="cannot read mesh"):
        explain("exp", "R", mesh="2xx")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@needs_elementwise
def test_cli_explain_rules_and_errors(workbench_cli):
    run = lambda *a: subprocess.run([*workbench_cli, "spmd", *a], capture_output=True, text=True, timeout=100)  # noqa: E731
    p = run("explain", "masked_fill.Scalar", "--mesh", "2x2", "--in", "P(max),R", "--in", "R,R", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["status"] == "ok" and doc["decided"] == "ours" and doc["outputs"] == ["P(max),R"]

    p = run("rules", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    ops = {r["op"]: r for r in doc["rules"]}
    assert ops["aten.masked_fill.Scalar"]["family"] == "masked" and doc["skipped_families"] == {}
    assert ops["aten.hardtanh_backward.default"]["kind"] == "single_dim"
    assert {"masked/masked_fill/zero", "binary/atan2"} <= {c["name"] for c in doc["cases"]}

    p = run("explain", "exp", "--in", "S(0)", "--mesh", "2x2")
    assert p.returncode == 2 and p.stderr.strip().startswith("error:") and len(p.stderr.strip().splitlines()) == 1
    p = run("check", "--family", "nope", "--json")
    assert p.returncode == 2 and "unknown family" in json.loads(p.stdout)["error"]
    p = run("check", "--case", "no/such/case")
    assert p.returncode == 2 and "unknown case(s) ['no/such/case']" in p.stderr
