"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch."""

from workbench.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from workbench.train.launcher import Run, RunFailed, launch
from workbench import spmd  # noqa: F401  (our SPMD rules; workbench.spmd.install() puts them into DTensor)
from workbench import plan  # noqa: F401  (a callable package: workbench.plan(model, parallel))

from workbench.version import __version__

__all__ = ["launch", "plan", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]
