"""``workbench spmd``: explain an op's sharding, run the conformance harness, list the rule registry.

    workbench spmd explain masked_fill.Scalar --mesh 2x2 --in "P,R" --in "R,R"
    workbench spmd explain max.dim --mesh 2 --in "S(1)" --arg dim=1 --arg keepdim=True
    workbench spmd check [--family masked] [--json]          # exit 1 on any failing combination
    workbench spmd check --source opinfo --rules both        # torch's OpInfo samples; exit 1 where only torch passes
    workbench spmd rules [--family norm] [--json]

It lives beside ``workbench/cli.py``, not in ``workbench/spmd/``: importing that package registers the rule
families and imports torch, and the parser must not (``workbench spmd --help`` starts without torch;
tests/test_imports.py). The handlers import ``workbench.spmd`` when they run.
"""

from __future__ import annotations

import argparse
import ast

from workbench.cli_output import EXIT_FAILED, emit_json, error


def cmd_explain(args: argparse.Namespace) -> int:
    from workbench.spmd.explain import explain

    shapes = None
    if args.shape:
        try:
            shapes = [tuple(int(x) for x in s.split(",") if x.strip()) for s in args.shape]
        except ValueError:
            return error(f"cannot read --shape {args.shape}; write one per tensor input like 4,6", args.json)
    values = {}
    for item in args.arg:
        name, eq, text = item.partition("=")
        try:
            if not eq or not name.strip().isidentifier():
                raise ValueError
            values[name.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            return error(f"cannot read --arg {item!r}; write NAME=VALUE with a Python literal, e.g. dim=1, "
                         "keepdim=True, dims=(0, 1), reduce='mean'", args.json)
    try:
        e = explain(args.op, *args.inputs, mesh=args.mesh, shapes=shapes, kwargs=values)
    except ValueError as exc:
        return error(str(exc), args.json)
    if args.json:
        emit_json({"status": "ok", **e.to_dict()})
    else:
        print(e)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from workbench.spmd.conformance import check

    if args.source != "opinfo" and (args.opinfo or args.opinfo_samples):
        return error("--opinfo and --opinfo-samples choose torch's OpInfo samples; add --source opinfo", args.json)
    if args.source == "opinfo" and (args.family or args.case):
        return error("--family and --case choose registry cases; with --source opinfo use --opinfo NAME", args.json)
    try:
        report = check(family=args.family, names=args.case or None, cap=None if args.cap == 0 else args.cap,
                       meshes=tuple(args.mesh or ("1d", "2d")), rules=args.rules, timeout=args.timeout,
                       progress=not args.json, source=args.source, opinfo=args.opinfo or None,
                       opinfo_samples=args.opinfo_samples or None)
    except ValueError as exc:
        return error(str(exc), args.json)
    except (TimeoutError, RuntimeError) as exc:
        return error(str(exc), args.json, EXIT_FAILED)
    if args.json:
        doc = report.to_dict()
        if not args.rows:
            doc.pop("rows")
        emit_json(doc)
    else:
        for fam, d in report.summary().items():
            print(f"{fam:<12} {d['cases']:>3} cases  {d['passed']:>4}/{d['combinations']:<4} combinations pass  "
                  f"{d['comm_bytes']:>9,} bytes sent per rank")
        if report.rules == "both":
            v = report.versus()
            print(f"{v['cases']} combinations under both rule sets: {v['both']} pass with both, {v['ours_only']} with "
                  f"ours only, {v['torch_only']} with torch's only, {v['neither']} with neither")
        for r in report.failures[:30]:
            print(f"FAIL {r['case']} [{r['mesh']}] {r['placements']}: {r['error']} (max_err {r['max_err']:.3g})"
                  + ("; torch's rules pass it" if report.rules == "both" else ""))
        if len(report.failures) > 30:
            print(f"... and {len(report.failures) - 30} more (--json lists all)")
        n = len(report.rows)
        if report.rules == "both":
            print(f"{'ok' if report.ok else 'FAILED'}: {len(report.failures)} combinations pass with torch's rules "
                  f"and fail with ours ({report.wall_s:.1f}s)")
        else:
            print(f"{'ok' if report.ok else 'FAILED'}: {n - len(report.failures)}/{n} combinations pass "
                  f"({report.rules} rules, {report.wall_s:.1f}s)")
    return 0 if report.ok else EXIT_FAILED


def cmd_rules(args: argparse.Namespace) -> int:
    from workbench.spmd import SKIPPED_FAMILIES, registry

    if args.family and args.family not in registry.FAMILIES:
        return error(f"unknown family {args.family!r}; choose one of {', '.join(registry.FAMILIES)}", args.json)
    rules = [r for r in registry.RULES.values() if not args.family or r.family == args.family]
    cases = [c for c in registry.CASES.values() if not args.family or c.family == args.family]
    rows = [{"op": str(r.op), "family": r.family, "kind": r.kind, "summary": r.summary,
             "torch_rule": registry.torch_rule_kind(r.op)} for r in rules]
    case_rows = [{"name": c.name, "family": c.family, "ops": [str(o) for o in c.ops],
                  "shardable": list(c.shardable), "requires_grad": list(c.requires_grad)} for c in cases]
    if args.json:
        emit_json({"status": "ok", "installed": registry.installed(), "skipped_families": SKIPPED_FAMILIES,
                    "rules": rows, "cases": case_rows})
        return 0
    skipped = "".join(f"; family {f!r} skipped: {why}" for f, why in SKIPPED_FAMILIES.items())
    print(f"{len(rows)} rules (training jobs install them: TrainConfig.spmd_rules), "
          f"{len(case_rows)} conformance cases{skipped}")
    for r in rows:
        print(f"  {r['family']:<12} {r['op']:<45} {r['kind']:<10} {r['summary']}")
    ops_with_rules = {r["op"] for r in rows}
    torch_only = sorted({o for c in case_rows for o in c["ops"]} - ops_with_rules)
    if torch_only:
        print(f"kept torch's rule (covered by cases): {', '.join(torch_only)}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    from workbench.settings import bounded, seconds

    p = sub.add_parser("spmd", help="sharding rules: explain an op, run the conformance harness, list rules",
                       description="Our DTensor sharding rules, registered into torch when workbench is imported.")
    cmds = p.add_subparsers(dest="spmd_command", required=True, parser_class=type(p))

    c = cmds.add_parser("explain", help="output placements, redistributions and bytes of one op, and whose rule decided",
                        description="Simulated on a fake process group: no cluster needed.")
    c.add_argument("op", help="aten op, e.g. masked_fill.Scalar, aten.add.Tensor, exp")
    c.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x2 or 4 (default 2x2)")
    c.add_argument("--in", dest="inputs", action="append", default=[], metavar="PLACEMENTS",
                   help='placements of the next tensor input, one per mesh dim, e.g. "S(0),R" or "P(max),R"; '
                        "repeat per input (missing inputs are replicated)")
    c.add_argument("--shape", action="append", default=[], metavar="DIMS",
                   help="shape of the next tensor input, e.g. 4,6 (default: the op's conformance case)")
    c.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                   help="set one of the op's non-tensor arguments by schema name, the value a Python literal, "
                        "e.g. dim=1 or keepdim=True (repeatable; default: the conformance case's call)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_explain)

    c = cmds.add_parser("check", help="conformance: every registry case under every placement equals the dense run",
                        description="Spawns 4 gloo processes (a 2-rank 1-D mesh and a 2x2 mesh). Exit 1 on failures.")
    c.add_argument("--family", default=None, help="only this family (elementwise, binary, reduction, norm, index, masked)")
    c.add_argument("--case", action="append", default=[], help="only this case (repeatable)")
    c.add_argument("--cap", type=bounded("int", "cap", min=0), default=12,
                   help="placement combinations per case and mesh, sampled to cover each input's placements (0: all)")
    c.add_argument("--mesh", action="append", choices=["1d", "2d"], default=None, help="only this mesh (repeatable)")
    c.add_argument("--rules", choices=["ours", "torch", "both"], default="ours",
                   help="run under torch's rules instead, or both (then exit 1 only where torch's pass and ours fail)")
    c.add_argument("--source", choices=["registry", "opinfo"], default="registry",
                   help="cases from our registry, or torch's OpInfo samples of every op we have a rule for "
                        "(needs the test-only package expecttest)")
    c.add_argument("--opinfo", action="append", default=[], metavar="NAME",
                   help="with --source opinfo: only this OpInfo, e.g. nn.functional.layer_norm or "
                        "max.reduction_with_dim; NAME/INDEX for one sample (repeatable)")
    c.add_argument("--opinfo-samples", type=bounded("int", "opinfo-samples", min=1), default=None,
                   help="with --source opinfo: at most this many samples per OpInfo")
    c.add_argument("--timeout", type=seconds("timeout"), default=600.0, help="hard limit in seconds for the whole run")
    c.add_argument("--rows", action="store_true", help="with --json: include every combination, not just failures")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_check)

    c = cmds.add_parser("rules", help="list our registered rules and conformance cases")
    c.add_argument("--family", default=None)
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=cmd_rules)
