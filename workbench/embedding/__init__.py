"""Contrastive embedding training: pairs from the shipped text, a pooled Llama encoder, InfoNCE with
negatives gathered across data-parallel ranks (with the right gradient), GradCache-style chunking, and
a trainer on the main trainer's run directory, events and checkpoints (:func:`train_embedding`)."""

from workbench.embedding.config import EmbeddingConfig
from workbench.embedding.data import PairCorpus, tokenize
from workbench.embedding.encoder import Encoder
from workbench.embedding.gradcache import cached_backward
from workbench.embedding.loss import InfoNCE, gather_with_grad, retrieval_accuracy
from workbench.embedding.trainer import EmbeddingRun, train_embedding

__all__ = ["EmbeddingConfig", "PairCorpus", "tokenize", "Encoder", "InfoNCE", "gather_with_grad", "cached_backward",
           "retrieval_accuracy", "EmbeddingRun", "train_embedding"]
