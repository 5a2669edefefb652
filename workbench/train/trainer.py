"""The training loop that every rank runs: build, parallelize, train, log events.

The step itself (forward, backward, clipping, optimizer, scheduler) is ``workbench.train.step``, the
code the memory predictor runs too under FakeTensorMode. What needs real values stays here: the loss
all-reduced over ranks and turned into a number, the finiteness check, the events, checkpoints, EMA.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from workbench.checkpoint.load import load as load_checkpoint
from workbench.checkpoint.saver import EMA, Checkpointer, manifest_base
from workbench.checkpoint.state import TrainState, model_view
from workbench.config import JobConfig
from workbench.mesh import build_mesh, dp_rank
from workbench import compat, kernels
from workbench.memory.marks import phase, set_step
from workbench.memory.recorder import MemoryRecorder
from workbench.memory.probe import PeakMemoryProbe
from workbench.parallel.build import build_stages
from workbench.train.data import make_dataset
from workbench.train.group import init_group
from workbench.train.events import EventWriter
from workbench.train.profiling import StepProfiler
from workbench.time.labels import CHECKPOINT, label
from workbench.train import flops
from workbench.train.launcher import job_device
from workbench.train.resumed import describe_layout, layout_changes
from workbench.parallel.apply import optimizer_impl_of
from workbench.parallel.compile import compiled_blocks
from workbench.parallel.precision import set_tf32
from workbench.train.step import build_train_step, clip_grads_, grad_norm, lr_lambda  # noqa: F401 (re-exported)


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


def _reserved_bytes(device: torch.device) -> dict[str, int]:
    """On CUDA, the caching allocator's peak reservation (what the process holds from the driver, which
    is what runs out first); a CPU has no such pool."""
    return {"mem_reserved_bytes": int(torch.cuda.max_memory_reserved(device))} if device.type == "cuda" else {}


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
                        keep_every=tcfg.keep_every, manifest=base, emit=events.emit, quant=tcfg.ckpt_quant,
                        owner=ckpt_owner(job, run_dir))


def ckpt_owner(job: JobConfig, run_dir: str) -> str | None:
    """The run id the checkpoint directory must still name at each save (the launcher claimed it for this
    run; workbench.train.rundir). None on a multi-node job, where only node 0's run directory has that id."""
    from workbench.train.rundir import run_id_of

    return None if job.nodes else run_id_of(run_dir)


def ckpt_dir(job: JobConfig, run_dir: str) -> str:
    return job.train.ckpt_dir or os.path.join(run_dir, "checkpoints")


def train(job: JobConfig, run_dir: str) -> None:
    """Run ``job`` on this rank. Expects torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    events = EventWriter(run_dir, rank)
    mcfg, pcfg, tcfg = job.model, job.parallel, job.train
    use_cuda = job_device(job) == "cuda"  # the launcher's preflight: a GPU for every local rank
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        set_tf32(tcfg.tf32)
    # --kernels: which implementation our custom ops run in this process (every rank); 'triton' where
    # Triton cannot run on this device fails here, with the reason, before any process group exists.
    kernels.set_backend(tcfg.kernels)
    kernels_resolved = kernels.resolve(tcfg.kernels, device)
    backend = init_group(use_cuda)  # workbench.train.group: one line when a rank never joins
    if tcfg.spmd_rules:  # our DTensor sharding rules, in this job's processes only (recorded in config.json)
        from workbench import spmd

        spmd.install()
    recorder = profiler = None
    try:
        mesh = build_mesh(pcfg, device.type) if world > 1 else None
        torch.manual_seed(tcfg.seed)
        # The one build path (plans use it too): meta model -> this rank's stages, sharded -> only the
        # local blocks allocated and initialised. The probe measures what the build allocates.
        # --memory: every storage this rank makes from here on goes into RUN_DIR/memory/rank{r}.npz.
        recorder = _start_recording(job, rank, device) if tcfg.memory else None
        build_probe = PeakMemoryProbe(device)
        build_probe.reset_peak()
        with build_probe, phase("build"):
            stages = build_stages(mcfg, pcfg, tcfg, mesh, device)
        build_peak = build_probe.peak()
        # The step (workbench.train.step): this rank's pipeline schedule, the optimizer, the LR schedule.
        with phase("build"):
            ts = build_train_step(stages, mcfg, pcfg, tcfg, mesh)
        model, pipe, opt, sched = ts.model, ts.pipe, ts.optimizer, ts.scheduler
        if recorder is not None:
            recorder.track(model=stages.modules, optimizer=opt)
        probe = None
        if pipe is not None and not (tcfg.compile and device.type == "cpu"):
            # On CPU the probe is a dispatch mode, which compiled blocks cannot run under: there the
            # pipeline's peak goes unmeasured (step events still carry the resident set, mem_bytes).
            ts.probe = probe = PeakMemoryProbe(device).track(model.parameters())
            events.emit("pipeline", schedule=pcfg.pp_schedule, microbatches=pipe.n_microbatches,
                        stages={str(s): layers for s, layers in pipe.layers.items()})
        params = ts.params
        local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        param_dtype = ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        # MFU: the model's training FLOPs per token (workbench.train.flops) against the device's peak
        # for the precision the matmuls run in (None where the peak is unknown, e.g. on CPU).
        flops_per_token = flops.flops_per_token(mcfg, tcfg.seq_len)
        precision = flops.precision_of(tcfg, device.type)
        peak = flops.peak_flops_per_s(device, precision, tcfg.peak_tflops)
        events.emit("start", pid=os.getpid(), world_size=world, layout=pcfg.describe(),
                    local_params=local_params, n_params=mcfg.n_params, device=str(device), backend=backend,
                    zero=pcfg.zero, mixed_precision=tcfg.mixed_precision, param_dtype=param_dtype,
                    activation_checkpointing=tcfg.activation_checkpointing, build_peak_bytes=build_peak,
                    kernels=kernels_resolved, optim_impl=optimizer_impl_of(opt),
                    compiled_blocks=sum(compiled_blocks(m) for m in stages.modules), precision=precision,
                    flops_per_token=flops_per_token, peak_flops_per_s=peak)

        if tcfg.init_from:  # HF weights over the seeded init; optimizer and step stay fresh (hf_init)
            from workbench.checkpoint.hf_init import load_hf_weights

            events.emit("init_from", **load_hf_weights(model, tcfg.init_from, mcfg))  # each rank: what it read
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
            # What it resumed from, and whether the layout moved (the manifest records the saved one):
            # the CLI, Run.resumed and the dashboard say so instead of showing a run that starts at 0.
            saved, now = res.manifest.get("layout"), pcfg.to_dict()
            changes = layout_changes(saved, now)
            events.emit("resume", step=res.step, path=str(res.path), load_s=time.perf_counter() - t_load,
                        saved_layout=saved, layout=now, layout_changed=None if changes is None else bool(changes),
                        layout_changes=changes, saved_layout_desc=describe_layout(saved),
                        layout_desc=pcfg.describe(), saved_world_size=res.manifest.get("world_size"),
                        world_size=world, steps=tcfg.steps, skipped=res.skipped, read=res.read)
        dataset = make_dataset(tcfg.data, mcfg.vocab_size, tcfg.seq_len, tcfg.seed)
        d_rank = dp_rank(pcfg, rank)
        tokens_per_step = tcfg.global_batch * tcfg.seq_len
        fail_rank = (job.fail_at or {}).get("rank")
        fail_step = (job.fail_at or {}).get("step")
        # Mixture of experts: the router loss counts expert load over every dp rank (one all-reduce of
        # the counts per micro-batch), so its gradient too matches the single-process run.
        moe = mcfg.n_experts > 0
        # --profile: torch.profiler over one warm-up step and then tcfg.profile steps (RUN_DIR/profile)
        profiler = (StepProfiler(run_dir, rank, tcfg.profile, start_step, tcfg.steps, device, events.emit)
                    if tcfg.profile else None)

        for step in range(start_step, tcfg.steps):
            if profiler is not None:
                profiler.begin(step)
            if fail_rank == rank and fail_step == step:
                raise RuntimeError(f"injected failure on rank {rank} at step {step} (fail_at test hook)")
            t0 = time.perf_counter()
            lr = opt.param_groups[0]["lr"]  # set by the LambdaLR scheduler
            result = ts(step, dataset, d_rank)
            loss_sum, aux_sum, expert_load = result.loss_sum, result.aux_sum, result.expert_load
            gnorm = float(result.grad_norm)
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
            per_rank = tokens_per_step / dt / world  # tokens/s of one rank's share
            events.emit("step", step=step, loss=loss_value, tokens_per_s=tokens_per_step / dt,
                        step_time_s=dt, mem_bytes=_mem_bytes(device), **_reserved_bytes(device),
                        grad_norm=gnorm, lr=lr,
                        tflops=flops.tflops_per_s(per_rank, flops_per_token),
                        mfu=flops.mfu(per_rank, flops_per_token, peak),
                        **({"aux_loss": float(aux_sum)} if moe else {}),
                        **({"peak_mem_bytes": probe.peak()} if probe is not None else {}),
                        # async/zero-stall: what checkpointing cost the loop around this step (capture + wait)
                        **({"ckpt_stall_s": ckpt.take_stall()} if ckpt is not None and ckpt.mode != "sync" else {}))
            if recorder is not None:  # live and peak bytes of this step, by category (the dashboard plots it)
                events.emit("memory", step=step, **recorder.step_summary())
            if pipe is not None:  # measured start/end of every forward (F) and backward (B) on this rank
                events.emit("schedule", step=step, actions=pipe.actions())
            if moe:  # token-slots routed to each expert, per layer, over the whole global batch
                events.emit("moe", step=step, tokens_per_expert=expert_load.tolist())
            state.step, state.consumed_samples = step + 1, (step + 1) * tcfg.global_batch
            if ckpt is not None:
                with phase("checkpoint"), label(CHECKPOINT):
                    ckpt.after_step(state)
            if profiler is not None:
                profiler.end(step)
        set_step(-1)
        if ckpt is not None:
            with phase("checkpoint"):
                ckpt.close()  # waits for the save in flight; raises if it failed
        events.emit("end", steps=tcfg.steps)
        # Tear down together: a rank that destroys its gloo pairs while a peer still uses them
        # aborts the peer at exit ("terminate called without an active exception").
        if world > 1:
            dist.barrier()
    finally:
        if profiler is not None:
            profiler.close()
        if recorder is not None:  # a failed run keeps what it recorded up to the failure
            try:
                _save_recording(recorder, job, run_dir, device)
            except Exception as e:  # noqa: BLE001 - never hide the run's own error behind this one
                print(f"workbench: rank {rank} could not save its memory timeline: {e}", file=sys.stderr)
        events.close()
        dist.destroy_process_group()


def _start_recording(job: JobConfig, rank: int, device: torch.device) -> MemoryRecorder:
    """A recorder of this rank's storages (on CUDA also the caching allocator's own history)."""
    if device.type == "cuda":
        compat.get("cuda_record_memory_history")(max_entries=1_000_000)
    recorder = MemoryRecorder(rank, device, clock="wall", source="measured")
    recorder.__enter__()
    return recorder


def _save_recording(recorder: MemoryRecorder, job: JobConfig, run_dir: str, device: torch.device) -> None:
    recorder.__exit__(None, None, None)
    out = os.path.join(run_dir, "memory")
    meta = {"model": job.model.name, "layout": job.parallel.describe(), "world_size": job.parallel.world_size}
    if device.type == "cuda":
        meta["max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
        os.makedirs(out, exist_ok=True)
        compat.get("cuda_dump_snapshot")(os.path.join(out, f"rank{recorder.rank}.cuda_snapshot.pickle"))
        compat.get("cuda_record_memory_history")(enabled=None)
    recorder.timeline(**meta).save(out)
