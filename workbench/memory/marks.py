"""Where the program is: phase, step and micro-batch, marked by the training code, read by recorders.

The trainer, the pipeline stages and the predictor all run the same step code, and that code says what
it is doing::

    with marks.phase("forward"), marks.microbatch(m):
        logits = model(x)

A recorder (measured or predicted) reads :data:`MARKS` when it logs an allocation. Nothing records
unless a recorder runs, and a mark costs two attribute writes, so the marks stay in the code always.
Backward passes that run inside a pipeline schedule are told apart by the recorder itself (autograd's
engine is running), so only the phases the code can see need marking.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from workbench.memory.timeline import PHASES

__all__ = ["MARKS", "phase", "microbatch", "set_step"]


class _Marks:
    __slots__ = ("phase", "step", "microbatch")

    def __init__(self) -> None:
        self.phase = "other"
        self.step = -1
        self.microbatch = -1


MARKS = _Marks()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as phase ``name`` (one of the timeline's PHASES)."""
    if name not in PHASES:
        raise ValueError(f"unknown memory phase {name!r}; use one of {list(PHASES)}")
    prev = MARKS.phase
    MARKS.phase = name
    try:
        yield
    finally:
        MARKS.phase = prev


@contextmanager
def microbatch(index: int) -> Iterator[None]:
    prev = MARKS.microbatch
    MARKS.microbatch = int(index)
    try:
        yield
    finally:
        MARKS.microbatch = prev


def set_step(step: int) -> None:
    """The training step now running (-1: outside the loop)."""
    MARKS.step = int(step)
    MARKS.microbatch = -1
