"""``explain`` shows and sets an op's non-tensor arguments, and its torch side is what torch really does.

Issue 16, item 6: ``max.dim`` hid which dim it reduced, and the batch-sharded ``batch_norm`` that
``explain`` reported as ``R | R | R`` under torch's rules came out ``Shard(1)`` in notebook 03's measured
run. Torch's rule picks by estimated cost, so its answer depends on the activation's size: here the
measured run and ``explain`` get the same call and must agree, for a small and a large activation.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.distributed as dist

from workbench import compat

needs = lambda fam: pytest.mark.skipif(not compat.available(f"spmd.{fam}"),  # noqa: E731
                                       reason=f"SPMD rule family {fam!r}: {compat.skip_reason(f'spmd.{fam}')}")


@pytest.fixture(autouse=True)
def _no_process_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")


@needs("reductions")
def test_explain_shows_the_call_and_overriding_dim_changes_the_placements():
    from workbench.spmd import explain

    # max.dim's case reduces dim 0 of a [6, 8] input: with dim 1 sharded that reduction is local.
    e = explain("max.dim", "S(1)", mesh="2")
    assert e.call == "aten.max.dim(self=in0, dim=0, keepdim=False)" and e.arguments == {"dim": 0, "keepdim": False}
    assert e.outputs == ["S(0)", "S(0)"] and e.total_bytes == 0
    assert "  call: aten.max.dim(self=in0, dim=0, keepdim=False)" in str(e).splitlines()

    # Reducing the sharded dim instead: our rule all-reduces (value, index) keys of the [6, 1] winners.
    d1 = explain("max.dim", "S(1)", mesh="2", dim=1)
    assert d1.arguments == {"dim": 1, "keepdim": False} and d1.example == "case reduction/max.dim/dim0 with dim=1"
    assert d1.outputs == ["R", "R"] and d1.decided == "ours" and d1.total_bytes == 48
    assert d1.to_dict() == explain("max.dim", "S(1)", mesh="2", kwargs={"dim": 1}).to_dict()
    assert "dim=1, keepdim=False" in d1._repr_html_()
    assert json.loads(d1.to_json())["arguments"] == {"dim": 1, "keepdim": False}

    kept = explain("max.dim", "S(1)", mesh="2", dim=0, keepdim=True)
    assert kept.outputs == ["S(1)", "S(1)"] and "keepdim=True" in kept.call


@needs("reductions")
def test_explain_names_the_valid_arguments_when_one_is_wrong():
    from workbench.spmd import explain

    with pytest.raises(ValueError, match=r"^aten.max.dim has no argument 'dims'; its non-tensor arguments: "
                                         r"dim, keepdim$"):
        explain("max.dim", "S(1)", mesh="2", dims=1)
    with pytest.raises(ValueError, match=r"^'self' is a tensor input of aten.max.dim .*: dim, keepdim$"):
        explain("max.dim", "S(1)", mesh="2", kwargs={"self": 1})
    with pytest.raises(ValueError, match=r"dim=7.*fails on plain tensors: Dimension out of range"):
        explain("max.dim", "S(1)", mesh="2", dim=7)
    assert not dist.is_initialized()


@pytest.mark.timeout(60)
@needs("reductions")
def test_cli_explain_sets_arguments_and_rejects_a_bad_one_in_one_line(workbench_cli):
    base = [*workbench_cli, "spmd", "explain", "max.dim", "--mesh", "2", "--in", "S(1)"]
    run = lambda *a: subprocess.run([*base, *a], capture_output=True, text=True, timeout=50)  # noqa: E731
    p = run("--arg", "dim=1", "--arg", "keepdim=True", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["arguments"] == {"dim": 1, "keepdim": True} and doc["outputs"] == ["R", "R"]
    assert doc["call"] == "aten.max.dim(self=in0, dim=1, keepdim=True)"

    p = run("--arg", "dims=1")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "error: aten.max.dim has no argument 'dims'; its non-tensor arguments: dim, keepdim"]


def test_cli_explain_rejects_an_unreadable_arg_value_in_one_line(capsys):
    from workbench.cli import main

    assert main(["spmd", "explain", "max.dim", "--in", "S(1)", "--mesh", "2", "--arg", "keepdim=maybe"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        "error: cannot read --arg 'keepdim=maybe'; write NAME=VALUE with a Python literal, e.g. dim=1, "
        "keepdim=True, dims=(0, 1), reduce='mean'"]


def _measured_batch_norm(shape) -> tuple[str, int]:
    """F.batch_norm in training mode on a batch-sharded DTensor under torch's rules, as notebook 03 runs it:
    (output placement, forward bytes sent per rank)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from workbench.plan.simulate import fake_world
    from workbench.spmd import torch_rules
    from workbench.spmd.comm import CommBytesMode
    from workbench.spmd.placements import format_placements

    c = shape[1]
    with fake_world(2), torch_rules():
        mesh = init_device_mesh("cpu", (2,))
        rep = lambda t: distribute_tensor(t, mesh, [Replicate()])  # noqa: E731
        x = distribute_tensor(torch.randn(shape), mesh, [Shard(0)])
        w, b, rm, rv = rep(torch.ones(c)), rep(torch.zeros(c)), rep(torch.zeros(c)), rep(torch.ones(c))
        with CommBytesMode() as fwd:
            y = F.batch_norm(x, rm, rv, w, b, training=True)
        return format_placements(y.placements), fwd.total_bytes


@needs("norms")
@pytest.mark.parametrize("shape, torch_out", [((6, 4, 5, 3), "R"), ((8, 64, 8, 8), "S(1)")])
def test_batch_norm_torch_side_matches_a_measured_run(shape, torch_out):
    """Below about 81 KB torch all-gathers the activation, above it all-to-alls it to channel shards."""
    from workbench.spmd import explain

    placement, fwd_bytes = _measured_batch_norm(shape)
    e = explain("native_batch_norm", "S(0)", mesh="2", shapes=[shape] + [(shape[1],)] * 4)
    assert e.arguments == {"training": True, "momentum": 0.1, "eps": 1e-5}  # F.batch_norm's defaults
    assert placement == e.torch["outputs"][0] == torch_out
    assert fwd_bytes == e.torch["total_bytes"] == 4 * torch.Size(shape).numel() // 2
    assert e.outputs[0] == "S(0)" and e.total_bytes == 2 * 4 * shape[1]  # ours: 2 all-reduces of C floats
    assert any("estimated cost" in n for n in e.notes)


def test_our_max_dim_rule_refuses_a_dim_out_of_range_as_torch_does():
    """Our rule used to wrap dim=7 around a 2-d input (7 % 2) and answer; torch's error must come through."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import workbench.spmd as spmd
    from workbench.plan.simulate import fake_world

    was = spmd.installed()
    spmd.install()
    try:
        with fake_world(2):
            x = distribute_tensor(torch.randn(4, 6), init_device_mesh("cpu", (2,)), [Shard(1)])
            with pytest.raises((IndexError, RuntimeError), match="Dimension out of range"):
                torch.max(x, dim=7)
            assert torch.max(x, dim=-1).values.shape == (4,)
    finally:
        if not was:
            spmd.uninstall()
