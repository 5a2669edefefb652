"""Mixture-of-experts routing in memory predictions: a measured routing, or a band from balanced to skewed.

A fake step has no data, so its router has nothing to route: by default every MoE layer spreads its
token-slots evenly over the experts (``workbench.models.moe.split_sizes``). Under expert parallelism the
rank that owns the busy experts receives more rows, and its expert matmuls, saved activations and
all-to-all buffers grow with them. Two ways to predict that::

    predict(job, routing=run)          # a measured routing: a Run, its directory, its events.jsonl,
                                       # or counts per layer (per step) -> one prediction
    predict_band(job, skew=2.0)        # no routing known: balanced (low) and a worst case (high)

**A routing table** is token-slots per expert of every MoE layer, ``counts[step][layer][expert]``, over the
whole global batch: what the trainer writes as its ``moe`` event each step. Each layer's counts become
shares ``p[l, e]``, and every rank of the simulated job routes its ``S = micro x seq x top_k`` slots of a
micro-batch as ``round(S p[l, e])`` (largest remainders, so they sum to ``S``). Every rank takes its split
from the same table, so the all-to-alls' sizes agree: rank s sends rank d what d receives from s
(``workbench.parallel.expert.simulated_splits``). Ranks of different ep index then hold different loads, and
each is simulated (``distinct_ranks(..., symmetric_routing=False)``). Of a run's steps, each rank is
predicted with the step that loads its experts most (``step=`` picks one).

**The skew** is a capacity factor ``c``: the busiest expert of a layer routes at most ``c`` times the mean
``S / E`` slots. ``c = 1`` is balanced routing; ``c`` ranges up to ``E / top_k``, where one expert is
picked by every token. The band's high end is each rank's worst case under that bound: its own experts
each at the cap (until the slots run out), the rest spread evenly over the other experts, in every layer.
That case is the same for every ep rank, so the ranks stay symmetric. The default,
:data:`DEFAULT_CAPACITY_FACTOR` = 2.0 (capped at ``E / top_k``), is the worst seen in our own runs: tiny-moe
at dp_shard=2 x ep=2 reached 1.96 by its third step (benchmarks/bench_memory.py's ep2_moe layout).
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd

from workbench.config import JobConfig
from workbench.display import RendersInNotebook
from workbench.memory.timeline import MemoryTimeline
from workbench.units import format_bytes

__all__ = ["RoutingTable", "RoutingSkew", "MemoryBand", "as_routing", "routing_from_dict", "routed",
           "predict_band", "split_slots", "DEFAULT_CAPACITY_FACTOR"]

DEFAULT_CAPACITY_FACTOR = 2.0
_COUNTS_FIX = "give counts per layer (and per step) from a run of the same model, e.g. routing=run"


def split_slots(shares: np.ndarray, slots: int) -> list[int]:
    """``slots`` split by ``shares`` (non-negative, summing to 1) into integers that sum to ``slots``:
    each takes its floor, and the largest remainders (ties: the lower index) take one more."""
    raw = np.asarray(shares, dtype=np.float64) * slots
    out = np.floor(raw).astype(np.int64)
    short = int(slots - out.sum())
    if short > 0:
        order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))
        for i in order[:short]:
            out[i] += 1
    return [int(v) for v in out]


def _ep_index(job: JobConfig, rank: int) -> int:
    """The rank's index in its ep group: its dp_shard coordinate mod ep (``parallel.expert.expert_meshes``)."""
    _, _, shard, _ = job.parallel.rank_coords(rank)
    return int(shard) % job.parallel.ep


def _local(job: JobConfig, ep_index: int) -> slice:
    n_local = job.model.n_experts // job.parallel.ep
    return slice(ep_index * n_local, (ep_index + 1) * n_local)


@dataclasses.dataclass(frozen=True, eq=False)
class RoutingTable:
    """Measured (or given) token-slots per expert: ``counts`` of shape (steps, layers, experts).

    ``step``: which step's counts to simulate (None: for each rank, the step that loads its experts most).
    """

    counts: np.ndarray
    source: str = "counts"
    step: int | None = None
    symmetric = False  # ep ranks carry different loads: each is simulated

    def check(self, job: JobConfig) -> "RoutingTable":
        """This table, if it fits ``job``'s model; else a one-line ValueError naming the mismatch."""
        m = job.model
        if not m.n_experts:
            raise ValueError(f"routing= is for a mixture-of-experts model; {m.name!r} is dense (n_experts=0)")
        steps, layers, experts = self.counts.shape
        if layers != m.n_layers:
            raise ValueError(f"routing from {self.source} has {layers} layer(s) of counts but {m.name!r} has "
                             f"{m.n_layers} MoE layers; {_COUNTS_FIX}")
        if experts != m.n_experts:
            raise ValueError(f"routing from {self.source} counts {experts} experts per layer but {m.name!r} has "
                             f"{m.n_experts}; {_COUNTS_FIX}")
        if self.step is not None and not 0 <= self.step < steps:
            raise ValueError(f"routing step={self.step}: {self.source} has steps 0..{steps - 1}")
        totals = self.counts.sum(axis=2)
        if (totals == 0).any():
            s, layer = map(int, np.argwhere(totals == 0)[0])
            raise ValueError(f"routing from {self.source}: layer {layer} routed no token-slots"
                             f"{f' at step {s}' if steps > 1 else ''}; {_COUNTS_FIX}")
        cap = 1.0 / m.top_k  # each token picks top_k distinct experts: one expert gets at most 1/top_k
        share = self.counts / totals[..., None]
        if (share > cap + 1e-9).any():
            s, layer, e = map(int, np.argwhere(share > cap + 1e-9)[0])
            raise ValueError(f"routing from {self.source}: layer {layer} sends {share[s, layer, e]:.0%} of its "
                             f"token-slots to expert {e}, but with top_k={m.top_k} one expert gets at most "
                             f"{cap:.0%}; {_COUNTS_FIX}")
        return self

    def shares(self, job: JobConfig, rank: int) -> np.ndarray:
        """(layers, experts) shares of the step simulated for ``rank``."""
        share = self.counts / self.counts.sum(axis=2, keepdims=True)
        if self.step is not None:
            return share[self.step]
        mine = share[:, :, _local(job, _ep_index(job, rank))].sum(axis=(1, 2))
        busiest = share.max(axis=2).sum(axis=1)  # ep=1 (every step equal above): the most skewed step
        best = max(range(len(share)), key=lambda s: (round(float(mine[s]), 12), float(busiest[s]), -s))
        return share[best]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "table", "counts": self.counts.tolist(), "source": self.source, "step": self.step}

    def describe(self) -> dict[str, Any]:
        return {"kind": "measured", "source": self.source, "steps": int(self.counts.shape[0]),
                "step": "busiest per rank" if self.step is None else self.step}


@dataclasses.dataclass(frozen=True)
class RoutingSkew:
    """The worst case for each rank when no expert routes more than ``capacity_factor`` x the mean."""

    capacity_factor: float = DEFAULT_CAPACITY_FACTOR
    symmetric = True  # every ep rank's worst case is the same case, seen from it

    def check(self, job: JobConfig) -> "RoutingSkew":
        m = job.model
        if not m.n_experts:
            raise ValueError(f"a routing skew is for a mixture-of-experts model; {m.name!r} is dense (n_experts=0)")
        c, top = self.capacity_factor, m.n_experts / m.top_k
        if not (isinstance(c, (int, float)) and math.isfinite(c) and 1.0 <= c <= top + 1e-9):
            raise ValueError(f"capacity factor {c!r}: choose 1 (balanced) to {top:g} (E/top_k = {m.n_experts}/"
                             f"{m.top_k}, one expert picked by every token) for {m.name!r}")
        return self

    def shares(self, job: JobConfig, rank: int) -> np.ndarray:
        m = job.model
        e = m.n_experts
        cap = min(self.capacity_factor / e, 1.0 / m.top_k)
        hot = range(e)[_local(job, _ep_index(job, rank))]
        row = np.zeros(e)
        left = 1.0
        for i in hot:
            row[i] = min(cap, left)
            left -= row[i]
        others = [i for i in range(e) if i not in hot]
        if others:
            row[others] = left / len(others)
        elif left > 1e-12:  # one ep rank holds every expert (ep=1): the rest over all of them
            row += left / e
        return np.tile(row, (m.n_layers, 1))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "skew", "capacity_factor": self.capacity_factor}

    def describe(self) -> dict[str, Any]:
        return {"kind": "skew", "capacity_factor": self.capacity_factor}


Routing = RoutingTable | RoutingSkew


def routing_from_dict(d: dict[str, Any]) -> Routing:
    """The inverse of ``to_dict()`` (how a routing travels to a prediction's worker processes)."""
    if d.get("kind") == "skew":
        return RoutingSkew(float(d["capacity_factor"]))
    return RoutingTable(np.asarray(d["counts"], dtype=np.int64), str(d.get("source", "counts")), d.get("step"))


def as_routing(value: Any, job: JobConfig) -> Routing | None:
    """A checked routing for ``job`` from what a user passes as ``routing=``: None, a RoutingTable or
    RoutingSkew, a Run, a run directory or its ``events.jsonl`` (its ``moe`` events), or counts per layer
    ``[[e0, e1, ...], ...]`` (or per step and layer). Bad input is a one-line ValueError."""
    if value is None:
        return None
    if isinstance(value, (RoutingTable, RoutingSkew)):
        return value.check(job)
    run_dir = getattr(value, "run_dir", None)  # a workbench Run
    if run_dir is not None or isinstance(value, (str, Path)):
        return _from_events(Path(run_dir if run_dir is not None else value)).check(job)
    if isinstance(value, (list, tuple, np.ndarray)):
        return RoutingTable(_counts(value, "the given counts"), "the given counts").check(job)
    raise ValueError(f"routing={type(value).__name__}: pass a Run, a run directory, its events.jsonl, or token "
                     "counts per layer ([[n_expert0, n_expert1, ...], ...])")


def _counts(value: Any, source: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"routing from {source}: counts must be a rectangular table of numbers (layers x "
                         f"experts, or steps x layers x experts); {_COUNTS_FIX}") from None
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(f"routing from {source}: counts of shape {arr.shape} are not layers x experts (or steps x "
                         f"layers x experts); {_COUNTS_FIX}")
    bad = ~np.isfinite(arr) | (arr < 0) | (arr != np.round(arr))
    if bad.any():
        s, layer, e = map(int, np.argwhere(bad)[0])
        raise ValueError(f"routing from {source}: counts must be non-negative whole numbers; layer {layer} expert "
                         f"{e}{f' at step {s}' if arr.shape[0] > 1 else ''} is {arr[s, layer, e]:g}")
    return arr.astype(np.int64)


def _from_events(path: Path) -> RoutingTable:
    """The ``moe`` events of a run directory (or of the ``events.jsonl`` named), one table per step."""
    from workbench.train.events import EVENTS_FILE, read_events

    if path.name == EVENTS_FILE and not path.is_dir():
        path = path.parent
    if not path.is_dir() or not os.path.lexists(path / EVENTS_FILE):
        raise ValueError(f"routing={str(path)!r}: not a run directory; pass the directory of a run (it holds "
                         f"{EVENTS_FILE}) or that {EVENTS_FILE}")
    events = read_events(path)  # only a regular events.jsonl inside the directory; one-line FileRefused
    by_step: dict[int, Any] = {}
    for e in events:  # every rank writes the same global counts: keep one per step
        if e.get("type") == "moe" and isinstance(e.get("step"), int):
            by_step.setdefault(e["step"], e.get("tokens_per_expert"))
    source = str(path / EVENTS_FILE)
    if not by_step:
        raise ValueError(f"{source}: no moe events (tokens per expert); pass the run of a mixture-of-experts "
                         "model that trained at least one step")
    tables = [by_step[s] for s in sorted(by_step)]
    if len({np.shape(t) for t in tables}) != 1:
        raise ValueError(f"{source}: the moe events' tables differ in shape from step to step; {_COUNTS_FIX}")
    return RoutingTable(_counts(tables, source), source)


@contextmanager
def routed(routing: Routing | None, job: JobConfig, rank: int) -> Iterator[None]:
    """While active, the fake steps of ``rank`` route as ``routing`` says (nothing changes for None)."""
    if routing is None:
        yield
        return
    from workbench.models.moe import simulated_routing

    shares = routing.shares(job, rank)

    def route(layer_id: int | None, slots: int, n_experts: int) -> list[int]:
        if layer_id is None or not 0 <= layer_id < len(shares):
            raise ValueError(f"a simulated routing needs the MoE layer's block id; got {layer_id!r}")
        return split_slots(shares[layer_id], slots)

    with simulated_routing(route):
        yield


# --------------------------------------------------------------------------------------------------
# The band: balanced routing (low) to a worst-case skew (high)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class MemoryBand(RendersInNotebook):
    """Two predictions of one MoE job: ``low`` with balanced routing, ``high`` with each rank's worst case
    under ``capacity_factor``. Evaluate it in a notebook to see the band drawn over the low timeline."""

    low: MemoryTimeline
    high: MemoryTimeline
    capacity_factor: float

    def peaks(self) -> pd.DataFrame:
        """One row per rank of the job: ``rank, low_peak, high_peak``."""
        from workbench.prediction.memory import peak_per_rank

        lo, hi = peak_per_rank(self.low), peak_per_rank(self.high)
        return pd.DataFrame({"rank": lo.index.astype(int), "low_peak": lo.to_numpy(dtype=np.int64),
                             "high_peak": hi.reindex(lo.index).to_numpy(dtype=np.int64)})

    def contains(self, measured: MemoryTimeline | dict[int, int] | pd.Series) -> pd.DataFrame:
        """Per rank of ``measured`` (a timeline, or peak bytes per rank): its peak, the band, and whether
        the peak lies inside it (``low <= measured <= high``)."""
        if isinstance(measured, MemoryTimeline):
            measured = {r: measured.peak(r).bytes for r in measured.ranks}
        band = self.peaks().set_index("rank")
        rows = []
        for r, m in dict(measured).items():
            if int(r) not in band.index:
                raise ValueError(f"rank {r} is not in this band's job (ranks 0..{len(band) - 1})")
            lo, hi = int(band.at[int(r), "low_peak"]), int(band.at[int(r), "high_peak"])
            rows.append({"rank": int(r), "measured": int(m), "band_low": lo, "band_high": hi,
                         "contains": bool(lo <= m <= hi)})
        return pd.DataFrame(rows, columns=["rank", "measured", "band_low", "band_high", "contains"])

    def summary(self) -> dict[str, Any]:
        p = self.peaks()
        return {"routing": "band", "capacity_factor": self.capacity_factor,
                "low_peak_bytes_per_rank": {str(r): int(v) for r, v in zip(p["rank"], p["low_peak"])},
                "high_peak_bytes_per_rank": {str(r): int(v) for r, v in zip(p["rank"], p["high_peak"])},
                "max_low_peak_bytes": int(p["low_peak"].max()), "max_high_peak_bytes": int(p["high_peak"].max())}

    def to_frame(self) -> pd.DataFrame:
        return self.peaks()

    def to_json(self) -> str:
        return json.dumps(self.summary())

    def __repr__(self) -> str:
        s = self.summary()
        return (f"MemoryBand({self.low.meta.get('model', '?')} [{self.low.meta.get('layout', '?')}], capacity factor "
                f"{self.capacity_factor:g}: peak {format_bytes(s['max_low_peak_bytes'])} balanced to "
                f"{format_bytes(s['max_high_peak_bytes'])} skewed)")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{r.rank}</td><td>{format_bytes(r.low_peak)}</td><td>{format_bytes(r.high_peak)}</td>"
                       f"</tr>" for r in self.peaks().itertuples())
        return (f"<p>{html.escape(repr(self))}</p><table><tr><th>rank</th><th>balanced (low)</th>"
                f"<th>skewed (high)</th></tr>{rows}</table>")


def predict_band(job: Any, *, skew: float | None = None, parallel: Any = None, train: Any = None,
                 nproc: int | None = None, **kwargs: Any) -> MemoryBand:
    """Predict ``job`` twice: balanced routing (low) and each rank's worst case with no expert above
    ``skew`` x its mean load (high; a capacity factor from 1 to E/top_k; default
    :data:`DEFAULT_CAPACITY_FACTOR`, capped at E/top_k). ``kwargs`` go to both ``predict()`` calls
    (``device``, ``progress``, ...); model settings (``tp=2``) as in ``predict()``."""
    from workbench.prediction.memory import _job, predict

    predict_keys = {"device", "ranks", "steps", "exact", "workers", "progress", "fold"}
    settings = {k: v for k, v in kwargs.items() if k not in predict_keys}
    options = {k: v for k, v in kwargs.items() if k in predict_keys}
    job = _job(job, parallel, train, nproc, **settings)
    if skew is None:
        skew = min(DEFAULT_CAPACITY_FACTOR, job.model.n_experts / job.model.top_k) if job.model.n_experts else 1.0
    high_routing = RoutingSkew(skew).check(job)
    low = predict(job, **options)
    high = predict(job, routing=high_routing, **options)
    return MemoryBand(low, high, skew)
