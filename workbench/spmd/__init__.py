"""SPMD sharding rules that improve on DTensor's defaults, ``explain()``, and the conformance harness.

Importing this package registers every rule family and installs them into DTensor (``import workbench``
does this), unless the environment sets ``WORKBENCH_SPMD=0``. See ``workbench.spmd.registry``.
"""

from __future__ import annotations

import os

from workbench.spmd import registry
from workbench.spmd.registry import CASES, RULES, install, installed, torch_rules, uninstall

# Rule families: importing a module registers its rules and conformance cases.
from workbench.spmd import elementwise, indexing, norms, reductions  # noqa: E402,F401

if os.environ.get("WORKBENCH_SPMD", "1") != "0":
    install()

__all__ = ["registry", "RULES", "CASES", "install", "uninstall", "installed", "torch_rules"]
