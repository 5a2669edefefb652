"""Reliability: the adversarial corpus and the mutation fuzzer of tests/hostile, counted.

    python benchmarks/bench_hostile.py            # 10,000 inputs per format (what pytest --hostile-long runs)
    python benchmarks/bench_hostile.py --quick    # 500 per format (the suite's own run)

Every format workbench reads (torch memory snapshot, profiler trace, saved timeline, DCP checkpoint, HF
checkpoint, safetensors file, torch.save file, run directory, plan JSON, model config.json) gets
``--per-format`` seeded mutations of a valid file, each read through the public API in a forked child with
a memory cap (RLIMIT_AS), a CPU-time cap and an audit hook on every open (tests/hostile/hostile_harness.py);
then the hostile corpus (tests/hostile/hostile_corpus.py: evil pickles, lying headers, deep nesting, bombs,
FIFOs, links out, non-UTF-8, huge claims) goes through every reader of its family. The document counts, per
format, what the readers did (read it, or refused it in one line) and what they must never do: crash,
hang, raise an undeclared exception, read outside the input's directory, lose a file or run code. The
baseline is the count that must hold, 0 for each.

stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HOSTILE = Path(__file__).resolve().parents[1] / "tests" / "hostile"
sys.path.insert(0, str(HOSTILE))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import hostile_fuzz as F  # noqa: E402
import hostile_harness as H  # noqa: E402

MUST_BE_ZERO = ("crash", "hang", "undeclared", "outside", "lost", "executed", "harness")


def _brief(classes: list[dict]) -> list[dict]:
    return [{k: c[k] for k in ("format", "api", "what", "exc", "where", "count")}
            | ({"example": c["examples"][0]["key"], "input": c["examples"][0]["desc"],
                "detail": c["examples"][0]["detail"]} if c["examples"] else {}) for c in classes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="500 inputs per format, as the test suite runs")
    ap.add_argument("--per-format", type=int, default=None, help="inputs per format (default 10,000; quick 500)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lanes", type=int, default=min(2, os.cpu_count() or 1), help="children at a time")
    ap.add_argument("--no-corpus", action="store_true", help="the fuzzer only")
    args = ap.parse_args()
    F.fixed_hash_seed()
    per_format = args.per_format or (500 if args.quick else 500 * F.LONG_FACTOR)
    work = F.scratch_dir()
    try:
        t0 = time.perf_counter()
        driver = F.Driver(work, H.Options(lanes=args.lanes))
        print(f"driver ready in {time.perf_counter() - t0:.1f} s (torch, workbench, bases, warm-up); "
              f"fuzzing {per_format} inputs x {len(F.FORMATS)} formats", file=sys.stderr)
        fuzz = driver.fuzz(per_format, args.seed, progress=True)
        print(fuzz.pop("summary") or "fuzz: no failures", file=sys.stderr)
        corpus = None
        if not args.no_corpus:
            c = driver.corpus()
            print(c.pop("summary") or "corpus: no failures", file=sys.stderr)
            corpus = {"per_family": c["per_family"], "cases": sum(v["inputs"] for v in c["per_family"].values()),
                      "seconds": c["seconds"], "failures": _brief(c["failures"])}
        totals = {k: sum(v[k] for v in fuzz["per_format"].values()) for k in H.COUNTS}
        doc = {
            "benchmark": "bench_hostile",
            "baseline": {k: 0 for k in MUST_BE_ZERO},
            "seed": args.seed,
            "per_format_inputs": per_format,
            "lanes": args.lanes,
            "caps": {"memory_bytes": driver.opts.mem_cap, "cpu_s": driver.opts.cpu_cap,
                     "blocked_s": driver.opts.blocked_cap},
            "fuzz": {"per_format": fuzz["per_format"], "totals": totals, "inputs": fuzz["inputs"],
                     "seconds": fuzz["seconds"], "inputs_per_s": fuzz["inputs_per_s"],
                     "child_cpu_s": fuzz["child_cpu_s"], "cpu_ms_per_input": fuzz["cpu_ms_per_input"],
                     "slowest": fuzz["slowest"], "call_seconds": fuzz["call_seconds"],
                     "failures": _brief(fuzz["failures"])},
            "corpus": corpus,
            "setup_s": round(driver.setup_s + driver.warm_s, 1),
            "machine": F.machine(),
        }
        print(json.dumps(doc, indent=2, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
