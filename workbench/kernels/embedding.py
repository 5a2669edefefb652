"""``nn.Embedding`` whose weight gradient is our deterministic ``index_put``: bit-reproducible.

The forward is a gather; the weight's gradient scatters each token's output gradient back to its row::

    y[t] = W[tokens[t]]                       (N tokens, W: V x D)
    dW   = zeros(V, D);  dW[tokens[t]] += dy[t]   for every t

Tokens repeat, so ``dW`` is a sum of many rows per token id; on a GPU torch takes those sums in an order
that can change between runs. Under ``kernels='triton'`` (``auto`` on CUDA) we take them with
``index_put(accumulate=True, deterministic=True)``: a stable sort of the token ids and one fp32 sum per
row in that order, so two runs give the same bits. Elsewhere the backward is torch's own
``embedding_dense_backward``.

Tensor parallel: ``RowwiseParallel`` shards the weight by rows (a DTensor). The forward is DTensor's
embedding; the gradient is our ``index_put`` into zeros laid out like the weight, whose DTensor rule
(``workbench/spmd/kernels.py``, installed by ``workbench.spmd.install()`` as training jobs do) has each
rank sum only the tokens of its own rows: no gradient row is communicated. Without our rules installed a
DTensor weight takes torch's own embedding. Options our backward does not cover (``max_norm``, ``scale_grad_by_freq``, ``sparse``)
take torch's path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench import compat
from workbench.kernels import backend
from workbench.kernels.index_put import index_put


def _is_dtensor(x: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(x, DTensor)


def _use_index_put(grad: torch.Tensor) -> bool:
    """Our kernel when the backend picks Triton for grad's device; torch's where it does not, and on
    meta / fake tensors that Triton could never run on (plans, memory predictions)."""
    if grad.device.type == "meta":
        return False
    try:
        return backend.choose(grad.device) == "triton"
    except backend.KernelUnavailable:
        if compat.is_fake(grad):
            return False
        raise


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, weight, padding_idx):
        ctx.save_for_backward(tokens)
        ctx.num_weights = weight.shape[0]
        # Under tensor parallelism the gradient is laid out like the weight (rows sharded).
        ctx.weight_layout = (weight.device_mesh, weight.placements) if _is_dtensor(weight) else None
        ctx.padding_idx = padding_idx
        return F.embedding(tokens, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (tokens,) = ctx.saved_tensors
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        if not _use_index_put(grad):
            return None, torch.ops.aten.embedding_dense_backward(grad, tokens, ctx.num_weights, pad, False), None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.weight_layout is not None:  # a row-sharded weight: zeros sharded alike, filled shard-locally
            from torch.distributed.tensor import zeros as dtensor_zeros

            mesh, placements = ctx.weight_layout
            zeros = dtensor_zeros((ctx.num_weights, grad.shape[-1]), dtype=grad.dtype, device_mesh=mesh,
                                  placements=placements)
        else:
            zeros = grad.new_zeros((ctx.num_weights, grad.shape[-1]))
        grad_weight = index_put(zeros, (tokens.reshape(-1),), rows, accumulate=True, deterministic=True)
        if pad >= 0:
            grad_weight[pad] = 0  # the padding row never learns (nn.Embedding's rule)
        return None, grad_weight, None


def _dtensor_rule_installed() -> bool:
    """Whether DTensor knows our index_put (``workbench.spmd.install()``, which training jobs run)."""
    try:
        return torch.ops.workbench.index_put.default in compat.custom_op_handlers()
    except compat.MissingTorchAPI:
        return False


def embedding(tokens: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(tokens, weight, padding_idx)`` whose weight gradient is deterministic under Triton.

    A DTensor weight takes torch's own embedding unless our SPMD rules are installed (they say how our
    index_put runs on a row-sharded gradient)."""
    if (_is_dtensor(weight) or _is_dtensor(tokens)) and not _dtensor_rule_installed():
        return F.embedding(tokens, weight, padding_idx)
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _EmbeddingFunction.apply(tokens, weight, padding_idx)


class Embedding(nn.Embedding):
    """A drop-in ``nn.Embedding`` (same parameters, state_dict, meta/``to_empty``, ``RowwiseParallel``)
    whose weight gradient comes from :func:`embedding`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return super().forward(input)
        return embedding(input, self.weight, self.padding_idx)
