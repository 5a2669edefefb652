"""DTensor rules for our kernel ops (workbench/spmd/kernels.py), in a real 4-rank gloo run.

The whole registry, these cases included, passes the conformance harness in tests/test_spmd.py. Here:
the rules that promise to run on the local shards move no bytes of the sharded operand, and the
layout-invariant dropout draws, on each shard, exactly the unsharded tensor's mask (``ok`` is an exact
comparison with the dense run: a mask drawn from local coordinates would differ).
"""

from __future__ import annotations

import pytest
import torch

from workbench import kernels
from workbench.spmd import registry

pytestmark = pytest.mark.multirank


def test_every_kernel_op_has_a_rule_and_a_conformance_case():
    import workbench.spmd  # noqa: F401  (registers the kernel family)

    ops = set(kernels.custom_ops())
    assert len(ops) == len(kernels.OP_NAMES)
    assert ops <= set(registry.RULES)
    covered = {op for c in registry.CASES.values() if c.family == "kernel" for op in c.ops}
    forward = {op for op in ops if not str(op).split(".")[1].endswith(("_backward", "_"))}
    assert forward <= covered, sorted(map(str, forward - covered))


@pytest.mark.timeout(120)
def test_local_rules_move_nothing_and_dropout_masks_match_the_dense_run():
    from workbench.spmd import check

    report = check(names=[n for n in registry.CASES if n.startswith("kernel/")], meshes=("1d",), cap=None,
                   progress=False, timeout=100)
    assert report.ok, report.failures[:5]
    rows = {(r["case"], r["placements"]): r for r in report.rows}
    local = [("kernel/dropout_add/p0.3", "S(0) | S(0)"), ("kernel/dropout_add/p0.3", "S(1) | S(1)"),
             ("kernel/masked_fill/tensor-value", "S(0) | S(0)"), ("kernel/masked_fill/broadcast-mask", "S(1)"),
             ("kernel/set_value/strided", "S(1) | S(1)")]
    for key in local:
        assert rows[key]["comm_bytes"] == 0, (key, rows[key]["bytes_by_kind"])
    # index_put writes into the owning shard, and its backward gathers each shard's own rows into a
    # Partial(sum) gradient of the values: nothing moves either way (the harness sums it afterwards).
    for name in ("kernel/index_put/accumulate-duplicates", "kernel/index_put/overwrite-last-writer",
                 "kernel/index_put/broadcast-row"):
        assert rows[(name, "S(0)")]["comm_bytes"] == 0, rows[(name, "S(0)")]["bytes_by_kind"]
        assert rows[(name, "S(0)")]["out_placements"] == "S(0)"
    # values broadcast over the rows: each shard sums its own rows' gradient, Partial(sum) too
    assert rows[("kernel/index_put/broadcast-row", "S(0)")]["comm_bytes"] == 0
    # Boolean select has a data-dependent size: it runs replicated, and says so with its bytes.
    assert rows[("kernel/mask_select/rows", "S(0)")]["fwd_bytes"] > 0


def test_dropout_rule_draws_the_global_mask_on_each_shard():
    """The rule's promise, without processes: two row shards drawn with their global offsets are the
    whole tensor's draw."""
    x, r = torch.randn(6, 8), torch.randn(6, 8)
    whole = torch.ops.workbench.dropout_add(x, r, 0.4, 99, 3, [], [])
    top = torch.ops.workbench.dropout_add(x[:3], r[:3], 0.4, 99, 3, [6, 8], [0, 0])
    bottom = torch.ops.workbench.dropout_add(x[3:], r[3:], 0.4, 99, 3, [6, 8], [3, 0])
    assert torch.equal(torch.cat([top, bottom]), whole)
