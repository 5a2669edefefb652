"""What the run dashboard draws: the figures of the step metrics, and per run what is on screen.

Split from :mod:`workbench.widgets.dashboard` (which draws and follows runs) so that one stays readable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from workbench.train.launcher import Run

# What the memory plot shows, by where Run.memory_history found it.
MEMORY_TITLES = {
    "memory": "Memory per step: each rank's peak within the step",
    "peak_mem_bytes": "Memory per step: each rank's peak tensor bytes",
    "mem_bytes": "Memory per step: mem_bytes (memory=True records the peak within each step)",
}


@dataclass(frozen=True)
class StepMetric:
    """One figure: a field of the step events (a column of ``Run.history()``), by step or wall-clock time."""

    column: str
    title: str
    ytitle: str  # says the unit, and whether the number is each rank's or the whole job's
    per_rank: bool  # False: every rank reports the same number; drawn once per run, from rank 0
    smooth: bool  # a noisy measurement: the smoothing control draws its EMA
    log: bool  # the log-scale control applies


STEP_METRICS = (
    StepMetric("loss", "Loss per step", "loss", per_rank=True, smooth=True, log=True),
    StepMetric("tokens_per_s", "Throughput per step (whole job)", "tokens/s (global)",
               per_rank=False, smooth=True, log=False),
    StepMetric("grad_norm", "Gradient norm per step (before clipping)", "grad L2 norm (global)",
               per_rank=False, smooth=True, log=True),
    StepMetric("lr", "Learning rate per step", "learning rate (global)", per_rank=False, smooth=False, log=False),
    StepMetric("step_time_s", "Step time", "seconds per step (per rank)", per_rank=True, smooth=True, log=True),
)
SMOOTHED = frozenset(m.column for m in STEP_METRICS if m.smooth)
X_AXES = {"step": "step", "time": "seconds since the run started (wall clock)"}

@dataclass
class _RunView:
    """What the dashboard draws for one run: the Run's history as last drawn, and the plot traces.

    Every fact comes from the :class:`Run` (``history()``, ``status``, ``root_cause()``); the view keeps
    only how many of its events it has drawn (``seen``), when its first event was written (``t0``, the
    wall-clock axis's zero) and what is on screen.
    """

    run: Run
    label: str
    color: str
    steps: int
    seen: int = 0  # events of the run already read
    # What the events read since the figures were last redrawn touched (a slow page defers that redraw):
    # the ranks with new steps, with new memory, and the new kinds of event ("schedule", "moe", "eval").
    pending_steps: set[int] = field(default_factory=set)
    pending_memory: set[int] = field(default_factory=set)
    pending_kinds: set[str] = field(default_factory=set)
    history: dict[int, Any] = field(default_factory=dict)  # run.history() when last drawn
    t0: float | None = None  # the `time` of the run's first event
    shown: bool = True  # False once "Clear" removed it from the plots
    traces: dict[tuple[str, int], Any] = field(default_factory=dict)  # (field or "memory", rank) -> raw line
    smoothed: dict[tuple[str, int], Any] = field(default_factory=dict)  # its EMA, while smoothing is on
    eval_events: list[dict] = field(default_factory=list)  # embedding runs: rank 0's `eval` events
    eval_trace: Any = None
    pipeline_events: list[dict] = field(default_factory=list)  # `pipeline` + `schedule`, for the timeline
    moe_events: list[dict] = field(default_factory=list)  # `moe` + `step` (its aux_loss)
    timeline_step: Any = None  # (picked, step shown, steps complete) as last drawn
    moe_step: int | None = None
    launched_at: float = field(default_factory=time.time)
    finished: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # redraw now (Stop), not at the next poll
    stopping: bool = False  # Stop was pressed; the status says so until the run has ended
    thread: threading.Thread | None = None
