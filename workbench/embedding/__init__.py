"""Contrastive embedding training: pairs from the shipped text, a pooled Llama encoder, InfoNCE with
negatives gathered across data-parallel ranks (with the right gradient), and GradCache-style chunking."""

from workbench.embedding.data import PairCorpus, tokenize
from workbench.embedding.encoder import Encoder
from workbench.embedding.gradcache import cached_backward
from workbench.embedding.loss import InfoNCE, gather_with_grad

__all__ = ["PairCorpus", "tokenize", "Encoder", "InfoNCE", "gather_with_grad", "cached_backward"]
