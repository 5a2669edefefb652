"""``workbench time calibrate``: measure this machine and save the device profile predictions use.

    workbench time calibrate                       # matmul, elementwise, op overhead, gloo on 2 and 4 ranks
    workbench time calibrate --quick --json        # ~20 s on 2 cores; one JSON document
    workbench time calibrate --ranks 2 --out prof/ # group sizes to measure; save under prof/<name>.json

``workbench/prediction/time_cli.py`` adds it to ``workbench time`` with :func:`add_calibrate`. Building the
parser imports nothing heavy (torch is imported by the handler).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workbench.cli_output import EXIT_FAILED, emit_json, error

__all__ = ["add_calibrate", "cmd_calibrate"]


def _ranks(text: str) -> tuple[int, ...]:
    from workbench.time.calibrate import parse_ranks

    try:
        return parse_ranks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--ranks: ")) from None


def _profile_path(text: str) -> str:
    """``--out``: a ``.json`` file or a directory; refused at parse time when it (or a parent) is in the way."""
    p = Path(text).expanduser()
    if p.exists() and not p.is_dir() and p.suffix != ".json":
        raise argparse.ArgumentTypeError(f"{text}: is a file that is not .json; pass a directory or a .json path")
    for q in p.parents:
        if q.exists() and not q.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: lies under {q}, which is a file; pass a path in a directory")
        if q.exists():
            break
    return text


def add_calibrate(tsub: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` to the ``workbench time`` subcommands."""
    from workbench.schema import seconds

    c = tsub.add_parser(
        "calibrate", help="measure this machine (matmul, elementwise, op overhead, collectives) into a device profile",
        description="Measure this machine's matmul flop/s per dtype, elementwise bytes/s, per-op dispatch "
                    "overhead and collective latency and bandwidth per group size (gloo here, NCCL with a GPU "
                    "per rank) on real process groups, and save a calibrated device profile that `workbench "
                    "time predict --device cpu` uses (default: ~/.cache/workbench/devices/<name>.json or "
                    "$WORKBENCH_DEVICE_PROFILE_DIR).")
    c.add_argument("--out", type=_profile_path, default=None, metavar="PATH",
                   help="save the profile here: a .json file or a directory (default: the profile directory)")
    c.add_argument("--ranks", type=_ranks, default=(2, 4), metavar="N,N",
                   help="process-group sizes to time collectives on, e.g. 2,4 (default); '' for none")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats: ~20 s on 2 cores")
    c.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="what to calibrate (default: cuda when a GPU is visible, else cpu)")
    c.add_argument("--timeout", type=seconds("timeout"), default=180.0,
                   help="stop the collective measurement after this many seconds (default: 180)")
    c.add_argument("--no-save", action="store_true", help="measure and print only")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from workbench.time.calibrate import _target, calibrate, describe

    device = None if args.device == "auto" else args.device
    try:
        profile = calibrate(ranks=args.ranks, quick=args.quick, out=args.out, save=not args.no_save, device=device,
                            progress=not args.json, timeout_s=args.timeout)
    except (TimeoutError, RuntimeError) as e:
        return error(str(e).splitlines()[0], args.json, EXIT_FAILED)
    path = None if args.no_save else str(_target(args.out, profile.name))
    doc = describe(profile, path)
    if args.json:
        emit_json({"status": "ok", "path": path, "profile": doc})
        return 0
    print(render(doc, path))
    return 0


def render(doc: dict, path: str | None) -> str:
    """The profile in a few lines of text."""
    m = doc.get("measured", {})
    lines = [f"{doc['name']}: calibrated in {m.get('seconds', 0):.1f} s ({doc['source']})"]
    if doc.get("assumptions", {}).get("per_rank"):
        lines.append(f"  per rank      {doc['assumptions']['per_rank']}")
    lines.append("  matmul        " + ", ".join(f"{dt} {v / 1e9:,.1f} GFLOP/s" for dt, v in doc["matmul_flops"].items()))
    lines.append(f"  elementwise   {doc['elementwise_bytes_per_s'] / 1e9:,.2f} GB/s")
    lines.append(f"  op overhead   {doc['op_overhead_s'] * 1e6:,.2f} us per op")
    links = doc.get("links") or {}
    if "intra" in links:
        lk = links["intra"]
        note = "default, not measured" if not m.get("collectives") else "fitted"
        lines.append(f"  link (intra)  latency {lk['latency_s'] * 1e6:,.1f} us, {lk['bytes_per_s'] / 1e9:,.2f} GB/s "
                     f"({lk.get('algorithm', 'ring')}; {note})")
    coll = (m.get("collectives") or {}).get("groups", {})
    for g, by_kind in coll.items():
        lines.append(f"  {g} ranks ({m['collectives']['backend']}): " + ", ".join(
            f"{k} {f['latency_s'] * 1e6:,.0f} us + {f['bytes_per_s'] / 1e9:,.2f} GB/s" for k, f in by_kind.items()))
    if path:
        lines.append(f"saved {path}")
    return "\n".join(lines)
