"""Memory prediction: the trainer's own step, run on fake tensors under a fake process group.

This package sits above the trainer (it runs ``workbench.train.step``) and the plan (it borrows its fake
world), so the low-level memory package (``workbench.memory``: the timeline schema, the recorder the
trainer uses, the importers) never imports it. ``workbench.memory.predict`` and ``workbench.memory.fits``
re-export :func:`predict` and :func:`fits` for users, resolved on first use.

- :mod:`.fake`: one rank of any world size on fake tensors, and which ranks are alike.
- :mod:`.memory`: ``predict(job)`` -> MemoryTimeline, ``fits(job, "80GiB")``, ``peak_per_rank``.
- :mod:`.cli`: ``workbench memory record|predict|compare|import|show``.
"""

from workbench.lazy import lazy_names

__all__ = ["predict", "fits", "peak_per_rank", "FitAnswer"]
# Imported on first use (it imports torch), so `workbench memory --help` starts without it.
__getattr__, __dir__ = lazy_names(__name__, dict.fromkeys(__all__, "workbench.prediction.memory"))
