"""How a run ends: its status, the rank to blame, and :class:`RunFailed`, the one failure type.

Used by the launcher's agent (to write the ``run_end`` event), by :class:`workbench.Run` (to answer
``status``, ``error`` and ``root_cause()`` while the run is live and after) and so by every view.

Root cause. When one rank dies, the others fail too: a peer that loses its connection raises
"connection closed by peer", and torchrun stops the rest with SIGTERM. The rank to blame is the first
one, by time, of the best class below (ties go to the lower rank)::

    0  raised an error that is not a lost connection, or was killed by a signal torchrun never sends
       (SIGKILL, SIGSEGV, SIGABRT...)
    1  exited non-zero without saying why (e.g. it failed before it could write an error event)
    2  stopped by torchrun's clean-up (SIGTERM/SIGINT)
    3  raised an error that says a peer went away (a consequence, not a cause)

Across nodes the same rule runs on each node over its own ranks. When every failed rank of a node is
only a consequence (classes 2 and 3), the cause is on another node: ``workbench.train.nodes`` names it.
"""

from __future__ import annotations

import signal
from typing import Any, Mapping

__all__ = ["RunFailed", "STATUSES", "root_cause", "describe_exit", "is_peer_loss", "is_consequence", "rank_span",
           "print_outcome"]

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
    "failed to recv",
    "recvvalue failed",
    "sendbytes failed",
    "distnetworkerror",
)
_CLEANUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunFailed(RuntimeError):
    """A run failed. ``rank`` names the rank to blame (None: the launcher itself), ``message`` what it
    said, ``traceback`` its Python traceback when it had one. In a multi-node run ``node`` names the
    node (its ``--node-rank``) and ``ranks`` all of that node's ranks when the whole node went away.
    ``Run.wait()`` raises it; ``Run.error`` and ``Run.root_cause()`` return it without raising."""

    def __init__(self, rank: int | None, message: str, traceback: str = "", run_dir: str = "",
                 node: int | None = None, ranks: list[int] | None = None):
        self.rank, self.message, self.traceback, self.run_dir = rank, message, traceback, run_dir
        self.node = node
        self.ranks = list(ranks) if ranks else ([rank] if rank is not None else [])
        super().__init__(f"{self.where} failed: {message}")

    @property
    def where(self) -> str:
        """'rank 1', 'node 1 (ranks 2-3)', 'node 1' or 'the launcher'."""
        if self.node is None:
            return f"rank {self.rank}" if self.rank is not None else "the launcher"
        if not self.ranks:
            return f"node {self.node}"
        return f"node {self.node} (rank{'s' if len(self.ranks) > 1 else ''} {rank_span(self.ranks)})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RunFailed) and (self.rank, self.node, self.message, self.traceback)
                == (other.rank, other.node, other.message, other.traceback))

    __hash__ = RuntimeError.__hash__


def is_peer_loss(message: str) -> bool:
    """Whether an error message says only that a peer went away."""
    text = message.lower()
    return any(p in text for p in _PEER_LOSS)


def rank_span(ranks) -> str:
    """``[2, 3]`` -> '2-3', ``[1]`` -> '1', ``[0, 2, 3]`` -> '0, 2-3'."""
    ranks, parts = sorted(ranks), []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


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
        kind, when = _classify(errors.get(rank), exits[rank] if exits is not None else (1, 0.0))
        return (kind, when, rank)

    return min(candidates, key=score)


def _classify(err: Mapping[str, Any] | None, exit: tuple[int, float]) -> tuple[int, float]:
    """(class, time) of one failed rank, the classes of the module docstring."""
    if err is not None:
        return (3 if is_peer_loss(err.get("message", "") + err.get("traceback", "")) else 0), float(err["time"])
    exitcode, when = exit
    if exitcode < 0:
        return (2 if -exitcode in _CLEANUP_SIGNALS else 0), when
    return 1, when


def is_consequence(errors: Mapping[int, Mapping[str, Any]], exits: Mapping[int, tuple[int, float]]) -> bool:
    """Whether every failed rank in ``exits`` only followed a failure elsewhere: stopped by torchrun's
    clean-up, or told that a peer went away. On one node some rank is always the cause; when none of a
    node's ranks is, the cause is on another node."""
    return bool(exits) and all(_classify(errors.get(r), exits[r])[0] >= 2 for r in exits)


def print_outcome(run: Any, as_json: bool) -> None:
    """A finished :class:`workbench.Run`'s last word on the command line, the same for ``workbench train``
    and a plain torchrun's rank 0: one JSON document (``run.summary()`` with every rank's losses and the
    error), or the failing rank's traceback and one ``error:`` line, or one ``done:`` line."""
    import sys

    from workbench.cli_output import emit_json

    summary = run.summary()
    err = run.error
    if as_json:
        metrics = run.metrics
        summary["losses"] = {int(r): g["loss"].tolist() for r, g in metrics.groupby("rank")} if len(metrics) else {}
        if err is not None:
            summary["error"] = {"rank": err.rank, "message": err.message, "traceback": err.traceback,
                                **({"node": err.node, "ranks": err.ranks} if err.node is not None else {})}
        emit_json(summary)
    elif err is not None:
        if err.traceback:
            print(err.traceback.rstrip(), file=sys.stderr)
        print(f"error: {err}  (logs: {run.log_path})", file=sys.stderr)
    else:
        nodes = summary.get("nodes")
        if nodes:
            ranks = nodes.get("ranks")
            print(f"node {nodes['node_rank']} of {nodes['nnodes']} (ranks {rank_span(ranks) if ranks else '?'}, "
                  f"world size {nodes['world_size']}):", end=" ")
        resumed = summary.get("resumed_from")
        print(f"done: {summary['steps_logged']} steps"
              + (f" (steps {resumed['step']}-{run.job.train.steps - 1}, resumed)" if resumed else "")
              + f", loss {summary.get('first_loss', float('nan')):.4f} -> "
              f"{summary.get('final_loss', float('nan')):.4f}, {summary.get('tokens_per_s', 0):.0f} tokens/s"
              + (f", MFU {summary['mfu']:.2f}" if summary.get("mfu") is not None else "")
              + f"; events in {run.run_dir / 'events.jsonl'}")
