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

from typing import TYPE_CHECKING

from workbench.lazy import lazy_names

if TYPE_CHECKING:
    from workbench.plan.types import ShardingPlan, TensorPlan

__all__ = ["plan", "plan_configs", "ShardingPlan", "TensorPlan"]


# The data types import pandas: loaded on first use, so `workbench plan --help` and `import workbench.plan`
# stay light (tests/test_imports.py).
__getattr__, _ = lazy_names(__name__, dict.fromkeys(("ShardingPlan", "TensorPlan"), "workbench.plan.types"))


def plan_configs(parallel=None, train=None, **settings):
    """The (ParallelConfig, TrainConfig) a plan simulates, from configs and/or field shortcuts.

    ``dp_shard=-1`` (the default) resolves to fill the other degrees (a plan has no nproc: 1). With no
    ``train``, TrainConfig's defaults with ``global_batch`` rounded up to a multiple of dp (x
    microbatches); train shortcuts (``seq_len=128``) apply over that.
    """
    import dataclasses

    from workbench.settings import make_configs, split_settings

    parts = split_settings(settings, ("parallel", "train"), what="plan setting")
    parallel, _ = make_configs(parallel, None, **parts["parallel"])
    parallel = parallel.resolved() if parallel.dp_shard == -1 else parallel
    if train is None:
        from workbench.plan.simulate import _default_train

        return parallel, dataclasses.replace(_default_train(parallel), **parts["train"])
    _, train = make_configs(None, train, **parts["train"])
    return parallel, train


def plan(model, parallel=None, train=None, **settings) -> ShardingPlan:
    """Simulate ``model`` under ``parallel`` (a ParallelConfig); see :func:`workbench.plan.simulate.plan`.

    ``train``: a TrainConfig or a dict of its fields. Field shortcuts (``tp=8``, ``seq_len=4096``) apply
    over both: ``workbench.plan("llama-70b", dp_shard=128, tp=8)``.
    """
    from workbench.plan.simulate import plan as _plan

    if settings or parallel is None:
        parallel, train = plan_configs(parallel, train, **settings)
    return _plan(model, parallel, train)


class _CallableModule(ModuleType):
    def __call__(self, model, parallel=None, train=None, **settings) -> ShardingPlan:
        return plan(model, parallel, train, **settings)


sys.modules[__name__].__class__ = _CallableModule
