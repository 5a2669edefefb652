"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch."""

from workbench.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from workbench.train.launcher import Run, RunFailed, launch
from workbench import spmd  # noqa: F401  (installs our DTensor sharding rules)
from workbench import plan  # noqa: F401  (a callable package: workbench.plan(model, parallel))

__version__ = "0.1.0"

__all__ = ["launch", "plan", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]
