"""A Llama as a sentence encoder: the decoder's final hidden states, pooled (mean or last token)."""

from __future__ import annotations

import torch
from torch import nn

from workbench.config import ModelConfig
from workbench.models import build_model


class Encoder(nn.Module):
    """``forward(tokens, lengths) -> (B, dim)`` pooled embeddings (not normalised: the loss normalises
    each Matryoshka prefix itself). The LM head is dropped; padding is on the right, and the decoder is
    causal, so no real token attends to padding and pooling ignores it."""

    def __init__(self, cfg: ModelConfig, pooling: str = "mean", seed: int = 0, model: nn.Module | None = None):
        super().__init__()
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling={pooling!r} is unknown; choose mean or last")
        self.pooling = pooling
        self.backbone = model if model is not None else build_model(cfg, seed=seed)
        self.backbone.output = None  # the model then returns its final (normed) hidden states

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.backbone(tokens)  # (B, L, dim)
        lengths = lengths.to(h.device)
        if self.pooling == "last":
            return h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        mask = (torch.arange(h.shape[1], device=h.device)[None, :] < lengths[:, None]).to(h.dtype)
        return (h * mask[..., None]).sum(1) / lengths[:, None].to(h.dtype)
