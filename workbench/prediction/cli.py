"""``workbench memory record|predict|compare|import|show``: memory timelines from the command line.

    workbench memory record small --dp-shard 2 --out runs/m     # train with --memory; peaks per rank
    workbench memory predict llama-70b --nproc 1024 --tp 8 --pp 4 --device cuda --budget 80GiB
    workbench memory compare runs/m                             # measured vs predicted (predicted now)
    workbench memory import snapshot_rank*.pickle --out imported/
    workbench memory show runs/m [--rank 1]

Every command takes ``--json`` and then prints one JSON document. Bad input is one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from workbench.cli_output import EXIT_FAILED, emit_json, error
from workbench.config import PRESETS
from workbench.settings import add_arguments, bounded, from_args, output_dir, ranks, seconds
from workbench.units import format_bytes

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="memory timelines: record a run, predict a layout, compare, import, show",
                       description="Memory timelines per rank, in one schema for measured, predicted and "
                                   "imported (torch snapshot, profiler) timelines.")
    msub = p.add_subparsers(dest="memory_command", required=True, parser_class=type(p))

    r = msub.add_parser("record", help="train with --memory and report each rank's peak",
                        description="Run `workbench train ... --memory`: every rank records its timeline "
                                    "into RUN_DIR/memory.")
    _model_and_layout(r)
    r.add_argument("--out", type=output_dir, default=None, help="run directory (default: ./runs/<time>)")
    r.add_argument("--timeout", type=seconds("timeout"), default=None, help="stop the run after this many seconds")
    r.add_argument("--json", action="store_true")
    # cmd_record runs cmd_train, which reads the multi-node and --overwrite flags: one node, no overwrite
    r.set_defaults(func=cmd_record, nnodes=1, node_rank=0, rdzv_endpoint=None, rdzv_id=None, rdzv_timeout=None,
                   overwrite=False)

    pr = msub.add_parser("predict", help="predict every rank's timeline with one fake step (any world size)",
                         description="Run one real training step under FakeTensorMode and a fake process "
                                     "group for every distinct rank, and print the peak bytes per rank.")
    _model_and_layout(pr, exclude=("device",))  # its --device is the target predicted for, not where ranks run
    pr.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="what to predict: the CPU recorder's peak, or CUDA's max_memory_allocated and "
                         "max_memory_reserved (the caching allocator model; PYTORCH_CUDA_ALLOC_CONF here is used)")
    pr.add_argument("--budget", default=None, metavar="SIZE",
                    help="memory per rank, e.g. 80GiB: say whether the job fits and the largest micro batch "
                         "that does (on CUDA: the reserved peak plus --margin)")
    pr.add_argument("--margin", default="auto", metavar="SIZE",
                    help="with --budget on CUDA: memory per rank outside the caching allocator (CUDA context, "
                         "NCCL buffers), e.g. 1.5GiB or 0; auto: 512 MiB + 256 MiB per NCCL communicator")
    pr.add_argument("--out", type=output_dir, default=None, help="save the predicted timeline into this directory")
    _routing_arguments(pr)
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_predict)

    c = msub.add_parser("compare", help="measured against predicted, per rank and category",
                        description="Compare a run's measured timeline with a prediction (default: predict "
                                    "the run's own job now).")
    c.add_argument("measured", help="a run directory (or its memory/) recorded with --memory")
    c.add_argument("predicted", nargs="?", default=None, help="a saved prediction (default: predict now)")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None, help="prediction target (default: the run's)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)

    i = msub.add_parser("import", help="import torch CUDA snapshots or a profiler trace as a timeline",
                        description="Read torch.cuda.memory._dump_snapshot pickles (never unpickling code) or "
                                    "a profiler chrome trace with memory events; save it as a timeline.")
    i.add_argument("paths", nargs="+", help="snapshot pickles (one per rank) or one profiler trace .json")
    i.add_argument("--out", type=output_dir, default=None, help="save the imported timeline into this directory")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_import)

    s = msub.add_parser("show", help="summarise a timeline: peak per rank, what is alive at the peak",
                        description="Summarise a saved timeline (a run directory, memory/ or a saved "
                                    "prediction): the peak of each rank, its categories and largest tensors.")
    s.add_argument("path")
    s.add_argument("--rank", type=ranks("rank", min=0), default=None, help="only this rank")
    s.add_argument("--top", type=bounded("int", "top", min=0), default=8,
                   help="largest allocations alive at the peak to list")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_show)


def _model_and_layout(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    p.add_argument("--nproc", type=ranks("nproc"), default=None,
                   help="processes (default: product of the degrees)")
    add_arguments(p, ("parallel", "train"), exclude=exclude)


# --------------------------------------------------------------------------------------------------


def cmd_record(args: argparse.Namespace) -> int:
    from workbench.cli import cmd_train
    from workbench.memory.timeline import MemoryTimeline

    args.memory = True
    if not args.out:
        import time

        args.out = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    out = sys.stdout
    if args.json:  # the train summary is not this command's document
        import io

        sys.stdout = io.StringIO()
    try:
        code = cmd_train(args)
    finally:
        captured, sys.stdout = sys.stdout, out
    if code != 0:
        if args.json:
            sys.stdout.write(captured.getvalue() if hasattr(captured, "getvalue") else "")
        return code
    try:
        tl = MemoryTimeline.load(args.out)
    except (FileNotFoundError, ValueError) as e:
        return error(str(e), args.json, EXIT_FAILED)
    return _report(tl, args, run_dir=args.out)


def cmd_predict(args: argparse.Namespace) -> int:
    from workbench.prediction.memory import fits, peak_per_rank, predict, reserved_per_rank

    from workbench.units import check_margin, parse_bytes

    try:
        settings = dict(parallel=from_args(args, "parallel"), train=from_args(args, "train"), nproc=args.nproc)
        if args.budget:
            parse_bytes(args.budget)  # a typo fails before the prediction's seconds of work
        check_margin(args.margin)
        skew = _band_skew(args, settings)  # MoE: the band's capacity factor (None: no band)
        tl = predict(args.model, device=args.device, progress=not args.json, routing=args.routing, **settings)
        band = _band(args, tl, skew, settings)
        answer = (fits(args.model, args.budget, device=args.device, margin=args.margin, timeline=tl, **settings)
                  if args.budget else None)
    except (ValueError, TypeError) as e:
        return error(str(e), args.json)
    if args.out:
        tl.save(args.out)
    peaks = peak_per_rank(tl)
    reserved = reserved_per_rank(tl) if tl.device == "cuda" else None
    if args.json:
        doc = {"status": "ok", **tl.summary(), "peak_bytes_per_rank": {str(k): int(v) for k, v in peaks.items()},
               "max_peak_bytes": int(peaks.max()), "peaks": tl.peaks().to_dict(orient="records")}
        doc.pop("job", None)
        if band is not None:
            doc["band"] = band.summary()
        if reserved is not None:
            doc["reserved_bytes_per_rank"] = {str(k): int(v) for k, v in reserved.items()}
            doc["max_reserved_bytes"] = int(reserved.max())
        if answer is not None:
            doc["fit"] = {"budget_bytes": answer.budget_bytes, "fits": answer.fits,
                          "largest_micro_batch": answer.micro_batch, "peak_at_micro_batch": answer.peak_at_micro_batch,
                          "tried": {str(k): v for k, v in answer.tried.items()}, "compared": answer.compared,
                          "peak_bytes": answer.peak_bytes, "margin_bytes": answer.margin_bytes,
                          "needed_bytes": answer.needed_bytes, "runs_out": answer.runs_out}
        emit_json(doc)
        return 0
    m = tl.meta
    print(f"{m['model']}  [{m['layout']}]  {m['world_size']} ranks, predicted for {tl.device} "
          f"({len(tl.ranks)} distinct rank(s) simulated in {m['prediction_s']:.1f} s)")
    if m.get("ac_policy"):
        print(f"activation checkpointing: {m['ac_policy']}")
    _print_peaks(tl)
    groups = peaks.groupby(peaks).groups
    print()
    print("peak per rank" + (" (allocated, reserved):" if reserved is not None else ":"))
    for value, members in sorted(groups.items(), key=lambda kv: -kv[0]):
        res = reserved[list(members)] if reserved is not None else None
        also = "" if res is None else f"  {format_bytes(int(res.max())):>12}"
        print(f"  {format_bytes(value):>12}{also}  ranks {_ranges(list(members))}")
    if reserved is not None:
        _print_allocator(tl)
    _print_band(band)
    if answer is not None:
        print()
        print(answer)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from workbench.config import JobConfig
    from workbench.memory.comparison import compare
    from workbench.prediction.memory import predict
    from workbench.memory.timeline import MemoryTimeline

    try:
        measured = MemoryTimeline.load(args.measured)
        if args.predicted:
            predicted = MemoryTimeline.load(args.predicted)
        else:
            run_dir = Path(args.measured)
            cfg = run_dir / "config.json" if (run_dir / "config.json").exists() else run_dir.parent / "config.json"
            if not cfg.exists():
                raise FileNotFoundError(f"no config.json beside {args.measured}: pass a saved prediction too")
            predicted = predict(JobConfig.load(cfg), device=args.device or measured.device, progress=not args.json)
        result = compare(measured, predicted)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return error(str(e).strip("'\""), args.json)
    if args.json:
        emit_json({"status": "ok", **result.summary(), "ranks": result.to_frame().to_dict(orient="records")})
        return 0
    frame = result.to_frame()
    print(frame.to_string(index=False))
    s = result.summary()
    print()
    print(", ".join(f"{k}: {v}" for k, v in s.items() if not isinstance(v, (dict, list))))
    if s["phase_mismatch_ranks"]:
        print(f"warning: on rank(s) {s['phase_mismatch_ranks']} the two peaks fall in different phases "
              "(measured_phase, predicted_phase): the sizes may agree for different reasons")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from workbench.memory import snapshot

    try:
        kinds = {p: snapshot.identify_memory_file(p) for p in args.paths}
        for p, k in kinds.items():  # a pickle we cannot tell apart: the reader says exactly what is wrong
            if k is None and Path(p).suffix.lower() in (".pickle", ".pkl", ".pk"):
                kinds[p] = "snapshot"
        unknown = [p for p, k in kinds.items() if k is None]
        if unknown:
            raise ValueError(f"{unknown[0]} is neither a torch memory snapshot nor a profiler trace with memory "
                             "events")
        if any(k == "timeline" for k in kinds.values()):
            raise ValueError(f"{next(p for p, k in kinds.items() if k == 'timeline')} is already a workbench "
                             "timeline: open it with `workbench memory show`")
        if any(k == "profiler" for k in kinds.values()):
            if len(args.paths) != 1:
                raise ValueError("import one profiler trace at a time")
            tl = snapshot.import_profiler_trace(args.paths[0])
        else:
            tl = snapshot.import_snapshots(args.paths)
    except (FileNotFoundError, ValueError) as e:  # every reader's refusal of a file: one line (issue 27)
        return error(str(e), args.json)
    except OSError as e:  # a file that exists but cannot be read (permissions, an I/O error)
        return error(f"{e.filename or args.paths[0]}: cannot be read ({e.strerror or type(e).__name__})", args.json)
    if args.out:
        try:
            tl.save(args.out)
        except OSError as e:
            return error(f"{args.out}: cannot save the timeline there ({e.strerror or type(e).__name__}); "
                         "pass a writable directory to --out", args.json, EXIT_FAILED)
    return _report(tl, args)


def cmd_show(args: argparse.Namespace) -> int:
    from workbench.memory.timeline import MemoryTimeline

    try:
        tl = MemoryTimeline.load(args.path)
        if args.rank is not None:
            tl = tl.rank(args.rank)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return error(str(e).strip("'\""), args.json)
    except OSError as e:  # a directory or file that exists but cannot be read
        return error(f"{e.filename or args.path}: cannot be read ({e.strerror or type(e).__name__})", args.json)
    return _report(tl, args)


# --------------------------------------------------------------------------------------------------


def _report(tl, args: argparse.Namespace, run_dir: str | None = None) -> int:
    top = getattr(args, "top", 8)
    if args.json:
        doc = {"status": "ok", **tl.summary(), "peaks": tl.peaks().to_dict(orient="records"),
               "alive_at_peak": {str(r): tl.alive_at_peak(r, top=top).to_dict(orient="records") for r in tl.ranks}}
        doc.pop("job", None)
        if run_dir:
            doc["run_dir"] = run_dir
        emit_json(doc)
        return 0
    where = f" ({run_dir}/memory)" if run_dir else ""
    print(f"{tl.source} memory timeline, {tl.device}, {len(tl.ranks)} rank(s), {len(tl):,} events{where}")
    _print_peaks(tl)
    for r in tl.ranks:
        alive = tl.alive_at_peak(r, top=top)
        if alive.empty:
            continue
        print()
        print(f"rank {r}: largest allocations alive at the peak")
        for a in alive.itertuples():
            print(f"  {format_bytes(a.bytes):>12}  {a.category:<13} {a.phase:<9} {a.module or '-':<28} {a.op}")
    return 0


def _print_peaks(tl) -> None:
    from workbench.memory.timeline import CATEGORIES

    peaks = tl.peaks()
    cats = [c for c in CATEGORIES if peaks[c].any()]
    has_reserved = "reserved_bytes" in peaks.columns
    print(f"{'rank':>5} {'peak':>12} " + (f"{'reserved':>12} " if has_reserved else "")
          + f"{'phase':<10} {'step':>4}  " + " ".join(f"{c[:12]:>12}" for c in cats))
    for r in peaks.itertuples():
        res = f"{format_bytes(r.reserved_bytes):>12} " if has_reserved else ""
        print(f"{r.rank:>5} {format_bytes(r.peak_bytes):>12} {res}{r.phase:<10} {r.step:>4}  "
              + " ".join(f"{format_bytes(getattr(r, c)):>12}" for c in cats))


def _print_allocator(tl) -> None:
    """The caching allocator model's figures: fragmentation, segments, steps where caching costs > 5%."""
    info = tl.meta.get("allocator") or {}
    for r, v in sorted((info.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        line = (f"rank {r}: caching allocator reserves {format_bytes(v['peak_reserved'])} for "
                f"{format_bytes(v['peak_allocated'])} allocated in blocks (+{v['overhead']:.1%}; fragmentation "
                f"{v['fragmentation']:.1%}, {v['segments']} segments)")
        if v.get("flagged_steps"):
            worst = max(v["steps"], key=lambda s: s["overhead"])
            line += (f"; over {info.get('flag_overhead', 0.05):.0%} in step(s) {v['flagged_steps']} "
                     f"(worst +{worst['overhead']:.1%} in step {worst['step']})")
        print(line)
    if info.get("ignored_settings"):
        print(f"PYTORCH_CUDA_ALLOC_CONF settings not modelled (ignored): {', '.join(info['ignored_settings'])}")


def _routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routing", default=None, metavar="RUN",
                   help="mixture of experts: predict with the measured routing (tokens per expert) of this run "
                        "directory or its events.jsonl, instead of a band")
    p.add_argument("--moe-skew", type=float, default=None, metavar="CF",
                   help="mixture of experts without --routing: predict a band from balanced routing to each "
                        "rank's worst case when no expert routes more than CF x its mean load (a capacity "
                        "factor, 1 to n_experts/top_k; default 2, capped there; 1: balanced only)")


def _band_skew(args: argparse.Namespace, settings: dict) -> float | None:
    """The band's capacity factor for this job (None: dense, --routing given, or 1), checked up front."""
    from workbench.prediction.memory import _job
    from workbench.prediction.routing import DEFAULT_CAPACITY_FACTOR, RoutingSkew

    job = _job(args.model, **settings)
    if not job.model.n_experts:
        if args.moe_skew is not None or args.routing is not None:
            raise ValueError(f"--{'routing' if args.routing else 'moe-skew'} is for a mixture-of-experts model; "
                             f"{job.model.name!r} is dense")
        return None
    if args.routing is not None:
        if args.moe_skew is not None:
            raise ValueError("pass --routing (a measured routing) or --moe-skew (a band), not both")
        return None
    skew = args.moe_skew if args.moe_skew is not None else min(DEFAULT_CAPACITY_FACTOR,
                                                               job.model.n_experts / job.model.top_k)
    RoutingSkew(skew).check(job)
    return None if skew == 1 else skew


def _band(args: argparse.Namespace, low, skew: float | None, settings: dict):
    from workbench.prediction.memory import predict
    from workbench.prediction.routing import MemoryBand, RoutingSkew

    if skew is None:
        return None
    high = predict(args.model, device=args.device, progress=not args.json, routing=RoutingSkew(skew), **settings)
    return MemoryBand(low, high, skew)


def _print_band(band) -> None:
    if band is None:
        return
    p = band.peaks()
    print()
    print(f"routing band (balanced to capacity factor {band.capacity_factor:g}): peak "
          f"{format_bytes(int(p['low_peak'].max()))} to {format_bytes(int(p['high_peak'].max()))}")


def _ranges(ranks: list[int]) -> str:
    """Ranks as runs: [0, 1, 2, 5] -> "0-2,5" ("none" for no rank)."""
    ranks = sorted(int(r) for r in ranks)
    if not ranks:
        return "none"
    out, start, prev = [], ranks[0], ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)
