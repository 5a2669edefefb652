"""How every ``workbench`` command answers: one JSON document under ``--json``, else text, and a failure
as one ``error: ...`` line naming the problem and the fix.

A leaf module: the command groups (``plan``, ``ckpt``, ``spmd``, ``doctor``) and the top-level parser
share it without importing one another.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["EXIT_FAILED", "EXIT_USAGE", "emit_json", "error"]

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
