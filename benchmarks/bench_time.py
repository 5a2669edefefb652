"""Step time: how close the predicted step time of a layout is to the measured one, and published anchors.

    python benchmarks/bench_time.py                  # calibrate, 14 layouts of `small` on 4 gloo ranks, advisor, anchors
    python benchmarks/bench_time.py --quick          # calibrate --quick, 3 layouts, fewer steps
    python benchmarks/bench_time.py --layouts fsdp4,tp4 --no-anchors

The figures, each against a baseline measured in the same run:

- ``calibration``: ``workbench.time.calibrate`` runs first (this machine's matmul, elementwise, op overhead
  and gloo collectives on 2 and 4 ranks); every prediction below uses that profile (``device="cpu"``).
- ``layouts``: for each layout (dp, fsdp, hsdp, tp, tp+sp, pp GPipe and 1F1B, ep on a MoE preset, AC full
  and selective, micro batch), a real ``workbench.launch`` run on 4 gloo ranks (the CLI's path) is the
  baseline: its step time is the median over the steady steps (the first ``--warmup`` dropped) of the
  slowest rank's ``step_time_s`` in ``events.jsonl``. ``workbench.prediction.step_time.predict_time`` predicts
  the same job; ``ratio`` = predicted / measured and ``error`` = ratio - 1. The document gives
  ``median_abs_error`` and the Spearman rank correlation of predicted and measured over the layouts
  (targets: at most 0.10 and at least 0.9).
- ``advisor`` (when ``workbench.prediction.advise`` exists): its top pick for the same model on 4 ranks,
  measured (reused if it is one of the layouts, else run), as a ratio to the best measured layout of the
  same model (target: at most 1.10). ``spearman`` and ``best_measured`` are over the layouts of ``--preset``
  (the MoE layout trains tiny-moe); ``spearman_all_models`` includes it.
- ``anchors`` (``--anchors``, the default; ``--no-anchors`` skips): torchtitan's published Llama 3.1 8B on
  8 and 128 H100 (FSDP, local batch 2, seq 8192, selective AC, bf16, eager): 5,762 and 5,605 tokens/s
  per GPU, 82.4 and 67.0 GiB. Predicted with the shipped (uncalibrated) H100-SXM profile; each error is
  predicted / published - 1 (the published figure is the baseline).

The machine may be shared: ``load_average`` and the run's CPU seconds are in the document. stdout carries
exactly one JSON document; progress goes to stderr.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

NPROC = 4
# name -> launch() layout settings on NPROC ranks (model: the --preset unless named here)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4": dict(dp_replicate=4, dp_shard=1),
    "fsdp4": dict(dp_shard=4),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "tp4": dict(dp_shard=1, tp=4),
    "tp4_sp": dict(dp_shard=1, tp=4, sequence_parallel=True),
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "pp4_gpipe": dict(dp_shard=1, pp=4, pp_schedule="GPipe", microbatches=4),
    "pp4_1f1b": dict(dp_shard=1, pp=4, pp_schedule="1F1B", microbatches=4),
    "fsdp2_pp2_1f1b": dict(dp_shard=2, pp=2, pp_schedule="1F1B", microbatches=4),
    "fsdp4_ep4_moe": dict(model="tiny-moe", dp_shard=4, ep=4),
    "fsdp4_ac_full": dict(dp_shard=4, activation_checkpointing="full"),
    "dp4_ac_selective": dict(dp_replicate=4, dp_shard=1, activation_checkpointing="selective"),
    "fsdp4_micro1": dict(dp_shard=4, micro_batch=1),
    "tp2_sp_dp2_micro1": dict(dp_replicate=2, dp_shard=1, tp=2, sequence_parallel=True, micro_batch=1),
}
QUICK = ("fsdp4", "tp4", "pp4_1f1b")
TRAIN = dict(global_batch=8, seq_len=128)

# torchtitan's published Llama 3.1 8B (torchtitan docs/performance.md): tokens/s per GPU and memory, on H100
ANCHORS = {
    "llama3.1-8b_fsdp8": dict(nodes=1, nproc=8, tokens_per_s_per_gpu=5762.0, memory_gib=82.4),
    "llama3.1-8b_fsdp128": dict(nodes=16, nproc=128, tokens_per_s_per_gpu=5605.0, memory_gib=67.0),
}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    import torch

    from workbench.cpu_quota import usable_cpus

    return {"cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank): Pearson's r of the ranks."""
    import numpy as np
    import pandas as pd

    if len(a) < 2:
        return float("nan")
    ra = pd.Series(a).rank(method="average").to_numpy(float)
    rb = pd.Series(b).rank(method="average").to_numpy(float)
    if np.std(ra) == 0 or np.std(rb) == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(name: str, settings: dict[str, Any], preset: str, work: Path, steps: int, warmup: int) -> tuple[Any, dict]:
    """A real run of the layout; its steady step time: per step the slowest rank, median over steps."""
    import workbench

    s = {**TRAIN, **settings}
    model = s.pop("model", preset)
    t0, c0 = time.perf_counter(), _cpu_s()
    run = workbench.launch(model, out=work / name, nproc=NPROC, steps=steps, **s)
    run.wait(timeout=1800)
    m = run.metrics
    per_step = m[m["step"] >= warmup].groupby("step")["step_time_s"].max()
    if per_step.empty:
        raise RuntimeError(f"{name}: no steady steps ({len(m)} rows, warmup={warmup})")
    return run, {"layout": run.job.parallel.describe(), "model": model, "measured_s": float(per_step.median()),
                 "measured_steps_s": [round(float(v), 4) for v in per_step], "run_s": round(time.perf_counter() - t0, 1),
                 # CPU seconds of the run's processes (torchrun and its ranks, reaped): with run_s, the share of
                 # this machine's cores the run got
                 "run_cpu_s": round(_cpu_s() - c0, 1), "load_average": round(os.getloadavg()[0], 2)}


def predict(job: Any, profile: Any) -> dict[str, Any]:
    from workbench.prediction.step_time import predict_time

    t0 = time.perf_counter()
    tl = predict_time(job, device="cpu", profile=profile, progress=False)
    meta = tl.meta
    step_s = meta.get("step_time_s")
    if step_s is None:
        step_s = max(tl.step_time(r) for r in sorted(set(tl.frame["rank"])))
    bound = meta.get("bound", {})
    return {"predicted_s": float(step_s), "predict_s": round(time.perf_counter() - t0, 2),
            "bound": bound if isinstance(bound, (str, dict)) else str(bound)}


def run_layouts(names: list[str], preset: str, profile: Any, work: Path, steps: int, warmup: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name in names:
        _log(f"[layouts] {name}: measure ({NPROC} ranks)")
        run, row = measure(name, LAYOUTS[name], preset, work, steps, warmup)
        _log(f"[layouts] {name}: predict")
        row.update(predict(run.job, profile))
        row["ratio"] = row["predicted_s"] / row["measured_s"]
        row["error"] = row["ratio"] - 1.0
        _log(f"[layouts] {name}: measured {row['measured_s']:.3f} s, predicted {row['predicted_s']:.3f} s "
             f"({row['error']:+.1%})")
        rows[name] = row
    return {"baseline_detail": f"measured step time (workbench.launch, {NPROC} gloo ranks; median of steady steps, "
                               "slowest rank)", "layouts": rows, **summarize(rows, preset)}


def summarize(rows: dict[str, Any], preset: str) -> dict[str, Any]:
    """median and max |error| over every layout; Spearman's rank correlation and the best measured layout over
    the layouts of ``preset`` (the MoE layout trains another model: ranking it beside them says nothing of
    layouts), and over all of them (``spearman_all_models``)."""
    errors = [abs(r["error"]) for r in rows.values()]
    same = {k: r for k, r in rows.items() if r["model"] == preset}
    out: dict[str, Any] = {
        "median_abs_error": statistics.median(errors) if errors else None, "max_abs_error": max(errors) if errors else None,
        "spearman": spearman([r["measured_s"] for r in same.values()], [r["predicted_s"] for r in same.values()]),
        "spearman_all_models": spearman([r["measured_s"] for r in rows.values()],
                                        [r["predicted_s"] for r in rows.values()]),
        "targets": {"median_abs_error": 0.10, "spearman": 0.9}}
    if same:
        best = min(same, key=lambda k: same[k]["measured_s"])
        out["best_measured"] = best
        for r in same.values():
            r["vs_best_measured"] = r["measured_s"] / same[best]["measured_s"]
        out["best_predicted"] = min(same, key=lambda k: same[k]["predicted_s"])
    return out


def _layout_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """An advisor row (``Advice.best``) as launch() settings (``Candidate.settings()``'s spelling)."""
    out: dict[str, Any] = {"dp_replicate": int(row["dp_replicate"]), "dp_shard": int(row["dp_shard"]),
                           "tp": int(row["tp"]), "pp": int(row["pp"]), "ep": int(row["ep"]),
                           "sequence_parallel": bool(row["sp"]), "activation_checkpointing": row["ac"]}
    if out["pp"] > 1:
        out.update(pp_schedule=row["schedule"], microbatches=int(row["microbatches"]))
    else:
        out["micro_batch"] = int(row["micro"])
    return out


def _same_layout(a: dict[str, Any], b: dict[str, Any], global_batch: int) -> bool:
    """Whether two launch() layouts run the same job (defaults filled in: a micro batch equal to the local
    batch is no accumulation; AC "none" is the default; ep and pp default to 1)."""
    from workbench.settings import make_configs

    def norm(s: dict[str, Any]) -> tuple:
        s = {k: v for k, v in s.items() if k != "model"}
        par, tr = make_configs(global_batch=global_batch, **s)
        local = global_batch // par.dp
        micro = tr.micro_batch if tr.micro_batch and par.pp == 1 and tr.micro_batch < local else None
        return (par.to_dict(), tr.activation_checkpointing, micro)

    return norm(a) == norm(b)


def run_advisor(preset: str, profile: Any, layouts: dict[str, Any], work: Path, steps: int, warmup: int) -> dict[str, Any]:
    try:
        from workbench.prediction.advise import advise
    except ImportError:
        return {"skipped": "workbench.prediction.advise does not exist yet"}

    t0 = time.perf_counter()
    advice = advise(preset, gpus=NPROC, gpu_memory="16GiB", gpu=str(profile.name), gpus_per_node=NPROC,
                    global_batch=TRAIN["global_batch"], seq_len=TRAIN["seq_len"], top=5, progress=False,
                    train=dict(mixed_precision="none"))
    advise_s = time.perf_counter() - t0
    top = advice.best
    if top is None:
        return {"skipped": "the advisor ranked no layout", "advise_s": round(advise_s, 2)}
    kwargs = _layout_kwargs(top)
    same = [n for n, r in layouts["layouts"].items() if r["model"] == preset
            and _same_layout(LAYOUTS[n], kwargs, TRAIN["global_batch"])]
    if same:
        measured_s, source = layouts["layouts"][same[0]]["measured_s"], f"layout {same[0]}"
    else:
        _log(f"[advisor] top pick {top['layout']}: measure")
        _, row = measure("advisor_top", kwargs, preset, work, steps, warmup)
        measured_s, source = row["measured_s"], "measured now"
    best = layouts["layouts"][layouts["best_measured"]]["measured_s"]
    return {"baseline": "the best measured layout", "top_pick": top["layout"], "top_pick_settings": kwargs,
            "top_pick_predicted_s": top["step_time_s"], "top_pick_measured_s": measured_s, "source": source,
            "ratio": measured_s / best, "best_measured": layouts["best_measured"], "advise_s": round(advise_s, 2),
            "target_ratio": 1.10, "top5": advice.ranked.head(5)["layout"].tolist()}


def run_anchors(work: Path) -> dict[str, Any]:
    from bench_memory import LLAMA31_8B

    from workbench.prediction.step_time import predict_time

    path = work / "llama31-8b" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(LLAMA31_8B))
    out: dict[str, Any] = {"baseline": "torchtitan's published figures (Llama 3.1 8B, H100, bf16, eager)",
                           "profile": "H100-SXM"}
    for name, a in ANCHORS.items():
        n = a["nproc"]
        _log(f"[anchors] {name}: predict")
        t0 = time.perf_counter()
        job = dict(nproc=n, dp_shard=n, activation_checkpointing="op", mixed_precision="bf16",
                   train=dict(global_batch=2 * n, seq_len=8192))
        tl = predict_time(str(path), device="cuda", gpu="H100-SXM", nodes=a["nodes"], gpus_per_node=8,
                          progress=False, **job)
        seconds = time.perf_counter() - t0
        tps = float(tl.meta["tokens_per_s"]) / n
        row = {"layout": f"FSDP {n}, local batch 2, seq 8192, op-level selective AC, bf16",
               "published_tokens_per_s_per_gpu": a["tokens_per_s_per_gpu"], "predicted_tokens_per_s_per_gpu": tps,
               "tokens_per_s_error": tps / a["tokens_per_s_per_gpu"] - 1.0,
               "predicted_step_time_s": float(tl.meta.get("step_time_s", float("nan"))),
               "bound": tl.meta.get("bound"), "device_model": tl.meta.get("device_model"),
               "predict_s": round(seconds, 2), "published_memory_gib": a["memory_gib"]}
        try:
            row.update(_anchor_memory(str(path), job))
            row["memory_error"] = row["predicted_reserved_gib"] / a["memory_gib"] - 1.0
        except Exception as e:  # noqa: BLE001 - the memory figure is secondary: say why it is missing
            row["memory_error"] = None
            row["memory_note"] = f"{type(e).__name__}: {e}"[:200]
        out[name] = row
        _log(f"[anchors] {name}: {tps:,.0f} tokens/s/GPU predicted vs {a['tokens_per_s_per_gpu']:,.0f} "
             f"({row['tokens_per_s_error']:+.1%})")
    return out


def _anchor_memory(model: str, job: dict[str, Any]) -> dict[str, Any]:
    """The memory predictor's figures for the anchor (bench_memory's predict_8b path): reserved peak."""
    from workbench.memory import peak_per_rank
    from workbench.memory import predict as predict_memory

    tl = predict_memory(model, device="cuda", progress=False, ranks=[0], **job)
    alloc = float(peak_per_rank(tl).max())
    ranks = tl.meta.get("allocator", {}).get("ranks", {})
    reserved = max((float(v.get("reserved_peak", v.get("peak_reserved", 0))) for v in ranks.values()), default=0.0)
    return {"predicted_allocated_gib": alloc / 2**30, "predicted_reserved_gib": (reserved or alloc) / 2**30}


def _finite(o: Any) -> Any:
    """The document with NaN and infinities as null (JSON has no spelling for them)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"calibrate --quick, layouts {','.join(QUICK)}, 4 steps")
    ap.add_argument("--layouts", default=None, help=f"comma list from: {','.join(LAYOUTS)}")
    ap.add_argument("--preset", default="small", help="the model of the layouts (default: small)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 8; quick 4)")
    ap.add_argument("--warmup", type=int, default=None, help="leading steps dropped (default 3; quick 2)")
    ap.add_argument("--anchors", action=argparse.BooleanOptionalAction, default=True,
                    help="predict torchtitan's published 8B anchors (default: on)")
    ap.add_argument("--advisor", action=argparse.BooleanOptionalAction, default=True,
                    help="ask the advisor and measure its top pick (default: on)")
    args = ap.parse_args(argv)
    names = args.layouts.split(",") if args.layouts else list(QUICK if args.quick else LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose from {','.join(LAYOUTS)}")
    steps = args.steps or (4 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    if steps <= warmup:
        ap.error(f"--steps={steps} must exceed --warmup={warmup} to leave steady steps")
    from workbench.time.calibrate import calibrate, describe

    t_start, cpu_start = time.perf_counter(), _cpu_s()
    doc: dict[str, Any] = {"benchmark": "bench_time", "baseline": "measured", "quick": args.quick,
                           "preset": args.preset, "nproc": NPROC, "steps": steps, "warmup_steps_dropped": warmup,
                           **{k: v for k, v in TRAIN.items()}, "machine": machine(),
                           "load_average_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="bench_time_") as tmp:
        work = Path(tmp)
        # device "cpu" is the profile calibrated below, for predict_time and the advisor alike (not one
        # saved in the user's cache)
        os.environ["WORKBENCH_DEVICE_PROFILE_DIR"] = str(work)
        _log("[calibrate] this machine (gloo on 2 and 4 ranks)")
        t0 = time.perf_counter()
        profile = calibrate(quick=args.quick, ranks=(2, 4), out=work / "cpu.json", progress=False)
        cal = describe(profile)
        doc["calibration"] = {"seconds": round(time.perf_counter() - t0, 1), "matmul_flops": cal["matmul_flops"],
                              "elementwise_bytes_per_s": cal["elementwise_bytes_per_s"],
                              "op_overhead_s": cal["op_overhead_s"], "links": cal.get("links"),
                              "per_rank": cal.get("assumptions", {}).get("per_rank")}
        doc.update(run_layouts(names, args.preset, profile, work, steps, warmup))
        if args.advisor:
            doc["advisor"] = run_advisor(args.preset, profile, doc, work, steps, warmup)
        if args.anchors:
            doc["anchors"] = run_anchors(work)
    doc["load_average_end"] = os.getloadavg()[0]
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    doc["cpu_s"] = round(_cpu_s() - cpu_start, 1)
    print(json.dumps(_finite(doc), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
