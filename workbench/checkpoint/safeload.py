"""Reading checkpoint metadata without running anybody's code.

A DCP ``.metadata`` file is a pickle, and unpickling is code execution: a pickle can name any importable
callable (``os.system``, ``builtins.exec``) and call it. So nothing here calls ``pickle.load``. The
restricted unpickler below resolves only the classes DCP itself writes (what ``pickletools.dis`` of a
torch 2.13 ``.metadata`` names), and refuses everything else before it is called::

    Metadata(state_dict_metadata={fqn: TensorStorageMetadata(properties, size, chunks) | BytesStorageMetadata},
             storage_data={MetadataIndex(fqn, offset): _StorageInfo(relative_path, offset, length)},
             planner_data, storage_meta=StorageMeta(checkpoint_id: PosixPath, ...), version)

safetensors files are read by their header only: 8 bytes of little-endian length ``N``, then ``N`` bytes of
JSON ``{key: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data. The header is checked
against the file: a header that lies about sizes is refused with the file named.

torch.save archives (zip) are opened with ``torch.load(weights_only=True, mmap=True)``: torch's own
restricted unpickler, with storages mapped from the file rather than read.

Every problem is a :class:`CheckpointFormatError`: one line, ``<file>: <problem>; <fix>``.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = [
    "CheckpointFormatError",
    "SafeFileSystemReader",
    "SAFETENSORS_DTYPES",
    "read_dcp_metadata",
    "read_safetensors_header",
    "read_torch_file",
]


class CheckpointFormatError(ValueError):
    """A checkpoint file that cannot be read as what it claims to be. The message is one line."""

    def __init__(self, file: str | os.PathLike, problem: str, fix: str):
        self.file, self.problem, self.fix = str(file), problem, fix
        super().__init__(f"{file}: {problem}; {fix}")


# --------------------------------------------------------------------------------------------------
# DCP .metadata
# --------------------------------------------------------------------------------------------------

def _torch_constants() -> set[str]:
    """Names of torch dtypes, layouts and memory formats: plain constants, safe to resolve."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {name for name in dir(torch) if isinstance(getattr(torch, name, None), kinds)}


# module -> names a DCP .metadata may reference. Each is a dataclass, a constant or a constructor of
# plain values; none of them reaches the filesystem, the interpreter or the network.
_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # str -> torch.layout lookup
    "torch": {"Size"} | _torch_constants(),
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool", "complex"},
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name.startswith(("float", "int", "uint", "bfloat", "complex", "bits")):
            raise CheckpointFormatError(self.source, f"the checkpoint holds torch.{name} tensors, a dtype "
                                        f"torch {torch.__version__} does not have", "read it with a newer torch")
        raise CheckpointFormatError(self.source, f"refusing to unpickle {module}.{name}: not DCP metadata",
                                    "this file is not a torch.distributed.checkpoint .metadata (or was tampered "
                                    "with); do not load it, re-save the checkpoint")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(self.source, "refusing a persistent id: not DCP metadata",
                                    "re-save the checkpoint with torch.distributed.checkpoint")


def read_dcp_metadata(path: str | os.PathLike):
    """The ``Metadata`` of a DCP checkpoint directory (or of its ``.metadata`` file), read safely."""
    p = Path(path)
    if p.is_dir():
        p = p / ".metadata"
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise CheckpointFormatError(p, "no such file", "a DCP checkpoint directory holds a .metadata file written "
                                    "last by the save; the save did not finish, pick another step") from None
    try:
        md = _DcpMetadataUnpickler(io.BytesIO(data), str(p)).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated or garbled: EOFError, UnpicklingError, struct errors, ...
        raise CheckpointFormatError(p, f"broken DCP metadata ({type(e).__name__}: {str(e)[:80] or 'no detail'})",
                                    "the file is truncated or corrupted; restore it or use another checkpoint") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointFormatError(p, f"holds a {type(md).__name__}, not DCP Metadata",
                                    "pass the directory torch.distributed.checkpoint.save wrote")
    if md.storage_data is None or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(p, "DCP metadata without storage_data", "the checkpoint was not written by "
                                    "FileSystemWriter; re-save it with torch.distributed.checkpoint.save")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the restricted unpickler (and caches it).

    Pass it to ``dcp.load(..., storage_reader=SafeFileSystemReader(path))``. Load only tensor keys:
    DCP's default planner unpickles non-tensor (bytes) entries with ``weights_only=False``. Per-rank
    metadata files (``__<rank>.metadata``, DCP's fallback when the global one fails) are never read.
    """

    _cached = None
    direct = True  # read tensors straight into place (workbench.checkpoint.directread); False: DCP's reader

    def read_data(self, plan, planner):
        """Each file's items in offset order, straight into their destinations where they can be placed;
        the rest (and everything when ``direct`` is False) through DCP's ``torch.load`` path."""
        from torch.futures import Future

        from workbench.checkpoint.directread import ReadStats, read_items

        if not self.direct:
            self.stats = ReadStats(dcp=len(plan.items), reasons={"direct reading off": len(plan.items)})
            return super().read_data(plan, planner)
        self.stats = stats = ReadStats()
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, reqs in per_file.items():
            read_items(Path(self.path) / rel, reqs, self.storage_data, planner, stats,
                       lambda rest: FileSystemReader.read_data(self, _Plan(rest), planner).wait())
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self._cached is None:
            self._cached = read_dcp_metadata(self.path)
        md = self._cached
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _Plan:
    """A LoadPlan of some items (DCP's read_data only reads ``.items``)."""

    def __init__(self, items):
        self.items = items


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------

# safetensors dtype code -> torch dtype name. The FP8 formats (e4m3fn: weights and activations; e5m2:
# gradients; e8m0fnu: power-of-two block scales of MX formats) are looked up by name, so a torch that
# lacks one still reads every other file and refuses only the tensors of that dtype, by name.
_SAFETENSORS_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, name in _SAFETENSORS_NAMES.items()
                                              if isinstance(getattr(torch, name, None), torch.dtype)}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, every entry checked against the file's size.

    ``header`` maps key -> ``{"dtype", "shape", "data_offsets"}`` (plus ``"__metadata__"`` if present);
    data offsets are relative to ``data_start = 8 + N``.
    """
    p = Path(path)
    fix = "the file is truncated or was not written by safetensors; re-export or re-download it"
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFormatError(p, f"{size} bytes is too short for a safetensors header", fix)
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise CheckpointFormatError(p, f"header claims {n} bytes but the file has {size - 8} after the "
                                            "length prefix", fix)
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointFormatError(p, "no such file", "check the path") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(p, f"safetensors header is not JSON ({type(e).__name__})", fix) from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(p, "safetensors header is not a JSON object", fix)
    start = 8 + n
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        code = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(code, str) and code not in SAFETENSORS_DTYPES:
            known = code in _SAFETENSORS_NAMES
            raise CheckpointFormatError(p, f"tensor {key!r} has dtype {code!r}, which " + (
                f"torch {torch.__version__} cannot hold (no torch.{_SAFETENSORS_NAMES[code]})" if known else
                "is not a safetensors dtype"), "upgrade torch" if known else
                f"re-export it in one of {sorted(SAFETENSORS_DTYPES)}")
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            b, e = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(p, f"tensor {key!r} has a malformed header entry {str(entry)[:80]}", fix) from None
        want = math.prod(shape) * dtype.itemsize
        if e - b != want or b < 0 or any(s < 0 for s in shape):
            raise CheckpointFormatError(p, f"tensor {key!r} {entry['dtype']}{shape} needs {want} bytes but its "
                                        f"data_offsets [{b}, {e}] span {e - b}", fix)
        if start + e > size:
            raise CheckpointFormatError(p, f"tensor {key!r} ends at byte {start + e} but the file has {size} bytes", fix)
        spans.append((b, e, key))
    spans.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointFormatError(p, f"tensors {k0!r} and {k1!r} overlap in the data section", fix)
    return header, start


# --------------------------------------------------------------------------------------------------
# torch.save
# --------------------------------------------------------------------------------------------------

def read_torch_file(path: str | os.PathLike) -> dict[str, Any]:
    """A torch.save archive's contents, flattened to ``{dotted.key: value}``, tensors memory-mapped.

    Uses torch's restricted unpickler (``weights_only=True``): only tensors, containers and plain values.
    """
    p = Path(path)
    if not zipfile.is_zipfile(p):
        raise CheckpointFormatError(p, "not a zip archive (legacy torch.save format or not a torch file)",
                                    "re-save it with torch.save (the default zip format), or convert it with "
                                    "`workbench ckpt convert`")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else "refused by weights_only"
        raise CheckpointFormatError(p, f"refusing to unpickle: {first}",
                                    "the file holds objects other than tensors and plain values; load it only if "
                                    "you trust it, and re-save its state_dict") from None
    except Exception as e:
        raise CheckpointFormatError(p, f"unreadable torch.save archive ({type(e).__name__}: {str(e)[:80]})",
                                    "the file is truncated or corrupted; restore it") from None
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}" if prefix else str(i), v)
        else:
            flat[prefix or "value"] = value

    walk("", obj)
    return flat
