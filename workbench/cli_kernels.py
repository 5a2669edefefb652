"""``workbench kernels check|bench|status``: our Triton kernels against their reference, and their speed.

    workbench kernels check [--op index_put] [--dtype fp32 --dtype bf16] [--size 1000] [--rows] [--json]
    workbench kernels bench [--op dropout_add] [--sizes 1048576,16777216] [--repeats 20] [--json]
    workbench kernels status [--json]        # Triton version, interpreter or CUDA, the backend in force

``check`` exits 1 when any row fails. Without a GPU ``bench`` says so and shows the torch reference
path's CPU times at small sizes (never the interpreter's). Every command takes ``--json``.

It lives beside ``workbench/cli.py``, not in ``workbench/kernels/``: importing that package defines the
custom ops and imports torch, and the parser must not (``workbench kernels --help`` starts without torch;
tests/test_imports.py). The handlers import the kernels when they run.
"""

from __future__ import annotations

import argparse

from workbench.cli_output import EXIT_FAILED, emit_json, error

__all__ = ["add_parser"]

DTYPE_CHOICES = ("fp32", "bf16", "fp16")
MAX_SIZE = 1 << 31  # elements of one kernel case's tensor: 8 GiB of fp32, more than any case needs


def add_parser(sub: argparse._SubParsersAction) -> None:
    from workbench.schema import bounded

    p = sub.add_parser("kernels", help="Triton kernels: check them against the reference, time them, status",
                       description="Our Triton kernels (torch custom ops): correctness against the torch "
                                   "reference path and torch's own ops, and speed against torch eager, "
                                   "torch.compile and copy_ bandwidth.")
    ksub = p.add_subparsers(dest="kernels_command", required=True, parser_class=type(p))

    c = ksub.add_parser("check", help="every kernel against its reference (Triton's interpreter without a GPU)",
                        description="Run every registered kernel case under kernels='triton' and 'torch' at "
                                    "small sizes and edge cases, and compare (bitwise where exact). Exit 1 on "
                                    "any failure.")
    _selection(c)
    c.add_argument("--size", type=bounded("int", "size", min=1, limit=MAX_SIZE), action="append", default=None,
                   help="size to make (repeatable; default: each case's check sizes)")
    c.add_argument("--no-edge", action="store_true", help="leave out the edge cases")
    c.add_argument("--rows", action="store_true", help="print every row, not one line per case")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_check)

    b = ksub.add_parser("bench", help="time the kernels against torch eager, torch.compile and copy_",
                        description="On a GPU: time, GB/s, fraction of copy_ bandwidth and the ratio to torch "
                                    "eager and torch.compile per case and size. Without one: says so, and "
                                    "shows the torch reference path's CPU times at small sizes.")
    _selection(b)
    b.add_argument("--sizes", default=None, help="comma list of sizes (default: each case's bench sizes)")
    b.add_argument("--repeats", type=bounded("int", "repeats", min=1, limit=10_000), default=20,
                   help="timed repeats per measurement (the median is kept)")
    b.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    s = ksub.add_parser("status", help="Triton version, interpreter or CUDA, the backend, registered cases")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)


def _selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--op", action="append", default=None, help="op or case name prefix (repeatable; default all)")
    p.add_argument("--dtype", action="append", choices=DTYPE_CHOICES, default=None,
                   help="dtype (repeatable; default: each case's)")


def cmd_check(args: argparse.Namespace) -> int:
    from workbench.kernels.bench import check

    try:
        result = check(ops=args.op, dtypes=args.dtype, sizes=args.size, edge=not args.no_edge,
                       progress=not args.json)
    except ValueError as e:
        return error(str(e), args.json)
    if args.json:
        emit_json({"status": "ok" if result.ok else "failed", **result.summary(), "rows": result.to_dict()["rows"]})
    else:
        if args.rows:
            cols = ["case", "dtype", "size", "label", "status", "max_abs_err", "vs_torch_err", "seconds"]
            table = result.to_frame()[cols]
        else:
            table = result.by_case()
        print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        for r in result.failures.itertuples():
            print(f"FAIL {r.case} {r.dtype} {r.label} size {r.size}: {r.note}")
        print(result.headline())
    return 0 if result.ok else EXIT_FAILED


def cmd_bench(args: argparse.Namespace) -> int:
    from workbench.kernels.bench import bench

    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()] if args.sizes else None
    except ValueError:
        return error(f"cannot read --sizes {args.sizes[:60]!r}; write a comma list of integers like "
                     "1048576,16777216", args.json)
    bad = [s for s in sizes or () if not 1 <= s <= MAX_SIZE]
    if bad:
        return error(f"--sizes {bad[0]} is outside 1..{MAX_SIZE} elements; write sizes like 1048576,16777216",
                     args.json)
    try:
        result = bench(ops=args.op, dtypes=args.dtype, sizes=sizes, repeats=args.repeats,
                       compile=not args.no_compile, progress=not args.json)
    except ValueError as e:
        return error(str(e), args.json)
    if args.json:
        doc = result.to_dict()
        emit_json({"status": "ok", **doc["summary"], "rows": doc["rows"], "overhead": doc["overhead"]})
        return 0
    frame = result.to_frame()
    cols = ["case", "dtype", "size", "time_ms", "eager_ms", "compile_ms", "gbps", "copy_fraction", "vs_eager",
            "vs_compile", "max_err"]
    print(frame[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    notes = frame[frame["note"] != ""]
    for r in notes.itertuples():
        print(f"note {r.case} {r.dtype} {r.size}: {r.note}")
    over = result.overhead_frame()
    if len(over):
        print()
        print("eager dispatch, microseconds per call on a tiny input:")
        print(over[["case", "impl", "ours_us", "eager_us", "overhead_us"]].to_string(
            index=False, float_format=lambda v: f"{v:.1f}"))
    print()
    print(f"{result!r}: {result.note}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import torch

    from workbench.kernels import get_backend, resolve, triton_status
    from workbench.kernels.bench import load_cases

    st = triton_status()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cases = load_cases()
    doc = {"triton": st.version, "usable": st.usable, "interpreter": st.interpret, "why": st.why,
           "cuda": cuda, "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
           "backend": get_backend(), "auto_means": resolve("auto", device), "cases": sorted(cases)}
    if args.json:
        emit_json({"status": "ok", **doc})
        return 0
    mode = ("runs in its interpreter on CPU tensors (TRITON_INTERPRET=1)" if st.interpret else "compiles for CUDA")
    print(f"Triton {st.version or 'not installed'}: " + (mode if st.usable else f"unusable: {st.why}"))
    print(f"torch {torch.__version__}, {'GPU ' + doc['gpu'] if cuda else 'no GPU'}; backend {doc['backend']!r} "
          f"(auto means {doc['auto_means']!r} on {device} tensors)")
    print(f"{len(cases)} kernel cases: {', '.join(sorted(cases))}")
    return 0

