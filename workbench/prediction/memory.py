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
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.cpu_quota import usable_cpus
from workbench.memory.recorder import MemoryRecorder
from workbench.memory.timeline import MemoryTimeline
from workbench.units import parse_bytes

__all__ = ["predict", "peak_per_rank", "fits", "FitAnswer"]


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
            nproc: int | None = None, fold: bool = True, **settings) -> MemoryTimeline:
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
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: predict for 'cpu' or 'cuda'")
    job = _job(job, parallel, train, nproc, **settings)
    from workbench.prediction.fake import distinct_ranks

    rank_map = distinct_ranks(job)
    reps = sorted(set(rank_map.values())) if ranks is None else sorted({rank_map[_check_rank(r, rank_map)]
                                                                         for r in ranks})
    if workers is None:
        workers = min(usable_cpus(), len(reps)) if job.model.n_params >= 1e9 else 1
    workers = max(1, min(workers, len(reps)))
    t0 = time.perf_counter()
    if dist.is_initialized() or workers > 1:  # a real group here cannot coexist with the fake one
        parts = [reps[i::workers] for i in range(workers)]
        timelines = _predict_in_subprocesses(job, device, parts, steps, exact, fold)
    else:
        timelines = [_predict_rank(job, r, device, steps, exact, fold) for r in _progress(reps, job, progress)]
    meta = {"rank_map": {str(k): int(v) for k, v in rank_map.items() if v in reps},
            "model": job.model.name, "layout": job.parallel.describe(), "world_size": job.parallel.world_size,
            "exact": exact, "prediction_s": round(time.perf_counter() - t0, 3),
            "job": {"model": job.model.to_dict(), "parallel": job.parallel.to_dict(), "train": job.train.to_dict()}}
    tl = MemoryTimeline.concat(timelines, source="predicted", device=device)
    tl.meta.update(meta)
    folded = _folded(timelines)
    if folded:
        tl.meta["folded"] = folded
    tl.meta.pop("recording_overhead_s", None)
    return tl


def _predict_rank(job: JobConfig, rank: int, device: str, steps: int | None, exact: bool,
                  fold: bool = True) -> MemoryTimeline:
    """One distinct rank: the recorder on top of the fake step (``workbench.prediction.fake``). Unless
    ``exact``, a stage of many identical blocks is simulated with 4 and folded out to all of them
    (``workbench.prediction.fold``); where the fold's checks refuse, every block is simulated."""
    from workbench.prediction.fake import run_fake_steps
    from workbench.prediction.fold import FoldError, fold_plan, fold_rows

    plan = fold_plan(job, rank) if fold and not exact else None

    # Fake CUDA tensors need a CUDA build and a GPU (autograd's engine and FSDP2 set up streams even for
    # fake tensors). Without one, the step runs on fake CPU tensors and the blocks are counted as CUDA's
    # caching allocator rounds them; kernels that save different tensors on CUDA than on CPU (attention's
    # saved statistics) are then the CPU's.
    sim = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    accumulates = job.parallel.pp > 1 or job.train.grad_accum(job.parallel.dp) > 1
    if steps is None:
        steps = min(2, job.train.steps) if exact or not accumulates else 1
    warm = not exact and accumulates and steps == 1
    rec = MemoryRecorder(rank=rank, device=sim, clock="sequence", source="predicted", allocator=device,
                         blocks=plan is not None)
    run_fake_steps(plan.job if plan else job, rank, device=sim, steps=steps, mode_factory=lambda: rec,
                   on_built=lambda model, opt: rec.track(model=model, optimizer=opt),
                   microbatches="all" if exact else "peak", warm_start=warm)
    meta: dict[str, Any] = {}
    if plan is not None:
        try:
            folded = fold_rows(rec.events, rec.categories, rec.blocks, plan.simulated, plan.real, rec.round_bytes)
        except FoldError:
            return _predict_rank(job, rank, device, steps, exact, fold=False)
        rec.set_events(folded.rows, folded.categories)
        meta["folded"] = {str(rank): folded.info}
    if device == "cuda":
        workspaces = cublas_workspace_bytes()
        if rec.library_block(workspaces, "cuBLAS workspaces"):
            meta["library_bytes"] = {"cuBLAS workspaces": workspaces}
    return rec.timeline(steps=steps, simulated_on=sim, warm_start=warm, **meta)


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


@dataclasses.dataclass(frozen=True)
class FitAnswer:
    """Whether a job fits in ``budget_bytes`` per rank, and the largest micro batch that does."""

    budget_bytes: int
    peak_bytes: int  # the job as given, the worst rank
    fits: bool
    micro_batch: int | None  # the largest local micro batch that fits (None: not even 1)
    peak_at_micro_batch: int | None
    tried: dict[int, int]  # micro batch -> predicted worst-rank peak

    def __str__(self) -> str:
        from workbench.units import format_bytes

        verdict = "fits" if self.fits else "does not fit"
        mb = (f"largest micro batch that fits: {self.micro_batch} (peak {format_bytes(self.peak_at_micro_batch)})"
              if self.micro_batch else "no micro batch fits")
        return f"{verdict} in {format_bytes(self.budget_bytes)}: peak {format_bytes(self.peak_bytes)}; {mb}"


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
         progress: bool = False, **settings) -> FitAnswer:
    """Does the job fit in ``budget`` per rank (bytes, or text like ``"80GiB"``), and what is the largest
    micro batch that does? Peak memory grows about linearly with the micro batch, so two predictions
    give the line, and the candidate it points at is checked with a real prediction (and stepped down
    until one fits)."""
    job = _job(job, **settings)
    budget_bytes = parse_bytes(budget)
    tried: dict[int, int] = {}

    def peak(m: int) -> int:
        if m not in tried:
            tl = predict(_with_micro(job, m), device=device, progress=progress)
            tried[m] = int(peak_per_rank(tl).max())
        return tried[m]

    base = predict(job, device=device, progress=progress)
    job_peak = int(peak_per_rank(base).max())
    local = job.train.global_batch // job.parallel.dp
    own = local // job.parallel.pp_microbatches if job.parallel.pp > 1 else job.train.local_micro_batch(job.parallel.dp)
    tried[own] = job_peak  # the job as given is one of the sizes: no need to predict it twice
    choices = _micro_choices(job)
    if not choices:
        return FitAnswer(budget_bytes, job_peak, job_peak <= budget_bytes, None, None, tried)
    lo = choices[0]
    p_lo = peak(lo)
    best = None
    if p_lo <= budget_bytes:
        if len(choices) == 1:
            best = lo
        else:
            hi = choices[1]
            slope = max(1.0, (peak(hi) - p_lo) / (hi - lo))
            guess = lo + (budget_bytes - p_lo) / slope
            ordered = sorted((m for m in choices if m <= guess), reverse=True) or [lo]
            for m in ordered:
                if peak(m) <= budget_bytes:
                    best = m
                    break
            # the line may be pessimistic: try the next size up once
            bigger = [m for m in choices if best is not None and m > best]
            if bigger and peak(bigger[0]) <= budget_bytes:
                best = bigger[0]
    return FitAnswer(budget_bytes, job_peak, job_peak <= budget_bytes, best,
                     tried.get(best) if best else None, dict(sorted(tried.items())))


# --------------------------------------------------------------------------------------------------
# In a subprocess (this process already has a real process group)
# --------------------------------------------------------------------------------------------------


def _predict_in_subprocesses(job: JobConfig, device: str, parts: list[list[int]], steps: int | None,
                             exact: bool, fold: bool = True) -> list[MemoryTimeline]:
    """Predict each part of the distinct ranks in its own process, all at once (fake steps are CPU-bound
    Python; a process with a real process group cannot hold a fake one either)."""
    with tempfile.TemporaryDirectory(prefix="workbench-predict-") as d:
        cfg = os.path.join(d, "job.json")
        with open(cfg, "w") as f:
            f.write(job.to_json())
        procs = []
        for i, part in enumerate(parts):
            ranks = os.path.join(d, f"ranks{i}")  # a file: thousands of ranks overflow one argument (E2BIG)
            with open(ranks, "w") as f:
                f.write(",".join(map(str, part)))
            cmd = [sys.executable, "-m", "workbench.prediction.memory", cfg, os.path.join(d, f"out{i}"), device,
                   "" if steps is None else str(steps), "1" if exact else "0", ranks, "1" if fold else "0"]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
        failures = []
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                failures.append((err.strip().splitlines() or ["no output"])[-1])
        if failures:
            raise RuntimeError(f"memory prediction in a subprocess failed: {failures[0]}")
        return [MemoryTimeline.load(os.path.join(d, f"out{i}")) for i in range(len(parts))]


def _main(argv: list[str]) -> int:
    cfg, out, device, steps, exact, ranks, fold = argv
    job = JobConfig.load(cfg)
    with open(ranks) as f:
        ranks_list = [int(r) for r in f.read().split(",")]
    timelines = [_predict_rank(job, r, device, int(steps) if steps else None, exact == "1", fold == "1")
                 for r in ranks_list]
    tl = MemoryTimeline.concat(timelines, source="predicted", device=device)
    if _folded(timelines):
        tl.meta["folded"] = _folded(timelines)
    tl.save(out)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
