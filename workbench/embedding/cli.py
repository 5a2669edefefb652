"""``workbench train-embedding``: the contrastive embedding trainer from the command line (the same
:func:`workbench.embedding.train_embedding` the notebooks call)."""

from __future__ import annotations

import argparse
import sys

from workbench.cli_output import EXIT_FAILED, emit_json, error
from workbench.config import PRESETS


def add_parser(sub: argparse._SubParsersAction) -> None:
    from workbench.embedding.config import EmbeddingConfig
    from workbench.settings import add_arguments, output_dir, ranks, seconds

    p = sub.add_parser("train-embedding", help="train a contrastive sentence encoder (InfoNCE, cross-rank "
                       "negatives, GradCache chunks) on verse pairs from the shipped text",
                       description="Train a Llama preset as a sentence encoder: pooled final hidden states, InfoNCE "
                       "over every data-parallel rank's candidates, retrieval accuracy on held-out verses.")
    dense = [name for name, cfg in PRESETS.items() if not cfg.n_experts]
    p.add_argument("model", nargs="?", default="tiny",
                   help=f"a dense preset ({', '.join(dense)}) or a Hugging Face config.json path (default tiny)")
    p.add_argument("--nproc", type=ranks("nproc"), default=None,
                   help="processes (default: the product of the degrees)")
    add_arguments(p, EmbeddingConfig)
    add_arguments(p, ("parallel", "train"))
    add_arguments(p, "model", given_only=True)
    p.add_argument("--out", type=output_dir, default=None, help="run directory (default: ./runs/embedding-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out: delete its events, config, logs and "
                   "checkpoints (with --resume its checkpoints are kept, to resume from)")
    p.add_argument("--adopt-ckpt-dir", action="store_true", help="save into a --ckpt-dir that another run "
                   "owns, making this run its owner (its checkpoints stay and rotate with this run's)")
    p.add_argument("--timeout", type=seconds("timeout"), default=None, metavar="SECONDS",
                   help="stop every rank after this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of progress")
    p.set_defaults(func=cmd_train_embedding)


def cmd_train_embedding(args: argparse.Namespace) -> int:
    from workbench.embedding.config import EmbeddingConfig
    from workbench.embedding.trainer import build_embedding_job, train_embedding
    from workbench.settings import from_args, given

    try:
        settings = dict(nproc=args.nproc, parallel=from_args(args, "parallel"), train=from_args(args, "train"),
                        embedding=from_args(args, EmbeddingConfig), **given(args, "model"))
        build_embedding_job(args.model, **settings)  # every setting checked before anything starts
    except ValueError as e:
        return error(str(e), args.json)
    from workbench.train.rundir import RunDirInUse

    try:
        run = train_embedding(args.model, out=args.out, timeout_s=args.timeout, progress=not args.json,
                              in_process=False, overwrite=args.overwrite, adopt_ckpt_dir=args.adopt_ckpt_dir,
                              **settings)
    except RunDirInUse as e:
        return error(e.for_cli(), args.json)
    except ValueError as e:  # e.g. --resume: no complete checkpoint there
        return error(str(e), args.json)
    except (RuntimeError, TimeoutError) as e:
        return error(str(e), args.json, EXIT_FAILED)
    except KeyboardInterrupt:
        return error("interrupted; all ranks were stopped", args.json, 130)
    summary = run.to_dict()
    if args.json:
        emit_json({"status": "succeeded", **summary})
        return 0
    ev = run.evals
    first, last = ev.iloc[0], ev.iloc[-1]
    print(f"done: {summary['steps']} steps, loss {summary['final_loss']:.4f}; top-1 retrieval "
          f"{first.retrieval_accuracy:.3f} (step {int(first.step)}) -> {last.retrieval_accuracy:.3f} "
          f"(step {int(last.step)}), chance {last.chance:.3f}; events in {run.run_dir / 'events.jsonl'}",
          file=sys.stdout)
    return 0
