"""SPMD sharding rules that improve on DTensor's defaults, ``explain()``, and the conformance harness.

Importing this package registers every rule family and installs them into DTensor (``import workbench``
does this), unless the environment sets ``WORKBENCH_SPMD=0``. See ``workbench.spmd.registry``.

    workbench.spmd.explain("masked_fill.Scalar", "P,R", "R,R", mesh="2x2")   # who decided, what moved
    workbench.spmd.check()                                                  # the conformance harness
"""

from __future__ import annotations

import os

from workbench.spmd import registry
from workbench.spmd.registry import (
    CASES,
    RULES,
    install,
    installed,
    normalize_multi_shard,
    torch_rules,
    uninstall,
)

# Rule families: importing a module registers its rules and conformance cases.
from workbench.spmd import elementwise, indexing, norms, reductions  # noqa: E402,F401

if os.environ.get("WORKBENCH_SPMD", "1") != "0":
    install()

# The function shadows its module's name on purpose: ``workbench.spmd.explain(op, ...)``.
from workbench.spmd.conformance import ConformanceReport, check  # noqa: E402
from workbench.spmd.explain import Explanation, explain  # noqa: E402

__all__ = ["registry", "RULES", "CASES", "install", "uninstall", "installed", "torch_rules",
           "normalize_multi_shard", "explain", "Explanation", "check", "ConformanceReport"]
