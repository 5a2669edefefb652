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
from typing import Any

import torch.distributed as dist

PG_TIMEOUT_ENV = "WORKBENCH_PG_TIMEOUT_S"


def group_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(PG_TIMEOUT_ENV, "120")))


def check_world_size(parallel: Any, world: int, fix: str) -> None:
    """Refuse (ValueError, one line ending in ``fix``) a layout whose rank count is not the job's process
    count. Without this a tp=2 job started as one process trained unsharded (no mesh is built for one rank)
    while its events still said tp=2, and one with too many processes built a mesh that did not fit."""
    if parallel.world_size != world:
        raise ValueError(f"the layout {parallel.describe()} needs {parallel.world_size} "
                         f"rank{'s' if parallel.world_size != 1 else ''}, but this job has {world} "
                         f"process{'es' if world != 1 else ''} (WORLD_SIZE={world}); {fix}")


def init_group(use_cuda: bool) -> str:
    """``dist.init_process_group`` (NCCL on CUDA, else gloo) from torchrun's environment; returns the backend.

    A group that already exists is kept: under plain torchrun (``workbench.train.torchrun_rank``) the ranks form
    it first, to wait for rank 0 to set up the run directory, and then train in it."""
    if dist.is_initialized():
        return str(dist.get_backend())
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
