"""A plan builds one block per distinct position and reuses its answers for every layer it stands for.

Transformer blocks of one stage differ only in their layer id: the build path gives each the same TP
plan, the same FSDP2 unit and the same placements. So the plan simulation builds, through the same
``build_stages``, a model with ``R`` blocks per pipeline stage instead of all ``n_layers``, and copies
each block's findings (placements, gradient placements, FSDP units, MoE layers) to the real layers::

    llama-70b, pp=1:              80 blocks  ->  1 block    (block 0 stands for layers 0..79)
    pp=4 (20 layers per stage):   stage s    ->  block s    (stands for layers 20s..20s+19)
    selective AC every k:         stage s    ->  k blocks   (position i of a stage -> block i % k:
                                                             AC wraps stage positions 0, k, 2k, ...)

What depends on the whole model is built whole instead: ZeRO-1 (its optimizer assigns whole tensors to
ranks by their sizes), and a model factory (no config to shrink). ``tests/test_plan.py`` holds the two
builds equal, layout by layout, and the plans themselves to real gloo runs rank by rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, TypeVar

from workbench.config import ModelConfig, ParallelConfig, TrainConfig

__all__ = ["Representatives", "representatives"]

T = TypeVar("T")
_LAYER = re.compile(r"layers\.(\d+)(?=\.|$)")


@dataclasses.dataclass(frozen=True)
class Representatives:
    """A smaller model config whose blocks stand for all of ``real``'s, and which real layers each does."""

    real: ModelConfig
    model: ModelConfig                     # ``real`` with n_layers = blocks per stage x stages
    stands_for: dict[int, list[int]]       # reduced layer id -> the real layer ids it stands for (ascending)

    def real_layers(self, layers: list[list[int]]) -> list[list[int]]:
        """The real layer ids of each of a rank's stages, from the reduced ones."""
        return [sorted(r for k in stage for r in self.stands_for[k]) for stage in layers]

    def weight(self, name: str) -> int:
        """How many real modules the module ``name`` stands for (1 outside the blocks)."""
        m = _LAYER.match(name)
        return len(self.stands_for[int(m.group(1))]) if m else 1

    def expand(self, items: Iterable[T], name: Callable[[T], str], rename: Callable[[T, int], T]) -> list[T]:
        """``items`` in model order, each run of block items replaced by the real layers' copies.

        ``name(item)`` is an item's module path (``layers.3.attention.wq.weight``); ``rename(item, i)``
        its copy for real layer ``i``. Real layers come in ascending order, each with the items of the
        block that stands for it, in that block's order: the order the whole model lists them in.
        """
        out: list[T] = []
        run: dict[int, list[T]] = {}

        def flush() -> None:
            real = sorted((r, k) for k in run for r in self.stands_for[k])
            out.extend(rename(item, r) for r, k in real for item in run[k])
            run.clear()

        for item in items:
            m = _LAYER.match(name(item))
            if m is None:
                flush()
                out.append(item)
            else:
                run.setdefault(int(m.group(1)), []).append(item)
        flush()
        return out


def rename_layer(name: str, layer: int) -> str:
    """``layers.K...`` -> ``layers.<layer>...``."""
    return _LAYER.sub(f"layers.{layer}", name, count=1)


def representatives(cfg: ModelConfig | None, parallel: ParallelConfig, train: TrainConfig) -> Representatives | None:
    """The reduced model a plan of ``cfg`` can build instead, or None where it must build the whole one."""
    from workbench.parallel.pipeline_split import split_layers

    if cfg is None:
        return None  # a model factory: no config to shrink
    if parallel.zero == 1 and parallel.dp_shard > 1:
        return None  # ZeRO-1 partitions whole tensors over ranks by their sizes: it needs them all
    n_stages = parallel.pp * parallel.pp_stages_per_rank if parallel.pp > 1 else 1
    per_stage = train.ac_every if train.activation_checkpointing == "selective" else 1
    if per_stage * n_stages >= cfg.n_layers:
        return None  # nothing to save
    reduced = split_layers(per_stage * n_stages, n_stages)
    stands_for: dict[int, list[int]] = {k: [] for stage in reduced for k in stage}
    for small, real in zip(reduced, split_layers(cfg.n_layers, n_stages)):
        for i, layer in enumerate(real):
            stands_for[small[i % per_stage]].append(layer)
    return Representatives(cfg, dataclasses.replace(cfg, n_layers=per_stage * n_stages), stands_for)


def expand_units(reps: Representatives, units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FSDP units of the reduced model -> the whole model's (one per real block, in module order)."""
    def rename(unit: dict[str, Any], layer: int) -> dict[str, Any]:
        return {**unit, "name": rename_layer(unit["name"], layer),
                "params": [rename_layer(p, layer) for p in unit["params"]]}

    for unit in units:
        if not _LAYER.match(unit["name"]) and any(_LAYER.match(p) for p in unit["params"]):
            raise AssertionError(f"FSDP unit {unit['name']!r} outside the blocks holds block parameters")
    return reps.expand(units, lambda u: u["name"], rename)
