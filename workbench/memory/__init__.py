"""Memory timelines: measured per rank (``train --memory``), predicted for any layout and scale, compared,
and imported from torch's snapshots and profiler traces. All in one schema (:mod:`.timeline`).

    timeline = workbench.memory.predict("small", dp_shard=2, tp=2)     # a MemoryTimeline
    measured = workbench.memory.load("runs/x")                         # RUN_DIR/memory
    workbench.memory.comparison(measured, timeline)                       # per-rank peak error
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MemoryTimeline", "MemoryRecorder", "CATEGORIES", "PHASES", "predict", "fits", "peak_per_rank",
           "compare", "load", "import_snapshots", "import_profiler_trace"]

_WHERE = {
    "MemoryTimeline": "workbench.memory.timeline", "CATEGORIES": "workbench.memory.timeline",
    "PHASES": "workbench.memory.timeline", "MemoryRecorder": "workbench.memory.recorder",
    "predict": "workbench.prediction.memory", "fits": "workbench.prediction.memory",
    "peak_per_rank": "workbench.prediction.memory", "compare": "workbench.memory.comparison",
    "import_snapshots": "workbench.memory.snapshot", "import_profiler_trace": "workbench.memory.snapshot",
}


def load(path) -> "Any":
    """A saved timeline: a run directory, its ``memory/``, or a directory written by ``MemoryTimeline.save``."""
    from workbench.memory.timeline import MemoryTimeline

    return MemoryTimeline.load(path)


# Imported on first use, so `import workbench.memory` stays light. `predict`, `fits` and `peak_per_rank`
# live in workbench.prediction, the layer above the trainer: this package's own modules never import it
# (the trainer imports them), and this lookup only hands a user the function by its short name.
def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'workbench.memory' has no attribute {name!r}")
