"""The names the training code gives the parts of a step in profiler traces, so a trace says unambiguously
which span is which (``workbench.time.trace`` reads them back)::

    workbench.forward              a forward pass (gradient-accumulation micro-batches included)
    workbench.backward             a backward pass, and the pipeline's gradient reduction after it
    workbench.optimizer            clipping, optimizer.step, zero_grad and the LR scheduler
    workbench.data                 fetching a batch
    workbench.checkpoint           saving (or waiting for) a checkpoint after a step
    workbench.forward#mb<k>        a pipeline stage's forward of microbatch k
    workbench.backward#mb<k>       a pipeline stage's backward of microbatch k

The labels are ``torch.profiler.record_function`` ranges, entered only while :func:`labelled` (or
:func:`set_enabled`) switches them on: the trainer does so for its ``--profile`` steps. Switched off,
:func:`label` returns a shared no-op context: no torch call, about a tenth of a microsecond (a
``record_function`` costs ~6 us on CPU even with no profiler running, and would reach the dispatch modes
that record memory and run predictions). Use :func:`labelled` around your own ``torch.profiler.profile``
to get the labels in a notebook.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

__all__ = ["FORWARD", "BACKWARD", "OPTIMIZER", "DATA", "CHECKPOINT", "LABELS", "label", "microbatch_label",
           "labelled", "set_enabled", "enabled", "labelled_batches"]

FORWARD = "workbench.forward"
BACKWARD = "workbench.backward"
OPTIMIZER = "workbench.optimizer"
DATA = "workbench.data"
CHECKPOINT = "workbench.checkpoint"
LABELS = (FORWARD, BACKWARD, OPTIMIZER, DATA, CHECKPOINT)
MICROBATCH_SEP = "#mb"

_OFF = nullcontext()


class _State:
    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


_STATE = _State()


def enabled() -> bool:
    return _STATE.on


def set_enabled(on: bool) -> bool:
    """Switch the labels on or off; returns the previous setting."""
    prev, _STATE.on = _STATE.on, bool(on)
    return prev


@contextmanager
def labelled(on: bool = True) -> Iterator[None]:
    """Labels on (or off) inside the block."""
    prev = set_enabled(on)
    try:
        yield
    finally:
        set_enabled(prev)


def label(name: str) -> Any:
    """A ``record_function(name)`` range while labels are on, else a no-op context."""
    if not _STATE.on:
        return _OFF
    from torch.profiler import record_function

    return record_function(name)


def microbatch_label(base: str, k: int) -> Any:
    """``label("workbench.forward#mb3")``: the name is only formatted while labels are on."""
    if not _STATE.on:
        return _OFF
    return label(f"{base}{MICROBATCH_SEP}{int(k)}")


def labelled_batches(batches) -> Iterator:
    """``batches`` with each fetch inside a ``workbench.data`` range (only while labels are on)."""
    it = iter(batches)
    while True:
        with label(DATA):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item
