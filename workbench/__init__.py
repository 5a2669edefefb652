"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch.

``import workbench`` loads nothing heavy (not torch, pandas, Triton or the SPMD rules): each name is
imported on first use (PEP 562), so the command line, the Jupyter server extension and a process that
needs one piece start fast. ``workbench.launch``, ``workbench.plan(...)``, ``workbench.Run``,
``workbench.ModelConfig`` and every subpackage (``workbench.spmd``, ``workbench.kernels``, ...) work as
before; ``tests/test_imports.py`` keeps them lazy.
"""

from workbench.lazy import lazy_names
from workbench.version import __version__

# name -> the module that defines it, imported when the name is first asked for; any other public name
# that is a subpackage or module (workbench.plan: a callable package, workbench.plan(model, parallel);
# workbench.spmd: our SPMD rules, which workbench.spmd.install() puts into DTensor) is imported the same way.
_WHERE = {
    "launch": "workbench.train.launcher", "Run": "workbench.train.launcher",
    "RunFailed": "workbench.train.launcher",
    "ModelConfig": "workbench.config", "ParallelConfig": "workbench.config", "TrainConfig": "workbench.config",
    "PRESETS": "workbench.config",
}

__all__ = ["launch", "plan", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]

__getattr__, __dir__ = lazy_names(__name__, _WHERE, submodules=True)
