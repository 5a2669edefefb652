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
arguments the case passes it, backward ops included). ``shapes=[(8, 16), ...]`` gives one shape per tensor
input: for an op with a case the case's call is kept and its tensors become random ones of those shapes;
for an op without one the tensors are its first arguments (``args`` supplies the positional rest).

The op's other arguments are set by schema name, as keywords of ``explain`` or as ``kwargs={...}``; they
override what the case passes (any value the schema's type accepts; tensors are inputs, not arguments)::

    >>> explain("max.dim", "S(1)", mesh="2", dim=1)        # or kwargs={"dim": 1}; CLI: --arg dim=1
    aten.max.dim on mesh 2: out R | R; 0 redistributions, 48 bytes; decided: ours (torch: 96 bytes)

Every explanation shows the call it ran, by schema name (``Explanation.call``, ``.arguments``), e.g.
``aten.max.dim(self=in0, dim=1, keepdim=False)``.

Torch's rules choose between strategies by an estimated cost (latency plus bytes), so torch's decision can
depend on sizes: on a 2-rank CPU mesh ``native_batch_norm`` of a batch-sharded activation all-gathers it
(``R``) below about 81 KB and all-to-alls it to ``S(1)`` above. Run ``explain`` with your shapes to see
torch's decision for them.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import math
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


def _is_tensor_arg(a) -> bool:
    return "Tensor" in str(a.type)


def check_arguments(op: OpOverload, names) -> None:
    """A one-line ValueError unless every name is a non-tensor argument of ``op``'s schema."""
    valid = [a.name for a in compat.op_schema(op).arguments if not _is_tensor_arg(a) and not a.is_out]
    tensors = {a.name for a in compat.op_schema(op).arguments if _is_tensor_arg(a)}
    for name in names:
        if name in valid:
            continue
        what = f"{name!r} is a tensor input of {op} (give its placements and shape instead)" if name in tensors \
            else f"{op} has no argument {name!r}"
        raise ValueError(f"{what}; its non-tensor arguments: {', '.join(valid) or 'none'}")


def _with_arguments(op: OpOverload, args: tuple, kwargs: dict, values: dict) -> tuple[tuple, dict]:
    """The call with ``values`` (schema name -> value) set: a positional argument stays positional (rules
    read positions), filling skipped ones with their defaults; a keyword-only one goes to kwargs."""
    args, kwargs = list(args), dict(kwargs)
    pos = [a for a in compat.op_schema(op).arguments if not a.kwarg_only]
    for name, v in values.items():
        i = next((i for i, a in enumerate(pos) if a.name == name), None)
        if i is None or name in kwargs:
            kwargs[name] = v
            continue
        while len(args) <= i:
            a = pos[len(args)]
            args.append(kwargs.pop(a.name) if a.name in kwargs else a.default_value)
        args[i] = v
    return tuple(args), kwargs


def describe_call(op: OpOverload, args: tuple, kwargs: dict) -> tuple[str, dict[str, Any]]:
    """(``aten.max.dim(self=in0, dim=1, keepdim=False)``, {non-tensor argument: value}) of one call,
    defaults included; tensors are named in0, in1, ... in the order ``explain`` numbers its inputs."""
    k = 0

    def show(v):
        nonlocal k
        if isinstance(v, torch.Tensor):
            k += 1
            return f"in{k - 1}"
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return "[" + ", ".join(show(x) for x in v) + "]"
        return repr(v)

    parts, values = [], {}
    pos = [a for a in compat.op_schema(op).arguments if not a.kwarg_only]
    given = {a.name: v for a, v in zip(pos, args)}
    for a in compat.op_schema(op).arguments:
        if a.is_out or (a.name not in given and a.name not in kwargs and not a.has_default_value()):
            continue
        v = given[a.name] if a.name in given else kwargs[a.name] if a.name in kwargs else a.default_value
        parts.append(f"{a.name}={show(v)}")
        if not isinstance(v, torch.Tensor) and not (isinstance(v, (list, tuple)) and
                                                     any(isinstance(x, torch.Tensor) for x in v)):
            values[a.name] = list(v) if isinstance(v, tuple) else v
    return f"{op}({', '.join(parts)})", values


def _dense_check(op: OpOverload, args: tuple, kwargs: dict, source: str) -> None:
    """A one-line ValueError when the call itself is wrong (``dim=7`` of a 2-d input), before any rule
    sees it."""
    try:
        with torch.no_grad():
            op(*args, **kwargs)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{describe_call(op, args, kwargs)[0]} ({source}) fails on plain tensors: {first}") from None


def _random_like(t: torch.Tensor, shape, gen: torch.Generator) -> torch.Tensor:
    if t.dtype == torch.bool:
        return torch.rand(*shape, generator=gen) > 0.5
    if t.is_floating_point() or t.is_complex():
        return torch.randn(*shape, generator=gen, dtype=t.dtype)
    return torch.randint(0, 2, tuple(shape), generator=gen, dtype=t.dtype)  # valid indices into any dim >= 2


def example_args(op: OpOverload, shapes: list | None = None, args: tuple | None = None,
                 kwargs: dict | None = None) -> tuple[tuple, dict, str]:
    """(args, kwargs, where they came from) of one dense call of ``op``; ``kwargs`` set arguments by
    schema name (over the case's values)."""
    if shapes is not None and args is None and _case_for(op) is not None:
        c_args, c_kwargs, source = example_args(op, kwargs=kwargs)
        pytree = compat.get("pytree")
        flat, tree = pytree.tree_flatten((c_args, c_kwargs))
        n = sum(isinstance(x, torch.Tensor) for x in flat)
        if len(shapes) != n:
            raise ValueError(f"{source} calls {op} with {n} tensor input(s); give {n} shapes, not {len(shapes)}")
        gen, it = torch.Generator().manual_seed(0), iter(shapes)
        flat = [_random_like(x, next(it), gen) if isinstance(x, torch.Tensor) else x for x in flat]
        d_args, d_kwargs = pytree.tree_unflatten(flat, tree)
        source += ", random inputs of the given shapes"
        _dense_check(op, d_args, d_kwargs, source)
        return d_args, d_kwargs, source
    if shapes is not None:
        gen = torch.Generator().manual_seed(0)
        tensors = []
        names = [a.name for a in compat.op_schema(op).arguments if _is_tensor_arg(a)]
        for i, s in enumerate(shapes):
            name = names[i] if i < len(names) else ""
            t = torch.rand(*s, generator=gen) > 0.5 if name in ("mask", "condition") else torch.randn(*s, generator=gen)
            tensors.append(t)
        d_args, d_kwargs = _with_arguments(op, (*tensors, *(args or ())), {}, dict(kwargs or {}))
        _dense_check(op, d_args, d_kwargs, "random inputs of the given shapes")
        return d_args, d_kwargs, "random inputs of the given shapes"
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
    source = f"case {case.name}"
    if kwargs:
        cap.args, cap.kwargs = _with_arguments(op, cap.args, cap.kwargs, kwargs)
        source += " with " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        _dense_check(op, cap.args, cap.kwargs, source)
    return cap.args, cap.kwargs, source


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
    call: str = ""  # the call it ran, by schema name: aten.max.dim(self=in0, dim=1, keepdim=False)
    arguments: dict[str, Any] = field(default_factory=dict)  # its non-tensor arguments, defaults included

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
                 *([f"  call: {self.call}"] if self.call else []),
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
        call = f"<br><code>{e(self.call)}</code>" if self.call else ""
        notes = "".join(f"<p>Note: {e(n)}</p>" for n in self.notes)
        return (f"<div><b><code>{e(self.op)}</code></b> on mesh {mesh} "
                f"<span style='color:{color}'>decided: <b>{self.decided}</b></span> <i>{who}</i>{call}"
                f"<table><tr><th></th><th>placements</th><th>shape</th><th>dtype</th></tr>{ins}"
                f"<tr><td>out</td><td colspan=3><code>{e(' | '.join(o or '-' for o in self.outputs))}</code></td></tr>"
                f"</table><table><tr><th>input</th><th>redistribution</th><th>collectives</th><th>bytes/rank</th></tr>"
                f"{reds or '<tr><td colspan=4>none</td></tr>'}</table>"
                f"<p>Total {self.total_bytes:,} bytes sent per rank.</p>{torch_part}{notes}</div>")


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
    if base.get("redistributions"):
        size = sum(math.prod(d["shape"]) * torch.empty(0, dtype=getattr(torch, d["dtype"])).element_size()
                   for d in res["inputs"])
        notes.append(f"torch's rules pick a strategy by estimated cost (latency + bytes), here for {size:,} bytes "
                     "of inputs; with other sizes torch may redistribute differently: pass yours "
                     "(shapes=, CLI --shape)")
    call, arguments = describe_call(op, args, kwargs)
    return Explanation(
        op=str(op), mesh=list(mesh_obj.shape), inputs=res["inputs"], outputs=res["outputs"],
        redistributions=res["redistributions"], collectives=res["collectives"], total_bytes=res["total_bytes"],
        decided=decided, rule=rule.summary if decided == "ours" else None,
        rule_kind=rule.kind if decided == "ours" else None, torch_rule=registry.torch_rule_kind(op),
        torch={k: base.get(k) for k in ("outputs", "total_bytes", "redistributions", "collectives", "error")},
        example=source, notes=notes, call=call, arguments=arguments)


def explain(op: Any, *input_specs: Any, mesh: Any = "2x2", shapes: list | None = None,
            args: tuple | None = None, kwargs: dict | None = None, **arguments: Any) -> Explanation:
    """Explain how DTensor runs ``op`` when its tensor inputs have ``input_specs`` (one per tensor input,
    in argument order: text like ``"S(0),R"`` or a sequence of Placements; missing ones are Replicate).

    ``mesh`` is a shape (``"2x2"``, ``(2, 2)``, ``"4"``) simulated on a fake process group, or a real
    ``DeviceMesh`` (then every rank of it must call ``explain`` together). The op's non-tensor arguments
    are set by schema name, as keywords (``dim=0``) or ``kwargs={"dim": 0}``, over the case's values.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from workbench.spmd.placements import format_placements, parse_placements

    op = resolve_op(op)
    both = set(arguments) & set(kwargs or {})
    if both:
        raise ValueError(f"{', '.join(sorted(both))} given both as a keyword and in kwargs; give each once")
    kwargs = {**(kwargs or {}), **arguments} or None
    check_arguments(op, kwargs or {})
    specs_text = [s if isinstance(s, str) else format_placements(s) for s in input_specs]
    if isinstance(mesh, DeviceMesh):
        dense_args, dense_kwargs, source = example_args(op, shapes, args, kwargs)
        return _explain_here(op, specs_text, mesh, dense_args, dense_kwargs, source)
    shape = parse_mesh(mesh)
    for s in specs_text:  # fail fast, before any process group
        parse_placements(s, len(shape))
    if dist.is_initialized():
        if args:
            raise ValueError("explain with positional args needs no process group in this process; "
                             "call it outside torchrun, pass mesh=<your DeviceMesh>, or set them by name")
        return _explain_subprocess(op, specs_text, shape, shapes, kwargs)
    dense_args, dense_kwargs, source = example_args(op, shapes, args, kwargs)
    FakeStore = compat.get("FakeStore")

    world = 1
    for s in shape:
        world *= s
    # DTensor warns "CPU process group does not support alltoall yet" on any CPU mesh; on a fake group its
    # all-gather fallback is what gets counted, so the warning is no news (as in plan.simulate.fake_world).
    redistribute_log = logging.getLogger("torch.distributed.tensor._collective_utils")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh_obj = init_device_mesh("cpu", shape)
        return _explain_here(op, specs_text, mesh_obj, dense_args, dense_kwargs, source)
    finally:
        dist.destroy_process_group()
        redistribute_log.setLevel(level)


def _explain_subprocess(op: OpOverload, specs: list[str], shape: tuple, shapes: list | None,
                        kwargs: dict | None = None) -> Explanation:
    code = ("import json,sys; from workbench.spmd.explain import explain; "
            "a=json.loads(sys.argv[1]); "
            "print(explain(a['op'], *a['specs'], mesh=tuple(a['mesh']), shapes=a['shapes'], "
            "kwargs=a['kwargs']).to_json())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    try:
        payload = json.dumps({"op": str(op), "specs": specs, "mesh": list(shape), "shapes": shapes,
                              "kwargs": kwargs})
    except TypeError:
        raise ValueError("inside a process group explain runs in a subprocess and takes only JSON-like "
                         f"argument values; got {kwargs}: pass mesh=<your DeviceMesh>") from None
    proc = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True, timeout=120, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["unknown error"])[-1]
        raise ValueError(last.split(": ", 1)[-1])
    return Explanation(**json.loads(proc.stdout.strip().splitlines()[-1]))
