"""torch's own op samples (OpInfo) as a conformance source (issue 29 row 8, build 6).

The harness runs every OpInfo sample of an op we have a rule for under the placement combinations it
enumerates (Partial inputs included), forward and gradients, on real gloo ranks, under torch's rules and
under ours. The contract: any combination that passes with torch's rules passes with ours.

By default a bounded subset runs (one sample of each of a dozen OpInfos, the 1-D mesh; it includes the
layer_norm sample whose normalised shape is the whole input, which used to pass with torch's rules only).
``WORKBENCH_SPMD_OPINFO=all`` (``make test-exhaustive``) runs every sample on both meshes (an hour or more).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from workbench import compat

FULL = os.environ.get("WORKBENCH_SPMD_OPINFO") == "all"


def _op_db_or_skip():
    try:
        return compat.op_db()
    except compat.MissingTorchAPI as e:
        pytest.skip(str(e))


needs_norms = pytest.mark.skipif(not compat.available("spmd.norms"),
                                 reason=f"SPMD rule family 'norms': {compat.skip_reason('spmd.norms')}")

# One sample of each: the norms (layer_norm over every dim first), and the pointwise, masked, reduction and
# indexing ops whose rules differ from torch's.
SUBSET = ["native_layer_norm", "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.batch_norm",
          "masked_fill", "where", "clamp", "nn.functional.hardtanh", "max.reduction_with_dim", "index_put",
          "scatter", "add"]


def _summary(report) -> str:
    v = report.versus()
    lines = [f"{v['cases']} combinations: {v['both']} pass with both, {v['ours_only']} ours only, "
             f"{v['torch_only']} torch only, {v['neither']} neither ({report.wall_s:.0f}s)"]
    lines += [f"  torch only: {r['case']} [{r['mesh']}] {r['placements']}: {r['error']}"
              for r in v["torch_only_rows"][:30]]
    return "\n".join(lines)


@needs_norms
@pytest.mark.multirank
@pytest.mark.timeout(1800 if FULL else 420)
def test_every_opinfo_sample_that_passes_with_torchs_rules_passes_with_ours():
    from workbench.spmd import opinfo
    from workbench.spmd.conformance import check

    _op_db_or_skip()
    if FULL:
        report = check(source="opinfo", rules="both", meshes=("1d", "2d"), cap=8, timeout=1700, progress=False)
    else:
        report = check(source="opinfo", opinfo=SUBSET, opinfo_samples=1, rules="both", meshes=("1d",), cap=4,
                       timeout=400, progress=False)
    print(_summary(report))
    v = report.versus()
    assert v["torch_only"] == 0 and report.ok, _summary(report)
    # Both rule sets ran every combination, and the subset is what it says.
    assert v["cases"] == len(report.rows) // 2 > 0
    cases = {r["case"] for r in report.rows}
    if not FULL:
        assert {c.rsplit("/", 1)[0].removeprefix("opinfo/") for c in cases} == set(SUBSET)
    # The layer_norm sample over the whole input (x [1, 2, 3], normalized_shape [1, 2, 3]) ran sharded and
    # passes with ours, gradients of weight and bias included.
    info, samples = opinfo._samples("native_layer_norm")
    assert tuple(samples[0].input.shape) == tuple(samples[0].args[0]) == (1, 2, 3)
    ln = [r for r in report.rows if r["case"] == "opinfo/native_layer_norm/0" and r["rules"] == "ours"]
    sharded = [r for r in ln if r["placements"].split(" | ")[0].startswith("S(")]
    assert sharded and all(r["ok"] for r in sharded), ln
    # Partial inputs are part of the plan.
    assert any("P" in r["placements"] for r in report.rows)


@needs_norms
def test_opinfo_selection_covers_our_rule_ops_and_is_deterministic():
    from workbench.spmd import opinfo
    from workbench.spmd.conformance import case_inputs

    _op_db_or_skip()
    picks = opinfo.select(["native_layer_norm", "nn.functional.group_norm/4", "masked_fill"], max_samples=2)
    by = {}
    for p in picks:
        by.setdefault(p.opinfo, []).append(p)
    assert len(by["native_layer_norm"]) == 2 and [p.index for p in by["nn.functional.group_norm"]] == [4]
    assert "aten.native_layer_norm_backward.default" in by["native_layer_norm"][0].ops
    assert any(o.startswith("aten.masked_fill") for o in by["masked_fill"][0].ops)
    # Every rank rebuilds the same inputs from the pick alone.
    state = torch.get_rng_state()
    case = opinfo.make_case(by["nn.functional.group_norm"][0])
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is left alone
    opinfo._samples.cache_clear()  # built again, not the cached tensors
    again = opinfo.make_case(opinfo.Pick("nn.functional.group_norm", 4, ()))
    for a, b in zip(case_inputs(case), case_inputs(again)):
        assert a.shape == b.shape and bool((a == b).all())
    assert case.requires_grad == (0, 1, 2)  # x, weight, bias: the sample's own requires_grad


def test_cli_refuses_bad_opinfo_requests_in_one_line(workbench_cli):
    p = subprocess.run([*workbench_cli, "spmd", "check", "--opinfo", "where", "--json"],
                       capture_output=True, text=True, timeout=120)
    doc = json.loads(p.stdout)
    assert p.returncode == 2 and doc["status"] == "error" and "--source opinfo" in doc["error"]
    p = subprocess.run([*workbench_cli, "spmd", "check", "--source", "opinfo", "--opinfo", "no_such_op"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    line = p.stderr.strip()
    assert line.startswith("error:") and "\n" not in line and ("no_such_op" in line or "OpInfo" in line), p.stderr


def test_a_report_of_both_rule_sets_counts_our_rows():
    """Under rules="both" every combination has a row per rule set; the counts shown are ours (before, a
    combination failing under both rule sets showed as "2/2 combinations pass")."""
    from workbench.spmd.conformance import ConformanceReport

    row = {"case": "c", "family": "norms", "mesh": "(2,)", "placements": "S(0)", "ok": False, "max_err": None,
           "fwd_bytes": 0, "bwd_bytes": 0, "comm_bytes": 0, "out_placements": None, "error": "x"}
    report = ConformanceReport([{**row, "rules": "torch"}, {**row, "rules": "ours"}], "both", 1.0, 4)
    assert "0/1 combinations pass" in repr(report) and "0/1 combinations pass" in report._repr_html_()
    assert report.summary()["norms"]["combinations"] == 1 and list(report.to_frame()["rules"]) == ["torch", "ours"]
    assert report.ok  # nothing passes with torch's rules only
