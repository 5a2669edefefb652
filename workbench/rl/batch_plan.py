"""PPO batch sizes that cannot get the arithmetic wrong: every count derived, with units, and no clamping.

A PPO iteration generates a *rollout* and then trains on it::

    rollout      P prompts x n samples per prompt          = S samples          (S = P n)
    per epoch    S samples cut into K mini-batches of M    (one optimizer step each: K = S / M)
    per rank     each mini-batch split over dp ranks       = M / dp samples per rank
    per step     each rank's share in micro-batches of m   (gradient accumulation A = (M / dp) / m)
    per rollout  K x E optimizer steps (E PPO epochs);  the LR schedule has R x K x E steps (R rollouts)

The anchors' bugs are exactly these lines: prompts taken for samples (a factor n), a global size taken
for a per-GPU one (a factor dp), a ratio that does not divide rounded or clamped (PaddleNLP sets
gradient accumulation to 1 with a warning), a zero mini-batch (verl hangs or yields NaN), and an LR
schedule counted in rollouts instead of optimizer steps (OpenRLHF #248). So every size is given with its
unit, required (``"64 prompts"``, ``"256 samples"``; a bare number is refused), and scope (``"4 samples/rank"``: per data-parallel rank;
otherwise global), and every ratio must divide exactly, or :func:`plan_ppo_batches` raises one
``ValueError`` that names the numbers and the nearest sizes that would work. Nothing is clamped.

``world_size`` may exceed ``dp``: the other ranks (tensor or pipeline parallel) share their data-parallel
rank's batch, so they do not divide it further.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from workbench.display import RendersInNotebook

__all__ = ["BatchSize", "PPOBatchPlan", "parse_batch_size", "plan_ppo_batches"]

_UNITS = {"prompt": "prompts", "prompts": "prompts", "sample": "samples", "samples": "samples",
          "sequence": "samples", "sequences": "samples", "response": "samples", "responses": "samples"}
_SCOPES = {"rank": "rank", "gpu": "rank", "device": "rank", "dp": "rank", "per-rank": "rank",
           "global": "global", "total": "global"}


@dataclass(frozen=True)
class BatchSize:
    """A batch size with its unit ("prompts" or "samples") and scope ("global" or "rank": per data-parallel rank)."""

    value: int
    unit: str = "samples"
    scope: str = "global"

    def __str__(self) -> str:
        return f"{self.value} {self.unit}" + ("/rank" if self.scope == "rank" else "")


def parse_batch_size(spec: "str | BatchSize", what: str) -> BatchSize:
    """``"256 samples"``, ``"64 prompts"``, ``"4 samples/rank"`` (also ``per rank``, ``/gpu``), or a :class:`BatchSize`.

    The unit is required: a bare number is the prompts-vs-samples ambiguity (a factor n) the anchors hit.
    No scope means global (the whole data-parallel group); ``/rank`` means per data-parallel rank."""
    example = "write e.g. '256 samples', '64 prompts' or '4 samples/rank'"
    if isinstance(spec, BatchSize):
        out = spec
        if isinstance(out.value, bool) or not isinstance(out.value, int) or out.unit not in ("prompts", "samples") \
                or out.scope not in ("global", "rank"):
            raise ValueError(f"{what}={spec!r} is not a batch size: value must be an int, unit prompts or samples, "
                             "scope global or rank")
    elif isinstance(spec, bool) or isinstance(spec, int):
        raise ValueError(f"{what}={spec} has no unit, and prompts and samples differ by a factor n; "
                         f"write '{spec} samples' or '{spec} prompts' (add '/rank' for per data-parallel rank)")
    elif not isinstance(spec, str):
        raise ValueError(f"{what}={spec!r} is not a batch size; {example}")
    else:
        m = re.fullmatch(r"\s*(-?\d+)\s*([a-z]+)?\s*(?:(?:/|\s+per\s+|\s+)([a-z-]+))?\s*", spec.lower())
        if not m:
            raise ValueError(f"{what}={spec!r} is not a batch size; {example}")
        value, word, scope = int(m.group(1)), m.group(2), m.group(3)
        if word in _SCOPES and scope is None:  # "8/gpu" parses as value 8, no word; "8 global" as word "global"
            word, scope = None, word
        if word is None:
            suffix = "/rank" if scope is not None and _SCOPES.get(scope) == "rank" else ""
            raise ValueError(f"{what}={spec!r} has no unit, and prompts and samples differ by a factor n; "
                             f"write '{value} samples{suffix}' or '{value} prompts{suffix}'")
        if word not in _UNITS:
            raise ValueError(f"{what}={spec!r}: unit {word!r} is unknown; use prompts or samples")
        if scope is not None and scope not in _SCOPES:
            raise ValueError(f"{what}={spec!r}: scope {scope!r} is unknown; use /rank (per data-parallel rank) "
                             "or nothing (global)")
        out = BatchSize(value, _UNITS[word], _SCOPES[scope] if scope else "global")
    if out.value <= 0:
        raise ValueError(f"{what}={out} must be at least 1: a zero or negative batch trains on nothing "
                         "(verl hangs or yields NaN on it); give a positive size")
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _near(n: int, target: int, ok=lambda d: True, k: int = 3) -> str:  # callers ensure one divisor is ok
    """The divisors of ``n`` closest to ``target`` (that satisfy ``ok``), for a message."""
    ds = sorted((d for d in _divisors(n) if ok(d)), key=lambda d: (abs(d - target), d))[:k]
    ds = [str(d) for d in sorted(ds)]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else "".join(ds)


@dataclass
class PPOBatchPlan(RendersInNotebook):
    """Every count of a PPO run's batch hierarchy, and how each was derived (``derivation``).

    In a notebook it shows as its registered view (the batch hierarchy drawn), else as its HTML table."""

    prompts_per_rollout: int
    samples_per_prompt: int
    samples_per_rollout: int
    world_size: int
    dp: int
    ranks_per_dp_rank: int
    rollout_samples_per_rank: int
    mini_batch_samples: int
    mini_batch_prompts: int | float  # a float when the mini-batch holds a fraction of a prompt's samples
    mini_batches_per_epoch: int
    mini_batch_samples_per_rank: int
    micro_batch_samples_per_rank: int
    grad_accum: int
    ppo_epochs: int
    optimizer_steps_per_rollout: int
    rollouts: int | None
    lr_schedule_steps: int | None
    group_samples: bool
    derivation: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.derivation, columns=["quantity", "value", "unit", "how"])

    def __str__(self) -> str:
        width = max(len(d["quantity"]) for d in self.derivation)
        unit = max(len(d["unit"]) for d in self.derivation)
        return "\n".join(f"{d['quantity']:<{width}}  {d['value']:>8} {d['unit']:<{unit}}  {d['how']}"
                          for d in self.derivation)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(d['quantity'])}</td><td style='text-align:right'><b>{d['value']}</b></td>"
                       f"<td>{html.escape(d['unit'])}</td><td><code>{html.escape(d['how'])}</code></td></tr>"
                       for d in self.derivation)
        return ("<div><b>PPO batch plan</b><table><tr><th>quantity</th><th>value</th><th>unit</th><th>how</th></tr>"
                f"{rows}</table></div>")


def plan_ppo_batches(prompts_per_rollout: int, samples_per_prompt: int, mini_batch: "str | int | BatchSize",
                     micro_batch: "str | int | BatchSize", *, world_size: int, dp: int | None = None,
                     ppo_epochs: int = 1, rollouts: int | None = None, total_prompts: int | None = None,
                     group_samples: bool = False) -> PPOBatchPlan:
    """Derive a PPO run's batch hierarchy; raise one ``ValueError`` naming the fix for any inexact ratio.

    ``mini_batch`` and ``micro_batch``: sizes with a unit and a scope (:func:`parse_batch_size`: the unit
    is required, no scope means global). ``dp``: data-parallel degree (default ``world_size``). ``rollouts``, or
    ``total_prompts`` (prompts the run trains on, a multiple of ``prompts_per_rollout``): the number of
    rollouts, for the LR schedule's length. ``group_samples``: every mini-batch, and every rank's share of
    it, holds whole prompt groups (all n samples of a prompt), as group-normalised advantages (GRPO) need.
    """
    for name, v in (("prompts_per_rollout", prompts_per_rollout), ("samples_per_prompt", samples_per_prompt),
                    ("world_size", world_size), ("ppo_epochs", ppo_epochs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer (a zero here trains on nothing); give at least 1")
    dp = world_size if dp is None else dp
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be a positive integer; give the data-parallel degree, at most world_size")
    if world_size % dp:
        raise ValueError(f"dp={dp} does not divide world_size={world_size}; the other parallel degrees "
                         f"(tp x pp) must make up world_size / dp: choose dp in {{{', '.join(map(str, _divisors(world_size)))}}}")
    P, n, E = prompts_per_rollout, samples_per_prompt, ppo_epochs
    S = P * n
    steps: list[dict[str, Any]] = []

    def row(quantity: str, value, unit: str, how: str) -> None:
        steps.append({"quantity": quantity, "value": value, "unit": unit, "how": how})

    row("prompts per rollout", P, "prompts", "given")
    row("samples per prompt (n)", n, "samples", "given")
    row("samples per rollout", S, "samples", f"{P} prompts x {n} samples")
    row("data-parallel ranks", dp, "ranks", f"given; {world_size // dp} rank(s) (tp x pp) share each")
    if S % dp:
        raise ValueError(f"samples per rollout {S} (= {P} prompts x {n}) do not split over dp={dp} ranks; "
                         f"use prompts_per_rollout a multiple of {dp // math.gcd(dp, n)} (e.g. "
                         f"{_round_up(P, dp // math.gcd(dp, n))}) or dp = {_near(S, dp, lambda d: world_size % d == 0, k=4)}")
    row("rollout samples per rank", S // dp, "samples", f"{S} / {dp} ranks (generation share)")

    mb = parse_batch_size(mini_batch, "mini_batch")
    M = mb.value * (n if mb.unit == "prompts" else 1) * (dp if mb.scope == "rank" else 1)
    how = (f"{mb.value} prompts x {n} samples" if mb.unit == "prompts" else f"{mb.value} samples") + \
          (f" x {dp} ranks" if mb.scope == "rank" else "")
    row("mini-batch", M, "samples", f"{how} (given as '{mb}')")
    said = f"mini_batch={mb}" + ("" if (mb.unit, mb.scope) == ("samples", "global") else f" ({M} samples)")
    if M > S:
        raise ValueError(f"{said} is larger than the {S} samples of a rollout (= {P} prompts x {n}): there would be "
                         f"0 mini-batches, no optimizer step; use a mini-batch of "
                         f"{_near(S, M, lambda d: d % dp == 0)} samples (global), or more prompts per rollout")
    if S % M:
        raise ValueError(f"{said} does not divide the {S} samples of a rollout "
                         f"(= {P} prompts x {n}); PPO would drop or repeat the remainder: use a mini-batch of "
                         f"{_near(S, M, lambda d: d % dp == 0)} samples (global), or change prompts_per_rollout")
    K = S // M
    row("mini-batches per epoch", K, "steps", f"{S} / {M} samples (one optimizer step each)")
    if M % dp:
        raise ValueError(f"{said} does not split over dp={dp} ranks; use a "
                         f"mini-batch of {_near(S, M, lambda d: d % dp == 0)} samples (a multiple of {dp} dividing {S})")
    Mr = M // dp
    row("mini-batch per rank", Mr, "samples", f"{M} / {dp} ranks")
    if group_samples and Mr % n:  # whole groups on every rank (then the mini-batch holds whole groups too)
        if P % dp:  # S / (n dp) is not whole: no mini-batch can give every rank whole groups
            raise ValueError(f"group_samples: {P} prompts per rollout do not split into whole prompt groups over "
                             f"dp={dp} ranks; use prompts_per_rollout a multiple of {dp} (e.g. {_round_up(P, dp)})")
        raise ValueError(f"group_samples: each rank's {Mr} samples of {said} split the {n} samples of a "
                         f"prompt; use a mini-batch of {_near(S, M, lambda d: d % (n * dp) == 0)} samples "
                         f"(a multiple of {n} x {dp} ranks)")
    row("mini-batch in prompts", M // n if M % n == 0 else M / n, "prompts", f"{M} / {n} samples per prompt"
        + (", whole groups on every rank" if group_samples else ""))
    mc = parse_batch_size(micro_batch, "micro_batch")
    m_units = mc.value * (n if mc.unit == "prompts" else 1)
    if mc.scope == "global":
        if m_units % dp:
            raise ValueError(f"micro_batch={mc} ({m_units} samples, global) does not split over dp={dp} ranks; "
                             f"give it per rank, e.g. '{max(1, m_units // dp)} samples/rank', or a multiple of {dp}")
        m = m_units // dp
        mhow = f"{m_units} samples / {dp} ranks"
    else:
        m = m_units
        mhow = f"given as '{mc}'"
    row("micro-batch per rank", m, "samples", mhow)
    if Mr % m:
        said_m = f"micro_batch={mc}" + ("" if (mc.unit, mc.scope) == ("samples", "rank") else f" ({m} samples/rank)")
        raise ValueError(f"{said_m} does not divide the mini-batch's {Mr} samples per rank "
                         f"(= {M} / {dp}); gradient accumulation would be {Mr / m:g}, not an integer (some tools "
                         f"clamp it silently to 1): use a micro-batch of {_near(Mr, m)} samples/rank")
    A = Mr // m
    row("gradient accumulation", A, "micro-batches", f"{Mr} / {m} samples per rank, per optimizer step")
    row("PPO epochs", E, "epochs", "given")
    spr = K * E
    row("optimizer steps per rollout", spr, "steps", f"{K} mini-batches x {E} epochs")
    if total_prompts is not None:
        if isinstance(total_prompts, bool) or not isinstance(total_prompts, int) or total_prompts < 1:
            raise ValueError(f"total_prompts={total_prompts!r} must be a positive integer")
        if total_prompts % P:
            raise ValueError(f"total_prompts={total_prompts} is not a whole number of rollouts of {P} prompts "
                             f"({total_prompts / P:g}); use {total_prompts // P * P or P} or {_round_up(total_prompts, P)}")
        if rollouts is not None and rollouts != total_prompts // P:
            raise ValueError(f"rollouts={rollouts} disagrees with total_prompts={total_prompts} / {P} = "
                             f"{total_prompts // P}; give one of them")
        rollouts = total_prompts // P
        row("rollouts", rollouts, "rollouts", f"{total_prompts} prompts / {P}")
    elif rollouts is not None:
        if isinstance(rollouts, bool) or not isinstance(rollouts, int) or rollouts < 1:
            raise ValueError(f"rollouts={rollouts!r} must be a positive integer")
        row("rollouts", rollouts, "rollouts", "given")
    total = None
    if rollouts is not None:
        total = rollouts * spr
        row("LR schedule steps", total, "steps", f"{rollouts} rollouts x {spr} optimizer steps (not rollouts, "
            "not samples)")
    return PPOBatchPlan(P, n, S, world_size, dp, world_size // dp, S // dp, M, M // n if M % n == 0 else M / n,
                        K, Mr, m, A, E, spr,
                        rollouts, total, group_samples, steps)


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k
