"""The registry that ``workbench kernels check|bench``, ``KernelBench`` and ``benchmarks/bench_kernels.py``
read: one :class:`KernelCase` per op and variant.

A case makes inputs at a size (a number of elements, or of rows for index_put), runs our op, the
reference (our op under ``kernels='torch'``), and torch's own eager way of doing the same thing (the
baseline; it is also what ``torch.compile`` is given). ``bytes_moved`` is the least traffic the op must
make, so ``GB/s = bytes_moved / time`` and the fraction of ``copy_`` bandwidth compare like with like.

Each op module registers its cases at import (``register``); names are ``op/variant``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Inputs = dict[str, Any]


@dataclass
class KernelCase:
    """One op variant, as the checker and the benchmark see it.

    ``make(size, dtype, device, gen)`` -> inputs (a dict). ``run(inputs)`` calls our op under whatever
    backend is in force and returns a tensor or a tuple of tensors (forward outputs, then gradients when
    ``backward``). ``torch_eager(inputs)`` returns the same values computed with torch's own ops (the
    baseline; ``None`` when torch has no equivalent and only the reference is compared).
    ``exact``: the Triton result must equal the reference bit for bit (integer logic, copies, masks);
    otherwise ``tol[dtype] = (atol, rtol)``.
    ``check_sizes`` are small (they run in Triton's interpreter on CPU); ``bench_sizes`` are for a GPU.
    ``edge_cases(dtype, device, gen)`` yields ``(label, inputs)`` for empty, non-contiguous, duplicate,
    negative-index and all-true/all-false inputs. An input that must raise (an out-of-range index) passes
    when both backends raise the same error.
    ``gen`` is a CPU ``torch.Generator`` (also on a GPU): draw on ``gen.device``, then move to ``device``.
    """

    op: str
    variant: str
    make: Callable[[int, torch.dtype, torch.device, torch.Generator], Inputs]
    run: Callable[[Inputs], Any]
    bytes_moved: Callable[[Inputs], int]
    torch_eager: Callable[[Inputs], Any] | None = None
    backward: bool = False
    exact: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    tol: dict[torch.dtype, tuple[float, float]] = field(default_factory=lambda: {
        torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 1e-3)})
    check_sizes: tuple[int, ...] = (1000, 4099)
    bench_sizes: tuple[int, ...] = (1 << 20, 1 << 24, 1 << 26)
    edge_cases: Callable[[torch.dtype, torch.device, torch.Generator], Any] | None = None
    note: str = ""  # one line shown in the bench table (what the baseline is, what differs)
    # torch_eager's values equal ours up to ``tol`` (False: it is only a speed baseline, e.g. dropout's
    # mask comes from torch's generator, not our Philox stream, so only the reference is compared)
    compare_eager: bool = True

    @property
    def name(self) -> str:
        return f"{self.op}/{self.variant}"


CASES: dict[str, KernelCase] = {}


def register(case: KernelCase) -> KernelCase:
    if case.name in CASES:
        raise ValueError(f"kernel case {case.name!r} is registered twice")
    CASES[case.name] = case
    return case


def as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
