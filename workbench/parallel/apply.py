"""ParallelConfig -> a parallelized model. The single place that decides which technique applies.

    tp > 1                      -> tensor parallel over mesh["tp"] (with sequence parallel if asked)
    dp_shard > 1                -> FSDP2 over mesh["dp_shard"], or HSDP over (dp_replicate, dp_shard)
    dp_replicate > 1 alone      -> DDP over mesh["dp_replicate"]
    dp_replicate > 1 with tp    -> HSDP with a shard group of one: replicated DTensor-aware data parallel
    ep > 1                      -> experts sharded over ep (carved out of dp_shard), tokens by all-to-all

``ParallelConfig.zero`` picks the engine of the dp_shard dimension (0/1: DDP, 2/3: FSDP2; see
``workbench.parallel.data``). With a TrainConfig, activation checkpointing goes on after TP and
before data parallelism, and FSDP2 gets the mixed-precision policy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from workbench.config import ParallelConfig, TrainConfig
from workbench.parallel.checkpointing import apply_ac
from workbench.parallel.data import apply_ddp, apply_fsdp, zero1_optimizer
from workbench.parallel.expert import apply_ep, expert_meshes
from workbench.parallel.precision import fsdp_mp_policy
from workbench.parallel.tensor import apply_tp


def parallelize(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh | None,
                train: TrainConfig | None = None) -> nn.Module:
    """Apply ``parallel`` to ``model`` (in place where possible) and return the module to train.

    :func:`shard` then, where the layout replicates with DDP, :func:`apply_ddp`. DDP reads real
    weights, so ``workbench.parallel.build`` calls the two halves around materialization instead.
    """
    model = shard(model, parallel, mesh, train)
    dim = ddp_dim(parallel) if mesh is not None else None
    return apply_ddp(model, mesh[dim]) if dim else model


def shard(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh | None,
          train: TrainConfig | None = None) -> nn.Module:
    """Every technique but DDP: TP, activation checkpointing, EP, FSDP2. Works on meta modules."""
    train = train or TrainConfig()
    if mesh is None or parallel.world_size == 1:
        return apply_ac(model, train.activation_checkpointing, train.ac_every)
    if parallel.tp > 1:
        apply_tp(model, mesh["tp"], parallel.sequence_parallel)
    apply_ac(model, train.activation_checkpointing, train.ac_every)
    if parallel.ep > 1:  # experts become their own FSDP2 units, before the blocks around them
        ep_mesh, expert_dp_mesh = expert_meshes(mesh, parallel)
        apply_ep(model, ep_mesh, expert_dp_mesh, reshard_after_forward=parallel.zero != 2,
                 mp_policy=fsdp_mp_policy(train.mixed_precision))
    if ddp_dim(parallel) is None and (parallel.dp_shard > 1 or (parallel.dp_replicate > 1 and parallel.tp > 1)):
        dims = ("dp_replicate", "dp_shard") if parallel.dp_replicate > 1 else ("dp_shard",)
        return apply_fsdp(model, mesh[dims], reshard_after_forward=parallel.zero != 2,
                          mp_policy=fsdp_mp_policy(train.mixed_precision))
    return model


def ddp_dim(parallel: ParallelConfig) -> str | None:
    """The mesh dimension DDP replicates over in this layout, or None where it uses no DDP."""
    if parallel.world_size == 1:
        return None
    if parallel.dp_shard > 1:
        return "dp_shard" if parallel.zero <= 1 else None
    if parallel.dp_replicate > 1 and parallel.tp == 1:
        return "dp_replicate"
    return None


def adamw_settings(train: TrainConfig) -> dict:
    """The AdamW hyperparameters of every run and plan."""
    return {"lr": train.lr, "weight_decay": train.weight_decay, "betas": (0.9, 0.95), "foreach": False}


def build_optimizer(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh | None,
                    train: TrainConfig | None = None, **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over the model's (fp32 master) parameters; its state sharded over dp_shard under zero=1.

    ``train`` gives the run's settings (:func:`adamw_settings`); keyword arguments override them.
    """
    if train is not None:
        adamw_kwargs = {**adamw_settings(train), **adamw_kwargs}
    params = list(model.parameters())
    if mesh is not None and parallel.zero == 1 and parallel.dp_shard > 1:
        return zero1_optimizer(params, mesh["dp_shard"], **adamw_kwargs)
    return torch.optim.AdamW(params, **adamw_kwargs)
