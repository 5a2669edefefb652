"""Model definitions. They hold no parallel code: parallelism is applied from ``workbench.parallel``."""

from workbench.models.llama import Transformer, build_model

__all__ = ["Transformer", "build_model"]
