"""``workbench time predict``: one step's predicted timeline per distinct rank, for any layout and scale.

    workbench time predict small --dp-shard 2 --tp 2                                  # this CPU (4 gloo ranks)
    workbench time predict llama-70b --dp-shard 32 --tp 8 --device cuda --gpu H100-SXM --nodes 32
    workbench time predict small --pp 2 --pp-schedule 1F1B --microbatches 4 --json

``add_predict(tsub)`` adds the subcommand to ``workbench time`` (``workbench.prediction.time_cli``).
"""

from __future__ import annotations

import argparse

from workbench.cli_output import emit_json, error
from workbench.config import PRESETS
from workbench.settings import add_arguments, bounded, from_args, output_dir, ranks

__all__ = ["add_predict", "cmd_predict"]


def _gpu(text: str) -> str:
    """A device profile's name (or a profile .json path); an unknown name lists the choices."""
    from workbench.time.devices import device_profile

    try:
        device_profile(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_predict(tsub: argparse._SubParsersAction) -> None:
    p = tsub.add_parser("predict", help="predict one step's timeline per rank for a layout (any world size)",
                        description="Run one training step per distinct rank on fake tensors and a fake process "
                                    "group (the trainer's build path), price every operator on a device profile's "
                                    "roofline and every collective on its link model, and play them with each "
                                    "technique's overlap and the pipeline schedule.")
    p.add_argument("model", help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json path")
    p.add_argument("--nproc", type=ranks("nproc"), default=None, help="processes (default: product of the degrees)")
    add_arguments(p, ("parallel", "train"), exclude=("device", "profile"))  # not a run: no tracing
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="what to predict for: this machine's CPU ranks (a calibrated profile if saved) or GPUs")
    p.add_argument("--gpu", type=_gpu, default=None, metavar="NAME",
                   help="with --device cuda: a device profile (H100-SXM, H200, A100-SXM-80GB, or a saved one)")
    p.add_argument("--profile", type=_gpu, default=None, metavar="PATH", dest="device_profile",
                   help="a device profile's JSON file (e.g. one `workbench time calibrate` saved)")
    p.add_argument("--nodes", type=bounded("int", "nodes", min=1), default=None, help="nodes the ranks are spread over")
    p.add_argument("--gpus-per-node", type=bounded("int", "gpus-per-node", min=1), default=None,
                   help="ranks per node (default: the profile's, 8 for the shipped GPUs; CPU: all on one)")
    p.add_argument("--no-fold", action="store_true", help="simulate every transformer block (slower)")
    p.add_argument("--out", type=output_dir, default=None, help="save the predicted timeline into this directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from workbench.prediction.step_time import predict_time

    if args.gpu and args.device != "cuda":
        return error(f"--gpu {args.gpu} names a GPU: add --device cuda", args.json)
    try:
        tl = predict_time(args.model, device=args.device, gpu=args.gpu, profile=args.device_profile, nodes=args.nodes,
                          gpus_per_node=args.gpus_per_node, progress=not args.json, fold=not args.no_fold,
                          parallel=from_args(args, "parallel"), train=from_args(args, "train"), nproc=args.nproc)
    except (ValueError, TypeError) as e:
        return error(str(e), args.json)
    if args.out:
        tl.save(args.out)
    m = tl.meta
    if args.json:
        doc = {"status": "ok", **{k: m[k] for k in ("model", "layout", "world_size", "nodes", "gpus_per_node",
                                                    "device_model", "step_time_s", "tokens_per_s",
                                                    "tokens_per_s_per_rank", "step_time_s_by_rank", "bound",
                                                    "flops", "comm_bytes", "seconds", "rank_map")},
               "seconds_by_category": {str(r): {c: float(v) for c, v in row.items()}
                                       for r, row in tl.totals().iterrows()},
               "simulate_s": m["simulate_s"], "spans": len(tl)}
        if args.out:
            doc["saved"] = str(args.out)
        emit_json(doc)
        return 0
    dm = m["device_model"]
    print(f"{m['model']}  [{m['layout']}]  {m['world_size']} ranks on {m['nodes']} node(s) x {m['gpus_per_node']}, "
          f"device {dm['name']} ({'calibrated' if dm['calibrated'] else 'uncalibrated: data sheet / defaults'})")
    print(f"step {m['step_time_s'] * 1e3:.2f} ms, {m['tokens_per_s']:,.0f} tokens/s "
          f"({m['tokens_per_s_per_rank']:,.1f} per rank); simulated in {m['simulate_s']:.1f} s")
    tot = tl.totals()
    print(f"{'rank':>6} {'step ms':>9} {'bound':>13} {'TFLOP':>8} "
          + " ".join(f"{c[:8]:>9}" for c in tot.columns))
    for r in tl.ranks:
        row = tot.loc[r]
        print(f"{r:>6} {m['step_time_s_by_rank'][str(r)] * 1e3:>9.2f} {m['bound'][str(r)]:>13} "
              f"{m['flops'][str(r)] / 1e12:>8.3f} " + " ".join(f"{v * 1e3:>9.2f}" for v in row.values))
    print("(ms per category, summed over spans; communication on the comm stream overlaps compute)")
    if args.out:
        print(f"saved to {args.out}")
    return 0
