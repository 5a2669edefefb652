"""group_norm's backward through its mean/rstd outputs (issue 29 build 6: torch's OpInfo samples of
native_group_norm failed with both rule sets). When ``mean``/``rstd`` get gradients too, autograd runs
``infinitely_differentiable_native_group_norm_backward``, which calls the in-place view op ``unsqueeze_`` on
DTensors. torch 2.13 has no DTensor rule for it, so every placement raised, all-Replicate included; ours
gives it one (and keeps the wrapper's shape in step with its local tensor)."""

from __future__ import annotations

import pytest
import torch

from workbench import compat

pytestmark = pytest.mark.skipif(not compat.available("spmd.norms"),
                                reason=f"SPMD rule family 'norms': {compat.skip_reason('spmd.norms')}")


def _run(x, w, b, cots):
    out, mean, rstd = torch.native_group_norm(x, w, b, x.shape[0], x.shape[1], x[0, 0].numel(), 2, 1e-5)
    torch.autograd.backward([out, mean, rstd], cots)
    return out, mean, rstd


@pytest.mark.parametrize("x_placement", ["R", "S(0)", "S(2)"])
def test_group_norm_backward_through_mean_and_rstd_matches_dense(one_rank_mesh, x_placement):
    from torch.distributed.tensor import Replicate, distribute_tensor

    from workbench.spmd import our_rules, torch_rules
    from workbench.spmd.placements import parse_placements

    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 6, 3, generator=gen), torch.rand(6, generator=gen) + 0.5, torch.randn(6, generator=gen)
    cots = [torch.randn(2, 6, 3, generator=gen), torch.randn(2, 2, generator=gen), torch.randn(2, 2, generator=gen)]
    dense = [t.clone().requires_grad_() for t in (x, w, b)]
    want = _run(*dense, cots)

    mesh = one_rank_mesh

    def distributed():
        xd = distribute_tensor(x.clone(), mesh, parse_placements(x_placement)).requires_grad_()
        wd, bd = (distribute_tensor(t.clone(), mesh, [Replicate()]).requires_grad_() for t in (w, b))
        got = _run(xd, wd, bd, [distribute_tensor(c, mesh, [Replicate()]) for c in cots])
        return got, (xd, wd, bd)

    with torch_rules():  # torch's gap, which this test pins: if torch gains a rule, the note in norms.py goes
        with pytest.raises(NotImplementedError, match="unsqueeze_"):
            distributed()
    with our_rules():
        got, leaves = distributed()
        for g, wnt in zip(got, want):
            torch.testing.assert_close(g.full_tensor(), wnt.detach(), atol=1e-5, rtol=1e-5)
        for name, leaf, d in zip(("x", "weight", "bias"), leaves, dense):
            assert leaf.grad.shape == d.shape, name
            torch.testing.assert_close(leaf.grad.full_tensor(), d.grad, atol=1e-5, rtol=1e-5, msg=name)
