"""How a launched process lives and ends: it follows its parent down, and it exits without teardown races.

If the notebook kernel (or the CLI) dies without cleaning up, torchrun and its ranks must not run on
as orphans. ``prctl(PR_SET_PDEATHSIG)`` is the usual tool, but it fires when the parent *thread* exits
(a widget's worker thread, say), so we watch the parent *process* instead.
"""

from __future__ import annotations

import os
import signal
import sys
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


def exit_now(code: int) -> None:
    """Exit without running C++ static destructors (every gloo worker process should end this way).

    Every event has been written with an unbuffered os.write; what remains at interpreter exit is the
    destruction of gloo/c10d thread objects, which occasionally races and aborts a rank that finished
    cleanly ("terminate called without an active exception", SIGABRT: ~2% of 2-rank runs under load).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
