"""Training throughput of each 2-process layout, as a ratio to a 1-process run measured in the same session.

    python benchmarks/bench_train.py                 # tiny preset, 30 steps (5 dropped), 2 repeats
    python benchmarks/bench_train.py --quick --repeats 1
    python benchmarks/bench_train.py --repeats 3 --max-other-cpu 0.1   # on a machine others also use

Configurations: ``single`` (the baseline: one process, as many OpenMP threads as the launcher gives it),
``single_1thread`` (the same with ``OMP_NUM_THREADS=1``, for reference), and the 2-process layouts ``ddp``
(dp_replicate=2), ``fsdp2`` (dp_shard=2), ``tp`` (tp=2) and ``tp_sp`` (tp=2 with sequence parallel).

Every configuration goes through ``workbench.launch`` (torchrun; gloo on CPU), exactly as the CLI and the
dashboard run it. Throughput is steady state: the first ``--warmup`` steps of a run are dropped and the
median of rank 0's per-step ``tokens_per_s`` (global tokens per second) over the rest is the run's figure.
Repeats are interleaved (single, single_1thread, ddp, ..., single, ...) so slow drift of the machine lands
on every configuration alike. Each configuration reports the median over repeats, its spread (min, max,
relative spread) and ``ratio`` = its median / the baseline's median. Each run also records the share of
the CPU that other processes took while it ran (``other_cpu_share``): a shared machine shows up in the
numbers instead of silently skewing them.

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run from a source checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASELINE = "single"

# name -> launch() layout settings. The baseline comes first.
LAYOUTS: dict[str, dict[str, Any]] = {
    "single": dict(nproc=1),
    # Not a parallel layout: the baseline again with one OpenMP thread, as each rank of a 2-process run
    # gets on 2 cores. It separates "two processes" from "two threads" in the ratios below.
    "single_1thread": dict(nproc=1),
    "ddp": dict(nproc=2, dp_replicate=2, dp_shard=1),
    "fsdp2": dict(nproc=2, dp_shard=2),
    "tp": dict(nproc=2, dp_shard=1, tp=2),
    "tp_sp": dict(nproc=2, dp_shard=1, tp=2, sequence_parallel=True),
}

# Environment a configuration runs under, on top of this process's (the launcher passes it to the ranks).
ENV: dict[str, dict[str, str]] = {"single_1thread": {"OMP_NUM_THREADS": "1"}}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def omp_threads_per_rank(name: str) -> int:
    """What the launcher gives each rank: OMP_NUM_THREADS if it is set, else usable CPUs // nproc."""
    from workbench.cpu_quota import threads_per_rank

    nproc = LAYOUTS[name]["nproc"]
    omp = ENV.get(name, {}).get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if omp:
        return int(omp)
    return threads_per_rank(nproc)


def machine_info() -> dict[str, Any]:
    import torch

    from workbench.cpu_quota import usable_cpus

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),  # affinity and the cgroup CPU quota: what the launcher divides
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy_env": os.environ.get("OMP_WAIT_POLICY"),
        "omp_note": (
            "the launcher sets OMP_NUM_THREADS = usable_cpus // nproc for each rank unless OMP_NUM_THREADS is "
            "already set; a 1-process run gets all cores, each rank of a 2-process run gets half"
        ),
    }
    if hasattr(os, "getloadavg"):  # other work on the machine skews every figure; record how busy it was
        info["loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:  # the CPU model, where Linux tells us
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its reaped descendants)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system [idle iowait] irq softirq steal
    own = sum(os.times()[:4])  # self + children (a reaped torchrun agent includes its ranks)
    return busy / os.sysconf("SC_CLK_TCK"), own


def steady_tokens_per_s(metrics, warmup: int) -> dict[str, float]:
    """Median of rank 0's per-step tokens/s and step time after dropping the first ``warmup`` steps."""
    r0 = metrics[metrics["rank"] == 0].sort_values("step")
    steady = r0[r0["step"] >= warmup]
    if steady.empty:
        raise RuntimeError(f"no steady-state steps: {len(r0)} steps logged, warmup={warmup}")
    return {
        "tokens_per_s": float(steady["tokens_per_s"].median()),
        "step_time_s": float(steady["step_time_s"].median()),
        "steps_measured": int(len(steady)),
    }


def run_once(preset: str, name: str, train: dict[str, Any], warmup: int, timeout: float) -> dict[str, float]:
    from workbench.train.launcher import launch

    env = ENV.get(name, {})
    saved = {k: os.environ.get(k) for k in env}
    cpu0, t0 = _cpu_seconds(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as out:
        os.environ.update(env)  # launch() hands this process's environment to torchrun
        try:
            run = launch(preset, out=out, **LAYOUTS[name], **train)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        run.wait(timeout)  # raises RunFailed (naming the rank) or TimeoutError (after stopping the ranks)
        result = steady_tokens_per_s(run.metrics, warmup)
    cpu1, wall = _cpu_seconds(), time.monotonic() - t0
    if cpu0 is not None and cpu1 is not None:
        # CPU the rest of the machine used while this run went on, as a share of all cores.
        other = (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
        result["other_cpu_share"] = max(0.0, other / (wall * (os.cpu_count() or 1)))
    return result


def summarize(values: list[float]) -> dict[str, Any]:
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / med if med else float("nan"),
        "runs": values,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    p.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="leading steps dropped from each run (default: 5)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, whatever the layout")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration (default: 2)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated subset of {list(LAYOUTS)}; the baseline {BASELINE!r} is always run")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    p.add_argument("--max-other-cpu", type=float, default=None, metavar="SHARE",
                   help="on a shared machine: redo a run (up to 3 more times) when other processes used more "
                        "than this share of all cores during it, e.g. 0.1; discarded runs are counted")
    p.add_argument("--quick", action="store_true", help="smoke test: 4 steps, 1 dropped")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 4, 1
    if args.steps <= args.warmup:
        p.error(f"--steps={args.steps} must exceed --warmup={args.warmup} to leave steady-state steps")
    if args.repeats < 1:
        p.error(f"--repeats={args.repeats} must be at least 1")
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {list(LAYOUTS)}")
    names = [BASELINE] + [n for n in LAYOUTS if n in names and n != BASELINE]

    from workbench.train.launcher import build_job

    train = dict(steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len)
    layouts = {}
    for name in names:  # validate every configuration before starting any run
        try:
            job = build_job(args.preset, **LAYOUTS[name], **train)
        except ValueError as e:
            p.error(f"{name}: {e}")
        layouts[name] = job.parallel.describe()

    machine = machine_info()
    if machine.get("loadavg_1m_at_start", 0) > 0.5 * (os.cpu_count() or 1):
        _log(f"warning: load average {machine['loadavg_1m_at_start']} on {os.cpu_count()} cores; "
             "if other processes keep the CPU busy the figures are skewed (each run reports other_cpu_share)")
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    discarded: dict[str, int] = {n: 0 for n in names}
    t_start = time.time()
    for rep in range(args.repeats):
        for name in names:
            for attempt in range(4 if args.max_other_cpu is not None else 1):
                _log(f"[{rep + 1}/{args.repeats}] {name:<14} ({layouts[name]}) ...")
                r = run_once(args.preset, name, train, args.warmup, args.timeout)
                other = r.get("other_cpu_share")
                note = f", other processes used {other:.0%} of the CPU" if other is not None else ""
                _log(f"    {r['tokens_per_s']:10.0f} tokens/s  ({r['step_time_s'] * 1e3:.1f} ms/step{note})")
                if args.max_other_cpu is None or other is None or other <= args.max_other_cpu or attempt == 3:
                    break
                discarded[name] += 1
                _log(f"    discarded: more than {args.max_other_cpu:.0%} of the CPU went to other processes")
            results[name].append(r)

    base = statistics.median(r["tokens_per_s"] for r in results[BASELINE])
    configs = {}
    for name in names:
        tps = summarize([r["tokens_per_s"] for r in results[name]])
        nproc = LAYOUTS[name]["nproc"]
        configs[name] = {
            "layout": layouts[name],
            "settings": {**LAYOUTS[name], **({"env": ENV[name]} if name in ENV else {})},
            "nproc": nproc,
            "omp_threads_per_rank": omp_threads_per_rank(name),
            "tokens_per_s": tps,
            "step_time_s": statistics.median(r["step_time_s"] for r in results[name]),
            "other_cpu_share_max": max((r.get("other_cpu_share", 0.0) for r in results[name]), default=0.0),
            "runs_discarded": discarded[name],
            "ratio": tps["median"] / base,
            "ratio_min": tps["min"] / base,
            "ratio_max": tps["max"] / base,
        }

    doc = {
        "benchmark": "bench_train",
        "metric": "tokens_per_s: global tokens (global_batch * seq_len) per second of step time, "
                  "rank 0, median over steady-state steps, then median over repeats",
        "baseline": BASELINE,
        "preset": args.preset,
        "steps": args.steps,
        "warmup_steps_dropped": args.warmup,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "repeats": args.repeats,
        "max_other_cpu": args.max_other_cpu,
        "quick": args.quick,
        "wall_s": round(time.time() - t_start, 1),
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "other_cpu_share_max": max(c["other_cpu_share_max"] for c in configs.values()),
        "other_cpu_note": "share of all cores used by other processes during the runs (from /proc/stat minus "
                          "this benchmark's own process tree); above a few percent the machine was shared "
                          "and the figures, the baseline's most of all, are not clean",
        "machine": machine,
        "configs": configs,
    }
    assert math.isclose(configs[BASELINE]["ratio"], 1.0)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
