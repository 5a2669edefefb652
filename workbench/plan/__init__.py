"""Sharding plans: what every rank of a layout holds and communicates, simulated without running it.

``workbench.plan`` is both this package and a function::

    import workbench
    plan = workbench.plan("llama-70b", ParallelConfig(dp_shard=128, tp=8))   # 1024 ranks, no GPU
    plan.rank_bytes()        # bytes per rank by category
    plan.local("layers.0.attention.wq.weight", rank=9)                     # ((8, 8192), (8, 0))
    plan                     # in a notebook: the interactive ShardingPlanView

    from workbench.plan import ShardingPlan, TensorPlan                    # the data types

The package's module object gets a subclass of ``types.ModuleType`` whose ``__call__`` is
:func:`workbench.plan.simulate.plan`, so ``workbench.plan(...)`` calls it while ``workbench.plan.X``
still reaches the package's attributes.
"""

from __future__ import annotations

import sys
from types import ModuleType  # not `import types`: the submodule workbench.plan.types shadows it

from workbench.plan.types import ShardingPlan, TensorPlan

__all__ = ["plan", "ShardingPlan", "TensorPlan"]


def plan(model, parallel_config, train_shape=None) -> ShardingPlan:
    """Simulate ``model`` under ``parallel_config``; see :func:`workbench.plan.simulate.plan`."""
    from workbench.plan.simulate import plan as _plan

    return _plan(model, parallel_config, train_shape)


class _CallableModule(ModuleType):
    def __call__(self, model, parallel_config, train_shape=None) -> ShardingPlan:
        return plan(model, parallel_config, train_shape)


sys.modules[__name__].__class__ = _CallableModule
