"""Where each tensor of a checkpoint lies, in its manifest: what a load in one process needs of DCP's
``.metadata`` without unpickling it.

Reading ``.metadata`` means checking its pickle first (:mod:`workbench.safepickle`'s scan, a Python loop
over every opcode: 11 ms of CPU for the small preset's 310 entries, a third of what
``safetensors.load_file`` takes for the whole state). When every tensor of a save is stored whole (one
chunk: a save from one process, or a pipeline's stages), the saver also writes, into ``workbench.json``::

    "index": "{\"files\": [\"__0_0.distcp\", ...],
               \"tensors\": {\"model.norm.weight\": [0, 4416, 1472, \"float32\", [64]], ...},
               \"other\": []}",
    "index_xxh3_64": "1f0c..."

each tensor's file (a position in ``files``), its item's offset and length in that file, its dtype and
shape, and the keys of entries that are not tensors. The index is JSON text with a checksum of its own,
since the manifest holds the other files' checksums but none of itself: a damaged index is not used.
:func:`index_metadata` turns it back into the ``Metadata`` those entries would give, or None (damaged,
absent, anything out of form), and the load then reads ``.metadata``. Only the mapped/copying path of a
load in one process uses it; DCP's planner always gets ``.metadata`` itself. ``.metadata`` is still
checksummed with every other file.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)

__all__ = ["manifest_index", "index_metadata"]

# dtypes by name: only these are read back (anything else: the index is not used)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)))}
_NAMES = {d: n for n, d in _DTYPES.items()}
_MAX = 1 << 62  # offsets, lengths and sizes: beyond this no file or tensor exists


def manifest_index(md: Metadata) -> dict[str, str] | None:
    """The manifest fields (``index``, ``index_xxh3_64``) for the metadata a save produced, or None when some
    tensor is stored in pieces, under a transform or in a dtype not listed (then loads read ``.metadata``)."""
    storage = {(idx.fqn, tuple(idx.offset)): info for idx, info in md.storage_data.items() if idx.offset is not None}
    files: list[str] = []
    where: dict[str, int] = {}
    tensors: dict[str, list[Any]] = {}
    other: list[str] = []
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            other.append(key)
            continue
        if len(meta.chunks) != 1 or tuple(meta.chunks[0].sizes) != tuple(meta.size) or any(meta.chunks[0].offsets):
            return None
        info = storage.get((key, tuple(meta.chunks[0].offsets)))
        name = _NAMES.get(meta.properties.dtype)
        if info is None or getattr(info, "transform_descriptors", None) or name is None:
            return None
        n = where.setdefault(info.relative_path, len(files))
        if n == len(files):
            files.append(info.relative_path)
        tensors[key] = [n, info.offset, info.length, name, list(meta.size)]
    text = json.dumps({"files": files, "tensors": tensors, "other": other}, separators=(",", ":"))
    return {"index": text, "index_xxh3_64": xxhash.xxh3_64_hexdigest(text.encode())}


def _count(x: Any) -> bool:
    return type(x) is int and 0 <= x < _MAX


def index_metadata(manifest: dict[str, Any] | None) -> Metadata | None:
    """The ``Metadata`` (tensor entries, one whole chunk each, and their items) that the manifest's index
    describes, or None where there is no index, its checksum differs, or any part is out of form: file
    names that the manifest does not list as data files, counts that are not non-negative integers, shapes
    of more elements than torch can count, dtypes not listed. Nothing here is trusted further than the
    bounds checks of the mapped reader, which holds each item against its file's size."""
    from workbench.checkpoint.safeload import numel_of

    text = (manifest or {}).get("index")
    digest = (manifest or {}).get("index_xxh3_64")
    if not isinstance(text, str) or not isinstance(digest, str) or xxhash.xxh3_64_hexdigest(text.encode()) != digest:
        return None
    try:
        doc = json.loads(text)
    except ValueError:  # RecursionError included
        return None
    listed = manifest.get("files")
    if not isinstance(doc, dict) or not isinstance(listed, dict):
        return None
    files, tensors, other = doc.get("files"), doc.get("tensors"), doc.get("other")
    if not (isinstance(files, list) and isinstance(tensors, dict) and isinstance(other, list)):
        return None
    if not all(isinstance(f, str) and f.endswith(".distcp") and f in listed for f in files) \
            or not all(isinstance(k, str) and k not in tensors for k in other):
        return None
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, entry in tensors.items():
        if not (isinstance(entry, list) and len(entry) == 5):
            return None
        n, offset, length, dtype, shape = entry
        if not (_count(n) and n < len(files) and _count(offset) and _count(length) and dtype in _DTYPES
                and isinstance(shape, list) and len(shape) <= 64 and all(_count(s) for s in shape)):
            return None
        numel = numel_of(shape)
        if numel is None or numel * _DTYPES[dtype].itemsize > length:
            return None
        size = torch.Size(shape)
        zeros = torch.Size([0] * len(shape))
        state[key] = TensorStorageMetadata(TensorProperties(dtype=_DTYPES[dtype]), size,
                                           [ChunkStorageMetadata(offsets=zeros, sizes=size)])
        storage[MetadataIndex(key, zeros)] = _StorageInfo(files[n], offset, length)
    for key in other:  # not tensors: named, so that a load knows they are there (never read from here)
        state[key] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=state, storage_data=storage)
