"""Step time: where each rank's step goes, measured from profiler traces and predicted for any layout, in one
schema (:mod:`.timeline`), like memory.

    tl = workbench.time.import_trace("runs/x/profile")          # a StepTimeline, every rank
    workbench.time.breakdown(tl)                                 # seconds per rank, step and category
    pred = workbench.time.predict("small", dp_shard=2, tp=2)     # predicted, same schema
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["StepTimeline", "CATEGORIES", "PHASES", "load", "import_trace", "breakdown", "communication_overlap",
           "idle_split", "stragglers", "diff", "DeviceProfile", "device_profile", "predict", "advise", "calibrate"]

_WHERE = {
    "StepTimeline": "workbench.time.timeline", "CATEGORIES": "workbench.time.timeline",
    "PHASES": "workbench.time.timeline",
    "import_trace": "workbench.time.trace",
    "breakdown": "workbench.time.analysis", "communication_overlap": "workbench.time.analysis",
    "idle_split": "workbench.time.analysis", "stragglers": "workbench.time.analysis", "diff": "workbench.time.analysis",
    "DeviceProfile": "workbench.time.devices", "device_profile": "workbench.time.devices",
    "calibrate": "workbench.time.calibrate",
    # predictions build through the trainer's one build path: they live in workbench.prediction (the layer
    # above the trainer); this lookup only hands a user the function by its short name
    "predict": "workbench.prediction.step_time", "advise": "workbench.prediction.advise",
}
_RENAMED = {"predict": "predict_time"}


def load(path) -> Any:
    """A saved step timeline (a file written by ``StepTimeline.save``, or a directory holding one)."""
    from workbench.time.timeline import StepTimeline

    return StepTimeline.load(path)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'workbench.time' has no attribute {name!r}")
