"""A light peak-memory probe: the bytes of live tensor storages, measured as the program runs.

On CUDA it reads the caching allocator (``torch.cuda.max_memory_allocated``). On CPU there is no
allocator to ask, so the probe is a ``TorchDispatchMode`` that sees every tensor an operator returns,
counts each new storage once (``storage.nbytes()``) and uncounts it when the storage is freed (a
``weakref.finalize`` on the storage)::

    live(t) = sum of nbytes over storages alive at t       peak = max_t live(t) since reset_peak()

Enter it around the work to measure: what is created inside is counted from birth, and tensors made
before it (parameters, optimizer state) are added with :meth:`PeakMemoryProbe.track`. Tensor subclasses (DTensor) are counted through their local
tensors; temporaries created inside a subclass's own dispatch are not seen (they are short-lived).
Code that shrinks or regrows a storage in place tells the probe through :func:`resize_storage_`.
"""

from __future__ import annotations

import functools
import weakref

import torch

from workbench import compat

__all__ = ["PeakMemoryProbe", "resize_storage_"]

_ACTIVE: "PeakMemoryProbe | None" = None  # the probe resize_storage_ reports to, while one runs


@functools.cache
def _is_wrapper_subclass():
    return compat.get("is_traceable_wrapper_subclass")  # looked up once: this runs on every operator's output


def _local_tensors(t):
    if not isinstance(t, torch.Tensor):
        return
    if _is_wrapper_subclass()(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _local_tensors(getattr(t, name, None))
    else:
        yield t


def _meter(probe: "PeakMemoryProbe"):
    """A dispatch mode that counts every tensor an operator returns (torch's TorchDispatchMode is private API:
    made on first use, so a torch without it only loses the CPU measurement)."""
    tree_flatten = compat.get("pytree").tree_flatten

    class Meter(compat.get("TorchDispatchMode")):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    for local in _local_tensors(t):
                        probe._track(local)
            return out

    return Meter()


class PeakMemoryProbe:
    """Live and peak tensor bytes of this process (CPU: dispatch tracking; CUDA: the allocator)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}
        self._mode = None
        # On CPU the measurement needs torch's dispatch-mode API; without it (workbench doctor says so)
        # peak() and live() answer None rather than a wrong number.
        self.measuring = self.device.type == "cuda" or compat.check("memory.probe")

    # -- tracking -----------------------------------------------------------------------------
    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self._sizes:
            return
        n = storage.nbytes()
        self._sizes[key] = n
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        if key not in self._sizes:
            return
        self.live_bytes += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    # -- API ----------------------------------------------------------------------------------
    def track(self, tensors) -> "PeakMemoryProbe":
        """Count tensors created outside the probe (parameters, optimizer state) until they are freed."""
        if not self.measuring:
            return self
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for local in _local_tensors(t):
                    self._track(local)
        return self

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak_bytes = self.live_bytes

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.peak_bytes) if self.measuring else None

    def live(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return int(self.live_bytes) if self.measuring else None

    def __enter__(self) -> "PeakMemoryProbe":
        global _ACTIVE
        _ACTIVE = self
        if self.device.type == "cpu" and self.measuring:
            self._mode = _meter(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        _ACTIVE = None


def resize_storage_(t: torch.Tensor, nbytes: int) -> None:
    """Resize ``t``'s storage in place (0 frees it, keeping shape and autograd identity); the probe follows."""
    storage = t.untyped_storage()
    if storage.nbytes() == nbytes:
        return
    storage.resize_(nbytes)
    if _ACTIVE is not None:
        _ACTIVE._resized(storage, nbytes)
