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

import html
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from workbench.config import JobConfig, ModelConfig, ParallelConfig, TrainConfig, resolve_model, validate
from workbench.train.events import LAUNCHER_RANK, EventReader, follow


class RunFailed(RuntimeError):
    """A rank failed. ``rank`` names it; ``traceback`` is its Python traceback when it had one."""

    def __init__(self, rank: int | None, message: str, traceback: str = "", run_dir: str = ""):
        self.rank, self.message, self.traceback, self.run_dir = rank, message, traceback, run_dir
        where = f"rank {rank}" if rank is not None else "the launcher"
        super().__init__(f"{where} failed: {message}")


@dataclass
class RunError:
    rank: int | None
    message: str
    traceback: str

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "the launcher"
        return f"{where} failed: {self.message}"


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


class Run:
    """A launched job. Evaluate it in a notebook for a summary; ``run.metrics`` for the numbers."""

    def __init__(self, job: JobConfig, run_dir: Path, proc: subprocess.Popen, log_path: Path):
        self.job, self.run_dir, self._proc, self.log_path = job, run_dir, proc, log_path
        self.nproc = job.parallel.world_size
        self.started_at = time.time()
        self._stop_requested = False
        self._reader = EventReader(run_dir)
        self._events: list[dict[str, Any]] = []
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
        self._events.extend(self._reader.read_new())
        return self._events

    def _run_end(self) -> dict[str, Any] | None:
        for e in reversed(self._all_events()):
            if e["type"] == "run_end" and e["rank"] == LAUNCHER_RANK:
                return e
        return None

    @property
    def error(self) -> RunError | None:
        if not self.done or self.status != "failed":
            return None
        end = self._run_end()
        if end is None:  # the agent itself died before it could report
            tail = self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""
            return RunError(None, f"launcher exited with code {self.returncode}", tail)
        return RunError(end.get("failed_rank"), end.get("message", ""), end.get("traceback", ""))

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
            raise RunFailed(err.rank, err.message, err.traceback, str(self.run_dir))
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
        rows = [e for e in self._all_events() if e["type"] == "step"]
        cols = ["rank", "step", "loss", "tokens_per_s", "step_time_s", "mem_bytes", "grad_norm", "lr", "time"]
        if not rows:
            return pd.DataFrame(columns=cols)
        df = pd.DataFrame(rows)
        # the fixed columns first, then what some layouts add (peak_mem_bytes under pp, aux_loss for MoE)
        extra = [c for c in df.columns if c not in cols and c != "type"]
        ordered = [c for c in cols if c in df.columns] + extra
        return df[ordered].sort_values(["step", "rank"]).reset_index(drop=True)

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
        if len(df):
            r0 = df[df["rank"] == df["rank"].min()]
            out["first_loss"] = float(r0["loss"].iloc[0])
            out["final_loss"] = float(r0["loss"].iloc[-1])
            steady = r0.iloc[1:] if len(r0) > 1 else r0  # step 0 includes warm-up work
            out["tokens_per_s"] = float(steady["tokens_per_s"].median())
        err = self.error
        if err is not None:
            out["error"] = {"rank": err.rank, "message": err.message}
        return out

    def __repr__(self) -> str:
        return f"Run({self.job.model.name}, {self.job.parallel.describe()}, status={self.status}, dir={self.run_dir})"

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
            for k, v in s.items()
        )
        return f"<table><caption>Run</caption>{rows}</table>"


def _default_run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="workbench-run-"))


def build_job(
    model: str | Path | ModelConfig | dict = "tiny",
    *,
    nproc: int | None = None,
    parallel: ParallelConfig | None = None,
    train: TrainConfig | None = None,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    sequence_parallel: bool = False,
    zero: int = 3,
    ep: int = 1,
    pp: int = 1,
    pp_schedule: str = "1F1B",
    microbatches: int | None = None,
    **train_fields: Any,
) -> JobConfig:
    """Resolve and validate every setting; raises one ValueError naming the fix."""
    mcfg = resolve_model(model)
    pcfg = parallel or ParallelConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
                                      sequence_parallel=sequence_parallel, zero=zero, ep=ep,
                                      pp=pp, pp_schedule=pp_schedule, microbatches=microbatches)
    unknown = set(train_fields) - {f for f in TrainConfig.__dataclass_fields__}
    if unknown:
        raise ValueError(f"unknown training setting(s) {sorted(unknown)}; known: {sorted(TrainConfig.__dataclass_fields__)}")
    tcfg = train or TrainConfig(**train_fields)
    validate(mcfg, pcfg)  # model-shape problems first: they don't depend on nproc
    pcfg = pcfg.resolved(nproc)
    validate(mcfg, pcfg, tcfg)
    job = JobConfig(model=mcfg, parallel=pcfg, train=tcfg)
    check_fits_in_memory(job)
    return job


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits_in_memory(job: JobConfig, available: int | None = None) -> None:
    """Refuse a job whose training state cannot fit in this machine's memory, before starting it.

    Each rank holds its shard of fp32 weights, gradients and Adam's two moments (16 bytes/param), and
    every rank's model is first built whole (4 bytes/param) before it is sharded. Activations are
    extra; this is a floor, meant to catch "llama-70b on a laptop", not to plan memory.
    """
    if torch_cuda_available():
        return  # device memory is checked by the allocator, with a clear OOM message
    available = _available_memory_bytes() if available is None else available
    if available is None:
        return
    p = job.parallel
    n = job.model.n_params
    per_rank = n * 16 // (p.dp_shard * p.tp) + n * 4
    need = per_rank * p.world_size
    if need > 0.9 * available:
        raise ValueError(
            f"{job.model.name} ({n / 1e9:.2f}B params) needs at least {need / 2**30:.1f} GiB for weights, "
            f"grads and optimizer state on {p.world_size} local rank(s), but {available / 2**30:.1f} GiB is "
            f"available; choose a smaller model (e.g. tiny or small)"
        )


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _checkpoint_paths(job: JobConfig, run_dir: Path) -> JobConfig:
    """Make ``ckpt_dir``/``resume`` absolute (ranks may run elsewhere) and check the resume target now."""
    import dataclasses

    t = job.train
    if t.ckpt_dir is None and t.resume is None:
        return job
    ckpt_dir = str(Path(t.ckpt_dir).resolve()) if t.ckpt_dir else None
    resume = t.resume if t.resume in (None, "latest") else str(Path(t.resume).resolve())
    if resume is not None:
        from workbench.checkpoint.load import check_resume

        check_resume(resume, ckpt_dir or run_dir / "checkpoints", job.model)  # ValueError naming the problem
    return dataclasses.replace(job, train=dataclasses.replace(t, ckpt_dir=ckpt_dir, resume=resume))


def launch(
    model: str | Path | ModelConfig | dict = "tiny",
    *,
    out: str | Path | None = None,
    nproc: int | None = None,
    fail_at: dict[str, int] | None = None,
    **settings: Any,
) -> Run:
    """Validate, write ``RUN_DIR/config.json``, start torchrun, and return the live :class:`Run`.

    ``settings`` are ParallelConfig degrees (``dp_replicate``, ``dp_shard``, ``tp``, ``sequence_parallel``,
    ``zero``, ``pp``, ``pp_schedule``, ``microbatches``) or whole configs (``parallel=``, ``train=``), and TrainConfig fields (``steps``,
    ``global_batch``, ``micro_batch``, ``seq_len``, ``lr``, ``seed``, ``dtype``, ``data``,
    ``mixed_precision``, ``activation_checkpointing``, ``ac_every``, ...), and checkpointing
    (``ckpt_every``, ``ckpt_async``, ``zero_stall``, ``keep``, ``keep_every``, ``ckpt_dir``, ``ema``,
    ``resume="latest"`` or a path: a different layout than the one saved works).
    """
    job = build_job(model, nproc=nproc, **settings)
    if fail_at is not None:
        job = JobConfig(job.model, job.parallel, job.train, fail_at=fail_at)
    run_dir = Path(out) if out is not None else _default_run_dir()
    job = _checkpoint_paths(job, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stale = [p for p in ("events.jsonl",) if (run_dir / p).exists()]
    for p in stale:  # a reused directory starts a fresh event stream
        (run_dir / p).unlink()
    (run_dir / "config.json").write_text(json.dumps(job.to_dict(), indent=2))
    log_path = run_dir / "launcher.log"
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Let the children import workbench even when it is run from a source tree, not installed.
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.train.agent", str(run_dir), str(job.parallel.world_size)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: stop() reaches torchrun and every rank
        )
    return Run(job, run_dir, proc, log_path)


__all__ = ["launch", "build_job", "Run", "RunFailed", "RunError", "EventReader"]
