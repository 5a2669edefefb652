"""Parallelism applied from the outside onto a plain model: one module per technique."""

from workbench.parallel.apply import parallelize
from workbench.parallel.build import Stages, build_stages

__all__ = ["parallelize", "build_stages", "Stages"]
