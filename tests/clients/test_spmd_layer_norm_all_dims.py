"""layer_norm over every dim of a sharded input (issue 29 row 8): the weight and bias gradients are whole
``[*D]`` tensors. Our rule used to sum them over an empty list of row dims, which sums over everything, and
returned 0-d shards: ``full_tensor()`` and an optimizer step on them raised."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench import compat

pytestmark = pytest.mark.skipif(not compat.available("spmd.norms"),
                                reason=f"SPMD rule family 'norms': {compat.skip_reason('spmd.norms')}")


@pytest.mark.parametrize("shard_dim", [0, 2])
def test_layer_norm_over_every_dim_of_a_sharded_input_gives_whole_weight_grads(one_rank_mesh, shard_dim):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from workbench.spmd import our_rules

    gen = torch.Generator().manual_seed(0)
    shape = (4, 6, 5)
    x, w, b = torch.randn(shape, generator=gen), torch.rand(shape, generator=gen) + 0.5, torch.randn(shape, generator=gen)
    cot = torch.randn(shape, generator=gen)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    (F.layer_norm(xs, shape, ws, bs) * cot).sum().backward()

    mesh = one_rank_mesh
    with our_rules():
        # Shard(d) on a 1-rank mesh is still a normalised dim that our rule (not torch's) decides.
        xd = distribute_tensor(x, mesh, [Shard(shard_dim)]).requires_grad_()
        wd, bd = (distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
        out = F.layer_norm(xd, shape, wd, bd)
        (out * distribute_tensor(cot, mesh, [Replicate()])).sum().backward()
        for name, got, want in (("x", xd.grad, xs.grad), ("weight", wd.grad, ws.grad), ("bias", bd.grad, bs.grad)):
            assert got.to_local().shape == got.shape == shape, f"{name}: local {tuple(got.to_local().shape)}"
            torch.testing.assert_close(got.full_tensor(), want, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(out.full_tensor(), F.layer_norm(x, shape, w, b), atol=1e-5, rtol=1e-5)
        # What a training step does with them.
        want = w - 0.1 * ws.grad  # before the step: a 1-rank Replicate DTensor may share w's storage
        torch.optim.SGD([wd, bd], lr=0.1).step()
        torch.testing.assert_close(wd.full_tensor(), want, atol=1e-5, rtol=1e-5)
