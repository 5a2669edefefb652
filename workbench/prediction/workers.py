"""Share a prediction's distinct ranks between this process and worker processes.

A fake step is CPU-bound Python, so ranks predicted at once need processes, not threads. Each worker
used to be a fresh interpreter that imported torch and the build path (2.6 s of a 10 s llama-70b
prediction on 2 cores) while this process, which had imported them already, waited. Now::

    this process          imports the build path once, then predicts part 0 itself
    parts 1 ..            forked from it after that import (nothing imported twice), each saving its
                          timeline to a temporary directory this process reads back

A fork is only taken where it is safe: this process runs no other Python thread (a notebook kernel
does: its threads' locks would be copied held), has not initialized CUDA, and holds no real process
group. Otherwise the workers are fresh interpreters (``python -m workbench.prediction.workers``), and
with a real process group here every part goes to one, as a fake process group cannot live beside
a real one.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from workbench.config import JobConfig
from workbench.memory.timeline import MemoryTimeline

__all__ = ["predict_parts", "can_fork"]

_BUILD_PATH = ("workbench.parallel.build", "workbench.train.step", "workbench.prediction.fake",
               "workbench.prediction.fold", "workbench.prediction.routing", "workbench.plan.simulate",
               "workbench.mesh", "workbench.spmd")


def can_fork() -> bool:
    """Whether worker processes may be forked from this one (see the module's docstring)."""
    import torch
    import torch.distributed as dist

    return (hasattr(os, "fork") and threading.active_count() == 1 and not torch.cuda.is_initialized()
            and not (dist.is_available() and dist.is_initialized()))


def predict_parts(job: JobConfig, device: str, parts: list[list[int]], run_part: Callable[[list[int]], MemoryTimeline],
                  *, steps: int | None, exact: bool, fold: bool, routing: Any = None) -> list[MemoryTimeline]:
    """One timeline per part of the distinct ranks, each predicted by ``run_part(ranks)`` in this process
    (part 0, unless a real process group is here) or in a worker (forked, else a fresh interpreter given
    ``job``, ``device``, ``steps``, ``exact``, ``fold`` and ``routing``)."""
    import torch.distributed as dist

    here = not (dist.is_available() and dist.is_initialized())
    frozen = False
    with tempfile.TemporaryDirectory(prefix="workbench-predict-") as d:
        away = parts[1:] if here else parts
        if here and can_fork():
            import importlib

            for name in _BUILD_PATH:  # imported once, before the fork, not once per worker
                importlib.import_module(name)
            frozen = _freeze()
            workers = [_fork(run_part, part, os.path.join(d, f"out{i}")) for i, part in enumerate(away)]
        else:
            workers = [_spawn(job, device, part, os.path.join(d, f"out{i}"), steps, exact, fold, routing, d, i)
                       for i, part in enumerate(away)]
        try:
            mine = [run_part(parts[0])] if here else []
        except BaseException:  # an error (or Ctrl-C) here: the workers' results are not wanted
            for _, stop in workers:
                stop()
            raise
        finally:
            failures = [f for f in (wait() for wait, _ in workers) if f]  # every worker reaped
            if frozen:
                gc.unfreeze()
        if failures:
            raise RuntimeError(f"memory prediction in a worker process failed: {failures[0]}")
        return mine + [MemoryTimeline.load(os.path.join(d, f"out{i}")) for i in range(len(away))]


def _freeze() -> bool:
    """Move every object alive now (torch, the build path: a few hundred thousand) out of the garbage
    collector's reach until :func:`predict_parts` is done: its full collections, a few per rank predicted,
    no longer walk them (0.15 s each), and a forked worker no longer copies the pages they live on when
    a collection writes to their headers. False (nothing done) when something else has frozen objects."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


def _fork(run_part: Callable[[list[int]], MemoryTimeline], part: list[int], out: str) -> tuple[Callable, Callable]:
    """Predict ``part`` in a forked child that saves its timeline to ``out``; returns a function that waits
    for it and gives its error (None: none), and one that stops it."""
    err = out + ".err"
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            import torch

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            torch.set_num_threads(1)
            run_part(part).save(out)
            code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            with open(err, "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        finally:
            os._exit(code)

    def wait() -> str | None:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            return None
        if os.path.exists(err):
            with open(err) as f:
                text = f.read().strip()
            return text.splitlines()[-1] if text else "no output"
        return f"worker exited with status {os.waitstatus_to_exitcode(status)}"

    def stop() -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    return wait, stop


def _spawn(job: JobConfig, device: str, part: list[int], out: str, steps: int | None, exact: bool, fold: bool,
           routing: Any, d: str, i: int) -> tuple[Callable, Callable]:
    """Predict ``part`` in a fresh interpreter (``python -m workbench.prediction.workers``)."""
    cfg = os.path.join(d, "job.json")
    if not os.path.exists(cfg):
        with open(cfg, "w") as f:
            f.write(job.to_json())
        with open(os.path.join(d, "routing.json"), "w") as f:
            json.dump(None if routing is None else routing.to_dict(), f)
    ranks = os.path.join(d, f"ranks{i}")  # a file: thousands of ranks overflow one argument (E2BIG)
    with open(ranks, "w") as f:
        f.write(",".join(map(str, part)))
    cmd = [sys.executable, "-m", "workbench.prediction.workers", cfg, out, device, "" if steps is None else str(steps),
           "1" if exact else "0", ranks, "1" if fold else "0", os.path.join(d, "routing.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)

    def wait() -> str | None:
        _, err = proc.communicate(timeout=3600)
        return None if proc.returncode == 0 else (err.strip().splitlines() or ["no output"])[-1]

    return wait, proc.terminate


def _main(argv: list[str]) -> int:
    from workbench.prediction.memory import predict_part

    cfg, out, device, steps, exact, ranks, fold, routing_file = argv
    job = JobConfig.load(cfg)
    with open(routing_file) as f:
        routing = json.load(f)
    if routing is not None:
        from workbench.prediction.routing import routing_from_dict

        routing = routing_from_dict(routing)
    with open(ranks) as f:
        ranks_list = [int(r) for r in f.read().split(",")]
    predict_part(job, ranks_list, device, int(steps) if steps else None, exact == "1", fold == "1", routing).save(out)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
