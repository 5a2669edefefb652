"""InfoNCE with in-batch (and cross-rank) negatives, hard negatives, a temperature, Matryoshka prefixes.

Cross-rank negatives, and why the gradient is right. Rank ``r`` of ``W`` holds ``B`` queries and their
positives; the candidates are every rank's positives (then every rank's hard negatives), gathered. Rank
``r``'s loss is the mean over *its* queries, ``loss_r``, and the full batch's loss is ``L = (1/W) sum_r
loss_r``. Data parallelism averages parameter gradients over ranks, so rank ``r'`` must contribute
``d(sum_r loss_r)/d(its own embeddings)``: every rank's loss uses ``r'``'s positives as candidates.
:func:`gather_with_grad`'s backward therefore **sums** the gathered gradient over ranks (all-reduce) and
keeps this rank's slice. Averaged by data parallelism that gives exactly ``dL/dθ``: the same loss and
gradients as one rank with the whole batch (``tests/test_embedding.py`` checks the values, so the scale
too). A backward that keeps only the local slice, without the sum, is the "1/world_size too small"
bug Tevatron, lightly and pytorch-metric-learning each fixed.

Labels: query ``i`` of rank ``r`` is global row ``r*B + i``; its positive is candidate column ``r*B + i``.
Hard negatives are appended after all ``W*B`` positives, so they never shift a label.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.world = dist.get_world_size(group)
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)  # every rank's loss uses our rows
        n = grad.shape[0] // ctx.world
        return grad[ctx.rank * n:(ctx.rank + 1) * n], None


def gather_with_grad(x: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' ``x`` concatenated in rank order; the gradient flows back to each rank's own rows,
    summed over every rank's use of them. Without a process group (or one rank), ``x`` itself."""
    if group is None and not dist.is_initialized():
        return x
    if dist.get_world_size(group) == 1:
        return x
    return _GatherWithGrad.apply(x, group)


class InfoNCE(nn.Module):
    """``forward(queries, positives, hard=None) -> loss`` for this rank's rows (mean over its queries).

    ``temperature``: fixed, or learned (``learn_temperature=True``: a log-parameterised scale, clamped to
    at most 100 like CLIP's). ``dims``: Matryoshka prefixes; the loss is summed over them, each prefix
    L2-normalised on its own. ``group``: the data-parallel group whose ranks' candidates are negatives
    (None: the default group if one is initialised). ``gather=False``: this rank's candidates only (a
    layout without data parallelism, whose other ranks hold the same rows, e.g. tensor-parallel ranks); a
    callable ``gather(x, group)``: that gather instead (:mod:`workbench.embedding.check` passes the common
    wrong one, to show what it costs).
    """

    def __init__(self, temperature: float = 0.05, learn_temperature: bool = False, dims: tuple[int, ...] | None = None,
                 group=None, gather=True):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0, e.g. 0.05")
        scale = torch.tensor(math.log(1.0 / temperature))
        if learn_temperature:
            self.log_scale = nn.Parameter(scale)
        else:
            self.register_buffer("log_scale", scale)
        self.dims = tuple(dims) if dims else None
        self.group = group
        self.gather = gather

    @property
    def temperature(self) -> float:
        return float(torch.exp(-self.log_scale.detach()))

    def forward(self, queries: torch.Tensor, positives: torch.Tensor, hard: torch.Tensor | None = None) -> torch.Tensor:
        if queries.shape != positives.shape or (hard is not None and hard.shape != queries.shape):
            raise ValueError(f"queries {tuple(queries.shape)}, positives {tuple(positives.shape)} and hard negatives "
                             f"{None if hard is None else tuple(hard.shape)} must have the same shape")
        gather = (self.gather if callable(self.gather) else gather_with_grad) if self.gather else (lambda x, group: x)
        cands = gather(positives, self.group)
        if hard is not None:
            cands = torch.cat([cands, gather(hard, self.group)], dim=0)
        world = dist.get_world_size(self.group) if self.gather and dist.is_initialized() else 1
        rank = dist.get_rank(self.group) if world > 1 else 0
        labels = torch.arange(queries.shape[0], device=queries.device) + rank * queries.shape[0]
        scale = self.log_scale.clamp(max=math.log(100.0)).exp()
        total = queries.new_zeros(())
        for d in self.dims or (queries.shape[-1],):
            if not 0 < d <= queries.shape[-1]:
                raise ValueError(f"Matryoshka dimension {d} is outside 1..{queries.shape[-1]}")
            q = F.normalize(queries[:, :d], dim=-1)
            c = F.normalize(cands[:, :d], dim=-1)
            total = total + F.cross_entropy(scale * q @ c.T, labels)
        return total


@torch.no_grad()
def retrieval_accuracy(encoder, queries, positives, chunk: int = 64) -> float:
    """Top-1: how often a query's most similar candidate (cosine, among all ``positives``) is its own."""
    def embed(tokens, lengths):
        return torch.cat([F.normalize(encoder(tokens[i:i + chunk], lengths[i:i + chunk]), dim=-1)
                          for i in range(0, tokens.shape[0], chunk)])

    was = encoder.training
    encoder.eval()
    try:
        q, p = embed(*queries), embed(*positives)
    finally:
        encoder.train(was)
    return float(((q @ p.T).argmax(dim=1) == torch.arange(q.shape[0])).float().mean())
