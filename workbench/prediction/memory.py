"""Predict a job's memory timeline on every rank without running it: one real step, on fake tensors.

How llama-70b on 1024 ranks is predicted on a laptop::

    for each distinct rank r (ranks that build and run identically share one representative):
        fake process group of 1024 ranks, seen from r          # collectives return at once
        FakeTensorMode                                         # tensors with sizes, no memory
        MemoryRecorder on top                                  # the recorder `train --memory` uses
            build_stages(...)                                  # the trainer's one build path
            steps of the trainer's own step code               # forward, backward, optimizer:
                                                               # parallelize, pipeline schedule, AC,
                                                               # mixed precision, ZeRO, accumulation
        its stage's 20 blocks simulated as 4, folded out to 20 # workbench.prediction.fold
    -> one MemoryTimeline, with meta["rank_map"]: every rank -> the representative it equals

Because the predictor runs the trainer's code and counts with the recorder's rules, a prediction and a
CPU measurement agree up to what differs between a fake and a real run (gloo's own buffers, which no
tensor tracker sees, and Python objects). Targeting CUDA (``device="cuda"``), tensors are faked on
CUDA and every block is rounded as the caching allocator rounds it, so the peak predicts
``torch.cuda.max_memory_allocated()``; of what the allocator hands to libraries outside tensor ops, the
cuBLAS workspaces are counted (:func:`cublas_workspace_bytes`), NCCL's buffers are not.

Two steps are simulated by default: the first makes the optimizer state, the second runs with it
already alive, which is where a steady-state peak usually is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.cpu_quota import usable_cpus
from workbench.memory.recorder import MemoryRecorder
from workbench.memory.timeline import MemoryTimeline
from workbench.units import parse_bytes

__all__ = ["predict", "peak_per_rank", "reserved_per_rank", "add_reserved", "fits", "FitAnswer", "default_margin"]


def _job(job: Any, parallel: Any = None, train: Any = None, nproc: int | None = None, **settings) -> JobConfig:
    """A validated JobConfig from a JobConfig, or a model plus layout (no check against this machine's
    memory: the job is predicted, not run here)."""
    if isinstance(job, JobConfig):
        if parallel is not None or train is not None or settings:
            raise TypeError("pass either a JobConfig or a model with parallel=/train= settings, not both")
        return job
    from workbench.settings import make_configs

    mcfg = resolve_model(job)
    pcfg, tcfg = make_configs(parallel, train, what="memory setting", **settings)
    validate(mcfg, pcfg)
    pcfg = pcfg.resolved(nproc)
    validate(mcfg, pcfg, tcfg)
    return JobConfig(model=mcfg, parallel=pcfg, train=tcfg)


def predict(job: JobConfig | str | ModelConfig | dict, *, device: str = "cpu", ranks: list[int] | None = None,
            steps: int | None = None, exact: bool = False, workers: int | None = None, progress: bool = True,
            parallel: ParallelConfig | dict | None = None, train: TrainConfig | dict | None = None,
            nproc: int | None = None, fold: bool = True, routing: Any = None, **settings) -> MemoryTimeline:
    """The predicted memory timeline of every distinct rank of ``job`` (a JobConfig, or a model name /
    ModelConfig with ``parallel=``, ``train=`` or shortcuts like ``tp=2, micro_batch=4``).

    ``device`` is what the prediction targets: ``"cpu"`` (the CPU recorder of ``train --memory``) or
    ``"cuda"`` (``max_memory_allocated``). ``ranks`` limits it to some ranks (default: one per distinct
    rank).

    By default the step is shortened to what reaches the same peak (``exact=False``): the fewest
    micro-batches whose schedule repeats from there on (:func:`workbench.prediction.fake.same_peak_job`),
    and for a job with micro-batches, one step with the optimizer state made before it instead of two.
    And a stage of more than 4 identical transformer blocks is simulated with 4 and folded out to all of
    them (:mod:`workbench.prediction.fold`: the same events, event for event, at a fraction of the time;
    ``meta["folded"]`` says which ranks were, and layouts it cannot fold exactly are simulated whole;
    ``fold=False`` simulates every block).
    ``exact=True`` runs every micro-batch of ``steps`` steps (default 2) and every block, the timeline to
    look at when the whole schedule matters. ``workers``: processes sharing the distinct ranks (default: up to the
    CPUs this process may use, :func:`usable_cpus`, for models of a billion parameters or more, else 1;
    each worker is a process that imports torch, about 350 MB).
    ``routing``: a mixture of experts' measured routing (a Run, its directory or events.jsonl, or token counts
    per layer; :mod:`workbench.prediction.routing`) instead of balanced routing.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: predict for 'cpu' or 'cuda'")
    job = _job(job, parallel, train, nproc, **settings)
    from workbench.parallel.checkpointing import ac_policy
    from workbench.prediction.fake import distinct_ranks
    from workbench.prediction.routing import as_routing

    routing = as_routing(routing, job)
    rank_map = distinct_ranks(job, symmetric_routing=routing is None or routing.symmetric)
    reps = sorted(set(rank_map.values())) if ranks is None else sorted({rank_map[_check_rank(r, rank_map)]
                                                                         for r in ranks})
    if workers is None:
        workers = min(usable_cpus(), len(reps)) if job.model.n_params >= 1e9 else 1
    workers = max(1, min(workers, len(reps)))
    t0 = time.perf_counter()
    if dist.is_initialized() or workers > 1:  # a real group here cannot coexist with the fake one
        from workbench.prediction.workers import predict_parts

        parts = _split(job, reps, workers, exact)
        timelines = predict_parts(job, device, parts, lambda part: predict_part(job, part, device, steps, exact, fold,
                                                                                routing),
                                  steps=steps, exact=exact, fold=fold, routing=routing)
    else:
        timelines = [_predict_rank(job, r, device, steps, exact, fold, routing) for r in _progress(reps, job, progress)]
    # each part replayed its own ranks through the caching allocator model (predict_part), in parallel
    replayed = [t.meta.get("allocator") for t in timelines] if device == "cuda" else []
    meta = {"rank_map": {str(k): int(v) for k, v in rank_map.items() if v in reps},
            "model": job.model.name, "layout": job.parallel.describe(), "world_size": job.parallel.world_size,
            "exact": exact, "prediction_s": round(time.perf_counter() - t0, 3),
            "ac_policy": ac_policy(job.train.activation_checkpointing, job.train.ac_every),
            "job": {"model": job.model.to_dict(), "parallel": job.parallel.to_dict(), "train": job.train.to_dict()}}
    tl = MemoryTimeline.concat(timelines, source="predicted", device=device)
    tl.meta.update(meta)
    if routing is not None:
        tl.meta["routing"] = routing.describe()
    folded = _folded(timelines)
    if folded:
        tl.meta["folded"] = folded
    tl.meta.pop("recording_overhead_s", None)
    if replayed and all(replayed) and len({json.dumps(a["settings"], sort_keys=True) for a in replayed}) == 1:
        tl.meta["allocator"] = _merge_allocator(replayed)
    elif device == "cuda":
        add_reserved(tl)
    return tl


def _split(job: JobConfig, reps: list[int], workers: int, exact: bool) -> list[list[int]]:
    """``reps`` in ``workers`` parts of about equal work, the lightest first (this process predicts it, then
    joins the parts). A rank's work is taken to be two units per micro-batch its step runs (under a
    shortened 1F1B step one more on stage 0 than on the others: :func:`same_peak_job`), plus one for the
    first pipeline stage (the embedding) and one for the last (the output head and the loss): about what
    the four stages of llama-70b at pp=4 measured (CPU seconds 4.3, 3.4, 3.4, 3.8)."""
    from workbench.prediction.fake import same_peak_job

    pp = job.parallel.pp

    def cost(r: int) -> int:
        if pp == 1:
            return 1
        stage = job.parallel.rank_coords(r)[0]
        return 2 * (job if exact else same_peak_job(job, r)).parallel.pp_microbatches + (stage == 0) + (stage == pp - 1)

    parts: list[list[int]] = [[] for _ in range(workers)]
    load = [0] * workers
    for r in sorted(reps, key=lambda r: (-cost(r), r)):  # the longest first, to the least loaded part
        i = min(range(workers), key=lambda i: (load[i], i))
        parts[i].append(r)
        load[i] += cost(r)
    order = sorted(range(workers), key=lambda i: (load[i], -len(parts[i]), i))
    return [sorted(parts[i]) for i in order if parts[i]]


def _predict_rank(job: JobConfig, rank: int, device: str, steps: int | None, exact: bool,
                  fold: bool = True, routing: Any = None) -> MemoryTimeline:
    """One distinct rank: the recorder on top of the fake step (``workbench.prediction.fake``). Unless
    ``exact``, a stage of many identical blocks is simulated with 4 and folded out to all of them
    (``workbench.prediction.fold``); where the fold's checks refuse, every block is simulated."""
    from workbench.prediction.fake import run_fake_steps
    from workbench.prediction.fold import FoldError, fold_plan, fold_rows

    plan = fold_plan(job, rank) if fold and not exact else None

    # Fake CUDA tensors need a CUDA build and a GPU (autograd's engine and FSDP2 set up streams even for
    # fake tensors). Without one, the step runs on fake CPU tensors and the blocks are counted as CUDA's
    # caching allocator rounds them, and the operators CUDA runs differently (attention's backend and
    # saved statistics, fused AdamW, our Triton embedding backward) run as on CUDA (prediction/cuda_ops.py).
    sim = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    accumulates = job.parallel.pp > 1 or job.train.grad_accum(job.parallel.dp) > 1
    if steps is None:
        steps = min(2, job.train.steps) if exact or not accumulates else 1
    warm = not exact and accumulates and steps == 1
    rec = MemoryRecorder(rank=rank, device=sim, clock="sequence", source="predicted", allocator=device,
                         blocks=plan is not None)
    from workbench.prediction.routing import routed

    with routed(routing, job, rank):  # a MoE's routing when given (None: balanced)
        info = run_fake_steps(plan.job if plan else job, rank, device=sim, steps=steps, mode_factory=lambda: rec,
                              on_built=lambda model, opt: rec.track(model=model, optimizer=opt),
                              microbatches="all" if exact else "peak", warm_start=warm, target=device)
    meta: dict[str, Any] = {}
    if plan is not None:
        try:
            folded = fold_rows(rec.events, rec.categories, rec.blocks, plan.simulated, plan.real, rec.round_bytes,
                               plan.group)
        except FoldError:
            return _predict_rank(job, rank, device, steps, exact, fold=False, routing=routing)
        rec.set_events(folded.rows, folded.categories)
        meta["folded"] = {str(rank): folded.info}
    if device == "cuda":
        workspaces = cublas_workspace_bytes()
        if rec.library_block(workspaces, "cuBLAS workspaces"):
            meta["library_bytes"] = {"cuBLAS workspaces": workspaces}
    return rec.timeline(steps=steps, simulated_on=sim, warm_start=warm, device_model=info.device_model, **meta)


def _folded(timelines: list[MemoryTimeline]) -> dict[str, Any]:
    """Every rank's fold (its simulated blocks, its events before and after), from each part's meta."""
    return {r: info for t in timelines for r, info in (t.meta.get("folded") or {}).items()}


def cublas_workspace_bytes(capability: tuple[int, int] | None = None) -> int:
    """What cuBLAS keeps of the caching allocator through a CUDA training step: two workspaces, each
    ``CUBLAS_WORKSPACE_CONFIG``'s size when set (``:SIZE_KiB:COUNT`` pairs), else torch's default for the
    GPU: 32 MiB on compute capability 9.0 and newer (H100, H200), 8 MiB + 128 KiB before it.
    ``capability`` defaults to this machine's GPU, or 9.0 without one. On an H200 (torch 2.11) the
    measured ``max_memory_allocated`` of seven one-GPU configs stood 64-74 MiB above the tensors' peak,
    2 x 32 MiB of it these workspaces (gpu/check.py's memory part)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = [p for p in config.split(":") if p]
    if config and len(pairs) % 2 == 0 and all(p.isdigit() for p in pairs):
        per = sum(int(size) * int(count) for size, count in zip(pairs[::2], pairs[1::2])) * 1024
    else:
        if capability is None:
            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
        per = 32 << 20 if capability >= (9, 0) else (8 << 20) + (128 << 10)
    return 2 * per


def _progress(reps: list[int], job: JobConfig, progress: bool):
    if not progress or len(reps) < 2:
        return reps
    from workbench.progress import tqdm

    return tqdm(reps, desc=f"predict {job.model.name} [{job.parallel.describe()}]", unit="rank")


def _check_rank(r: int, rank_map: dict[int, int]) -> int:
    if r not in rank_map:
        raise ValueError(f"rank {r} is not in this job; its ranks are 0..{len(rank_map) - 1}")
    return r


def peak_per_rank(timeline: MemoryTimeline) -> pd.Series:
    """Peak bytes of every rank of the job (a prediction's representatives expanded by its rank_map)."""
    peaks = {r: timeline.peak(r).bytes for r in timeline.ranks}
    rank_map = timeline.meta.get("rank_map")
    if not rank_map:
        return pd.Series(peaks, name="peak_bytes").rename_axis("rank")
    out = {int(k): peaks[int(v)] for k, v in rank_map.items() if int(v) in peaks}
    return pd.Series(dict(sorted(out.items())), name="peak_bytes").rename_axis("rank")


# --------------------------------------------------------------------------------------------------
# Does it fit?
# --------------------------------------------------------------------------------------------------


CONTEXT_MARGIN = 512 << 20  # the CUDA context, cuDNN/cuBLAS handles and the kernels' modules, outside the allocator
NCCL_MARGIN = 256 << 20     # per NCCL communicator a rank joins: its channels' buffers and proxy state


def nccl_communicators(job: JobConfig) -> int:
    """The NCCL communicators a rank of ``job`` joins: one per mesh dimension of degree > 1, plus the world's."""
    p = job.parallel
    degrees = (p.dp_replicate, p.dp_shard, p.tp, p.pp, p.ep)
    return (p.world_size > 1) + sum(d > 1 for d in degrees)


def default_margin(job: JobConfig, device: str) -> int:
    """Bytes a rank needs beyond what its caching allocator reserves, by default: on CUDA, 512 MiB for the
    CUDA context (0.3-0.6 GiB with torch 2.x's lazily loaded modules) plus 256 MiB per NCCL communicator
    (:func:`nccl_communicators`; NCCL's buffers grow with channels and peers: set ``margin=`` from a
    measurement where it matters); on CPU nothing."""
    return CONTEXT_MARGIN + NCCL_MARGIN * nccl_communicators(job) if device == "cuda" else 0


def _margin_bytes(margin: int | float | str | None, job: JobConfig, device: str) -> int:
    if margin is None or (isinstance(margin, str) and margin.strip().lower() == "auto"):
        return default_margin(job, device)
    if isinstance(margin, (int, float)) and not isinstance(margin, bool) and margin == 0 \
            or isinstance(margin, str) and margin.strip() in ("0", "0B", "0b"):
        return 0
    try:
        return parse_bytes(margin)
    except ValueError:
        raise ValueError(f"margin {margin!r}: write bytes or a size like 1.5GiB, 0, or 'auto' (CUDA context + "
                         "NCCL defaults)") from None


@dataclasses.dataclass(frozen=True)
class FitAnswer:
    """Whether a job fits in ``budget_bytes`` per rank, and the largest micro batch that does.

    On CUDA the peak compared is the allocator's *reserved* peak (``max_memory_reserved``, from the caching
    allocator model: :mod:`workbench.memory.allocator`), plus ``margin_bytes`` for what lives outside the
    allocator (CUDA context, NCCL); on CPU it is the recorder's peak, without margin. ``compared`` names it."""

    budget_bytes: int
    peak_bytes: int  # the job as given, the worst rank: the compared peak (reserved on CUDA), margin excluded
    fits: bool
    micro_batch: int | None  # the largest local micro batch that fits (None: not even 1)
    peak_at_micro_batch: int | None
    tried: dict[int, int]  # micro batch -> predicted worst-rank peak (the compared one)
    compared: str = "allocated"  # "reserved" (CUDA) or "allocated" (CPU)
    margin_bytes: int = 0
    allocated_bytes: int | None = None  # the job as given: worst-rank allocated peak
    # CUDA: whether the allocator, replayed with budget - margin as the device's room, runs out (a job over
    # its reserved peak may still run: at the limit torch frees its cached segments and retries)
    runs_out: bool | None = None

    @property
    def needed_bytes(self) -> int:
        """What the job as given needs per rank: the compared peak plus the margin."""
        return self.peak_bytes + self.margin_bytes

    def __str__(self) -> str:
        from workbench.units import format_bytes

        verdict = "fits" if self.fits else "does not fit"
        mb = (f"largest micro batch that fits: {self.micro_batch} (peak {format_bytes(self.peak_at_micro_batch)})"
              if self.micro_batch else "no micro batch fits")
        if self.compared == "reserved":
            alloc = f", allocated {format_bytes(self.allocated_bytes)}" if self.allocated_bytes is not None else ""
            peak = (f"reserved peak {format_bytes(self.peak_bytes)}{alloc}, + {format_bytes(self.margin_bytes)} "
                    f"margin (CUDA context, NCCL) = {format_bytes(self.needed_bytes)}")
        else:
            peak = f"peak {format_bytes(self.peak_bytes)}" + (
                f" + {format_bytes(self.margin_bytes)} margin" if self.margin_bytes else "")
        note = ""
        if self.runs_out is False and not self.fits:
            note = ("; at this budget the allocator would not run out: it frees its cached segments and retries "
                    "(slower)")
        return f"{verdict} in {format_bytes(self.budget_bytes)}: {peak}; {mb}{note}"


def _with_micro(job: JobConfig, micro: int) -> JobConfig:
    """The job with local micro batch ``micro``: the accumulation (or, under pp, the number of pipeline
    micro-batches) grows so the global batch stays what it is."""
    dp = job.parallel.dp
    local = job.train.global_batch // dp
    if job.parallel.pp > 1:
        par = dataclasses.replace(job.parallel, microbatches=local // micro)
        return dataclasses.replace(job, parallel=par)
    return dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch=micro))


def _micro_choices(job: JobConfig) -> list[int]:
    local = job.train.global_batch // job.parallel.dp
    out = []
    for m in range(1, local + 1):
        if local % m:
            continue
        try:
            j = _with_micro(job, m)
            validate(j.model, j.parallel, j.train)
        except ValueError:
            continue
        out.append(m)
    return out


def fits(job: JobConfig | str | ModelConfig | dict, budget: int | float | str, *, device: str = "cpu",
         progress: bool = False, margin: int | float | str | None = None, timeline: MemoryTimeline | None = None,
         **settings) -> FitAnswer:
    """Does the job fit in ``budget`` per rank (bytes, or text like ``"80GiB"``), and what is the largest
    micro batch that does? Peak memory grows about linearly with the micro batch, so two predictions
    give the line, and the candidate it points at is checked with a real prediction (and stepped down
    until one fits).

    On CUDA the peak is what the caching allocator reserves (:func:`reserved_per_rank`), and ``margin``
    is added for memory outside it: bytes or text (``"1.5GiB"``, ``0``); default (None or ``"auto"``)
    :func:`default_margin`, 512 MiB of CUDA context + 256 MiB per NCCL communicator. ``timeline``: this
    job's prediction for ``device`` when one is at hand (a plan's cached one), so it is not predicted again."""
    job = _job(job, **settings)
    budget_bytes = parse_bytes(budget)
    margin_bytes = _margin_bytes(margin, job, device)
    room = budget_bytes - margin_bytes
    tried: dict[int, int] = {}

    def peak(m: int) -> int:
        if m not in tried:
            tried[m] = _compared_peak(predict(_with_micro(job, m), device=device, progress=progress), device)
        return tried[m]

    if timeline is not None and timeline.device != device:
        raise ValueError(f"the timeline given was predicted for {timeline.device}, not {device}; predict it for "
                         f"{device} or leave timeline= out")
    base = timeline if timeline is not None else predict(job, device=device, progress=progress)
    job_peak = _compared_peak(base, device)
    allocated = int(peak_per_rank(base).max())
    if device == "cuda":  # max_memory_allocated counts whole blocks (an unsplit remainder too): the model's
        allocated = max(int(v["peak_allocated"]) for v in base.meta["allocator"]["ranks"].values())
    compared = "reserved" if device == "cuda" else "allocated"

    def answer(best: int | None) -> FitAnswer:
        return FitAnswer(budget_bytes, job_peak, job_peak <= room, best, tried.get(best) if best else None,
                         dict(sorted(tried.items())), compared, margin_bytes, allocated,
                         _runs_out(base, room) if device == "cuda" else None)

    local = job.train.global_batch // job.parallel.dp
    own = local // job.parallel.pp_microbatches if job.parallel.pp > 1 else job.train.local_micro_batch(job.parallel.dp)
    tried[own] = job_peak  # the job as given is one of the sizes: no need to predict it twice
    choices = _micro_choices(job)
    if not choices:
        return answer(None)
    lo = choices[0]
    p_lo = peak(lo)
    best = None
    if p_lo <= room:
        if len(choices) == 1:
            best = lo
        else:
            hi = choices[1]
            slope = max(1.0, (peak(hi) - p_lo) / (hi - lo))
            guess = lo + (room - p_lo) / slope
            ordered = sorted((m for m in choices if m <= guess), reverse=True) or [lo]
            for m in ordered:
                if peak(m) <= room:
                    best = m
                    break
            # the line may be pessimistic: try the next size up once
            bigger = [m for m in choices if best is not None and m > best]
            if bigger and peak(bigger[0]) <= room:
                best = bigger[0]
    return answer(best)


def _runs_out(timeline: MemoryTimeline, room: int) -> bool:
    """Whether any rank's allocator, replayed with ``room`` bytes to reserve, runs out of memory."""
    from workbench.memory.allocator import AllocatorConfig, replay

    if room <= 0:
        return True
    settings = (timeline.meta.get("allocator") or {}).get("settings") or {}
    config = AllocatorConfig(**settings, capacity=room)
    frame = timeline.frame
    per = reserved_per_rank(timeline)
    for r in timeline.ranks:
        if int(per[r]) <= room:
            continue  # its unbounded reserved peak fits: the allocator never reaches the limit
        ev = frame[frame["rank"] == r]
        if replay(ev["id"].to_numpy(), ev["delta_bytes"].to_numpy(), config,
                  base_bytes=timeline.base_bytes.get(r, 0)).oom:
            return True
    return False


def _compared_peak(timeline: MemoryTimeline, device: str) -> int:
    """The worst rank's peak that :func:`fits` compares: reserved on CUDA, allocated on CPU."""
    if device == "cuda":
        return int(reserved_per_rank(timeline).max())
    return int(peak_per_rank(timeline).max())


# --------------------------------------------------------------------------------------------------
# Reserved memory: the caching allocator's segments
# --------------------------------------------------------------------------------------------------


def allocator_config_from_env(capacity: int | None = None) -> tuple[Any, list[str]]:
    """The allocator settings of ``PYTORCH_CUDA_ALLOC_CONF`` here (what a run started from this shell gets),
    and the settings in it the model leaves out (they are ignored, and named in the prediction's meta)."""
    from workbench.memory.allocator import AllocatorConfig

    kw: dict[str, Any] = {}
    ignored = []
    for part in (p.strip() for p in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if p.strip()):
        try:
            one = AllocatorConfig.parse(part)
        except ValueError:
            ignored.append(part)
            continue
        key = part.partition(":")[0].strip()
        name = {"max_split_size_mb": "max_split_size"}.get(key, key)
        kw[name] = getattr(one, name)
    return AllocatorConfig(capacity=capacity, **kw), ignored


def add_reserved(timeline: MemoryTimeline, config: Any = None) -> MemoryTimeline:
    """Replay each rank of a CUDA timeline through the caching allocator model
    (:mod:`workbench.memory.allocator`) and put what it reserves into ``meta["allocator"]``: per rank the
    reserved and allocated peaks (torch's ``max_memory_reserved`` / ``max_memory_allocated``),
    fragmentation, segments, and per step the two peaks, with the steps whose reserved peak exceeds
    the allocated one by more than 5% flagged (``flagged_steps``; ``flagged_ranks`` at the top).
    ``config``: an :class:`~workbench.memory.allocator.AllocatorConfig` (default: ``PYTORCH_CUDA_ALLOC_CONF``
    here). Returns the timeline (changed in place)."""
    from workbench.memory.allocator import FLAG_OVERHEAD, replay

    ignored: list[str] = []
    if config is None:
        config, ignored = allocator_config_from_env()
    import hashlib

    t0 = time.perf_counter()
    frame = timeline.frame
    ranks: dict[str, Any] = {}
    seen: dict[bytes, dict[str, Any]] = {}  # ranks with the same events (often: one stage's ranks) replay once
    for r in timeline.ranks:
        ev = frame[frame["rank"] == r]
        ids, deltas, step = ev["id"].to_numpy(), ev["delta_bytes"].to_numpy(), ev["step"].to_numpy()
        base = timeline.base_bytes.get(r, 0)
        key = hashlib.blake2b(b"".join(np.ascontiguousarray(a).tobytes() for a in (ids, deltas, step))
                              + str(base).encode(), digest_size=16).digest()
        if key not in seen:
            rep = replay(ids, deltas, config, base_bytes=base)
            steps = rep.by_step(step)
            seen[key] = {**rep.summary(), "flagged": rep.overhead > FLAG_OVERHEAD,
                         "flagged_steps": [s["step"] for s in steps if s["flagged"]], "steps": steps}
        ranks[str(r)] = seen[key]
    settings = config.to_dict()
    settings.pop("capacity", None)
    timeline.meta["allocator"] = {
        "model": "torch's CUDA caching allocator (workbench.memory.allocator)", "settings": settings,
        "ignored_settings": ignored, "flag_overhead": FLAG_OVERHEAD,
        "flagged_ranks": [int(r) for r, v in ranks.items() if v["flagged"] or v["flagged_steps"]],
        "replay_s": round(time.perf_counter() - t0, 3), "ranks": ranks}
    return timeline


def reserved_per_rank(timeline: MemoryTimeline) -> pd.Series:
    """Predicted reserved peak (``max_memory_reserved``) of every rank of the job (a CUDA prediction's
    representatives expanded by its rank_map); a timeline without the allocator's figures gets them first."""
    if "allocator" not in timeline.meta:
        add_reserved(timeline)
    per = timeline.meta["allocator"]["ranks"]
    peaks = {int(r): int(v["peak_reserved"]) for r, v in per.items()}
    rank_map = timeline.meta.get("rank_map")
    if rank_map:
        peaks = {int(k): peaks[int(v)] for k, v in rank_map.items() if int(v) in peaks}
    return pd.Series(dict(sorted(peaks.items())), name="reserved_bytes").rename_axis("rank")


# --------------------------------------------------------------------------------------------------
# A part of the distinct ranks (in this process or a worker: workbench.prediction.workers)
# --------------------------------------------------------------------------------------------------


def predict_part(job: JobConfig, ranks: list[int], device: str, steps: int | None, exact: bool, fold: bool = True,
                 routing: Any = None) -> MemoryTimeline:
    """The timelines of ``ranks`` (distinct ranks of ``job``) in one MemoryTimeline, their folds in its meta,
    and for CUDA their caching allocator replay (:func:`add_reserved`), which :func:`predict` joins."""
    timelines = [_predict_rank(job, r, device, steps, exact, fold, routing) for r in ranks]
    tl = MemoryTimeline.concat(timelines, source="predicted", device=device)
    if _folded(timelines):
        tl.meta["folded"] = _folded(timelines)
    if device == "cuda":
        add_reserved(tl)
    return tl


def _merge_allocator(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``meta["allocator"]`` from those :func:`add_reserved` gave parts of the ranks (same settings):
    what it gives for all of them at once (``replay_s``: the parts' sum)."""
    ranks = {str(r): v for r, v in sorted(((int(r), v) for p in parts for r, v in p["ranks"].items()))}
    out = {k: v for k, v in parts[0].items() if k not in ("flagged_ranks", "replay_s", "ranks")}
    out["flagged_ranks"] = [int(r) for r, v in ranks.items() if v["flagged"] or v["flagged_steps"]]
    out["replay_s"] = round(sum(p["replay_s"] for p in parts), 3)
    out["ranks"] = ranks
    return {k: out[k] for k in parts[0]}  # the keys in add_reserved's order


if __name__ == "__main__":
    from workbench.prediction.workers import _main

    sys.exit(_main(sys.argv[1:]))
