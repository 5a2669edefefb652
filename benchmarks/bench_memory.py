"""Memory timelines: how close the prediction is to the measurement, and what recording and importing cost.

    python benchmarks/bench_memory.py            # the full grid (16 layouts), overhead, 70b, 1 GB import
    python benchmarks/bench_memory.py --quick    # 2 layouts, a short overhead run, 100 MB import

Six figures, each against a baseline measured in the same run:

- ``prediction``: for every layout of the grid (2 and 4 processes on CPU, mixing dp/fsdp/tp/sp/pp/ep,
  activation checkpointing, bf16 and ZeRO), a real ``workbench.launch(..., memory=True)`` run records
  each rank's timeline (the baseline: what was measured), and ``workbench.memory.predict`` predicts
  the same job on fake tensors. The error of a rank is ``predicted_peak / measured_peak - 1``; the
  document gives every rank's, and the median and max of their absolute values. A mixture-of-experts
  layout (ep2_moe) also gets its routing band (``predict_band``: balanced to the default capacity
  factor; ``band``: band_low, band_high, measured and contains per rank) and the prediction with the
  run's own measured routing (``measured_routing``: its error against the same measured peak).
- ``recording_overhead``: median step time of the same run with ``--memory`` divided by without it
  (the baseline), steady-state steps only.
- ``predict_70b``: seconds (wall, and CPU of this process and its workers) to predict llama-70b on 1024
  ranks (every distinct rank), and the ratio to the 10 s target (issue 32; 30 s before).
- ``predict_8b``: the same for an HF-like Llama 3.1 8B on 8 FSDP ranks at seq 8192 with layer-level
  selective checkpointing (one distinct rank; issue 32's 44 s), against the 10 s target.
- ``import``: seconds and peak RSS to import a generated snapshot of ``--import-mb`` MB (in a fresh
  process, so RSS is its own), as ratios to the 60 s and 2 GB targets.
- ``import_padding``: MB/s of importing a 40 MB snapshot padded with DUP POP pairs (issue 27: it had no
  answer after 150 s), as a ratio to the MB/s of a generated snapshot of the same size imported in the
  same process (the baseline).

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> launch() settings; steps/global_batch/seq_len are shared (TRAIN) unless given here.
GRID: dict[str, dict[str, Any]] = {
    "ddp2": dict(nproc=2, dp_replicate=2, dp_shard=1),
    "fsdp2": dict(nproc=2, dp_shard=2),
    "tp2": dict(nproc=2, dp_shard=1, tp=2),
    "tp2_sp": dict(nproc=2, dp_shard=1, tp=2, sequence_parallel=True),
    "pp2_gpipe": dict(nproc=2, dp_shard=1, pp=2, pp_schedule="GPipe", microbatches=4),
    "pp2_1f1b": dict(nproc=2, dp_shard=1, pp=2, pp_schedule="1F1B", microbatches=4),
    "ep2_moe": dict(model="tiny-moe", nproc=2, dp_shard=2, ep=2),
    "fsdp2_ac_full": dict(nproc=2, dp_shard=2, activation_checkpointing="full"),
    "ddp2_ac_selective": dict(nproc=2, dp_replicate=2, dp_shard=1, activation_checkpointing="selective"),
    "fsdp2_bf16": dict(nproc=2, dp_shard=2, mixed_precision="bf16"),
    "zero1": dict(nproc=2, dp_shard=2, zero=1),
    "zero2": dict(nproc=2, dp_shard=2, zero=2),
    "fsdp2_accum": dict(nproc=2, dp_shard=2, micro_batch=2),
    "hsdp4": dict(nproc=4, dp_replicate=2, dp_shard=2),
    "fsdp2_tp2": dict(nproc=4, dp_shard=2, tp=2),
    "pp2_tp2_1f1b": dict(nproc=4, dp_shard=1, tp=2, pp=2, pp_schedule="1F1B", microbatches=4),
}
QUICK = ("fsdp2", "tp2_sp")
TRAIN = dict(steps=3, global_batch=8, seq_len=64)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def run_grid(names: list[str], work: Path) -> dict[str, Any]:
    import workbench
    from workbench.memory import compare, load, predict

    rows: dict[str, Any] = {}
    errors: list[float] = []
    for name in names:
        settings = dict(GRID[name])
        model = settings.pop("model", "tiny")
        settings = {**TRAIN, **settings}
        _log(f"[grid] {name}: record")
        run = workbench.launch(model, out=work / name, memory=True, **settings)
        run.wait(timeout=600)
        measured = load(run.run_dir)
        _log(f"[grid] {name}: predict")
        t0 = time.perf_counter()
        predicted = predict(run.job, progress=False)
        predict_s = time.perf_counter() - t0
        table = compare(measured, predicted).to_frame()
        per_rank = {int(r.rank): {"measured": int(r.measured_peak), "predicted": int(r.predicted_peak),
                                  "error": float(r.error)} for r in table.itertuples()}
        errors += [abs(v["error"]) for v in per_rank.values()]
        rows[name] = {"layout": run.job.parallel.describe(), "model": model, "ranks": per_rank,
                      "max_abs_error": max(abs(v["error"]) for v in per_rank.values()),
                      "predict_s": round(predict_s, 2)}
        if run.job.model.n_experts:
            rows[name].update(moe_rows(run, measured, predicted))
        _log(f"[grid] {name}: max |error| {rows[name]['max_abs_error']:.4f}")
    return {"baseline": "measured peak (train --memory, CPU recorder)", "layouts": rows,
            "median_abs_error": statistics.median(errors), "max_abs_error": max(errors), "ranks_compared": len(errors)}


def moe_rows(run, measured, balanced) -> dict[str, Any]:
    """A MoE layout's band (the balanced prediction, low, to the default skew, high) against the measured
    peak of every rank, and the prediction with the run's own measured routing against it."""
    from workbench.memory import compare, predict
    from workbench.prediction.routing import DEFAULT_CAPACITY_FACTOR, MemoryBand, RoutingSkew

    m = run.job.model
    skew = min(DEFAULT_CAPACITY_FACTOR, m.n_experts / m.top_k)
    _log(f"[grid] band: predict with capacity factor {skew:g}")
    band = MemoryBand(balanced, predict(run.job, routing=RoutingSkew(skew), progress=False), skew)
    inside = band.contains(measured)
    _log("[grid] predict with the run's measured routing")
    t0 = time.perf_counter()
    routed = predict(run.job, routing=run, progress=False)
    routed_s = time.perf_counter() - t0
    table = compare(measured, routed).to_frame()
    errors = {int(r.rank): {"measured": int(r.measured_peak), "predicted": int(r.predicted_peak),
                            "error": float(r.error)} for r in table.itertuples()}
    return {"band": {"capacity_factor": skew, "contains": bool(inside["contains"].all()),
                     "ranks": {int(r.rank): {"band_low": int(r.band_low), "band_high": int(r.band_high),
                                             "measured": int(r.measured), "contains": bool(r.contains)}
                               for r in inside.itertuples()}},
            "measured_routing": {"routing": routed.meta.get("routing"), "ranks": errors,
                                 "max_abs_error": max(abs(v["error"]) for v in errors.values()),
                                 "predict_s": round(routed_s, 2)}}


def recording_overhead(work: Path, quick: bool) -> dict[str, Any]:
    import workbench

    settings = dict(model="small", nproc=1, steps=6 if quick else 12, global_batch=8, seq_len=256)
    out: dict[str, list[float]] = {"without": [], "with": []}
    repeats = 1 if quick else 2
    for i in range(repeats):
        for key, mem in (("without", False), ("with", True)):
            s = dict(settings)
            model = s.pop("model")
            run = workbench.launch(model, out=work / f"overhead_{key}_{i}", memory=mem, **s)
            run.wait(timeout=900)
            m = run.metrics
            times = m[(m["rank"] == 0) & (m["step"] >= 2)]["step_time_s"].tolist()  # steady state
            out[key].append(statistics.median(times))
            _log(f"[overhead] {key} memory: {out[key][-1]:.3f} s/step")
    base, rec = statistics.median(out["without"]), statistics.median(out["with"])
    return {"baseline": "the same run without --memory", "model": "small", "step_time_s_without": base,
            "step_time_s_with": rec, "ratio": rec / base, "target_ratio": 1.10}


def _timed_prediction(model: Any, target_s: float, **settings) -> dict[str, Any]:
    from workbench.memory import peak_per_rank, predict

    t0, c0 = time.perf_counter(), os.times()
    tl = predict(model, device="cuda", progress=False, **settings)
    seconds, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user) + \
        (c1.children_system - c0.children_system)
    peaks = peak_per_rank(tl)
    return {"baseline": f"the {target_s:g} s target", "layout": tl.meta["layout"], "world_size": tl.meta["world_size"],
            "distinct_ranks": len(tl.ranks), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "ratio": seconds / target_s, "load_average": os.getloadavg()[0], "folded": len(tl.meta.get("folded", {})),
            "max_peak_bytes": int(peaks.max()), "min_peak_bytes": int(peaks.min())}


def predict_70b() -> dict[str, Any]:
    return _timed_prediction("llama-70b", 10.0, nproc=1024, dp_shard=32, tp=8, pp=4, pp_schedule="1F1B",
                             microbatches=8, sequence_parallel=True, activation_checkpointing="full",
                             mixed_precision="bf16", train=dict(global_batch=256, seq_len=4096, steps=2))


# an HF-like config of Llama 3.1 8B (what torchtitan's published 8B memory figures train)
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def predict_8b(work: Path) -> dict[str, Any]:
    path = work / "llama31-8b" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LLAMA31_8B))
    return _timed_prediction(str(path), 10.0, nproc=8, dp_shard=8, activation_checkpointing="selective",
                             mixed_precision="bf16", train=dict(global_batch=16, seq_len=8192))


def import_snapshot(work: Path, megabytes: int) -> dict[str, Any]:
    from workbench.memory.snapshot import write_synthetic_snapshot

    path = work / "snapshot.pickle"
    t0 = time.perf_counter()
    write_synthetic_snapshot(path, megabytes * 2**20)
    write_s = time.perf_counter() - t0
    code = ("import json, sys; from workbench.memory.snapshot import measure_import; "
            f"print(json.dumps(measure_import({str(path)!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "import failed")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"baseline": "the 60 s and 2 GB targets", "file_bytes": path.stat().st_size,
            "generate_s": round(write_s, 1), **m, "time_ratio": m["seconds"] / 60.0,
            "rss_ratio": m["rss_bytes"] / 2**31}


def import_padding(work: Path, megabytes: int = 40) -> dict[str, Any]:
    from workbench.memory.snapshot import write_synthetic_snapshot

    real, padded = work / "real.pickle", work / "padded.pickle"
    write_synthetic_snapshot(real, megabytes * 2**20)
    with open(padded, "wb") as f:  # {"segments": [], "device_traces": [[]]}, DUP POP x N in the middle
        f.write(b"\x80\x04}(\x8c\x08segments]\x8c\x0ddevice_traces]]N")
        for _ in range(megabytes):
            f.write(b"20" * (1 << 19))
        f.write(b"0au.")
    code = ("import json; from workbench.memory.snapshot import measure_import; "
            f"print(json.dumps([measure_import(p) for p in ({str(real)!r}, {str(padded)!r}, {str(real)!r})]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "import failed")
    first, pad, second = json.loads(proc.stdout.strip().splitlines()[-1])
    real_s = min(first["seconds"], second["seconds"])  # the real file twice: the first pays warm-up
    real_mbs, pad_mbs = real.stat().st_size / real_s / 1e6, padded.stat().st_size / pad["seconds"] / 1e6
    return {"baseline": "a generated snapshot of the same size, same process", "padded_bytes": padded.stat().st_size,
            "padded_s": round(pad["seconds"], 3), "padded_mb_per_s": round(pad_mbs, 1), "real_s": round(real_s, 3),
            "real_mb_per_s": round(real_mbs, 1), "ratio": round(pad_mbs / real_mbs, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layouts, a short overhead run, a 100 MB import")
    ap.add_argument("--layouts", default=None, help="comma list of grid layouts (default: all, or the quick two)")
    ap.add_argument("--import-mb", type=int, default=None, help="snapshot size to import (default 1024; quick 100)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: grid,overhead,70b,8b,import,padding")
    args = ap.parse_args()
    names = args.layouts.split(",") if args.layouts else list(QUICK if args.quick else GRID)
    unknown = [n for n in names if n not in GRID]
    if unknown:
        print(f"error: unknown layouts {unknown}; choose from {list(GRID)}", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    doc: dict[str, Any] = {"benchmark": "bench_memory", "quick": args.quick, "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as d:
        work = Path(d)
        if "grid" not in skip:
            doc["prediction"] = run_grid(names, work)
        if "overhead" not in skip:
            doc["recording_overhead"] = recording_overhead(work, args.quick)
        if "70b" not in skip:
            doc["predict_70b"] = predict_70b()
        if "8b" not in skip:
            doc["predict_8b"] = predict_8b(work)
        if "import" not in skip:
            doc["import"] = import_snapshot(work, args.import_mb or (100 if args.quick else 1024))
        if "padding" not in skip:
            doc["import_padding"] = import_padding(work)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
