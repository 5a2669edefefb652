"""``--compile``: ``torch.compile`` each transformer block, as torchtitan does.

Each block's ``forward`` is replaced by its compiled version, in place. The module tree, parameter
names (so checkpoints, plans and SPMD rules) and every hook stay as they are: FSDP2's all-gather and
reshard hooks, DDP's, and the activation-checkpointing wrapper run around the compiled forward, exactly
as in eager mode. The blocks share their code, and with ``inline_inbuilt_nn_modules``
(torch's default) their parameters are graph inputs, so one compiled graph serves every block.

Dense blocks compile with ``fullgraph=True``; a mixture-of-experts block routes a data-dependent number
of tokens (and all-to-all under expert parallelism), so it is allowed graph breaks.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["compile_blocks", "compiled_blocks"]

_MARK = "_workbench_compiled"


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model or pipeline stage, looking through DDP's wrapper and through
    activation checkpointing's (the block inside it is what gets compiled, see :func:`compile_blocks`)."""
    module = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    layers = getattr(module, "layers", None)
    if layers is None:
        return []
    blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    return [getattr(b, "_checkpoint_wrapped_module", b) for b in blocks]


def compile_blocks(module: nn.Module, *, fullgraph: bool = True) -> int:
    """Compile the forward of every transformer block in ``module.layers`` (a model or a pipeline
    stage), in place; returns how many. A block already compiled is left alone.

    Under activation checkpointing the block inside the wrapper is compiled and the checkpoint runs
    around it, eagerly: the recompute calls the compiled forward again. (Compiling the wrapper traces
    torch.utils.checkpoint itself, which torch 2.13 cannot do where DTensors cross the block boundary,
    as under sequence parallelism.) Every block then shares one graph, checkpointed or not.
    """
    n = 0
    for block in _blocks(module):
        if getattr(block, _MARK, False):
            continue
        block.forward = _unaliased_inputs(torch.compile(block.forward, fullgraph=fullgraph))
        setattr(block, _MARK, True)
        n += 1
    return n


def _unaliased_inputs(compiled):
    """Call ``compiled`` with a copy of any input that needs a gradient and is a view.

    The first block's input is the embedding's output; under tensor parallelism that is
    ``DTensor.to_local()``, a view of the DTensor's local tensor. torch 2.13's compiled autograd then
    sends that input's gradient to the DTensor's redistribution as a plain tensor (AttributeError:
    'Tensor' object has no attribute '_local_tensor'). A copy ends the aliasing; it costs one
    activation of one block per micro-batch, and nothing for the other blocks, whose inputs are
    the previous block's outputs.
    """
    def forward(*args, **kwargs):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a.requires_grad and a._is_view() else a
                     for a in args)
        return compiled(*args, **kwargs)

    forward.__wrapped__ = compiled
    return forward


def compiled_blocks(module: nn.Module) -> int:
    """How many of ``module``'s blocks run compiled (0 for an eager model)."""
    return sum(bool(getattr(b, _MARK, False)) for b in _blocks(module))
