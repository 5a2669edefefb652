"""The names of the kinds of tensors training keeps, and how they map onto one another.

Three views of one training state, one vocabulary each, all defined here:

* :data:`STATE_KINDS`: what a rank holds in memory per parameter (a ``ShardingPlan``'s categories,
  its ``rank_bytes`` columns, the memory views' colours)::

      parameter   gradient   optimizer (AdamW exp_avg, exp_avg_sq)   master (fp32 copy under bf16)

* :data:`CHECKPOINT_KINDS`: what a checkpoint entry is (a ``CheckpointManifest``'s ``kind`` column, the
  ``--kind``/``include`` choices of the checkpoint tools)::

      model   optimizer   master   rng   extra (ema, scheduler, counters, anything else)

* :data:`KEY_PREFIXES`: the first dotted component of a workbench checkpoint key, in the order a save
  writes them, and the checkpoint kind each one is (:data:`PREFIX_KIND`)::

      model.* -> model   optim.* -> optimizer   ema.* -> extra   sched.* -> extra   rng.* -> rng
      extra.* -> extra   master.* -> master (read from other tools; a workbench save never writes it)

:data:`STATE_TO_CHECKPOINT` says where each in-memory kind is saved (gradients are not).
"""

from __future__ import annotations

# One colour per kind, from the one palette every plot uses (checkpoint kinds reuse their in-memory kind's).
from workbench.palette import KIND_COLORS

__all__ = ["STATE_KINDS", "CHECKPOINT_KINDS", "KEY_PREFIXES", "PREFIX_KIND", "STATE_TO_CHECKPOINT",
           "KIND_COLORS", "checkpoint_kind"]

STATE_KINDS = ("parameter", "gradient", "optimizer", "master")
CHECKPOINT_KINDS = ("model", "optimizer", "master", "rng", "extra")
KEY_PREFIXES = ("model", "optim", "ema", "sched", "rng", "extra")
PREFIX_KIND = {"model": "model", "optim": "optimizer", "optimizer": "optimizer", "master": "master",
               "rng": "rng", "ema": "extra", "sched": "extra", "extra": "extra"}
STATE_TO_CHECKPOINT = {"parameter": "model", "gradient": None, "optimizer": "optimizer", "master": "master"}


def checkpoint_kind(name: str) -> str:
    """A kind name as a user types it (``optim``, ``Optimizer``, ``model``) -> a :data:`CHECKPOINT_KINDS` name."""
    kind = PREFIX_KIND.get(name.strip().lower())
    if kind is None or kind not in CHECKPOINT_KINDS:
        raise ValueError(f"unknown kind {name!r}; choose from {list(CHECKPOINT_KINDS)}")
    return kind
