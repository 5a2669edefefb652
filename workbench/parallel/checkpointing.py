"""Activation checkpointing: keep less for backward, recompute the rest in backward.

A transformer block saves roughly ``b*s*(c1*dim + c2*ffn_hidden + heads*s)`` activation values for its
backward. The policies (``TrainConfig.activation_checkpointing``, ``--ac``)::

    none       every block saves everything
    full       every block is checkpointed whole: it keeps only its input x (b*s*dim) and runs its
               forward a second time inside backward (~1/3 more compute)
    selective  layer-level, every k-th block (k = ``ac_every``): blocks 0, k, 2k, ... are checkpointed
               whole, the others save everything: a knob between the two
    op         op-level, in every block: torchtitan's save list. The outputs of matmuls (``aten.mm``,
               except every second one), of attention (flash, memory-efficient and cuDNN on CUDA, the
               flash kernel on CPU) and of reduce-scatters are saved; everything else (norms,
               activations' elementwise ops, casts, every second matmul) is recomputed

Applied from the outside after tensor parallelism and before FSDP2/DDP (so FSDP's all-gather wraps
the recomputation too, as in torchtitan). We use non-reentrant checkpointing
(``torch.utils.checkpoint(use_reentrant=False)`` through ``checkpoint_wrapper``), which preserves
RNG and autocast state, so the recomputed forward is the same computation and losses are bitwise
equal with and without checkpointing (``op`` too: what it recomputes is recomputed exactly). The
wrapper's ``state_dict`` hides its ``_checkpoint_wrapped_module.`` prefix, so checkpoint keys do not
change.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch import nn

from workbench import compat

__all__ = ["checkpointed_blocks", "apply_ac", "ac_policy", "op_save_list", "AC_POLICIES"]

# what each policy is, for plans, predictions and run metadata (``ac_policy``)
AC_POLICIES = {
    "none": "none: every block saves its activations",
    "full": "full: every block checkpointed whole",
    "selective": "selective (layer-level): every {k}-th block checkpointed whole",
    "op": "op (torchtitan's op-level save list, every block): saves matmul outputs except every second, "
          "attention and reduce-scatter outputs; recomputes the rest",
}

# torchtitan's save list (torchtitan/distributed/activation_checkpoint.py), plus the CPU's flash kernel so
# that the policy behaves the same on CPU runs and predictions: (namespace, operator) pairs, looked up in
# the running torch (an operator this build lacks is left out)
_SAVE_OPS = (("aten", "mm.default"), ("aten", "_scaled_dot_product_efficient_attention.default"),
             ("aten", "_scaled_dot_product_flash_attention.default"),
             ("aten", "_scaled_dot_product_cudnn_attention.default"),
             ("aten", "_scaled_dot_product_flash_attention_for_cpu.default"),
             ("_c10d_functional", "reduce_scatter_tensor.default"))


def ac_policy(mode: str, every: int = 2) -> str:
    """The policy ``mode`` (with ``every`` for selective) in words: what plans and predictions name."""
    if mode not in AC_POLICIES:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; choose one of {list(AC_POLICIES)}")
    return AC_POLICIES[mode].format(k=every)


def checkpointed_blocks(n_layers: int, mode: str, every: int = 2) -> list[int]:
    """Indices of the blocks ``mode`` checkpoints (``op``: every block, each with the op-level policy)."""
    if mode == "none":
        return []
    if mode in ("full", "op"):
        return list(range(n_layers))
    if mode == "selective":
        return list(range(0, n_layers, every))
    raise ValueError(f"activation_checkpointing={mode!r} is unknown; choose one of {list(AC_POLICIES)}")


def op_save_list() -> frozenset:
    """The operators whose outputs the ``op`` policy saves (those of them the running torch has)."""
    ops = []
    for namespace, name in _SAVE_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace, None), packet, None), overload, None)
        if op is not None:
            ops.append(op)
    return frozenset(ops)


def _op_level_context() -> Callable[[], tuple]:
    """torchtitan's op-level policy as a ``context_fn`` for ``torch.utils.checkpoint``: a fresh count of
    matmuls per checkpointed call, kept apart for the forward and its recomputation, so both save the
    same (odd-numbered) matmuls."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from workbench.memory.recorder import saves_for_backward

    save = op_save_list()
    mm = torch.ops.aten.mm.default

    def context():
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            if func == mm:
                counts[key] += 1
            keep = func in save and not (func == mm and counts[key] % 2 == 0)
            out = getattr(ctx, "op_output", None)  # torch 2.13 asks after the operator ran
            if keep and out is not None and not ctx.is_recompute:
                saves_for_backward(out if isinstance(out, (tuple, list)) else (out,))
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    """Wrap the chosen transformer blocks of ``model.layers`` in place; returns ``model``."""
    names = list(model.layers.keys())
    chosen = checkpointed_blocks(len(names), mode, every)
    if not chosen:
        return model
    # torch's wrapper is private API: only a run that checkpoints needs it (config validation refuses
    # activation_checkpointing on a torch that lacks it).
    checkpoint_wrapper, CheckpointImpl = compat.get("checkpoint_wrapper"), compat.get("CheckpointImpl")
    extra = {"context_fn": _op_level_context()} if mode == "op" else {}
    for i in chosen:
        block = model.layers[names[i]]
        model.layers[names[i]] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                    preserve_rng_state=True, **extra)
    return model
