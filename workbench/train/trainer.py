"""The training loop that every rank runs: build, parallelize, train, log events.

Loss bookkeeping keeps every layout equal to the single-process run. Each micro-batch loss is the
token-mean cross entropy divided by the number of micro-batches, and data parallelism averages over dp
ranks, so the gradient is always that of the mean loss over the whole global batch.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections import defaultdict
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from workbench.checkpoint.load import load as load_checkpoint
from workbench.checkpoint.saver import EMA, Checkpointer, manifest_base
from workbench.checkpoint.state import TrainState, model_view
from workbench.config import JobConfig, TrainConfig
from workbench.mesh import build_mesh, dp_rank
from workbench.memory.probe import PeakMemoryProbe
from workbench.parallel.build import build_stages
from workbench.parallel.pipeline import build_pipeline
from workbench.parallel.expert import load_balancing_loss
from workbench.parallel.precision import compute_context
from workbench.train.data import make_dataset, micro_batches
from workbench.train.events import EventWriter


def grad_norm(params, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients of plain tensors and DTensors on any meshes.

    A DTensor gradient's local sum of squares is summed over the mesh dimensions it is sharded on and
    left alone on those it is replicated on. Grads that share those dimensions share one all-reduce.
    Pipeline stages hold different parameters, so the squares are finally summed over ``pp_group``.
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    pgs: dict[tuple, list] = {}
    device = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            # Shard and FSDP's _StridedShard (not a Shard subclass) both split the tensor; Partial
            # grads do not survive backward under our styles, so "not replicated" means "sharded".
            sharded = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key = tuple(mesh.get_group(i).group_name for i in sharded)
            pgs[key] = [mesh.get_group(i) for i in sharded]
            local = g.to_local()
        else:
            key = ()
            pgs[key] = []
            local = g
        device = local.device
        groups[key].append(local.detach().float().pow(2).sum())
    if device is None and pp_group is None:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    for key, parts in groups.items():
        s = torch.stack(parts).sum()
        for pg in pgs[key]:
            dist.all_reduce(s, group=pg)
        total = total + s
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_grads_(params, max_norm: float, pp_group=None) -> float:
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, pp_group)
    value = float(norm)
    if max_norm > 0 and value > max_norm:
        coef = max_norm / (value + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return value


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _rss_bytes()


def _pipeline_step(pipe, probe, model, dataset, step, tcfg, d_rank, dp, device) -> torch.Tensor:
    """One step through the pipeline schedule, which runs every microbatch's forward and backward.

    Returns this rank's loss sum: the loss on the last stage's ranks, zero elsewhere.
    """
    loss_sum = torch.zeros((), device=device)
    x, y = next(micro_batches(dataset, step, tcfg.global_batch, d_rank, dp, tcfg.global_batch // dp))
    probe.reset_peak()
    with probe, compute_context(model[0], tcfg.mixed_precision, device.type):
        stage_loss = pipe.step(x.to(device), y.to(device))
    if stage_loss is not None:  # only the last stage knows the loss
        loss_sum += stage_loss
    return loss_sum


def _micro_batch_step(model, dataset, step, tcfg, mcfg, d_rank, dp, micro, accum, dp_groups, device):
    """Forward and backward over this rank's micro-batches, accumulating gradients.

    Each micro-batch loss is divided by ``accum`` so the accumulated gradient is that of the mean loss;
    gradient sync (FSDP2 reduce-scatter, DDP all-reduce) runs only on the last micro-batch.
    Returns (loss sum, router aux-loss sum, tokens per expert) for this rank.
    """
    moe = mcfg.n_experts > 0
    loss_sum = torch.zeros((), device=device)
    aux_sum, expert_load = torch.zeros((), device=device), 0
    for m, (x, y) in enumerate(micro_batches(dataset, step, tcfg.global_batch, d_rank, dp, micro)):
        last = m == accum - 1
        sync = nullcontext()
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: skip reduce-scatter until last
            model.set_requires_gradient_sync(last)
        elif hasattr(model, "no_sync") and not last:  # DDP
            sync = model.no_sync()
        with sync:
            with compute_context(model, tcfg.mixed_precision, device.type):
                logits = model(x.to(device))
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten()) / accum
            aux, load = load_balancing_loss(model, dp_groups) if moe else (None, None)
            (loss if aux is None else loss + mcfg.router_aux_coef * aux / accum).backward()
        loss_sum += loss.detach()
        if aux is not None:
            aux_sum += aux.detach() / accum
            expert_load = expert_load + load
    return loss_sum, aux_sum, expert_load


def lr_lambda(tcfg: TrainConfig):
    """The LR multiplier of step ``s``: linear warmup over ``warmup_steps``, then constant.

    ``LambdaLR`` sets ``lr = base_lr * f(s)`` at step ``s`` (``scheduler.step()`` after each optimizer step).
    """
    warmup = tcfg.warmup_steps
    return (lambda s: min(1.0, (s + 1) / warmup)) if warmup else (lambda s: 1.0)


def _checkpointing(job: JobConfig, run_dir: str, events: EventWriter, world: int) -> Checkpointer | None:
    tcfg = job.train
    if not tcfg.ckpt_every:
        return None
    mode = "zero_stall" if tcfg.zero_stall else "async" if tcfg.ckpt_async else "sync"
    kinds = ["model", "optim", *(["ema"] if tcfg.ema else []), "sched", "rng", "extra"]
    base = manifest_base(world, kinds=kinds, ema=bool(tcfg.ema), layout=job.parallel.to_dict(),
                         job={"model": job.model.to_dict(), "parallel": job.parallel.to_dict(),
                              "train": job.train.to_dict()})
    return Checkpointer(ckpt_dir(job, run_dir), every=tcfg.ckpt_every, mode=mode, keep=tcfg.keep,
                        keep_every=tcfg.keep_every, manifest=base, emit=events.emit)


def ckpt_dir(job: JobConfig, run_dir: str) -> str:
    return job.train.ckpt_dir or os.path.join(run_dir, "checkpoints")


def train(job: JobConfig, run_dir: str) -> None:
    """Run ``job`` on this rank. Expects torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    events = EventWriter(run_dir, rank)
    use_cuda = torch.cuda.is_available() and os.environ.get("WORKBENCH_DEVICE", "") != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    mcfg, pcfg, tcfg = job.model, job.parallel, job.train
    timeout = timedelta(seconds=float(os.environ.get("WORKBENCH_PG_TIMEOUT_S", "120")))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    if tcfg.spmd_rules:  # our DTensor sharding rules, in this job's processes only (recorded in config.json)
        from workbench import spmd

        spmd.install()
    try:
        mesh = build_mesh(pcfg, device.type) if world > 1 else None
        torch.manual_seed(tcfg.seed)
        # The one build path (plans use it too): meta model -> this rank's stages, sharded -> only the
        # local blocks allocated and initialised. The probe measures what the build allocates.
        build_probe = PeakMemoryProbe(device)
        build_probe.reset_peak()
        with build_probe:
            stages = build_stages(mcfg, pcfg, tcfg, mesh, device)
        build_peak = build_probe.peak()
        model = stages.model
        pipe = probe = pp_group = None
        if pcfg.pp > 1:  # this rank's pipeline stages, driven by the schedule
            pipe = build_pipeline(stages, pcfg, mesh)
            pp_group = mesh["pp"].get_group()
            probe = PeakMemoryProbe(device).track(model.parameters())
            events.emit("pipeline", schedule=pcfg.pp_schedule, microbatches=pipe.n_microbatches,
                        stages={str(s): layers for s, layers in pipe.layers.items()})
        params = list(model.parameters())
        local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        param_dtype = ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        events.emit("start", pid=os.getpid(), world_size=world, layout=pcfg.describe(),
                    local_params=local_params, n_params=mcfg.n_params, device=str(device),
                    zero=pcfg.zero, mixed_precision=tcfg.mixed_precision, param_dtype=param_dtype,
                    activation_checkpointing=tcfg.activation_checkpointing, build_peak_bytes=build_peak)

        opt = stages.optimizer(pcfg, mesh, tcfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tcfg))
        ema = EMA(model_view(model), tcfg.ema) if tcfg.ema else None
        state = TrainState(model, opt, sched, ema, rank=rank)
        ckpt = _checkpointing(job, run_dir, events, world)
        start_step = 0
        if tcfg.resume:
            spec = ckpt_dir(job, run_dir) if tcfg.resume == "latest" else tcfg.resume
            t_load = time.perf_counter()
            res = load_checkpoint(spec, model, opt, scheduler=sched, ema=ema, rng=True)
            state.step, state.consumed_samples = res.step, res.consumed_samples
            if res.consumed_samples != res.step * tcfg.global_batch:
                raise ValueError(f"checkpoint {res.path.name} consumed {res.consumed_samples} samples in {res.step} "
                                 f"steps, not global_batch={tcfg.global_batch} per step; resume with the "
                                 "global_batch it was saved with")
            start_step = res.step
            events.emit("resume", step=res.step, path=str(res.path), load_s=time.perf_counter() - t_load,
                        saved_layout=res.manifest.get("layout"), skipped=res.skipped)
        dataset = make_dataset(tcfg.data, mcfg.vocab_size, tcfg.seq_len, tcfg.seed)
        dp = pcfg.dp
        d_rank = dp_rank(pcfg, rank)
        micro = tcfg.local_micro_batch(dp)
        accum = tcfg.grad_accum(dp)
        tokens_per_step = tcfg.global_batch * tcfg.seq_len
        fail_rank = (job.fail_at or {}).get("rank")
        fail_step = (job.fail_at or {}).get("step")
        # Mixture of experts: the router loss counts expert load over every dp rank (one all-reduce of
        # the counts per micro-batch), so its gradient too matches the single-process run.
        moe = mcfg.n_experts > 0
        dp_groups = [mesh.get_group(d) for d, n in (("dp_replicate", pcfg.dp_replicate), ("dp_shard", pcfg.dp_shard))
                     if n > 1] if mesh is not None else []

        for step in range(start_step, tcfg.steps):
            if fail_rank == rank and fail_step == step:
                raise RuntimeError(f"injected failure on rank {rank} at step {step} (fail_at test hook)")
            t0 = time.perf_counter()
            lr = opt.param_groups[0]["lr"]  # set by the LambdaLR scheduler
            if pipe is not None:
                loss_sum = _pipeline_step(pipe, probe, model, dataset, step, tcfg, d_rank, dp, device)
                aux_sum, expert_load = torch.zeros((), device=device), 0
            else:
                loss_sum, aux_sum, expert_load = _micro_batch_step(
                    model, dataset, step, tcfg, mcfg, d_rank, dp, micro, accum, dp_groups, device)
            gnorm = clip_grads_(params, tcfg.grad_clip, pp_group)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if ema is not None:
                ema.update()
            if probe is not None:  # optimizer state is created at step 0, outside the probe
                probe.track(t for st in opt.state.values() for t in st.values())
            # The mean over all ranks equals the mean over dp ranks: tp ranks hold identical losses.
            if world > 1:
                dist.all_reduce(loss_sum)
                loss_sum /= world // pcfg.pp  # under pp only the last stage's ranks hold a loss
                if moe:
                    dist.all_reduce(aux_sum)
                    aux_sum /= world
            loss_value = float(loss_sum)
            dt = time.perf_counter() - t0
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step}; lower lr (now {tcfg.lr})")
            events.emit("step", step=step, loss=loss_value, tokens_per_s=tokens_per_step / dt,
                        step_time_s=dt, mem_bytes=_mem_bytes(device), grad_norm=gnorm, lr=lr,
                        **({"aux_loss": float(aux_sum)} if moe else {}),
                        **({"peak_mem_bytes": probe.peak()} if probe is not None else {}))
            if pipe is not None:  # measured start/end of every forward (F) and backward (B) on this rank
                events.emit("schedule", step=step, actions=pipe.actions())
            if moe:  # token-slots routed to each expert, per layer, over the whole global batch
                events.emit("moe", step=step, tokens_per_expert=expert_load.tolist())
            state.step, state.consumed_samples = step + 1, (step + 1) * tcfg.global_batch
            if ckpt is not None:
                ckpt.after_step(state)
        if ckpt is not None:
            ckpt.close()  # waits for the save in flight; raises if it failed
        events.emit("end", steps=tcfg.steps)
        # Tear down together: a rank that destroys its gloo pairs while a peer still uses them
        # aborts the peer at exit ("terminate called without an active exception").
        if world > 1:
            dist.barrier()
    finally:
        events.close()
        dist.destroy_process_group()
