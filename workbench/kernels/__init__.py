"""Triton kernels for the seed ops, as torch custom ops (``torch.ops.workbench.*``).

Every op has a torch reference path that runs anywhere, a fake implementation (FakeTensorMode, plans,
``torch.compile``), an autograd formula, a DTensor sharding rule in our SPMD registry
(``workbench.spmd``), and a Triton kernel (``workbench/kernels/triton_*.py``) for CUDA, which CI runs
through Triton's interpreter on CPU tensors.

============================  ==========================================================================
``index_put``                 ``self[indices] = values`` or ``+=``: deterministic (sort + segmented sum)
                              or fast (atomics); negative indices wrap, out-of-range ones raise
``masked_fill``               ``where(mask, value, self)``, value a tensor with a gradient
``mask_select/mask_assign``   ``self[mask]`` and ``self[mask] = value`` without materialising long indices
``set_value``                 ``self[s0:e0:k0, ...] = value`` with int64 offsets (tensors over 2^31)
``dropout_add``               ``residual + dropout(x)``: Philox from (seed, offset), no mask stored
``embedding``                 ``nn.Embedding`` whose weight gradient is our deterministic ``index_put``
============================  ==========================================================================

Which implementation runs is the backend (``--kernels triton|torch|auto``; see
``workbench.kernels.backend``). ``workbench kernels check`` compares every kernel with its reference;
``workbench kernels bench`` times them against torch eager and ``torch.compile``.
"""

from __future__ import annotations

from workbench.kernels import _triton

# Before anything loads Triton (torch.compile does, even on CPU): without CUDA, our Triton kernels run in
# Triton's interpreter, chosen for the whole process when Triton is first imported (see _triton's docstring).
_triton.prepare()

from workbench.kernels.backend import (  # noqa: E402
    BACKENDS,
    KernelUnavailable,
    choose,
    get_backend,
    resolve,
    set_backend,
    use,
)
from workbench.kernels.cases import CASES, KernelCase  # noqa: E402

# The ops. Each module defines its custom ops and registers its KernelCases on import; the package
# attribute is the function (``workbench.kernels.index_put(...)``), the module stays importable by path.
from workbench.kernels.index_put import index_put  # noqa: E402
from workbench.kernels.masked import mask_assign, mask_select, masked_fill  # noqa: E402
from workbench.kernels.set_value import set_value, set_value_  # noqa: E402
from workbench.kernels.dropout import dropout_add, dropout_scope  # noqa: E402
from workbench.kernels.embedding import Embedding, embedding  # noqa: E402

__all__ = ["BACKENDS", "KernelUnavailable", "choose", "get_backend", "resolve", "set_backend", "use",
           "CASES", "KernelCase", "triton_status", "custom_ops", "OP_NAMES",
           "index_put", "masked_fill", "mask_select", "mask_assign", "set_value", "set_value_", "dropout_add",
           "dropout_scope", "embedding", "Embedding"]


def triton_status() -> _triton.TritonStatus:
    """Whether Triton kernels can run in this process (interpreter or CUDA), and why not."""
    return _triton.status()


# Every custom op this package defines (torch.ops.workbench.<name>); the SPMD rules cover each one.
OP_NAMES = ("index_put", "index_put_backward", "masked_fill", "masked_fill_backward", "mask_select",
            "mask_select_backward", "mask_assign", "set_value", "set_value_", "dropout_add",
            "dropout_add_backward")


def custom_ops() -> list:
    """The OpOverloads of our custom ops (``torch.ops.workbench.*.default``)."""
    import torch

    return [getattr(torch.ops.workbench, n).default for n in OP_NAMES if hasattr(torch.ops.workbench, n)]
