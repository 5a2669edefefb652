"""Run a job's real training steps on one rank of any world size, with fake tensors and a fake process group.

What the memory predictor runs for each distinct rank (:func:`distinct_ranks`)::

    fake process group of world_size ranks, seen from rank r      collectives return at once
    mesh = build_mesh(parallel, device)                            the run's own DeviceMesh
    FakeTensorMode(allow_non_fake_inputs=True)                     sizes, dtypes, devices; no storage
        mode_factory()  (a recorder, on top of FakeTensorMode)     sees the build and every step
        stages = build_stages(model, parallel, train, mesh, device)    the trainer's one build path,
                                                                       materialized on fake storage
        step = build_train_step(stages, ...)                       pipeline schedule, optimizer, LR
        on_built(model, optimizer)
        step(s, blank data, dp_rank)  for s in range(steps)        workbench.train.step: the trainer's code

Everything the trainer does runs: TP/SP, FSDP2/HSDP/DDP/ZeRO-1, EP all-to-alls, the pipeline schedule
(GPipe, 1F1B, Interleaved1F1B, GPipeLean), activation checkpointing, mixed precision and gradient
accumulation. What a fake run cannot know is data: the batches are zeros of the right shape, and a
mixture-of-experts router is taken to spread tokens evenly over the experts
(``workbench.models.moe.split_sizes``), which sizes its all-to-alls and expert matmuls. Where torch's
code needs a value or a peer, the fake run answers it locally: DDP's bucket all-reduce and bucket
rebuild (:func:`_fake_ddp`), the pipeline stages' shapes (``workbench.parallel.pipeline.stage_io``, which the trainer gives them too) and torch 2.13's warm-up
vote (``compat.static_pipeline_stage``).

A fake step costs about 0.2 ms per operator, whatever the tensor sizes: a llama-70b pipeline stage
(20 layers, tp=8 + sp, FSDP2, full activation checkpointing) takes ~2 s per microbatch. Two shortcuts
keep the peak and cut the time: ``microbatches="peak"`` (:func:`same_peak_job`) and ``warm_start``.
``device="cuda"`` fakes CUDA tensors, which :func:`fake_rank` does on any machine; a training step on
them needs a CUDA build of torch and a visible GPU (autograd's engine and FSDP2 make CUDA streams).
Without one, ``target="cuda"`` on CPU tensors runs the operators CUDA runs differently as CUDA runs them
(:mod:`workbench.prediction.cuda_ops`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from workbench import compat
from workbench.config import JobConfig, ModelConfig, ParallelConfig

__all__ = ["fake_rank", "run_fake_steps", "distinct_ranks", "same_peak_job", "FakeRank", "FakeRunInfo",
           "BlankDataset"]


@dataclass
class FakeRank:
    """One rank of a fake world: its coordinates, and the run's mesh (None on one process)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: Any
    fake_mode: Any


@contextmanager
def fake_rank(world_size: int, rank: int, device: str | torch.device = "cpu",
              parallel: ParallelConfig | None = None) -> Iterator[FakeRank]:
    """Be rank ``rank`` of ``world_size`` on fake tensors until exit.

    A fake process group (every collective returns at once and moves nothing; c10d's ops have fake
    implementations, so they run on fake tensors too), the DeviceMesh of ``parallel`` (built before
    fake mode: the mesh reads its coordinates as real values), then ``FakeTensorMode``, under which
    every tensor has a size, dtype and device but no storage (``"cuda"`` tensors too, without a GPU).
    Operators on DTensors go straight to DTensor (``compat.fake_tensor_mode``).
    """
    from workbench.mesh import build_mesh
    from workbench.plan.simulate import fake_world

    compat.require("memory.fake_step", "a fake training step", "use a torch release that has it (2.11 to 2.13 do)")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r}: a fake rank runs on 'cpu' or 'cuda' tensors")
    if parallel is not None and parallel.world_size != world_size:
        raise ValueError(f"world_size={world_size} but {parallel.describe()} has {parallel.world_size} ranks")
    with fake_world(world_size, rank):
        mesh = build_mesh(parallel, device.type) if parallel is not None and world_size > 1 else None
        mode = compat.fake_tensor_mode(allow_non_fake_inputs=True)
        with mode:
            yield FakeRank(rank, world_size, device, mesh, mode)


class BlankDataset:
    """Training samples of the right shape and dtype (``seq_len + 1`` token ids) whose values are zeros:
    under FakeTensorMode, what a fake step trains on (``micro_batches`` stacks them as a real run does)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(self.seq_len + 1, dtype=torch.long)


@dataclass
class FakeRunInfo:
    """What :func:`run_fake_steps` did on one rank."""

    rank: int
    coords: dict[str, int]            # pp, dp_replicate, dp_shard, tp
    stages: list[int]                 # the pipeline stages this rank ran ([0] without pp)
    layers: list[list[int]]           # layer ids of each
    steps: int
    build_s: float
    step_s: list[float] = field(default_factory=list)
    result: Any = None                # the last step's StepResult (fake tensors)
    actions: list = field(default_factory=list)  # pipeline: the F/B actions of the last step
    job: Any = None                   # the job the steps ran (same_peak_job's under microbatches="peak")
    device_model: dict = field(default_factory=dict)  # target, simulated_on, what CUDA ops ran (cuda_ops)

    @property
    def total_s(self) -> float:
        return self.build_s + sum(self.step_s)


def run_fake_steps(job: JobConfig, rank: int, *, device: str | torch.device = "cpu", steps: int = 2,
                   on_built: Callable[[torch.nn.Module, torch.optim.Optimizer], None] | None = None,
                   mode_factory: Callable[[], Any] | None = None,
                   on_step: Callable[[int, Any], None] | None = None,
                   microbatches: str = "all", warm_start: bool = False,
                   target: str | None = None) -> FakeRunInfo:
    """Build ``job`` as rank ``rank`` builds it and run ``steps`` of its training steps, all on fake tensors.

    ``mode_factory()``: a context manager (e.g. a TorchDispatchMode recorder) entered right after
    FakeTensorMode, so it sits on top of it and sees the build and every step. ``on_built(model,
    optimizer)``: called once the model and optimizer exist, before the first step. ``on_step(step,
    result)``: after each step, with its :class:`workbench.train.step.StepResult` (fake tensors).
    ``microbatches``: ``"all"`` runs every micro-batch of the job's step; ``"peak"`` only as many as
    reach the same memory peak (:func:`same_peak_job`: 6x faster for 32 microbatches under 1F1B).
    ``warm_start``: make the optimizer state before the first step, as a resumed run has it (one
    optimizer step on zero gradients, marked phase "optimizer" of step -1), so that the first step
    simulated is already a steady-state one: ``steps=1`` then reaches the peak of ``steps=2``.
    ``target``: the device the run stands in for (default ``device``). ``target="cuda"`` on fake CPU
    tensors runs CUDA's operators where they save or allocate differently from the CPU's
    (:mod:`workbench.prediction.cuda_ops`: attention's backend, fused AdamW, our Triton embedding
    backward); ``FakeRunInfo.device_model`` says what ran.
    """
    if microbatches not in ("all", "peak"):
        raise ValueError(f"microbatches={microbatches!r}: choose 'all' or 'peak'")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda': a fake training step on CUDA tensors needs a torch built with CUDA and a "
                         "visible GPU (autograd's engine and FSDP2 set up CUDA streams even for fake tensors); "
                         "run it for device='cpu' here, or on a machine with a GPU")
    full = job
    if microbatches == "peak":
        job = same_peak_job(job, rank)
    from workbench.memory.marks import phase, set_step
    from workbench.mesh import dp_rank
    from workbench.parallel.build import build_stages
    from workbench.train.step import build_train_step

    device = torch.device(device)
    cuda_ops, device_model = _device_model(job, device, target)
    if cuda_ops is not None:
        from workbench.prediction.cuda_ops import cuda_train_config

        job = dataclasses.replace(job, train=cuda_train_config(job.train))
    mcfg, pcfg, tcfg = job.model, job.parallel, job.train
    world = pcfg.world_size
    p, r, s, t = pcfg.rank_coords(rank)
    info = None
    with fake_rank(world, rank, device, pcfg) as fr, _spmd_rules(tcfg.spmd_rules):
        mode = mode_factory() if mode_factory is not None else None
        with mode if mode is not None else nullcontext(), cuda_ops or nullcontext():
            t0 = time.perf_counter()
            with phase("build"):
                stages = build_stages(mcfg, pcfg, tcfg, fr.mesh, device, pp_rank=p)
                step_fn = build_train_step(stages, mcfg, pcfg, tcfg, fr.mesh)
            for module in stages.modules:
                _fake_ddp(module)
            if step_fn.pipe is not None:
                from workbench.parallel.pipeline import hold_recv_buffers_for

                for stage in step_fn.pipe.stages:
                    compat.static_pipeline_stage(stage)
                    hold_recv_buffers_for(stage, full.parallel.pp_microbatches)
            if on_built is not None:
                on_built(step_fn.model, step_fn.optimizer)
            if warm_start:
                _make_optimizer_state(step_fn)
            info = FakeRunInfo(rank, dict(zip(("pp", "dp_replicate", "dp_shard", "tp"), (p, r, s, t))),
                               list(stages.stage_ids), [list(x) for x in stages.layers], steps,
                               time.perf_counter() - t0, job=job)
            data = BlankDataset(tcfg.seq_len)
            d_rank = dp_rank(pcfg, rank)
            try:
                for step in range(steps):
                    t1 = time.perf_counter()
                    result = step_fn(step, data, d_rank)
                    info.step_s.append(time.perf_counter() - t1)
                    info.result = result
                    if on_step is not None:
                        on_step(step, result)
            finally:
                set_step(-1)
            if step_fn.pipe is not None:
                info.actions = step_fn.pipe.actions()
                if hasattr(mode, "label"):  # a recorder: the held copies are receive buffers, as in the full step
                    mode.label(_held_recv_buffers(step_fn.pipe.stages, pcfg.pp_microbatches), "communication")
    info.device_model = {**device_model, **(cuda_ops.summary() if cuda_ops is not None else {})}
    if cuda_ops is not None:
        info.device_model["optimizer"] = tcfg.optim_impl
    return info


def _device_model(job: JobConfig, device: torch.device, target: str | None):
    """(the CudaOps a CPU step targeting CUDA runs under, or None; what the run's metadata says of it)."""
    target = torch.device(target).type if target is not None else device.type
    if target not in ("cpu", "cuda"):
        raise ValueError(f"target={target!r}: a fake rank stands in for 'cpu' or 'cuda'")
    model = {"target": target, "simulated_on": device.type}
    if target == "cpu" or device.type == "cuda":
        return None, {**model, "cuda_ops": "none" if target == "cpu" else "native"}
    if not compat.check("memory.cuda_ops"):
        return None, {**model, "cuda_ops": "cpu kernels (this torch lacks what substitution needs)"}
    from workbench.prediction.cuda_ops import CudaOps, CudaTarget

    return CudaOps(CudaTarget(kernels=job.train.kernels)), model


def _held_recv_buffers(stages, ran: int) -> list[torch.Tensor]:
    """The receive buffers ``stages`` hold for the microbatches a shortened step did not run (from ``ran`` on;
    :func:`workbench.parallel.pipeline.hold_recv_buffers_for`). Never handed to a receive, a recorder
    would count them as temporaries, where the full step's receives make them communication buffers."""
    out = []
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", None) or {}, getattr(stage, "grad_recv_info", None) or {}):
            for i, infos in table.items():
                if isinstance(i, int) and i >= ran:
                    out += [b for info in infos if not getattr(info, "is_root_arg", False)
                            and isinstance(b := getattr(info, "buffer", None), torch.Tensor)]
    return out


def _make_optimizer_state(step_fn) -> None:
    """One optimizer step on zero gradients: the optimizer state exists afterwards, as after a first
    step. Its peak (parameters, gradients, state, the update's temporaries) is the optimizer phase's."""
    from workbench.memory.marks import phase

    with phase("optimizer"), torch.no_grad():
        for p in step_fn.params:
            p.grad = torch.zeros_like(p)
        step_fn.optimizer.step()
        step_fn.optimizer.zero_grad(set_to_none=True)


def same_peak_job(job: JobConfig, rank: int | None = None) -> JobConfig:
    """``job`` with the fewest micro-batches per step that reach the same memory peak on every rank, or,
    given ``rank``, on that rank (its pipeline stage may need fewer).

    A fake step costs time per micro-batch, not per byte, and a step's memory repeats from one
    micro-batch to the next once the schedule is in its steady state, so a shorter step with
    micro-batches of the same size reaches the same peak (``global_batch`` shrinks with them). The
    steady state must be reached once with the gradients already made, which takes::

        gradient accumulation (pp = 1)   2 micro-batches: the first makes the gradients, the last also
                                         syncs them; any between repeats the last without its sync
        1F1B                             pp + 1 microbatches: stage s holds pp - s in flight, and its
                                         second backward (the first with gradients) comes after a forward,
                                         which takes pp - s + 1; so pp on stages s > 0 (given ``rank``;
                                         torch's 1F1B refuses fewer than pp)
        Interleaved1F1B                  3 pp (when microbatches is a multiple of pp): its warm-up is
                                         (v - 1) pp + 2 (pp - 1 - rank) forwards for any larger number
        GPipe, GPipeLean                 unchanged: every forward is held until the backwards start

    The stages still allocate receive buffers for all of the job's microbatches
    (:func:`workbench.parallel.pipeline.hold_recv_buffers_for`). What the shorter step lacks is the
    token ids of the dropped microbatches (``micro x (seq_len + 1)`` int64 each, a few KiB), and its
    timeline is shorter; its peak and where in the schedule the peak falls are the job's (checked
    against full steps in ``tests/test_fake_step.py``).
    """
    import dataclasses

    pcfg, tcfg = job.parallel, job.train
    dp = pcfg.dp
    if pcfg.pp > 1:
        m, pp = pcfg.pp_microbatches, pcfg.pp
        stage = pcfg.rank_coords(rank)[0] if rank is not None else 0
        keep = {"1F1B": pp + 1 if stage == 0 else pp,
                "Interleaved1F1B": 3 * pp if m % pp == 0 else m}.get(pcfg.pp_schedule, m)
        if keep >= m:
            return job
        per_mb = tcfg.global_batch // dp // m
        return dataclasses.replace(job, parallel=dataclasses.replace(pcfg, microbatches=keep),
                                   train=dataclasses.replace(tcfg, global_batch=per_mb * keep * dp))
    accum = tcfg.grad_accum(dp)
    if accum <= 2:
        return job
    micro = tcfg.local_micro_batch(dp)
    return dataclasses.replace(job, train=dataclasses.replace(tcfg, global_batch=micro * 2 * dp))


class _NoRebuildReducer:
    """DDP's reducer, except that it keeps its first bucket layout.

    Before its second forward DDP rebuilds its gradient buckets in the order gradients became ready,
    after agreeing on that order with rank 0 (a broadcast whose values C++ reads, which fake tensors do
    not have). The rebuild frees the old buckets before it makes the new ones, which hold the same
    gradients, so keeping the first layout keeps the bytes."""

    def __init__(self, reducer):
        self._reducer = reducer

    def __getattr__(self, name):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _fake_ddp(module: torch.nn.Module) -> None:
    """Make DDP run on fake tensors: its gradient all-reduce as its default does it (divide by the group
    size, all-reduce the bucket in place), answered at once, since DDP's C++ reducer waits for the
    collective's result value, which a fake process group's work never has; and no bucket rebuild."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return

    def allreduce(group, bucket):
        buf = bucket.buffer()
        buf.div_(group.size())
        torch.distributed.all_reduce(buf, group=group)
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    module.register_comm_hook(module.process_group, allreduce)
    module.reducer = _NoRebuildReducer(module.reducer)


@contextmanager
def _spmd_rules(on: bool) -> Iterator[None]:
    """Our DTensor sharding rules while the fake steps run, as the job installs them (``spmd_rules``)."""
    if not on:
        yield
        return
    from workbench.spmd import our_rules

    with our_rules():
        yield


def distinct_ranks(job: JobConfig | ParallelConfig, model: ModelConfig | None = None, *,
                   symmetric_routing: bool = True) -> dict[int, int]:
    """Every rank of the job -> the representative rank it builds and runs identically to (the lowest).

    Ranks differ in memory only where they hold differently sized tensors or run different code:

    * the **pipeline stage** (pp coordinate) always matters: each holds other layers, and the first and
      last hold the embeddings and the output head and compute the loss;
    * the **dp_shard coordinate** matters under ZeRO-1 (``zero=1``): ZeroRedundancyOptimizer gives each
      dp_shard rank whole parameters, a different set per rank, and only their optimizer state;
    * and under FSDP2 when a shard is uneven: FSDP2 pads every rank's parameter and gradient shards to
      one size, but a rank's true shard (what AdamW's state is shaped like) is smaller at the end of a
      dimension that the dp_shard degree does not divide. This is checked on the model's parameter
      shapes (``job.model``, or ``model``); without a model, shards are taken to be even;
    * and the **ep index** (dp_shard coordinate mod ep) when a mixture of experts' routing loads the ep
      ranks differently (``symmetric_routing=False``: a measured routing table,
      ``workbench.prediction.routing``): each ep rank then receives the rows of its own experts.

    Everything else gives equal ranks: tp, sp and ep split dimensions that validation requires to be
    divisible, dp_replicate holds copies, and every dp rank trains on a batch of the same shape (the
    router of a mixture of experts balanced, or skewed the same way as seen from every ep rank).
    """
    if isinstance(job, JobConfig):
        parallel, model = job.parallel, model or job.model
    else:
        parallel = job
    coords = parallel.all_rank_coords()                      # (world, 4): pp, dp_replicate, dp_shard, tp
    split_shard = parallel.dp_shard > 1 and (parallel.zero == 1 or _uneven_fsdp_shards(parallel, model))
    if split_shard:
        shard = coords[:, 2]
    elif not symmetric_routing and parallel.ep > 1:
        shard = coords[:, 2] % parallel.ep                   # expert_meshes: ep index = dp_shard index mod ep
    else:
        shard = 0
    key = coords[:, 0] * parallel.dp_shard + shard
    first: dict[int, int] = {}
    for rank, k in enumerate(key.tolist()):
        first.setdefault(k, rank)
    return {rank: first[k] for rank, k in enumerate(key.tolist())}


def _uneven_fsdp_shards(parallel: ParallelConfig, model: ModelConfig | None) -> bool:
    """True when some parameter's FSDP2 shard differs in size across dp_shard ranks (conservative: any
    dimension FSDP2 could shard that the shard degree does not divide after tensor parallelism)."""
    if model is None or parallel.zero < 2:
        return False
    n = parallel.dp_shard
    tp = parallel.tp
    kv = model.n_kv_heads * model.head_dim
    rows = [model.vocab_size, model.dim, kv, model.ffn_hidden]      # dim 0 of every 1-D/2-D parameter
    if model.n_experts:
        rows.append(model.n_experts)                                   # the router
        edp = n // parallel.ep                                         # experts: (E/ep, ffn | dim, ...)
        local_experts = model.n_experts // parallel.ep
        expert_even = (local_experts % edp == 0) if local_experts >= edp else \
            (model.ffn_hidden % edp == 0 and model.dim % edp == 0)
        if not expert_even:
            return True
    # Column-parallel weights are split over tp first, row-parallel and replicated ones are not: both
    # leave dim 0 divisible by n only if it is divisible by n before and after the tp split.
    return any(r % n or (r % tp == 0 and (r // tp) % n) for r in rows)
