"""The per-rank entry point: ``rank_main(RUN_DIR)``, which torchrun calls in each rank it forks from the
launcher's agent (``workbench.train.agent``), or ``python -m workbench.train.worker RUN_DIR``.

An exception becomes an ``error`` event carrying the traceback, so the launcher can show it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from workbench.config import JobConfig
from workbench.lifeline import exit_now, follow_parent
from workbench.train.outcome import is_peer_loss

# A rank that only lost its peer waits this long before exiting, so that torchrun reaps the rank that
# caused it first: with forked ranks it reports the first failed rank it sees (workbench.train.agent).
PEER_LOSS_EXIT_DELAY_S = 1.0


def preload(run_dir: str | None = None) -> None:
    """Import what a rank imports, in the process that forks the ranks, so they share those pages with it
    (a task's entry module too, named in ``RUN_DIR/task.json``); then move every object there out of the
    garbage collector's reach (``gc.freeze``): a collection in a rank would otherwise write to the header
    of every object it examines, copying the pages they sit on."""
    import gc
    import importlib

    import workbench.train.trainer  # noqa: F401

    entry = _task_entry(run_dir) if run_dir is not None else None
    if entry is not None:
        importlib.import_module(entry[0])

    gc.collect()
    gc.freeze()


def _task_entry(run_dir: str) -> tuple[str, str] | None:
    """``(module, function)`` of the run's task (``RUN_DIR/task.json``), or None for language modelling."""
    task = os.path.join(run_dir, "task.json")
    if not os.path.exists(task):
        return None
    with open(task) as f:
        module, _, function = json.load(f)["entry"].partition(":")
    if not module.startswith("workbench."):  # a run directory names code to run: only ours
        raise ValueError(f"{task} names {module!r}; a task's entry must be a workbench module")
    return module, function


def _layout_refusal(job: JobConfig, run_dir: str) -> str | None:
    """Why this process cannot train ``job`` in the layout its config.json names (its rank count is not
    torchrun's WORLD_SIZE), or None."""
    from workbench.train.group import check_world_size

    n, world = job.parallel.world_size, os.environ.get("WORLD_SIZE") or "1"
    if not world.isdigit():
        return f"WORLD_SIZE={world!r} is not a number of processes; start the worker under torchrun, which sets it"
    try:
        check_world_size(job.parallel, int(world),
                         f"start {n} process{'es' if n != 1 else ''} (torchrun --nproc-per-node {n} -m "
                         f"workbench.train.worker {run_dir}), or let `workbench train` start the ranks it needs")
    except ValueError as e:
        return f"{os.path.join(run_dir, 'config.json')}: {e}"
    return None


def rank_main(run_dir: str) -> int:
    """One rank, in a process torchrun forked from the agent: as ``python -m workbench.train.worker``.

    The agent's signal handlers came along with the fork: a rank ends on SIGTERM (torchrun's clean-up)
    and raises KeyboardInterrupt on SIGINT, as a fresh interpreter does. A failure exits at once with
    its code; success returns 0 to torchrun, which collects it before the process exits.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main([run_dir])
    if code:
        exit_now(code)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workbench.train.worker RUN_DIR", file=sys.stderr)
        return 2
    run_dir = argv[0]
    follow_parent(signal.SIGKILL)  # if torchrun itself is killed, do not linger as an orphan
    from workbench.train.events import EventWriter

    rank = int(os.environ.get("RANK", "0"))
    try:
        job = JobConfig.load(os.path.join(run_dir, "config.json"))
        refusal = _layout_refusal(job, run_dir)
        if refusal is not None:
            with EventWriter(run_dir, rank) as ev:
                ev.emit("error", message=refusal, traceback="")
            if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank refuses; one line per machine says why
                print(f"error: {refusal}", file=sys.stderr)
            return 2
        entry = _task_entry(run_dir)  # another loop on these ranks (workbench.train.launcher.Task)
        if entry is not None:
            import importlib

            getattr(importlib.import_module(entry[0]), entry[1])(job, run_dir)
        else:
            from workbench.train.trainer import train  # after the checks: a refusal need not load the trainer

            train(job, run_dir)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the event stream
        if isinstance(exc, KeyboardInterrupt):
            return 130
        message, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
        with EventWriter(run_dir, rank) as ev:
            ev.emit("error", message=message, traceback=trace)
        traceback.print_exc()
        if is_peer_loss(message + trace):
            time.sleep(PEER_LOSS_EXIT_DELAY_S)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
