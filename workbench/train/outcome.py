"""How a run ends: its status, the rank to blame, and :class:`RunFailed`, the one failure type.

Used by the launcher's agent (to write the ``run_end`` event), by :class:`workbench.Run` (to answer
``status``, ``error`` and ``root_cause()`` while the run is live and after) and so by every view.

Root cause. When one rank dies, the others fail too: a peer that loses its connection raises
"connection closed by peer", and torchrun stops the rest with SIGTERM. The rank to blame is the first
one, by time, of the best class below (ties go to the lower rank)::

    0  raised an error that is not a lost connection, or was killed by a signal torchrun never sends
       (SIGKILL, SIGSEGV, SIGABRT...)
    1  stopped by torchrun's clean-up (SIGTERM/SIGINT), or exited non-zero without saying why
    2  raised an error that says a peer went away (a consequence, not a cause)
"""

from __future__ import annotations

import signal
from typing import Any, Mapping

__all__ = ["RunFailed", "STATUSES", "root_cause", "describe_exit", "is_peer_loss"]

STATUSES = ("running", "succeeded", "failed", "stopped")

# Messages a healthy rank raises when a peer dies under it: they are consequences, not causes.
_PEER_LOSS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "read error",
    "timed out",
    "nccl communicator was aborted",
)


class RunFailed(RuntimeError):
    """A run failed. ``rank`` names the rank to blame (None: the launcher itself), ``message`` what it
    said, ``traceback`` its Python traceback when it had one. ``Run.wait()`` raises it; ``Run.error``
    and ``Run.root_cause()`` return it without raising."""

    def __init__(self, rank: int | None, message: str, traceback: str = "", run_dir: str = ""):
        self.rank, self.message, self.traceback, self.run_dir = rank, message, traceback, run_dir
        where = f"rank {rank}" if rank is not None else "the launcher"
        super().__init__(f"{where} failed: {message}")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RunFailed) and (self.rank, self.message, self.traceback)
                == (other.rank, other.message, other.traceback))

    __hash__ = RuntimeError.__hash__


def is_peer_loss(message: str) -> bool:
    """Whether an error message says only that a peer went away."""
    text = message.lower()
    return any(p in text for p in _PEER_LOSS)


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit {exitcode})"
    return f"exited with code {exitcode}"


def root_cause(errors: Mapping[int, Mapping[str, Any]],
               exits: Mapping[int, tuple[int, float]] | None = None) -> int | None:
    """The rank to blame (see the module docstring), or None when no rank failed.

    ``errors``: each rank's first ``error`` event. ``exits``: ``rank -> (exitcode, time)`` of the ranks
    that exited badly, as torchrun reports them; without it (a run still going) the ranks that raised
    are the candidates.
    """
    candidates = list(exits) if exits is not None else list(errors)
    if not candidates:
        return None

    def score(rank: int) -> tuple:
        err = errors.get(rank)
        if err is not None:
            kind = 2 if is_peer_loss(err.get("message", "") + err.get("traceback", "")) else 0
            when = float(err["time"])
        else:
            exitcode, when = exits[rank] if exits is not None else (1, 0.0)
            kind = 0 if exitcode < 0 and -exitcode not in (signal.SIGTERM, signal.SIGINT) else 1
        return (kind, when, rank)

    return min(candidates, key=score)
