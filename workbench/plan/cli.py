"""``workbench plan MODEL --dp-shard 128 --tp 8 [--json]``: the sharding plan of a layout, simulated.

Text output is a summary (bytes per rank by category, worst and best rank; communication per step by
collective and mesh dimension). ``--json`` prints one document: the summary, every tensor with its
placements, every rank's totals (``rank_bytes``: one list per category, indexed by rank) and the
communication rows. Invalid layouts print one ``error:`` line and exit 2, as ``workbench train`` does.

``--memory [cpu|cuda]`` also predicts each rank's peak memory, activations included, from one training
step run on fake tensors (``ShardingPlan.predict_memory``), and prints it grouped by value; ``--budget
80GiB`` answers whether the job fits per rank and the largest micro batch that does
(``ShardingPlan.fits``). Under ``--json`` they are ``memory_device``, ``predicted_peak_bytes``
(rank -> bytes) and ``fit``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from contextlib import contextmanager
from typing import Iterator

from workbench.cli_output import EXIT_FAILED, emit_json, error
from workbench.config import PRESETS
from workbench.kinds import STATE_KINDS
from workbench.settings import add_arguments, from_args, given
from workbench.units import format_bytes

__all__ = ["add_parser", "cmd_plan"]


# The training settings that change a plan (the batch shape and the dtypes; activation checkpointing changes
# its --memory prediction); the rest only matter to a run.
PLAN_TRAIN_SETTINGS = ("global_batch", "micro_batch", "seq_len", "dtype", "mixed_precision", "activation_checkpointing",
                       "ac_every")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="simulate a layout at any world size: what each rank holds and sends",
                       description="Simulate a parallel layout on the meta device under a fake process group "
                                   "(no GPU, no allocation) and report per-rank memory and communication.")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    add_arguments(p, "parallel")
    add_arguments(p, "train", only=PLAN_TRAIN_SETTINGS, given_only=True, help={
        "global_batch": "sequences per step (default: the smallest multiple of dp [x microbatches] >= 8)"})
    p.add_argument("--memory", dest="memory_device", nargs="?", const="cuda", default=None,
                   choices=("cpu", "cuda"),
                   help="also predict each rank's peak memory, activations included, by running one training "
                        "step on fake tensors (no GPU needed); the device the prediction targets. Given alone: "
                        "cuda (what torch.cuda.max_memory_allocated would report), since plans are for GPU jobs")
    p.add_argument("--budget", dest="memory_budget", default=None, metavar="SIZE",
                   help="memory per rank, e.g. 80GiB: does the job fit, and the largest micro batch that does "
                        "(predicted for the --memory device, cuda when not given; on CUDA: the reserved peak "
                        "plus --margin)")
    p.add_argument("--margin", dest="memory_margin", default="auto", metavar="SIZE",
                   help="with --budget on CUDA: memory per rank outside the caching allocator (CUDA context, "
                        "NCCL buffers), e.g. 1.5GiB or 0; auto: 512 MiB + 256 MiB per NCCL communicator")
    p.add_argument("--json", action="store_true", help="print one JSON document (with every rank's totals)")
    p.set_defaults(func=cmd_plan)


def _build(args: argparse.Namespace):
    from workbench.plan import plan_configs

    return plan_configs(from_args(args, "parallel"), **given(args, "train"))


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        with _collector_paused():
            from workbench.plan.simulate import plan

            parallel, train = _build(args)
            result = plan(args.model, parallel, train)
    except (ValueError, TypeError) as e:
        return error(str(e), args.json)
    device = args.memory_device or ("cuda" if args.memory_budget is not None else None)
    fit = None
    if device is not None:
        from workbench.units import check_margin, parse_bytes

        try:  # the bar goes to stderr: a --json document on stdout stays clean
            if args.memory_budget is not None:
                parse_bytes(args.memory_budget)  # a typo fails before seconds of prediction
                check_margin(args.memory_margin)
            result.predict_memory(device, progress=not args.json)
            if args.memory_budget is not None:
                fit = result.fits(args.memory_budget, device=device, progress=not args.json,
                                  margin=args.memory_margin)
        except (ValueError, TypeError) as e:
            return error(_one_line(e), args.json)
        except RuntimeError as e:  # a prediction that ran and failed
            return error(_one_line(e), args.json, code=EXIT_FAILED)
    if args.json:
        doc = {"status": "ok", **result.to_dict()}
        if fit is not None:
            doc["fit"] = {"device": device, **dataclasses.asdict(fit), "text": str(fit)}
        emit_json(doc)
        return 0
    s = result.summary()
    mesh = " ".join(f"{k}={v}" for k, v in s["mesh"].items())
    print(f"{s['model_name']}  [{s['layout']}]  {s['world_size']} ranks  (mesh {mesh})")
    print(f"{s['n_params']:,} parameters in {s['n_tensors']} tensors ({format_bytes(s['param_bytes'])} as stored), "
          f"zero={s['zero']}, mixed_precision={s['mixed_precision']}, "
          f"global_batch={train.global_batch} x seq_len={train.seq_len}")
    if train.activation_checkpointing != "none":
        from workbench.parallel.checkpointing import ac_policy

        print(f"activation checkpointing: {ac_policy(train.activation_checkpointing, train.ac_every)}")
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
    if device is not None:
        _print_memory(result, device, fit)
    return 0


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while torch loads and the plan is simulated, and what that made
    frozen afterwards (never scanned again, the simulation's few garbage cycles included). That work leaves
    ~300,000 long-lived objects, and the full collections they triggered took 0.6 to 0.9 s of the 1024-rank
    plan's ~3.3 s of CPU (measured; unfrozen, the young collections after it cost 0.3 s more). The command is
    one short process; a --memory prediction after it runs with the collector on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def _print_memory(result, device: str, fit) -> None:
    """Predicted peak per rank, ranks of equal peak on one line, then the fit answer."""
    tl = result.predict_memory(device)
    peaks = result.predicted_peaks(device)
    at_peak = {r: tl.peak(r) for r in tl.ranks}  # the distinct ranks the prediction ran
    rank_map = {int(k): int(v) for k, v in tl.meta.get("rank_map", {}).items()}
    groups: dict[int, list[int]] = {}
    for rank, b in peaks.items():
        groups.setdefault(int(b), []).append(int(rank))
    print()
    print(f"predicted peak memory per rank ({device}, activations included; {len(at_peak)} distinct rank(s) "
          f"simulated):")
    for b, ranks in sorted(groups.items(), reverse=True):
        p = at_peak.get(rank_map.get(ranks[0], ranks[0]))
        where = ""
        if p is not None:
            top = sorted(p.by_category.items(), key=lambda kv: -kv[1])[:3]
            where = f"  at {p.phase}: " + ", ".join(f"{c} {format_bytes(v)}" for c, v in top)
        print(f"{format_bytes(b):>14}  ranks {_rank_ranges(ranks)}{where}")
    if fit is not None:
        print(f"budget: {fit}")


def _one_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _rank_ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 8, 9]`` -> ``"0-2, 5, 8-9"``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
