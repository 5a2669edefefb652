"""``explain``: what DTensor does with one op under given input placements, and whose rule decided.

    >>> from workbench.spmd import explain
    >>> explain("masked_fill.Scalar", "P,R", "R,R", mesh="2x2")
    aten.masked_fill.Scalar on mesh 2x2: out P,R; 0 redistributions, 0 bytes; decided: ours (torch: 96 bytes)

For the op it returns the output placements, every redistribution DTensor inserted (input, from -> to,
the collectives it ran and the bytes each moved, per rank sent as in ``workbench.spmd.comm``), any other
collective a rule ran itself, and who decided: ``ours`` when one of our registered rules made the decision,
``torch`` otherwise (no rule of ours for the op, or our handler handed these placements back to torch).
The same op is also run under torch's rules, so every explanation carries torch's bytes to compare.

It needs no cluster: with no process group in this process, it runs on a FAKE process group (rank 0 of
a mesh of any shape, collectives are no-ops on correctly shaped buffers) in this process; with one (a
notebook already inside ``torchrun``), it runs in a subprocess. Sharding propagation and the
redistribution plan do not depend on the values, and bytes follow from shapes.

Example inputs come from the op's conformance case in the registry (the op is captured with the exact
arguments the case passes it, backward ops included); ``shapes=[(8, 16), ...]`` builds random inputs for
an op without a case (tensor arguments in order; ``args``/``kwargs`` supply the rest).
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from workbench import compat
from workbench.compat import OpOverload, OpOverloadPacket

# --------------------------------------------------------------------------------------------------
# Resolving the op, the mesh and example inputs
# --------------------------------------------------------------------------------------------------


def resolve_op(op: Any) -> OpOverload:
    """``aten.masked_fill.Scalar`` / ``"masked_fill.Scalar"`` / ``"aten::masked_fill.Scalar"`` /
    ``torch.ops.aten.exp`` (-> .default) / ``"exp"`` -> the OpOverload."""
    if isinstance(op, OpOverload):
        return op
    if isinstance(op, OpOverloadPacket):
        return op.default
    if not isinstance(op, str):
        raise ValueError(f"cannot explain {op!r}; pass an aten op like torch.ops.aten.exp.default or 'exp'")
    name = op.strip().replace("::", ".")
    parts = name.split(".")
    ns = "aten"
    if parts[0] in ("aten", "prims", "c10d"):
        ns, parts = parts[0], parts[1:]
    if not parts or not parts[0]:
        raise ValueError(f"cannot read op name {op!r}; write e.g. aten.masked_fill.Scalar")
    try:
        packet = getattr(getattr(torch.ops, ns), parts[0])
        return getattr(packet, parts[1] if len(parts) > 1 else "default")
    except (AttributeError, RuntimeError):
        raise ValueError(f"no op {op!r} in torch.ops.{ns}; write e.g. aten.masked_fill.Scalar "
                         "(`workbench spmd rules` lists the registry's ops)") from None


def parse_mesh(mesh: Any) -> tuple[int, ...]:
    """``"2x2"`` / ``"4"`` / ``(2, 2)`` -> (2, 2)."""
    if isinstance(mesh, str):
        try:
            shape = tuple(int(x) for x in mesh.lower().replace("*", "x").split("x"))
        except ValueError:
            raise ValueError(f"cannot read mesh {mesh!r}; write its shape like 2x2 or 4") from None
    else:
        shape = tuple(int(x) for x in mesh)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {mesh!r} must be positive sizes, e.g. 2x2")
    return shape


def _case_for(op: OpOverload):
    from workbench.spmd.registry import CASES

    for c in CASES.values():
        if op in c.ops:
            return c
    return None


def _capture_mode(op: OpOverload):
    """A dispatch mode that keeps a copy of the first call's arguments to ``op``."""
    tree_map = compat.get("pytree").tree_map

    class Capture(compat.get("TorchDispatchMode")):
        def __init__(self):
            super().__init__()
            self.op, self.args, self.kwargs = op, None, None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func == self.op and self.args is None:
                clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
                self.args = tree_map(clone, tuple(args))
                self.kwargs = tree_map(clone, dict(kwargs))
            return out

    return Capture()


def example_args(op: OpOverload, shapes: list | None = None, args: tuple | None = None,
                 kwargs: dict | None = None) -> tuple[tuple, dict, str]:
    """(args, kwargs, where they came from) of one dense call of ``op``."""
    if shapes is not None:
        gen = torch.Generator().manual_seed(0)
        tensors = []
        names = [a.name for a in op._schema.arguments if "Tensor" in str(a.type)]
        for i, s in enumerate(shapes):
            name = names[i] if i < len(names) else ""
            t = torch.rand(*s, generator=gen) > 0.5 if name in ("mask", "condition") else torch.randn(*s, generator=gen)
            tensors.append(t)
        return (*tensors, *(args or ())), dict(kwargs or {}), "random inputs of the given shapes"
    case = _case_for(op)
    if case is None:
        from workbench.spmd import SKIPPED_FAMILIES

        if SKIPPED_FAMILIES:  # its case may belong to a family this torch cannot run
            skipped = "; ".join(f"family {f!r} skipped: {why}" for f, why in SKIPPED_FAMILIES.items())
            raise ValueError(f"{op} has no conformance case on this torch ({skipped}); give one shape per "
                             f"tensor input: shapes=[(4, 6)] (CLI: --shape 4,6)")
        raise ValueError(f"{op} has no conformance case to take example inputs from; give one shape per "
                         "tensor input: shapes=[(4, 6)] (CLI: --shape 4,6)")
    from workbench.spmd.conformance import case_inputs

    inputs = case_inputs(case)
    rg = set(case.requires_grad)
    dense = [x.detach().clone().requires_grad_(i in rg) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(inputs)]
    cap = _capture_mode(op)
    with cap:
        out = case.fn(*dense)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if cap.args is None and outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    if cap.args is None:
        raise ValueError(f"case {case.name!r} lists {op} but never calls it; give one shape per tensor input: "
                         "shapes=[(4, 6)] (CLI: --shape 4,6)")
    return cap.args, cap.kwargs, f"case {case.name}"


# --------------------------------------------------------------------------------------------------
# The result
# --------------------------------------------------------------------------------------------------


@dataclass
class Explanation:
    op: str
    mesh: list[int]
    inputs: list[dict[str, Any]]  # shape, dtype, placements
    outputs: list[str | None]  # placements of each output
    redistributions: list[dict[str, Any]]  # input, from, to, shape, bytes, collectives
    collectives: list[dict[str, Any]]  # collectives outside redistributions (run by a rule itself)
    total_bytes: int
    decided: str  # "ours" | "torch"
    rule: str | None  # our rule's summary, when ours decided
    rule_kind: str | None  # handler | strategy | single_dim
    torch_rule: str | None  # how torch itself decides this op
    torch: dict[str, Any] | None = None  # the same op under torch's rules: outputs, total_bytes, ...
    example: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), default=str, **kw)

    @property
    def saved_bytes(self) -> int | None:
        """Bytes per rank our rule saves against torch's (None when torch's rules fail here)."""
        if self.torch is None or self.torch.get("total_bytes") is None:
            return None
        return self.torch["total_bytes"] - self.total_bytes

    def __str__(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        ins = "; ".join(f"in{i} {d['placements']} {tuple(d['shape'])}" for i, d in enumerate(self.inputs))
        lines = [f"{self.op} on mesh {mesh}: {ins}",
                 f"  out: {' | '.join(o or '-' for o in self.outputs)}"]
        for r in self.redistributions:
            kinds = ", ".join(f"{c['kind']} {c['bytes']} B" for c in r["collectives"]) or "local, no collective"
            lines.append(f"  redistribute in{r['input']}: {r['from']} -> {r['to']}  ({kinds})")
        for c in self.collectives:
            lines.append(f"  {c['kind']} {c['shape']} over {c['group_size']} ranks: {c['bytes']} B")
        who = f"ours ({self.rule_kind}: {self.rule})" if self.decided == "ours" else \
            f"torch ({self.torch_rule or 'no rule'})"
        lines.append(f"  total: {self.total_bytes} bytes sent per rank; decided: {who}")
        if self.torch is not None and self.torch.get("error"):
            lines.append(f"  torch's rules: fail ({self.torch['error']})")
        elif self.torch is not None and self.decided == "ours":
            lines.append(f"  torch's rules: out {' | '.join(o or '-' for o in self.torch['outputs'])}, "
                         f"{self.torch['total_bytes']} bytes")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        t = "" if self.torch is None else " (torch: fails)" if self.torch.get("error") else \
            f" (torch: {self.torch['total_bytes']} bytes)"
        return (f"{self.op} on mesh {mesh}: out {' | '.join(o or '-' for o in self.outputs)}; "
                f"{len(self.redistributions)} redistributions, {self.total_bytes} bytes; decided: {self.decided}{t}")

    def _repr_html_(self) -> str:
        e = html.escape
        mesh = "x".join(map(str, self.mesh))
        color = "#1a7f37" if self.decided == "ours" else "#555"
        ins = "".join(f"<tr><td>in{i}</td><td><code>{e(d['placements'])}</code></td><td>{tuple(d['shape'])}</td>"
                      f"<td>{e(d['dtype'])}</td></tr>" for i, d in enumerate(self.inputs))
        reds = "".join(
            f"<tr><td>in{r['input']}</td><td><code>{e(r['from'])}</code> &rarr; <code>{e(r['to'])}</code></td>"
            f"<td>{e(', '.join(c['kind'] for c in r['collectives']) or 'local')}</td><td>{r['bytes']:,}</td></tr>"
            for r in self.redistributions)
        reds += "".join(f"<tr><td>rule</td><td>-</td><td>{e(c['kind'])}</td><td>{c['bytes']:,}</td></tr>"
                        for c in self.collectives)
        torch_part = ""
        if self.torch is not None and self.torch.get("error"):
            torch_part = f"<p>Under torch's rules this fails: {e(self.torch['error'])}</p>"
        elif self.torch is not None:
            torch_part = (f"<p>Under torch's rules: out <code>{e(' | '.join(o or '-' for o in self.torch['outputs']))}"
                          f"</code>, {self.torch['total_bytes']:,} bytes.</p>")
        who = e(self.rule or "") if self.decided == "ours" else e(self.torch_rule or "no rule")
        return (f"<div><b><code>{e(self.op)}</code></b> on mesh {mesh} "
                f"<span style='color:{color}'>decided: <b>{self.decided}</b></span> <i>{who}</i>"
                f"<table><tr><th></th><th>placements</th><th>shape</th><th>dtype</th></tr>{ins}"
                f"<tr><td>out</td><td colspan=3><code>{e(' | '.join(o or '-' for o in self.outputs))}</code></td></tr>"
                f"</table><table><tr><th>input</th><th>redistribution</th><th>collectives</th><th>bytes/rank</th></tr>"
                f"{reds or '<tr><td colspan=4>none</td></tr>'}</table>"
                f"<p>Total {self.total_bytes:,} bytes sent per rank.</p>{torch_part}</div>")


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _record_redistributions(comm, log: list):
    mods = compat.redistribute_hook_modules()
    orig = compat.get("redistribute_local_tensor")

    def wrapped(local, current_spec, target_spec, **kw):
        mark = comm.mark()
        out = orig(local, current_spec, target_spec, **kw)
        log.append({"from": current_spec.placements, "to": target_spec.placements,
                    "shape": list(current_spec.shape), "collectives": comm.since(mark)})
        return out

    saved = [m.redistribute_local_tensor for m in mods]
    for m in mods:
        m.redistribute_local_tensor = wrapped
    try:
        yield
    finally:
        for m, s in zip(mods, saved):
            m.redistribute_local_tensor = s


def _run_once(op: OpOverload, args: tuple, kwargs: dict, specs: list, mesh) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate
    from workbench.spmd import registry

    pytree = compat.get("pytree")
    from workbench.spmd.comm import CommBytesMode
    from workbench.spmd.placements import format_placements, make_dtensor

    flat, tree = pytree.tree_flatten((args, kwargs))
    k = 0
    dts, inputs = [], []
    for x in flat:
        if isinstance(x, torch.Tensor):
            pl = specs[k] if k < len(specs) else (Replicate(),) * mesh.ndim
            if any(not isinstance(p, Replicate) and type(p).__name__ == "Partial" for p in pl) and \
                    not x.is_floating_point():
                raise ValueError(f"input {k} is {x.dtype}: a Partial placement needs a floating-point tensor")
            dts.append(make_dtensor(x, mesh, pl))
            inputs.append({"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", ""),
                           "placements": format_placements(pl)})
            k += 1
        else:
            dts.append(x)
    if len(specs) > k:
        raise ValueError(f"{op} takes {k} tensor input(s) here but {len(specs)} placements were given")
    d_args, d_kwargs = pytree.tree_unflatten(dts, tree)
    log: list = []
    fallbacks = registry._FALLBACKS[0]
    with CommBytesMode() as comm, _record_redistributions(comm, log):
        try:
            out = op(*d_args, **d_kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ValueError(f"DTensor cannot run {op} with inputs "
                             f"{[i['placements'] for i in inputs]}: {first}") from None
    fell_back = registry._FALLBACKS[0] > fallbacks
    outs = out if isinstance(out, (tuple, list)) else (out,)
    inside = {id(c) for r in log for c in r["collectives"]}
    reds = []
    for r in log:
        src = format_placements(r["from"])
        idx = next((i for i, d in enumerate(inputs) if d["placements"] == src and d["shape"] == r["shape"]), None)
        reds.append({"input": idx, "from": src, "to": format_placements(r["to"]), "shape": r["shape"],
                     "bytes": sum(c["bytes"] for c in r["collectives"]), "collectives": r["collectives"]})
    return {
        "inputs": inputs,
        "outputs": [format_placements(o.placements) if isinstance(o, DTensor) else None for o in outs],
        "redistributions": reds,
        "collectives": [c for c in comm.records if id(c) not in inside],
        "total_bytes": comm.total_bytes,
        "fell_back": fell_back,
    }


def _explain_here(op: OpOverload, specs_text: list, mesh_obj, args, kwargs, source: str) -> Explanation:
    from workbench.spmd import registry
    from workbench.spmd.placements import parse_placements

    specs = [parse_placements(s, mesh_obj.ndim) for s in specs_text]
    rule = registry.RULES.get(op)
    with registry.our_rules():  # ours for this call only; DTensor is left as it was
        ours_active = rule is not None and registry.installed()
        res = _run_once(op, args, kwargs, specs, mesh_obj)
        with registry.torch_rules():
            try:
                base = _run_once(op, args, kwargs, specs, mesh_obj)
            except ValueError as e:
                base = {"outputs": [], "total_bytes": None, "redistributions": [], "collectives": [],
                        "error": str(e)}
    decided = "ours" if ours_active and not res["fell_back"] else "torch"
    notes = []
    if ours_active and res["fell_back"]:
        notes.append("our handler handed these placements to torch's rule (it improves other placements)")
    if decided == "ours" and not base.get("error") and base["outputs"] == res["outputs"] and \
            base["total_bytes"] == res["total_bytes"]:
        notes.append("torch's rule reaches the same plan for these placements")
    if rule is not None and not ours_active:
        notes.append("our rules could not be installed on this torch (see workbench doctor); this is torch's decision")
    return Explanation(
        op=str(op), mesh=list(mesh_obj.shape), inputs=res["inputs"], outputs=res["outputs"],
        redistributions=res["redistributions"], collectives=res["collectives"], total_bytes=res["total_bytes"],
        decided=decided, rule=rule.summary if decided == "ours" else None,
        rule_kind=rule.kind if decided == "ours" else None, torch_rule=registry.torch_rule_kind(op),
        torch={k: base.get(k) for k in ("outputs", "total_bytes", "redistributions", "collectives", "error")},
        example=source, notes=notes)


def explain(op: Any, *input_specs: Any, mesh: Any = "2x2", shapes: list | None = None,
            args: tuple | None = None, kwargs: dict | None = None) -> Explanation:
    """Explain how DTensor runs ``op`` when its tensor inputs have ``input_specs`` (one per tensor input,
    in argument order: text like ``"S(0),R"`` or a sequence of Placements; missing ones are Replicate).

    ``mesh`` is a shape (``"2x2"``, ``(2, 2)``, ``"4"``) simulated on a fake process group, or a real
    ``DeviceMesh`` (then every rank of it must call ``explain`` together).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.spmd.placements import format_placements, parse_placements

    op = resolve_op(op)
    specs_text = [s if isinstance(s, str) else format_placements(s) for s in input_specs]
    if isinstance(mesh, DeviceMesh):
        dense_args, dense_kwargs, source = example_args(op, shapes, args, kwargs)
        return _explain_here(op, specs_text, mesh, dense_args, dense_kwargs, source)
    shape = parse_mesh(mesh)
    for s in specs_text:  # fail fast, before any process group
        parse_placements(s, len(shape))
    if dist.is_initialized():
        if args or kwargs:
            raise ValueError("explain with args/kwargs needs no process group in this process; "
                             "call it outside torchrun or pass mesh=<your DeviceMesh>")
        return _explain_subprocess(op, specs_text, shape, shapes)
    dense_args, dense_kwargs, source = example_args(op, shapes, args, kwargs)
    FakeStore = compat.get("FakeStore")

    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh_obj = init_device_mesh("cpu", shape)
        return _explain_here(op, specs_text, mesh_obj, dense_args, dense_kwargs, source)
    finally:
        dist.destroy_process_group()


def _explain_subprocess(op: OpOverload, specs: list[str], shape: tuple, shapes: list | None) -> Explanation:
    code = ("import json,sys; from workbench.spmd.explain import explain; "
            "a=json.loads(sys.argv[1]); "
            "print(explain(a['op'], *a['specs'], mesh=tuple(a['mesh']), shapes=a['shapes']).to_json())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    payload = json.dumps({"op": str(op), "specs": specs, "mesh": list(shape), "shapes": shapes})
    proc = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise ValueError(last.split(": ", 1)[-1])
    return Explanation(**json.loads(proc.stdout.strip().splitlines()[-1]))
