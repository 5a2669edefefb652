"""Contrastive embedding training: pairs from the shipped text, a pooled Llama encoder, InfoNCE with
negatives gathered across data-parallel ranks (with the right gradient), GradCache-style chunking, and
a trainer on the main trainer's run directory, events and checkpoints (:func:`train_embedding`).

Names are imported on first use (PEP 562), so a process that needs one piece (a rank of
:func:`check_gradients`, started fresh) does not import the trainer, pandas and the checkpoint code."""

from importlib import import_module

_WHERE = {
    "GradientCheck": "check", "check_gradients": "check", "EmbeddingConfig": "config", "PairCorpus": "data",
    "tokenize": "data", "Encoder": "encoder", "cached_backward": "gradcache", "InfoNCE": "loss",
    "gather_with_grad": "loss", "retrieval_accuracy": "loss", "EmbeddingRun": "trainer",
    "embedding_task": "trainer", "train_embedding": "trainer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(f"workbench.embedding.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench.embedding' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
