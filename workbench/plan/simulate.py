"""Simulate a layout on one process: the real parallelization code, a fake process group, meta tensors.

How a 1024-rank plan is made on a laptop::

    dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=1024)   # no peers, no traffic
    mesh   = build_mesh(parallel)                         # the same DeviceMesh a real run builds
    stages = build_stages(cfg, parallel, train, mesh, "meta")   # the trainer's build, left on meta:
                                                          # this pp rank's stages, TP, EP, FSDP2 / DDP
    opt    = stages.optimizer(parallel, mesh, train)      # AdamW or ZeRO-1's partitioned optimizer

Rank ``r`` sees its own shard, but DTensor placements describe every rank's: from a parameter's
placements (e.g. ``(_StridedShard(0, sf=8), Shard(0))`` on ``(dp_shard, tp)``) we derive the ordered
``splits`` of :mod:`workbench.plan.types`, which give any rank's local shape and offsets with numpy.
Under pipeline parallelism the stage a rank builds depends on its pp coordinate, so stage ``p`` is
simulated as rank ``p * world / pp`` (``workbench.parallel.pipeline``'s split, stage by stage).
Blocks of a stage are alike, so the build makes one block per distinct stage position and copies
its findings to every layer it stands for (``workbench.plan.reuse``: llama-70b's 80 blocks build as
1; the 1024-rank plan went from ~1 s to ~0.1 s of CPU after imports).

What is modelled per parameter ``W`` (shape and placements shared by all four kinds):

    parameter     W in the compute dtype: train.dtype, or bfloat16 under mixed_precision="bf16"
    master        mixed_precision="bf16" only: the float32 weights the optimizer steps (FSDP2's
                  sharded parameters; autocast's float32 parameters)
    gradient      float32 under bf16 mixed precision (FSDP2 reduce_dtype / autocast), else train.dtype.
                  Placements: the parameter's under FSDP2 (it reduce-scatters into the shard) and DDP;
                  a tensor-parallel parameter outside FSDP gets what backward gives it, found by one
                  meta forward/backward (TP alone: the embedding's gradient is Replicate, whole)
    optimizer     AdamW exp_avg and exp_avg_sq, in the (master) parameter dtype. ``step`` is a scalar
                  per tensor and is not counted. Under ZeRO-1 each is held whole by its owner rank.

Under bf16 the ``parameter`` rows are the bf16 copy of each rank's shard that FSDP2 (or autocast)
casts for compute. A real run makes them one FSDP unit at a time, so the ``parameter`` column is an
upper bound on what is live at once; the float32 ``master`` is what persists. Not modelled:
activations, all-gathered (unsharded) parameters, DDP's gradient buckets, allocator fragmentation.

A real process group already initialised in this process (a notebook running a job) cannot coexist
with the fake one, so then the simulation runs in a fresh subprocess (``python -m
workbench.plan.simulate``) and its plan comes back as JSON. Model factories cannot cross a process
boundary: that case raises, asking to pass a ModelConfig or call from a process without a group.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from workbench.config import ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.plan.reuse import Representatives, expand_units, rename_layer, representatives
from workbench.plan.types import MESH_DIMS, ShardingPlan, Split, TensorPlan

__all__ = ["plan", "fake_world", "describe_placements"]



# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def _resolve_model(model) -> tuple[str, ModelConfig | None, ModelConfig | Callable[[], nn.Module]]:
    """(name, config or None, what ``build_stages`` builds: the config, or the zero-argument factory)."""
    if callable(model) and not isinstance(model, (str, ModelConfig)):
        name = getattr(model, "__name__", type(model).__name__)
        return name, None, model
    cfg = resolve_model(model)
    return cfg.name, cfg, cfg


def _default_train(parallel: ParallelConfig) -> TrainConfig:
    """TrainConfig() with global_batch raised to the smallest multiple of dp (x microbatches) >= 8."""
    unit = parallel.dp * (parallel.pp_microbatches if parallel.pp > 1 else 1)
    base = TrainConfig()
    return dataclasses.replace(base, global_batch=unit * max(1, -(-base.global_batch // unit)))


def _resolve_train(train_shape, parallel: ParallelConfig) -> TrainConfig:
    if train_shape is None:
        return _default_train(parallel)
    if isinstance(train_shape, TrainConfig):
        return train_shape
    if isinstance(train_shape, dict):
        return TrainConfig.from_dict(train_shape)
    raise TypeError(f"train_shape={train_shape!r}: pass a TrainConfig or a dict like "
                    "{'global_batch': 1024, 'seq_len': 4096}")


# --------------------------------------------------------------------------------------------------
# The fake world
# --------------------------------------------------------------------------------------------------


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks seen from ``rank``; destroyed on exit.

    Collectives on it return at once without moving data, which is all meta tensors need.
    """
    from workbench.compat import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rankN]:"; a notebook keeps the plain one
    # DTensor warns "CPU process group does not support alltoall yet" on any CPU mesh: true of gloo, not
    # news on a fake group, whose all_gather fallback is what gets counted (workbench.spmd.comm says so).
    redistribute_log = logging.getLogger("torch.distributed.tensor._collective_utils")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
        redistribute_log.setLevel(level)
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions. They hold DeviceMesh objects, and a mesh compares
    equal to one of a later fake world, whose process groups have other names: a cache hit would then
    name a destroyed group."""
    from workbench import compat

    compat.clear_sharding_caches()


@contextmanager
def _spmd_rules(train: TrainConfig) -> Iterator[None]:
    """Our DTensor sharding rules for the simulation's duration, as the job would install them
    (``TrainConfig.spmd_rules``); DTensor is left as it was afterwards."""
    if not train.spmd_rules:
        yield
        return
    from workbench.spmd import our_rules

    with our_rules():
        yield


# --------------------------------------------------------------------------------------------------
# Placements -> splits
# --------------------------------------------------------------------------------------------------


def _mesh_dim(name: str, parallel: ParallelConfig) -> tuple[int, int]:
    """(index in MESH_DIMS, stride) of a DTensor mesh dimension. Expert parallelism unflattens
    dp_shard into (dp_shard_mod_ep, ep): ep index = s % ep, dp_shard_mod_ep index = s // ep."""
    if name in MESH_DIMS:
        return MESH_DIMS.index(name), 1
    if name == "ep":
        return MESH_DIMS.index("dp_shard"), 1
    if name == "dp_shard_mod_ep":
        return MESH_DIMS.index("dp_shard"), parallel.ep
    raise NotImplementedError(f"mesh dimension {name!r} is unknown to the planner; "
                              f"expected one of {MESH_DIMS + ('ep', 'dp_shard_mod_ep')}")


def describe_placements(param: torch.Tensor, parallel: ParallelConfig) -> tuple[tuple[str, ...], tuple[Split, ...]]:
    """Placement strings per plan mesh dimension, and the ordered splits that reproduce the shards.

    DTensor reads placements left to right, except FSDP2's ``_StridedShard(d, split_factor=k)``: it
    shards the piece left after the ``k``-way split by the mesh dimensions to its right (TP, or EP for
    experts). So plain ``Shard`` splits go first, in mesh order, and strided ones after them.
    """
    from torch.distributed.tensor import DTensor
    from workbench.compat import StridedShard as _StridedShard

    if not isinstance(param, DTensor):
        return ("R",) * len(MESH_DIMS), ()
    mesh = param.device_mesh
    subs: list[list[str]] = [[] for _ in MESH_DIMS]
    splits: list[Split] = []
    strided: list[tuple[Split, int]] = []
    for name, size, pl in zip(mesh.mesh_dim_names, mesh.shape, param.placements):
        i, stride = _mesh_dim(name, parallel)
        if size == 1:
            continue
        if isinstance(pl, _StridedShard):
            subs[i].append(f"_S({pl.dim})")
            strided.append(((pl.dim, i, size, stride), pl.split_factor))
        elif pl.is_shard():
            subs[i].append(f"S({pl.dim})")
            splits.append((pl.dim, i, size, stride))
        elif pl.is_partial():
            subs[i].append(f"P({getattr(pl, 'reduce_op', 'sum')})")
        else:
            subs[i].append("R")
    for split, factor in strided:
        inner = int(np.prod([n for d, _, n, _ in splits if d == split[0]] or [1]))
        if inner != factor:
            raise NotImplementedError(f"_StridedShard(dim={split[0]}, split_factor={factor}) after a {inner}-way "
                                      "split is not a layout the planner knows")
        splits.append(split)
    return tuple(_combine(s) for s in subs), tuple(splits)


def _combine(subs: list[str]) -> str:
    """One string for a plan mesh dimension made of sub-dimensions (dp_shard = dp_shard_mod_ep x ep)."""
    real = [s for s in subs if s != "R"]
    if not real:
        return "R"
    if len(set(s.lstrip("_") for s in real)) == 1:
        return real[0] if len(real) == 1 else ("_" + real[0].lstrip("_"))
    return "+".join(real)


# --------------------------------------------------------------------------------------------------
# One stage (the whole model when pp == 1)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamSim:
    """One parameter as the simulation found it: global shape, dtype, and how the mesh splits it and
    its gradient (which differs from the parameter's only for a tensor-parallel parameter outside FSDP)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    splits: tuple[Split, ...]
    grad_placements: tuple[str, ...]
    grad_splits: tuple[Split, ...]


@dataclasses.dataclass
class StageSim:
    """What the simulation of one pp coordinate found: its tensors' placements and its comm units."""

    stage: int | None
    rank: int
    layers: list[list[int]]                      # layer ids per virtual stage on this pp rank
    params: list[ParamSim]
    fsdp_units: list[dict[str, Any]]
    ddp_dim: str | None
    zero1_owner: dict[str, int]                  # fqn -> dp_shard coordinate owning its optimizer state
    moe_layers: int
    has_first: bool
    has_last: bool
    cfg: ModelConfig | None = None               # the built model's config, if it carries one


def _strip(name: str) -> str:
    return name[len("module."):] if name.startswith("module.") else name


def _fsdp_units(modules: list[nn.Module]) -> list[dict[str, Any]]:
    """Every FSDP2 parameter group: its parameters, shard/replicate groups, and resharding."""
    from torch.distributed.fsdp import FSDPModule
    from workbench import compat
    from workbench.compat import HSDPMeshInfo

    units = []
    for root in modules:
        names = {id(p): _strip(n) for n, p in root.named_parameters()}
        for mod_name, mod in root.named_modules():
            if not isinstance(mod, FSDPModule):
                continue
            for group in compat.fsdp_param_groups(mod):
                info = group.mesh_info
                dim_names = info.mesh.mesh_dim_names
                units.append({
                    "name": _strip(mod_name) or "<root>",
                    "params": [names[id(fp.sharded_param)] for fp in group.fsdp_params],
                    "shard_dim": dim_names[info.shard_mesh_dim], "shard_size": info.shard_mesh_size,
                    "replicate_dim": dim_names[info.replicate_mesh_dim] if isinstance(info, HSDPMeshInfo) else None,
                    "replicate_size": info.replicate_mesh_size if isinstance(info, HSDPMeshInfo) else 1,
                    "reshard_after_forward": group.post_forward_mesh_info is not None,
                })
    return units


def _probe_grads(modules: list[nn.Module], units: list[dict[str, Any]],
                 parallel: ParallelConfig) -> dict[str, tuple[tuple[str, ...], tuple[Split, ...]]]:
    """Gradient placements of tensor-parallel parameters that no FSDP unit manages.

    FSDP2 gives every gradient its sharded parameter's placements, and DDP's are plain tensors, but a
    DTensor parameter outside FSDP gets whatever its backward's sharding rule produces: under TP alone
    the row-parallel embedding's gradient comes back ``Replicate`` (whole on every tp rank), not
    ``Shard(0)``. So those layouts run one forward and backward on meta tensors (1 sequence of
    ``max(2, tp)`` tokens; FSDP2 refuses meta training, but it is not involved here) and read the
    gradients' placements.
    """
    from torch.distributed.tensor import DTensor

    managed = {p for u in units for p in u["params"]}
    loose = [(m, _strip(n), p) for m in modules for n, p in m.named_parameters()
             if isinstance(p, DTensor) and _strip(n) not in managed]
    if not loose:
        return {}
    seq = max(2, parallel.tp)
    for m in modules:
        if getattr(m, "tok_embeddings", None) is not None:
            x = torch.zeros((1, seq), dtype=torch.long, device="meta")
        else:  # a later pipeline stage: hidden states (a sequence slice under SP)
            dim = m.cfg.dim if hasattr(m, "cfg") else next(p for p in m.parameters() if p.dim() == 2).shape[1]
            local = seq // parallel.tp if parallel.sequence_parallel else seq
            dtype = next(m.parameters()).dtype
            x = torch.zeros((1, local, dim), dtype=dtype, device="meta", requires_grad=True)
        m(x).float().sum().backward()
    out = {}
    for _, name, p in loose:
        if p.grad is not None:
            out[name] = describe_placements(p.grad, parallel)
            p.grad = None
    return out


def _simulate_stage(source: ModelConfig | Callable[[], nn.Module], parallel: ParallelConfig,
                    train: TrainConfig, pp_index: int | None, reps: Representatives | None = None) -> StageSim:
    """Simulate pp coordinate ``pp_index`` (None: pp == 1). With ``reps`` the build makes the reduced
    model (``workbench.plan.reuse``) and its blocks' findings are copied to the layers they stand for."""
    from torch.nn.parallel import DistributedDataParallel

    from workbench.mesh import build_mesh
    from workbench.parallel.build import build_stages

    world = parallel.world_size
    rank = 0 if pp_index is None else pp_index * (world // parallel.pp)
    with fake_world(world, rank), _spmd_rules(train):
        mesh = build_mesh(parallel, "cpu") if world > 1 else None
        # The trainer's own build, stopped on the meta device.
        stages = build_stages(reps.model if reps else source, parallel, train, mesh, "meta", pp_rank=pp_index or 0)
        modules, layers = stages.modules, stages.layers
        first, last = stages.has_first, stages.has_last
        units = _fsdp_units(modules)
        grads = _probe_grads(modules, units, parallel)
        opt = stages.optimizer(parallel, mesh, train)
        names = {id(p): _strip(n) for m in modules for n, p in m.named_parameters()}
        owner: dict[str, int] = {}
        from workbench import compat

        partition = compat.zero_partition(opt)
        if partition is not None:  # ZeRO-1: whole tensors assigned to dp_shard ranks
            for r, groups in enumerate(partition):
                for g in groups:
                    for p in g["params"]:
                        owner[names[id(p)]] = r
        params = []
        for m in modules:
            for n, p in m.named_parameters():
                placements, splits = describe_placements(p, parallel)
                fqn = _strip(n)
                g_placements, g_splits = grads.get(fqn, (placements, splits))
                params.append(ParamSim(fqn, tuple(p.shape), str(p.dtype).removeprefix("torch."), placements,
                                       splits, g_placements, g_splits))
        ddp_dim = None
        if isinstance(modules[0], DistributedDataParallel):
            ddp_dim = "dp_shard" if parallel.dp_shard > 1 else "dp_replicate"
        from workbench.models.moe import MoEFeedForward

        moe = [_strip(n) for m in modules for n, x in m.named_modules() if isinstance(x, MoEFeedForward)]
        cfg = stages.cfg or getattr(getattr(modules[0], "module", modules[0]), "cfg", None)
        if reps is None:
            return StageSim(pp_index, rank, layers, params, units, ddp_dim, owner, len(moe), first, last, cfg)
        params = reps.expand(params, lambda ps: ps.name,
                             lambda ps, i: dataclasses.replace(ps, name=rename_layer(ps.name, i)))
        return StageSim(pp_index, rank, reps.real_layers(layers), params, expand_units(reps, units), ddp_dim,
                        owner, sum(reps.weight(n) for n in moe), first, last, reps.real)


# --------------------------------------------------------------------------------------------------
# Tensors of the plan
# --------------------------------------------------------------------------------------------------


def _tensors(sims: list[StageSim], train: TrainConfig) -> list[TensorPlan]:
    mixed = train.mixed_precision == "bf16"
    dp_shard = MESH_DIMS.index("dp_shard")
    out: list[TensorPlan] = []
    for sim in sims:
        stage_holder = () if sim.stage is None else ((0, sim.stage),)
        for ps in sim.params:
            name, dtype, placements = ps.name, ps.dtype, ps.placements
            common = dict(global_shape=ps.shape, placements=placements, stage=sim.stage, splits=ps.splits,
                          holders=stage_holder, param=name)
            grad = dict(common, placements=ps.grad_placements, splits=ps.grad_splits)
            compute = "bfloat16" if mixed else dtype
            state = "float32" if mixed else dtype
            out.append(TensorPlan(name=name, kind="parameter", dtype=compute, **common))
            if mixed:
                out.append(TensorPlan(name=name + ".master", kind="master", dtype="float32", **common))
            out.append(TensorPlan(name=name, kind="gradient", dtype=state, **grad))
            opt = dict(common)
            if name in sim.zero1_owner:
                k = sim.zero1_owner[name]
                pl = list(placements)
                pl[dp_shard] = f"O({k})"
                opt.update(placements=tuple(pl), holders=stage_holder + ((dp_shard, k),))
            for suffix in (".exp_avg", ".exp_avg_sq"):
                out.append(TensorPlan(name=name + suffix, kind="optimizer", dtype=state, **opt))
    return out


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def plan(model, parallel_config: ParallelConfig, train_shape: TrainConfig | dict | None = None, *,
         reuse_blocks: bool = True) -> ShardingPlan:
    """Simulate ``model`` laid out by ``parallel_config`` on ``parallel_config.world_size`` ranks.

    ``model``: a preset name ("llama-70b"), a path to a Hugging Face config.json, a ModelConfig, or a
    zero-argument factory returning an ``nn.Module`` (built under ``torch.device("meta")``; it must
    look like ``workbench.models.Transformer``: a ``layers`` ModuleDict of blocks).
    ``train_shape``: a TrainConfig, or a dict of its fields (``global_batch``, ``seq_len``,
    ``micro_batch``, ``mixed_precision``, ...). Default: ``TrainConfig()`` with ``global_batch``
    rounded up to a multiple of the data-parallel degree (and of the pipeline microbatches).

    ``reuse_blocks``: build one block per distinct stage position and copy its findings to the layers it
    stands for (``workbench.plan.reuse``); False builds every block (the same plan, slower).

    Raises ``ValueError`` (one line: the problem and the fix) for layouts a real run would reject.
    """
    from workbench.plan.comm import comm_rows

    if not isinstance(parallel_config, ParallelConfig):
        raise TypeError(f"parallel_config must be a ParallelConfig, not {type(parallel_config).__name__}")
    from workbench import compat

    parallel = parallel_config.resolved() if parallel_config.dp_shard == -1 else parallel_config
    compat.require("plan.zero1" if parallel.zero == 1 and parallel.dp_shard > 1 else "plan.simulate",
                   "a sharding plan", "use a torch release that has it (2.11 to 2.13 do; "
                   "`workbench doctor` lists what this one lacks)")
    name, cfg, build = _resolve_model(model)
    train = _resolve_train(train_shape, parallel)
    if cfg is not None:
        validate(cfg, parallel, train)
    if dist.is_initialized():
        if cfg is None:
            raise RuntimeError("a process group is already initialised here, and a model factory cannot be "
                               "simulated in a subprocess; pass a ModelConfig or preset name instead")
        return _plan_in_subprocess(cfg, parallel, train)

    from workbench.progress import tqdm

    reps = representatives(cfg, parallel, train) if reuse_blocks else None
    if parallel.pp == 1:
        sims = [_simulate_stage(build, parallel, train, None, reps)]
    else:
        sims = [_simulate_stage(build, parallel, train, p, reps)
                for p in tqdm(range(parallel.pp), desc=f"simulating {parallel.pp} pipeline stages",
                              leave=False, disable=None)]
    tensors = _tensors(sims, train)
    return ShardingPlan(name, parallel, train, tensors, comm_rows=comm_rows(parallel, train, tensors, sims, cfg),
                        model=cfg, notes=list(NOTES))


NOTES = (
    "rank_bytes counts parameters, gradients, AdamW exp_avg/exp_avg_sq and fp32 master weights; not "
    "activations, all-gathered parameters, AdamW step scalars, DDP gradient buckets or allocator overhead",
    "under mixed_precision='bf16', 'parameter' is the bf16 compute copy of each rank's shard (made one FSDP "
    "unit at a time in a real run: an upper bound) and 'master' the fp32 weights the optimizer steps",
    "comm: bytes each rank sends per step under ring algorithms; TP/SP/EP/PP activation traffic assumes "
    "balanced expert routing; grad-norm and loss-logging scalars are not counted",
)


def _plan_in_subprocess(cfg: ModelConfig, parallel: ParallelConfig, train: TrainConfig) -> ShardingPlan:
    request = json.dumps({"model": cfg.to_dict(), "parallel": parallel.to_dict(), "train": train.to_dict()})
    proc = subprocess.run([sys.executable, "-m", "workbench.plan.simulate"], input=request, text=True,
                          capture_output=True, timeout=600)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the plan subprocess failed: {tail}")
    return ShardingPlan.from_json(proc.stdout)


def _main() -> None:
    """``python -m workbench.plan.simulate``: read {model, parallel, train} JSON on stdin, print the plan."""
    req = json.loads(sys.stdin.read())
    result = plan(ModelConfig.from_dict(req["model"]), ParallelConfig.from_dict(req["parallel"]),
                  TrainConfig.from_dict(req["train"]))
    sys.stdout.write(result.to_json())


if __name__ == "__main__":
    _main()
