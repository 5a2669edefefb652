"""How every ``workbench`` command answers: one JSON document under ``--json``, else text, and a failure
as one ``error: ...`` line naming the problem and the fix.

A leaf module: the command groups (``plan``, ``ckpt``, ``spmd``, ``doctor``) and the top-level parser
share it without importing one another.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import sys
import zipfile
from typing import Any

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "DEBUG_ENV", "emit_json", "error", "describe_exception", "unexpected"]

DEBUG_ENV = "WORKBENCH_DEBUG"  # set to 1: an unforeseen error raises with its traceback instead of one line

EXIT_FAILED = 1  # the work ran and failed (a bad checkpoint, a failed run)
EXIT_USAGE = 2   # the input was wrong (a bad flag, an invalid layout)


def emit_json(doc: dict[str, Any]) -> None:
    print(json.dumps(doc, indent=2, default=str))


def error(msg: str, as_json: bool, code: int = EXIT_USAGE, **extra: Any) -> int:
    """Report ``msg`` (as JSON under ``--json``) and return the exit code."""
    if as_json:
        emit_json({"status": "error", "error": msg, **extra})
    else:
        print(f"error: {msg}", file=sys.stderr)
    return code


# What a person should do about an OSError, by errno: the file is named by the error itself.
_OS_FIX = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; check the path",
    errno.EISDIR: "it is a directory; pass a file",
    errno.EEXIST: "it is in the way; pass another path or remove it",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
    errno.EROFS: "the file system is read-only; pass a path on a writable one",
    errno.ENOSPC: "the disk is full; free space or pass a path on another disk",
    errno.EDQUOT: "the disk quota is used up; free space or pass a path on another disk",
    errno.E2BIG: "the job is too large for one command line; use fewer ranks",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "it is a symlink loop; check the path",
}


def _first_line(e: BaseException, limit: int = 200) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_exception(e: BaseException, subject: str | None = None) -> str:
    """An exception in words: the file or argument (``subject`` when the error does not name one), the
    problem and, where known, the fix; never a traceback.

    ``FileNotFoundError: [Errno 2] ...`` becomes ``runs/r1/x: no such file or directory; check the path``,
    a RecursionError ``... is nested too deeply to read``, a MemoryError ``... needs more memory than this
    machine has``. Anything else keeps its type name, after the subject.
    """
    prefix = f"{subject}: " if subject else ""
    if isinstance(e, OSError) and e.errno is not None:
        problem = (e.strerror or os.strerror(e.errno)).rstrip(".")
        problem = problem[:1].lower() + problem[1:]
        name = e.filename if e.filename is not None else subject
        where = f"{name}: " if name is not None else ""
        also = f" (and {e.filename2})" if getattr(e, "filename2", None) is not None else ""
        fix = _OS_FIX.get(e.errno)
        return f"{where}{problem}{also}" + (f"; {fix}" if fix else "")
    if isinstance(e, RecursionError):
        return f"{prefix}nested too deeply to read; the input is damaged or hostile"
    if isinstance(e, MemoryError):
        return f"{prefix}needs more memory than this machine has; the input claims sizes that are too large"
    if isinstance(e, UnicodeDecodeError):
        return f"{prefix}not UTF-8 text (byte {e.start}); the input is damaged or not text"
    if isinstance(e, OverflowError):
        return f"{prefix}a number too large to use ({_first_line(e)}); pass a smaller value"
    if isinstance(e, EOFError):
        return f"{prefix}ends before its data does; the file is truncated or damaged"
    if isinstance(e, zipfile.BadZipFile):
        return f"{prefix}not a valid zip archive ({_first_line(e)}); the file is truncated or damaged"
    if isinstance(e, struct.error):
        return f"{prefix}holds a malformed binary field ({_first_line(e)}); the file is damaged"
    if isinstance(e, (ValueError, KeyError)) and e.args and isinstance(e.args[0], str):
        return prefix + _first_line(Exception(e.args[0]))  # our own one-line messages (KeyError's without quotes)
    text = _first_line(e)
    return f"{prefix}{type(e).__name__}" + (f": {text}" if text else "")


def unexpected(e: BaseException, as_json: bool, subject: str | None = None, code: int = EXIT_FAILED,
               hint: bool = True) -> int:
    """Report an error no command foresaw as one line (re-raised under ``WORKBENCH_DEBUG=1``). ``hint``:
    point at ``WORKBENCH_DEBUG`` where the words may not be enough (not for the errors mapped to words)."""
    if os.environ.get(DEBUG_ENV):
        raise e
    known = isinstance(e, (OSError, RecursionError, MemoryError, UnicodeDecodeError, OverflowError))
    more = f"; set {DEBUG_ENV}=1 for the traceback" if hint and not known else ""
    return error(describe_exception(e, subject) + more, as_json, code)
