"""``workbench`` command line: a thin front end over the same APIs the notebooks use.

Every command takes ``--json`` and then prints exactly one JSON document on stdout. Bad input prints one
``error: ...`` line naming the problem and the fix, and exits 2; a failed run exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from workbench.cli_output import EXIT_FAILED, EXIT_USAGE, emit_json, error, unexpected


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    from workbench.config import PRESETS
    from workbench.settings import add_arguments, output_dir, ranks, seconds

    p = sub.add_parser("train", help="train a model on N local processes through torchrun",
                       description="Train a preset (or a Hugging Face config.json) with a parallel layout.")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    p.add_argument("--nproc", type=ranks("nproc"), default=None,
                   help="processes to start on this machine (default: product of the degrees, over --nnodes)")
    nodes = p.add_argument_group("several machines", "run the same command on every node, changing only "
                                 "--node-rank (docs/multinode.md)")
    nodes.add_argument("--nnodes", type=ranks("nnodes"), default=1,
                       help="machines in the job; --nproc is per machine")
    nodes.add_argument("--node-rank", type=ranks("node_rank", min=0), default=0,
                       help="this machine's number, 0..nnodes-1; node 0 hosts the rendezvous")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="node 0's address and a free port there, reachable from every node")
    nodes.add_argument("--rdzv-id", default=None, help="the job's name at the rendezvous, the same on every node "
                       "(default: workbench)")
    nodes.add_argument("--rdzv-timeout", type=seconds("rdzv_timeout"), default=None, metavar="SECONDS",
                       help="how long a node waits for the others (default: $WORKBENCH_RDZV_TIMEOUT_S or 300)")
    add_arguments(p, ("parallel", "train"))
    add_arguments(p, "model", given_only=True)  # over the model's own values only where typed
    p.add_argument("--out", type=output_dir, default=None, help="run directory, one per node (default: "
                   "./runs/<time>, and "
                   "./runs/<time>-node<R> on several machines); one that already holds a run is refused "
                   "unless --resume or --overwrite is given")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out: delete its "
                   "events, config, logs, memory timelines and checkpoints (with --resume its checkpoints are "
                   "kept, to resume from)")
    p.add_argument("--adopt-ckpt-dir", action="store_true", help="save into a --ckpt-dir that another run "
                   "owns, making this run its owner (its checkpoints stay and rotate with this run's)")
    p.add_argument("--timeout", type=seconds("timeout"), default=None,
                   help="stop the run after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of progress")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from workbench.settings import from_args, given
    from workbench.train.launcher import build_job, launch
    from workbench.train.nodes import node_settings
    from workbench.train.rundir import RunDirInUse
    from workbench.train.torchrun_rank import run_args, under_torchrun

    if under_torchrun():  # a rank of a plain torchrun: train as that rank (launching here would race the others)
        return run_args(args, default_out=lambda: _default_out(None))
    where = dict(nnodes=args.nnodes, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                 rdzv_id=args.rdzv_id, rdzv_timeout_s=args.rdzv_timeout)
    try:  # validate before anything is created or started
        settings = dict(nproc=args.nproc, parallel=from_args(args, "parallel"), train=from_args(args, "train"),
                        **given(args, "model"))
        multinode = node_settings(**where) is not None
        build_job(args.model, nnodes=args.nnodes, **settings)
    except ValueError as e:
        return error(str(e), args.json)
    # Nodes sharing a file system (and a start time, under srun) must not share a run directory.
    out = args.out or str(_default_out(args.node_rank if multinode else None))
    try:
        run = launch(args.model, out=out, overwrite=args.overwrite, adopt_ckpt_dir=args.adopt_ckpt_dir, **where,
                     **settings)
    except RunDirInUse as e:  # --out holds a run: name --resume and --overwrite
        return error(e.for_cli(), args.json)
    except ValueError as e:  # e.g. --resume: no complete checkpoint there, or it does not fit the model
        return error(str(e), args.json)
    deadline = None if args.timeout is None else (time.monotonic() + args.timeout, args.timeout)
    try:
        if args.json:
            _follow_quietly(run, deadline)
        else:
            _follow_with_progress(run, deadline)
    except KeyboardInterrupt:
        run.stop()
        return error("interrupted; all ranks were stopped", args.json, 130)
    except TimeoutError as e:
        return error(str(e), args.json, EXIT_FAILED)

    from workbench.train.outcome import print_outcome

    print_outcome(run, args.json)
    if run.status == "succeeded":
        return 0
    return EXIT_FAILED


def _default_out(node_rank: int | None) -> Path:
    """``./runs/<time>`` (``-node<R>`` on several machines), with a suffix if a run started there this second."""
    base = time.strftime("%Y%m%d-%H%M%S") + (f"-node{node_rank}" if node_rank is not None else "")
    out, n = Path("runs") / base, 1
    while out.exists():
        n += 1
        out = Path("runs") / f"{base}-{n}"
    return out


def _check_deadline(run, deadline: tuple[float, float] | None) -> None:
    if deadline is not None and time.monotonic() > deadline[0]:
        run.stop()
        raise TimeoutError(f"run did not finish within --timeout {deadline[1]:g} s; all ranks were stopped "
                           f"({run.run_dir}); raise --timeout or lower --steps")


def _follow_quietly(run, deadline: tuple[float, float] | None) -> None:
    while not run.done:
        _check_deadline(run, deadline)
        time.sleep(0.1)


def _follow_with_progress(run, deadline: tuple[float, float] | None) -> None:
    from workbench.progress import tqdm

    from workbench.train.resumed import Resumed

    node = run.job.nodes
    where = f" node {node['node_rank']}/{node['nnodes']}" if node else ""
    # A resumed run starts at its checkpoint's step (100/120, not 0/120); the rate counts this run's steps.
    bar = tqdm(total=run.job.train.steps, initial=run.start_step,
               desc=f"{run.job.model.name} [{run.job.parallel.describe()}]{where}", unit="step")
    started: set[int] = set()  # every local rank starts before any finishes a step (a step's collectives need all)
    try:
        for event in run.events():
            _check_deadline(run, deadline)
            if event["type"] == "start":
                started.add(event["rank"])
            if event["type"] == "resume" and event["rank"] == min(started, default=event["rank"]):
                resumed = Resumed.from_event(event)
                bar.write(resumed.describe(), file=sys.stderr)
                if bar.n != resumed.step:  # rank 0 fell back past a damaged checkpoint
                    bar.n = bar.initial = resumed.step
                    bar.refresh()
            if event["type"] == "init_from" and event["rank"] == min(started, default=event["rank"]):
                bar.write(f"weights from {event['path']} ({event['tensors']} tensors; optimizer and step "
                          "start fresh)", file=sys.stderr)
            # rank 0 on one node; this node's first rank on the others
            if event["type"] == "step" and event["rank"] == min(started, default=event["rank"]):
                bar.set_postfix(loss=f"{event['loss']:.4f}", tok_s=f"{event['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
    finally:
        bar.close()  # ends the bar's line, so a message after it (a timeout, an error) starts on its own


# --------------------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------------------


def _add_presets(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the model presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)


def cmd_presets(args: argparse.Namespace) -> int:
    from workbench.config import PRESETS

    rows = {name: {**cfg.to_dict(), "n_params": cfg.n_params} for name, cfg in PRESETS.items()}
    if args.json:
        emit_json(rows)
        return 0
    print(f"{'preset':<10} {'params':>10} {'dim':>6} {'layers':>6} {'heads':>5} {'kv':>4} {'ffn':>6} {'vocab':>6}")
    for name, r in rows.items():
        print(f"{name:<10} {r['n_params'] / 1e6:>9.1f}M {r['dim']:>6} {r['n_layers']:>6} {r['n_heads']:>5} "
              f"{r['n_kv_heads']:>4} {r['ffn_hidden']:>6} {r['vocab_size']:>6}")
    return 0


# --------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line (and as JSON under --json)."""

    json_requested = False  # set by main() from the arguments it parses (which may not be sys.argv)

    def error(self, message: str) -> None:  # type: ignore[override]
        if _Parser.json_requested:
            emit_json({"status": "error", "error": message})
        else:
            print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


# Command groups that live next to the API they front: each module exposes ``add_parser(sub)``. Building the
# parser imports them all, so none may import torch, pandas or Triton before its handler runs (help and
# --version stay fast; tests/test_imports.py). spmd's and kernels' live beside this file because importing
# those packages registers rules and custom ops.
_COMMAND_MODULES: list[str] = ["workbench.plan.cli", "workbench.prediction.cli", "workbench.prediction.time_cli",
                               "workbench.prediction.advise_cli",
                               "workbench.checkpoint.cli", "workbench.cli_spmd", "workbench.cli_kernels",
                               "workbench.rl.cli", "workbench.embedding.cli", "workbench.doctor"]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="workbench", description="Parallel Workbench: parallel training on PyTorch, inspectable.")
    from workbench.version import __version__

    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    _add_presets(sub)
    import importlib

    for name in _COMMAND_MODULES:  # each exposes add_parser(sub), which sets func on its parsers
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _Parser.json_requested = "--json" in (sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    as_json = getattr(args, "json", False)
    try:
        return args.func(args)
    except BrokenPipeError:  # `workbench ... | head` closed stdout early: end quietly and well, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return 0
    except KeyboardInterrupt:
        return error("interrupted", as_json, 130)
    # The last word for what a command did not catch itself: one line (the traceback only under
    # WORKBENCH_DEBUG=1), naming the command's input where the error does not name a file.
    except ValueError as e:  # our checks' one-line messages: bad input
        return unexpected(e, as_json, code=EXIT_USAGE, hint=False)
    except Exception as e:  # noqa: BLE001
        if _missing_torch_api(e):  # a feature this torch cannot run (workbench doctor lists them)
            return error(f"{e}; this command needs it (see `workbench doctor`)", as_json, EXIT_FAILED)
        return unexpected(e, as_json, subject=_subject(args))


def _missing_torch_api(e: Exception) -> bool:
    """``e`` is workbench.compat's MissingTorchAPI (only a command that imported compat, and so torch, can
    raise it: the commands that need no torch never load it)."""
    compat = sys.modules.get("workbench.compat")
    return compat is not None and isinstance(e, compat.MissingTorchAPI)


def _subject(args: argparse.Namespace) -> str | None:
    """The input a command was given (a path or a model), to name in an error that names none."""
    for name in ("path", "src", "model", "measured", "paths", "a"):
        value = getattr(args, name, None)
        if value:
            return " ".join(map(str, value)) if isinstance(value, list) else str(value)
    return None


if __name__ == "__main__":
    sys.exit(main())
