"""Bytes on the wire: a ``CommDebugMode`` that also records how many bytes each collective moves.

``CommDebugMode`` counts collectives but not their size. ``CommBytesMode`` sees every collective's input
tensors as it runs (functional collectives, which DTensor's redistributions use, and the c10d ops behind
``torch.distributed.all_reduce`` and friends, which hand-written rules may call), and records

    bytes = bytes ONE rank sends, under the ring algorithm of that collective

by the one rule of ``workbench.parallel.collectives.ring_bytes`` (the plans use it too). An all-gather's
input is the local shard, so its full buffer is ``group size x input``. This is the volume DTensor's own
cost model charges, so "ours vs torch's" compares like with like. A
group of one rank moves nothing. (On CPU, gloo has no all_to_all: DTensor falls back to all_gather, and
that is what gets recorded, because that is what runs.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode

from workbench import compat
from workbench.parallel.collectives import full_buffer_bytes, ring_bytes

_fn = compat.get("c10d_functional")
_c10d = torch.ops.c10d

# packet -> (kind, index of the group argument)
_FUNCOL = {
    _fn.all_gather_into_tensor: ("all_gather", 2),
    _fn.all_gather_into_tensor_coalesced: ("all_gather", 2),
    _fn.reduce_scatter_tensor: ("reduce_scatter", 3),
    _fn.reduce_scatter_tensor_coalesced: ("reduce_scatter", 3),
    _fn.all_reduce: ("all_reduce", 2),
    _fn.all_reduce_coalesced: ("all_reduce", 2),
    _fn.all_to_all_single: ("all_to_all", 3),
    _fn.broadcast: ("broadcast", 2),
}
# c10d ops (torch.distributed.* calls): (kind, index of the input tensor(s), index of the process group)
_C10D = {
    _c10d.allreduce_: ("all_reduce", 0, 1),
    _c10d.allreduce_coalesced_: ("all_reduce", 0, 1),
    _c10d._allgather_base_: ("all_gather", 1, 2),
    _c10d.allgather_: ("all_gather", 1, 2),
    _c10d.allgather_into_tensor_coalesced_: ("all_gather", 1, 2),
    _c10d._reduce_scatter_base_: ("reduce_scatter", 1, 2),
    _c10d.reduce_scatter_tensor_coalesced_: ("reduce_scatter", 1, 2),
    _c10d.broadcast_: ("broadcast", 0, 1),
    _c10d.alltoall_base_: ("all_to_all", 1, 2),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _group_of(name_or_pg: Any) -> tuple[int, str]:
    """(size, name) of a process group given by name (functional collectives) or object (c10d ops)."""
    if isinstance(name_or_pg, str):
        _resolve_process_group = compat.get("resolve_process_group")

        pg = _resolve_process_group(name_or_pg)
        return pg.size(), name_or_pg
    try:
        return name_or_pg.size(), getattr(name_or_pg, "group_name", "")
    except Exception:  # a ScriptObject without size(): count it, without a size
        return 1, ""


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` plus ``records``: one dict per collective with ``kind``, ``bytes`` (sent per
    rank, see the module docstring), ``group_size``, ``group`` (its name), ``shape`` and ``dtype``.

        with CommBytesMode() as comm:
            y = x_dtensor + 1
        comm.total_bytes, comm.records
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def __enter__(self):
        self.records = []
        return super().__enter__()

    @property
    def total_bytes(self) -> int:
        return sum(r["bytes"] for r in self.records)

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r["kind"]] = out.get(r["kind"], 0) + r["bytes"]
        return out

    def mark(self) -> int:
        """A position in ``records``; ``since(mark)`` returns what was recorded after it."""
        return len(self.records)

    def since(self, mark: int) -> list[dict[str, Any]]:
        return self.records[mark:]

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        packet = func._overloadpacket
        if packet in _FUNCOL:
            kind, gi = _FUNCOL[packet]
            inp = args[0]
            group = args[gi] if len(args) > gi else kwargs.get("group_name")
        elif packet in _C10D:
            kind, ti, gi = _C10D[packet]
            inp = args[ti]
            group = args[gi]
        else:
            return
        size, name = _group_of(group)
        nbytes = _nbytes(inp)
        first = inp[0] if isinstance(inp, (list, tuple)) and inp else inp
        while isinstance(first, (list, tuple)) and first:
            first = first[0]
        self.records.append({
            "kind": kind,
            "bytes": round(ring_bytes(kind, full_buffer_bytes(kind, nbytes, size), size)),
            "input_bytes": nbytes,
            "group_size": size,
            "group": name,
            "shape": list(first.shape) if isinstance(first, torch.Tensor) else None,
            "dtype": str(first.dtype).replace("torch.", "") if isinstance(first, torch.Tensor) else None,
        })

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and not isinstance(func, torch._ops.HigherOrderOperator):
            self._record(func, args, kwargs or {})
        return out
