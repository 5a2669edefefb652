"""``workbench advise``: the fastest layouts of a model that fit a GPU (:mod:`workbench.prediction.advise`).

    workbench advise llama-70b --gpus 1024 --gpu-memory 80GiB --gpu H100-SXM --global-batch 1024 --seq-len 4096
    workbench advise small --gpus 4 --gpu-memory 8GiB --gpu cpu --top 5 --json

``--json`` prints one JSON document: the settings, the rules, the ranked layouts, the Pareto front and the
pruned layouts counted by rule. Bad input is one ``error:`` line.
"""

from __future__ import annotations

import argparse
import sys

from workbench.cli_output import emit_json, error
from workbench.config import MAX_BATCH, MAX_SEQ_LEN, PRESETS
from workbench.settings import bounded, ranks

__all__ = ["add_parser", "cmd_advise"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("advise", help="the fastest layouts of a model that fit a GPU (predicted)",
                       description="Search dp_replicate/dp_shard/tp/sp/pp (schedule, micro-batches)/ep, activation "
                                   "checkpointing and the micro batch; prune by rule and by the memory predictor; "
                                   "rank the layouts that fit by predicted tokens/s and say what bounds each.")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    p.add_argument("--gpus", type=ranks("gpus"), required=True, help="GPUs (ranks) of the job")
    p.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory of one GPU, e.g. 80GiB")
    p.add_argument("--gpu", default="H100-SXM", metavar="PROFILE",
                   help="device profile: H100-SXM, H200, A100-SXM-80GB, cpu (CPU ranks) or a profile .json "
                        "(default H100-SXM)")
    p.add_argument("--nodes", type=ranks("nodes"), default=None, help="nodes (default: gpus / gpus-per-node)")
    p.add_argument("--gpus-per-node", type=ranks("gpus-per-node"), default=8, help="GPUs per node (default 8)")
    p.add_argument("--global-batch", type=bounded("int", "global-batch", min=1, limit=MAX_BATCH), default=None,
                   help="sequences per step, the same for every layout (default: one per GPU)")
    p.add_argument("--seq-len", type=bounded("int", "seq-len", min=1, limit=MAX_SEQ_LEN), default=None,
                   help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--top", type=bounded("int", "top", min=1, limit=1000), default=10,
                   help="layouts to rank (default 10)")
    p.add_argument("--exact", type=bounded("int", "exact", min=0, limit=10000), default=None,
                   help="at most this many layouts checked with the memory and step-time predictors (default "
                        "2 x top; 0: the closed-form screen alone)")
    p.add_argument("--time-limit", type=bounded("float", "time-limit", min=0, exclusive_min=True), default=None,
                   metavar="SECONDS", help="start no check with the predictors after this many seconds; the layouts "
                                           "left keep the screen's figures (default: no limit)")
    p.add_argument("--margin", default="auto", metavar="SIZE",
                   help="memory per GPU outside the caching allocator, e.g. 1.5GiB or 0; auto: 512 MiB + 256 MiB "
                        "per NCCL communicator")
    p.add_argument("--all", action="store_true", help="with --json: every layout considered, not only the ranked")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    from workbench.prediction.advise import advise
    from workbench.units import check_margin, parse_bytes

    try:
        parse_bytes(args.gpu_memory)  # a typo fails before any work
        check_margin(args.margin)
        advice = advise(args.model, gpus=args.gpus, gpu_memory=args.gpu_memory, gpu=args.gpu, nodes=args.nodes,
                        gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, seq_len=args.seq_len,
                        top=args.top, exact=args.exact, margin=args.margin, time_limit=args.time_limit,
                        progress=not args.json)
    except (ValueError, TypeError) as e:
        return error(str(e), args.json)
    if args.json:
        emit_json(advice.to_dict("all" if args.all else "top"))
    else:
        sys.stdout.write(repr(advice) + "\n")
    return 0
