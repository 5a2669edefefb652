"""Activation checkpointing: keep a block's input, drop its internals, recompute them in backward.

A transformer block saves roughly ``b*s*(c1*dim + c2*ffn_hidden + heads*s)`` activation values for its
backward. With checkpointing it keeps only its input ``x`` (``b*s*dim``) and runs its forward a
second time inside backward, trading ~1/3 more compute for memory::

    none       every block saves everything
    full       every block is checkpointed
    selective  blocks 0, k, 2k, ... are checkpointed (k = ``every``): a knob between the two

Applied from the outside after tensor parallelism and before FSDP2/DDP (so FSDP's all-gather wraps
the recomputation too, as in torchtitan). We use non-reentrant checkpointing
(``torch.utils.checkpoint(use_reentrant=False)`` through ``checkpoint_wrapper``), which preserves
RNG and autocast state, so the recomputed forward is the same computation and losses are bitwise
equal with and without checkpointing. The wrapper's ``state_dict`` hides its
``_checkpoint_wrapped_module.`` prefix, so checkpoint keys do not change.
"""

from __future__ import annotations

from torch import nn

from workbench import compat


def checkpointed_blocks(n_layers: int, mode: str, every: int = 2) -> list[int]:
    """Indices of the blocks ``mode`` checkpoints."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(n_layers))
    if mode == "selective":
        return list(range(0, n_layers, every))
    raise ValueError(f"activation_checkpointing={mode!r} is unknown; choose one of ['none', 'full', 'selective']")


def apply_ac(model: nn.Module, mode: str, every: int = 2) -> nn.Module:
    """Wrap the chosen transformer blocks of ``model.layers`` in place; returns ``model``."""
    names = list(model.layers.keys())
    chosen = checkpointed_blocks(len(names), mode, every)
    if not chosen:
        return model
    # torch's wrapper is private API: only a run that checkpoints needs it (config validation refuses
    # activation_checkpointing on a torch that lacks it).
    checkpoint_wrapper, CheckpointImpl = compat.get("checkpoint_wrapper"), compat.get("CheckpointImpl")
    for i in chosen:
        block = model.layers[names[i]]
        model.layers[names[i]] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                    preserve_rng_state=True)
    return model
