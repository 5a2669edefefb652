"""One build path for real and simulated runs: a job's model, from the meta device to this rank's shards.

The trainer, the plan simulation (``workbench.plan``), the live plan check and the load dry run all
build through :func:`build_stages`, so a plan and a run cannot drift apart::

    model  = Transformer(cfg) on "meta"            shapes and dtypes, no storage (cast to train.dtype)
    stages = this rank's pipeline stages           pp > 1: split_layers / stage_ids / build_stage_module
    each   = shard(stage)                          TP, activation checkpointing, EP, FSDP2, still on meta
    device == "meta": stop here                    a plan reads shapes and placements
    else   stage.to_empty(device)                  allocates this rank's local blocks only
           block := piece of initial_value(name)   one whole parameter at a time, on the CPU
    DDP last                                       it broadcasts real weights (on meta: no rank sync)

A rank never holds the whole model: its peak during the build is its own shards plus one whole
parameter. Every layout still starts from the same weights as ``build_model(cfg, seed)`` on one
process, because each parameter's value is a function of ``(seed, name)`` alone
(``workbench.models.llama.initial_value``) and each rank copies the block DTensor assigns it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from workbench import compat
from workbench.config import ModelConfig, ParallelConfig, TrainConfig
from workbench.models import build_model
from workbench.models.llama import Transformer, initial_value
from workbench.parallel.apply import build_optimizer, ddp_dim, shard
from workbench.parallel.compile import compile_blocks
from workbench.parallel.data import apply_ddp
from workbench.parallel.pipeline_split import build_stage_module, split_layers, stage_ids

__all__ = ["Stages", "build_stages", "build_optimizer", "param_name"]

_AC_PREFIX = "_checkpoint_wrapped_module."


@dataclass
class Stages:
    """This rank's part of a job's model: its pipeline stage modules, parallelized, on one device.

    Without pipeline parallelism there is one module, the whole (sharded) model, and ``model`` is it;
    with it ``model`` is a ``ModuleList`` of this rank's stages (one, or v under Interleaved1F1B).
    """

    modules: list[nn.Module]
    stage_ids: list[int]           # the pipeline stage of each module ([0] when pp == 1)
    layers: list[list[int]]        # the layer ids of each module
    n_stages: int
    device: torch.device
    cfg: ModelConfig | None = None
    model: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.model = self.modules[0] if self.n_stages == 1 else nn.ModuleList(self.modules)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def optimizer(self, parallel: ParallelConfig, mesh: DeviceMesh | None,
                  train: TrainConfig) -> torch.optim.Optimizer:
        """The run's AdamW over these stages (ZeRO-1 partitioned under zero=1)."""
        return build_optimizer(self.model, parallel, mesh, train)


def param_name(name: str) -> str:
    """A parameter's name in the unparallelized model (without DDP's and activation checkpointing's
    wrapper prefixes): the key of its initial value, its checkpoint key and its plan name."""
    return name.replace(_AC_PREFIX, "").removeprefix("module.")


def build_stages(model: ModelConfig | Callable[[], nn.Module], parallel: ParallelConfig, train: TrainConfig,
                 mesh: DeviceMesh | None, device: torch.device | str = "meta", *,
                 pp_rank: int | None = None) -> Stages:
    """Build this rank's stages of ``model`` laid out by ``parallel``, on ``device``.

    ``model``: a ModelConfig, or a zero-argument factory of an ``nn.Module`` shaped like
    ``workbench.models.Transformer`` (built under the meta device; it can only be planned).
    ``mesh``: the job's DeviceMesh (None on one process). ``device="meta"`` stops before allocating
    anything; a real device materializes this rank's shards initialised from ``train.seed``.
    ``pp_rank``: the pipeline coordinate to build (default: this rank's, read from ``mesh``).
    """
    device = torch.device(device)
    cfg = model if isinstance(model, ModelConfig) else None
    if cfg is None and device.type != "meta":
        raise ValueError("a model factory can only be planned (device='meta'); pass a ModelConfig to build "
                         "real weights")
    # Everything on meta runs outside any dispatch mode: meta tensors are not memory, so a memory
    # recorder has nothing to see until materialize, and under FakeTensorMode (memory prediction) the
    # model stays a plain meta model, which to_empty then turns into fake tensors.
    with compat.outside_dispatch_modes():
        parts, ids, layers, n_stages = _meta_stages(cfg, model, parallel, train, mesh, pp_rank)
        parts = [shard(part, parallel, mesh, train) for part in parts]
    modules = []
    for part in parts:
        if device.type != "meta":
            materialize(part, cfg, train.seed, device)
            if train.compile and not compat.in_fake_mode():  # real weights only: a plan or a prediction runs eager
                compile_blocks(part, fullgraph=cfg.n_experts == 0)
        dim = ddp_dim(parallel) if mesh is not None else None
        if dim is not None:
            # Meta and fake tensors (a plan; a memory prediction) have no values to check or broadcast.
            part = _ddp(part, mesh[dim], no_values=device.type == "meta" or compat.in_fake_mode())
        modules.append(part)
    return Stages(modules, ids, layers, n_stages, device, cfg)


def _meta_stages(cfg: ModelConfig | None, model, parallel: ParallelConfig, train: TrainConfig,
                 mesh: DeviceMesh | None, pp_rank: int | None):
    """This rank's unsharded stage modules on meta: (modules, stage ids, layer ids, number of stages)."""
    with torch.device("meta"):
        whole = build_model(cfg, seed=None, device="meta") if cfg is not None else model()
    if train.dtype == "bfloat16":
        whole = whole.to(torch.bfloat16)
    n_layers = cfg.n_layers if cfg is not None else len(whole.layers)
    if parallel.pp == 1:
        return [whole], [0], [list(range(n_layers))], 1
    v = parallel.pp_stages_per_rank
    n_stages = parallel.pp * v
    split = split_layers(n_layers, n_stages)
    if pp_rank is None:
        pp_rank = mesh["pp"].get_local_rank()
    ids = stage_ids(pp_rank, parallel.pp, v)
    # Copies of a meta model cost nothing; the last stage prunes the model itself.
    parts = [build_stage_module(whole, split[s], first=s == 0, last=s == n_stages - 1,
                                in_place=j == len(ids) - 1) for j, s in enumerate(ids)]
    return parts, ids, [split[s] for s in ids], n_stages


def materialize(module: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> nn.Module:
    """Allocate ``module``'s local blocks on ``device`` and fill them with their initial values.

    Each parameter's whole value is made on the CPU, one parameter at a time, and this rank keeps the
    block its DTensor placements give it (DTensor's own local shape and global offset); a plain
    tensor keeps all of it. The rotary tables are recomputed.
    """
    ties = _ties(module)
    module.to_empty(device=device)
    # to_empty gives every module its own new Parameter, so a shared one (tie_embeddings: the output layer
    # reads tok_embeddings' weight) would train as two, the output with an init of its own. Share again.
    for (owner, name), *others in ties:
        for m, n in others:
            setattr(m, n, getattr(owner, name))
    offsets = compat.get("compute_local_shape_and_global_offset")
    with torch.no_grad():
        for name, p in module.named_parameters():
            whole = initial_value(cfg, param_name(name), tuple(p.shape), seed)
            if isinstance(p, DTensor):
                # torch computes the offset with small tensors and reads them back with int(): under
                # FakeTensorMode (memory prediction) they must be real ones.
                with compat.outside_dispatch_modes():
                    shape, offset = offsets(p.shape, p.device_mesh, p.placements)
                block = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
                compat.local_tensor(p).copy_(block)
            else:
                p.copy_(whole)
        for m in module.modules():
            if isinstance(m, Transformer):
                m.init_buffers()
    return module


def _ties(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The parameters registered on more than one (module, name): one list of places per shared one."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for n, p in m.named_parameters(recurse=False):
            places.setdefault(id(p), []).append((m, n))
    return [v for v in places.values() if len(v) > 1]


def _ddp(module: nn.Module, dp_mesh: DeviceMesh, no_values: bool) -> nn.Module:
    if not no_values:
        return apply_ddp(module, dp_mesh)
    # DDP's constructor checks shapes across ranks and broadcasts rank 0's weights; meta and fake
    # tensors have no values to read. Nothing else in DDP is skipped.
    with compat.ddp_without_rank_sync(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return apply_ddp(module, dp_mesh)
