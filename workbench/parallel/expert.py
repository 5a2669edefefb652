"""Expert parallelism: each of ``ep`` ranks owns E/ep experts; tokens travel to their expert and back.

Mesh. The ep ranks are carved out of the sharded data-parallel ranks, so every ep rank still reads its
own slice of the batch (ep must divide dp_shard). The standard mesh is left as it is; its
``(dp_replicate, dp_shard)`` slice is unflattened into ``(dp_replicate, dp_shard_mod_ep, ep)``::

    dp_shard = dp_shard_mod_ep x ep          rank's ep index = its dp_shard index mod ep

Parameters and gradients. Expert weights ``w1, w2, w3: (E, ...)`` become DTensors ``Shard(0)`` on the
ep mesh: ep rank i holds experts [i*E/ep, (i+1)*E/ep). Their gradients are synced only over the ranks
that hold the same experts (``dp_replicate x dp_shard_mod_ep``, one FSDP2 unit per experts module);
every other parameter is synced over all dp ranks as before. Gradient bookkeeping, with
``g_r = d loss_r / dW`` the gradient of rank r's own loss::

    after the combine all-to-all's backward, expert owner holds  sum_{r in ep group} g_r
    scaled by 1/ep here, then averaged by FSDP over the D/ep owners  ->  1/D sum_{all dp ranks} g_r

which is what data parallelism gives every other weight, so layouts match one process.

Dispatch and combine (per MoE layer, tokens already sorted by global expert, ``counts: (E,)``)::

    1. all_to_all(counts)                 -> R[s, l]: slots rank s sends to my local expert l
    2. all_to_all(tokens, splits)         -> received in (source, expert) order
    3. permute to (expert, source) order, run the local experts, permute back
    4. all_to_all(outputs, splits^T)      -> each slot returns to the rank it came from

``_AllToAll`` makes 2 and 4 differentiable: the backward of an all-to-all is the all-to-all with the
split sizes swapped. Zero-sized splits (a rank sends or receives nothing for an expert, or at all)
are ordinary empty slices.

Tensor parallelism (without sequence parallel) composes: tp ranks see identical tokens, so experts are
kept whole on every tp rank (not sharded over tp) and each tp rank repeats the same expert math on the
same tokens. That spends tp x the expert FLOPs but needs no extra communication and keeps the
all-to-all within one tp slice (the ep group is ranks with equal tp index).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from workbench.config import ParallelConfig
from workbench.models.moe import GroupedExperts, MoEFeedForward, grouped_swiglu, simulated_split, split_sizes
from workbench.parallel.collectives import Collective

__all__ = ["apply_ep", "expert_meshes", "load_balancing_loss", "ep_comm", "load_balance_comm", "simulated_splits"]


def expert_meshes(mesh: DeviceMesh, parallel: ParallelConfig) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, expert data-parallel mesh) of the standard mesh: dp_shard = dp_shard_mod_ep x ep.

    The expert data-parallel mesh is ``(dp_replicate, dp_shard_mod_ep)``: the ranks holding the same
    experts, over which their gradients are averaged.
    """
    ep = parallel.ep
    dp = mesh[("dp_replicate", "dp_shard")]
    split = dp._unflatten(1, (parallel.dp_shard // ep, ep), ("dp_shard_mod_ep", "ep"))
    expert_dp = split[("dp_replicate", "dp_shard_mod_ep")] if parallel.dp_replicate > 1 else split["dp_shard_mod_ep"]
    return split["ep"], expert_dp


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits along dim 0; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def _source_to_expert_order(recv: torch.Tensor, total: int) -> torch.Tensor:
    """recv[s, l] rows arrived from source s for local expert l, laid out (s, l)-major; ``total`` of them.

    Returns the index that reorders them (l, s)-major, so each local expert's rows are contiguous.
    """
    n_src, n_local = recv.shape
    lens = recv.flatten()
    starts = lens.cumsum(0) - lens
    by_expert = torch.arange(n_src * n_local, device=recv.device).view(n_src, n_local).t().flatten()
    lens, starts = lens[by_expert], starts[by_expert]
    new_starts = lens.cumsum(0) - lens
    pos = torch.arange(total, device=recv.device)
    return pos - new_starts.repeat_interleave(lens, output_size=total) + starts.repeat_interleave(lens, output_size=total)


def simulated_splits(split: list[int], ep: int, me: int) -> tuple[list[int], list[int], list[int]]:
    """The all-to-all sizes of ep rank ``me`` when every rank of the ep group routes its slots as ``split``
    (per global expert; one table for every rank, as a simulated routing gives it, so the sizes agree:
    what rank s sends to rank d is what d receives from s)::

        send[d]   = sum of split over rank d's experts        (rows this rank sends to d)
        recv[s]   = sum of split over my experts               (rows from each source s: the same split)
        rows[l]   = ep * split[me * E/ep + l]                  (rows my local expert l runs)

    Returns ``(send_splits, recv_splits, rows per local expert)``.
    """
    n_local = len(split) // ep
    send = [sum(split[d * n_local:(d + 1) * n_local]) for d in range(ep)]
    mine = split[me * n_local:(me + 1) * n_local]
    return send, [sum(mine)] * ep, [ep * c for c in mine]


class ExpertParallelExperts(GroupedExperts):
    """``GroupedExperts`` whose weights are ep-sharded DTensors; forward dispatches over the ep group.

    The class of an existing ``GroupedExperts`` is swapped for this one (as FSDP2 does), so parameter
    names stay ``...experts.w1`` and checkpoints look the same for every layout.
    """

    ep_group: dist.ProcessGroup
    ep_size: int

    # Always eager, also inside a --compile'd block: the splits are data-dependent, and torch 2.11's
    # compiler mishandles the gradient hooks below (measured: losses off by 0.2 after one step, ep=2).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group, ep = self.ep_group, self.ep_size
        n_local = counts.numel() // ep
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)  # my local experts' counts from each source
        recv = recv.view(ep, n_local)
        # Row counts as numbers. Under FakeTensorMode they have none: balanced routing, each rank receiving
        # as many rows as it sends (workbench.models.moe.split_sizes), or a simulated routing's split.
        sim = simulated_split(counts)
        if sim is not None:
            send_splits, recv_splits, expert_rows = simulated_splits(sim, ep, dist.get_rank(group))
        else:
            send_splits = split_sizes(counts.view(ep, n_local).sum(1), x.shape[0])
            recv_splits = split_sizes(recv.sum(1), x.shape[0])
            expert_rows = None

        tokens = _AllToAll.apply(x, recv_splits, send_splits, group)
        order = _source_to_expert_order(recv, sum(recv_splits))
        weights = []
        for w in (self.w1, self.w2, self.w3):
            local = w.to_local() if isinstance(w, DTensor) else w
            if local.requires_grad:
                local.register_hook(lambda g: g / ep)  # sum over the ep group -> mean (see module doc)
            weights.append(local)
        if expert_rows is None:
            expert_rows = split_sizes(recv.sum(0), sum(recv_splits))
        out = grouped_swiglu(tokens[order], expert_rows, *weights)
        out = out[order.argsort()]
        return _AllToAll.apply(out, send_splits, recv_splits, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, expert_dp_mesh: DeviceMesh | None = None,
             reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard every MoE layer's experts over ``ep_mesh`` and route tokens with all-to-all.

    With ``expert_dp_mesh`` each experts module also becomes its own FSDP2 unit over it, so the
    enclosing block's FSDP2 (over all dp ranks) leaves the expert weights alone. Call this after
    tensor parallelism and before data parallelism.
    """
    ep = ep_mesh.size()
    for module in model.modules():
        if not isinstance(module, MoEFeedForward):
            continue
        experts = module.experts
        if module.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide n_experts={module.n_experts}")
        for name in ("w1", "w2", "w3"):
            p = getattr(experts, name)
            # Every rank holds identical full weights (seeded init), so sharding is a local slice.
            sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=p.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group, experts.ep_size = ep_mesh.get_group(), ep
        if expert_dp_mesh is not None:
            # FSDP2 shards dim 0 (experts) by default. With fewer local experts than expert-dp ranks that
            # leaves most ranks empty and one holding everything, so shard the hidden dim instead.
            local_experts = module.n_experts // ep
            placement = (lambda p: Shard(1)) if local_experts < expert_dp_mesh.size() else None
            fully_shard(experts, mesh=expert_dp_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=mp_policy or MixedPrecisionPolicy(), shard_placement_fn=placement)
    return model


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def load_balancing_loss(model: nn.Module, dp_groups=()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sum over MoE layers of ``E * sum_e f_e * P_e`` with ``f`` counted over all data-parallel ranks.

    Returns ``(aux, tokens_per_expert)``, the latter ``(n_layers, E)`` global counts, or ``(None, None)``
    for a dense model. Each layer's ``P`` (mean router probability, differentiable) stays local. Only
    ``f`` (a count, no gradient) is all-reduced over ``dp_groups``: the gradient averaged over dp ranks
    then equals that of the loss on the whole batch, so every dp layout matches one process.
    """
    layers = [m for m in moe_layers(model) if m.tokens_per_expert is not None]
    if not layers:
        return None, None
    counts = torch.stack([m.tokens_per_expert for m in layers])
    for group in dp_groups:
        dist.all_reduce(counts, group=group)
    frac = counts.float() / counts.sum(dim=1, keepdim=True).clamp(min=1)
    aux = sum(m.n_experts * (f * m.router_prob_mean).sum() for m, f in zip(layers, frac))
    return aux, counts


def ep_comm(ep: int, n_moe: int, n_experts: int, slot_bytes: float, micro: int) -> list[Collective]:
    """What expert parallelism sends per step: per MoE layer and micro-batch the counts all-to-all and
    the token dispatch + combine (``slot_bytes`` = one micro-batch's routed token-slots), and the same
    two again in backward; (ep-1)/ep of the slots leave the rank under balanced routing."""
    if ep <= 1 or not n_moe:
        return []
    calls = n_moe * micro
    return [Collective("all_to_all", "ep", "forward", n_experts * 8, ep, calls, "EP token counts per expert"),
            Collective("all_to_all", "ep", "forward", slot_bytes, ep, 2 * calls,
                       "EP token dispatch + combine (balanced routing)"),
            Collective("all_to_all", "ep", "backward", slot_bytes, ep, 2 * calls, "EP gradients of dispatch + combine")]


def load_balance_comm(dp_dims: dict[str, int], n_moe: int, n_experts: int, micro: int) -> list[Collective]:
    """The router loss's all-reduce of every MoE layer's token counts (int64) over each dp dimension."""
    if not n_moe:
        return []
    return [Collective("all_reduce", dim, "forward", n_moe * n_experts * 8, n, micro, "MoE load-balancing token counts")
            for dim, n in dp_dims.items()]
