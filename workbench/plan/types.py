"""The data of a sharding plan: what every rank holds, tensor by tensor, and what it communicates.

A :class:`ShardingPlan` is plain data. It is produced by :func:`workbench.plan` (a simulation under a
fake process group, see ``workbench.plan.simulate``), and read by the CLI, the notebook view
(``workbench.widgets.plan_view.ShardingPlanView``) and tests that compare it with a real run.

Mesh and ranks
--------------
The mesh is always ``("pp", "dp_replicate", "dp_shard", "tp")`` (``workbench.mesh``), outermost first,
dimensions of size 1 included::

    rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t          coords(rank) = (p, r, s, t)

Placements
----------
Each :class:`TensorPlan` names one placement per mesh dimension, as DTensor does:

    "R"       replicated: every coordinate holds the same data
    "S(d)"    sharded on tensor dim d, torch's even-chunk rule (below)
    "_S(d)"   FSDP2's strided shard on dim d (``_StridedShard``): the shard of an already tp-sharded
              (or ep-sharded) dim, taken *after* the inner split; it is not a ``Shard`` subclass
    "P(sum)"  partial: every coordinate holds a summand (not produced by our layouts after backward)
    "O(k)"    owned: only coordinate k holds the tensor, whole (ZeRO-1 optimizer-state partition)

Local shape rule. For "S(d)" over a mesh dimension of size n, rank coordinate c holds::

    chunk = ceil(L / n),   length_c = max(0, min(chunk, L - c * chunk)),   offset_c = c * chunk

and an empty block (length 0, e.g. 5 rows over 8 ranks) has offset L, as DTensor reports it.

The exact recipe for a tensor is its ``splits``: an ordered list of ``(tensor_dim, mesh_dim, pieces,
stride)``. Each split cuts the *current local piece* of ``tensor_dim`` into ``pieces`` even chunks and
keeps chunk ``(coords[mesh_dim] // stride) % pieces``. Order matters: FSDP2 under tp shards the
tp-local piece, so the tp split comes first and the dp_shard split second. ``stride`` expresses
sub-dimensions: with expert parallelism ``dp_shard = dp_shard_mod_ep x ep`` and a rank's ep index is
``s % ep`` (stride 1, ep pieces) while its dp_shard_mod_ep index is ``s // ep`` (stride ep).
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from workbench.config import MESH_DIMS, ModelConfig, ParallelConfig, TrainConfig
from workbench.display import RendersInNotebook
from workbench.kinds import STATE_KINDS
from workbench.units import format_bytes

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["TensorPlan", "ShardingPlan", "MESH_DIMS", "KINDS", "ITEMSIZE", "local_extents", "group_blocks"]

KINDS = STATE_KINDS  # the categories a rank holds (see workbench.kinds)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4}

Split = tuple[int, int, int, int]  # (tensor_dim, mesh_dim, pieces, stride)


def local_extents(global_shape: tuple[int, ...], splits: Iterable[Split],
                  coords: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Local lengths and global offsets of one tensor on many ranks at once.

    ``coords``: ``(n_ranks, n_mesh_dims)`` integer array. Returns two ``(n_ranks, ndim)`` int64 arrays.
    Vectorised over ranks: the cost is one numpy expression per split, whatever the world size.
    """
    coords = np.asarray(coords, dtype=np.int64).reshape(-1, len(MESH_DIMS))
    n = coords.shape[0]
    lengths = np.tile(np.asarray(global_shape, dtype=np.int64), (n, 1))
    offsets = np.zeros_like(lengths)
    for dim, mesh_dim, pieces, stride in splits:
        length = lengths[:, dim]
        c = (coords[:, mesh_dim] // stride) % pieces
        chunk = -(-length // pieces)  # ceil
        start = c * chunk
        offsets[:, dim] += np.minimum(start, length)
        lengths[:, dim] = np.clip(length - start, 0, chunk)
    for dim in {s[0] for s in splits}:  # an empty block sits at the end, as DTensor reports it
        offsets[:, dim] = np.where(lengths[:, dim] == 0, global_shape[dim], offsets[:, dim])
    return lengths, offsets


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the training state: its global shape and how the mesh splits it.

    ``kind`` is "parameter", "gradient", "optimizer" (AdamW ``exp_avg``/``exp_avg_sq``, name suffixed)
    or "master" (fp32 master weights under mixed precision, name suffixed ".master").
    """

    name: str
    kind: str
    global_shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    stage: int | None = None
    # How to compute any rank's piece (see the module docstring). Not part of the display contract.
    splits: tuple[Split, ...] = ()
    # (mesh_dim, coordinate) pairs a rank must match to hold the tensor at all: its pp stage, or the
    # dp_shard rank that owns a ZeRO-1 optimizer-state partition. Empty: every rank holds a piece.
    holders: tuple[tuple[int, int], ...] = ()
    # The parameter this tensor belongs to (== name for parameters and gradients).
    param: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def signature(self) -> tuple:
        """Everything that decides per-rank sizes (tensors with equal signatures share the arithmetic)."""
        return (self.global_shape, self.splits, self.holders)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "global_shape": list(self.global_shape),
                "dtype": self.dtype, "placements": list(self.placements), "stage": self.stage,
                "splits": [list(s) for s in self.splits], "holders": [list(h) for h in self.holders],
                "param": self.param}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TensorPlan":
        """What :meth:`to_dict` wrote, every field checked (``workbench.plan.plan_json``): one ValueError."""
        from workbench.plan.plan_json import tensor_from_dict

        return tensor_from_dict(d)


def group_blocks(blocks: pd.DataFrame) -> pd.DataFrame:
    """Group a :meth:`ShardingPlan.blocks` frame by what a rank holds (see :meth:`ShardingPlan.block_groups`)."""
    import pandas as pd

    held = blocks[blocks["state"] != "absent"]
    groups: dict[tuple, list[int]] = {}
    for rank, off, ln, state in zip(held["rank"].tolist(), held["offsets"].tolist(), held["lengths"].tolist(),
                                    held["state"].tolist()):
        groups.setdefault((tuple(off), tuple(ln), state), []).append(int(rank))
    rows = [{"offsets": off, "lengths": ln, "state": state, "ranks": tuple(sorted(r)), "replicas": len(r)}
            for (off, ln, state), r in sorted(groups.items(), key=lambda kv: kv[0])]
    frame = pd.DataFrame(rows, columns=["offsets", "lengths", "state", "ranks", "replicas"])
    frame.insert(0, "block", range(len(frame)))
    return frame


class ShardingPlan(RendersInNotebook):
    """What each rank of a layout holds (per tensor and per category) and communicates per step.

    Build one with :func:`workbench.plan`; evaluate it in a notebook to get the interactive view.

    Per-rank numbers are computed from ``tensors`` with numpy over all ranks at once, so a
    1024-rank plan of a 700-tensor model answers :meth:`rank_bytes` in milliseconds.
    """

    def __init__(self, model_name: str, parallel: ParallelConfig, train: TrainConfig,
                 tensors: list[TensorPlan], comm_rows: list[dict[str, Any]] | None = None,
                 model: ModelConfig | None = None, notes: list[str] | None = None):
        self.model_name = model_name
        self.parallel = parallel
        self.train = train
        self.model = model
        self.tensors = list(tensors)
        self.mesh_dim_names: tuple[str, ...] = MESH_DIMS
        self.mesh_shape: tuple[int, ...] = (parallel.pp, parallel.dp_replicate, parallel.dp_shard, parallel.tp)
        self.world_size: int = math.prod(self.mesh_shape)
        self._comm_rows = list(comm_rows or [])
        self.notes = list(notes or [])
        self._index = {(t.name, t.kind): t for t in self.tensors}

    # -- predicted memory (activations included) -----------------------------------------------

    def _job(self):
        from workbench.config import JobConfig

        if self.model is None:
            raise ValueError(f"plan of {self.model_name!r} was made from a model factory; predict memory from a "
                             "ModelConfig or preset (workbench.plan('small', ...))")
        return JobConfig(model=self.model, parallel=self.parallel, train=self.train)

    def predict_memory(self, device: str = "cpu", progress: bool = False):
        """The predicted memory timeline of every distinct rank (``workbench.memory.predict``): the
        plan's bytes by category plus activations, temporaries and communication buffers, over one
        real step on fake tensors. Cached per device."""
        cache = self.__dict__.setdefault("_memory", {})
        if device not in cache:
            from workbench import memory

            cache[device] = memory.predict(self._job(), device=device, progress=progress)
        return cache[device]

    def predicted_peaks(self, device: str = "cpu") -> "pd.Series":
        """Predicted peak bytes of every rank (index: rank)."""
        cache = self.__dict__.setdefault("_peaks", {})
        if device not in cache:
            from workbench import memory

            cache[device] = memory.peak_per_rank(self.predict_memory(device))
        return cache[device].copy()

    def fits(self, budget: int | float | str, device: str = "cuda", progress: bool = False,
             margin: int | float | str | None = None):
        """Does this plan's job fit in ``budget`` per rank (``"80GiB"``), and the largest micro batch that
        does (:class:`workbench.prediction.memory.FitAnswer`)? On CUDA it compares the predicted reserved
        peak plus ``margin`` (default: CUDA context + NCCL, :func:`workbench.prediction.memory.default_margin`).
        The job as planned is this plan's cached prediction (:meth:`predict_memory`), not predicted again;
        answers are cached per (budget, device, margin): the search runs several predictions."""
        from workbench import memory
        from workbench.units import parse_bytes

        key = (parse_bytes(budget), device, margin)
        cache = self.__dict__.setdefault("_fits", {})
        if key not in cache:
            cache[key] = memory.fits(self._job(), key[0], device=device, progress=progress, margin=margin,
                                     timeline=self.predict_memory(device, progress=progress))
        return cache[key]

    def _predicted(self) -> tuple[str, "pd.Series"] | None:
        """(device, peak bytes per rank) of the device predicted last, or None: exports never predict."""
        cache = self.__dict__.get("_memory") or {}
        if not cache:
            return None
        device = list(cache)[-1]
        return device, self.predicted_peaks(device)

    # -- ranks and coordinates -----------------------------------------------------------------

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinates ``(pp, dp_replicate, dp_shard, tp)`` of ``rank`` (:meth:`ParallelConfig.rank_coords`)."""
        return self.parallel.rank_coords(int(rank))

    def rank_of(self, coords: Iterable[int]) -> int:
        """Inverse of :meth:`coords`."""
        return int(np.ravel_multi_index(tuple(coords), self.mesh_shape))

    @cached_property
    def _all_coords(self) -> np.ndarray:
        return self.parallel.all_rank_coords()

    def all_coords(self) -> np.ndarray:
        """Every rank's :meth:`coords`: an int64 array ``(world_size, 4)``, row = rank."""
        return self._all_coords.copy()

    # -- one tensor ----------------------------------------------------------------------------

    def tensor(self, name: str, kind: str = "parameter") -> TensorPlan:
        try:
            return self._index[(name, kind)]
        except KeyError:
            close = [t.name for t in self.tensors if t.kind == kind and name in t.name][:5]
            raise KeyError(f"no {kind} named {name!r} in this plan" + (f"; did you mean {close}?" if close else
                           "; list names with plan.to_frame()['name']")) from None

    def local(self, name: str, rank: int, kind: str = "parameter") -> tuple[tuple, tuple] | None:
        """``(local_shape, global_offsets)`` of ``name`` on ``rank``, or None if the rank holds none of it.

        A rank holds none of a tensor when it belongs to another pipeline stage, or (ZeRO-1 optimizer
        state) another rank owns it. An empty even-chunk shard (e.g. 5 rows over 8 ranks) is still
        returned, with a zero length, as DTensor reports it.
        """
        t = self.tensor(name, kind)
        c = self.coords(rank)
        if any(c[m] != v for m, v in t.holders):
            return None
        lengths, offsets = local_extents(t.global_shape, t.splits, np.asarray([c]))
        return tuple(int(x) for x in lengths[0]), tuple(int(x) for x in offsets[0])

    def blocks(self, name: str, kind: str = "parameter") -> pd.DataFrame:
        """One row per rank: its coordinates, the block of ``name`` it holds, and that block's state.

        ``state`` is "sharded" (a proper piece), "replicated" (the whole tensor), "partial" (a summand),
        or "absent" (nothing: another stage, another owner, or an empty chunk).
        """
        import pandas as pd

        t = self.tensor(name, kind)
        coords = self._all_coords
        lengths, offsets = local_extents(t.global_shape, t.splits, coords)
        held = np.ones(len(coords), dtype=bool)
        for m, v in t.holders:
            held &= coords[:, m] == v
        local_numel = np.prod(lengths, axis=1) if lengths.shape[1] else np.ones(len(coords), dtype=np.int64)
        state = np.where(~held | (local_numel == 0), "absent",
                         np.where(local_numel == t.numel, "replicated", "sharded")).astype(object)
        if any(p.startswith("P") for p in t.placements):
            state[state != "absent"] = "partial"
        frame = pd.DataFrame({"rank": np.arange(len(coords))})
        for i, dim in enumerate(self.mesh_dim_names):
            frame[dim] = coords[:, i]
        frame["offsets"] = [tuple(int(x) for x in row) for row in offsets]
        frame["lengths"] = [tuple(int(x) for x in row) if h else tuple(0 for _ in row)
                            for row, h in zip(lengths, held)]
        frame["state"] = state
        return frame

    def block_groups(self, name: str, kind: str = "parameter") -> pd.DataFrame:
        """The distinct blocks of ``name``: one row per different (offsets, lengths, state) a rank holds.

        Columns: ``block`` (0.., in offset order), ``offsets``, ``lengths``, ``state``, ``ranks`` (sorted
        tuple), ``replicas`` (how many ranks hold that block). Ranks that hold none of it are left out, so
        a 1024-rank plan of a tp=8 tensor answers 8 rows, each naming its 128 replicas.
        """
        return group_blocks(self.blocks(name, kind))

    # -- per rank ------------------------------------------------------------------------------

    def _local_numel(self, t: TensorPlan, coords: np.ndarray) -> np.ndarray:
        lengths, _ = local_extents(t.global_shape, t.splits, coords)
        numel = np.prod(lengths, axis=1) if lengths.shape[1] else np.ones(len(coords), dtype=np.int64)
        for m, v in t.holders:
            numel = np.where(coords[:, m] == v, numel, 0)
        return numel

    @cached_property
    def _rank_arrays(self) -> dict[str, np.ndarray]:
        """Bytes per rank (int64, index = rank) of each kind and the total: what ``rank_bytes`` frames. Kept
        as arrays so that the summary and the JSON export need no pandas (``workbench plan --json``)."""
        coords = self._all_coords
        out = {k: np.zeros(self.world_size, dtype=np.int64) for k in KINDS}
        # Tensors of equal signature (80 identical layers) hold equal pieces: each signature's per-rank numel
        # is computed once and weighted by its tensors' bytes per element, kind by kind. One array of
        # world_size at a time, not one per signature: a ZeRO-1 plan has a signature per owner.
        by_signature: dict[tuple, tuple[TensorPlan, dict[str, int]]] = {}
        for t in self.tensors:
            per_kind = by_signature.setdefault(t.signature(), (t, {}))[1]
            per_kind[t.kind] = per_kind.get(t.kind, 0) + t.itemsize
        for t, per_kind in by_signature.values():
            numel = self._local_numel(t, coords)
            for kind, itemsize in per_kind.items():
                out[kind] += numel * itemsize
        out["total"] = np.sum([out[k] for k in KINDS], axis=0, dtype=np.int64)
        return out

    @cached_property
    def _rank_bytes(self) -> pd.DataFrame:
        import pandas as pd

        arrays = self._rank_arrays
        return pd.DataFrame({k: arrays[k] for k in (*KINDS, "total")},
                            index=pd.RangeIndex(self.world_size, name="rank"))

    def rank_bytes(self) -> pd.DataFrame:
        """Bytes each rank holds, by category: index ``rank``, columns parameter, gradient, optimizer,
        master, total. Steady-state training state only (see ``notes`` for what is not counted)."""
        return self._rank_bytes.copy()

    # -- communication ---------------------------------------------------------------------------

    def comm(self) -> pd.DataFrame:
        """Communication per training step, one row per (collective, mesh_dim, phase[, stage]).

        ``bytes_per_rank`` is what one rank sends per step under bandwidth-optimal (ring) algorithms,
        summed over the step's ``calls_per_step`` calls; ``tensor_bytes`` is the logical payload of one
        call. The formulas live in ``workbench.plan.comm``.
        """
        import pandas as pd

        cols = ["collective", "mesh_dim", "phase", "bytes_per_rank", "calls_per_step", "tensor_bytes",
                "group_size", "stage", "what"]
        frame = pd.DataFrame(self._comm_rows, columns=cols)
        for c in ("bytes_per_rank", "calls_per_step", "tensor_bytes", "group_size"):
            frame[c] = frame[c].astype("int64")
        return frame

    def comm_bytes_per_step(self) -> int:
        """Bytes the busiest rank sends per step (pipeline stages differ; others are all alike)."""
        common, staged = 0, {}
        for row in self._comm_rows:
            stage, b = row.get("stage"), int(row["bytes_per_rank"])
            if stage is None or (isinstance(stage, float) and math.isnan(stage)) or self.parallel.pp == 1:
                common += b  # rows with stage=None apply to every stage
            else:
                staged[stage] = staged.get(stage, 0) + b
        return common + (max(staged.values()) if staged else 0)

    # -- exports ---------------------------------------------------------------------------------

    def to_frame(self) -> pd.DataFrame:
        """One row per tensor, with rank 0's local shape (None where rank 0 holds none of it)."""
        import pandas as pd

        rank0 = self._all_coords[:1]
        rows = []
        for t in self.tensors:
            lengths, _ = local_extents(t.global_shape, t.splits, rank0)
            held = all(rank0[0, m] == v for m, v in t.holders)
            row = {"name": t.name, "kind": t.kind, "dtype": t.dtype, "global_shape": t.global_shape,
                   "numel": t.numel, "bytes": t.nbytes, "placements": t.placements}
            row.update(dict(zip(self.mesh_dim_names, t.placements)))
            row["stage"] = t.stage
            row["local_shape_rank0"] = tuple(int(x) for x in lengths[0]) if held else None
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def layout(self) -> str:
        return self.parallel.describe()

    @property
    def n_params(self) -> int:
        return sum(t.numel for t in self.tensors if t.kind == "parameter")

    def summary(self) -> dict[str, Any]:
        """The headline numbers: sizes, the worst rank per category, and communication per step."""
        rb = self._rank_arrays
        params = [t for t in self.tensors if t.kind == "parameter"]
        return {
            "model_name": self.model_name,
            "layout": self.layout,
            "world_size": self.world_size,
            "mesh": dict(zip(self.mesh_dim_names, self.mesh_shape)),
            "zero": self.parallel.zero,
            "mixed_precision": self.train.mixed_precision,
            "n_params": self.n_params,
            "n_tensors": len(params),
            "param_bytes": sum(t.nbytes for t in params),
            "max_rank_bytes": {k: int(rb[k].max()) for k in (*KINDS, "total")},
            "min_rank_bytes": {k: int(rb[k].min()) for k in (*KINDS, "total")},
            "comm_bytes_per_step": self.comm_bytes_per_step(),
            **self._predicted_summary(),
        }

    def _predicted_summary(self) -> dict[str, Any]:
        predicted = self._predicted()
        if predicted is None:
            return {}
        device, peaks = predicted
        return {"memory_device": device, "max_predicted_peak_bytes": int(peaks.max()),
                "min_predicted_peak_bytes": int(peaks.min())}

    def to_dict(self) -> dict[str, Any]:
        rb = self._rank_arrays
        return {
            "summary": self.summary(),
            "model": self.model.to_dict() if self.model is not None else None,
            "parallel": self.parallel.to_dict(),
            "train": self.train.to_dict(),
            "mesh_dim_names": list(self.mesh_dim_names),
            "mesh_shape": list(self.mesh_shape),
            "tensors": [t.to_dict() for t in self.tensors],
            "rank_bytes": {k: rb[k].tolist() for k in (*KINDS, "total")},
            "comm": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
                     for row in self._comm_rows],
            "notes": self.notes,
            **self._predicted_peaks_dict(),
        }

    def _predicted_peaks_dict(self) -> dict[str, Any]:
        predicted = self._predicted()
        if predicted is None:
            return {}
        device, peaks = predicted
        return {"memory_device": device, "predicted_peak_bytes": {int(r): int(b) for r, b in peaks.items()}}

    def to_json(self) -> str:
        """Everything, json-safe: every tensor, every rank's totals (``rank_bytes``: lists indexed by
        rank) and the communication rows; once :meth:`predict_memory` has run, also ``memory_device`` and
        ``predicted_peak_bytes`` (rank -> bytes) of the latest prediction. :meth:`from_json` reads it back
        (without the prediction)."""
        return json.dumps(self.to_dict(), default=_json_default)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "plan JSON") -> "ShardingPlan":
        """The plan :meth:`to_json` wrote. Every field is checked first (``workbench.plan.plan_json``): a
        document that is not one is a ValueError ``SOURCE: WHERE: PROBLEM; FIX`` (``source``: what to call
        the text in it, e.g. its file's name)."""
        from workbench.plan.plan_json import plan_from_json

        return plan_from_json(text, source)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "plan JSON") -> "ShardingPlan":
        """:meth:`from_json` of an already parsed document."""
        from workbench.plan.plan_json import plan_from_dict

        return plan_from_dict(doc, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ShardingPlan":
        """The plan in a plan JSON file (``workbench plan --json > plan.json``): only a regular file of a
        plan's size is read (``workbench.safeio``); one ValueError naming the file otherwise."""
        from workbench.plan.plan_json import load_plan

        return load_plan(path)

    # -- notebook --------------------------------------------------------------------------------

    def __repr__(self) -> str:
        s = self.summary()
        return (f"ShardingPlan({s['model_name']!r}, {s['layout']}, world_size={s['world_size']}, "
                f"params={s['n_params']:,}, max rank total={format_bytes(s['max_rank_bytes']['total'])})")

    def _repr_html_(self) -> str:
        """A static summary table (what nbconvert and viewers without widgets show)."""
        s = self.summary()
        rows = [("model", s["model_name"]), ("layout", s["layout"]), ("world size", s["world_size"]),
                ("parameters", f"{s['n_params']:,} ({format_bytes(s['param_bytes'])})")]
        for k in (*KINDS, "total"):
            rows.append((f"{k} per rank (max / min)",
                         f"{format_bytes(s['max_rank_bytes'][k])} / {format_bytes(s['min_rank_bytes'][k])}"))
        rows.append(("communication per step (busiest rank)", format_bytes(s["comm_bytes_per_step"])))
        body = "".join(f"<tr><th style='text-align:left'>{html.escape(str(a))}</th>"
                       f"<td style='text-align:left'>{html.escape(str(b))}</td></tr>" for a, b in rows)
        comm = self.comm()
        if not comm.empty:
            g = comm.groupby(["collective", "mesh_dim"], as_index=False)["bytes_per_rank"].sum()
            body += "".join(f"<tr><td>{html.escape(r.collective)} over {html.escape(r.mesh_dim)}</td>"
                            f"<td>{format_bytes(r.bytes_per_rank)}</td></tr>" for r in g.itertuples())
        return f"<table><caption>ShardingPlan</caption>{body}</table>"

    # _ipython_display_ (RendersInNotebook): the registered view (workbench.widgets' ShardingPlanView),
    # or _repr_html_ where ipywidgets / plotly are missing; see workbench.display.


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, tuple):
        return list(o)
    return str(o)
