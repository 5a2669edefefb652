"""Shared fixtures. Multi-rank tests run real torchrun/gloo jobs; every wait has a hard timeout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Child processes (torchrun ranks) must not each grab every core of a 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def workbench_cli() -> list[str]:
    """The console script of the environment running the tests."""
    exe = Path(sys.executable).with_name("workbench")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "workbench.cli"]
