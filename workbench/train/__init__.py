"""Training: the per-rank loop, the torchrun launcher and the event stream.

``launch``, ``build_job``, ``Run`` and ``RunFailed`` are imported on first use (the launcher imports pandas
and torch), so a process that needs one piece (``workbench.train.events`` in the Jupyter server) does not
load the rest."""

from importlib import import_module

__all__ = ["launch", "build_job", "Run", "RunFailed"]


def __getattr__(name: str):
    if name in __all__:
        value = globals()[name] = getattr(import_module("workbench.train.launcher"), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
