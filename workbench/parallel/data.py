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

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from workbench.parallel.collectives import Collective

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

DDP_BUCKET_BYTES = 25 * 1024 * 1024


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
    # Imported here: torch.distributed.optim costs ~0.2 s of CPU, and only ZeRO-1 layouts use it.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(list(params), optimizer_class=torch.optim.AdamW,
                                   process_group=dp_mesh.get_group(), **adamw_kwargs)


def fsdp_comm(unit: dict, unsharded_numel: int, micro: int, compute_size: int, grad_size: int) -> list[Collective]:
    """What one FSDP2 unit communicates per step; ``U = unsharded_numel`` (padded: local shard x shard size).

    Forward all-gather of ``U`` in the compute dtype per micro-batch, again in backward when the unit
    reshards after forward (zero=3); one reduce-scatter of the gradients (reduce dtype) on the last
    micro-batch; under HSDP one all-reduce of the reduced shard ``U / shard_size`` over dp_replicate.
    """
    n, name = unit["shard_size"], unit["name"]
    what = "experts" if name.endswith("experts") else ("blocks" if name.startswith("layers.") else "root")
    dim = unit["shard_dim"]
    out = [Collective("all_gather", dim, "forward", unsharded_numel * compute_size, n, micro,
                      f"FSDP parameters ({what})")]
    if unit["reshard_after_forward"]:
        out.append(Collective("all_gather", dim, "backward", unsharded_numel * compute_size, n, micro,
                              f"FSDP parameters again (reshard_after_forward, {what})"))
    out.append(Collective("reduce_scatter", dim, "backward", unsharded_numel * grad_size, n, 1,
                          f"FSDP gradients ({what})"))
    if unit["replicate_dim"]:
        out.append(Collective("all_reduce", unit["replicate_dim"], "backward", unsharded_numel // n * grad_size,
                              unit["replicate_size"], 1, f"HSDP gradient shards ({what})"))
    return out


def ddp_comm(mesh_dim: str, n: int, grad_bytes: int, param_bytes: int, zero1: bool) -> list[Collective]:
    """DDP: one all-reduce of all local gradients per step, in 25 MiB buckets. ZeRO-1 adds the
    broadcast of each rank's updated partition: n calls of N/n bytes, (n-1)/n x N in total."""
    buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
    out = [Collective("all_reduce", mesh_dim, "backward", grad_bytes / buckets, n, buckets,
                      "DDP gradients (25 MiB buckets)")]
    if zero1:
        out.append(Collective("broadcast", mesh_dim, "optimizer", param_bytes / n, n, n,
                              "ZeRO-1 updated parameter partitions"))
    return out
