"""Disk trouble in words: where a write cannot go, and why, said before the work starts or when it fails.

A leaf module: the launcher's preflight (``workbench.train.rundir``), checkpoint saves
(``workbench.checkpoint.saver``) and exports (``workbench.checkpoint.destination``) share it.

* :func:`check_writable` answers before anything runs: a path that is a file or lies under one, a
  read-only file system, no permission, or less room than the job will need are one line each. It
  probes by creating (and removing) a file, so it answers what the kernel would answer: root on a
  ``chmod 0500`` directory may write there, and does; nobody writes to a read-only mount.
* :func:`storage_error` turns the ``OSError`` of a failed write (ENOSPC, EDQUOT, EROFS, EACCES, EPERM)
  into a :class:`StorageError` whose message names the condition, the place, the room needed and free,
  and the fix. Without it an async save out of space read ``unexpected pos 704 vs 598`` (torch.save's
  zip writer, after the write under it failed).
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from workbench.units import format_bytes

__all__ = ["StorageError", "storage_error", "named_os_error", "check_writable", "free_bytes", "nearest_existing"]

# errno -> how a person says it
_NAMES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the ones where room needed and free say something


class StorageError(OSError):
    """A write failed for lack of room or of permission; ``errno`` says which, the message says it in words.

    An ``OSError`` (``e.errno == errno.ENOSPC``), whose ``str`` is the one line itself. It pickles (DCP
    gathers a failing rank's exception to rank 0)."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.strerror)


def named_os_error(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` with a named errno in ``exc``'s chain (``__cause__``/``__context__``), if any:
    torch.save reports a failed write as ``unexpected pos``, with the real error as its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NAMES:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def nearest_existing(path: str | Path) -> Path:
    """``path`` itself if it exists, else its nearest existing ancestor (where it would be created)."""
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system that holds ``path`` (or would hold it);
    None where it cannot be told."""
    try:
        st = os.statvfs(nearest_existing(path))
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def storage_error(exc: BaseException, *, doing: str, where: str | Path, needed: int | None = None,
                  fix: str = "free space or write elsewhere") -> StorageError | None:
    """A :class:`StorageError` naming why ``exc`` (or an error in its chain) failed, or None when it is not
    a disk condition this module names. ``doing``: what was being written ("writing checkpoint step 4 to");
    ``needed``: about how many bytes the write needs; ``fix``: what to do about room (ENOSPC, EDQUOT)."""
    if isinstance(exc, StorageError):
        return exc
    err = named_os_error(exc)
    if err is None:
        return None
    name = _NAMES[err.errno]
    if err.errno in _ROOM:
        free = free_bytes(where)
        room = [f"needs ~{format_bytes(needed)}" if needed else None,
                f"{format_bytes(free)} free there" if free is not None else None]
        room = ", ".join(r for r in room if r)
        msg = f"{name} {doing} {where}{f' ({room})' if room else ''}; {fix}"
    elif err.errno == errno.EROFS:
        msg = f"{name}: {doing} {where} failed; choose a directory on a writable file system"
    else:
        msg = f"{name} {doing} {where}; make it writable for this user, or choose another directory"
    return StorageError(err.errno, msg)


def check_writable(path: str | Path, what: str, *, needed: int = 0, fix: str = "choose another directory") -> None:
    """Refuse, in one ValueError line, a directory that cannot be written: ``path`` is a file or lies under
    one, sits on a read-only file system, is not writable for this user, or its file system has less than
    ``needed`` bytes free. ``what`` names it as the user does (``--ckpt-dir /x``). Creates nothing that
    stays: a missing directory is probed in its nearest existing ancestor."""
    path = Path(os.path.abspath(path))
    base = nearest_existing(path)
    if base.is_symlink() and not base.exists():
        raise ValueError(f"{what}: {base} is a symbolic link to nothing; {fix}")
    if not base.is_dir():
        where = "is a file" if base == path else f"lies under {base}, which is a file"
        raise ValueError(f"{what} {where}, not a directory; {fix}")
    probe = base / f".workbench-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if base == path:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
        else:  # the directory will be created: creating one is what must work
            os.mkdir(probe)
            os.rmdir(probe)
    except OSError as e:
        reason = _NAMES.get(e.errno, e.strerror or type(e).__name__)
        at = "" if base == path else f" (in {base}, where it would be created)"
        raise ValueError(f"{what} cannot be written: {reason}{at}; {fix}") from None
    free = free_bytes(base)
    if needed and free is not None and free < needed:
        raise ValueError(f"{what} has {format_bytes(free)} free, and this job needs ~{format_bytes(needed)} there; "
                         f"free space or {fix}")
