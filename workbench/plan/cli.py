"""``workbench plan MODEL --dp-shard 128 --tp 8 [--json]``: the sharding plan of a layout, simulated.

Text output is a summary (bytes per rank by category, worst and best rank; communication per step by
collective and mesh dimension). ``--json`` prints one document: the summary, every tensor with its
placements, every rank's totals (``rank_bytes``: one list per category, indexed by rank) and the
communication rows. Invalid layouts print one ``error:`` line and exit 2, as ``workbench train`` does.
"""

from __future__ import annotations

import argparse

from workbench.cli_output import emit_json, error
from workbench.config import PRESETS
from workbench.kinds import STATE_KINDS
from workbench.settings import add_arguments, from_args, given
from workbench.units import format_bytes

__all__ = ["add_parser", "cmd_plan"]


# The training settings that change a plan (the batch shape and the dtypes); the rest only matter to a run.
PLAN_TRAIN_SETTINGS = ("global_batch", "micro_batch", "seq_len", "dtype", "mixed_precision")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate a layout at any world size: what each rank holds and sends",
                       description="Simulate a parallel layout on the meta device under a fake process group "
                                   "(no GPU, no allocation) and report per-rank memory and communication.")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    add_arguments(p, "parallel")
    add_arguments(p, "train", only=PLAN_TRAIN_SETTINGS, given_only=True, help={
        "global_batch": "sequences per step (default: the smallest multiple of dp [x microbatches] >= 8)"})
    p.add_argument("--json", action="store_true", help="print one JSON document (with every rank's totals)")
    p.set_defaults(func=cmd_plan)


def _build(args: argparse.Namespace):
    from workbench.plan import plan_configs

    return plan_configs(from_args(args, "parallel"), **given(args, "train"))


def cmd_plan(args: argparse.Namespace) -> int:
    from workbench.plan.simulate import plan

    try:
        parallel, train = _build(args)
        result = plan(args.model, parallel, train)
    except (ValueError, TypeError) as e:
        return error(str(e), args.json)
    if args.json:
        emit_json({"status": "ok", **result.to_dict()})
        return 0
    s = result.summary()
    mesh = " ".join(f"{k}={v}" for k, v in s["mesh"].items())
    print(f"{s['model_name']}  [{s['layout']}]  {s['world_size']} ranks  (mesh {mesh})")
    print(f"{s['n_params']:,} parameters in {s['n_tensors']} tensors ({format_bytes(s['param_bytes'])} as stored), "
          f"zero={s['zero']}, mixed_precision={s['mixed_precision']}, "
          f"global_batch={train.global_batch} x seq_len={train.seq_len}")
    print()
    print(f"{'per rank':<12} {'max':>14} {'min':>14}")
    for k in (*STATE_KINDS, "total"):
        print(f"{k:<12} {format_bytes(s['max_rank_bytes'][k]):>14} {format_bytes(s['min_rank_bytes'][k]):>14}")
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
            print(f"{lead}{r.collective:<15} {r.mesh_dim:<16} {r.phase:<10} {format_bytes(r.bytes_per_rank):>14} "
                  f"{r.calls_per_step:>7}")
        print(f"{'total (busiest rank)':<43} {format_bytes(s['comm_bytes_per_step']):>14}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
