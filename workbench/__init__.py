"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch."""

# Before anything loads Triton (torch's compiler does): without CUDA, our Triton kernels run in Triton's
# interpreter, which is decided when Triton is imported (workbench.kernels._triton).
from workbench.kernels import _triton as _kernels_triton

_kernels_triton.prepare()

from workbench.config import PRESETS, ModelConfig, ParallelConfig, TrainConfig
from workbench.train.launcher import Run, RunFailed, launch
from workbench import spmd  # noqa: F401  (our SPMD rules; workbench.spmd.install() puts them into DTensor)
from workbench import plan  # noqa: F401  (a callable package: workbench.plan(model, parallel))

from workbench.version import __version__

__all__ = ["launch", "plan", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]
