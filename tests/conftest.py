"""Shared fixtures. Multi-rank tests run real torchrun/gloo jobs; every wait has a hard timeout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Child processes (torchrun ranks) must not each grab every core of a 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Before any test module loads Triton (torch's compiler does; so does importorskip("triton")): without
# CUDA our kernels run in Triton's interpreter, which must be chosen before Triton is imported.
from workbench.kernels import _triton as _kernels_triton  # noqa: E402

_kernels_triton.prepare()


def pytest_addoption(parser):
    parser.addoption("--hostile-long", action="store_true", default=False,
                     help="tests/hostile: fuzz 20 times as many inputs per format (the reliability figures of "
                          "docs/benchmarks.md; about 20 times as long)")


def _gpu_missing() -> str | None:
    """Why the tests marked ``gpu`` cannot run here, or None where they can."""
    import torch

    if torch.version.cuda is None:
        return f"needs a CUDA GPU: this torch {torch.__version__} is a CPU build (run `make test-gpu` on a GPU machine)"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: none is visible (run `make test-gpu` on a GPU machine)"
    return None


def _slow_ids() -> list[str]:
    """The node ids (or id prefixes: a file, a test without its parameters) listed in tests/slow.txt."""
    lines = (REPO / "tests" / "slow.txt").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


def _is_listed(nodeid: str, listed: set[str]) -> bool:
    """``nodeid`` is listed itself, or its file, or its test without the parameters."""
    return nodeid in listed or nodeid.split("::", 1)[0] in listed or nodeid.split("[", 1)[0] in listed


def pytest_collection_modifyitems(config, items):
    # `make test` leaves out the tests listed in tests/slow.txt (`-m "not slow"`); `make test-all` runs them.
    listed = set(_slow_ids())
    for item in items:
        if _is_listed(item.nodeid, listed):
            item.add_marker(pytest.mark.slow)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    why = _gpu_missing() if gpu_tests else None
    if why is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def workbench_cli() -> list[str]:
    """The console script of the environment running the tests."""
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "workbench.cli"]


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo process group in this process (HashStore, no ports) and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
