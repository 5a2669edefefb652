"""Peak memory per pipeline stage of each pp=2 schedule, as a ratio to GPipe measured in the same session.

    python benchmarks/bench_parallel.py                 # tiny preset, seq_len 128, 8 microbatches, 2 repeats
    python benchmarks/bench_parallel.py --quick --repeats 1     # smoke test: GPipe, 1F1B, GPipeLean only
    python benchmarks/bench_parallel.py --preset small --microbatches 16 --global-batch 32

Schedules: ``GPipe`` (the baseline: every microbatch's forward, then every backward, so each stage holds
the activations of all m microbatches), ``1F1B`` (a backward as soon as possible: stage s of p holds at most
p - s microbatches in flight), ``GPipeLean`` (GPipe that frees each stage output once it has been sent and
each microbatch's receive buffers once its backward has run) and, as an extra, ``Interleaved1F1B`` (2 stages
per rank). Every schedule runs the same model, seed, data, microbatches, sequence length and global batch,
through ``workbench.launch`` (torchrun; gloo on CPU), exactly as the CLI and the dashboard run it.

The memory figure is the ``peak_mem_bytes`` of each rank's ``step`` events, measured by
``workbench.memory.probe.PeakMemoryProbe`` while the schedule runs the step's forwards and backwards (CPU:
bytes of live tensor storages, seen through a dispatch mode; CUDA: ``torch.cuda.max_memory_allocated``).
It counts parameters and optimizer state too, so ``peak_above_state_bytes`` also subtracts what a rank
holds before the step starts, estimated as parameters + Adam's two moments (3 x parameter bytes): that
is the part the schedule decides (activations, gradients, send/receive buffers). A run's figure per stage
is the steady-state peak, the max over steps >= 1 (step 0 also allocates the optimizer state and infers the
stages' shapes); a schedule reports the max over repeats (CPU peaks repeat exactly; they are listed) and
``ratio`` = its peak / GPipe's peak, per stage.

Extras: step time (median over steps >= 1 of rank 0's ``step_time_s``, median over repeats, and its ratio to
GPipe), and the bubble fraction measured from the ``schedule`` events
(``workbench.parallel.pipeline_bubble.bubble_fraction``, mean over ranks and steps >= 1) next to the theory
(p - 1) / (v m + p - 1). Run times depend on how busy the machine is; the memory figures do not.

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import _cpu_seconds, _log, machine_info, summarize  # noqa: E402  (shared machine facts)

BASELINE = "GPipe"
SCHEDULES = ["GPipe", "1F1B", "GPipeLean", "Interleaved1F1B"]  # the baseline comes first
QUICK_SCHEDULES = SCHEDULES[:3]  # the extra costs a fourth launch (~10 s), too much for a smoke test
PP = 2
MiB = 2**20

DESCRIPTION = {
    "GPipe": "all forwards, then all backwards: each stage holds m microbatches of activations",
    "1F1B": "one forward, one backward: stage s of p holds at most p - s microbatches",
    "GPipeLean": "GPipe that frees sent stage outputs and, after each backward, that microbatch's receive buffers",
    "Interleaved1F1B": "1F1B over 2 stages per rank (stage s on rank s mod p)",
}


def _dtype_bytes(name: str) -> int | None:
    import torch

    dtype = getattr(torch, name, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def run_once(preset: str, schedule: str, train: dict[str, Any], microbatches: int, timeout: float) -> dict[str, Any]:
    from workbench.parallel.pipeline_bubble import bubble_fraction
    from workbench.train.events import read_events
    from workbench.train.launcher import launch

    cpu0, t0 = _cpu_seconds(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as out:
        run = launch(preset, out=out, nproc=PP, pp=PP, pp_schedule=schedule, microbatches=microbatches, **train)
        run.wait(timeout)  # raises RunFailed (naming the rank) or TimeoutError (after stopping the ranks)
        events = read_events(out)
    wall = time.monotonic() - t0

    steps = [e for e in events if e["type"] == "step"]
    steady = [e for e in steps if e["step"] >= 1]
    if not steady:
        raise RuntimeError(f"{schedule}: no steps >= 1 logged ({len(steps)} steps)")
    starts = {e["rank"]: e for e in events if e["type"] == "start"}
    stages = {e["rank"]: {int(s): layers for s, layers in e["stages"].items()}
              for e in events if e["type"] == "pipeline"}
    ranks: dict[str, Any] = {}
    for rank in sorted({e["rank"] for e in steps}):
        mine = [e for e in steady if e["rank"] == rank]
        peak = max(e["peak_mem_bytes"] for e in mine)
        nbytes = _dtype_bytes(starts[rank].get("param_dtype", "float32"))
        param_bytes = starts[rank]["local_params"] * nbytes if nbytes else None
        ranks[str(rank)] = {
            "stages": stages.get(rank, {}),
            "peak_mem_bytes": peak,
            "peak_mem_bytes_step0": next(e["peak_mem_bytes"] for e in steps if e["rank"] == rank and e["step"] == 0),
            "peak_mem_bytes_per_step": [e["peak_mem_bytes"] for e in sorted(mine, key=lambda e: e["step"])],
            "param_bytes": param_bytes,
            "peak_above_state_bytes": peak - 3 * param_bytes if param_bytes is not None else None,
        }
    r0 = sorted((e for e in steady if e["rank"] == 0), key=lambda e: e["step"])
    result = {
        "ranks": ranks,
        "step_time_s": statistics.median(e["step_time_s"] for e in r0),
        "bubble_fraction": bubble_fraction(events, skip_first=True),
        "wall_s": wall,
    }
    cpu1 = _cpu_seconds()
    if cpu0 is not None and cpu1 is not None:  # CPU that other processes took while this run went on
        other = (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
        result["other_cpu_share"] = max(0.0, other / (wall * (os.cpu_count() or 1)))
    return result


def _ratio(x: float | None, base: float | None) -> float | None:
    return x / base if x is not None and base else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--steps", type=int, default=6, help="steps per run; step 0 is dropped (default: 6)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step (default: 16)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline microbatches per step (default: 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs per schedule (default: 2)")
    p.add_argument("--schedules", default=None,
                   help=f"comma-separated subset of {SCHEDULES} (default: all; with --quick: {QUICK_SCHEDULES}); "
                        f"the baseline {BASELINE!r} is always run")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 3 steps, seq_len 64, global batch 8, 4 microbatches, no Interleaved1F1B")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seq_len, args.global_batch, args.microbatches = 3, 64, 8, 4
    if args.steps < 2:
        p.error(f"--steps={args.steps} must be at least 2: step 0 is dropped")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be at least 1")
    if args.schedules is None:
        args.schedules = ",".join(QUICK_SCHEDULES if args.quick else SCHEDULES)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    unknown = sorted(set(names) - set(SCHEDULES))
    if unknown:
        p.error(f"unknown schedule(s) {unknown}; choose from {SCHEDULES}")
    names = [BASELINE] + [n for n in SCHEDULES if n in names and n != BASELINE]

    from workbench.parallel.pipeline_bubble import theoretical_bubble
    from workbench.train.launcher import build_job

    train = dict(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, seed=args.seed)
    jobs = {}
    for name in names:  # validate every schedule before starting any run
        try:
            jobs[name] = build_job(args.preset, nproc=PP, pp=PP, pp_schedule=name,
                                   microbatches=args.microbatches, **train)
        except ValueError as e:
            p.error(f"{name}: {e}")
    model = jobs[BASELINE].model

    machine = machine_info()
    if machine.get("loadavg_1m_at_start", 0) > 0.5 * (os.cpu_count() or 1):
        _log(f"warning: load average {machine['loadavg_1m_at_start']} on {os.cpu_count()} cores; "
             "step times and bubbles are skewed by other work (peak memory is not)")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    t_start = time.time()
    for rep in range(args.repeats):  # interleaved, so slow drift of the machine lands on every schedule alike
        for name in names:
            _log(f"[{rep + 1}/{args.repeats}] {name:<16} (pp={PP}, m={args.microbatches}) ...")
            r = run_once(args.preset, name, train, args.microbatches, args.timeout)
            peaks = "  ".join(f"rank {k}: {v['peak_mem_bytes'] / MiB:7.2f} MiB" for k, v in r["ranks"].items())
            _log(f"    peak {peaks}   {r['step_time_s'] * 1e3:.0f} ms/step, bubble {r['bubble_fraction']:.2f}")
            results[name].append(r)

    def stage_peaks(name: str) -> dict[str, dict[str, Any]]:
        out = {}
        for rank in results[name][0]["ranks"]:
            per_run = [r["ranks"][rank] for r in results[name]]
            above = [x["peak_above_state_bytes"] for x in per_run]
            out[rank] = {
                "stages": per_run[0]["stages"],
                "peak_mem_bytes": max(x["peak_mem_bytes"] for x in per_run),
                "peak_mem_bytes_runs": [x["peak_mem_bytes"] for x in per_run],
                "peak_mem_bytes_step0": max(x["peak_mem_bytes_step0"] for x in per_run),
                "param_bytes": per_run[0]["param_bytes"],
                "peak_above_state_bytes": max(above) if None not in above else None,
            }
        return out

    base_peaks = stage_peaks(BASELINE)
    base_time = statistics.median(r["step_time_s"] for r in results[BASELINE])
    configs = {}
    for name in names:
        peaks = stage_peaks(name)
        for rank, s in peaks.items():
            b = base_peaks[rank]
            s["ratio"] = s["peak_mem_bytes"] / b["peak_mem_bytes"]
            s["peak_mem_mib"] = round(s["peak_mem_bytes"] / MiB, 2)
            s["ratio_above_state"] = _ratio(s["peak_above_state_bytes"], b["peak_above_state_bytes"])
        v = jobs[name].parallel.pp_stages_per_rank
        step_time = summarize([r["step_time_s"] for r in results[name]])
        bubble = summarize([r["bubble_fraction"] for r in results[name]])
        configs[name] = {
            "schedule": name,
            "description": DESCRIPTION[name],
            "layout": jobs[name].parallel.describe(),
            "stages_per_rank": v,
            "per_stage": peaks,  # keyed by pp rank; "stages" lists the layers of each stage on that rank
            "ratio_by_rank": {rank: s["ratio"] for rank, s in peaks.items()},
            "step_time_s": step_time,
            "step_time_ratio": step_time["median"] / base_time,
            "bubble_fraction_measured": bubble,
            "bubble_fraction_theory": theoretical_bubble(PP, args.microbatches, v),
            "other_cpu_share_max": max((r.get("other_cpu_share", 0.0) for r in results[name]), default=0.0),
        }

    micro_batch = args.global_batch // args.microbatches
    doc = {
        "benchmark": "bench_parallel",
        "metric": "peak_mem_bytes per pp rank (stage): bytes of live tensor storages (CPU; CUDA: "
                  "max_memory_allocated) during the step's pipeline forwards and backwards, max over steps >= 1, "
                  "max over repeats; ratio = schedule's peak / GPipe's peak on the same rank",
        "baseline": BASELINE,
        "preset": args.preset,
        "model": {"name": model.name, "n_params": model.n_params, "dim": model.dim, "n_layers": model.n_layers,
                  "vocab_size": model.vocab_size},
        "pp": PP,
        "nproc": PP,
        "microbatches": args.microbatches,
        "micro_batch_sequences": micro_batch,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "seed": args.seed,
        "steps": args.steps,
        "steps_dropped": 1,
        "repeats": args.repeats,
        "quick": args.quick,
        "schedules": names,
        "device": "cuda" if machine.get("cuda") else "cpu",
        "state_note": "peak_above_state_bytes = peak - 3 x param_bytes (parameters + Adam exp_avg, exp_avg_sq, "
                      "alive before the step starts): the part the schedule decides",
        "wall_s": round(time.time() - t_start, 1),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "other_cpu_share_max": max(c["other_cpu_share_max"] for c in configs.values()),
        "machine": machine,
        "configs": configs,
    }
    assert all(math.isclose(r, 1.0) for r in configs[BASELINE]["ratio_by_rank"].values())
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
