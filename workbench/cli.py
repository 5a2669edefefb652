"""``workbench`` command line: a thin front end over the same APIs the notebooks use.

Every command takes ``--json`` and then prints exactly one JSON document on stdout. Bad input prints one
``error: ...`` line naming the problem and the fix, and exits 2; a failed run exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

EXIT_FAILED = 1
EXIT_USAGE = 2


def _emit_json(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, indent=2, default=str))


def _error(msg: str, as_json: bool, code: int = EXIT_USAGE, **extra: Any) -> int:
    if as_json:
        _emit_json({"status": "error", "error": msg, **extra})
    else:
        print(f"error: {msg}", file=sys.stderr)
    return code


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on N local processes through torchrun",
                       description="Train a preset (or a Hugging Face config.json) with a parallel layout.")
    p.add_argument("model", help="preset (tiny, small, llama-7b, llama-70b) or path to a config.json")
    p.add_argument("--nproc", type=int, default=None, help="processes to start (default: product of the degrees)")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicated data-parallel degree (DDP / HSDP)")
    p.add_argument("--dp-shard", type=int, default=-1, help="sharded data-parallel degree (FSDP2); -1 = the rest of nproc")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models; taken from --dp-shard)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages over ranks, outermost)")
    p.add_argument("--pp-schedule", choices=["GPipe", "1F1B", "Interleaved1F1B", "GPipeLean"], default="1F1B",
                   help="pipeline schedule (GPipeLean: GPipe that frees outputs and buffers early)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches per step (default: pp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step, whatever the layout")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per forward (gradient accumulation)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--data", choices=["synthetic", "text"], default="synthetic")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none",
                   help="bf16 compute with fp32 master weights and optimizer state")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none",
                   help="activation checkpointing: every block (full) or every --ac-every-th (selective)")
    p.add_argument("--ac-every", type=int, default=2, help="selective checkpointing: every K-th block")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=3,
                   help="ZeRO stage of --dp-shard: 0 DDP, 1 +sharded optimizer, 2 FSDP2 no reshard, 3 FSDP2")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--ckpt-every", type=int, default=0, metavar="N", help="save a checkpoint every N steps (0: never)")
    ck.add_argument("--ckpt-async", action="store_true", help="write checkpoints in the background after a host copy")
    ck.add_argument("--zero-stall", action="store_true",
                    help="snapshot to host memory every step, persist every --ckpt-every steps")
    ck.add_argument("--keep", type=int, default=None, metavar="K", help="keep the newest K checkpoints (default: all)")
    ck.add_argument("--keep-every", type=int, default=0, metavar="N", help="also keep every N-th step forever")
    ck.add_argument("--ckpt-dir", default=None, help="checkpoint directory (default: RUN_DIR/checkpoints)")
    ck.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH|latest",
                    help="resume from a checkpoint (default: the newest complete one); any layout")
    ck.add_argument("--ema", type=float, default=0.0, metavar="DECAY", help="keep and save an EMA of the weights")
    p.add_argument("--out", default=None, help="run directory (default: ./runs/<time>)")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of progress")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from workbench.train.launcher import build_job, launch

    settings = dict(
        nproc=args.nproc, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp,
        sequence_parallel=args.sp, steps=args.steps, global_batch=args.global_batch,
        micro_batch=args.micro_batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
        dtype=args.dtype, data=args.data, mixed_precision=args.mixed_precision,
        activation_checkpointing=args.ac, ac_every=args.ac_every, zero=args.zero,
        ep=args.ep, pp=args.pp, pp_schedule=args.pp_schedule, microbatches=args.microbatches,
        ckpt_every=args.ckpt_every, ckpt_async=args.ckpt_async, zero_stall=args.zero_stall, keep=args.keep,
        keep_every=args.keep_every, ckpt_dir=args.ckpt_dir, resume=args.resume, ema=args.ema,
    )
    try:
        build_job(args.model, **settings)  # validate before anything is created or started
    except ValueError as e:
        return _error(str(e), args.json)
    out = args.out or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    try:
        run = launch(args.model, out=out, **settings)
    except ValueError as e:  # e.g. --resume: no complete checkpoint there, or it does not fit the model
        return _error(str(e), args.json)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        if args.json:
            _follow_quietly(run, deadline)
        else:
            _follow_with_progress(run, deadline)
    except KeyboardInterrupt:
        run.stop()
        return _error("interrupted; all ranks were stopped", args.json, 130)
    except TimeoutError as e:
        return _error(str(e), args.json, EXIT_FAILED)

    summary = run.summary()
    err = run.error
    if args.json:
        losses = {int(r): g["loss"].tolist() for r, g in run.metrics.groupby("rank")} if len(run.metrics) else {}
        summary["losses"] = losses
        if err is not None:
            summary["error"] = {"rank": err.rank, "message": err.message, "traceback": err.traceback}
        _emit_json(summary)
    elif err is not None:
        if err.traceback:
            print(err.traceback.rstrip(), file=sys.stderr)
        print(f"error: {err}  (logs: {run.log_path})", file=sys.stderr)
    else:
        print(f"done: {summary['steps_logged']} steps, loss {summary.get('first_loss', float('nan')):.4f} -> "
              f"{summary.get('final_loss', float('nan')):.4f}, {summary.get('tokens_per_s', 0):.0f} tokens/s; "
              f"events in {run.run_dir / 'events.jsonl'}")
    if run.status == "succeeded":
        return 0
    return EXIT_FAILED


def _check_deadline(run, deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        run.stop()
        raise TimeoutError(f"run did not finish within the --timeout; all ranks were stopped ({run.run_dir})")


def _follow_quietly(run, deadline: float | None) -> None:
    while not run.done:
        _check_deadline(run, deadline)
        time.sleep(0.1)


def _follow_with_progress(run, deadline: float | None) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(total=run.job.train.steps, desc=f"{run.job.model.name} [{run.job.parallel.describe()}]", unit="step")
    for event in run.events():
        _check_deadline(run, deadline)
        if event["type"] == "step" and event["rank"] == 0:
            bar.set_postfix(loss=f"{event['loss']:.4f}", tok_s=f"{event['tokens_per_s']:.0f}", refresh=False)
            bar.update(1)
    bar.close()


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
        _emit_json(rows)
        return 0
    print(f"{'preset':<10} {'params':>10} {'dim':>6} {'layers':>6} {'heads':>5} {'kv':>4} {'ffn':>6} {'vocab':>6}")
    for name, r in rows.items():
        print(f"{name:<10} {r['n_params'] / 1e6:>9.1f}M {r['dim']:>6} {r['n_layers']:>6} {r['n_heads']:>5} "
              f"{r['n_kv_heads']:>4} {r['ffn_hidden']:>6} {r['vocab_size']:>6}")
    return 0


# --------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line (and as JSON under --json)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "--json" in sys.argv:
            _emit_json({"status": "error", "error": message})
        else:
            print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


# Command groups that live next to the API they front: each module exposes ``add_parser(sub)``.
_COMMAND_MODULES: list[str] = ["workbench.plan.cli", "workbench.checkpoint.cli", "workbench.spmd.cli"]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="workbench", description="Parallel Workbench: parallel training on PyTorch, inspectable.")
    from workbench import __version__

    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    _add_presets(sub)
    import importlib

    for name in _COMMAND_MODULES:  # each exposes add_parser(sub), which sets func on its parsers
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `workbench ... | head` closed stdout early: end quietly, like other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
