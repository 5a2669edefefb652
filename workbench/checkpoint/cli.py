"""``workbench ckpt``: inspect, verify, diff, convert and plan-load checkpoints from the shell.

    workbench ckpt inspect runs/r1                      what is in the latest checkpoint
    workbench ckpt verify runs/r1/checkpoints/step-000020   checksums, sizes, chunk tiling (exit 1 if bad)
    workbench ckpt diff A B --top 5 --kind model        verdict (kinds that differ), largest changes per tensor kind
    workbench ckpt stats runs/r1 KEY --bins 30 --log    one tensor's statistics and histogram (of log10|x|)
    workbench ckpt convert SRC DST --to hf --include optimizer   HF names and config: transformers loads DST
    workbench ckpt plan-load SRC --dp-shard 2 --tp 2    will it load into that layout? (exit 1 if not)

Every command takes ``--json`` (one JSON document on stdout). A bad file prints one line,
``error: <file>: <problem>; <fix>``, and exits 1; no traceback, and no pickle is ever executed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from workbench.cli_output import EXIT_FAILED, EXIT_USAGE, describe_exception, emit_json, error, unexpected
from workbench.kinds import CHECKPOINT_KINDS, checkpoint_kind
from workbench.units import format_bytes

__all__ = ["add_parser"]


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn every failure into one ``error:`` line (exit 1 for a bad checkpoint, 2 for bad input)."""

    def run(args: argparse.Namespace) -> int:
        from torch.distributed.checkpoint.api import CheckpointException

        from workbench.checkpoint.safeload import CheckpointFormatError

        try:
            return fn(args)
        except CheckpointFormatError as e:
            return error(str(e), args.json, EXIT_FAILED)
        except (ValueError, KeyError, FileExistsError) as e:
            if isinstance(e, OSError) and e.errno is not None:  # "[Errno 17] File exists: 'x'" in words
                msg = describe_exception(e)
            else:
                msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return error(str(msg), args.json, EXIT_USAGE)
        except KeyboardInterrupt:
            return error("interrupted", args.json, 130)
        except BrokenPipeError:  # `workbench ckpt inspect RUN | head`: workbench.cli.main ends quietly, exit 0
            raise
        except (Exception, CheckpointException) as e:  # a bug or an unforeseen file: one line naming the
            # checkpoint (or the file the error names) and the problem in words; the traceback on request
            return unexpected(e, args.json, subject=_inputs(args))

    return run


def _inputs(args: argparse.Namespace) -> str | None:
    """The checkpoint(s) a command was given, for an error that names no file of its own."""
    names = [str(getattr(args, k)) for k in ("path", "src", "a", "b") if getattr(args, k, None)]
    return " vs ".join(names) if names else None


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars on a terminal only: never in --json output, logs or pipes."""
    return not args.json and sys.stderr.isatty()


# --------------------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    from workbench.checkpoint.contents import inspect
    from workbench.checkpoint.param_groups import describe_groups, listing, matches, param_groups

    m = inspect(args.path)
    groups = param_groups(m)  # the hyper-parameter entries, one group each (their values: a few bytes, one read)
    frame = m.frame
    if args.kind:
        frame = frame[frame["kind"] == args.kind]
    if args.filter:
        frame = frame[frame["key"].str.contains(args.filter, regex=False)]
    rows = listing(m, groups)  # entries, with one row per param group
    if args.kind:
        rows = rows[rows["kind"] == args.kind]
    if args.filter:  # a group passes by its name or what it folds: its entries, or (packed) its parameters
        rows = rows[[matches(r, args.filter) for r in rows.to_dict("records")]]
    if args.json:
        doc = m.to_dict()
        keep = set(frame["key"])
        doc["tensors"] = [r for r in doc["tensors"] if r["key"] in keep]
        if not args.shards:
            for r in doc["tensors"]:
                r["n_shards"] = len(r.pop("shards"))
        doc["summary"]["n_param_groups"] = len(groups)
        # values, whatever the storage (n_hyperparameters counts stored entries: one per value before the
        # packing, one JSON item per distinct set after it)
        doc["summary"]["n_hyperparameter_values"] = sum(g.n_values for g in groups)
        doc["param_groups"] = [r["group"].to_dict() for r in rows.to_dict("records") if r["group"] is not None]
        emit_json({"status": "ok", **doc})
        return 0
    s = m.summary()
    hyper = f" + {describe_groups(groups)}" if groups else ""
    print(f"{s['path']}  ({s['format']})")
    print(f"step {s['step']}  layout {s['layout_description'] or '-'}  ranks {s['world_size'] or '-'}  "
          f"{s['n_tensors']} tensors{hyper}  {format_bytes(s['total_bytes'])}  files {s['n_files']}")
    print("  " + "  ".join(f"{k} {format_bytes(b)}" for k, b in s["bytes_by_kind"].items()))
    if s.get("quant"):
        from workbench.checkpoint.quant import describe

        print("  " + describe(s["quant"]))
    print()
    shown = rows if args.all else rows.head(args.limit)
    width = max([len(k) for k in shown["key"]] + [3])
    dw = max([len(d) for d, g in zip(shown["dtype"], shown["group"]) if g is None] + [9])  # float8_e8m0fnu: 14
    print(f"{'key':<{width}}  {'kind':<9} {'dtype':<{dw}} {'shape':<16} {'size':>10}  shards")
    for r in shown.itertuples(index=False):
        if r.group is not None:  # one row per optimizer param group
            print(f"{r.key:<{width}}  {r.kind:<9} {r.group.label()}  [{r.group.storage()}]")
            continue
        shape = "-" if r.shape is None else "x".join(map(str, r.shape)) or "()"
        ranks = sorted({s["rank"] for s in r.shards if s.get("rank") is not None})
        where = f"{len(r.shards)} (ranks {','.join(map(str, ranks))})" if ranks else str(len(r.shards))
        print(f"{r.key:<{width}}  {r.kind:<9} {r.dtype:<{dw}} {shape:<16} {format_bytes(r.bytes):>10}  {where}")
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more (--all, --filter, --kind)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from workbench.checkpoint.verify import verify

    report = verify(args.path, deep=args.deep, progress=_progress(args))
    if args.json:
        emit_json({"status": "ok" if report.ok else "error", **report.to_dict()})
    else:
        for p in report.problems:
            print(f"error: {p}", file=sys.stderr)
        for w in report.warnings:
            print(f"warning: {w}", file=sys.stderr)
        if report.ok:
            checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
            print(f"ok: {report.path} ({report.format}): {checked}")
            if report.quant:
                print(f"  {report.quant}")
    return 0 if report.ok else EXIT_FAILED


def cmd_diff(args: argparse.Namespace) -> int:
    from workbench.checkpoint.diff import diff

    kinds = [checkpoint_kind(k) for k in args.kind.split(",") if k.strip()] if args.kind else None
    d = diff(args.a, args.b, values=not args.no_values, kinds=kinds, progress=_progress(args))
    if args.json:
        emit_json({"status": "ok", **d.to_dict(top=args.top)})
        return 0
    print(f"{d.a} -> {d.b}")
    print(d.banner())
    print(d.summary_line())
    for k in d.added[:args.top]:
        print(f"  + {k}")
    for k in d.removed[:args.top]:
        print(f"  - {k}")
    for r in d.changed.head(args.top).itertuples(index=False):
        print(f"  ~ {r.key}: {r.a_dtype}{list(r.a_shape) if r.a_shape is not None else ''} -> "
              f"{r.b_dtype}{list(r.b_shape) if r.b_shape is not None else ''}")
    top = d.top(args.top)
    if len(top):
        counts = {r.tensor_kind: r for r in d.by_tensor_kind().itertuples(index=False)}
        print(f"\nlargest value changes, up to {args.top} per tensor kind (||b - a|| / ||a||, max |b - a|):")
        for tk, rows in top.groupby("tensor_kind", sort=False):
            c = counts[tk]
            print(f"  {tk}: {c.changed} of {c.compared} changed")
            for r in rows.itertuples(index=False):
                print(f"    {r.rel_norm:10.3e}  max|d| {r.max_abs:10.3e}  {r.key}")
    hyper = d.hyperparameter_changes()
    if len(hyper):
        from workbench.checkpoint.param_groups import format_value

        print("\noptimizer hyper-parameters changed:")
        for r in hyper.itertuples(index=False):
            print(f"  {r.name}: {format_value(r.a)} -> {format_value(r.b)} ({r.params} params)")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from workbench.checkpoint.stats import tensor_stats

    stats = tensor_stats(args.path, args.key, bins=args.bins, log=args.log)
    if args.json:
        emit_json({"status": "ok", **stats})
        return 0
    hist = stats.pop("histogram", None)
    print(f"{stats['key']}  {stats['dtype']}  {stats['numel']:,} values")
    print("  " + "  ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in stats.items() if k not in ("key", "dtype", "numel")))
    if hist and hist["counts"]:
        what = "log10 |x|" if hist["scale"] != "linear" else "x"
        left_out = f", {hist['excluded']} zero(s) left out" if hist["excluded"] else ""
        print(f"\nhistogram of {what} ({len(hist['counts'])} bins{left_out}):")
        top = max(hist["counts"]) or 1
        half = hist["width"] / 2
        for c, n in zip(hist["centers"], hist["counts"]):
            print(f"  {c - half:>11.4g} .. {c + half:<11.4g} {'#' * round(40 * n / top):<40} {n}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from workbench.checkpoint.formats import export
    from workbench.disk import StorageError

    include = ["model"] + [checkpoint_kind(k) for k in (args.include or "").split(",") if k.strip()]
    try:
        result = export(args.src, args.dst, to=args.to, include=include, max_shard_size=args.max_shard_size,
                        names=args.names, overwrite=args.force, progress=_progress(args), keep_quant=args.keep_quant)
    except StorageError as e:  # no room, read-only, no permission: said in words (DST is left as it was)
        return error(str(e), args.json, EXIT_FAILED)
    if args.json:
        emit_json({"status": "ok", **result.to_dict()})
    else:
        kinds = ", ".join(f"{k} {format_bytes(b)}" for k, b in result.by_kind.items())
        print(f"wrote {result.tensors} tensors ({kinds}) to {result.dst} as {result.to}: "
              f"{', '.join(result.files[:5])}{' ...' if len(result.files) > 5 else ''}")
    return 0


def cmd_plan_load(args: argparse.Namespace) -> int:
    from workbench.checkpoint.plan_load import plan_load
    from workbench.settings import from_args, parse_layout

    target = parse_layout(args.to) if args.to else from_args(args, "parallel")
    plan = plan_load(args.src, target, model=args.model, full_state=not args.weights_only)
    if args.json:
        emit_json({"status": "ok" if plan.loadable else "error", **plan.to_dict()})
    else:
        verdict = "loadable" if plan.loadable else "NOT loadable"
        print(f"{verdict}: {plan.src} ({plan.source_layout}) -> {plan.model} on {plan.target_description} "
              f"({plan.world_size} ranks); {plan.checked} keys checked, {format_bytes(plan.bytes_to_read)} to read")
        for r in plan.reasons():
            print(f"error: {r}", file=sys.stderr)
        for n in plan.notes:
            print(f"note: {n}")
        if plan.unexpected:
            print(f"note: {len(plan.unexpected)} checkpoint key(s) unused by the target (first: {plan.unexpected[0]})")
    return 0 if plan.loadable else EXIT_FAILED


# --------------------------------------------------------------------------------------------------

# workbench.checkpoint.stats.MAX_BINS, whose module imports torch, which the parser must not (a test keeps
# the two equal: tests/test_imports.py)
MAX_BINS = 10_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    from workbench.settings import bounded

    p = sub.add_parser("ckpt", help="inspect, verify, diff, convert and plan-load checkpoints",
                       description="Checkpoint tools. Metadata and headers are read safely (no pickle is executed).")
    cmds = p.add_subparsers(dest="ckpt_command", required=True, parser_class=type(p))

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        c = cmds.add_parser(name, help=help, description=help)
        c.add_argument("--json", action="store_true", help="print one JSON document")
        c.set_defaults(func=_guard(fn))
        return c

    c = add("inspect", cmd_inspect, "list a checkpoint's tensors (key, kind, dtype, global shape, bytes, shards)")
    c.add_argument("path", help="run dir, checkpoints dir, step dir, DCP dir, HF dir, .safetensors or torch file")
    c.add_argument("--kind", type=checkpoint_kind, choices=CHECKPOINT_KINDS, metavar="{" + ",".join(CHECKPOINT_KINDS) + "}",
                   help="only this kind")
    c.add_argument("--filter", help="only keys containing this text")
    c.add_argument("--limit", type=bounded("int", "limit", min=0), default=30, help="rows to print (default 30)")
    c.add_argument("--all", action="store_true", help="print every row")
    c.add_argument("--shards", action="store_true", help="with --json: include every shard (file, rank, block)")

    c = add("verify", cmd_verify, "check checksums, file sizes and that every tensor's chunks tile it (exit 1 if not)")
    c.add_argument("path")
    c.add_argument("--deep", action="store_true", help="also read every tensor and report non-finite values")

    c = add("diff", cmd_diff, "compare two checkpoints: keys, shapes, dtypes, and the largest value changes")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=bounded("int", "top", min=0), default=10,
                   help="how many of the largest changes to show")
    c.add_argument("--kind", help=f"comma-separated kinds to compare, of {','.join(CHECKPOINT_KINDS)} (default: all)")
    c.add_argument("--no-values", action="store_true", help="metadata only: read no tensors")

    c = add("stats", cmd_stats, "statistics and a histogram of one tensor (only it is read)")
    c.add_argument("path", help="any checkpoint path inspect accepts")
    c.add_argument("key", help="the tensor's key, as inspect lists it")
    c.add_argument("--bins", type=bounded("int", "bins", min=0, limit=MAX_BINS,
                                          limit_why="more than a histogram can show"), default=20,
                   help=f"histogram bins (0: none; up to {MAX_BINS:,}; default 20)")
    c.add_argument("--log", action="store_true",
                   help="histogram of log10 |x| (zeros left out): for values spanning decades, like exp_avg_sq")

    c = add("convert", cmd_convert, "convert a checkpoint (streaming, one tensor at a time)")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", choices=["hf", "safetensors", "torch", "dcp"], required=True,
                   help="hf: sharded safetensors + index.json; safetensors: one file; torch: torch.save; dcp")
    c.add_argument("--include", default="",
                   help=f"besides the model: comma-separated {','.join(k for k in CHECKPOINT_KINDS if k != 'model')}")
    c.add_argument("--max-shard-size", default="2GiB",
                   help="hf shards up to this size (default 2GiB; 2GB means 2*10^9 bytes, as Hugging Face counts)")
    c.add_argument("--names", choices=["hf-llama", "workbench"], default=None,
                   help="weight names: Hugging Face Llama names, q/k permuted for RoPE, with a config.json "
                   "transformers loads (the default of --to hf), or this model's FQNs (the default of the other "
                   "formats; with --to hf its config.json is one transformers refuses)")
    c.add_argument("--force", action="store_true", help="replace DST if it exists and is a file, an empty "
                   "directory or an earlier export (never the source, nor a directory holding anything else); "
                   "the new export takes its place only once it is complete")
    c.add_argument("--keep-quant", action="store_true", help="optimizer state saved quantized (--ckpt-quant): "
                   "export it as stored (<key>.q + <key>.qscale) instead of dequantized to fp32")

    from workbench.settings import add_arguments

    c = add("plan-load", cmd_plan_load, "dry run: will this checkpoint load into that layout? (exit 1 if not)")
    c.add_argument("src")
    c.add_argument("--model", default=None, help="preset or config.json (default: the one the checkpoint records)")
    c.add_argument("--to", default=None, metavar="LAYOUT",
                   help="the target layout as text, e.g. 'dp_shard=2,tp=2,sp' (instead of the layout flags)")
    add_arguments(c, "parallel")
    c.add_argument("--weights-only", action="store_true", help="do not require optimizer state (not a resume)")
