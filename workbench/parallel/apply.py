"""ParallelConfig -> a parallelized model. The single place that decides which technique applies.

    tp > 1                      -> tensor parallel over mesh["tp"] (with sequence parallel if asked)
    dp_shard > 1                -> FSDP2 over mesh["dp_shard"], or HSDP over (dp_replicate, dp_shard)
    dp_replicate > 1 alone      -> DDP over mesh["dp_replicate"]
    dp_replicate > 1 with tp    -> HSDP with a shard group of one: replicated DTensor-aware data parallel
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import ParallelConfig
from workbench.parallel.data import apply_ddp, apply_fsdp
from workbench.parallel.tensor import apply_tp


def parallelize(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh | None) -> nn.Module:
    """Apply ``parallel`` to ``model`` (in place where possible) and return the module to train."""
    if mesh is None or parallel.world_size == 1:
        return model
    if parallel.tp > 1:
        apply_tp(model, mesh["tp"], parallel.sequence_parallel)
    if parallel.dp_shard > 1 or (parallel.dp_replicate > 1 and parallel.tp > 1):
        dims = ("dp_replicate", "dp_shard") if parallel.dp_replicate > 1 else ("dp_shard",)
        dp_mesh = mesh[dims]
        return apply_fsdp(model, dp_mesh)
    if parallel.dp_replicate > 1:
        return apply_ddp(model, mesh["dp_replicate"])
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under a DDP wrapper (FSDP2 and TP modify the module in place)."""
    return getattr(model, "module", model)
