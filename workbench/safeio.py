"""Opening a file that another file names: inside the directory that named it, regular, of a plausible size.

A checkpoint is a directory of files that name each other: an HF ``*.safetensors.index.json`` names its
shards, a DCP ``.metadata`` names its ``.distcp`` files, ``workbench.json`` lists the files it checksums,
``latest`` names a step directory, a run directory holds ``events.jsonl`` and ``config.json``. Any of them
may be hostile (downloaded, uploaded to a Jupyter server, tampered with). Every reader opens such a name
through this module, in this order::

    name  --check_name-->  relative, no "..", no NUL, a name a file can have (encodable, not too long)
                           (before anything touches the filesystem)
          --confine----->  base/name, its links resolved, still inside base (and inside the server's root)
          --open_regular-> stat: a regular file no larger than the bound for its kind, then
                           open(O_NONBLOCK): a FIFO or a device is refused before it can block or stream

so an index naming ``/etc/shadow``, ``../x`` or a FIFO, and a ``.metadata`` linked to ``/dev/zero`` or to a
50 GB file, are each refused in one line before a byte is read. Errors name the file and the bound, and
never echo the bytes of a file that failed a check. Whether a name is refused never depends on what
exists outside the directory: names are refused by their text, links by where they point.

In the Jupyter server every answer runs inside :func:`confined_to` ``(root)``: every open through this
module is then also refused when the file resolves outside the server's root, whatever named it.

Errors are :class:`FileRefused` (a ValueError) with ``file``, ``problem``, ``fix`` and ``reason``
(``outside``, ``missing``, ``special``, ``too-large``, ``unreadable``, ``format``); readers pass their own
subclass as ``error=`` (the checkpoint readers: ``CheckpointFormatError``).
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from workbench.units import format_bytes

__all__ = ["FileRefused", "check_name", "confine", "confined_to", "current_root", "is_within", "open_regular",
           "read_bounded", "read_json", "regular_size", "METADATA_MAX", "INDEX_MAX", "MANIFEST_MAX", "POINTER_MAX",
           "CONFIG_MAX", "SAFETENSORS_HEADER_MAX", "NAME_MAX", "PATH_MAX"]

# Plausible sizes, each with the reason it is generous enough for a real file of that kind.
# DCP writes ~250 bytes of .metadata per stored chunk: 1 GiB is ~4M chunks, above a 70B model's weights and
# Adam moments sharded over 1024 ranks (~2.5M chunks).
METADATA_MAX = 1 << 30
# An HF index holds ~80 bytes per tensor: 64 MiB is ~800k tensors (DeepSeek-V3's has ~92k).
INDEX_MAX = 64 << 20
# workbench.json: per file its size, checksum and write spans (~20 bytes per tensor chunk), plus the job.
MANIFEST_MAX = 256 << 20
POINTER_MAX = 4096  # `latest`: one directory name
CONFIG_MAX = 16 << 20  # a run's or a model's config.json
SAFETENSORS_HEADER_MAX = 100 << 20  # the safetensors library's own limit
# Linux's limits on a file name (one component) and a whole path, in bytes: a name past them cannot be opened.
NAME_MAX = 255
PATH_MAX = 4096

_ROOT: contextvars.ContextVar[str | None] = contextvars.ContextVar("workbench_safeio_root", default=None)


class FileRefused(ValueError):
    """A file that will not be read: ``<file>: <problem>; <fix>``, one line. ``reason`` says why, for
    callers that answer differently (the server sends ``missing`` and ``outside`` as the same 404)."""

    def __init__(self, file: str | os.PathLike, problem: str, fix: str, reason: str = "format"):
        self.file, self.problem, self.fix, self.reason = str(file), problem, fix, reason
        super().__init__(" ".join(f"{file}: {problem}; {fix}".split()))


# --------------------------------------------------------------------------------------------------
# where a name leads
# --------------------------------------------------------------------------------------------------

def _a(what: str) -> str:
    """``what`` with its indefinite article: "an index", "a file"."""
    if what.startswith(("a ", "an ", "the ")):
        return what
    return ("an " if what[:1].lower() in "aeio" else "a ") + what


def is_within(path: str | os.PathLike, base: str | os.PathLike) -> bool:
    """Whether ``path`` is ``base`` or below it, both taken as they are (resolve them first)."""
    path, base = os.fspath(path), os.fspath(base).rstrip(os.sep) or os.sep
    return path == base or path.startswith(base if base == os.sep else base + os.sep)


@contextlib.contextmanager
def confined_to(root: str | os.PathLike) -> Iterator[None]:
    """Within this block (this thread or task), every open through this module must resolve inside ``root``."""
    token = _ROOT.set(os.path.realpath(root))
    try:
        yield
    finally:
        _ROOT.reset(token)


def current_root() -> str | None:
    """The root set by :func:`confined_to`, resolved, or None outside one."""
    return _ROOT.get()


def _outside_root(path: str | os.PathLike) -> bool:
    root = _ROOT.get()
    return root is not None and not is_within(os.path.realpath(path), root)


def check_name(name: Any, named_by: str | os.PathLike, what: str = "file", *, error: type[FileRefused] = FileRefused,
               fix: str | None = None) -> str:
    """``name`` as a plain relative path, or ``error`` (reason ``outside``): not a string, empty, with a NUL,
    absolute, with a ``..`` component, not encodable in the filesystem's encoding (a lone surrogate), or longer
    than a file name (``NAME_MAX`` bytes a component, ``PATH_MAX`` in all). Decided by the text alone, before
    the filesystem is asked."""
    fix = fix or (f"{Path(named_by).name} must name its files relative to its own directory; it was tampered with "
                  "or written by another tool: do not read it")
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(named_by, f"names {_a(what)} that is not a file name ({type(name).__name__})", fix, reason="outside")
    parts = name.replace("\\", "/").split("/")  # (a backslash is refused as a separator too: "..\\x")
    if name.startswith(("/", "\\")) or ".." in parts:
        raise error(named_by, f"names {what} {name[:200]!r}, a path outside its directory", fix, reason="outside")
    # A name the filesystem cannot take would fail later, inside open() or stat(), as UnicodeEncodeError or
    # ENAMETOOLONG naming nothing: refused here by its text, the same way as a name leading outside.
    try:
        raw = os.fsencode(name)  # a lone surrogate ("\ud800") has no bytes in the filesystem's encoding
    except UnicodeEncodeError:
        raise error(named_by, f"names {_a(what)} {name[:200]!r} that no file can have (not encodable as "
                    f"{sys.getfilesystemencoding()})", fix, reason="outside") from None
    if len(raw) >= PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise error(named_by, f"names {_a(what)} {name[:60]!r}... of {len(raw):,} bytes, longer than a file name can "
                    f"be ({NAME_MAX} bytes a component, {PATH_MAX - 1} in all)", fix, reason="outside")
    return name


def confine(base: str | os.PathLike, name: Any, named_by: str | os.PathLike | None = None, what: str = "file", *,
            error: type[FileRefused] = FileRefused, fix: str | None = None) -> Path:
    """``base / name`` once it is known to stay inside ``base``: the name passes :func:`check_name`, and with
    its symbolic links resolved it still lies inside ``base`` (and inside the :func:`confined_to` root).

    Existence is not checked (the caller says what a missing file means). ``named_by``: the file that holds
    the name (default ``base``), for the message."""
    named_by = base if named_by is None else named_by
    name = check_name(name, named_by, what, error=error, fix=fix)
    path = Path(base) / name
    if len(os.fsencode(path)) >= PATH_MAX:  # a short name below a deep directory: too long for open() as well
        raise error(named_by, f"names {_a(what)} whose path below {Path(base).name or base}/ is longer than a path can "
                    f"be ({PATH_MAX - 1} bytes)", fix or "move the checkpoint to a shorter path", reason="outside")
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if not (is_within(real, real_base) or _hub_blob(real, real_base)) or _outside_root(real):
        where = "the server's root" if _outside_root(real) else f"{Path(base).name or base}/"
        raise error(path, f"named by {Path(named_by).name} as {_a(what)}, leads outside {where} through a symbolic link",
                    fix or "copy the file into the directory (cp -L) instead of linking to it", reason="outside")
    return path


def _hub_blob(real: str, real_base: str) -> bool:
    """Whether ``real`` is a blob of the Hugging Face cache repository whose snapshot ``real_base`` is.

    ``huggingface_hub`` stores ``models--org--name/snapshots/<rev>/<file>`` as a link to
    ``models--org--name/blobs/<hash>``: the one layout where a checkpoint's own files live beside its
    directory. Only a plain file directly in that repository's ``blobs/`` qualifies, so a link still
    cannot reach anything the cache did not download."""
    snapshots = os.path.dirname(real_base)
    if os.path.basename(snapshots) != "snapshots":
        return False
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return os.path.dirname(real) == blobs and os.path.isdir(blobs)


# --------------------------------------------------------------------------------------------------
# opening
# --------------------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


def _check_stat(path, st: os.stat_result, limit: int | None, what: str, error, fix: str | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise error(path, f"is {_kind(st.st_mode)}, not a regular file; {_a(what)} is read only from a regular file",
                    fix or "replace it with the file itself", reason="special")
    if limit is not None and st.st_size > limit:
        raise error(path, f"is {format_bytes(st.st_size)}, more than {_a(what)} can be ({format_bytes(limit)} at most)",
                    fix or "it is not what its name says; restore the file", reason="too-large")


def _stat(path, what: str, error, fix_missing: str | None) -> os.stat_result:
    if _outside_root(path):
        raise error(path, "no such file or directory", fix_missing or "check the path", reason="outside")
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise error(path, "no such file or directory", fix_missing or "check the path", reason="missing") from None
    except OSError as e:
        raise error(path, f"cannot be read ({e.strerror or type(e).__name__})", "check its permissions",
                    reason="unreadable") from None


def regular_size(path: str | os.PathLike, what: str = "file", *, limit: int | None = None,
                 error: type[FileRefused] = FileRefused, fix_missing: str | None = None) -> int:
    """The size of ``path``, a regular file (no larger than ``limit``), without opening it."""
    st = _stat(path, what, error, fix_missing)
    _check_stat(path, st, limit, what, error, None)
    return st.st_size


def open_regular(path: str | os.PathLike, what: str = "file", *, limit: int | None = None,
                 error: type[FileRefused] = FileRefused, fix: str | None = None,
                 fix_missing: str | None = None) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file no larger than ``limit`` bytes.

    Checked with stat before the open (a device is never opened), opened with ``O_NONBLOCK`` (a FIFO
    swapped in meanwhile cannot block the open) and checked again on the open descriptor."""
    st = _stat(path, what, error, fix_missing)
    _check_stat(path, st, limit, what, error, fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise error(path, "no such file or directory", fix_missing or "check the path", reason="missing") from None
    except OSError as e:
        raise error(path, f"cannot be opened ({e.strerror or type(e).__name__})", "check its permissions",
                    reason="unreadable") from None
    try:
        _check_stat(path, os.fstat(fd), limit, what, error, fix)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file", *, error: type[FileRefused] = FileRefused,
                 fix: str | None = None, fix_missing: str | None = None) -> bytes:
    """The whole of ``path`` (a regular file) if it holds at most ``limit`` bytes. Reads at most ``limit + 1``
    bytes whatever its size claims (a ``/proc`` file says 0, a growing file says less), in steps: one
    ``read(limit + 1)`` allocates all of it up front (1 GiB for every 14 KiB ``.metadata``)."""
    with open_regular(path, what, limit=limit, error=error, fix=fix, fix_missing=fix_missing) as f:
        step = os.fstat(f.fileno()).st_size + 1  # what it says it holds, and a byte to see it grew
        parts, got = [], 0
        while got <= limit:
            part = f.read(min(max(step, 1 << 16), limit + 1 - got))
            if not part:
                break
            parts.append(part)
            got += len(part)
            step = 1 << 20
        data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > limit:
        raise error(path, f"holds more than {_a(what)} can ({format_bytes(limit)} at most)",
                    fix or "it is not what its name says; restore the file", reason="too-large")
    return data


def read_json(path: str | os.PathLike, limit: int, what: str = "JSON file", *, error: type[FileRefused] = FileRefused,
              fix: str | None = None, fix_missing: str | None = None) -> Any:
    """``path`` parsed as UTF-8 JSON, at most ``limit`` bytes; every failure one ``error`` naming the problem
    (where, never which bytes)."""
    data = read_bounded(path, limit, what, error=error, fix=fix, fix_missing=fix_missing)
    bad = fix or "the file is damaged or is not what its name says; restore it"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(path, f"is not UTF-8 text (an invalid byte at offset {e.start}); {_a(what)} is UTF-8 JSON", bad,
                    reason="format") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(path, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})", bad,
                    reason="format") from None
    except RecursionError:
        raise error(path, "nests deeper than JSON is read here", bad, reason="format") from None
    except ValueError:  # json's int() of a number of more digits than Python converts (4,300 by default)
        raise error(path, f"holds a number too long to read (more than {sys.get_int_max_str_digits():,} digits)",
                    bad, reason="format") from None
