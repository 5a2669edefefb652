"""Communication per training step, derived analytically from a plan and the model's shapes.

Cost model. ``bytes_per_rank`` is what one rank *sends* per step with bandwidth-optimal (ring)
algorithms over a group of ``n`` ranks, for a call whose full (gathered / reduced) payload is ``N``::

    all_gather, reduce_scatter     (n-1)/n * N
    all_reduce                     2 (n-1)/n * N        (a reduce-scatter then an all-gather)
    all_to_all                     (n-1)/n * N          (N = this rank's send buffer; the 1/n stays home)
    broadcast (ZeRO-1)             (n-1)/n * N          (N = all parameters; each rank sends its partition)
    send/recv (pipeline)           N

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

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.config import ModelConfig
from workbench.plan.types import ITEMSIZE, local_extents

if TYPE_CHECKING:
    from workbench.plan.simulate import StageSim
    from workbench.plan.types import ShardingPlan

__all__ = ["comm_rows", "ring_bytes"]

DDP_BUCKET_BYTES = 25 * 1024 * 1024


def ring_bytes(collective: str, payload: float, n: int) -> float:
    """Bytes one rank sends for one call (see the module docstring)."""
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2 * (n - 1) / n * payload
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        return (n - 1) / n * payload
    return float(payload)  # send/recv


class _Rows:
    def __init__(self) -> None:
        self._acc: dict[tuple, dict[str, Any]] = {}

    def add(self, collective: str, mesh_dim: str, phase: str, payload: float, group: int, calls: int,
            stage: int | None, what: str) -> None:
        if group <= 1 or calls <= 0 or payload <= 0:
            return
        key = (collective, mesh_dim, phase, stage, what)
        row = self._acc.setdefault(key, {"collective": collective, "mesh_dim": mesh_dim, "phase": phase,
                                         "bytes_per_rank": 0.0, "calls_per_step": 0, "tensor_bytes": 0,
                                         "group_size": group, "stage": stage, "what": what})
        row["bytes_per_rank"] += ring_bytes(collective, payload, group) * calls
        row["calls_per_step"] += calls
        row["tensor_bytes"] = max(row["tensor_bytes"], int(round(payload)))

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for row in self._acc.values():
            out.append({**row, "bytes_per_rank": int(round(row["bytes_per_rank"]))})
        return out


def comm_rows(plan: "ShardingPlan", sims: list["StageSim"], cfg: ModelConfig | None) -> list[dict[str, Any]]:
    """The rows of :meth:`ShardingPlan.comm` (one set per pipeline stage when pp > 1)."""
    par, train = plan.parallel, plan.train
    cfg = cfg or getattr(sims[0], "cfg", None)
    rows = _Rows()
    mixed = train.mixed_precision == "bf16"
    compute_size = 2 if (mixed or train.dtype == "bfloat16") else 4
    grad_size = 4 if mixed else ITEMSIZE[train.dtype]
    params = {(t.name, t.stage): t for t in plan.tensors if t.kind == "parameter"}
    pipelined = par.pp > 1
    micro = par.pp_microbatches if pipelined else train.grad_accum(par.dp)
    b_local = train.global_batch // par.dp

    for sim in sims:
        coords = np.asarray([plan.coords(sim.rank)])
        stage = sim.stage

        def local_numel(name: str) -> int:
            t = params[(name, stage)]
            lengths, _ = local_extents(t.global_shape, t.splits, coords)
            return int(np.prod(lengths[0]))

        # ---- data parallel: FSDP2 units -------------------------------------------------------
        for unit in sim.fsdp_units:
            n = unit["shard_size"]
            numel = sum(local_numel(p) for p in unit["params"]) * n  # padded unsharded size
            name = unit["name"]
            what = "experts" if name.endswith("experts") else ("blocks" if name.startswith("layers.") else "root")
            rows.add("all_gather", unit["shard_dim"], "forward", numel * compute_size, n, micro, stage,
                     f"FSDP parameters ({what})")
            if unit["reshard_after_forward"]:
                rows.add("all_gather", unit["shard_dim"], "backward", numel * compute_size, n, micro, stage,
                         f"FSDP parameters again (reshard_after_forward, {what})")
            rows.add("reduce_scatter", unit["shard_dim"], "backward", numel * grad_size, n, 1, stage,
                     f"FSDP gradients ({what})")
            if unit["replicate_dim"]:
                rows.add("all_reduce", unit["replicate_dim"], "backward", numel // n * grad_size,
                         unit["replicate_size"], 1, stage, f"HSDP gradient shards ({what})")

        # ---- data parallel: DDP / ZeRO-1 ------------------------------------------------------
        if sim.ddp_dim:
            n = par.dp_shard if sim.ddp_dim == "dp_shard" else par.dp_replicate
            total = sum(local_numel(p[0]) for p in sim.params) * grad_size
            buckets = max(1, math.ceil(total / DDP_BUCKET_BYTES))
            rows.add("all_reduce", sim.ddp_dim, "backward", total / buckets, n, buckets, stage,
                     "DDP gradients (25 MiB buckets)")
            if sim.zero1_owner:
                total_p = sum(local_numel(p[0]) for p in sim.params) * ITEMSIZE[train.dtype]
                rows.add("broadcast", sim.ddp_dim, "optimizer", total_p / n, n, n, stage,
                         "ZeRO-1 updated parameter partitions")
                # each call carries one partition; ring_bytes of N/n x n calls = (n-1)/n * N in total

        if cfg is None:
            continue  # activation traffic needs the model's dims
        n_blocks = sum(len(ls) for ls in sim.layers)
        n_moe = sim.moe_layers
        n_dense = n_blocks - n_moe
        tok = b_local * train.seq_len  # tokens per rank per step
        x = tok * cfg.dim * compute_size  # one activation, summed over micro-batches
        calls_per = micro

        # ---- tensor parallel ------------------------------------------------------------------
        tp = par.tp
        if tp > 1:
            sp = par.sequence_parallel
            per_block = 2 * n_dense + n_moe  # matmul outputs reduced per block (fwd); same count bwd
            if not sp:
                rows.add("all_reduce", "tp", "forward", x / micro, tp, per_block * calls_per, stage,
                         "TP block outputs (wo, w2)")
                rows.add("all_reduce", "tp", "backward", x / micro, tp, per_block * calls_per, stage,
                         "TP input gradients (wq/wk/wv, w1/w3)")
            else:
                for phase in ("forward", "backward"):
                    rows.add("all_gather", "tp", phase, x / micro, tp, per_block * calls_per, stage,
                             "SP sequence all-gather before attention / ffn" if phase == "forward"
                             else "SP gradient all-gather (backward of reduce-scatter)")
                    rows.add("reduce_scatter", "tp", phase, x / micro, tp, per_block * calls_per, stage,
                             "SP reduce-scatter after wo / w2" if phase == "forward"
                             else "SP input-gradient reduce-scatter (backward of all-gather)")
                norms = 2 * n_blocks + (1 if sim.has_last else 0)
                rows.add("all_reduce", "tp", "backward", cfg.dim * grad_size, tp, norms, stage,
                         "SP norm weight gradients (partial over tp)")
            if sim.has_first:
                rows.add("reduce_scatter" if sp else "all_reduce", "tp", "forward", x / micro, tp, calls_per,
                         stage, "TP embedding output")
            if sim.has_last:
                rows.add("all_gather", "tp", "forward", tok * cfg.vocab_size * compute_size / micro, tp,
                         calls_per, stage, "TP logits (output head, Replicate)")
                if sp:
                    rows.add("all_gather", "tp", "forward", x / micro, tp, calls_per, stage,
                             "SP sequence all-gather before the output head")
                    rows.add("reduce_scatter", "tp", "backward", x / micro, tp, calls_per, stage,
                             "SP output-head input gradient")
                else:
                    rows.add("all_reduce", "tp", "backward", x / micro, tp, calls_per, stage,
                             "TP output-head input gradient")

        # ---- pipeline -------------------------------------------------------------------------
        if pipelined:
            n_stages = par.pp * par.pp_stages_per_rank
            mine = [sim.stage + j * par.pp for j in range(par.pp_stages_per_rank)]
            act = x / micro / (tp if par.sequence_parallel else 1)
            for s in mine:
                if s < n_stages - 1:
                    rows.add("send/recv", "pp", "forward", act, 2, micro, stage, "PP activations to the next stage")
                if s > 0:
                    rows.add("send/recv", "pp", "backward", act, 2, micro, stage,
                             "PP input gradients to the previous stage")

        # ---- experts --------------------------------------------------------------------------
        if n_moe:
            if par.ep > 1:
                slots = tok * cfg.top_k * cfg.dim * compute_size / micro
                counts = cfg.n_experts * 8
                rows.add("all_to_all", "ep", "forward", counts, par.ep, n_moe * calls_per, stage,
                         "EP token counts per expert")
                rows.add("all_to_all", "ep", "forward", slots, par.ep, 2 * n_moe * calls_per, stage,
                         "EP token dispatch + combine (balanced routing)")
                rows.add("all_to_all", "ep", "backward", slots, par.ep, 2 * n_moe * calls_per, stage,
                         "EP gradients of dispatch + combine")
            for dim, n in (("dp_replicate", par.dp_replicate), ("dp_shard", par.dp_shard)):
                rows.add("all_reduce", dim, "forward", n_moe * cfg.n_experts * 8, n, calls_per, stage,
                         "MoE load-balancing token counts")
    return rows.rows()
