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
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from workbench import safeio
from workbench.safepickle import (DATA_PKL_OPCODES, DCP_METADATA_OPCODES, PickleFormat, PickleTruncated,
                                  RestrictedUnpickler, UnsafePickle, dotted_name, scan)
from workbench.safeio import FileRefused
from workbench.units import format_bytes

__all__ = [
    "CheckpointFormatError",
    "SafeFileSystemReader",
    "check_claims",
    "check_tensor_claim",
    "is_zip_archive",
    "numel_of",
    "SAFETENSORS_DTYPES",
    "read_dcp_metadata",
    "read_safetensors_header",
    "read_torch_file",
]


class CheckpointFormatError(FileRefused):
    """A checkpoint file that cannot be read as what it claims to be, or that is refused before it is read
    (:mod:`workbench.safeio`: outside its directory, not a regular file, too large). The message is one
    line, ``<file>: <problem>; <fix>``; ``reason`` says which (``format`` for a damaged file)."""


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
    # (not bytes: bytes(2**40) is a terabyte asked for by a few bytes, and no DCP writes bytes that way)
    "builtins": {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bool", "complex"},
}
# The format the restricted unpickler holds .metadata to: these names (the dict itself, so a test can take
# one away) and DCP's opcodes, under workbench.safepickle's limits (memo, depth, sizes) checked first.
_DCP_METADATA = PickleFormat("DCP .metadata", DCP_METADATA_OPCODES, _ALLOWED)


class _DcpMetadataUnpickler(RestrictedUnpickler):
    """DCP's ``.metadata`` through the C unpickler: the bytes pass :func:`workbench.safepickle.scan` first,
    then only the names in ``_ALLOWED`` resolve. Every refusal is one :class:`CheckpointFormatError`."""

    format = _DCP_METADATA

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def load(self) -> Any:
        try:
            return super().load()
        except PickleTruncated as e:  # an interrupted copy or save, the common case: not an attack
            raise CheckpointFormatError(self.source, f"broken DCP metadata: it {e.problem}",
                                        "the file is truncated; restore it or use another checkpoint") from None
        except UnsafePickle as e:
            raise CheckpointFormatError(self.source, f"refusing this DCP metadata: it {e.problem}",
                                        "the file is damaged or was made to attack a reader; do not load it, "
                                        "restore it or re-save the checkpoint") from None

    def refuse(self, module: str, name: str) -> Exception:
        what = dotted_name(module, name)  # the name only when it is one (no control characters)
        if module == "torch" and name.startswith(("float", "int", "uint", "bfloat", "complex", "bits")) \
                and what == f"torch.{name}":
            return CheckpointFormatError(self.source, f"the checkpoint holds {what} tensors, a dtype "
                                         f"torch {torch.__version__} does not have", "read it with a newer torch")
        return CheckpointFormatError(self.source, f"refusing to unpickle {what}: not DCP metadata",
                                     "this file is not a torch.distributed.checkpoint .metadata (or was tampered "
                                     "with); do not load it, re-save the checkpoint")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(self.source, "refusing a persistent id: not DCP metadata",
                                    "re-save the checkpoint with torch.distributed.checkpoint")


def read_dcp_metadata(path: str | os.PathLike):
    """The ``Metadata`` of a DCP checkpoint directory (or of its ``.metadata`` file), read safely."""
    p = Path(path)
    if p.name == ".metadata" and not p.is_dir():
        p = p.parent
    # .metadata inside its directory, a regular file of at most METADATA_MAX bytes: a link to /dev/zero, to a
    # huge file or out of the directory is refused before a byte is read.
    p = safeio.confine(p, ".metadata", what="DCP .metadata", error=CheckpointFormatError)
    data = safeio.read_bounded(p, safeio.METADATA_MAX, "DCP .metadata", error=CheckpointFormatError,
                               fix_missing="a DCP checkpoint directory holds a .metadata file written last by the "
                               "save; the save did not finish, pick another step")
    try:
        md = _DcpMetadataUnpickler(io.BytesIO(data), str(p)).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated or garbled: EOFError, UnpicklingError, struct errors, ...
        # the exception's type only: its text can quote the file's bytes ("invalid load key, 'x'")
        raise CheckpointFormatError(p, f"broken DCP metadata ({type(e).__name__})",
                                    "the file is truncated or corrupted; restore it or use another checkpoint") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointFormatError(p, f"holds a {type(md).__name__}, not DCP Metadata",
                                    "pass the directory torch.distributed.checkpoint.save wrote")
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointFormatError(p, "DCP metadata without storage_data", "the checkpoint was not written by "
                                    "FileSystemWriter; re-save it with torch.distributed.checkpoint.save")
    _check_metadata(md, p)
    return md


# torch counts a tensor's elements (and each size and offset) in int64: a shape whose non-zero sizes multiply
# to this or more cannot be made ("numel: integer multiplication overflow"), whatever else the file says.
_MAX_NUMEL = 1 << 63


def numel_of(shape: Any) -> int | None:
    """The element count of ``shape`` (non-negative ints), or None when torch could not hold it: the product
    of its non-zero sizes reaches 2**63. The product saturates, so a shape of a million sizes, or of sizes
    with thousands of digits, costs one small multiplication each."""
    product, empty = 1, False
    for d in shape:
        if d:
            product = min(product * d, _MAX_NUMEL)
        else:
            empty = True
    return None if product >= _MAX_NUMEL else 0 if empty else product


def _sizes(v: Any) -> bool:
    """A tuple/list/torch.Size of non-negative ints below 2**63: a shape, an offset."""
    return isinstance(v, (tuple, list)) and all(type(x) is int and 0 <= x < _MAX_NUMEL for x in v)


def _check_metadata(md: Metadata, p: Path) -> None:
    """Every entry has the fields and types DCP writes, and every data file name stays in the directory.

    The unpickler builds objects from whatever the file sets on them, so a flipped bit can leave a field
    missing or of another type; refused here in one line rather than as an AttributeError in a reader.
    Data file names are checked by their text (safeio.check_name): ``../x`` or ``/etc/x`` is refused
    whether or not it exists."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    fix = "the file is corrupted or was not written by torch.distributed.checkpoint; restore it or use another step"

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(p, f"damaged DCP metadata: {what}", fix)

    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"a key of type {type(fqn).__name__}, not a string")
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise bad(f"{fqn[:200]!r} is described by a {type(meta).__name__}")
        size, chunks = getattr(meta, "size", None), getattr(meta, "chunks", None)
        if not isinstance(getattr(getattr(meta, "properties", None), "dtype", None), torch.dtype) \
                or not _sizes(size) or not isinstance(chunks, list):
            raise bad(f"{fqn[:200]!r} lacks a dtype, a shape or its chunk list")
        if numel_of(size) is None:
            raise bad(f"{fqn[:200]!r} has a shape of 2**63 elements or more, more than a tensor can hold")
        for c in chunks:
            offsets, lengths = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not (_sizes(offsets) and _sizes(lengths) and len(offsets) == len(lengths) == len(size)):
                raise bad(f"a chunk of {fqn[:200]!r} lacks offsets or sizes of its rank")
    names: set[str] = set()  # a few files hold every chunk: each name is checked once
    for idx, info in md.storage_data.items():
        offset = getattr(idx, "offset", None)
        if not isinstance(idx, MetadataIndex) or not isinstance(getattr(idx, "fqn", None), str) \
                or not (offset is None or _sizes(offset)):
            raise bad(f"a storage index of type {type(idx).__name__} without a key or offset")
        if not isinstance(info, _StorageInfo) or type(getattr(info, "offset", None)) is not int \
                or type(getattr(info, "length", None)) is not int or info.offset < 0 or info.length < 0:
            raise bad(f"the storage entry of {idx.fqn[:200]!r} lacks a byte offset or length")
        rel = getattr(info, "relative_path", None)
        if not (type(rel) is str and rel in names):
            names.add(safeio.check_name(rel, p, "data file", error=CheckpointFormatError))


def check_tensor_claim(root: str | os.PathLike, key: str, shape: Any, dtype: torch.dtype, chunks: Any,
                       sizes: dict[str, int] | None = None) -> None:
    """Before a DCP tensor is allocated at the shape its ``.metadata`` claims: every chunk lies inside the shape
    and (unless empty) has a storage entry, the chunks cover the shape, and its bytes fit in the data files
    that hold them.

    The metadata is a few bytes per tensor and says nothing true about memory: one changed integer turns a
    16 x 32 tensor into 16 x 2**31 (a 128 GiB allocation). A tensor's chunks are distinct items of its data
    files, each holding its elements' bytes uncompressed (a compressed item is no torch.save archive, and
    :func:`workbench.checkpoint.directread.scan_item_pickle` refuses it), so a tensor that can be read never
    needs more bytes than those files hold: the allocation stays in proportion to the checkpoint's size.

    ``chunks``: ``(file or None, offsets, lengths)`` per chunk (None: no storage entry); ``sizes``: file sizes
    already looked up (shared by the calls for one checkpoint). One :class:`CheckpointFormatError` naming the
    tensor and ``.metadata`` (or the missing data file)."""
    named_by = Path(root) / ".metadata"
    fix = "the metadata is damaged or does not match its data files; restore the checkpoint or use another step"
    shape = tuple(shape)
    numel = numel_of(shape)  # read_dcp_metadata refused shapes torch cannot hold
    covered, files = 0, {}  # (a dict: the files in order, each once)
    for file, offsets, lengths in chunks:
        if len(offsets) != len(shape) or len(lengths) != len(shape) \
                or any(o + n > d for o, n, d in zip(offsets, lengths, shape)):
            raise CheckpointFormatError(named_by, f"a chunk of {key[:200]!r} at {list(offsets)[:8]} lies outside its "
                                        f"shape {list(shape)[:8]}", fix)
        elements = math.prod(lengths)  # inside the shape: at most its numel
        if file is None and elements:  # (an empty chunk holds nothing to read: DCP plans no read of it)
            raise CheckpointFormatError(named_by, f"a chunk of {key[:200]!r} at {list(offsets)[:8]} has no storage "
                                        "entry, so no file holds it", fix)
        covered += elements
        if file is not None:
            files[file] = None
    if covered != numel:
        raise CheckpointFormatError(named_by, f"the chunks of {key[:200]!r} cover {covered:,} of the {numel:,} "
                                    f"elements of its shape {list(shape)[:8]}", "a rank's shards are missing or the "
                                    "metadata is damaged; use a complete checkpoint step")
    sizes = {} if sizes is None else sizes
    have = 0
    for file in files:
        if file not in sizes:
            sizes[file] = safeio.regular_size(safeio.confine(root, file, named_by, "data file",
                                                             error=CheckpointFormatError),
                                              "DCP data file", error=CheckpointFormatError,
                                              fix_missing="restore the shard file or use another step")
        have += sizes[file]
    need = numel * dtype.itemsize
    if need > have:
        raise CheckpointFormatError(named_by, f"{key[:200]!r} claims {format_bytes(need)} ({dtype} "
                                    f"{list(shape)[:8]}) but the {len(files)} data file(s) holding it have "
                                    f"{format_bytes(have)}", fix)


def check_claims(md: Metadata, root: str | os.PathLike, keys: Any) -> None:
    """:func:`check_tensor_claim` for the tensors ``keys`` of the metadata ``md`` (a load's targets that are
    allocated at the checkpoint's shapes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = {(idx.fqn, tuple(idx.offset)): info.relative_path for idx, info in md.storage_data.items()
               if idx.offset is not None}
    sizes: dict[str, int] = {}
    for key in keys:
        meta = md.state_dict_metadata.get(key)
        if isinstance(meta, TensorStorageMetadata):
            chunks = [(storage.get((key, tuple(c.offsets))), tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
            check_tensor_claim(root, key, meta.size, meta.properties.dtype, chunks, sizes)


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

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        # each file .metadata names, inside the checkpoint directory (its links too), before DCP or we open it
        named_by = Path(self.path) / ".metadata"
        files = {rel: safeio.confine(self.path, rel, named_by, "data file", error=CheckpointFormatError)
                 for rel in per_file}
        if not self.direct:
            from torch.distributed.checkpoint.planner import LoadItemType

            from workbench.checkpoint.directread import pickled_value, scan_item_pickle

            for rel, reqs in per_file.items():  # what torch.load reads passes workbench.safepickle's limits first
                with safeio.open_regular(files[rel], "DCP data file", error=CheckpointFormatError) as fh:
                    for req in reqs:
                        if req.type == LoadItemType.BYTE_IO:
                            raise pickled_value(files[rel], req.storage_index.fqn)
                        scan_item_pickle(fh, self.storage_data[req.storage_index], files[rel], req.storage_index.fqn)
            self.stats = ReadStats(dcp=len(plan.items), reasons={"direct reading off": len(plan.items)})
            return super().read_data(plan, planner)
        self.stats = stats = ReadStats()
        for rel, reqs in per_file.items():
            read_items(files[rel], reqs, self.storage_data, planner, stats,
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
_MAX_HEADER = safeio.SAFETENSORS_HEADER_MAX  # the safetensors library's own limit
# A header's JSON costs ~60 bytes per tensor and a tensor at least a byte: a header larger than the data it
# describes is thousands of empty tensors, never an export. Headers up to this size pass whatever the data.
_FREE_HEADER = 16 << 20


def _int(x: int) -> str:
    """An integer from a file, for a message: a huge one is described (str() of one with more than 4,300
    digits raises ValueError, and its digits say nothing to a reader)."""
    return str(x) if x.bit_length() <= 64 else f"<an integer of {x.bit_length():,} bits>"


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, every entry checked against the file's size.

    ``header`` maps key -> ``{"dtype", "shape", "data_offsets"}`` (plus ``"__metadata__"`` if present);
    data offsets are relative to ``data_start = 8 + N``. Only a regular file is opened. The header is at most
    100 MiB and no larger than the larger of 16 MiB and the data after it; it is parsed once and each
    entry checked in one pass (then the spans sorted), so the time is in proportion to the header.
    """
    p = Path(path)
    fix = "the file is truncated or was not written by safetensors; re-export or re-download it"
    with safeio.open_regular(p, "safetensors file", error=CheckpointFormatError) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(p, f"{size} bytes is too short for a safetensors header", fix)
        (n,) = struct.unpack("<Q", head)
        # the problems are named without the claimed length: it is the file's own bytes
        if n > size - 8:
            raise CheckpointFormatError(p, f"its header claims more bytes than the {size}-byte file holds", fix)
        if n > _MAX_HEADER:
            raise CheckpointFormatError(p, f"its header claims more than {_MAX_HEADER >> 20} MiB, the most "
                                        "safetensors allows", fix)
        if n > max(_FREE_HEADER, size - 8 - n):
            raise CheckpointFormatError(p, f"its header is larger than the {size - 8 - n} bytes of data it "
                                        f"describes (a header is at most the larger of {_FREE_HEADER >> 20} MiB and "
                                        "its data)", fix)
        raw = f.read(n)
    if len(raw) < n:
        raise CheckpointFormatError(p, "ends inside its header", fix)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(p, f"safetensors header is not JSON ({type(e).__name__})", fix) from None
    except ValueError:  # json's int() of a number past sys.get_int_max_str_digits() digits
        raise CheckpointFormatError(p, "its safetensors header holds a number of thousands of digits, which no "
                                    "size or offset has", fix) from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(p, "safetensors header is not a JSON object", fix)
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointFormatError(p, "its __metadata__ is not a map of strings", fix)
    start = 8 + n
    spans = []
    dtypes = SAFETENSORS_DTYPES
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        code = entry.get("dtype") if type(entry) is dict else None
        dtype = dtypes.get(code) if type(code) is str else None
        if dtype is None and type(code) is str:
            known = code in _SAFETENSORS_NAMES
            raise CheckpointFormatError(p, f"tensor {key[:200]!r} has dtype {code[:40]!r}, which " + (
                f"torch {torch.__version__} cannot hold (no torch.{_SAFETENSORS_NAMES[code]})" if known else
                "is not a safetensors dtype"), "upgrade torch" if known else
                f"re-export it in one of {sorted(SAFETENSORS_DTYPES)}")
        shape = entry.get("shape") if dtype is not None else None
        offsets = entry.get("data_offsets") if dtype is not None else None
        numel, empty = 1, False
        ok = type(shape) is list and type(offsets) is list and len(offsets) == 2
        if ok:
            for d in shape:
                if type(d) is not int or d < 0:
                    ok = False
                    break
                if d > 1:  # the product saturates: a million sizes, or sizes of 4,000 digits, stay cheap
                    numel = min(numel * d, _MAX_NUMEL)
                elif not d:
                    empty = True
            b, e = offsets
            ok = ok and type(b) is int and type(e) is int
        if not ok:
            raise CheckpointFormatError(p, f"tensor {key[:200]!r} has a malformed header entry (it needs a dtype, a "
                                        "shape of non-negative integers and two integer data_offsets)", fix)
        if numel >= _MAX_NUMEL:
            raise CheckpointFormatError(p, f"tensor {key[:200]!r} has a shape of {len(shape):,} sizes whose product "
                                        "is 2**63 or more, more elements than a tensor can hold", fix)
        want = 0 if empty else numel * dtype.itemsize
        if e - b != want or b < 0:
            raise CheckpointFormatError(p, f"tensor {key[:200]!r} {code}{shape if len(shape) <= 8 else '[...]'} needs "
                                        f"{want} bytes but its data_offsets [{_int(b)}, {_int(e)}] span {_int(e - b)}",
                                        fix)
        if start + e > size:
            raise CheckpointFormatError(p, f"tensor {key[:200]!r} ends at byte {_int(start + e)} but the file has "
                                        f"{size} bytes", fix)
        spans.append((b, e, key))
    spans.sort()
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointFormatError(p, f"tensors {k0!r} and {k1!r} overlap in the data section", fix)
    return header, start


# --------------------------------------------------------------------------------------------------
# torch.save
# --------------------------------------------------------------------------------------------------

_TORCH_SAVE = PickleFormat("a torch.save file's data.pkl", DATA_PKL_OPCODES)  # its globals: torch's weights_only
# data.pkl lists the tensors (~100 bytes each) and plain values: 64 MiB is over half a million tensors
_DATA_PKL_MAX = 64 << 20


def _scan_archive_pickle(p: Path) -> None:
    """The archive's data.pkl within workbench.safepickle's limits (memo, depth, sizes) before torch.load."""
    try:
        with zipfile.ZipFile(p) as z:
            info = next((i for i in z.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"),
                        None)
            if info is None:
                return  # torch.load names what is missing
            if info.file_size > _DATA_PKL_MAX:  # (zipfile reads no more than this size: an inflation bomb stops)
                raise CheckpointFormatError(p, f"its data.pkl claims {format_bytes(info.file_size)}, more than a "
                                            f"torch.save file's index of tensors ({format_bytes(_DATA_PKL_MAX)} at "
                                            "most)", "the file is damaged or not a torch.save checkpoint")
            data = z.read(info)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError, zlib.error) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        # torch's zip reader is more lenient than Python's (it reads an archive whose zip64 locator names another
        # disk): what could not be scanned is not handed to torch.load
        raise CheckpointFormatError(p, f"is a damaged zip archive ({type(e).__name__}), so its data.pkl cannot be "
                                    "checked before it is unpickled", "the file is truncated or corrupted; restore "
                                    "it or re-save it with torch.save") from None
    try:
        scan(data, _TORCH_SAVE)
    except UnsafePickle as e:
        raise CheckpointFormatError(p, f"refusing this torch.save file: its data.pkl {e.problem}",
                                    "the file is damaged or was made to attack a reader; do not load it") from None


def is_zip_archive(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a zip archive (a torch.save file), by its end record.

    ``zipfile.is_zipfile`` answers False for most damaged files but raises BadZipFile for some ("zipfiles that
    span multiple disks are not supported", from a zip64 locator with a bit flipped): such a file does end
    like an archive, so it counts as one, and reading it names the damage."""
    try:
        return zipfile.is_zipfile(path)
    except (zipfile.BadZipFile, struct.error, ValueError):
        return True


def read_torch_file(path: str | os.PathLike) -> dict[str, Any]:
    """A torch.save archive's contents, flattened to ``{dotted.key: value}``, tensors memory-mapped.

    Uses torch's restricted unpickler (``weights_only=True``): only tensors, containers and plain values.
    """
    p = Path(path)
    safeio.regular_size(p, "torch.save file", error=CheckpointFormatError)  # a FIFO would block is_zipfile's open
    if not is_zip_archive(p):
        raise CheckpointFormatError(p, "not a zip archive (legacy torch.save format or not a torch file)",
                                    "re-save it with torch.save (the default zip format), or convert it with "
                                    "`workbench ckpt convert`")
    _scan_archive_pickle(p)  # torch's weights_only unpickler hashes a 10**6-deep tuple key in C (a segfault)
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
