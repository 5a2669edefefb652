"""``workbench plan MODEL --dp-shard 128 --tp 8 [--json]``: the sharding plan of a layout, simulated.

Text output is a summary (bytes per rank by category, worst and best rank; communication per step by
collective and mesh dimension). ``--json`` prints one document: the summary, every tensor with its
placements, every rank's totals (``rank_bytes``: one list per category, indexed by rank) and the
communication rows. Invalid layouts print one ``error:`` line and exit 2, as ``workbench train`` does.
"""

from __future__ import annotations

import argparse
import dataclasses

from workbench.cli import _emit_json, _error

__all__ = ["add_parser", "cmd_plan"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate a layout at any world size: what each rank holds and sends",
                       description="Simulate a parallel layout on the meta device under a fake process group "
                                   "(no GPU, no allocation) and report per-rank memory and communication.")
    p.add_argument("model", help="preset (tiny, small, llama-7b, llama-70b, tiny-moe, moe-8x7b) or a config.json path")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicated data-parallel degree (DDP / HSDP)")
    p.add_argument("--dp-shard", type=int, default=1, help="sharded data-parallel degree (FSDP2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--pp-schedule", choices=["GPipe", "1F1B", "Interleaved1F1B", "GPipeLean"], default="1F1B")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches per step (default: pp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE; taken from --dp-shard)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=3, help="ZeRO stage of --dp-shard")
    p.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step (default: the smallest multiple of dp [x microbatches] >= 8)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per forward")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64)")
    p.add_argument("--json", action="store_true", help="print one JSON document (with every rank's totals)")
    p.set_defaults(func=cmd_plan)


def _build(args: argparse.Namespace):
    from workbench.config import ParallelConfig
    from workbench.plan.simulate import _default_train

    parallel = ParallelConfig(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, tp=args.tp, pp=args.pp,
                              ep=args.ep, sequence_parallel=args.sp, pp_schedule=args.pp_schedule,
                              microbatches=args.microbatches, zero=args.zero)
    given = {"global_batch": args.global_batch, "micro_batch": args.micro_batch, "seq_len": args.seq_len}
    train = dataclasses.replace(_default_train(parallel), mixed_precision=args.mixed_precision, dtype=args.dtype,
                                **{k: v for k, v in given.items() if v is not None})
    return parallel, train


def _gib(n: float) -> str:
    from workbench.plan.types import _fmt_bytes

    return _fmt_bytes(n)


def cmd_plan(args: argparse.Namespace) -> int:
    from workbench.plan.simulate import plan

    try:
        parallel, train = _build(args)
        result = plan(args.model, parallel, train)
    except (ValueError, TypeError) as e:
        return _error(str(e), args.json)
    if args.json:
        _emit_json({"status": "ok", **result.to_dict()})
        return 0
    s = result.summary()
    mesh = " ".join(f"{k}={v}" for k, v in s["mesh"].items())
    print(f"{s['model_name']}  [{s['layout']}]  {s['world_size']} ranks  (mesh {mesh})")
    print(f"{s['n_params']:,} parameters in {s['n_tensors']} tensors ({_gib(s['param_bytes'])} as stored), "
          f"zero={s['zero']}, mixed_precision={s['mixed_precision']}, "
          f"global_batch={train.global_batch} x seq_len={train.seq_len}")
    print()
    print(f"{'per rank':<12} {'max':>14} {'min':>14}")
    for k in ("parameter", "gradient", "optimizer", "master", "total"):
        print(f"{k:<12} {_gib(s['max_rank_bytes'][k]):>14} {_gib(s['min_rank_bytes'][k]):>14}")
    comm = result.comm()
    print()
    if comm.empty:
        print("communication per step: none (single process)")
    else:
        stage_note = " (per pipeline stage; busiest stage in the total)" if parallel.pp > 1 else ""
        print(f"communication per step, bytes each rank sends{stage_note}:")
        group = ["stage"] if parallel.pp > 1 else []
        g = comm.groupby(group + ["collective", "mesh_dim", "phase"], dropna=False, as_index=False)[
            ["bytes_per_rank", "calls_per_step"]].sum()
        lead = f"{'stage':>5} " if group else ""
        print(f"{lead}{'collective':<15} {'mesh_dim':<16} {'phase':<10} {'bytes':>14} {'calls':>7}")
        for r in g.itertuples():
            lead = f"{int(r.stage):>5} " if group else ""
            print(f"{lead}{r.collective:<15} {r.mesh_dim:<16} {r.phase:<10} {_gib(r.bytes_per_rank):>14} "
                  f"{r.calls_per_step:>7}")
        print(f"{'total (busiest rank)':<43} {_gib(s['comm_bytes_per_step']):>14}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
