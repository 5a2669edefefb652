"""Where an export goes: never onto its source, never over what is not ours, never half-written.

``ckpt convert SRC DST --force`` used to delete DST first and then read SRC: with DST the run directory,
the run was gone; with DST the source file, the source. An :class:`ExportDestination` checks DST before any
tensor is read or written, and writes the export under a temporary name beside it:

* DST that is SRC, contains it or lies inside it (both resolved, symbolic links included) is refused,
  with or without ``--force``.
* An existing DST is replaced only with ``--force`` (``overwrite=True``), and only if it is a regular
  file, an empty directory, or an export of ours: a directory holding :data:`MARKER` (written into every
  directory export) and nothing the export did not write, or an HF export written before the marker
  (every file one of ours, its index saying ``workbench-export``). Anything else is refused in one line
  that says how to go on.
* The export is written into ``.<name>.tmp-<pid>-<hex>`` beside DST, fsynced, and swapped into place in one
  rename (``renameat2(RENAME_EXCHANGE)`` where the kernel has it; else two renames, the old DST kept
  under ``.<name>.old-...`` between them). A failed or killed convert leaves the old DST as it was and no
  partial DST; the next convert to the same DST removes a dead process's temporaries.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

__all__ = ["ExportDestination", "MARKER"]

MARKER = ".workbench-export.json"  # in every directory export: what wrote it, and which files
_MARKER_MAX = 4 << 20  # bytes: the marker lists file names; a larger one is not ours
_HF_NAME = re.compile(r"^[a-z]+(-\d{5}-of-\d{5}\.safetensors|\.safetensors\.index\.json)$")
_TEMP = re.compile(r"^\.(?P<name>.+)\.(tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}(\.tmp)?$")  # (.tmp: a file's own)


class ExportDestination:
    """DST of one export, checked on construction (nothing is written then).

    ``sources``: the paths the export reads (the SRC as given and the checkpoint it resolved to);
    ``overwrite``: ``--force``; ``is_dir``: the export is a directory (hf, dcp) rather than one file.
    Use :meth:`writing` to get the temporary path to write to, then :meth:`commit` inside it.
    """

    def __init__(self, dst: str | os.PathLike, sources: Iterable[str | os.PathLike], *, overwrite: bool, is_dir: bool):
        self.path = Path(dst)
        self.overwrite, self.is_dir = overwrite, is_dir
        try:
            # DST named through a link is the link's target: that is what would be replaced
            self.real = self.path.resolve()
            self._sources = [Path(s).resolve() for s in sources]
        except (OSError, RuntimeError) as e:  # a symlink loop
            raise ValueError(f"{dst}: cannot be resolved ({e}); choose another destination") from None
        self._check_not_source()
        self._existed = os.path.lexists(self.real)
        if self._existed:
            self._check_replaceable()

    # -- checks ------------------------------------------------------------------------------------
    def _check_not_source(self) -> None:
        for src in self._sources:
            if self.real == src:
                how = "is the source checkpoint"
            elif src.is_relative_to(self.real):
                how = f"contains the source checkpoint ({src})"
            elif self.real.is_relative_to(src):
                how = f"lies inside the source checkpoint ({src})"
            else:
                continue
            via = f" (it resolves to {self.real})" if self.real != Path(os.path.abspath(self.path)) else ""
            raise ValueError(f"destination {self.path}{via} {how}; writing there would destroy what is being "
                             "read: choose a destination outside the source")

    def _check_replaceable(self) -> None:
        dst = self.path
        if not self.overwrite:
            raise FileExistsError(f"{dst} already exists; choose another destination or pass overwrite=True (--force)")
        st = os.lstat(self.real)
        if stat.S_ISREG(st.st_mode):
            return
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{dst} is neither a regular file nor a directory; --force replaces only those: "
                             "choose another destination")
        entries = sorted(os.listdir(self.real))
        if not entries:
            return
        why = _not_our_export(self.real, entries)
        if why is not None:
            raise ValueError(f"{dst} is a directory that is not an export of ours ({why}); --force replaces only "
                             f"exports written by `workbench ckpt convert` (marked by {MARKER}) and empty "
                             "directories: delete it yourself if you mean to, or choose another destination")

    # -- writing -----------------------------------------------------------------------------------
    @contextmanager
    def writing(self) -> Iterator[Path]:
        """The temporary path (a directory for directory exports) to write the export to, beside DST. It is
        removed if the block raises; call :meth:`commit` inside the block to put it in place."""
        parent = self.real.parent
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(parent, self.real.name)
        tmp = parent / f".{self.real.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if self.is_dir:
            tmp.mkdir()
        self._tmp = tmp
        try:
            yield tmp
        except BaseException:
            _remove(tmp)
            _remove(tmp.with_name(tmp.name + ".tmp"))  # a file writer's own temporary (write_safetensors_streaming)
            raise

    def commit(self, to: str, source: str, files: list[str]) -> None:
        """Mark (directory exports), make durable, and swap the temporary export into DST's place."""
        tmp = self._tmp
        if self.is_dir:
            doc = {"format": "workbench-export", "to": to, "source": source, "files": sorted(files),
                   "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
            (tmp / MARKER).write_text(json.dumps(doc, indent=2))
        _fsync_tree(tmp)
        # DST may have appeared or changed while the export was written: the same rules, again
        self._existed = os.path.lexists(self.real)
        if self._existed:
            self._check_replaceable()
        _swap_into_place(tmp, self.real, self._existed)


# -- helpers ---------------------------------------------------------------------------------------


def _not_our_export(d: Path, entries: list[str]) -> str | None:
    """None if directory ``d`` (holding ``entries``) is an export of ours, else why not, in a few words."""
    if MARKER in entries:
        doc = _small_json(d / MARKER)
        ours = isinstance(doc, dict) and doc.get("format") == "workbench-export"
        if not ours or not isinstance(doc.get("files"), list):
            return f"its {MARKER} is not one we wrote"
        extra = [e for e in entries if e != MARKER and e not in doc["files"]]
        if extra:
            return f"it also holds {_few(extra)}, which the export did not write"
        return None
    # An HF export written before exports were marked: only our file names, and an index that says so.
    foreign = [e for e in entries if e != "config.json" and not _HF_NAME.match(e)]
    if foreign:
        return f"it holds {_few(foreign)}"
    indexes = [e for e in entries if e.endswith(".index.json")]
    docs = [_small_json(d / e) for e in indexes]
    if not docs or not all(isinstance(doc, dict) and isinstance(doc.get("metadata"), dict)
                           and doc["metadata"].get("format") == "workbench-export" for doc in docs):
        return f"it holds {_few(entries)} and no {MARKER}"
    return None


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _small_json(p: Path):
    """A small regular file's JSON (not followed through a link), or None."""
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MARKER_MAX:
            return None
        with open(p, "rb") as f:
            return json.loads(f.read(_MARKER_MAX + 1))
    except (OSError, ValueError):
        return None


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _remove_stale(parent: Path, name: str) -> None:
    """Temporaries of DST ``name`` left by converts that were killed (their process is gone)."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        m = _TEMP.match(entry)
        if m is None or m.group("name") != name:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # still running (or not ours to signal): leave it
        except ProcessLookupError:
            _remove(parent / entry)
        except (PermissionError, OverflowError):
            continue


def _fsync_tree(p: Path) -> None:
    """Every file of the export, then its directory, on disk before it takes DST's place."""
    paths = [p] if not p.is_dir() else [q for q in p.rglob("*") if q.is_file()]
    for q in paths:
        with open(q, "rb") as f:
            os.fsync(f.fileno())
    if p.is_dir():
        _fsync_dir(p)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _find_renameat2():
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError, ImportError):
        return None


_renameat2 = _find_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux 3.15+); False where the kernel or file system cannot."""
    if _renameat2 is None:
        return False
    return _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _swap_into_place(tmp: Path, dst: Path, existed: bool) -> None:
    if not existed:
        os.rename(tmp, dst)
    elif _exchange(tmp, dst):
        _remove(tmp)  # tmp now holds the old DST
    else:  # two renames: between them the old DST is whole under its .old- name (removed as stale later)
        old = dst.parent / f".{dst.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        _remove(old)
    _fsync_dir(dst.parent)
