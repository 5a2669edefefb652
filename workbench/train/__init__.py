"""Training: the per-rank loop, the torchrun launcher and the event stream."""

from workbench.train.launcher import Run, RunFailed, build_job, launch

__all__ = ["launch", "build_job", "Run", "RunFailed"]
