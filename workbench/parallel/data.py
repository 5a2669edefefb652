"""Data parallelism: every dp rank sees a different slice of the global batch.

* replicate (DDP): full weights on every rank; gradients all-reduced, ``g = 1/dp sum_i g_i``.
* fully_shard (FSDP2 / ZeRO-3): each rank keeps 1/dp_shard of every weight, all-gathers it for
  forward and backward, and reduce-scatters gradients. On a 2-D (dp_replicate, dp_shard) mesh this is
  HSDP: sharded within a group, replicated across groups.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True) -> nn.Module:
    """Shard each transformer block as its own unit (one all-gather per block), then the root."""
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Classic DDP over the 1-D replicate mesh. The model must hold plain (non-DTensor) parameters."""
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), broadcast_buffers=False)
