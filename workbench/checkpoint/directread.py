"""Reading DCP tensor items straight into their destination: few large reads, no per-tensor ``torch.load``.

DCP's default format stores each tensor item as a ``torch.save`` archive (an uncompressed zip) at
``(offset, length)`` of a ``__<rank>_<thread>.distcp`` file. DCP's own reader hands every item to
``torch.load`` (about 0.3 ms of Python each), narrows the result and copies it into the destination:
three copies. This reader walks the archive's local headers itself to find the tensor's bytes, learns
dtype, size, stride and storage offset from the archive's tiny ``data.pkl`` through an unpickler that
admits nothing but torch's tensor-rebuild call and storage types (none of which it calls), and then:

* ``direct``: the stored tensor is exactly the destination (same dtype, both contiguous, no narrowing):
  one ``preadv`` into the destination's memory;
* ``narrow``: otherwise (the layout changed, so only part of a saved chunk is wanted, or the strides
  differ): one read into a reused buffer, a view with the stored strides, narrowing, ``copy_``.

Items this reader cannot place (a compressed record, a dtype other than DCP's metadata says, a big-endian
archive, a record reaching outside its item) go through DCP's path (``torch.load``) and are counted as
``dcp``. Truncated or corrupt files are refused with :class:`~workbench.checkpoint.safeload.CheckpointFormatError`.
"""

from __future__ import annotations

import io
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.safepickle import DATA_PKL_OPCODES, PickleFormat, RestrictedUnpickler, UnsafePickle, dotted_name

__all__ = ["ReadStats", "StoredTensor", "parse_item", "pickled_value", "read_items", "scan_item_pickle"]

_LOCAL = b"PK\x03\x04"
_SMALL = 1 << 16  # items up to this size are read whole in one call
_HEAD = 4096  # bytes read to find a larger item's data record (data.pkl and the small records before it)
ALIGN = 64  # items start at multiples of this in files workbench writes (saver._HashingStream)
# The saver records where each write larger than this went (the manifest's ``spans``): in a tensor item the
# one such write is the tensor's data record, so a load can find large tensors without parsing the item.
SPAN_MIN = 4096


@dataclass
class ReadStats:
    """What a load read, by path: items and bytes read straight into place, narrowed, or via torch.load."""

    direct: int = 0
    narrow: int = 0
    dcp: int = 0
    bytes: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why items went through torch.load

    @property
    def path(self) -> str:
        if self.dcp:
            return "dcp" if not (self.direct or self.narrow) else "mixed"
        return "direct" if not self.narrow else "direct+narrow"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "direct": self.direct, "narrow": self.narrow, "dcp": self.dcp,
                "bytes": self.bytes, **({"dcp_reasons": dict(self.reasons)} if self.reasons else {})}


@dataclass
class StoredTensor:
    """Where a stored tensor's bytes are (relative to the item's start) and how to view them."""

    data_offset: int
    data_length: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @property
    def contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.size):
            expected.append(acc)
            acc *= s
        dims = [(st, e) for st, e, s in zip(self.stride, reversed(expected), self.size) if s != 1]
        return all(st == e for st, e in dims)


class _Unsupported(Exception):
    """This item goes through DCP's torch.load path; the message says why."""


class _Hostile(_Unsupported):
    """This item's data.pkl passes no reader's limits (:mod:`workbench.safepickle`): the load stops with the
    file named, and the item never reaches torch.load (whose unpickler would hash a 10**6-deep tuple in C).
    A subclass, so that a caller that falls back on any _Unsupported still does not read it itself."""


# -- data.pkl: torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks) -------

def _rebuild_capture(storage, storage_offset, size, stride, *rest):
    return ("tensor", storage, int(storage_offset), tuple(size), tuple(stride), None)


def _rebuild_capture_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *rest):
    """torch's rebuild for dtypes without a typed storage class (an untyped byte storage + the dtype)."""
    return ("tensor", storage, int(storage_offset), tuple(size), tuple(stride), dtype)


def _ordered_dict(*args):
    return dict(*args)


class _StorageType:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _storage_types() -> dict[str, _StorageType]:
    out = {}
    for name in dir(torch):
        if name.endswith("Storage") and not name.startswith("_"):
            cls = getattr(torch, name)
            with warnings.catch_warnings():  # "TypedStorage is deprecated": only its dtype is read
                warnings.simplefilter("ignore")
                try:
                    dtype = getattr(cls, "dtype", None)
                    dtype = dtype if isinstance(dtype, torch.dtype) else cls(0).dtype
                except Exception:  # noqa: BLE001 - a storage class without a dtype (e.g. UntypedStorage)
                    continue
            out[name] = _StorageType(dtype)
    return out


_STORAGES: dict[str, _StorageType] | None = None

# What a tensor's data.pkl may name: torch's rebuild functions, its storage types and dtypes, and OrderedDict
# (the backward hooks). Each resolves to an inert stand-in below.
_DATA_PKL = PickleFormat("a tensor's data.pkl", DATA_PKL_OPCODES, {
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_tensor_v3"}),
    "torch.storage": frozenset({"UntypedStorage"}),
    "torch": frozenset({n for n in dir(torch) if n.endswith("Storage") and not n.startswith("_")}
                       | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}),
    "collections": frozenset({"OrderedDict"})})


class _PklReader(RestrictedUnpickler):
    """Resolves only the names a tensor's ``data.pkl`` uses, to inert stand-ins; calls nothing of torch's.
    The bytes pass :func:`workbench.safepickle.scan` first (memo, depth, sizes, lengths)."""

    format = _DATA_PKL

    def refuse(self, module: str, name: str) -> Exception:
        return _Unsupported(f"data.pkl names {dotted_name(module, name)}")

    def resolve(self, module: str, name: str):
        global _STORAGES
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_capture
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_capture_v3
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageType(torch.uint8)
        if module == "collections" and name == "OrderedDict":
            return _ordered_dict
        if module == "torch":
            if _STORAGES is None:
                _STORAGES = _storage_types()
            if name in _STORAGES:
                return _STORAGES[name]
            dtype = getattr(torch, name, None)
            if isinstance(dtype, torch.dtype):
                return dtype
        raise _Unsupported(f"data.pkl names {module}.{name}")

    def persistent_load(self, pid):
        # ('storage', storage type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and type(pid[2]) is str
                and type(pid[4]) is int):
            raise _Unsupported("unexpected persistent id in data.pkl")
        kind = pid[1]
        dtype = kind.dtype if isinstance(kind, _StorageType) else kind if isinstance(kind, torch.dtype) else None
        if dtype is None:
            raise _Unsupported("storage without a dtype")
        return ("storage", dtype, str(pid[2]), int(pid[4]))


def _central(tail: memoryview, item_length: int) -> dict[str, tuple[int, int, int]]:
    """name -> (local header offset, compressed size, method) from the zip's central directory, which
    with its end records lies in ``tail`` (the item's last bytes). torch's writer puts the sizes only
    there (its local headers are followed by data descriptors)."""
    base = item_length - len(tail)  # item offset of tail[0]
    eocd = len(tail) - 22
    if eocd >= 0 and bytes(tail[eocd:eocd + 4]) != b"PK\x05\x06":
        # items written by workbench since 2026-11 end in up to ALIGN - 1 zero bytes of padding (the next
        # item then starts aligned, so a mapped load's tensors are aligned): the end record comes just before
        window = max(0, len(tail) - 22 - (ALIGN - 1))
        found = bytes(tail[window:]).rfind(b"PK\x05\x06")
        eocd = window + found if found >= 0 else -1
        if eocd < 0 or eocd + 22 > len(tail) or struct.unpack_from("<H", tail, eocd + 20)[0] != 0 \
                or any(tail[eocd + 22:]):
            raise _Unsupported("no zip end record at the item's end")
    if eocd < 0:
        raise _Unsupported("no zip end record at the item's end")
    _, _, _, _, count, cd_size, cd_offset, _ = struct.unpack_from("<4sHHHHIIH", tail, eocd)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:  # zip64: the locator before, then the zip64 end record
        loc = eocd - 20
        if loc < 0 or bytes(tail[loc:loc + 4]) != b"PK\x06\x07":
            raise _Unsupported("zip64 locator missing")
        z64 = struct.unpack_from("<4sIQI", tail, loc)[2] - base
        if z64 < 0 or bytes(tail[z64:z64 + 4]) != b"PK\x06\x06":
            raise _Unsupported("zip64 end record outside the bytes read")
        _, _, _, _, _, _, _, count, cd_size, cd_offset = struct.unpack_from("<4sQHHIIQQQQ", tail, z64)
    pos = cd_offset - base
    if pos < 0:
        raise _Unsupported("central directory outside the bytes read")
    out = {}
    for _ in range(count):
        if bytes(tail[pos:pos + 4]) != b"PK\x01\x02":
            raise _Unsupported("malformed central directory")
        (_, _, _, _, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _,
         offset) = struct.unpack_from("<4sHHHHHHIIIHHHHHII", tail, pos)
        name = bytes(tail[pos + 46:pos + 46 + nlen]).decode("utf-8", "replace")
        if 0xFFFFFFFF in (csize, usize, offset):
            extra, i = tail[pos + 46 + nlen:pos + 46 + nlen + xlen], 0
            while i + 4 <= len(extra):
                hid, hlen = struct.unpack_from("<HH", extra, i)
                if hid == 0x0001:
                    vals = list(struct.unpack_from("<" + "Q" * (hlen // 8), extra, i + 4))
                    if usize == 0xFFFFFFFF:
                        usize = vals.pop(0)
                    if csize == 0xFFFFFFFF:
                        csize = vals.pop(0)
                    if offset == 0xFFFFFFFF:
                        offset = vals.pop(0)
                    break
                i += 4 + hlen
        out[name] = (offset, csize, method)
        pos += 46 + nlen + xlen + clen
    return out


def _data_start(head: memoryview, offset: int) -> int | None:
    """Where a record's data starts, from its local header in ``head`` (None: header not in ``head``)."""
    if offset + 30 > len(head):
        return None
    if bytes(head[offset:offset + 4]) != _LOCAL:
        raise _Unsupported("local header missing")
    nlen, xlen = struct.unpack_from("<HH", head, offset + 26)
    return offset + 30 + nlen + xlen


def parse_item(head: memoryview, tail: memoryview, item_length: int,
               expect_dtype: torch.dtype | None = None) -> tuple[StoredTensor, int | None]:
    """Locate the tensor in one torch.save archive from its first and last bytes (whole, if small).

    Returns the stored tensor and, if the data record's local header lies beyond ``head``, its offset
    (then ``data_offset`` is 0 and the caller reads the header to find it)."""
    try:
        records = _central(tail, item_length)
    except struct.error:  # a record that runs past the bytes read: garbled, torch.load judges it
        raise _Unsupported("malformed zip directory") from None
    pkl_name = next((n for n in records if n.endswith("/data.pkl") or n == "data.pkl"), None)
    if pkl_name is None:
        raise _Unsupported("no data.pkl")
    prefix = pkl_name[:-len("data.pkl")]
    off, size, method = records[pkl_name]
    start = _data_start(head, off)
    if method != 0 or start is None or start + size > len(head):
        raise _Unsupported("data.pkl compressed or beyond the first bytes read")
    try:
        obj = _PklReader(io.BytesIO(bytes(head[start:start + size]))).load()
    except _Unsupported:
        raise
    except UnsafePickle as e:
        raise _Hostile(f"its data.pkl {e.problem}") from None
    except Exception as e:  # noqa: BLE001 - a malformed pickle (within the limits): let torch.load judge it
        raise _Unsupported(f"data.pkl unreadable ({type(e).__name__})") from None
    if not (isinstance(obj, tuple) and len(obj) == 6 and obj[0] == "tensor" and isinstance(obj[1], tuple)
            and len(obj[1]) == 4 and obj[1][0] == "storage"):
        raise _Unsupported("data.pkl is not a single tensor")
    _, storage, storage_offset, shape, stride, tensor_dtype = obj
    _, storage_dtype, key, numel = storage
    storage_bytes = numel * storage_dtype.itemsize
    dtype = tensor_dtype if isinstance(tensor_dtype, torch.dtype) else storage_dtype
    # what as_strided and the reads below need: int sizes and strides of one rank, inside the storage
    if not (all(type(x) is int and x >= 0 for x in (*shape, *stride, storage_offset, numel))
            and len(shape) == len(stride)
            and (0 in shape or (storage_offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride)))
                 * dtype.itemsize <= storage_bytes)):
        raise _Unsupported("data.pkl describes a tensor outside its storage")
    if storage_bytes % dtype.itemsize:
        raise _Unsupported("storage bytes not a multiple of the element size")
    order = records.get(prefix + "byteorder")
    if order is not None:
        bstart = _data_start(head, order[0])
        if bstart is None or bytes(head[bstart:bstart + order[1]]) != b"little":
            raise _Unsupported("byte order not little-endian (or unread)")
    if expect_dtype is not None and dtype != expect_dtype:
        raise _Unsupported(f"stored {dtype} where the metadata says {expect_dtype}")
    rec = records.get(f"{prefix}data/{key}")
    if rec is None:
        raise _Unsupported("no storage record")
    off, length, method = rec
    if method != 0:
        raise _Unsupported("storage record compressed")
    if length != storage_bytes or off + length > item_length:
        raise _Unsupported("storage record size disagrees with data.pkl")
    start = _data_start(head, off)
    st = StoredTensor(start if start is not None else 0, length, dtype, shape, stride, storage_offset)
    return st, (off if start is None else None)


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _view(raw: torch.Tensor, st: StoredTensor) -> torch.Tensor:
    flat = raw.view(st.dtype) if raw.numel() else torch.empty(0, dtype=st.dtype)
    # as_strided counts its offset from the start of the underlying storage, not of this view
    return flat.as_strided(st.size, st.stride, flat.storage_offset() + st.storage_offset)


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            from workbench.checkpoint.safeload import CheckpointFormatError

            raise CheckpointFormatError(path, f"ends at byte {offset + got}, inside a tensor item",
                                        "the file is truncated; restore it or load another step")
        got += n


def read_items(path: Path, reqs: list, storage_data: dict, planner, stats: ReadStats, fallback) -> None:
    """Read ``reqs`` (DCP ReadItems of one file) into the planner's destination tensors.

    ``fallback(reqs)`` reads the items this reader cannot place, through DCP's own path.
    """
    from torch.distributed.checkpoint.planner import LoadItemType

    from workbench.checkpoint.safeload import CheckpointFormatError

    from workbench.safeio import open_regular

    reqs = sorted(reqs, key=lambda r: storage_data[r.storage_index].offset)
    rest = []
    # a regular file only (a FIFO or a device named by .metadata is refused, not read): the caller confined
    # the name to the checkpoint directory
    with open_regular(path, "DCP data file", error=CheckpointFormatError,
                      fix_missing="restore the shard file or load another step") as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        for req in reqs:
            info = storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                raise pickled_value(path, req.storage_index.fqn)
            if getattr(info, "transform_descriptors", None):
                rest.append(req)
                stats.reasons["not a plain tensor item"] = stats.reasons.get("not a plain tensor item", 0) + 1
                continue
            if info.offset + info.length > size:
                raise CheckpointFormatError(path, f"is {size} bytes but an item ends at byte {info.offset + info.length}",
                                            "the file is truncated; restore it or load another step")
            dest = planner.resolve_tensor(req).detach()
            small = info.length <= _SMALL
            head = bytearray(info.length if small else _HEAD)
            _pread_into(fd, memoryview(head), info.offset, path)
            if small:
                tail = memoryview(head)
            else:
                tail = memoryview(bytearray(_HEAD))
                _pread_into(fd, tail, info.offset + info.length - _HEAD, path)
            try:
                st, local = parse_item(memoryview(head), tail, info.length, dest.dtype)
                if local is not None:  # the data record's local header is past the first bytes read
                    hdr = bytearray(30)
                    _pread_into(fd, memoryview(hdr), info.offset + local, path)
                    if bytes(hdr[:4]) != _LOCAL:
                        raise _Unsupported("local header missing")
                    nlen, xlen = struct.unpack_from("<HH", hdr, 26)
                    st.data_offset = local + 30 + nlen + xlen
            except _Hostile as e:
                raise CheckpointFormatError(path, f"item {req.storage_index.fqn[:200]!r}: {e}",
                                            "the file is corrupt or was made to attack a reader; do not load it, "
                                            "restore it or load another step") from None
            except _Unsupported as e:
                rest.append(req)
                why = str(e)
                stats.reasons[why] = stats.reasons.get(why, 0) + 1
                continue
            whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == st.size
            if st.data_offset + st.data_length > info.length:
                raise CheckpointFormatError(path, f"item {req.storage_index.fqn}'s tensor record runs past the item",
                                            "the file is corrupt; restore it or load another step")
            if whole and st.contiguous and st.storage_offset == 0 and dest.is_contiguous() and dest.is_cpu \
                    and tuple(dest.shape) == st.size:
                nbytes = dest.numel() * dest.element_size()
                if small:
                    _as_bytes(dest)[:] = memoryview(head)[st.data_offset:st.data_offset + nbytes]
                else:
                    _pread_into(fd, _as_bytes(dest), info.offset + st.data_offset, path)
                stats.direct += 1
            else:
                if small:
                    raw = torch.frombuffer(head, dtype=torch.uint8)[st.data_offset:st.data_offset + st.data_length]
                else:
                    raw = torch.empty(st.data_length, dtype=torch.uint8)
                    _pread_into(fd, _as_bytes(raw), info.offset + st.data_offset, path)
                stored = _view(raw, st)
                for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    stored = stored.narrow(dim, off, length)
                if tuple(dest.shape) != tuple(stored.shape):
                    raise CheckpointFormatError(path, f"item {req.storage_index.fqn} holds {tuple(stored.shape)} "
                                                f"where {tuple(dest.shape)} was expected",
                                                "the file does not match its .metadata; restore it")
                dest.copy_(stored)
                stats.narrow += 1
                nbytes = stored.numel() * stored.element_size()
            stats.bytes += nbytes
            planner.commit_tensor(req, dest)
        for req in rest:  # what torch.load will read passes the same limits first
            scan_item_pickle(fh, storage_data[req.storage_index], path, req.storage_index.fqn)
    if rest:
        stats.dcp += len(rest)
        fallback(rest)


class _ItemFile(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of an open file as a file of their own, for :mod:`zipfile`."""

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, pos + (0, self.pos, self.length)[whence])
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        got = os.preadv(self.fd, [memoryview(b)[:n]], self.offset + self.pos) if n else 0
        self.pos += got
        return got


def pickled_value(path: Path, fqn: str) -> Exception:
    """The refusal of an item DCP stored as a pickled value: its planner would ``torch.load`` it with
    ``weights_only=False``, which runs whatever the pickle names. Workbench saves tensors only."""
    from workbench.checkpoint.safeload import CheckpointFormatError

    return CheckpointFormatError(path, f"item {fqn[:200]!r} is a pickled value, which would run code to load",
                                 "workbench loads tensors only and never unpickles a checkpoint's values; "
                                 "load the tensors alone")


_ITEM_PKL_MAX = 1 << 20  # one tensor's data.pkl is ~200 bytes; an item's plain value a few KiB


def scan_item_pickle(fh, info, path: Path, fqn: str) -> None:
    """The data.pkl of the item at ``info`` (a DCP ``_StorageInfo``) within :mod:`workbench.safepickle`'s
    limits, before DCP's path hands the item to ``torch.load`` (whose C unpickler would recurse on a
    10**6-deep tuple and allocate what a memo index claims). Also refuses an item that is no zip archive."""
    import zipfile
    import zlib

    from workbench.checkpoint.safeload import CheckpointFormatError
    from workbench.safepickle import scan

    def refuse(problem: str, fix: str = "the file is corrupt or was made to attack a reader; do not load it, "
               "restore it or load another step") -> CheckpointFormatError:
        return CheckpointFormatError(path, f"item {fqn[:200]!r}: {problem}", fix)

    length = info.length
    if length >= 22:  # items workbench writes end in up to ALIGN - 1 zero bytes after the zip's end record
        tail = os.pread(fh.fileno(), min(length, 22 + ALIGN - 1), info.offset + length - min(length, 22 + ALIGN - 1))
        end = tail.rfind(b"PK\x05\x06")
        if end >= 0 and end + 22 <= len(tail) and not any(tail[end + 22:]):
            length -= len(tail) - (end + 22)
    try:
        with zipfile.ZipFile(io.BufferedReader(_ItemFile(fh.fileno(), info.offset, length))) as z:
            pkl = next((i for i in z.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"),
                       None)
            if pkl is None:
                raise refuse("holds no data.pkl, so it is no torch.save archive")
            if pkl.file_size > _ITEM_PKL_MAX or pkl.compress_size > _ITEM_PKL_MAX:
                raise refuse(f"its data.pkl claims {pkl.file_size} bytes, more than a stored item's can hold")
            # read past zipfile's CRC check: torch's writer may leave CRC-32 fields 0 (we turn them off)
            hdr = os.pread(fh.fileno(), 30, info.offset + pkl.header_offset)
            if len(hdr) < 30 or hdr[:4] != _LOCAL:
                raise refuse("has no local header where its zip directory puts data.pkl")
            nlen, xlen = struct.unpack_from("<HH", hdr, 26)
            raw = os.pread(fh.fileno(), pkl.compress_size, info.offset + pkl.header_offset + 30 + nlen + xlen)
            if pkl.compress_type == zipfile.ZIP_STORED:
                data = raw
            elif pkl.compress_type == zipfile.ZIP_DEFLATED:
                data = zlib.decompressobj(-15).decompress(raw, _ITEM_PKL_MAX + 1)
            else:
                raise refuse(f"its data.pkl is compressed with method {pkl.compress_type}, which torch never writes")
            if len(data) > _ITEM_PKL_MAX:
                raise refuse("its data.pkl inflates past what a stored item's can hold")
    except CheckpointFormatError:
        raise
    except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError, zipfile.BadZipFile, zlib.error,
            struct.error) as e:
        raise refuse(f"could not be read as a torch.save archive ({type(e).__name__})",
                     f"the file is damaged: run `workbench ckpt verify {Path(path).parent}`, restore it or "
                     "load another step") from None
    try:
        scan(data, _DATA_PKL)
    except UnsafePickle as e:
        raise refuse(f"its data.pkl {e.problem}") from None
