"""Optimizer hyper-parameters, folded back into one row per param group.

torch's flattened optimizer state dict (what a workbench save writes) repeats every hyper-parameter of a
group under each parameter of the group::

    optim.param_groups.layers.0.attention.wq.weight.lr             0.001
    optim.param_groups.layers.0.attention.wq.weight.betas          (0.9, 0.999)
    ...                                                            x 10 hyper-parameters x every parameter

so a tiny model's checkpoint holds 480 of these scalars beside 201 tensors. Listings show them as::

    optim.param_groups.0   lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01   (48 params)

Parameters whose hyper-parameters are equal form one group, numbered in checkpoint order (a flattened
state dict does not keep torch's group index). Unflattened state (``optim.param_groups.<i>.<name>``, from
other tools) keeps its own index. Values saved as tensors are read (a few bytes each, all in one read);
values DCP stored pickled are never unpickled, so those groups list the names only, and parameters with
the same names are one group.

Saves now pack them: one ``optim.hyper.<digest>`` item (UTF-8 JSON in a uint8 tensor, see
:func:`workbench.checkpoint.state.pack_hyper`) holds every parameter's values. Its groups are folded the
same way and listed the same; they share that one stored item, so counts say *values* (one per parameter
and name, :attr:`ParamGroup.n_values`, the same number for both formats) where stored entries would differ
(:func:`describe_groups`).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from workbench.checkpoint.manifest import CheckpointManifest

__all__ = ["ParamGroup", "param_groups", "listing", "matches", "format_value", "describe_groups", "LISTING_COLUMNS"]

LISTING_COLUMNS = ("key", "kind", "dtype", "shape", "bytes", "shards", "group")
_BASE = re.compile(r"^(?P<base>(?:.*\.)?param_groups)(?:\.(?P<rest>.+))?$")
_INDEX = re.compile(r"^\d+$")
_FIRST = ("lr", "betas", "momentum", "eps", "weight_decay")  # shown first, in this order


@dataclass
class ParamGroup:
    """One optimizer param group: its hyper-parameters, its parameters and the entries they came from."""

    name: str  # "optim.param_groups.0"
    hyper: dict[str, Any]  # "lr" -> 0.001, "betas" -> (0.9, 0.999); None where the value is pickled (not read)
    params: list[str]  # the parameters' FQNs (flattened state) or indices (unflattened); [] when unknown
    keys: list[str] = field(default_factory=list)  # the manifest entries folded into this group
    bytes: int = 0
    values_read: bool = True  # False: the values are pickled (never unpickled) or could not be read
    packed: bool = False  # from an ``optim.hyper.<digest>`` item (every group shares its keys)

    @property
    def n_values(self) -> int:
        """Hyper-parameter values it stands for, one per parameter and name whatever the storage: its
        entries (per-key format: one value each; an unflattened group's ``params`` list is no value), or
        parameters x names (packed). 0 when a packed item could not be read."""
        if self.packed:
            return len(self.params) * len(self.hyper)
        return sum(1 for k in self.keys if not k.endswith(".params"))

    def storage(self) -> str:
        """Where its values are stored: ``20 entries``, or ``packed in optim.hyper.<digest> (JSON)``."""
        if not self.packed:
            return f"{len(self.keys)} entr{'ies' if len(self.keys) != 1 else 'y'}"
        if len(self.keys) == 1:
            return f"packed in {self.keys[0]} (JSON)"
        return f"packed in {len(self.keys)} optim.hyper.* items (JSON)"

    @property
    def n_params(self) -> int | None:
        return len(self.params) if self.params else None

    def describe(self) -> str:
        """``lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01``: the numbers, flags left out
        (see ``hyper`` for them); names only when the values are not read."""
        names = sorted(self.hyper, key=lambda k: (_FIRST.index(k) if k in _FIRST else len(_FIRST), k))
        if not self.values_read:
            return ", ".join(names) + " (values pickled, not read)"
        shown = [f"{k}={format_value(self.hyper[k])}" for k in names
                 if self.hyper[k] is not None and not isinstance(self.hyper[k], bool)]
        return ", ".join(shown) or ", ".join(names)

    def label(self) -> str:
        """The listing's line: ``lr=0.001, ...  (48 params)``."""
        n = self.n_params
        return f"{self.describe()}  ({n if n is not None else '?'} param{'s' if n != 1 else ''})"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "hyper": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.hyper.items()},
                "n_params": self.n_params, "params": list(self.params), "n_values": self.n_values,
                # stored entries: one per value (per-key format), or the packed items it shares with the
                # other groups (``keys``)
                "n_entries": len(self.keys), "packed": self.packed, "keys": list(self.keys) if self.packed else None,
                "bytes": int(self.bytes), "values_read": self.values_read}


def describe_groups(groups: list[ParamGroup]) -> str:
    """``50 optimizer hyper-parameter values in 2 param groups``: true for both storage formats (a value is
    one parameter's one hyper-parameter); "" when there are no groups. Packed items that could not be read
    are said to be so, not counted as 0 values."""
    if not groups:
        return ""
    n = len(groups)
    where = f"in {n} param group{'s' if n != 1 else ''}"
    unread = [g for g in groups if g.packed and not g.values_read]
    counted = sum(g.n_values for g in groups if g not in unread)
    if unread and counted:
        return f"{counted} optimizer hyper-parameter values {where} (and packed values that could not be read)"
    if unread:
        return f"optimizer hyper-parameters {where} (packed, could not be read)"
    return f"{counted} optimizer hyper-parameter value{'s' if counted != 1 else ''} {where}"


def format_value(v: Any) -> str:
    """A hyper-parameter as people read it: ``0.001``, ``(0.9, 0.999)``, ``1e-08``, ``True``."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, tuple):
        return "(" + ", ".join(format_value(x) for x in v) + ")"
    return str(v)


def _split(key: str) -> tuple[str, str, str] | None:
    """``optim.param_groups.<owner>.<name>`` -> ``(base, owner, name)``; owner is an FQN or a group index."""
    m = _BASE.match(key)
    if not m:
        return None
    rest = (m["rest"] or "").split(".") if m["rest"] else []
    if len(rest) >= 2:
        return m["base"], ".".join(rest[:-1]), rest[-1]
    return m["base"], "", rest[0] if rest else "param_groups"  # a whole pickled list or group


def _python(value: Any) -> Any:
    """A stored hyper-parameter as the Python value the optimizer held (0-d -> scalar, 1-d -> tuple); a
    packed tensor value (``{"tensor": ..., "dtype": ...}``, e.g. a capturable lr) as its number(s)."""
    if isinstance(value, dict) and "tensor" in value:
        value = value["tensor"]
        return value if isinstance(value, (int, float, bool)) else _python(_flat(value))
    if isinstance(value, torch.Tensor):
        if value.numel() > 64:
            return None
        if value.dim() == 0:
            return value.item()
        return tuple(value.reshape(-1).tolist())
    if isinstance(value, list):
        return tuple(value)
    return value if isinstance(value, (bool, int, float, str, tuple, type(None))) else None


def _flat(value: Any) -> list:
    """A nested list (a tensor's ``tolist()``) flattened."""
    if not isinstance(value, list):
        return [value]
    return [x for v in value for x in _flat(v)]


def _read_values(m: CheckpointManifest, rows: list[dict]) -> dict[str, Any]:
    """The values of the tensor entries in ``rows`` (pickled DCP values are left out), read in one go.

    A file that cannot be read yields no values (the listing then shows names only; ``verify`` says why).
    """
    tensor_rows = [r for r in rows if r["shape"] is not None]
    if m.format == "torch":  # torch's weights_only unpickler already produced plain values
        from workbench.checkpoint.safeload import read_torch_file

        try:
            flat = read_torch_file(m.path)
        except ValueError:
            return {}
        return {r["key"]: flat[r["key"]] for r in rows if r["key"] in flat}
    if not tensor_rows:
        return {}
    if m.format in ("dcp", "workbench"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from workbench.checkpoint.safeload import CheckpointFormatError, SafeFileSystemReader, check_tensor_claim

        try:  # each shape is the metadata's claim: held against its chunks and data files before it is allocated
            sizes: dict[str, int] = {}
            for r in tensor_rows:
                check_tensor_claim(m.path, r["key"], r["shape"], getattr(torch, r["dtype"]),
                                   [(s["file"], s["offsets"], s["lengths"]) for s in r["shards"]], sizes)
        except CheckpointFormatError:
            return {}
        sd = {r["key"]: torch.empty(r["shape"], dtype=getattr(torch, r["dtype"])) for r in tensor_rows}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
                dcp.load(sd, storage_reader=SafeFileSystemReader(str(m.path)), no_dist=True)
        except (Exception, CheckpointException):  # damaged files: names only (verify reports the damage)
            return {}
        return sd
    from workbench.checkpoint.formats import TensorSource

    source = TensorSource(manifest=m, keys={r["key"]: r["key"] for r in tensor_rows})
    try:
        return {r["key"]: source.get(r["key"]) for r in tensor_rows}
    except (ValueError, KeyError, OSError):
        return {}


def param_groups(src: "str | CheckpointManifest", *, values: bool = True) -> list[ParamGroup]:
    """The optimizer param groups stored in ``src`` (anything :func:`inspect` accepts), in checkpoint order.

    ``values=False`` reads nothing but metadata: the groups then list hyper-parameter names only.
    """
    from workbench.checkpoint.contents import inspect

    m = inspect(src)
    rows = [r for r in m.hyperparameters().to_dict("records")]
    if not rows:
        return []
    packed = [r for r in rows if r["key"].startswith("optim.hyper.")]
    rows = [r for r in rows if not r["key"].startswith("optim.hyper.")]
    out = _packed_groups(m, packed, values) if packed else []
    if not rows:
        return out
    return out + _keyed_groups(m, rows, values, first=len(out))


def _packed_groups(m: CheckpointManifest, rows: list[dict], values: bool) -> list[ParamGroup]:
    """Groups from packed items (``optim.hyper.<digest>``: every parameter's values as JSON): parameters
    with equal values are one group. Unreadable items give one group of unknown parameters."""
    from workbench.checkpoint.state import unpack_hyper

    got = _read_values(m, rows) if values else {}
    keys = [r["key"] for r in rows]
    size = sum(int(r["bytes"]) for r in rows)
    try:
        per_param = unpack_hyper([got[k] for k in keys if k in got]) if got else {}
    except ValueError:
        per_param = {}
    if not per_param:
        return [ParamGroup(name="optim.param_groups.0", hyper={}, params=[], keys=keys, bytes=size, values_read=False,
                           packed=True)]
    folded: dict[str, ParamGroup] = {}
    for fqn, hyper in per_param.items():
        text = repr(sorted(hyper.items()))
        g = folded.get(text)
        if g is None:
            g = folded[text] = ParamGroup(name=f"optim.param_groups.{len(folded)}", hyper={k: _python(v) for k, v in hyper.items()},
                                          params=[], keys=list(keys), bytes=size if not folded else 0, packed=True)
        g.params.append(fqn)
    return list(folded.values())


def _keyed_groups(m: CheckpointManifest, rows: list[dict], values: bool, first: int = 0) -> list[ParamGroup]:
    """Groups from one entry per parameter and hyper-parameter (``optim.param_groups.<fqn>.<name>``, what
    saves wrote before the packing, and other tools' state)."""
    got = _read_values(m, rows) if values else {}
    # owner (a parameter FQN or a group index) -> {name: value}, in checkpoint order
    owners: dict[tuple[str, str], dict[str, Any]] = {}
    keys: dict[tuple[str, str], list[dict]] = {}
    members: dict[tuple[str, str], list] = {}
    for r in rows:
        base, owner, name = _split(r["key"])
        ident = (base, owner)
        keys.setdefault(ident, []).append(r)
        if name == "params" and _INDEX.match(owner or "x"):  # unflattened: the group's parameter indices
            v = _python(got.get(r["key"]))
            members[ident] = [str(p) for p in v] if isinstance(v, tuple) else []
            continue
        owners.setdefault(ident, {})[name] = _python(got[r["key"]]) if r["key"] in got else None
    for ident in keys:
        owners.setdefault(ident, {})
    groups: dict[tuple, ParamGroup] = {}
    counters: dict[str, int] = {"optim.param_groups": first} if first else {}
    for (base, owner), hyper in owners.items():
        read = bool(hyper) and all(r["key"] in got for r in keys[(base, owner)] if not r["key"].endswith(".params"))
        if _INDEX.match(owner):  # unflattened: the group is named by its own index
            ident = (base, "index", owner)
            name = f"{base}.{owner}"
            params = members.get((base, owner), [])
        else:  # flattened: parameters with equal hyper-parameters are one group
            ident = (base, "values", tuple(sorted((k, repr(v) if read else None) for k, v in hyper.items())))
            name = None
            params = [owner] if owner else []
        g = groups.get(ident)
        if g is None:
            if name is None:
                name = f"{base}.{counters.get(base, 0)}"
                counters[base] = counters.get(base, 0) + 1
            g = groups[ident] = ParamGroup(name=name, hyper=dict(hyper), params=[], values_read=read)
        elif not read:
            g.values_read = False
        g.params += [p for p in params if p not in g.params]
        g.keys += [r["key"] for r in keys[(base, owner)]]
        g.bytes += sum(int(r["bytes"]) for r in keys[(base, owner)])
    return list(groups.values())


def listing(src: "str | CheckpointManifest", groups: list[ParamGroup] | None = None) -> pd.DataFrame:
    """The manifest's rows with each param group's hyper-parameter entries folded into one row.

    Columns ``key, kind, dtype, shape, bytes, shards, group``: a group's row has ``key`` = its name,
    ``dtype`` "param_group", ``shape`` None, the bytes of its entries, no shards, and ``group`` = the
    :class:`ParamGroup`; every other row is the manifest's, with ``group`` None. The group's row stands where
    its first entry stood.
    """
    from workbench.checkpoint.contents import inspect

    m = inspect(src)
    groups = param_groups(m) if groups is None else groups
    first: dict[str, list[ParamGroup]] = {}  # packed groups share their item: all stand where it stood
    for g in groups:
        if g.keys:
            first.setdefault(g.keys[0], []).append(g)
    folded = {k for g in groups for k in g.keys}
    out = []
    for r in m.frame.to_dict("records"):
        for g in first.get(r["key"], ()):
            out.append({"key": g.name, "kind": r["kind"], "dtype": "param_group", "shape": None, "bytes": g.bytes,
                        "shards": [], "group": g})
        if r["key"] in first:
            continue
        if r["key"] not in folded:
            out.append({**{c: r[c] for c in LISTING_COLUMNS if c != "group"}, "group": None})
    return pd.DataFrame(out, columns=list(LISTING_COLUMNS))


def matches(row: dict, text: str) -> bool:
    """Whether a listing row matches a key filter: its key, or for a group any entry it folds."""
    if not text:
        return True
    g = row.get("group")
    if g is None:
        return text in row["key"]
    if g.packed:  # one shared item: a group matches by the parameters it holds
        return text in row["key"] or any(text in p for p in g.params)
    return text in row["key"] or any(text in k for k in g.keys)
