"""A Llama as a sentence encoder: the decoder's final hidden states, pooled (mean or last token),
optionally projected.

The hidden states come from the model itself, without a copy of its forward: a ``Transformer`` whose
``output`` (the LM head) is ``None`` returns its final normed hidden states (the same rule lets a
pipeline stage end early), so the encoder drops the head and calls the model. A parallelized backbone
(tensor parallel, FSDP2, DDP: ``workbench.embedding.trainer.build_encoder``) is built without the head
from the start, so no data-parallel engine ever sees a parameter that gets no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.config import ModelConfig
from workbench.models import build_model
from workbench.models.llama import Transformer, initial_value


def drop_head(model: nn.Module) -> nn.Module:
    """``model`` (a Transformer) returning its final hidden states instead of logits."""
    if isinstance(model, Transformer):
        model.output = None
    return model


class Encoder(nn.Module):
    """``forward(tokens, lengths) -> (B, width)`` pooled embeddings (not normalised: the loss normalises
    each Matryoshka prefix itself). Padding is on the right and the decoder is causal, so no real token
    attends to padding, and pooling ignores it.

    ``model``: a backbone already built (and perhaps parallelized) without its head; default
    ``build_model(cfg, seed)``. ``projection``: a bias-free linear map to this width after pooling.
    """

    def __init__(self, cfg: ModelConfig, pooling: str = "mean", seed: int = 0, model: nn.Module | None = None,
                 projection: int | None = None):
        super().__init__()
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling={pooling!r} is unknown; choose mean or last")
        self.pooling = pooling
        self.backbone = drop_head(model if model is not None else build_model(cfg, seed=seed))
        self.projection = None
        if projection is not None:
            self.projection = nn.Linear(cfg.dim, projection, bias=False)
            with torch.no_grad():  # a function of (seed, name), like every backbone weight
                self.projection.weight.copy_(initial_value(cfg, "projection.weight", (projection, cfg.dim), seed))
        self.width = projection or cfg.dim

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.backbone(tokens)  # (B, L, dim)
        lengths = lengths.to(h.device)
        if self.pooling == "last":
            pooled = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        else:
            mask = (torch.arange(h.shape[1], device=h.device)[None, :] < lengths[:, None]).to(h.dtype)
            pooled = (h * mask[..., None]).sum(1) / lengths[:, None].to(h.dtype)
        return pooled if self.projection is None else self.projection(pooled.to(self.projection.weight.dtype))
