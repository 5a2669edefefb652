"""The launcher's subprocess: torchrun, run in-process so its failure report is structured.

``python -m workbench.train.agent RUN_DIR NPROC`` calls ``torch.distributed.run.run`` (exactly what the
``torchrun`` command does) in standalone mode. When a rank dies, torchrun stops the others and raises
``ChildFailedError`` with each failed rank's exit code; we pick the rank that caused it (a crash or a
signal, not a peer that merely lost its connection to the dead rank: ``workbench.train.outcome``) and write
a ``run_end`` event.
"""

from __future__ import annotations

import os
import signal
import sys

from workbench.train.events import LAUNCHER_RANK, EventWriter, read_events
from workbench.lifeline import follow_parent
from workbench.train.outcome import describe_exit, root_cause


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
        exits = {r: (f.exitcode, float(f.timestamp)) for r, f in exc.failures.items()}
        rank = root_cause(errors, exits)
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
