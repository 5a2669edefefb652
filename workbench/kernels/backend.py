"""Which implementation our custom ops run: ``triton`` (our kernels), ``torch`` (the reference path, plain
torch ops, any device) or ``auto`` (Triton on CUDA tensors, torch elsewhere).

The choice is process-wide (``set_backend``, what ``--kernels`` sets in a training job) or scoped
(``with use("torch"):``). Each op asks :func:`choose` with its inputs' device, so one setting serves CPU
and GPU tensors alike::

    workbench.kernels.set_backend("triton")        # every op from now on, or a clear error where it can't
    with workbench.kernels.use("torch"):           # this block: the reference path
        y = workbench.kernels.masked_fill(x, m, 0.0)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from workbench.config import KERNEL_BACKENDS as BACKENDS
from workbench.kernels import _triton

_state = threading.local()
_GLOBAL = ["auto"]


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"kernels={name!r} is not a kernel backend; choose one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> None:
    """Set the process-wide backend (``--kernels``)."""
    _GLOBAL[0] = _check(name)


def get_backend() -> str:
    """The backend in force here: the innermost ``use`` block, else the process-wide one."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else _GLOBAL[0]


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Run a block with ``name`` as the backend (thread-local, nests)."""
    _check(name)
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


class KernelUnavailable(RuntimeError):
    """kernels='triton' where Triton cannot run on the inputs' device (the message says the fix)."""


def choose(device: torch.device | str, backend: str | None = None) -> str:
    """'triton' or 'torch' for tensors on ``device`` under ``backend`` (default: :func:`get_backend`).

    ``auto`` takes Triton only on CUDA tensors with a usable Triton; ``triton`` raises
    :class:`KernelUnavailable` (one line, with the fix) where it cannot run.
    """
    backend = _check(backend or get_backend())
    if backend == "torch":
        return "torch"
    device = torch.device(device)
    st = _triton.status()
    why = st.device_ok(device)
    if backend == "auto":
        return "triton" if device.type == "cuda" and why is None else "torch"
    if why is not None:
        raise KernelUnavailable(f"kernels='triton' cannot run on {device.type} tensors: {why}")
    return "triton"


def resolve(backend: str, device: torch.device | str) -> str:
    """What ``backend`` means on ``device`` ('triton' or 'torch'), for recording in a run's config."""
    return choose(device, backend)
