"""Memory prediction: the trainer's own step, run on fake tensors under a fake process group.

This package sits above the trainer (it runs ``workbench.train.step``) and the plan (it borrows its fake
world), so the low-level memory package (``workbench.memory``: the timeline schema, the recorder the
trainer uses, the importers) never imports it. ``workbench.memory.predict`` and ``workbench.memory.fits``
re-export :func:`predict` and :func:`fits` for users, resolved on first use.

- :mod:`.fake`: one rank of any world size on fake tensors, and which ranks are alike.
- :mod:`.memory`: ``predict(job)`` -> MemoryTimeline, ``fits(job, "80GiB")``, ``peak_per_rank``.
- :mod:`.cli`: ``workbench memory record|predict|compare|import|show``.
"""

from importlib import import_module

__all__ = ["predict", "fits", "peak_per_rank", "FitAnswer"]


def __getattr__(name: str):
    # Imported on first use (it imports torch), so `workbench memory --help` starts without it.
    if name in __all__:
        value = globals()[name] = getattr(import_module("workbench.prediction.memory"), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
