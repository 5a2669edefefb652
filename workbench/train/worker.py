"""The per-rank entry point that torchrun starts: ``python -m workbench.train.worker RUN_DIR``.

An exception becomes an ``error`` event carrying the traceback, so the launcher can show it.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from workbench.config import JobConfig
from workbench.lifeline import exit_now, follow_parent


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workbench.train.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = argv[0]
    follow_parent(signal.SIGKILL)  # if torchrun itself is killed, do not linger as an orphan
    from workbench.train.events import EventWriter
    from workbench.train.trainer import train

    rank = int(os.environ.get("RANK", "0"))
    try:
        job = JobConfig.load(os.path.join(run_dir, "config.json"))
        train(job, run_dir)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the event stream
        if isinstance(exc, KeyboardInterrupt):
            return 130
        with EventWriter(run_dir, rank) as ev:
            ev.emit("error", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
