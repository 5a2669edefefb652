"""Communication per training step: each parallelism's formula, added up per rank.

The formulas live next to the code they describe (``fsdp_comm``/``ddp_comm`` in
``workbench.parallel.data``, ``tp_comm`` in ``.tensor``, ``pp_comm`` in ``.pipeline``, ``ep_comm`` and
``load_balance_comm`` in ``.expert``); this module only measures the simulated stages and sums the
:class:`~workbench.parallel.collectives.Collective` records they return. ``bytes_per_rank`` is what one
rank *sends* per step under ring algorithms (``workbench.parallel.collectives.ring_bytes``: for a call
whose full (gathered / reduced) payload is ``N`` over ``n`` ranks, ``(n-1)/n N``, twice that for an
all-reduce, ``N`` for a pipeline send).

Notation: ``B`` = sequences per data-parallel rank per step (``global_batch / dp``), ``S`` = seq_len,
``D`` = dim, ``V`` = vocab, ``k`` = top_k, ``m`` = micro-batches per step (gradient accumulation, or
pipeline microbatches), ``a`` = bytes per activation element (2 under bf16, else 4).

What is counted, per rank and step:

* FSDP2 / HSDP, per FSDP unit (one per block, experts, the root) with ``U`` = the unit's padded
  unsharded bytes in the compute dtype (``local shard * shard_size``):
  forward all-gather ``U`` x m; backward all-gather ``U`` x m again when the unit reshards after
  forward (zero=3); one gradient reduce-scatter of ``U`` (in the reduce dtype: fp32 under bf16) on
  the last micro-batch; under HSDP one all-reduce of the reduced shard ``U / shard_size`` over
  dp_replicate.
* DDP (zero 0/1, or dp_replicate alone): one all-reduce of all local gradients per step, in 25 MiB
  buckets. ZeRO-1 adds the broadcast of each rank's updated partition.
* Tensor parallelism, per block and micro-batch, activation ``X = B/m * S * D * a``:
  without SP, forward all-reduces after ``wo`` and ``w2`` (2X), backward all-reduces of the input
  gradients of ``wq/wk/wv`` and ``w1/w3`` (2X); MoE blocks keep experts whole, so 1 + 1.
  With SP each all-reduce becomes a reduce-scatter plus an all-gather of the same X.
  Embedding: a forward all-reduce (reduce-scatter under SP). Output head: a forward all-gather of the
  logits ``B/m * S * V * a`` and a backward all-reduce of X (under SP an all-gather of X forward and a
  reduce-scatter backward). SP norm weights: their partial gradients are all-reduced over tp.
* Pipeline: per microbatch each virtual stage sends its output activation ``X`` forward (not the last
  stage) and the input gradient backward (not the first); ``X / tp`` under SP (the stream is Shard(1)).
  Counted as the sender's bytes.
* Expert parallelism, per MoE layer and micro-batch: the counts all-to-all, token dispatch and combine
  ``B/m * S * k * D * a`` each (forward), the same two in backward; (ep-1)/ep of the slots leave the
  rank under balanced routing. Plus the load-balancing all-reduce of token counts over dp.

Not counted: gradient-norm and loss scalars, and any all-gather/reduce-scatter torch may add when
a DTensor op has no sharding rule. Under pipeline parallelism FSDP counts follow the rule above per
microbatch (an upper bound: torch.distributed.pipelining may keep units gathered between microbatches).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.config import ModelConfig, ParallelConfig, TrainConfig
from workbench.parallel.collectives import Collective
from workbench.parallel.data import ddp_comm, fsdp_comm
from workbench.parallel.expert import ep_comm, load_balance_comm
from workbench.parallel.pipeline_split import pp_comm
from workbench.parallel.tensor import tp_comm
from workbench.plan.types import ITEMSIZE, TensorPlan, local_extents

if TYPE_CHECKING:
    from workbench.plan.simulate import StageSim

__all__ = ["comm_rows"]


class _Rows:
    """Collectives summed per (collective, mesh_dim, phase, stage, what)."""

    def __init__(self) -> None:
        self._acc: dict[tuple, dict[str, Any]] = {}

    def add(self, collectives: list[Collective], stage: int | None) -> None:
        for c in collectives:
            if c.group_size <= 1 or c.calls <= 0 or c.full_bytes <= 0:
                continue
            key = (c.collective, c.mesh_dim, c.phase, stage, c.what)
            row = self._acc.setdefault(key, {"collective": c.collective, "mesh_dim": c.mesh_dim, "phase": c.phase,
                                             "bytes_per_rank": 0.0, "calls_per_step": 0, "tensor_bytes": 0,
                                             "group_size": c.group_size, "stage": stage, "what": c.what})
            row["bytes_per_rank"] += c.bytes_per_rank
            row["calls_per_step"] += c.calls
            row["tensor_bytes"] = max(row["tensor_bytes"], int(round(c.full_bytes)))

    def rows(self) -> list[dict[str, Any]]:
        return [{**row, "bytes_per_rank": int(round(row["bytes_per_rank"]))} for row in self._acc.values()]


def comm_rows(parallel: ParallelConfig, train: TrainConfig, tensors: list[TensorPlan], sims: list["StageSim"],
              cfg: ModelConfig | None) -> list[dict[str, Any]]:
    """The rows of :meth:`ShardingPlan.comm` (one set per pipeline stage when pp > 1)."""
    par = parallel
    cfg = cfg or getattr(sims[0], "cfg", None)
    rows = _Rows()
    mixed = train.mixed_precision == "bf16"
    compute_size = 2 if (mixed or train.dtype == "bfloat16") else 4
    grad_size = 4 if mixed else ITEMSIZE[train.dtype]
    params = {(t.name, t.stage): t for t in tensors if t.kind == "parameter"}
    pipelined = par.pp > 1
    micro = par.pp_microbatches if pipelined else train.grad_accum(par.dp)
    b_local = train.global_batch // par.dp

    for sim in sims:
        coords = np.asarray([par.rank_coords(sim.rank)])
        stage = sim.stage

        def local_numel(name: str) -> int:
            t = params[(name, stage)]
            lengths, _ = local_extents(t.global_shape, t.splits, coords)
            return int(np.prod(lengths[0]))

        for unit in sim.fsdp_units:  # padded unsharded size = local shard x shard size
            numel = sum(local_numel(p) for p in unit["params"]) * unit["shard_size"]
            rows.add(fsdp_comm(unit, numel, micro, compute_size, grad_size), stage)
        if sim.ddp_dim:
            n = par.dp_shard if sim.ddp_dim == "dp_shard" else par.dp_replicate
            local = sum(local_numel(p.name) for p in sim.params)
            rows.add(ddp_comm(sim.ddp_dim, n, local * grad_size, local * ITEMSIZE[train.dtype],
                              bool(sim.zero1_owner)), stage)
        if cfg is None:
            continue  # activation traffic needs the model's dims
        n_blocks = sum(len(ls) for ls in sim.layers)
        n_moe = sim.moe_layers
        tok = b_local * train.seq_len  # tokens per rank per step
        act = tok * cfg.dim * compute_size / micro  # one micro-batch's activation
        rows.add(tp_comm(par.tp, par.sequence_parallel, n_blocks - n_moe, n_moe, sim.has_first, sim.has_last,
                         act, tok * cfg.vocab_size * compute_size / micro, cfg.dim * grad_size, micro), stage)
        if pipelined:
            v = par.pp_stages_per_rank
            mine = [sim.stage + j * par.pp for j in range(v)]
            rows.add(pp_comm(mine, par.pp * v, act / (par.tp if par.sequence_parallel else 1), micro), stage)
        rows.add(ep_comm(par.ep, n_moe, cfg.n_experts, tok * cfg.top_k * cfg.dim * compute_size / micro, micro),
                 stage)
        rows.add(load_balance_comm({"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard}, n_moe,
                                   cfg.n_experts, micro), stage)
    return rows.rows()
