"""The launcher's subprocess: torchrun, run in-process so its failure report is structured.

``python -m workbench.train.agent RUN_DIR NPROC`` runs torchrun's elastic agent (what the ``torchrun``
command runs) with NPROC processes on this machine: in standalone mode on one node; in a multi-node run
(``nodes`` in ``RUN_DIR/config.json``) by joining the c10d rendezvous at the endpoint that node 0 hosts
(``workbench.train.nodes``).

On CPU (gloo) the ranks are forked from this process (torchrun's ``start_method="fork"`` with a function
entrypoint, ``workbench.train.worker.rank_main``) after it has imported everything a rank imports, so they
share torch's and workbench's pages with it copy-on-write instead of each importing them again: a 2-rank
``tiny`` run then takes about 490 MiB (PSS, agent and ranks) instead of 930, and starts sooner. That is
what lets a notebook run on Binder (1 GB). Nothing here may run a torch op with intra-op threads before
the fork: OpenMP's thread pool does not survive one. CUDA ranks (``device: cuda`` in config.json) start
as fresh interpreters (``--module workbench.train.worker``), since CUDA does not survive a fork either.

When a rank dies, torchrun stops the others and raises ``ChildFailedError`` with each failed rank's exit
code; we pick the rank that caused it (a crash or a signal, not a peer that merely lost its connection
to the dead rank: ``workbench.train.outcome``) and write a ``run_end`` event. In a multi-node run, when
none of this node's ranks caused it, another node did: the event names that node, its ranks, its host
and its log, instead of blaming a rank here that only lost its peer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from workbench.cpu_quota import threads_per_rank
from workbench.lifeline import exit_now, follow_parent
from workbench.train.events import LAUNCHER_RANK, NODE_ENV, EventWriter, read_events
from workbench.train.nodes import NodeDirectory, torchrun_args
from workbench.train.outcome import describe_exit, is_consequence, root_cause


# Set (to anything) to start CPU ranks as fresh interpreters too, as CUDA ranks are.
FRESH_RANKS_ENV = "WORKBENCH_FRESH_RANKS"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run_dir, nproc = argv[0], int(argv[1])
    follow_parent(signal.SIGTERM)  # torchrun turns SIGTERM into stopping every rank
    # The container's CPU quota, not the host's cores (os.cpu_count()): workbench.cpu_quota.
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))

    from torch.distributed.run import get_args_parser, run

    from workbench.train import worker

    job = json.loads(Path(run_dir, "config.json").read_text())
    # CPU ranks fork from here; CUDA ranks start fresh interpreters (torchrun's script mode), as CUDA does
    # not survive a fork of a process that has touched the driver, and a GPU machine needs no page sharing.
    fork = job.get("device") == "cpu" and not os.environ.get(FRESH_RANKS_ENV)
    if fork:
        worker.preload(run_dir)

    def stop_on_signal(signum: int, frame: Any) -> None:
        # torchrun installs its own handler once its ranks start; before that (the rendezvous) SIGTERM
        # would kill this process without a run_end event. A BaseException: the rendezvous code catches
        # Exception and would wait on.
        raise _Stopped(signal.Signals(signum))

    signal.signal(signal.SIGTERM, stop_on_signal)
    nodes = job.get("nodes")
    if nodes:
        os.environ[NODE_ENV] = str(nodes["node_rank"])  # this process's events and its ranks' say which node
        where = torchrun_args(nodes, nproc)
    else:
        os.environ.pop(NODE_ENV, None)
        where = ["--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    events = EventWriter(run_dir, LAUNCHER_RANK)
    start = ["--start-method=fork", "workbench.train.worker"] if fork else ["--module", "workbench.train.worker"]
    args = get_args_parser().parse_args([*where, "--max-restarts=0", "--monitor-interval=0.1", *start, run_dir])
    reported = threading.Event()
    report_lock = threading.Lock()

    def report(end: dict[str, Any]) -> None:  # one run_end, from whichever thread gets there first
        with report_lock:
            if not reported.is_set():
                events.emit("run_end", **end)
                reported.set()

    def on_mismatch(message: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun stops this node's ranks; main() reports
        # torchrun may be inside a blocking store call that holds off Python signal handlers (waiting
        # for the node that has just stopped): report from here, and this node's ranks follow their
        # launcher down (workbench.lifeline).
        if not reported.wait(3.0):
            report({"status": "failed", "message": message, "failed_node": nodes["node_rank"]})
            exit_now(1)

    directory = NodeDirectory(nodes, nproc, run_dir, job, on_mismatch) if nodes else None
    events.emit("launch", nproc=nproc, pid=os.getpid(), **({"nodes": nodes} if nodes else {}))
    if directory is not None:
        directory.start()
    try:
        try:
            if fork:
                _torchrun(args, worker.rank_main)
            else:
                run(args)
        finally:  # from here on this process only reports: a late signal must not cut the report short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if directory is not None:
                directory.stop()
        end, code = {"status": "succeeded"}, 0
    except BaseException as exc:  # noqa: BLE001 - every ending becomes a run_end event
        end, code = _ending(exc, run_dir, directory)
    report(end)
    return code


def _torchrun(args: Any, entrypoint: Any) -> None:
    """``torch.distributed.run.run(args)``, with ``entrypoint(*args.training_script_args)`` as each rank's
    function in place of the script (``run`` only starts scripts, each in a fresh interpreter)."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # as run() does: a c10d rendezvous that this process hosts on a free port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=entrypoint)(*args.training_script_args)


class _Stopped(BaseException):
    """A signal that arrived before torchrun's own handler was installed."""

    def __init__(self, sigval: signal.Signals):
        super().__init__(sigval.name)
        self.sigval = sigval


def _ending(exc: BaseException, run_dir: str, directory: NodeDirectory | None) -> tuple[dict[str, Any], int]:
    """The ``run_end`` event and exit code for a run that torchrun ended with ``exc``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    if directory is not None and directory.mismatch:  # this node stopped itself: the nodes disagree
        return {"status": "failed", "message": directory.mismatch, "failed_node": directory.node_rank}, 1
    if isinstance(exc, ChildFailedError):
        return _failure(run_dir, exc, directory), 1
    if isinstance(exc, (SignalException, _Stopped)):
        return {"status": "stopped", "message": f"stopped by {exc.sigval.name}"}, 130
    if isinstance(exc, KeyboardInterrupt):
        return {"status": "stopped", "message": "stopped by SIGINT"}, 130
    if isinstance(exc, RendezvousTimeoutError) and directory is not None:
        return {"status": "failed", "message": directory.join_timeout(), "failed_node": directory.node_rank}, 1
    # The rendezvous failed, or a store call of torchrun's after it (DistError) when node 0 went away
    if isinstance(exc, RendezvousError) or (directory is not None and isinstance(exc, DistError)):
        return _rendezvous_failure(exc, directory), 1
    return {"status": "failed", "message": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(exc))}, 1


def _failure(run_dir: str, exc: Any, directory: NodeDirectory | None) -> dict[str, Any]:
    """The ``run_end`` of a run whose ranks failed: the rank to blame here, or the node that went away."""
    errors: dict[int, dict] = {}
    for e in read_events(run_dir):
        if e["type"] == "error" and e["rank"] not in errors:
            errors[e["rank"]] = e
    exits = {r: (f.exitcode, float(f.timestamp)) for r, f in exc.failures.items()}
    # With forked ranks torchrun reports only the first failed rank it reaped (the others it then stops);
    # a rank that wrote an error event failed too, with exit code 1 (workbench.train.worker).
    for r, e in errors.items():
        if isinstance(r, int) and r >= 0:
            exits.setdefault(r, (1, float(e["time"])))
    if directory is not None and is_consequence(errors, exits):
        first = min(exits, key=lambda r: errors[r]["time"] if r in errors else exits[r][1])
        seen = errors[first]["message"] if first in errors else describe_exit(exits[first][0])
        return {"status": "failed", "how": "lost its connection to another node", "traceback": "",
                "failed_ranks": sorted(exits), "seen_here": f"rank {first}: {seen}",
                **directory.lost(sorted(exits))}
    rank = root_cause(errors, exits)
    exitcode = exits[rank][0]
    err = errors.get(rank, {})
    how = describe_exit(exitcode)
    return {"status": "failed", "failed_rank": rank, "exitcode": exitcode, "how": how,
            "message": err.get("message") or how, "traceback": err.get("traceback", ""),
            "failed_ranks": sorted(exits),
            **({"failed_node": directory.node_rank} if directory is not None else {})}


def _rendezvous_failure(exc: BaseException, directory: NodeDirectory | None) -> dict[str, Any]:
    """torchrun's rendezvous failed: before this node's ranks ran (node 0 unreachable, or its port taken),
    or during the run (node 0, which hosts the rendezvous, went away)."""
    text = str(exc.__cause__ or exc).strip()
    cause = text.splitlines()[0] if text else type(exc).__name__
    if directory is None:
        return {"status": "failed", "message": f"rendezvous failed: {cause}"}
    if directory.node_rank != 0 and directory.local_ranks() is not None:
        return {"status": "failed", "how": "lost the rendezvous", "traceback": "", "seen_here": cause,
                **directory.lost(directory.local_ranks() or [], rendezvous_lost=True)}
    if directory.node_rank != 0 and directory.reached:  # node 0 was there, then went away
        return {"status": "failed", "how": "lost the rendezvous", "seen_here": cause, **directory.rendezvous_gone()}
    return {"status": "failed", "message": directory.unreachable(cause), "failed_node": directory.node_rank}


if __name__ == "__main__":
    # os._exit: the node directory's thread may sit in a TCPStore call, whose destruction at interpreter
    # exit can abort the process.
    exit_now(main())
