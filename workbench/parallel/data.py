"""Data parallelism: every dp rank sees a different slice of the global batch.

* replicate (DDP): full weights on every rank; gradients all-reduced, ``g = 1/dp sum_i g_i``.
* fully_shard (FSDP2 / ZeRO-3): each rank keeps 1/dp_shard of every weight, all-gathers it for
  forward and backward, and reduce-scatters gradients. On a 2-D (dp_replicate, dp_shard) mesh this is
  HSDP: sharded within a group, replicated across groups.

ZeRO stages of the dp_shard dimension (``ParallelConfig.zero``) map onto these engines:

    0  DDP                                   params, grads, optimizer state replicated
    1  DDP + ZeroRedundancyOptimizer         optimizer state sharded; each rank steps 1/dp of the params
                                             and broadcasts them (grads are still all-reduced whole)
    2  fully_shard(reshard_after_forward=False)  + grads sharded; params stay gathered until backward
    3  fully_shard(reshard_after_forward=True)   + params sharded again after each block's forward
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
               mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard each transformer block as its own unit (one all-gather per block), then the root."""
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Classic DDP over the 1-D replicate mesh. The model must hold plain (non-DTensor) parameters."""
    return DistributedDataParallel(model, process_group=dp_mesh.get_group(), broadcast_buffers=False)


def zero1_optimizer(params, dp_mesh: DeviceMesh, **adamw_kwargs) -> ZeroRedundancyOptimizer:
    """AdamW whose state is sharded over the 1-D ``dp_mesh`` (ZeRO-1), for use over DDP.

    DDP has already all-reduced every gradient, so gradient clipping sees whole gradients; each rank
    then steps only its partition and broadcasts the updated parameters.
    """
    return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW,
                                   process_group=dp_mesh.get_group(), **adamw_kwargs)
