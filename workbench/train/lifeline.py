"""Orphan protection: a launched process follows its parent down.

If the notebook kernel (or the CLI) dies without cleaning up, torchrun and its ranks must not run on
as orphans. ``prctl(PR_SET_PDEATHSIG)`` is the usual tool, but it fires when the parent *thread* exits
(a widget's worker thread, say), so we watch the parent *process* instead.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def follow_parent(sig: int = signal.SIGTERM, poll_s: float = 0.25) -> None:
    """Send ``sig`` to this process as soon as its original parent process is gone."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                return

    threading.Thread(target=watch, name="workbench-lifeline", daemon=True).start()
