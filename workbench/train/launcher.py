"""``workbench.launch(...) -> Run``: the one code path behind the CLI, the dashboard and notebooks.

The job is validated in this process, before anything starts. Then ``RUN_DIR/config.json`` is written
and torchrun is started as a subprocess (``workbench.train.agent``). The ``Run`` follows the job through
``RUN_DIR/events.jsonl``::

    run = workbench.launch("tiny", nproc=2, tp=2, steps=20)
    for event in run.events(): ...     # live
    run.wait()                         # raises RunFailed naming the rank, with its traceback
    run.metrics                        # DataFrame: one row per (rank, step)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import html
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd

from workbench.config import DEVICES, JobConfig, ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.settings import make_configs, split_settings
from workbench.display import RendersInNotebook
from workbench.train.events import EVENTS_FILE, LAUNCHER_RANK, EventReader, follow, memory_summary
from workbench.train.nodes import node_settings
from workbench.train.outcome import RunFailed, root_cause
from workbench.train.resumed import Resumed
from workbench.train.rundir import RunDirInUse, check_outputs, check_reusable, clear_run

METRIC_COLUMNS = ["rank", "step", "loss", "tokens_per_s", "step_time_s", "mem_bytes", "grad_norm", "lr", "time"]
MEMORY_COLUMNS = ["rank", "step", "peak_bytes", "live_bytes", "source", "time"]


def _terminate_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _log_tail(path: Path, size: int = 4000) -> str:
    """The end of the run's launcher.log (the ranks print into it: it may be long), or "" if there is none or
    it is not a regular file of the run directory (:mod:`workbench.safeio`)."""
    from workbench import safeio

    try:
        with safeio.open_regular(safeio.confine(path.parent, path.name, path.parent, "launcher log")) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read(size).decode(errors="replace")
    except safeio.FileRefused:
        return ""


class Run(RendersInNotebook):
    """A launched job. Evaluate it in a notebook for a summary; ``run.metrics`` for the numbers.

    Everything a view shows is answered here, from the run's event stream: :attr:`status`,
    :meth:`history` (per-rank metrics), :meth:`root_cause` (the failing rank, its message and traceback),
    :attr:`started_ranks`, :attr:`resumed` and :attr:`start_step` (what a resumed run resumed from), and
    :meth:`events_since` for views that draw other events as they come.
    """

    def __init__(self, job: JobConfig, run_dir: Path, proc: subprocess.Popen, log_path: Path,
                 resume_target: Path | None = None):
        self.job, self.run_dir, self._proc, self.log_path = job, run_dir, proc, log_path
        self._resume_target = resume_target  # the checkpoint a resumed job named at launch (ranks may fall back)
        self.nproc = _local_ranks(job)  # this machine's ranks; the whole job has job.parallel.world_size
        self.started_at = time.time()
        self._stop_requested = False
        self._reader = EventReader(run_dir)
        self._events: list[dict[str, Any]] = []
        self._steps: dict[int, list[dict[str, Any]]] = {}  # rank -> its step events, in order
        self._memory: dict[int, list[dict[str, Any]]] = {}  # rank -> its memory events (runs with --memory)
        self._first_errors: dict[int, dict[str, Any]] = {}  # rank -> its first error event
        self._resume_events: dict[int, dict[str, Any]] = {}  # rank -> its resume event
        self._started: set[int] = set()
        self._read_lock = threading.Lock()  # a view's poller thread and the user's cell both read
        # If the Run is garbage-collected or the kernel exits, the ranks go with it.
        self._finalizer = weakref.finalize(self, _terminate_group, proc, 2.0)

    # -- state --------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    @property
    def done(self) -> bool:
        return self._proc.poll() is not None

    @property
    def status(self) -> str:
        """'running', 'succeeded', 'failed' or 'stopped'."""
        if not self.done:
            return "running"
        end = self._run_end()
        if end is not None and end["status"] == "succeeded":
            return "succeeded"
        if self._stop_requested:  # also when torchrun was stopped before it could say so itself
            return "stopped"
        if end is not None:
            return end["status"]
        return "succeeded" if self.returncode == 0 else "failed"

    def _all_events(self) -> list[dict[str, Any]]:
        """Every event so far; reads only what was appended since the last call."""
        with self._read_lock:
            new = self._reader.read_new()
            for e in new:
                kind, rank = e.get("type"), e.get("rank")
                if kind == "step":
                    self._steps.setdefault(rank, []).append(e)
                elif kind == "memory":
                    self._memory.setdefault(rank, []).append(e)
                elif kind == "error":
                    self._first_errors.setdefault(rank, e)
                elif kind == "start":
                    self._started.add(rank)
                elif kind == "resume":
                    self._resume_events.setdefault(rank, e)
            self._events.extend(new)
        return self._events

    def events_since(self, n: int = 0) -> list[dict[str, Any]]:
        """The events after the first ``n`` (read so far, in file order): a view keeps ``n`` and asks again."""
        return self._all_events()[n:]

    @property
    def started_ranks(self) -> set[int]:
        """The ranks that have started (built their process group)."""
        self._all_events()
        return set(self._started)

    @property
    def resumed(self) -> Resumed | None:
        """What this run resumed from (:class:`~workbench.train.resumed.Resumed`: the step, the checkpoint,
        the saved layout against this one), once its ranks have loaded the checkpoint; None for a run that
        does not resume, or before then (see :attr:`start_step`)."""
        self._all_events()
        if not self._resume_events:
            return None
        return Resumed.from_event(self._resume_events[min(self._resume_events)])

    @property
    def start_step(self) -> int:
        """The first step this run trains: 0, or the step it resumes from. Known at launch (the step of
        the checkpoint ``resume`` names); once the ranks have loaded it, the step they loaded (rank 0 may
        fall back past a damaged newest checkpoint)."""
        resumed = self.resumed
        if resumed is not None:
            return resumed.step
        if self._resume_target is not None:
            from workbench.checkpoint.store import parse_step

            return parse_step(self._resume_target.name) or 0
        return 0

    @property
    def init_from(self) -> dict[str, Any] | None:
        """Where the weights came from in a run started with ``init_from`` (None otherwise): the HF directory,
        and once the ranks have loaded it, the first rank's ``files``, ``tensors`` and ``load_s``, and the
        bytes each rank read (its own shard's rows: ``bytes_read`` by rank)."""
        if self.job.train.init_from is None:
            return None
        loaded = sorted((e for e in self._all_events() if e["type"] == "init_from"), key=lambda e: e["rank"])
        fields = {k: v for k, v in (loaded[0] if loaded else {}).items() if k not in ("type", "rank", "time")}
        if loaded:
            fields["bytes_read"] = {e["rank"]: e.get("bytes_read") for e in loaded}
        return {"path": self.job.train.init_from, **fields}

    def _run_end(self) -> dict[str, Any] | None:
        for e in reversed(self._all_events()):
            if e["type"] == "run_end" and e["rank"] == LAUNCHER_RANK:
                return e
        return None

    @property
    def error(self) -> RunFailed | None:
        """Why the run failed (not raised), once it has ended as "failed"; None otherwise."""
        if not self.done or self.status != "failed":
            return None
        return self.root_cause()

    def root_cause(self) -> RunFailed | None:
        """The rank to blame, its message and traceback (not raised), or None while no rank has failed.

        After a failed run: what the launcher decided (its ``run_end`` event). While the run goes on, or
        if it was stopped: the first rank that raised, by the same rule (``workbench.train.outcome``).
        """
        run_dir = str(self.run_dir)
        if self.done and self.status == "failed":
            end = self._run_end()
            if end is None:  # the agent itself died before it could report
                tail = _log_tail(self.log_path)
                return RunFailed(None, f"launcher exited with code {self.returncode}", tail, run_dir)
            # multi-node: failed_node names the node (and lost_ranks its ranks when it went away)
            return RunFailed(end.get("failed_rank"), end.get("message", ""), end.get("traceback", ""), run_dir,
                             node=end.get("failed_node"), ranks=end.get("lost_ranks"))
        self._all_events()
        rank = root_cause(self._first_errors)
        if rank is None:
            return None
        e = self._first_errors[rank]
        return RunFailed(rank, e.get("message", ""), e.get("traceback", ""), run_dir, node=e.get("node"))

    # -- control ------------------------------------------------------------------------------
    def events(self, poll_s: float = 0.1) -> Iterator[dict[str, Any]]:
        """Every event of the run, from the first, live until the job ends. Ctrl-C / kernel interrupt stops the job."""
        try:
            yield from follow(self.run_dir, lambda: self.done, poll_s)
        except KeyboardInterrupt:
            self.stop()
            raise

    def wait(self, timeout: float | None = None, raise_on_error: bool = True) -> "Run":
        """Block until the job ends. Raises RunFailed (naming the rank) if it failed, TimeoutError on timeout."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"run in {self.run_dir} did not finish within {timeout} s; it was stopped") from None
        except KeyboardInterrupt:
            self.stop()
            raise
        err = self.error
        if err is not None and raise_on_error:
            raise err
        return self

    def stop(self, grace_s: float = 5.0) -> "Run":
        """Stop every rank (SIGTERM to torchrun, which stops its workers; SIGKILL after ``grace_s``)."""
        if not self.done:
            self._stop_requested = True
        _terminate_group(self._proc, grace_s)
        return self

    # -- results ------------------------------------------------------------------------------
    @property
    def metrics(self) -> pd.DataFrame:
        """One row per (rank, step): loss, tokens_per_s, step_time_s, mem_bytes, grad_norm, lr, time, and any
        layout-specific fields (``peak_mem_bytes`` for pipeline runs, ``aux_loss`` for mixture of experts)."""
        self._all_events()
        rows = [e for steps in self._steps.values() for e in steps]
        if not rows:
            return pd.DataFrame(columns=METRIC_COLUMNS)
        return _metric_frame(rows).sort_values(["step", "rank"]).reset_index(drop=True)

    def history(self) -> dict[int, pd.DataFrame]:
        """Per-rank metrics so far: ``rank -> frame`` with one row per logged step, in step order (the
        columns of :attr:`metrics`). Live: call it again for what has arrived since."""
        self._all_events()
        return {rank: _metric_frame(steps) for rank, steps in sorted(self._steps.items())}

    def memory_history(self) -> pd.DataFrame:
        """Memory per (rank, step) so far, one row each, in (rank, step) order: ``peak_bytes`` within the
        step and ``live_bytes`` at its end, plus bytes per category at the peak (one column per category,
        NaN where unknown). ``source`` says where a row comes from: ``memory`` (the rank's ``memory``
        event, written by runs with ``--memory``), else ``peak_mem_bytes`` (the pipeline's peak probe) or
        ``mem_bytes`` (the step event: the device's peak allocation on CUDA, the resident set on CPU);
        those two have no ``live_bytes``. Live: call it again for what has arrived since."""
        self._all_events()
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        for rank, steps in self._steps.items():
            for e in steps:
                key = "peak_mem_bytes" if e.get("peak_mem_bytes") is not None else "mem_bytes"
                if e.get(key) is not None:
                    rows[rank, e["step"]] = {"rank": rank, "step": e["step"], "peak_bytes": e[key],
                                             "live_bytes": None, "source": key, "time": e.get("time")}
        for rank, events in self._memory.items():
            for e in events:
                rows[rank, e["step"]] = {"rank": rank, "step": e["step"], "peak_bytes": e.get("peak_bytes"),
                                         "live_bytes": e.get("live_bytes"), "source": "memory",
                                         "time": e.get("time"), **(e.get("by_category") or {})}
        if not rows:
            return pd.DataFrame(columns=MEMORY_COLUMNS)
        df = pd.DataFrame([rows[k] for k in sorted(rows)])
        return df[MEMORY_COLUMNS + [c for c in df.columns if c not in MEMORY_COLUMNS]]

    def losses(self, rank: int = 0) -> list[float]:
        df = self.metrics
        return df[df["rank"] == rank]["loss"].tolist()

    def summary(self) -> dict[str, Any]:
        df = self.metrics
        out: dict[str, Any] = {
            "run_dir": str(self.run_dir),
            "status": self.status,
            "model": self.job.model.name,
            "layout": self.job.parallel.describe(),
            "nproc": self.nproc,
            "steps_logged": int(df["step"].nunique()) if len(df) else 0,
        }
        resumed = self.resumed
        if resumed is not None:
            out["resumed_from"] = resumed.to_dict()
        if self.job.train.init_from is not None:
            out["init_from"] = self.init_from
        if self.job.nodes:
            out["nodes"] = self.nodes()
        if len(df):
            r0 = df[df["rank"] == df["rank"].min()]
            out["first_loss"] = float(r0["loss"].iloc[0])
            out["final_loss"] = float(r0["loss"].iloc[-1])
            steady = r0.iloc[1:] if len(r0) > 1 else r0  # step 0 includes warm-up work
            out["tokens_per_s"] = float(steady["tokens_per_s"].median())
            if "mfu" in steady and steady["mfu"].notna().any():  # None where the device's peak is unknown
                out["mfu"] = float(steady["mfu"].median())
            if "tflops" in steady:
                out["tflops_per_rank"] = float(steady["tflops"].median())
        # "peak" means one thing everywhere (workbench.train.events.memory_summary, the run tab's rule too):
        # a recorded peak; on CPU a step's mem_bytes is the process's resident set, rss_bytes, never a peak.
        memory = memory_summary(self._all_events())
        for key in ("peak_mem_bytes", "rss_bytes"):
            if key in memory:
                out[key] = memory[key]
        err = self.error
        if err is not None:
            out["error"] = {"rank": err.rank, "message": err.message,
                            **({"node": err.node} if err.node is not None else {})}
        return out

    def nodes(self) -> dict[str, Any] | None:
        """A multi-node run's nodes (None on one node): the settings every node shares, this node's
        ``node_rank``, ``host`` and global ``ranks``, and ``hosts`` (node -> host) once every node's
        ranks have started."""
        if not self.job.nodes:
            return None
        events = self._all_events()
        info: dict[str, Any] = {k: v for k, v in self.job.nodes.items()}
        info["world_size"] = self.job.parallel.world_size
        info["host"] = next((e["host"] for e in events if e["type"] == "launch" and "host" in e), None)
        ranks = sorted(self._started) or None
        listed = next((e["nodes"] for e in reversed(events) if e["type"] == "nodes"), None)
        if listed:
            info["hosts"] = {int(n): e["host"] for n, e in listed.items()}
            ranks = listed.get(str(self.job.nodes["node_rank"]), {}).get("ranks") or ranks
        info["ranks"] = ranks
        return info

    def __repr__(self) -> str:
        return f"Run({self.job.model.name}, {self.job.parallel.describe()}, status={self.status}, dir={self.run_dir})"

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in s.items()
        )
        return f"<table><caption>Run</caption>{rows}</table>"


def _metric_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    # the fixed columns first, then what some layouts add (peak_mem_bytes under pp, aux_loss for MoE)
    extra = [c for c in df.columns if c not in METRIC_COLUMNS and c != "type"]
    return df[[c for c in METRIC_COLUMNS if c in df.columns] + extra]


def _local_ranks(job: JobConfig) -> int:
    """The ranks one machine runs: all of them, or the world's share of one node in a multi-node job."""
    return job.parallel.world_size // (job.nodes["nnodes"] if job.nodes else 1)


def _default_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="workbench-run-"))


def build_job(
    model: str | Path | ModelConfig | dict = "tiny",
    *,
    nproc: int | None = None,
    nnodes: int = 1,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    **settings: Any,
) -> JobConfig:
    """Resolve and validate every setting; raises one ValueError naming the fix.

    ``settings`` are shortcuts for single fields of either config (``tp=2``, ``steps=20``); they are
    applied over ``parallel``/``train`` (default: the configs' defaults). The model's settings
    (``dropout=0.1``) are applied over the model. ``nproc`` is the processes per node (torchrun's
    ``--nproc-per-node``; the world is ``nproc x nnodes``). The device preflight runs here, before any
    process starts (:func:`resolve_device`: ``device`` against this machine's GPUs for its
    ``nproc`` local ranks), and so does ``kernels`` for that device; both choices are recorded in the
    job (``config.json``), and what cannot run is refused with one line naming the fix.
    """
    parts = split_settings(settings, ("parallel", "train", "model"), what="training setting")
    mcfg = resolve_model(model)
    if parts["model"]:
        mcfg = dataclasses.replace(mcfg, **parts["model"])
    pcfg, tcfg = make_configs(parallel, train, what="training setting", **parts["parallel"], **parts["train"])
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes={nnodes!r} must be a positive integer (the machines in the job)")
    if nproc is not None and (isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1):
        raise ValueError(f"nproc={nproc!r} must be a positive integer (processes per node)")
    validate(mcfg, pcfg)  # model-shape problems first: they don't depend on nproc
    pcfg = pcfg.resolved(None if nproc is None else nproc * nnodes)
    validate(mcfg, pcfg, tcfg)
    if tcfg.init_from is not None:  # the HF directory checked against the model now (headers only), made absolute
        from workbench.checkpoint.hf_init import check_init_from

        tcfg = dataclasses.replace(tcfg, init_from=check_init_from(tcfg.init_from, mcfg)["path"])
    world = pcfg.world_size
    if world % nnodes:
        raise ValueError(f"the layout {pcfg.describe()} has {world} ranks, which {nnodes} nodes cannot share "
                         f"equally; choose degrees whose product is a multiple of --nnodes {nnodes}")
    device = resolve_device(tcfg.device, world // nnodes)
    job = JobConfig(model=mcfg, parallel=pcfg, train=tcfg, kernels=_resolve_kernels(tcfg.kernels, device),
                    device=device)
    check_fits_in_memory(job, nnodes=nnodes)
    return job


def visible_gpus() -> int:
    """The CUDA GPUs this process can use (0 without a CUDA build of torch, or without a driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(choice: str, local_ranks: int, gpus: int | None = None) -> str:
    """The device preflight: where ``local_ranks`` ranks of this machine train, 'cuda' or 'cpu'.

    ``cuda`` needs a GPU for every local rank (NCCL, one device each); ``cpu`` always works (gloo, also
    on a GPU machine); ``auto`` is cuda when there is a GPU for every local rank and cpu when there is
    none, and refuses in between rather than guess (``WORKBENCH_DEVICE=cpu`` makes auto mean cpu).
    ``gpus`` defaults to :func:`visible_gpus`. Raises ValueError with one line naming both numbers
    and the fixes.
    """
    if choice not in DEVICES:
        raise ValueError(f"device={choice!r}; choose one of {', '.join(DEVICES)}")
    if choice == "cpu" or (choice == "auto" and os.environ.get("WORKBENCH_DEVICE", "") == "cpu"):
        return "cpu"
    gpus = visible_gpus() if gpus is None else gpus
    if gpus == 0:
        if choice == "auto":
            return "cpu"
        import torch

        why = ("this torch has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise ValueError(f"--device cuda needs a GPU, but {why}; use --device cpu to run on CPU (gloo)")
    if local_ranks > gpus:
        raise ValueError(f"--nproc {local_ranks} needs {local_ranks} GPUs, this machine has {gpus}; use --nproc "
                         f"{gpus}, or --device cpu to run {local_ranks} ranks on CPU (gloo)")
    return "cuda"


def agent_env(job: JobConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of torchrun's agent and so of every rank. Children import this workbench also
    when it runs from a source tree. A CPU job hides the GPUs (``CUDA_VISIBLE_DEVICES=""``): its ranks
    fork from the agent, and a process forked after anything touched the CUDA driver (torch's optimizers
    ask whether a CUDA graph is being captured) fails with "CUDA error: initialization error"."""
    env = dict(os.environ if base is None else base)
    env.setdefault("PYTHONUNBUFFERED", "1")
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if job_device(job) == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def job_device(job: JobConfig) -> str:
    """Where ``job``'s ranks train: its recorded ``device``; a config.json written before devices were
    recorded follows the old rule (a GPU if there is one, unless ``WORKBENCH_DEVICE=cpu``)."""
    if job.device is not None:
        return job.device
    import torch

    return "cuda" if torch.cuda.is_available() and os.environ.get("WORKBENCH_DEVICE", "") != "cpu" else "cpu"


def _resolve_kernels(choice: str, device: str) -> str:
    """What ``--kernels`` means on the ranks' device ('triton' or 'torch'); a ValueError with the reason
    where it cannot run (``kernels='triton'`` without a usable Triton)."""
    from workbench import kernels

    try:
        return kernels.resolve(choice, device)
    except kernels.KernelUnavailable as e:
        raise ValueError(str(e)) from None


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def training_state_bytes(job: JobConfig) -> int:
    """Bytes of training state the job's ranks hold together on this machine (all of them are local):
    each rank's total from the job's simulated :class:`~workbench.plan.ShardingPlan` (its shard of
    weights, gradients, AdamW moments and fp32 masters), summed over ranks."""
    from workbench.plan import plan

    return int(plan(job.model, job.parallel, job.train).rank_bytes()["total"].sum())


def memory_shortfall(job: JobConfig, available: int | None = None, nnodes: int | None = None) -> str | None:
    """The one memory-feasibility rule: why ``job`` cannot fit in this machine's memory, or None.

    The need is what the plan says this machine's ranks hold (:func:`training_state_bytes`; of
    ``nnodes`` machines, default ``job.nodes``, each runs world/nnodes ranks, and which ones is
    torchrun's choice, so each counts as the plan's largest); ranks build only their own shards, so
    nothing larger is ever allocated while the model is set up. Activations are extra: this is a floor,
    meant to catch "llama-70b on a laptop", not to plan memory. Jobs that train on CUDA devices are
    left to the allocator, whose OOM message is clear.
    """
    if job_device(job) == "cuda":
        return None
    available = _available_memory_bytes() if available is None else available
    if available is None:
        return None
    nnodes = nnodes or (job.nodes or {}).get("nnodes", 1)
    local = job.parallel.world_size // nnodes
    # Fast path, same verdict: no rank holds more than every parameter in 5 copies (weight, gradient,
    # 2 AdamW moments, master) of at most 8 bytes, so if that fits, the plan's smaller need fits too.
    if job.model.n_params * 5 * 8 * local <= 0.9 * available:
        return None
    if nnodes == 1:
        need = training_state_bytes(job)
    else:
        from workbench.plan import plan

        need = int(plan(job.model, job.parallel, job.train).rank_bytes()["total"].max()) * local
    if need <= 0.9 * available:
        return None
    n = job.model.n_params
    return (f"{job.model.name} ({n / 1e9:.2f}B params) needs at least {need / 2**30:.1f} GiB for weights, grads "
            f"and optimizer state on {local} local rank(s), but {available / 2**30:.1f} GiB is available; "
            "choose a smaller model (e.g. tiny or small)")


def check_fits_in_memory(job: JobConfig, available: int | None = None, nnodes: int | None = None) -> None:
    """Refuse a job whose training state cannot fit in this machine's memory, before starting it
    (ValueError with :func:`memory_shortfall`'s one line)."""
    problem = memory_shortfall(job, available, nnodes)
    if problem is not None:
        raise ValueError(problem)


TASK_FILE = "task.json"  # {"name", "entry": "module:function"} of a run that is not language modelling


@dataclass(frozen=True)
class Task:
    """A training loop other than language modelling, run by the same launcher, agent and ranks.

    The launcher knows nothing of it but this: ``build(model, nproc=, nnodes=, parallel=, train=,
    **settings) -> JobConfig`` validates the settings (one ValueError) before anything starts; ``files``
    are written into the run directory; each rank calls ``entry`` (``"module:function"``, imported in the
    rank) as ``function(job, run_dir)`` instead of the trainer; ``model_state(job)`` is the state dict (on
    meta) a ``resume`` checkpoint's ``model.*`` keys are checked against. The task's package depends on
    ``workbench.train``, never the other way (``workbench.embedding.embedding_task`` is one).
    """

    name: str
    entry: str
    build: Callable[..., JobConfig]
    files: dict[str, str] = field(default_factory=dict)
    model_state: Callable[[JobConfig], dict] | None = None


def _checkpoint_paths(job: JobConfig, run_dir: Path, model_state: dict | None = None) -> tuple[JobConfig, Path | None]:
    """Make ``ckpt_dir``/``resume`` absolute (ranks may run elsewhere) and check the resume target now
    (against ``model_state``, a meta state dict, when the job trains more than the model). Returns the job
    and the checkpoint it resumes from (None when it does not)."""
    t = job.train
    if t.ckpt_dir is None and t.resume is None:
        return job, None
    ckpt_dir = str(Path(t.ckpt_dir).resolve()) if t.ckpt_dir else None
    resume = t.resume if t.resume in (None, "latest") else str(Path(t.resume).resolve())
    target = None
    if resume is not None:
        from workbench.checkpoint.load import check_resume

        target = check_resume(resume, ckpt_dir or run_dir / "checkpoints", job.model, model_state)  # ValueError naming the problem
    return dataclasses.replace(job, train=dataclasses.replace(t, ckpt_dir=ckpt_dir, resume=resume)), target


def launch(
    model: str | Path | ModelConfig | dict = "tiny",
    *,
    out: str | Path | None = None,
    nproc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_timeout_s: float | None = None,
    parallel: ParallelConfig | dict | None = None,
    train: TrainConfig | dict | None = None,
    fail_at: dict[str, int] | None = None,
    overwrite: bool = False,
    adopt_ckpt_dir: bool = False,
    task: "Task | None" = None,
    **settings: Any,
) -> Run:
    """Validate, write ``RUN_DIR/config.json``, start torchrun, and return the live :class:`Run`.

    ``out`` is the run directory (default: a fresh temporary one). One that already holds a run (a
    ``config.json`` or ``events.jsonl``) is refused with a ValueError (:class:`RunDirInUse`) unless the
    job resumes (``resume=...``), which starts a fresh event stream there, or ``overwrite=True``, which
    deletes the earlier run first: its events, config, logs, memory timelines and checkpoints (those are
    kept when the job also resumes; :mod:`workbench.train.rundir`).

    Before anything is written: ``out`` and the checkpoint directory (``ckpt_dir``, default
    ``out/checkpoints``) must be writable with room for a checkpoint, and the checkpoint directory must
    be this run's: one that another run saves into is refused (ValueError) unless ``adopt_ckpt_dir=True``
    makes this run its owner. Resuming from another run's checkpoint into a directory of this run's own
    needs nothing more.

    ``parallel`` and ``train`` are the configs (:class:`ParallelConfig`, :class:`TrainConfig`).
    ``settings`` are shortcuts for any of their fields (``tp=2``, ``steps=20``, ``resume="latest"``),
    applied over them; ``nproc`` fills ``dp_shard=-1`` (default: the product of the degrees).

    Several machines: call it on each with the same arguments but ``node_rank`` (0..nnodes-1).
    ``nproc`` is then the processes per node (world size ``nproc * nnodes``); node 0 hosts torchrun's
    c10d rendezvous at ``rdzv_endpoint`` (``"HOST:PORT"``, an address of node 0 every node reaches);
    ``rdzv_id`` names the job there (default ``"workbench"``, the same everywhere); a node waits
    ``rdzv_timeout_s`` for the others (default ``$WORKBENCH_RDZV_TIMEOUT_S`` or 300 s). Each node writes
    its own run directory: give each its own ``out`` (see docs/multinode.md).

    ``task``: another training loop on the same ranks, events, checkpoints and :class:`Run` (a
    :class:`Task`, e.g. ``workbench.embedding.embedding_task(...)``); None trains the language model.
    """
    nodes = node_settings(nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout_s)
    build = task.build if task is not None else build_job
    job = build(model, nproc=nproc, nnodes=nnodes, parallel=parallel, train=train, **settings)
    if fail_at is not None:
        job = dataclasses.replace(job, fail_at=fail_at)
    if nodes is not None:
        job = dataclasses.replace(job, nodes=nodes)
    run_dir = Path(out) if out is not None else _default_run_dir()
    job, resume_target = prepare_run_dir(job, run_dir, overwrite=overwrite, adopt_ckpt_dir=adopt_ckpt_dir, task=task)
    log_path = run_dir / "launcher.log"
    env = agent_env(job)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.train.agent", str(run_dir), str(_local_ranks(job))],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: stop() reaches torchrun and every rank
        )
    return Run(job, run_dir, proc, log_path, resume_target)


def prepare_run_dir(job: JobConfig, run_dir: Path, *, overwrite: bool = False, adopt_ckpt_dir: bool = False,
                    task: "Task | None" = None) -> tuple[JobConfig, Path | None]:
    """Make ``run_dir`` this job's, as :func:`launch` describes (refusals first, one ValueError each; then
    the earlier run cleared if ``overwrite``, the directories claimed, ``config.json`` written): what
    ``launch`` does before it starts torchrun, and what rank 0 does under plain torchrun
    (:mod:`workbench.train.torchrun_rank`). Returns the job as the ranks will read it (checkpoint paths made
    absolute) and the checkpoint it resumes from (None when it does not)."""
    if task is not None and job.train.init_from is not None:
        raise ValueError(f"init_from loads a language model's weights; the {task.name} task does not take them")
    check_reusable(run_dir, resume=job.train.resume is not None, overwrite=overwrite)
    expected = (task.model_state(job) if task is not None and task.model_state is not None
                and job.train.resume is not None else None)
    job, resume_target = _checkpoint_paths(job, run_dir, expected)
    # The last checks (nothing is deleted or written before them): room, writability, whose checkpoints.
    outputs = check_outputs(run_dir, job, overwrite=overwrite, adopt=adopt_ckpt_dir, resume_target=resume_target,
                            claims=(job.nodes or {}).get("node_rank", 0) == 0)
    if overwrite:  # the earlier run goes, checkpoints included unless this job resumes from them
        clear_run(run_dir, keep_checkpoints=job.train.resume is not None)
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs.claim()
    if (run_dir / EVENTS_FILE).exists():  # a resumed run starts a fresh event stream
        (run_dir / EVENTS_FILE).unlink()
    (run_dir / "config.json").write_text(json.dumps(job.to_dict(), indent=2))
    if task is not None:  # the ranks' worker runs the task's loop when this file is there
        for name, text in task.files.items():
            (run_dir / name).write_text(text)
        (run_dir / TASK_FILE).write_text(json.dumps({"name": task.name, "entry": task.entry}))
    else:
        (run_dir / TASK_FILE).unlink(missing_ok=True)
    return job, resume_target


__all__ = ["launch", "build_job", "Run", "RunFailed", "RunDirInUse", "EventReader", "Task"]
