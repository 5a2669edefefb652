"""Parallelism applied from the outside onto a plain model: one module per technique."""

from workbench.parallel.apply import parallelize

__all__ = ["parallelize"]
