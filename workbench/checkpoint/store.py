"""Where checkpoints live, and how one becomes visible: atomically, or not at all.

A run's checkpoints are directories under ``<run_dir>/checkpoints/``::

    checkpoints/
      step-000003/            .metadata  __0_0.distcp  __0_1.distcp  __1_0.distcp  __1_1.distcp  workbench.json
                              (__<rank>_<writer thread>.distcp: saver.WRITE_THREADS files per rank)
      step-000006/            ...
      .tmp-step-000009-7f3a/  being written (never read)
      latest                  "step-000006"

Publishing a checkpoint is a sequence of steps whose every prefix leaves a valid store::

    1. every rank writes its shards into .tmp-step-N-<nonce>/ and fsyncs them     (invisible)
    2. rank 0 writes workbench.json (sizes + checksum of every file) LAST, fsyncs it and the dir
    3. rename .tmp-step-N-<nonce>/ -> step-N/, fsync the parent                    (visible, complete)
    4. write latest.tmp-<nonce>, fsync, rename -> latest, fsync the parent         (pointer moves)

A crash between any two steps leaves either the old ``latest`` or the new one, each pointing at a
complete directory. Readers trust a directory only if its ``workbench.json`` parses and every file it
lists has the listed size and checksum (:func:`is_complete`); stale ``.tmp-*`` are removed by the next save.

Checksums are computed on the bytes as DCP writes them (``saver.HashingFileSystem``), never by reading the
files back, with xxHash's XXH3-128 (4-5x sha256's speed on one core here, and it releases the GIL). Each file
entry names its algorithm: ``{"bytes": n, "xxh3_128": hex}``; checkpoints saved before it carry
``{"bytes": n, "sha256": hex}`` and still verify. It is a checksum against damage (torn writes, bit rot,
truncation), not a signature against tampering.

Rotation keeps the newest ``keep`` checkpoints, every ``keep_every``-th step forever, and whatever
``latest`` points at.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["MANIFEST", "LATEST", "OWNER", "CHECKSUM", "CheckpointStore", "step_name", "parse_step", "is_complete",
           "read_manifest", "file_digest", "recorded_digest", "new_hash", "fsync_dir", "resolve_checkpoint",
           "BackgroundVerify", "start_writeback"]

MANIFEST = "workbench.json"
LATEST = "latest"
OWNER = "owner.json"  # which run writes this checkpoints directory (workbench.train.rundir)
_OWNER_MAX = 64 << 10
FORMAT = "workbench-checkpoint"
VERSION = 1
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_CHUNK = 8 << 20
_MAPPED_CHUNK = 256 << 20
CHECKSUM = "xxh3_128"  # what saves record; "sha256" is what older saves recorded
_HASHERS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def _find_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none (then writeback starts at fsync)."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError, ImportError):
        return None


_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to the disk now, without waiting.

    Linux otherwise keeps a save's dirty pages in memory until the closing fsync, which then waits for
    all of them: the disk sits idle while the bytes are produced, then the CPU waits while the disk
    works. Started every few MiB as the file is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, what
    RocksDB's ``bytes_per_sync`` does), the flush overlaps the writing and the fsync finds little left.
    It changes nothing about durability: the fsync still decides. False (nothing done) where the call
    does not exist or fails (not Linux, a filesystem without it)."""
    if _sync_file_range is None or nbytes <= 0:
        return False
    return _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


def step_name(step: int) -> str:
    """``step-000123``: six digits, zero-padded (more if the step needs them)."""
    return f"step-{step:06d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (creates, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: str | Path, fsync: bool = False, algo: str = "sha256") -> tuple[int, str]:
    """(bytes, hex digest) of a file, read in 8 MiB chunks; optionally fsync it while it is open.

    ``algo``: "sha256" or "xxh3_128" (:data:`CHECKSUM`, what saves record).
    """
    from workbench.safeio import open_regular

    with open_regular(path, "checkpoint file") as f:  # a FIFO or device swapped in is refused, not read forever
        size = os.fstat(f.fileno()).st_size
        if size and not fsync:
            # Hash the page cache's pages in place (no copy into Python bytes): half the memory traffic,
            # which matters when it runs beside a load reading the same files. The hashers release the GIL.
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
                return buffer_digest(mm, algo)
        h, n = _HASHERS[algo](), 0
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return n, h.hexdigest()


def new_hash(algo: str = CHECKSUM):
    """A fresh hash object (``update(bytes)``, ``hexdigest()``) of ``algo``."""
    return _HASHERS[algo]()


def recorded_digest(entry: dict[str, Any]) -> tuple[str, str] | None:
    """``(algorithm, hex)`` of a manifest file entry (xxh3_128, or sha256 in older saves); None if it has none."""
    for algo in _HASHERS:
        if isinstance(entry.get(algo), str):
            return algo, entry[algo]
    return None


def write_durable(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, rename: readers see old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    """The parsed ``workbench.json`` of a checkpoint directory; ValueError naming what is wrong.

    Read only from inside the directory (not through a link out of it), as a regular file of at most
    ``safeio.MANIFEST_MAX`` bytes of UTF-8 JSON."""
    from workbench import safeio
    from workbench.checkpoint.safeload import CheckpointFormatError

    try:
        p = safeio.confine(ckpt_dir, MANIFEST, what="manifest", error=CheckpointFormatError)
        doc = safeio.read_json(p, safeio.MANIFEST_MAX, "checkpoint manifest", error=CheckpointFormatError,
                               fix="the checkpoint is damaged; restore it or use another step")
    except CheckpointFormatError as e:
        if e.reason == "missing":
            raise ValueError(f"{ckpt_dir}: no {MANIFEST}; the checkpoint is incomplete (its save was interrupted)") from None
        raise
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{p}: not a workbench checkpoint manifest "
                         f"(format={str(doc.get('format'))[:40] if isinstance(doc, dict) else None!r})")
    return doc


# A load's checksum threads run at this nice: they then leave the cores to the loading thread while it
# has work (its Python, which they would otherwise preempt), and it joins the hashing once it has none.
# A mapped load of 305 MB + touch, 12 interleaved runs (2026-11-27): 43.8 ms at +10, 50.0 ms at 0.
_NICE = 10
_HASH_THREADS = 2  # files hashed at once when verifying (2 cores here; more only contend)


def buffer_digest(buf, algo: str = CHECKSUM) -> tuple[int, str]:
    """(bytes, hex digest) of a buffer (a mapped file), hashed in place in 8 MiB steps."""
    h = _HASHERS[algo]()
    # No MADV_POPULATE_READ first: mmap.madvise holds the GIL for the whole call (3 ms per 97 MiB file here),
    # which stalled the loading thread while the checksum thread populated; the hasher's own reads fault the
    # pages in with the GIL released. Resume of 305 MiB + touch, 6 runs each (2026-12-07, quiet 2 cores):
    # 51 ms with the madvise, 40 ms without.
    view = memoryview(buf).cast("B")
    try:
        # In _MAPPED_CHUNK steps: each update releases the GIL once for its whole length, so a hashing thread
        # is not left waiting for the GIL each 8 MiB while a load's thread runs Python. 12 interleaved mapped
        # loads + touch (2026-11-27): 1.34x safetensors with 256 MiB steps, 1.53x with 8 MiB steps.
        for i in range(0, len(view), _MAPPED_CHUNK):
            h.update(view[i:i + _MAPPED_CHUNK])
    finally:
        view.release()
    return len(buf), h.hexdigest()


def _listing(ckpt_dir: str | Path, verify_checksums: bool, manifest: dict | None
             ) -> tuple[str | None, list[tuple[Path, int, tuple[str, str]]]]:
    """(problem, files to hash): the manifest parses and every file it lists exists with its size."""
    try:
        doc = read_manifest(ckpt_dir) if manifest is None else manifest
    except ValueError as e:
        return str(e), []
    from workbench import safeio

    files = doc.get("files") or {}
    if not isinstance(files, dict) or ".metadata" not in files:
        return f"{ckpt_dir}: manifest lists no .metadata", []
    todo = []
    for name, info in files.items():
        try:  # a name inside the directory (no ../, no absolute path, no link out), a regular file
            p = safeio.confine(ckpt_dir, name, Path(ckpt_dir) / MANIFEST, "checkpoint file")
            size = safeio.regular_size(p, "checkpoint file")
        except safeio.FileRefused as e:
            return (f"{Path(ckpt_dir) / name}: missing" if e.reason == "missing" else str(e)), []
        if not isinstance(info, dict) or type(info.get("bytes")) is not int:
            return f"{p}: the manifest's entry for it has no size", []
        if size != info["bytes"]:
            return f"{p}: {size} bytes, manifest says {info['bytes']}", []
        if verify_checksums:
            recorded = recorded_digest(info)
            if recorded is None:
                return f"{p}: the manifest records no checksum for it", []
            todo.append((p, size, recorded))
    todo.sort(key=lambda t: -t[1])  # largest first: whoever is free last takes a small one
    return None, todo


def _lowered(fn):
    """``fn`` run at :data:`_NICE` more than this thread's nice (Linux: per thread; elsewhere as it is). Only for
    threads that end with it: an unprivileged thread cannot raise its priority back."""
    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + _NICE, 19))
        except (OSError, AttributeError):
            pass
        fn()
    return run


class _HashJob:
    """Files to hash, taken one at a time by whichever thread is free (the hashers release the GIL, so a
    rank's files, one per writer thread, hash side by side; a load's own thread joins in once it has
    nothing else to do). ``mapped``: file name -> a mapping of it, hashed in place of the file."""

    def __init__(self, todo: list, mapped: dict[str, Any] | None = None):
        self.todo, self.mapped = todo, mapped or {}
        self.results: list[str | None] = [None] * len(todo)
        self._next, self._lock = 0, threading.Lock()

    def work(self) -> None:
        while True:
            with self._lock:
                i = self._next
                if i >= len(self.todo):
                    return
                self._next += 1
            p, _, (algo, digest) = self.todo[i]
            buf = self.mapped.get(p.name)
            try:
                got = buffer_digest(buf, algo) if buf is not None else file_digest(p, algo=algo)
            except OSError as e:
                self.results[i] = f"{p}: cannot be read ({type(e).__name__}: {e})"
                continue
            except Exception as e:  # noqa: BLE001 - never a file left unhashed (and so counted intact)
                self.results[i] = f"{p}: cannot be verified ({type(e).__name__}: {e})"
                continue
            if got[1] != digest:
                self.results[i] = f"{p}: {algo} differs from the manifest; the file is damaged"

    def run(self, threads: int) -> None:
        """Hash everything with ``threads`` threads, this one included."""
        extra = [threading.Thread(target=self.work, name="checkpoint-hash", daemon=True)
                 for _ in range(min(threads, len(self.todo)) - 1)]
        for t in extra:
            t.start()
        self.work()
        for t in extra:
            t.join()

    def problem(self) -> str | None:
        return next((r for r in self.results if r is not None), None)


def is_complete(ckpt_dir: str | Path, verify_checksums: bool = True, *, manifest: dict | None = None,
                mapped: dict[str, Any] | None = None) -> tuple[bool, str]:
    """(ok, reason): the manifest parses and every file it lists exists with its size (and checksum).

    ``manifest``: the already parsed manifest. ``mapped``: file name -> a mapping of that file, hashed
    instead of opening the file again; a mapped load passes the mappings its tensors point into, so
    hashing also brings their pages into the process (the first read of the tensors then faults nothing).
    """
    why, todo = _listing(ckpt_dir, verify_checksums, manifest)
    if why is not None:
        return False, why
    job = _HashJob(todo, mapped)
    job.run(_HASH_THREADS)
    bad = job.problem()
    return (False, bad) if bad else (True, "ok")


class BackgroundVerify:
    """:func:`is_complete` with checksums, on threads: start it, read the checkpoint, then ``result()``.

    Reading and hashing the same files overlap (both release the GIL; the second reader hits the page
    cache), so a verified load costs about what an unverified one does. The listing (sizes, confinement)
    runs on the caller's thread, and the hashing threads start straight into their first file: a thread
    that still had Python to run waited for the GIL while the load's thread ran its own Python, and began
    hashing 11-16 ms late in a 25 ms load (2026-12-07). ``result()`` hashes whatever file no thread has
    started yet before it waits: the caller has nothing else to do by then.
    """

    def __init__(self, ckpt_dir: str | Path, *, manifest: dict | None = None, mapped: dict[str, Any] | None = None):
        self.dir, self._why = Path(ckpt_dir), None
        self._job: _HashJob | None = None
        self._threads: list[threading.Thread] = []
        try:
            why, todo = _listing(self.dir, True, manifest)
        except Exception as e:  # noqa: BLE001 - unreadable: a problem to report, as result() reports it
            why, todo = f"{self.dir}: cannot be verified ({type(e).__name__}: {e})", []
        if why is not None:
            self._why = why
            return
        self._job = _HashJob(todo, mapped)
        self._threads = [threading.Thread(target=_lowered(self._job.work), name="checkpoint-hash", daemon=True)
                         for _ in range(min(_HASH_THREADS, len(todo)))]
        for t in self._threads:
            t.start()

    def result(self) -> str | None:
        """None if every file matches the manifest, else the first problem (one line)."""
        if self._job is not None:
            self._job.work()
        for t in self._threads:
            t.join()
        if self._why is None and self._job is not None:  # every file is hashed now, by whichever thread
            self._why = self._job.problem()
        return self._why


@dataclass
class CheckpointStore:
    """The ``checkpoints/`` directory of one run: naming, publishing, ``latest``, rotation."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    # -- names ---------------------------------------------------------------------------------
    def path(self, step: int) -> Path:
        return self.root / step_name(step)

    def tmp_path(self, step: int, nonce: str) -> Path:
        return self.root / f".tmp-{step_name(step)}-{nonce}"

    def steps(self) -> list[int]:
        """Steps of the published directories (complete or not), ascending."""
        if not self.root.is_dir():
            return []
        from workbench.safeio import is_within

        # a step directory linked out of the store is not one of its checkpoints (nothing follows it)
        real = os.path.realpath(self.root)
        out = [parse_step(p.name) for p in self.root.iterdir()
               if p.is_dir() and (not p.is_symlink() or is_within(os.path.realpath(p), real))]
        return sorted(s for s in out if s is not None)

    def latest_pointer(self) -> str | None:
        """The name ``latest`` holds, or None where there is no readable pointer (no file, not UTF-8 text, not
        a regular file of at most a few KiB, or a link out of the directory: nothing else is read)."""
        from workbench import safeio

        try:
            data = safeio.read_bounded(safeio.confine(self.root, LATEST, what="pointer"), safeio.POINTER_MAX,
                                       "latest pointer")
            return data.decode("utf-8").strip() or None
        except (safeio.FileRefused, UnicodeDecodeError):
            return None

    def latest(self, verify_checksums: bool = True) -> Path | None:
        """The newest complete checkpoint: ``latest`` if it is complete, else the newest complete step dir."""
        name = self.latest_pointer()
        steps = self.steps()  # the step directories inside the store (none linked out of it)
        if name and parse_step(name) in steps and is_complete(self.root / name, verify_checksums)[0]:
            return self.root / name
        for step in reversed(steps):
            if is_complete(self.path(step), verify_checksums)[0]:
                return self.path(step)
        return None

    def newest_any(self) -> Path | None:
        """What the inspection tools open: the step ``latest`` names (complete or not), else the newest
        step directory with a ``.metadata``, complete ones (with a manifest) first."""
        name = self.latest_pointer()
        if name:
            from workbench import safeio
            from workbench.checkpoint.safeload import CheckpointFormatError  # a ValueError too

            if parse_step(name) is None:  # what saves write; anything else (../x, /x) is not followed
                raise CheckpointFormatError(self.root / LATEST, f"holds {name[:80]!r}, not a step-NNNNNN name",
                                            "pass one of the step-* directories next to it")
            target = safeio.confine(self.root, name, self.root / LATEST, "step directory", error=CheckpointFormatError)
            if not target.is_dir():
                raise CheckpointFormatError(self.root / LATEST, f"points at {name!r}, which does not exist",
                                            "pass one of the step-* directories next to it")
            return target
        steps = [self.path(s) for s in self.steps() if (self.path(s) / ".metadata").exists()]
        complete = [d for d in steps if (d / MANIFEST).exists()]
        return (complete or steps or [None])[-1]

    # -- the run that writes here -------------------------------------------------------------
    def owner(self) -> dict[str, Any] | None:
        """The run that owns this directory (:data:`OWNER`: ``run_id``, ``run_dir``, ``claimed``), or None
        where no run has claimed it. A marker that cannot be read is returned as ``{"unreadable": why}``:
        whoever wrote it is unknown, so it is nobody's to take."""
        p = self.root / OWNER
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            return {"unreadable": f"{type(e).__name__}: {e.strerror}"}
        if not p.is_file() or st.st_size > _OWNER_MAX:  # a few hundred bytes when we write it
            return {"unreadable": "not a small regular file"}
        try:
            doc = json.loads(p.read_bytes())
        except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
            return {"unreadable": type(e).__name__}
        if not isinstance(doc, dict) or not isinstance(doc.get("run_id"), str):
            return {"unreadable": "no run_id"}
        return doc

    def claim(self, doc: dict[str, Any], exclusive: bool) -> dict[str, Any] | None:
        """Write the owner marker (creating the directory). ``exclusive``: only if there is none yet, as one
        atomic link of a complete file; returns the marker found instead when another run claimed the
        directory first (None: ``doc`` is the marker now)."""
        self.root.mkdir(parents=True, exist_ok=True)
        data = json.dumps(doc, indent=2).encode()
        if not exclusive:
            write_durable(self.root / OWNER, data)
            return None
        tmp = self.root / f"{OWNER}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.root / OWNER)  # fails if a marker exists: two launches cannot both claim
        except FileExistsError:
            return self.owner()
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.root)
        return None

    def check_owner(self, run_id: str | None) -> None:
        """Before publishing: this directory still belongs to ``run_id`` (None: no check). A marker naming
        another run means another run took it over (``--adopt-ckpt-dir``) while this one was running."""
        if run_id is None:
            return
        owner = self.owner()
        if owner is not None and owner.get("run_id") != run_id:
            theirs = owner.get("run_dir") or owner.get("unreadable")
            raise ValueError(f"{self.root} now belongs to another run ({theirs}, {OWNER}); this run stops saving "
                             "there rather than mix its checkpoints with that run's: resume it with a --ckpt-dir "
                             "of its own")

    # -- writing (rank 0) ----------------------------------------------------------------------
    def clean_stale(self, keep_tmp: str | None = None) -> list[str]:
        """Remove ``.tmp-*`` directories and ``latest.tmp-*`` files left by interrupted saves."""
        removed = []
        if not self.root.is_dir():
            return removed
        for p in self.root.iterdir():
            if p.name == keep_tmp:
                continue
            if p.name.startswith(".tmp-") or p.name.startswith(".trash-") or p.name.startswith(f"{LATEST}.tmp-"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
        return removed

    def publish(self, tmp: Path, step: int, manifest: dict[str, Any]) -> Path:
        """Steps 2-4 of the module docstring: manifest last, rename, then move ``latest``."""
        data = json.dumps(manifest, indent=2).encode()
        with open(tmp / MANIFEST, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = self.path(step)
        if final.exists():  # re-saving a step (a resumed run passing it again): swap, then drop the old
            trash = self.root / f".trash-{final.name}-{os.getpid()}"
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(self.root)
        write_durable(self.root / LATEST, (final.name + "\n").encode())
        return final

    def rotate(self, keep: int | None, keep_every: int = 0) -> list[int]:
        """Delete published checkpoints beyond the newest ``keep`` (except every ``keep_every``-th and latest)."""
        if not keep:
            return []
        steps = self.steps()
        pinned = set(steps[-keep:])
        if keep_every:
            pinned |= {s for s in steps if s % keep_every == 0}
        latest = self.latest_pointer()
        if latest and parse_step(latest) is not None:
            pinned.add(parse_step(latest))
        removed = []
        for s in steps:
            if s not in pinned:
                # Rename first so a half-deleted directory is never mistaken for a checkpoint.
                trash = self.root / f".trash-{step_name(s)}-{os.getpid()}"
                os.replace(self.path(s), trash)
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(s)
        return removed


def resolve_checkpoint(spec: str | Path, default_root: str | Path | None = None,
                       verify_checksums: bool = True, *, complete: bool = True) -> Path:
    """A checkpoint directory from ``"latest"``, a step dir, a ``checkpoints/`` dir, its ``latest`` file,
    or a run dir. The one walk from what a user names to a step directory; every tool uses it.

    ``complete=True`` (resume, load): only a complete checkpoint is returned, the one ``latest`` names if it
    is complete, else the newest complete step (sizes, and checksums if ``verify_checksums``).
    ``complete=False`` (inspect, verify, diff: they must show a damaged checkpoint, not skip it): the step
    ``latest`` names, else the newest step directory holding a ``.metadata``, complete ones first.
    Raises one-line ValueErrors: nothing there, or (complete=True) the named checkpoint is incomplete.
    """
    spec = str(spec)
    if spec == "latest":
        if default_root is None:
            raise ValueError("resume='latest' needs a checkpoint directory; pass --ckpt-dir or a path")
        root = Path(default_root)
    else:
        root = Path(spec)
    if root.is_file() and root.name == LATEST:  # the pointer file itself: resolve it in its directory
        root = root.parent
    elif root.exists() and not root.is_dir():
        raise ValueError(f"{root} is a file, not a checkpoint; pass a run directory, its checkpoints/ "
                         "directory, a step-NNNNNN directory or its latest file")
    if (root / MANIFEST).exists() or (root / ".metadata").exists():  # a checkpoint directory itself
        if complete:
            if not (root / MANIFEST).exists() and parse_step(root.name) is None and (root / ".metadata").is_file():
                # not a step directory a run saves (and a save can leave incomplete), but plain DCP, e.g.
                # `ckpt convert HF_DIR OUT --to dcp`: model weights only, nothing a resume restores
                raise ValueError(f"cannot resume from {root}: plain DCP without {MANIFEST} (e.g. `ckpt convert "
                                 "--to dcp` output) holds weights only, no optimizer state, step or RNG to resume; "
                                 "to start training from Hugging Face weights pass their directory with "
                                 "--init-from HF_DIR")
            ok, why = is_complete(root, verify_checksums)
            if not ok:
                raise ValueError(f"cannot resume from {root}: {why}; pick another step directory")
        return root
    for cand in (root, root / "checkpoints"):
        store = CheckpointStore(cand)
        if not (store.latest_pointer() or store.steps()):
            continue
        found = store.latest(verify_checksums) if complete else store.newest_any()
        if found is not None:
            return found
        raise ValueError(f"no complete checkpoint in {cand}; every step directory there is incomplete")
    raise ValueError(f"no checkpoint found at {root}; pass a run directory, its checkpoints/ directory, "
                     "or a step-NNNNNN directory")
