"""``workbench time show|import|compare`` (and ``predict``, ``calibrate``): step timelines from the command line.

    workbench train small --nproc 2 --profile 2 --out runs/p     # traces in runs/p/profile
    workbench time show runs/p [--rank 1]                         # breakdown, overlap, idle split, stragglers
    workbench time import host_123.pt.trace.json.gz ... --out imported/
    workbench time compare runs/a runs/b                          # two runs (or traces, or saved timelines)
    workbench time compare runs/p                                 # the run against its predicted layout

A PATH is a run directory (its ``profile/``), a directory of traces, one trace (``.json`` / ``.json.gz``),
or a timeline saved by ``time import`` / ``StepTimeline.save``. Every command takes ``--json`` and then
prints one JSON document; bad input is one ``error:`` line. ``time predict`` and ``time calibrate`` come
from their own modules (``add_predict`` in :mod:`workbench.prediction.step_time_cli`, ``add_calibrate`` in
:mod:`workbench.prediction.time_calibrate_cli`), added here when they are installed.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from workbench.cli_output import EXIT_FAILED, emit_json, error
from workbench.prediction.cli import _ranges
from workbench.settings import output_dir, ranks

__all__ = ["add_parser", "load_timeline"]

_SAVED_FORMAT = b'"workbench.step_timeline"'
# Other helpers' subcommands: (module, function adding its parser to `workbench time`)
_EXTRA = (("workbench.prediction.step_time_cli", "add_predict"),
          ("workbench.prediction.time_calibrate_cli", "add_calibrate"))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("time", help="step timelines: show where a run's time went, import traces, compare",
                       description="Step timelines per rank, in one schema for measured (train --profile), "
                                   "imported (torch.profiler traces) and predicted timelines.")
    tsub = p.add_subparsers(dest="time_command", required=True, parser_class=type(p))

    s = tsub.add_parser("show", help="breakdown, exposed communication, idle split and stragglers per rank",
                        description="Analyse a step timeline: seconds per category (exclusive wall time), "
                                    "communication not hidden under compute, idle time split into waiting "
                                    "for the host, another rank or the pipeline bubble, and stragglers.")
    s.add_argument("path", help="a run directory trained with --profile, a trace (.json/.json.gz), a "
                                "directory of traces, or a saved timeline")
    s.add_argument("--rank", type=ranks("rank", min=0), default=None, help="only this rank's rows")
    s.add_argument("--threshold", type=_fraction, default=0.05,
                   help="a straggler works this fraction more than the median rank (default: 0.05)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_show)

    i = tsub.add_parser("import", help="import torch.profiler traces (any ranks, gzip) as a step timeline",
                        description="Read Kineto/Chrome traces (one per rank; .json or .json.gz) with the "
                                    "bounded reader and save them as one step timeline.")
    i.add_argument("paths", nargs="+", help="trace files, or one directory of them (a run directory too)")
    i.add_argument("--out", type=output_dir, required=True, help="directory to save the timeline into "
                   "(step_timeline.json), or a .json path")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_import)

    c = tsub.add_parser("compare", help="two timelines, or a run against its prediction: per rank and category",
                        description="Compare two step timelines (runs, traces or saved timelines): seconds per "
                                    "step in each category and the step-time ratio B/A. With one run only, "
                                    "compare it with the prediction of its own layout (config.json).")
    c.add_argument("a", help="the first timeline (a run directory, trace or saved timeline)")
    c.add_argument("b", nargs="?", default=None, help="the second (default: predict A's job now)")
    c.add_argument("--gpu", default=None, help="with a prediction: the GPU's device profile (e.g. H100-SXM)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)

    for module, fn in _EXTRA:  # `time predict`, `time calibrate`: wired in when their modules exist
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        getattr(mod, fn)(tsub)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; pass a fraction such as 0.05") from None
    if not (v >= 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"{text} must be a fraction >= 0, such as 0.05 (5 % over the median)")
    return v


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _is_saved_timeline(p: Path) -> bool:
    """Whether ``p`` is a file written by StepTimeline.save (it starts with its format key)."""
    from workbench.safeio import open_regular

    if p.suffix != ".json" or p.name.endswith(".pt.trace.json"):
        return False
    with open_regular(p, "step timeline") as f:
        return _SAVED_FORMAT in f.read(64)


def _import(source: Any):
    try:
        from workbench.time.trace import import_trace
    except ImportError:
        raise ValueError("reading torch.profiler traces needs workbench.time.trace, which this installation "
                         "lacks; pass a saved step timeline instead") from None
    return import_trace(source)


def load_timeline(path: str | Path):
    """A StepTimeline from a saved timeline, a run directory (its ``profile/``), a directory of traces or
    one trace; one ValueError / FileNotFoundError naming the path and the fix."""
    from workbench.time.timeline import StepTimeline

    p = Path(path)
    if p.is_dir():
        if (p / "step_timeline.json").is_file():
            return StepTimeline.load(p)
        if (p / "config.json").is_file() and not (p / "profile").is_dir():
            raise ValueError(f"{p} is a run without traces (no profile/); train it with --profile, e.g. "
                             "`workbench train MODEL ... --profile 3`")
        return _import(p)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory; pass a run directory, a trace or a saved timeline")
    if _is_saved_timeline(p):
        return StepTimeline.load(p)
    return _import(p)


def _run_dir_of(path: str | Path) -> Path | None:
    """The run directory holding ``path`` (itself, or the parent of its profile/), if any."""
    p = Path(path)
    for d in (p, p.parent, p.parent.parent):
        if (d / "config.json").is_file():
            return d
    return None


# --------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------


def _reading(fn, args: argparse.Namespace, subject: str):
    """Run ``fn()``; map a refused input to one ``error:`` line (returned as an int exit code)."""
    try:
        return fn()
    except (FileNotFoundError, ValueError, KeyError) as e:
        return error(str(e).strip("'\""), args.json)
    except OSError as e:
        return error(f"{e.filename or subject}: cannot be read ({e.strerror or type(e).__name__})", args.json)


def cmd_show(args: argparse.Namespace) -> int:
    tl = _reading(lambda: load_timeline(args.path), args, args.path)
    if isinstance(tl, int):
        return tl
    if args.rank is not None and args.rank not in tl.ranks:
        return error(f"rank {args.rank} is not in {args.path} (it has ranks {_ranges(tl.ranks)}); pass one of "
                     "those to --rank", args.json)
    return _report(tl, args, args.threshold)


def cmd_import(args: argparse.Namespace) -> int:
    source = args.paths[0] if len(args.paths) == 1 else list(args.paths)
    tl = _reading(lambda: _import(source), args, args.paths[0])
    if isinstance(tl, int):
        return tl
    try:
        saved = tl.save(args.out)
    except OSError as e:
        return error(f"{args.out}: cannot save the timeline there ({e.strerror or type(e).__name__}); pass a "
                     "writable directory to --out", args.json, EXIT_FAILED)
    args.rank = None
    return _report(tl, args, 0.05, saved=str(saved))


def cmd_compare(args: argparse.Namespace) -> int:
    from workbench.time.analysis import diff

    def load_both():
        a = load_timeline(args.a)
        b = load_timeline(args.b) if args.b is not None else _predict_for(args.a, a, args)
        return a, b

    pair = _reading(load_both, args, args.a)
    if isinstance(pair, int):
        return pair
    try:
        d = diff(*pair)
    except ValueError as e:
        return error(str(e), args.json)
    if args.json:
        import json

        emit_json({"status": "ok", **json.loads(d.to_json())})
        return 0
    print(f"A: {args.a} ({d.summary()['a']})")
    print(f"B: {args.b or 'predicted now'} ({d.summary()['b']})")
    print(f"step time: {d.step_time_a_s * 1e3:.2f} ms -> {d.step_time_b_s * 1e3:.2f} ms "
          f"(B/A x{d.step_time_ratio:.3f})")
    print()
    print(f"{'category':<14} {'A ms/step':>10} {'B ms/step':>10} {'B-A ms':>10}")
    for r in d.categories().itertuples(index=False):
        print(f"{r.category:<14} {r.a_s * 1e3:>10.3f} {r.b_s * 1e3:>10.3f} {r.delta_s * 1e3:>+10.3f}")
    return 0


def _predict_for(path: str, measured, args: argparse.Namespace):
    """The prediction of the job of the run at ``path`` (its config.json), on the measured device."""
    try:
        mod = importlib.import_module("workbench.prediction.step_time")
        predict_time = getattr(mod, "predict_time")
    except (ImportError, AttributeError):
        raise ValueError("predicting step time needs workbench.prediction.step_time.predict_time, which this "
                         "installation lacks; pass a second timeline to compare with") from None
    from workbench.config import JobConfig

    run = _run_dir_of(path)
    if run is None:
        raise ValueError(f"{path} is not inside a run directory (no config.json beside it); pass a second "
                         "timeline to compare with")
    job = JobConfig.load(run / "config.json")
    kw: dict[str, Any] = {"device": "cuda" if measured.device.startswith("cuda") else "cpu"}
    if args.gpu:
        kw["gpu"] = args.gpu
    return predict_time(job, progress=not args.json, **kw)


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def _report(tl, args: argparse.Namespace, threshold: float, saved: str | None = None) -> int:
    from workbench.time.analysis import breakdown, communication_overlap, idle_split, stragglers

    b, o, i = breakdown(tl), communication_overlap(tl), idle_split(tl)
    s = stragglers(tl, threshold)
    if args.rank is not None:
        b, o, i, s = (f[f["rank"] == args.rank] for f in (b, o, i, s))
    if args.json:
        summary = tl.summary()
        doc = {"status": "ok", **summary, "breakdown": _records(b), "overlap": _records(o), "idle": _records(i),
               "stragglers": _records(s), "straggler_ranks": [int(r) for r in s.loc[s["straggler"], "rank"]]}
        if saved:
            doc["saved"] = saved
        emit_json(doc)
        return 0
    _print(tl, b, o, i, s, saved)
    return 0


def _print(tl, b, o, i, s, saved: str | None) -> None:
    from workbench.time.timeline import CATEGORIES

    steps = tl.steps
    st = f"; step {tl.step_time() * 1e3:.2f} ms (median, slowest rank)" if steps else ""
    print(f"{tl.source} step timeline, {tl.device}, {len(tl.ranks)} rank(s), {len(tl):,} spans, "
          f"steps {_ranges(steps)}{st}" + (f"; saved to {saved}" if saved else ""))
    if b.empty:
        print("no spans inside a step (step >= 0): nothing to break down")
        return
    print()
    print("ms per step (mean over steps), each instant charged once: forward > backward > optimizer > "
          "communication > data > checkpoint > idle")
    mean = b.groupby("rank")[[*CATEGORIES, "step_s"]].mean() * 1e3
    cats = [c for c in CATEGORIES if (mean[c] > 0).any()]
    print(f"{'rank':>5} {'step':>9} " + " ".join(f"{c[:13]:>13}" for c in cats))
    for r, row in mean.iterrows():
        print(f"{r:>5} {row['step_s']:>9.2f} " + " ".join(f"{row[c]:>13.2f}" for c in cats))
    print()
    ov = o.groupby("rank")[["comm_s", "exposed_s"]].mean() * 1e3
    idle = i.groupby("rank")[["host_s", "rank_s", "bubble_s"]].mean() * 1e3
    print(f"{'rank':>5} {'comm ms':>9} {'exposed':>9} {'exposed%':>9} | {'wait: host':>10} {'rank':>8} "
          f"{'bubble':>8} | {'work ms':>8} {'vs median':>9}")
    strag = s.set_index("rank")
    for r in mean.index:
        c, e = ov.at[r, "comm_s"], ov.at[r, "exposed_s"]
        frac = f"{e / c:>9.1%}" if c > 0 else f"{'-':>9}"
        sr = strag.loc[r] if r in strag.index else None
        tail = "" if sr is None else (f"{sr['busy_s'] * 1e3:>8.2f} {sr['excess']:>+9.1%}"
                                     + ("  straggler" if sr["straggler"] else ""))
        print(f"{r:>5} {c:>9.2f} {e:>9.2f} {frac} | {idle.at[r, 'host_s']:>10.2f} {idle.at[r, 'rank_s']:>8.2f} "
              f"{idle.at[r, 'bubble_s']:>8.2f} | {tail}")
    flagged = [int(r) for r in s.loc[s["straggler"], "rank"]]
    if flagged:
        print()
        print(f"straggler(s): rank {_ranges(flagged)} (work over the median rank's by more than the threshold)")


def _records(df) -> list[dict[str, Any]]:
    import numpy as np

    out = []
    for rec in df.to_dict(orient="records"):
        out.append({k: (bool(v) if isinstance(v, (bool, np.bool_)) else int(v) if isinstance(v, (np.integer,))
                        else float(v) if isinstance(v, (float, np.floating)) else v) for k, v in rec.items()})
    return out
