"""The job's process group: ``init_group(use_cuda)``, with a timeout and a one-line failure.

Every rank waits in ``init_process_group`` until all ``WORLD_SIZE`` ranks have joined, for at most
``WORKBENCH_PG_TIMEOUT_S`` seconds (default 120). When one never arrives (stuck before the rendezvous,
or starved of CPU on an overloaded machine), the ranks that did arrive see torch's ``DistStoreError:
wait timeout after 120000ms, keys: ...``, which names a store key, not the problem; it becomes one
line that says what happened and what to do.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

PG_TIMEOUT_ENV = "WORKBENCH_PG_TIMEOUT_S"


def group_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "120")))


def init_group(use_cuda: bool) -> str:
    """``dist.init_process_group`` (NCCL on CUDA, else gloo) from torchrun's environment; returns the backend."""
    timeout, backend = group_timeout(), "nccl" if use_cuda else "gloo"
    try:
        dist.init_process_group(backend, timeout=timeout)
    except dist.DistStoreError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        world = os.environ.get("WORLD_SIZE", "?")
        raise RuntimeError(
            f"the process group of {world} ranks did not form within {timeout.total_seconds():g} s: another "
            f"rank never joined ({first}); it may be stuck or starved of CPU: check the other ranks' errors, "
            f"run fewer processes at once, or raise {PG_TIMEOUT_ENV}") from None
    return backend
