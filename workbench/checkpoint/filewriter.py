"""How a rank's checkpoint files are written: hashed on the way, items aligned, failures named and never lost.

DCP's ``FileSystemWriter`` writes a rank's items into ``WRITE_THREADS`` files; :class:`HashingFileSystem`
is its file system here: every byte passes through :class:`_HashingStream` (XXH3-128 of the file, spans of
large writes, 64-byte aligned items, early writeback), and a write that fails for lack of room or
permission comes out as a :class:`~workbench.disk.StorageError` that says so. :class:`CheckedWriter`
makes a failure in any of DCP's writer threads fail the save.
"""

from __future__ import annotations

import io
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from workbench.checkpoint.directread import ALIGN, SPAN_MIN
from workbench.checkpoint.store import new_hash, start_writeback
from workbench.disk import storage_error

__all__ = ["HashingFileSystem", "CheckedWriter", "WRITEBACK_BYTES", "ROOM_FIX"]

WRITEBACK_BYTES = 8 << 20  # start the disk's writeback every this many bytes of a file (measured: 8 MiB)
ROOM_FIX = "free space there or choose another --ckpt-dir"  # what a save out of room tells the user to do


# -- checksums while writing ---------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write stream that feeds every byte written to a hash on its way to the file.

    DCP writes a shard front to back (``torch.save`` into the stream, or raw bytes); a seek would break
    the correspondence of hashed and stored bytes, so it marks the digest unusable (the file is then
    hashed from disk instead).

    - ``torch.save`` writes an item in about 40 calls, all but one of them a few bytes (zip headers, the
      pickle, descriptors): those are gathered and written and hashed together, the large one goes
      straight through. Measured on a 305 MB save: 12,402 calls in, 976 to the file.
    - Every :data:`WRITEBACK_BYTES` written, it starts the kernel's writeback of them
      (:func:`~workbench.checkpoint.store.start_writeback`), so the closing fsync waits for the tail only.
    - ``spans`` lists ``(offset, length)`` of every write larger than :data:`SPAN_MIN` bytes: in a tensor
      item, its one large write is the tensor's data record (``torch.save`` writes a storage in one call,
      and the rest of an item is a few hundred bytes), which lets a load find the bytes without parsing.
    - ``fileno()`` flushes first: DCP fsyncs ``stream.fileno()`` before closing the stream, and bytes
      still in a buffer then would miss the fsync.
    """

    _GATHER = 1 << 16  # gathered small writes go out at this size

    def __init__(self, raw: io.IOBase):
        super().__init__()
        self.raw, self.hash, self.n, self.sequential = raw, new_hash(), 0, True
        self.spans: list[tuple[int, int]] = []
        self._kicked = 0
        self._small = bytearray()
        self.error: OSError | None = None  # the first failed write: torch.save reports it as "unexpected pos"

    def _put(self, data) -> int | None:
        try:
            return self.raw.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def writable(self) -> bool:
        return True

    def _drain(self) -> None:
        if self._small:
            self._put(self._small)
            self.hash.update(self._small)
            self._small = bytearray()

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if n <= SPAN_MIN:
            self._small += view
            if len(self._small) >= self._GATHER:
                self._drain()
        else:
            self._drain()
            got = self._put(view)
            if got is not None and got != n:  # a raw (unbuffered) file may write part: the rest follows
                self.hash.update(view[:got])
                self.n += got
                return got
            self.hash.update(view)
            self.spans.append((self.n, n))
        self.n += n
        if self.n - self._kicked >= WRITEBACK_BYTES and self.sequential:
            start_writeback(self.raw.fileno(), self._kicked, self.n - self._kicked)
            self._kicked = self.n
        return n

    def tell(self) -> int:
        """The position, first padded with zeros to a multiple of ``ALIGN`` (64) bytes. DCP asks for it
        exactly before and after writing each item (its offset, then its length), so every item starts
        aligned in the file, and a mapped load's tensors are aligned (the data record inside torch.save's
        archive is itself 64-byte aligned). The padding ends the previous item: readers find the archive's
        end record before it (torch.load, :mod:`workbench.checkpoint.directread`)."""
        if not self.sequential:
            self._drain()
            return self.raw.tell()
        if self.n % ALIGN:
            self.write(bytes(ALIGN - self.n % ALIGN))
        return self.n

    def seek(self, offset: int, whence: int = 0) -> int:
        self._drain()
        pos = self.raw.seek(offset, whence)
        self.sequential = self.sequential and pos == self.n
        return pos

    def fileno(self) -> int:
        self.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        self._drain()
        try:
            self.raw.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes (through self.flush) while the file is still open
            self.raw.close()


class HashingFileSystem(FileSystem):
    """DCP's local filesystem, hashing each file as it is written: ``digests[name] = (bytes, hex)``.

    Set it as a ``FileSystemWriter``'s ``fs``. Renames (DCP writes ``.metadata.tmp`` then renames it) carry
    the digest along. A file written out of order gets no digest.

    A write that fails for lack of room or permission is raised as a
    :class:`~workbench.disk.StorageError` naming it (``doing`` + ``target``, the ``needed`` bytes and
    what is free), not as what torch.save makes of it. Every failure is also kept in ``errors``: DCP
    only prints an exception of its extra writer threads, and :class:`CheckedWriter` raises it.
    """

    def __init__(self, target: Path | None = None, doing: str = "writing", needed: int | None = None) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self.spans: dict[str, list[tuple[int, int]]] = {}
        self.errors: list[BaseException] = []
        self.target, self.doing, self.needed = target, doing, needed
        self.caller: int | None = None  # the thread DCP writes from (the others are its extra writer threads)
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = yielded = None
        try:
            with _no_zip_crc32(), super().create_stream(path, mode) as raw:
                stream = _HashingStream(raw)
                yielded = True
                yield stream
                if stream.sequential:
                    with self._lock:
                        self.digests[Path(path).name] = (stream.n, stream.hash.hexdigest())
                        self.spans[Path(path).name] = stream.spans
        except BaseException as exc:
            if not isinstance(exc, Exception):  # KeyboardInterrupt, GeneratorExit: as they are
                raise
            cause = stream.error if stream is not None and stream.error is not None else exc
            named = storage_error(cause, doing=self.doing, where=self.target or Path(path).parent,
                                  needed=self.needed, fix=ROOM_FIX)
            with self._lock:
                self.errors.append(named or exc)
            if yielded and self.caller not in (None, threading.get_ident()):
                return  # an extra writer thread: kept for CheckedWriter, not printed by the thread's death
            if named is None:
                raise
            raise named from exc

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)
            if Path(path).name in self.spans:
                self.spans[Path(new_path).name] = self.spans.pop(Path(path).name)


class CheckedWriter(FileSystemWriter):
    """DCP's filesystem writer, failing the save when any of its writer threads failed.

    DCP writes a rank's files from ``thread_count`` threads; an exception in one of the extra threads is
    printed and dropped, and the save went on as if whole: with one writer's file on ``/dev/full`` (ENOSPC),
    DCP wrote ``.metadata`` without that file's items and the save went on to its manifest and publish.
    Raised here, inside DCP's write step, the failure reaches every rank as DCP's own errors do.
    """

    def write_data(self, plan, planner):
        fs = self.fs
        if isinstance(fs, HashingFileSystem):
            fs.caller = threading.get_ident()
        fut = super().write_data(plan, planner)
        if isinstance(fs, HashingFileSystem) and fs.errors:
            raise fs.errors[0]
        return fut


@contextmanager
def _no_zip_crc32():
    """``torch.save`` without the zip records' CRC-32, in this thread, while DCP writes a file from it (each
    tensor item is a torch.save archive). The CRC-32 cost 0.17-0.28 s of a 305 MB save here, more than the
    writes' Python overhead, and it is redundant: every file's XXH3-128 goes into the manifest as it is
    written. ``torch.load`` reads such archives as usual (it does not check record CRCs); a generic unzip
    would warn. torch keeps the option per thread, so it is set where each file is written: DCP's own writer
    threads included (until 2026-11-27 it was set on the calling thread only, and DCP's second writer thread
    still computed it: 0.1 s of a 0.22 s save).
    """
    getter = getattr(torch.serialization, "get_crc32_options", None)  # public since torch 2.5
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if getter is None or setter is None:
        yield
        return
    before = getter()
    setter(False)
    try:
        yield
    finally:
        setter(before)
