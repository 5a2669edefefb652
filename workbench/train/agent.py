"""The launcher's subprocess: torchrun, run in-process so its failure report is structured.

``python -m workbench.train.agent RUN_DIR NPROC`` calls ``torch.distributed.run.run`` (exactly what the
``torchrun`` command does) in standalone mode. When a rank dies, torchrun stops the others and raises
``ChildFailedError`` with each failed rank's exit code; we pick the rank that caused it (a crash or a
signal, not a peer that merely lost its connection to the dead rank) and write a ``run_end`` event.
"""

from __future__ import annotations

import os
import signal
import sys

from workbench.train.events import LAUNCHER_RANK, EventWriter, read_events
from workbench.train.lifeline import follow_parent

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


def _is_secondary(message: str) -> bool:
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


def root_cause(failures: dict[int, object], errors: dict[int, dict]) -> int:
    """The rank to blame among torchrun's failures, given each rank's ``error`` event (if any)."""

    def score(rank: int) -> tuple:
        f = failures[rank]
        err = errors.get(rank)
        if err is not None:  # it raised: a cause unless the error is a lost connection to a peer
            text = err.get("message", "") + err.get("traceback", "")
            kind = 2 if _is_secondary(text) else 0
        elif f.exitcode < 0 and -f.exitcode not in (signal.SIGTERM, signal.SIGINT):
            kind = 0  # SIGKILL, SIGSEGV, SIGABRT...: torchrun itself only ever sends SIGTERM
        else:
            kind = 1  # stopped by torchrun's clean-up, or exited non-zero without saying why
        when = err["time"] if err is not None else float(f.timestamp)
        return (kind, when, rank)

    return min(failures, key=score)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, nproc = argv[0], int(argv[1])
    follow_parent(signal.SIGTERM)  # torchrun turns SIGTERM into stopping every rank
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    events = EventWriter(run_dir, LAUNCHER_RANK)
    args = get_args_parser().parse_args(
        [
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "--module",
            "workbench.train.worker",
            run_dir,
        ]
    )
    events.emit("launch", nproc=nproc, pid=os.getpid())
    try:
        run(args)
    except ChildFailedError as exc:
        errors: dict[int, dict] = {}
        for e in read_events(run_dir):
            if e["type"] == "error" and e["rank"] not in errors:
                errors[e["rank"]] = e
        rank = root_cause(exc.failures, errors)
        f = exc.failures[rank]
        err = errors.get(rank, {})
        how = describe_exit(f.exitcode)
        message = err.get("message") or how
        events.emit("run_end", status="failed", failed_rank=rank, exitcode=f.exitcode, how=how,
                    message=message, traceback=err.get("traceback", ""),
                    failed_ranks=sorted(exc.failures))
        return 1
    except SignalException as exc:
        events.emit("run_end", status="stopped", message=f"stopped by {exc.sigval.name}")
        return 130
    except KeyboardInterrupt:
        events.emit("run_end", status="stopped", message="stopped by SIGINT")
        return 130
    events.emit("run_end", status="succeeded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
