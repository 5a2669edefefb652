"""Tensor parallelism (Megatron-style) with optional sequence parallelism, written as a plan.

Column-parallel splits a weight's output features, row-parallel its input features::

    Y = X W,  W = [W_1 ... W_p]     (colwise: rank i computes X W_i, no communication)
    Y = sum_i X_i W_i               (rowwise: an all-reduce, or a reduce-scatter under SP)

Attention is colwise on wq/wk/wv (each rank owns n_heads/tp heads) and rowwise on wo; the feed-forward
is colwise on w1/w3 and rowwise on w2. With sequence parallelism the norms and residual stream hold
a slice of the sequence (Shard(1)), and the all-reduce becomes reduce-scatter + all-gather.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from workbench.parallel.collectives import Collective


def root_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for the embedding, final norm and output head."""
    if sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one TransformerBlock, by the block-relative name of each submodule."""
    if sequence_parallel:
        # The residual stream is Shard(1); gather it before attention / ffn, reduce-scatter after.
        return {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh``. A pipeline stage may lack root modules."""
    plan = {k: v for k, v in root_plan(sequence_parallel).items() if getattr(model, k, None) is not None}
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        plan = block_plan(sequence_parallel)
        if not hasattr(block.feed_forward, "w1"):
            # Mixture of experts: router and experts stay whole on every tp rank, which all see the
            # same tokens (see workbench.parallel.expert); only attention is sharded.
            plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        parallelize_module(block, tp_mesh, plan)
    return model


def tp_comm(tp: int, sequence_parallel: bool, n_dense: int, n_moe: int, has_first: bool, has_last: bool,
            act_bytes: float, logits_bytes: float, norm_grad_bytes: float, micro: int) -> list[Collective]:
    """What tensor parallelism communicates per step over ``tp`` ranks.

    Per block and micro-batch, with ``X = act_bytes`` one micro-batch's activation: without SP the
    forward all-reduces after ``wo`` and ``w2`` (2X) and backward all-reduces the input gradients of
    ``wq/wk/wv`` and ``w1/w3`` (2X); MoE blocks keep their experts whole, so 1 + 1. Under SP each
    all-reduce becomes a reduce-scatter plus an all-gather of the same X, and the norm weights' partial
    gradients are all-reduced. The embedding all-reduces (reduce-scatters under SP) its output; the
    output head all-gathers the logits and all-reduces its input gradient (SP: gathers X forward and
    reduce-scatters its gradient backward).
    """
    if tp <= 1:
        return []
    sp, calls = sequence_parallel, micro
    per_block = (2 * n_dense + n_moe) * calls
    out = []
    if not sp:
        out += [Collective("all_reduce", "tp", "forward", act_bytes, tp, per_block, "TP block outputs (wo, w2)"),
                Collective("all_reduce", "tp", "backward", act_bytes, tp, per_block,
                           "TP input gradients (wq/wk/wv, w1/w3)")]
    else:
        out += [Collective("all_gather", "tp", "forward", act_bytes, tp, per_block,
                           "SP sequence all-gather before attention / ffn"),
                Collective("reduce_scatter", "tp", "forward", act_bytes, tp, per_block,
                           "SP reduce-scatter after wo / w2"),
                Collective("all_gather", "tp", "backward", act_bytes, tp, per_block,
                           "SP gradient all-gather (backward of reduce-scatter)"),
                Collective("reduce_scatter", "tp", "backward", act_bytes, tp, per_block,
                           "SP input-gradient reduce-scatter (backward of all-gather)"),
                Collective("all_reduce", "tp", "backward", norm_grad_bytes, tp,
                           2 * (n_dense + n_moe) + (1 if has_last else 0), "SP norm weight gradients (partial over tp)")]
    if has_first:
        out.append(Collective("reduce_scatter" if sp else "all_reduce", "tp", "forward", act_bytes, tp, calls,
                              "TP embedding output"))
    if has_last:
        out.append(Collective("all_gather", "tp", "forward", logits_bytes, tp, calls,
                              "TP logits (output head, Replicate)"))
        if sp:
            out += [Collective("all_gather", "tp", "forward", act_bytes, tp, calls,
                               "SP sequence all-gather before the output head"),
                    Collective("reduce_scatter", "tp", "backward", act_bytes, tp, calls, "SP output-head input gradient")]
        else:
            out.append(Collective("all_reduce", "tp", "backward", act_bytes, tp, calls, "TP output-head input gradient"))
    return out
