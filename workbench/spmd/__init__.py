"""SPMD sharding rules that improve on DTensor's defaults, ``explain()``, and the conformance harness.

Importing this package changes nothing in torch: it registers each rule family in our own registry
(``RULES``, ``CASES``). ``install()`` puts the rules into DTensor and ``uninstall()`` takes them out.
Training jobs launched by the workbench install them (``TrainConfig.spmd_rules``, default on); plans,
``explain`` and ``check`` install them for their own duration. See ``workbench.spmd.registry``.

A rule family that needs a private torch API the running torch lacks is not registered, and
``install()`` names it in one stderr line (``workbench doctor`` lists it too; see ``workbench.compat``).

    workbench.spmd.install()                                                 # our rules, from now on
    workbench.spmd.explain("masked_fill.Scalar", "P,R", "R,R", mesh="2x2")   # who decided, what moved
    workbench.spmd.check()                                                  # the conformance harness
"""

from __future__ import annotations

import importlib

from workbench import compat
from workbench.spmd import registry
from workbench.spmd.registry import (
    CASES,
    RULES,
    install,
    installed,
    normalize_multi_shard,
    our_rules,
    torch_rules,
    uninstall,
)

# Rule families (indexing and norms import reductions themselves; kernels covers our own custom ops,
# torch.ops.workbench.*). Importing one registers its
# rules and conformance cases; one the running torch cannot support is left out.
FAMILY_MODULES = ("elementwise", "indexing", "kernels", "norms", "reductions")
SKIPPED_FAMILIES: dict[str, str] = {}  # family -> why (e.g. "torch 2.11.0 lacks ...")

for _family in FAMILY_MODULES:
    _why = compat.skip_reason(f"spmd.{_family}")
    if _why is None:
        globals()[_family] = importlib.import_module(f"workbench.spmd.{_family}")
    else:
        SKIPPED_FAMILIES[_family] = _why


def warn_skipped_families() -> None:
    """One stderr line per rule family left out, once per process (called by ``install()``)."""
    for family in SKIPPED_FAMILIES:
        compat.check(f"spmd.{family}")


# The function shadows its module's name on purpose: ``workbench.spmd.explain(op, ...)``.
from workbench.spmd.conformance import ConformanceReport, check  # noqa: E402
from workbench.spmd.explain import Explanation, explain  # noqa: E402

__all__ = ["registry", "RULES", "CASES", "install", "uninstall", "installed", "our_rules", "torch_rules",
           "normalize_multi_shard", "explain", "Explanation", "check", "ConformanceReport",
           "FAMILY_MODULES", "SKIPPED_FAMILIES"]
