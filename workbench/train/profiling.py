"""``--profile [STEPS]``: every rank traces a few training steps with torch.profiler.

The first step of the run (or of its resumption) is the profiler's warm-up (traced and discarded: the
first step creates the optimizer state and the profiler's own start-up lands there), then ``STEPS`` steps
are traced and written as one Chrome/Kineto trace per rank::

    RUN_DIR/profile/rank{r}.pt.trace.json.gz       (gzip; torch writes the file, distributedInfo.rank = r)

and each rank appends ``{"type": "profile", "rank": r, "path": "profile/rank{r}.pt.trace.json.gz",
"steps": [...], ...}`` to ``events.jsonl`` (``path`` relative to the run directory), so tools find the
traces (``workbench time show RUN_DIR``, ``workbench.time.import_trace(RUN_DIR)``). The profiler's step
numbers are the training steps (``ProfilerStep#5`` is step 5), and the training code labels forward,
backward, optimizer, data and checkpoint (:mod:`workbench.time.labels`) while it traces. CPU activities
always; CUDA (kernels, NCCL) when the rank trains on a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from workbench.time import labels

__all__ = ["StepProfiler", "PROFILE_DIR", "trace_name"]

PROFILE_DIR = "profile"


def trace_name(rank: int) -> str:
    return f"rank{rank}.pt.trace.json.gz"


class StepProfiler:
    """Trace ``steps`` training steps after one warm-up step, starting at ``start_step``. Call
    :meth:`begin` before each step and :meth:`end` after it; :meth:`close` in a ``finally``."""

    def __init__(self, run_dir: str, rank: int, steps: int, start_step: int, total_steps: int,
                 device: torch.device, emit: Callable[..., Any]):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, self.emit = rank, emit
        self.rel = os.path.join(PROFILE_DIR, trace_name(rank))
        self.path = os.path.join(run_dir, self.rel)
        # A resumed run may have fewer steps left than asked: trace what there is.
        self.steps = max(0, min(steps, total_steps - start_step - 1))
        self.first, self.last = start_step + 1, start_step + self.steps  # traced steps, inclusive
        self.start_step = start_step
        self.done = self.steps == 0
        self.activities = ["cpu"] + (["cuda"] if device.type == "cuda" else [])
        if self.done:
            emit("profile", path=None, steps=[], reason=f"no step left to trace after the warm-up step "
                 f"{start_step} (the run ends at step {total_steps})")
            self.prof = None
            return
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        window = schedule(wait=0, warmup=1, active=self.steps, repeat=1)
        self.prof = profile(activities=acts, schedule=lambda n: window(max(0, n - start_step)), on_trace_ready=self._write,
                            # shapes: gloo's collectives carry their sizes only then (the trace's comm bytes)
                            record_shapes=True, with_stack=False)
        self.prof.step_num = start_step  # ProfilerStep#N is training step N
        self.started = False

    def _write(self, prof) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path[:-len(".json.gz")] + ".tmp.json.gz"  # torch gzips by the name's ending
        prof.export_chrome_trace(tmp)
        os.replace(tmp, self.path)
        self.emit("profile", path=self.rel, steps=list(range(self.first, self.last + 1)),
                  warmup_steps=[self.start_step], activities=self.activities)

    def begin(self, step: int) -> None:
        if self.done or self.prof is None:
            return
        if not self.started:
            labels.set_enabled(True)
            self.prof.start()
            self.started = True

    def end(self, step: int) -> None:
        if self.done or self.prof is None or not self.started:
            return
        self.prof.step()  # after the last active step the schedule writes the trace (on_trace_ready)
        if step >= self.last:
            self.done = True
            labels.set_enabled(False)
            self.prof.stop()

    def close(self) -> None:
        """Stop tracing (idempotent); a run that fails mid-trace writes no trace."""
        if self.prof is not None and self.started and not self.done:
            self.done = True
            labels.set_enabled(False)
            self.prof.on_trace_ready = None  # stopped before its last step: the run failed
            self.prof.stop()
        self.done = True
