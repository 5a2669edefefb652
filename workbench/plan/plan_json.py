"""A plan JSON (:meth:`ShardingPlan.to_json`, ``workbench plan --json``) read back, checked field by field.

A plan file may come from anywhere (an upload to the Jupyter server, a file edited by hand, a bit flip),
and a :class:`~workbench.plan.types.ShardingPlan` computes on what it holds: shapes become numpy int64
arrays, splits index mesh dimensions, rank totals are summed per category. So before a plan is built
every field is checked against what :meth:`ShardingPlan.to_dict` writes, and each problem is one
``ValueError``::

    plan.json: tensors[3].splits[0]: mesh dimension 7 is outside 0..3; the file is damaged or not a plan; ...

Sizes are bounded so the arithmetic stays exact in int64 and the cost stays in proportion to the file:
a dimension up to 2^48 elements, a tensor up to 2^50 bytes, all tensors together up to 2^62 bytes, and
at most :data:`PIECES_MAX` (tensor layout x rank) pieces to compute for the per-rank table (Llama-70B
planned over 65,536 ranks with ZeRO-1 needs 2^25.5).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["plan_from_dict", "plan_from_json", "load_plan", "tensor_from_dict", "PLAN_MAX", "PIECES_MAX"]

PLAN_MAX = 256 << 20  # bytes: a 1M-tensor plan; workbench writes ~300 bytes per tensor
# Distinct tensor layouts (shape, splits, holders) x ranks: the per-rank table computes each layout's piece
# on every rank, a few numpy passes over world_size int64s. Llama-70B over 1,024 ranks (pp=8, tp=8) has 50
# layouts (2^15.6 pieces); over 65,536 ranks with ZeRO-1, whose optimizer state has a layout per owner, 729
# (2^25.5: 1.3 s). 2^27 leaves room for ~2,000 layouts there; a 0.5 MB file of the costliest layouts up to
# it takes ~10 s on a busy 2-core machine, once (the server caches the table).
PIECES_MAX = 1 << 27
_DIM_MAX = 1 << 48
_TENSOR_BYTES_MAX = 1 << 50
_TOTAL_BYTES_MAX = 1 << 62
_INDEX_MAX = 1 << 31
_SPLITS_MAX = 16
_NDIM_MAX = 8
_COMM_INTS = ("bytes_per_rank", "calls_per_step", "tensor_bytes", "group_size")
_COMM_TEXT = ("collective", "mesh_dim", "phase")
FIX = "the file is damaged or not a plan; write one with `workbench plan MODEL --json` or ShardingPlan.to_json()"


class _Bad(Exception):
    def __init__(self, where: str, problem: str):
        self.where, self.problem = where, problem


def _kind(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "true/false"
    if isinstance(x, (int, float)):
        return "a number"
    return {str: "text", list: "a list", dict: "an object"}.get(type(x), type(x).__name__)


def _show(x: int) -> str:
    """An integer as it reads in a message: its digits, or for a long one their count."""
    if abs(x) < 10**30:
        return str(x)
    return f"a {len(str(abs(x)))}-digit number" if abs(x) < 10**4000 else "a number of over 4,000 digits"


def _obj(x: Any, where: str) -> dict:
    if type(x) is not dict:
        raise _Bad(where, f"is {_kind(x)}, not an object")
    return x


def _list(x: Any, where: str, most: int | None = None) -> list:
    if type(x) is not list:
        raise _Bad(where, f"is {_kind(x)}, not a list")
    if most is not None and len(x) > most:
        raise _Bad(where, f"has {len(x):,} entries, more than the {most} a plan has")
    return x


def _text(x: Any, where: str) -> str:
    if type(x) is not str:
        raise _Bad(where, f"is {_kind(x)}, not text")
    return x


def _int(x: Any, where: str, lo: int, hi: int, what: str = "") -> int:
    if type(x) is not int:
        raise _Bad(where, f"is {_kind(x)}, not an integer")
    if not lo <= x <= hi:
        raise _Bad(where, f"{what or 'value'} {_show(x)} is outside {lo:,}..{hi:,}")
    return x


def _config(cls, x: Any, where: str):
    """A config section through its own checks (:mod:`workbench.schema`), its message kept."""
    _obj(x, where)
    try:
        return cls.from_dict(x)
    except (ValueError, TypeError, ArithmeticError) as e:
        raise _Bad(where, (str(e).strip().splitlines() or [type(e).__name__])[0][:300]) from None


def _tensor(t: Any, w: str):
    from workbench.config import MAX_RANKS, MESH_DIMS
    from workbench.plan.types import ITEMSIZE, KINDS, TensorPlan

    _obj(t, w)
    for k in ("name", "kind", "global_shape", "dtype", "placements"):
        if k not in t:
            raise _Bad(w, f"has no {k!r}")
    name = _text(t["name"], f"{w}.name")
    kind, dtype = t["kind"], t["dtype"]
    if type(kind) is not str or kind not in KINDS:
        raise _Bad(f"{w}.kind", f"is not one of {list(KINDS)}")
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise _Bad(f"{w}.dtype", f"is not one of {list(ITEMSIZE)}")
    shape = tuple(_int(n, f"{w}.global_shape[{j}]", 0, _DIM_MAX, "size")
                  for j, n in enumerate(_list(t["global_shape"], f"{w}.global_shape", _NDIM_MAX)))
    placements = _list(t["placements"], f"{w}.placements")
    if len(placements) != len(MESH_DIMS):
        raise _Bad(f"{w}.placements", f"has {len(placements)} entries, not one per mesh dimension "
                   f"({len(MESH_DIMS)}: {', '.join(MESH_DIMS)})")
    placements = tuple(_text(p, f"{w}.placements[{j}]") for j, p in enumerate(placements))
    stage = t.get("stage")
    if stage is not None:
        _int(stage, f"{w}.stage", 0, _INDEX_MAX - 1, "stage")
    splits = []
    for j, s in enumerate(_list(t.get("splits", []), f"{w}.splits", _SPLITS_MAX)):
        sw = f"{w}.splits[{j}]"
        if type(s) is not list or len(s) != 4:
            raise _Bad(sw, f"is {_kind(s)}{f' of {len(s)}' if type(s) is list else ''}, not "
                       "[tensor_dim, mesh_dim, pieces, stride]")
        if not shape:
            raise _Bad(sw, "splits a tensor of no dimensions")
        splits.append((_int(s[0], sw, 0, len(shape) - 1, "tensor dimension"),
                       _int(s[1], sw, 0, len(MESH_DIMS) - 1, "mesh dimension"),
                       _int(s[2], sw, 1, MAX_RANKS, "pieces"), _int(s[3], sw, 1, MAX_RANKS, "stride")))
    holders = []
    for j, h in enumerate(_list(t.get("holders", []), f"{w}.holders", _SPLITS_MAX)):
        hw = f"{w}.holders[{j}]"
        if type(h) is not list or len(h) != 2:
            raise _Bad(hw, f"is {_kind(h)}, not [mesh_dim, coordinate]")
        holders.append((_int(h[0], hw, 0, len(MESH_DIMS) - 1, "mesh dimension"),
                        _int(h[1], hw, 0, MAX_RANKS - 1, "coordinate")))
    param = _text(t.get("param", name), f"{w}.param")
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    if nbytes > _TENSOR_BYTES_MAX:
        raise _Bad(f"{w}.global_shape", f"makes {nbytes:,} bytes, more than a tensor can hold here "
                   f"({_TENSOR_BYTES_MAX:,})")
    return TensorPlan(name=name, kind=kind, global_shape=shape, dtype=dtype, placements=placements, stage=stage,
                      splits=tuple(splits), holders=tuple(holders), param=param)


def _comm_row(r: Any, i: int) -> dict[str, Any]:
    w = f"comm[{i}]"
    _obj(r, w)
    for k in _COMM_INTS:
        _int(r.get(k), f"{w}.{k}", 0, _TOTAL_BYTES_MAX, k.replace("_", " "))
    for k in _COMM_TEXT:
        _text(r.get(k), f"{w}.{k}")
    if r.get("stage") is not None:
        _int(r["stage"], f"{w}.stage", 0, _INDEX_MAX - 1, "stage")
    if r.get("what") is not None:
        _text(r["what"], f"{w}.what")
    return r


def _or_empty(doc: dict, key: str) -> Any:
    value = doc.get(key)
    return [] if value is None else value


def _plan(doc: Any):
    from workbench.config import ModelConfig, ParallelConfig, TrainConfig
    from workbench.plan.types import ShardingPlan

    _obj(doc, "the document")
    for k in ("summary", "parallel", "train", "tensors"):
        if k not in doc:
            raise _Bad("the document", f"has no {k!r}")
    name = _text(_obj(doc["summary"], "summary").get("model_name"), "summary.model_name")
    model = _config(ModelConfig, doc["model"], "model") if doc.get("model") not in (None, {}) else None
    parallel = _config(ParallelConfig, doc["parallel"], "parallel")
    if parallel.dp_shard == -1:
        raise _Bad("parallel.dp_shard", "is -1 (the rest of nproc): a plan's layout is resolved")
    train = _config(TrainConfig, doc["train"], "train")
    tensors = [_tensor(t, f"tensors[{i}]") for i, t in enumerate(_list(doc["tensors"], "tensors"))]
    total = sum(t.nbytes for t in tensors)
    if total > _TOTAL_BYTES_MAX:
        raise _Bad("tensors", f"hold {total:,} bytes together, more than a plan's totals can count "
                   f"({_TOTAL_BYTES_MAX:,})")
    pieces = len({t.signature() for t in tensors}) * parallel.world_size
    if pieces > PIECES_MAX:
        raise _Bad("tensors", f"have {pieces:,} (layout x rank) pieces to compute over {parallel.world_size:,} "
                   f"ranks, more than a plan has ({PIECES_MAX:,})")
    comm = [_comm_row(r, i) for i, r in enumerate(_list(_or_empty(doc, "comm"), "comm"))]
    notes = [_text(n, f"notes[{i}]") for i, n in enumerate(_list(_or_empty(doc, "notes"), "notes"))]
    return ShardingPlan(name, parallel, train, tensors, comm, model, notes)


def tensor_from_dict(d: Any, source: str = "tensor"):
    """One :class:`TensorPlan` as :meth:`TensorPlan.to_dict` wrote it; one ValueError naming the field."""
    try:
        return _tensor(d, source)
    except _Bad as e:
        raise ValueError(" ".join(f"{e.where}: {e.problem}; pass what TensorPlan.to_dict() wrote".split())) from None


def plan_from_dict(doc: Any, source: str = "plan JSON"):
    """The :class:`ShardingPlan` a parsed plan JSON holds; one ValueError ``SOURCE: WHERE: PROBLEM; FIX``."""
    try:
        return _plan(doc)
    except _Bad as e:
        raise ValueError(" ".join(f"{source}: {e.where}: {e.problem}; {FIX}".split())) from None


def plan_from_json(text: str | bytes, source: str = "plan JSON"):
    """:func:`plan_from_dict` of ``text`` parsed as JSON; a parse failure is one ValueError too."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        doc = json.loads(text)
    except UnicodeDecodeError as e:
        raise ValueError(f"{source}: is not UTF-8 text (an invalid byte at offset {e.start}); {FIX}") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ValueError(f"{source}: is not valid JSON ({e.msg.removesuffix(' at')} at {where}); {FIX}") from None
    except RecursionError:
        raise ValueError(f"{source}: nests deeper than JSON is read here; {FIX}") from None
    except ValueError:  # an integer of more digits than Python converts
        raise ValueError(f"{source}: holds a number too long to be a plan's; {FIX}") from None
    except TypeError:
        raise ValueError(f"{source}: a plan JSON is text, not {type(text).__name__}; pass the file's text") from None
    return plan_from_dict(doc, source)


def load_plan(path: str | Path):
    """The plan in the file ``path``: a regular file of at most :data:`PLAN_MAX` bytes (a FIFO or a device
    is refused before it is opened), UTF-8 JSON, checked by :func:`plan_from_dict`; one ValueError naming
    the file otherwise."""
    from workbench.safeio import read_json

    doc = read_json(path, PLAN_MAX, "plan JSON", fix=FIX, fix_missing="check the path")
    return plan_from_dict(doc, str(path))
