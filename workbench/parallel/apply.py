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
from torch.distributed.tensor import DTensor

from workbench import compat
from workbench.config import OPTIM_IMPLS, ParallelConfig, TrainConfig
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
        if parallel.tp > 1:  # the TP output head returns a view of the logits: FSDP2 warns, needlessly here
            compat.quiet_fsdp_view_output_warning()
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
    """The AdamW hyperparameters of every run and plan (the implementation is :func:`optimizer_impl`'s)."""
    return {"lr": train.lr, "weight_decay": train.weight_decay, "betas": (0.9, 0.95)}


def _layout(p: torch.Tensor) -> tuple:
    """What foreach and fused kernels need shared by every tensor of one call: plain tensors of one
    device, or DTensors on one device mesh (placements may differ)."""
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh)
    return ("tensor", p.device)


def optimizer_impl(choice: str, params: list[torch.Tensor]) -> str:
    """What ``TrainConfig.optim_impl`` means for these parameters: 'fused', 'foreach' or 'loop'.

    ``auto`` is fused on CUDA (one kernel launch per tensor group instead of ~10 per parameter) and the
    per-parameter loop elsewhere, whose arithmetic is the reference the parity tests hold every layout to.
    """
    if choice not in OPTIM_IMPLS:
        raise ValueError(f"optim_impl={choice!r}; choose one of {', '.join(OPTIM_IMPLS)}")
    if choice != "auto":
        return choice
    return "fused" if params and params[0].device.type == "cuda" else "loop"


def layout_groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` split so each group shares one layout (:func:`_layout`), in first-seen order."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(_layout(p), []).append(p)
    return list(groups.values())


def build_optimizer(model: nn.Module, parallel: ParallelConfig, mesh: DeviceMesh | None,
                    train: TrainConfig | None = None, **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over the model's (fp32 master) parameters; its state sharded over dp_shard under zero=1.

    ``train`` gives the run's settings (:func:`adamw_settings`, and ``optim_impl``: :func:`optimizer_impl`);
    keyword arguments override them. Fused and foreach kernels take one layout per call, so where a
    layout mixes them (tensor parallelism's replicated norms beside its DTensors, FSDP x TP's 1-D and
    2-D meshes, experts on their own mesh) the parameters go into one param group per layout, with the
    same hyperparameters: the update is the same, and checkpoints key optimizer state by parameter name.
    """
    params = list(model.parameters())
    if train is not None:
        impl = optimizer_impl(train.optim_impl, params)
        adamw_kwargs = {**adamw_settings(train), "foreach": impl == "foreach", "fused": impl == "fused" or None,
                        **adamw_kwargs}
    if mesh is not None and parallel.zero == 1 and parallel.dp_shard > 1:
        return zero1_optimizer(params, mesh["dp_shard"], **adamw_kwargs)
    if adamw_kwargs.get("foreach") or adamw_kwargs.get("fused"):
        groups = layout_groups(params)
        if len(groups) > 1:
            return torch.optim.AdamW([{"params": g} for g in groups], **adamw_kwargs)
    return torch.optim.AdamW(params, **adamw_kwargs)


def optimizer_impl_of(opt: torch.optim.Optimizer) -> str:
    """Which implementation ``opt`` (an AdamW, or ZeRO-1's around one) steps with."""
    inner = getattr(opt, "optim", opt)
    d = inner.defaults
    return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "loop"
