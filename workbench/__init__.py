"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch."""

from workbench.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from workbench.train.launcher import Run, RunFailed, launch

__version__ = "0.1.0"

__all__ = ["launch", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]
