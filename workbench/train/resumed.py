"""What a resumed run resumed from: the step, the checkpoint, and whether the layout changed.

The trainer writes it into the ``resume`` event (every rank, after loading), from the checkpoint's
manifest (which records the layout it was saved under) and the job's layout now::

    {"type": "resume", "step": 100, "path": ".../checkpoints/step-000100",
     "saved_layout": {...}, "layout": {...}, "layout_changed": true,
     "layout_changes": {"tp": [2, 1], "dp_shard": [1, 2]},
     "saved_layout_desc": "tp=2", "layout_desc": "dp_shard=2", ...}

:class:`Resumed` is that event as an object: ``Run.resumed`` in the Python API, ``resumed_from`` in a
run's summary (``train --json``), one line in the CLI.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from workbench.config import ParallelConfig

__all__ = ["Resumed", "layout_changes", "describe_layout"]


def layout_changes(saved: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, list[Any]] | None:
    """``{setting: [saved, now]}`` for each ParallelConfig setting that differs (empty: the same layout);
    None when the checkpoint does not record its layout. Settings the saved layout lacks (written by an
    older version) are left out rather than guessed."""
    if not saved:
        return None
    return {k: [saved[k], v] for k, v in now.items() if k in saved and saved[k] != v}


def describe_layout(layout: dict[str, Any] | None) -> str | None:
    """``"dp_shard=2 x tp=2"`` for a layout dict (``ParallelConfig.to_dict()``), None if it is not one."""
    if not layout:
        return None
    try:
        return ParallelConfig.from_dict(layout).describe()
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Resumed:
    """A resumed run's starting point, from its ``resume`` event."""

    step: int
    path: str
    saved_layout: dict[str, Any] | None
    layout: dict[str, Any] | None
    changes: dict[str, list[Any]] | None  # setting -> [saved, now]; None: the saved layout is unknown
    load_s: float | None = None

    @classmethod
    def from_event(cls, e: dict[str, Any]) -> "Resumed":
        changes = e.get("layout_changes")
        if changes is None and "layout" in e:
            changes = layout_changes(e.get("saved_layout"), e["layout"])
        return cls(step=int(e["step"]), path=str(e["path"]), saved_layout=e.get("saved_layout"),
                   layout=e.get("layout"), changes=changes, load_s=e.get("load_s"))

    @property
    def layout_changed(self) -> bool | None:
        """True if the job's layout differs from the one the checkpoint was saved under; None if unknown."""
        return None if self.changes is None else bool(self.changes)

    def describe(self) -> str:
        """One line: ``resumed from step 100 (PATH); layout changed: tp=2 -> dp_shard=2 (tp 2 -> 1, ...)``."""
        head = f"resumed from step {self.step} ({self.path})"
        if self.changes is None:
            return f"{head}; the checkpoint does not record its layout"
        now = describe_layout(self.layout) or "?"
        if not self.changes:
            return f"{head}; same layout ({now})"
        diffs = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.changes.items())
        return f"{head}; layout changed: {describe_layout(self.saved_layout) or '?'} -> {now} ({diffs})"

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "layout_changed": self.layout_changed,
                "layout_changes": self.changes, "saved_layout": describe_layout(self.saved_layout),
                "layout": describe_layout(self.layout), "load_s": self.load_s}

    def __str__(self) -> str:
        return self.describe()

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in self.to_dict().items())
        return f"<table><caption>Resumed</caption>{rows}</table>"
