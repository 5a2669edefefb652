"""Our Triton kernels against torch eager, torch.compile and copy_ bandwidth, measured in the same run.

    python benchmarks/bench_kernels.py                  # every registered case at its bench sizes
    python benchmarks/bench_kernels.py --quick          # the smallest bench size, fewer repeats
    python benchmarks/bench_kernels.py --ops index_put --sizes 16777216 --repeats 50
    python benchmarks/bench_kernels.py --targets        # only the issue-11 target rows, at their H100 sizes

On a GPU, for every kernel case (``workbench.kernels.cases.CASES``), dtype and size, ``workbench.kernels
.bench.bench`` times (CUDA events, warm-up, median of ``--repeats``) four things in the same process:
our op under ``kernels='triton'``, torch's own eager ops doing the same thing (the case's
``torch_eager``), ``torch.compile`` of that (mode default), and ``dst.copy_(src)`` moving the same
number of bytes as the op must (its ``bytes_moved``). The ratios:

    vs_eager       = eager_ms / ours_ms            > 1: ours is faster than torch eager
    vs_compile     = compile_ms / ours_ms          > 1: ours is faster than torch.compile
    copy_fraction  = copy_ms / ours_ms             the fraction of copy_ bandwidth ours reaches

and each issue-11 target (an H100 figure) is reported against its case when that case ran. First, every
kernel is checked against its reference on the GPU (``check``, bitwise where exact).

Without a GPU the document says so (``"gpu": null``, a ``note``) and carries the correctness summary of
``check`` instead, run through Triton's interpreter on CPU tensors: interpreter times say nothing about
speed and are not reported as such.

stdout carries exactly one JSON document; progress goes to stderr. The exit status is 1 when a kernel
fails its check.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import _log, machine_info  # noqa: E402  (shared machine facts)

BASELINES = ["torch eager", "torch.compile", "copy_", "a direct Python call (dispatch_us)"]

# Issue 11's targets on an H100, beside torch 2.11's figures measured there (the baselines to beat).
# case: the registered case a target is about; size: in that case's unit (index_put: K indices; the
# others: elements); metric: a bench column, to be at most / at least the threshold.
_M, _G = 1 << 20, 1 << 30


def _target(what, case, dtype, size, metric, threshold, at_most, torch_h100):
    return {"target": what, "case": case, "dtype": dtype, "size": size, "metric": metric, "threshold": threshold,
            "at_most": at_most, "torch_h100": torch_h100}


# The targets issue 31 names, which `make gpu-check` times (`--targets gpu-check`): (case, dtype)
GPU_CHECK_TARGETS = {("index_put/accumulate-deterministic-1d", "fp32"), ("index_put/accumulate-atomic-1d", "fp32"),
                     ("dropout_add/forward", "bf16"), ("dropout_add/forward-backward", "bf16"),
                     ("masked_fill/forward-backward", "fp32"), ("set_value/slice", "bf16")}


TARGETS: list[dict[str, Any]] = [
    _target("index_put accumulate, 1-D, K=16M (deterministic): <= 1/4 of torch's 6.76 ms",
            "index_put/accumulate-deterministic-1d", "fp32", 16 * _M, "time_ms", 1.7, True,
            "6.76 ms (sort path); index_add_ 0.84 ms"),
    _target("index_put accumulate, 1-D, K=16M (fast mode): <= index_add_'s 0.84 ms",
            "index_put/accumulate-atomic-1d", "fp32", 16 * _M, "time_ms", 0.84, True,
            "6.76 ms (sort path); index_add_ 0.84 ms"),
    _target("index_put accumulate, 1M x 128 rows (deterministic): <= torch's 0.67 ms",
            "index_put/accumulate-deterministic-rows", "fp32", _M, "time_ms", 0.67, True, "0.67 ms; index_add_ 1.08 ms"),
    _target("index_put accumulate, 1M x 128 rows (fast mode): <= torch's 0.67 ms",
            "index_put/accumulate-atomic-rows", "fp32", _M, "time_ms", 0.67, True, "0.67 ms; index_add_ 1.08 ms"),
    *(_target(f"fused dropout+add {dt} {part}, 2^28 elements: >= 0.85 of copy_ bandwidth",
              f"dropout_add/{part}", dt, 1 << 28, "copy_fraction", 0.85, False,
              {"bf16": "eager 0.51, torch.compile 0.59 of copy_", "fp32": "eager 0.54, torch.compile 0.93 of copy_"}[dt])
      for part in ("forward", "forward-backward") for dt in ("bf16", "fp32")),
    _target("masked_fill forward + backward fp32, 2^26 elements: >= 0.8 of copy_ bandwidth",
            "masked_fill/forward-backward", "fp32", 1 << 26, "copy_fraction", 0.8, False, "0.39 of copy_"),
    *(_target(f"set_value ({how}) bf16, 3.2G elements: >= 0.85 of copy_ bandwidth",
              f"set_value/{variant}", "bf16", 3_200_000_000, "copy_fraction", 0.85, False, "0.57 of copy_")
      for variant, how in (("slice", "functional slice assignment"), ("inplace", "in-place slice assignment"))),
]


def _finite(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else None


class Stopped(BaseException):
    """SIGTERM (the GPU check's per-part time): stop timing and print what was measured."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signal.Signals(signum).name)


def gpu_document(args: argparse.Namespace, ops: list[str] | None, dtypes: list[str] | None) -> dict[str, Any]:
    import pandas as pd

    from workbench.kernels.bench import bench, check
    from workbench.kernels.cases import CASES

    if args.no_check:
        result = None
        _log("[check] skipped (--no-check): `workbench kernels check` on this GPU says whether the kernels are right")
    else:
        _log("[check] every case against its reference on the GPU")
        result = check(ops=ops, dtypes=dtypes, sizes="smallest" if args.quick else None, progress=True)
        _log(f"[check] {result.headline()}")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else ("smallest" if args.quick else None)
    if args.targets:  # only the rows the targets name, at their H100 sizes (the GPU check's few minutes)
        b, extra = None, [t for t in TARGETS if t["case"] in CASES
                          and (args.targets == "all" or (t["case"], t["dtype"]) in GPU_CHECK_TARGETS)]
    else:
        b = bench(ops=ops, dtypes=dtypes, sizes=sizes, repeats=args.repeats, compile=not args.no_compile,
                  progress=True)
        extra = []
    if b is not None and not args.quick and not args.sizes and not ops and not dtypes:
        have = set(zip(b.rows["case"], b.rows["dtype"], b.rows["size"]))  # the full run also times every target
        extra = [t for t in TARGETS if t["case"] in CASES and (t["case"], t["dtype"], t["size"]) not in have]
    stopped = None
    try:
        for t in extra:
            _log(f"[target] {t['case']} {t['dtype']} {t['size']}")
            e = bench(ops=[t["case"]], dtypes=[t["dtype"]], sizes=[t["size"]], repeats=args.repeats,
                      compile=not args.no_compile, overhead=False, progress=False)
            b = e if b is None else type(b)(pd.concat([b.rows, e.rows], ignore_index=True), b.overhead, b.note,
                                            b.gpu, b.repeats, b.wall_s + e.wall_s)
            r = e.rows.iloc[0]
            _log("[target] ... " + ", ".join(f"{k} {r[k]:.4g}" if isinstance(r[k], (int, float)) else f"{k} {r[k]}"
                                             for k in ("time_ms", "copy_fraction", "vs_eager", "vs_compile")))
    except Stopped as s:  # the GPU check's time ran out: the targets timed so far still make a document
        stopped = f"stopped by {s.args[0]} after {0 if b is None else len(b.rows)} of {len(extra)} targets"
        _log(f"[target] {stopped}")
        if b is None:
            return {"gpu": None, "note": stopped, "stopped": stopped, "check": result and result.summary(), "cases": {},
                    "targets": [{**t, "measured": None, "met": None, "why_none": "not run: " + stopped}
                                for t in TARGETS]}
    doc = b.to_dict()
    cases: dict[str, Any] = {}
    for r in doc["rows"]:
        entry = {k: r[k] for k in ("time_ms", "eager_ms", "compile_ms", "copy_ms", "gbps", "copy_gbps",
                                   "copy_fraction", "vs_eager", "vs_compile", "max_err", "bytes", "note")}
        cases.setdefault(r["case"], {}).setdefault(r["dtype"], {})[str(r["size"])] = entry
        _log(f"[bench] {r['case']} {r['dtype']} {r['size']}: {entry['time_ms']} ms, vs eager {entry['vs_eager']}, "
             f"copy fraction {entry['copy_fraction']}")
    targets = []
    for t in TARGETS:
        row = b.rows[(b.rows["case"] == t["case"]) & (b.rows["dtype"] == t["dtype"]) & (b.rows["size"] == t["size"])]
        value = _finite(float(row[t["metric"]].iloc[0])) if len(row) else None
        met = None if value is None else (value <= t["threshold"] if t["at_most"] else value >= t["threshold"])
        why = None
        if value is None:
            why = ("its case is not registered" if t["case"] not in CASES else
                   row["note"].iloc[0] if len(row) else "not run: " + stopped if stopped else
                   "not run: --targets gpu-check, --quick, --ops, --dtypes or --sizes left it out")
        targets.append({**t, "measured": value, "met": met, "why_none": why})
    return {"gpu": b.gpu, "note": b.note, "stopped": stopped, "check": result and result.summary(),
            "bench": doc["summary"], "cases": cases,
            "overhead_us": {r["case"]: {k: r[k] for k in ("impl", "ours_us", "eager_us", "overhead_us")}
                            for r in doc["overhead"]},
            "targets": targets}


def cpu_document(args: argparse.Namespace, ops: list[str] | None, dtypes: list[str] | None) -> dict[str, Any]:
    import torch

    from workbench.kernels import triton_status
    from workbench.kernels.bench import check

    st = triton_status()
    why = ("no GPU: torch.cuda.is_available() is False here" if not torch.cuda.is_available() else
           f"Triton cannot compile for the GPU here ({st.why or 'TRITON_INTERPRET=1 is set'})")
    _log(f"[check] {why}; checking every case through Triton's interpreter instead")
    result = check(ops=ops, dtypes=dtypes or (["fp32"] if args.quick else None),
                   sizes="smallest" if args.quick else None, progress=True)
    _log(f"[check] {result.headline()}")
    failures = result.failures
    return {"gpu": None,
            "note": f"{why}; no speed figures (Triton's interpreter times say nothing about speed). Run this "
                    "script on a GPU for them. Shown: the interpreter correctness summary.",
            "check": result.summary(),
            "check_by_case": {r["case"]: {k: _finite(v) if isinstance(v, float) else v if isinstance(v, str) else int(v)
                                          for k, v in r.items() if k != "case"} for r in result.by_case().to_dict(orient="records")},
            "failures": [{k: r[k] for k in ("case", "dtype", "size", "label", "note")}
                         for r in failures.to_dict(orient="records")],
            "targets": [{**t, "measured": None, "met": None, "why_none": "no GPU"} for t in TARGETS]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="GPU: each case's smallest bench size, 5 repeats; no GPU: fp32 at the smallest check size")
    ap.add_argument("--ops", default=None, help="comma list of ops or case names (default: all)")
    ap.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16 (default: each case's)")
    ap.add_argument("--sizes", default=None, help="comma list of sizes (GPU; default: each case's bench sizes)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 20; quick 5)")
    ap.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    ap.add_argument("--no-check", action="store_true",
                    help="GPU: time only, without first checking every case against its reference")
    ap.add_argument("--targets", nargs="?", const="all", choices=("all", "gpu-check"), default=None,
                    help="GPU: time only the rows the issue-11 targets name, at their (H100) sizes; "
                         "`gpu-check`: only the six that issue 31 names")
    args = ap.parse_args()
    if args.targets and (args.ops or args.dtypes or args.sizes):
        ap.error("--targets picks its own cases, dtypes and sizes: leave out --ops, --dtypes and --sizes")
    args.repeats = args.repeats or (5 if args.quick else 20)
    ops = args.ops.split(",") if args.ops else None
    dtypes = args.dtypes.split(",") if args.dtypes else None

    from workbench.kernels import triton_status  # (before Triton loads: interpreter mode without CUDA)

    st = triton_status()
    import torch

    on_gpu = torch.cuda.is_available() and st.usable and not st.interpret
    signal.signal(signal.SIGTERM, _stop)
    doc: dict[str, Any] = {"benchmark": "bench_kernels", "quick": args.quick, "baselines": BASELINES,
                           "machine": machine_info(), "triton": st.version, "interpreter": st.interpret,
                           "repeats": args.repeats}
    try:
        doc.update(gpu_document(args, ops, dtypes) if on_gpu else cpu_document(args, ops, dtypes))
        from workbench.kernels.bench import dispatch_cost

        # Host-side cost of torch.library's dispatch per call of one of our ops (baseline: the same body
        # called directly); the same on CPU and GPU.
        cost = dispatch_cost(calls=2000 if args.quick else 20000, device="cuda" if on_gpu else "cpu")
        doc["dispatch_us"] = {k: round(v, 2) for k, v in cost.items()}
    except ValueError as e:  # an unknown op or dtype
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2))
    # wrong kernels make no benchmark: the document says which
    return 0 if doc["check"] is None or doc["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
