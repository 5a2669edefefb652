"""Parallel Workbench: a Jupyter-centric workbench for parallel training on PyTorch.

``import workbench`` loads nothing heavy (not torch, pandas, Triton or the SPMD rules): each name is
imported on first use (PEP 562), so the command line, the Jupyter server extension and a process that
needs one piece start fast. ``workbench.launch``, ``workbench.plan(...)``, ``workbench.Run``,
``workbench.ModelConfig`` and every subpackage (``workbench.spmd``, ``workbench.kernels``, ...) work as
before; ``tests/test_imports.py`` keeps them lazy.
"""

from importlib import import_module
from importlib.util import find_spec

from workbench.version import __version__

# name -> the module that defines it, imported when the name is first asked for
_WHERE = {
    "launch": "workbench.train.launcher", "Run": "workbench.train.launcher",
    "RunFailed": "workbench.train.launcher",
    "ModelConfig": "workbench.config", "ParallelConfig": "workbench.config", "TrainConfig": "workbench.config",
    "PRESETS": "workbench.config",
}

__all__ = ["launch", "plan", "Run", "RunFailed", "ModelConfig", "ParallelConfig", "TrainConfig", "PRESETS", "__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
    elif not name.startswith("_") and find_spec(f"{__name__}.{name}") is not None:
        # a subpackage or module: workbench.plan (a callable package: workbench.plan(model, parallel)),
        # workbench.spmd (our SPMD rules; workbench.spmd.install() puts them into DTensor), workbench.kernels ...
        value = import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
