"""Training: the per-rank loop, the torchrun launcher and the event stream.

``launch``, ``build_job``, ``Run`` and ``RunFailed`` are imported on first use (the launcher imports pandas
and torch), so a process that needs one piece (``workbench.train.events`` in the Jupyter server) does not
load the rest."""

from workbench.lazy import lazy_names

__all__ = ["launch", "build_job", "Run", "RunFailed"]
__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "workbench.train.launcher"))
