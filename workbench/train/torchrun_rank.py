"""One rank of a job that plain ``torchrun`` started, as torchtitan users run their trainer::

    torchrun --nproc-per-node 2 -m workbench.torchrun tiny --tp 2 --steps 20 --out runs/a

``workbench train`` starts torchrun itself (``workbench.train.agent``); here torchrun starts every rank
with the same command line, the flags of ``workbench train`` (``workbench.torchrun`` parses them with
that command's parser and calls :func:`run_args`). ``workbench train`` started under torchrun
(``LOCAL_RANK`` or ``TORCHELASTIC_RUN_ID`` set) calls :func:`run_args` too: one launcher per rank used to
race the others for ``--out`` and exit 1.

Each rank validates the flags and builds the job (bad input is refused in one line, printed by each
machine's local rank 0; every rank exits 2). The ranks form the process group (``workbench.train.group``,
bounded by ``WORKBENCH_PG_TIMEOUT_S``). Rank 0 then makes the run directory the job's, as ``launch``
does (``launcher.prepare_run_dir``: the same refusals, ``config.json``, ``run.json``, the checkpoint
directory's owner) and writes the ``launch`` event; it tells the other ranks through the group whether it
could, and where (a broadcast, bounded by the same timeout: nobody polls for files). They join that run:
every rank trains as a rank of ``workbench train`` does (``workbench.train.worker``, reading the
``config.json`` rank 0 wrote), so the directory holds what ``workbench train`` writes, and rank 0 writes
the ``run_end`` event that ``workbench train``'s agent would. On several machines ``--out`` must be a
directory every machine shares; a rank that cannot see it says so.

torchrun starts, watches and stops the processes here, so what ``workbench train`` does with them is
torchrun's: ``--nproc``, ``--nnodes`` and ``--node-rank`` are accepted only where they agree with
torchrun's ``--nproc-per-node``, ``--nnodes`` and node rank; ``--rdzv-*`` and ``--timeout`` are refused,
naming torchrun's own options (and ``timeout(1)``).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any, Callable

from workbench.cli_output import EXIT_FAILED, EXIT_USAGE, error

ENTRY = "-m workbench.torchrun"  # what torchrun runs: workbench/torchrun.py
# What torchrun sets in every rank's environment, and this module reads.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PATH_MAX = 1 << 16  # the run directory rank 0 sends: a path, never more than this


def under_torchrun(env: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank torchrun started (torchrun sets both variables in every rank)."""
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env


def run_args(args: argparse.Namespace, default_out: Callable[[], Path]) -> int:
    """Train as one rank of a job torchrun started, from ``workbench train``'s parsed arguments;
    ``default_out()`` names the run directory (on rank 0) when ``--out`` is not given."""
    as_json = args.json
    env = os.environ
    speaks = env.get("LOCAL_RANK", "0") == "0"  # one line per machine, not one per rank

    def refuse(message: str, code: int = EXIT_USAGE) -> int:
        return error(message, as_json, code) if speaks else code

    missing = [k for k in TORCHRUN_ENV if k not in env]
    if missing:
        unset = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
        start = f"`torchrun --nproc-per-node N {ENTRY} MODEL ...`"
        if under_torchrun():  # `workbench train` with a stray LOCAL_RANK (or a torchrun of another kind)
            set_ = [k for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID") if k in env]
            return refuse(f"{' and '.join(set_)} set: this process would train as a rank of a torchrun job, but "
                          f"{unset}; start it as {start}, or unset {' and '.join(set_)} to let `workbench train` "
                          "start its own ranks")
        return refuse(f"workbench.torchrun trains as one of the ranks torchrun starts, but {unset}; start it "
                      f"as {start}, or without torchrun as `workbench train MODEL --nproc N`")
    bad = next((k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if not env[k].isdigit()), None)
    if bad is not None:
        return refuse(f"{bad}={env[bad]!r} is not a number; start this under torchrun, which sets it")
    rank, world, local_world = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    problem = _flag_problem(args, world, local_world, env.get("GROUP_RANK"))
    if problem is not None:
        return refuse(problem)
    try:
        job = _build(args, world, local_world)
    except ValueError as e:
        return refuse(str(e))

    import torch

    from workbench.train.group import group_timeout, init_group

    use_cuda = job.device == "cuda"
    device = torch.device("cuda", int(env["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if use_cuda:  # before the group forms: NCCL binds each rank to its current device
        torch.cuda.set_device(device)
    try:
        init_group(use_cuda)
    except RuntimeError as e:  # one line: another rank never joined
        return refuse(str(e), EXIT_FAILED)

    code, run_dir = (_set_up(args, job, world, local_world, default_out) if rank == 0 else (0, ""))
    try:  # rank 0's verdict and the run directory, to every rank
        code, run_dir = _share(code, run_dir, device)
    except Exception as e:  # noqa: BLE001 - a peer that went away or never answered: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return refuse(f"rank {rank}: rank 0 did not say within {group_timeout().total_seconds():g} s whether it set "
                      f"up the run directory ({first}); see rank 0's output", EXIT_FAILED)
    if code:  # rank 0 said why; the ranks of other machines point there
        if rank != 0 and speaks and env.get("GROUP_RANK", "0") != "0":
            error("rank 0 could not set up the run directory (its error is on the first machine)", as_json, code)
        return code
    if not (Path(run_dir) / "config.json").is_file():
        return refuse(f"rank {rank}: rank 0 set up the run directory {run_dir}, but this machine does not see it; "
                      "under torchrun on several machines --out must be a directory every machine shares",
                      EXIT_FAILED)

    from workbench.train import worker

    if rank == 0:  # torchrun's clean-up (SIGTERM): end through the worker, to write the run's end
        signal.signal(signal.SIGTERM, _interrupt)
    code = worker.main([run_dir])
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _report_end(run_dir, code)
        _print_outcome(run_dir, job, code, as_json)
    return code


def _flag_problem(args: argparse.Namespace, world: int, local_world: int, group_rank: str | None) -> str | None:
    """Why a flag of ``workbench train`` that torchrun's own options decide here cannot be taken, or None."""
    if local_world < 1 or world % local_world:
        return (f"torchrun started {world} processes as {local_world} per machine, which machines cannot share "
                "equally; give every machine the same --nproc-per-node")
    nnodes = world // local_world
    if args.nproc is not None and args.nproc != local_world:
        return (f"--nproc {args.nproc}, but torchrun started {local_world} processes on this machine; under "
                "torchrun its --nproc-per-node sets that: drop --nproc or make the two agree")
    if args.nnodes != 1 and args.nnodes != nnodes:
        return (f"--nnodes {args.nnodes}, but torchrun's job spans {nnodes} machine(s); under torchrun its --nnodes "
                "sets that: drop --nnodes or make the two agree")
    if args.node_rank and str(args.node_rank) != group_rank:
        return (f"--node-rank {args.node_rank}, but torchrun made this machine node {group_rank}; under torchrun "
                "its --node-rank sets that: drop --node-rank")
    for flag, value, theirs in (("--rdzv-endpoint", args.rdzv_endpoint, "--rdzv-endpoint"),
                                ("--rdzv-id", args.rdzv_id, "--rdzv-id"),
                                ("--rdzv-timeout", args.rdzv_timeout, "--rdzv-conf join_timeout=SECONDS")):
        if value is not None:
            return f"{flag} is torchrun's to set under torchrun: pass {theirs} to torchrun, before -m"
    if args.timeout is not None:
        return (f"--timeout {args.timeout:g} stops the ranks that workbench train starts; torchrun starts them "
                f"here: run `timeout {args.timeout:g} torchrun ...`, which stops torchrun and its ranks")
    return None


def _build(args: argparse.Namespace, world: int, local_world: int) -> Any:
    """The job from the flags, for torchrun's ``world`` ranks (``dp_shard`` fills what the other degrees
    leave, as ``--nproc`` does for ``workbench train``). ValueError: one line naming the fix."""
    from workbench.settings import from_args, given
    from workbench.train.group import check_world_size
    from workbench.train.launcher import build_job

    parallel = from_args(args, "parallel")
    fixed = parallel.dp_replicate * parallel.tp * parallel.pp
    if parallel.dp_shard != -1:  # every degree given: they must make torchrun's world
        check_world_size(parallel, world, f"start {parallel.world_size} processes (torchrun --nproc-per-node), or "
                         "leave --dp-shard out to shard data over the processes the other degrees leave")
    elif world % fixed:  # (resolving dp_shard would say "nproc", a flag torchrun's users did not pass)
        raise ValueError(f"dp_replicate*tp*pp={fixed} does not divide the {world} process{'es' if world != 1 else ''} "
                         f"torchrun started (WORLD_SIZE={world}); start a multiple of {fixed} "
                         "(torchrun --nproc-per-node), or choose degrees that divide it")
    return build_job(args.model, nproc=local_world, nnodes=world // local_world, parallel=parallel,
                     train=from_args(args, "train"), **given(args, "model"))


def _set_up(args: argparse.Namespace, job: Any, world: int, local_world: int,
            default_out: Callable[[], Path]) -> tuple[int, str]:
    """Rank 0: make the run directory the job's and write its ``launch`` event. ``(0, run directory)``, or
    ``(exit code, "")`` after saying why in one line."""
    from workbench.train.events import LAUNCHER_RANK, EventWriter
    from workbench.train.launcher import prepare_run_dir
    from workbench.train.rundir import RunDirInUse

    run_dir = Path(os.path.abspath(args.out or default_out()))  # absolute: every machine is told it
    try:
        prepare_run_dir(job, run_dir, overwrite=args.overwrite, adopt_ckpt_dir=args.adopt_ckpt_dir)
        with EventWriter(run_dir, LAUNCHER_RANK) as ev:
            ev.emit("launch", nproc=local_world, world_size=world, pid=os.getppid(), launcher="torchrun")
    except RunDirInUse as e:
        return error(e.for_cli(), args.json), ""
    except ValueError as e:  # no room, not writable, another run's checkpoints, no checkpoint to resume
        return error(str(e), args.json), ""
    except OSError as e:
        return error(f"could not set up the run directory {run_dir}: {e}", args.json, EXIT_FAILED), ""
    return 0, str(run_dir)


def _share(code: int, text: str, device: Any) -> tuple[int, str]:
    """Rank 0's ``(code, text)``, on every rank: two broadcasts in the job's group (on the group's device:
    NCCL takes CUDA tensors only), each bounded by the group's timeout."""
    import torch
    import torch.distributed as dist

    data = text.encode()
    head = torch.tensor([code, len(data)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    code, n = int(head[0]), int(head[1])
    if not 0 <= n <= _PATH_MAX:
        raise ValueError(f"rank 0 sent a run directory of {n} bytes")
    if n == 0:
        return code, ""
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if dist.get_rank() == 0
           else torch.empty(n, dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    return code, bytes(buf.cpu().tolist()).decode()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the worker ends the run as stopped (exit 130)


def _report_end(run_dir: str, code: int) -> None:
    """Rank 0 writes the ``run_end`` event, as ``workbench train``'s agent does: succeeded, failed (naming
    the rank to blame among the errors written so far: ``workbench.train.outcome``) or stopped."""
    from workbench.train.events import LAUNCHER_RANK, EventWriter, read_events
    from workbench.train.outcome import describe_exit, root_cause

    if code == 0:
        end: dict[str, Any] = {"status": "succeeded"}
    else:
        errors: dict[int, dict] = {}
        for e in read_events(run_dir):
            if e["type"] == "error" and e["rank"] >= 0:
                errors.setdefault(e["rank"], e)
        blamed = root_cause(errors)
        if blamed is not None:
            err = errors[blamed]
            end = {"status": "failed", "failed_rank": blamed, "message": err.get("message", ""),
                   "traceback": err.get("traceback", ""), "failed_ranks": sorted(errors)}
        elif code == 130:
            end = {"status": "stopped", "message": "stopped by torchrun (SIGTERM) or SIGINT"}
        else:
            end = {"status": "failed", "failed_rank": 0, "message": describe_exit(code)}
    with EventWriter(run_dir, LAUNCHER_RANK) as ev:
        ev.emit("run_end", launcher="torchrun", **end)


class _Ended:
    """The finished process a :class:`workbench.Run` asks about: here this rank's own exit code."""

    def __init__(self, code: int):
        self.pid, self.returncode = os.getpid(), code

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def _print_outcome(run_dir: str, job: Any, code: int, as_json: bool) -> None:
    """Rank 0's last word, as ``workbench train``'s: the run read back as a finished :class:`workbench.Run`
    (its ``run_end`` just written), printed by the same :func:`workbench.train.outcome.print_outcome`."""
    from workbench.train.launcher import Run
    from workbench.train.outcome import print_outcome

    run = Run(job, Path(run_dir), _Ended(code), Path(run_dir) / "events.jsonl")  # no launcher.log: torchrun prints
    print_outcome(run, as_json)
