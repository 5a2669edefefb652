"""Saving train state: synchronous, asynchronous, and zero-stall; plus an EMA of the weights.

What blocks the training loop in each mode (``blocking_s`` of the ``checkpoint`` event)::

    sync        [ DCP writes the live tensors ][ hash ][ publish ]              all of it
    async       [ copy to host buffers ] -> writer thread: [ DCP write ][ hash ][ publish ]
    zero-stall  every step: [ copy into one of two host buffer sets ]
                every N steps: hand that step's snapshot to the writer thread (no second copy)

Host buffers are allocated once (pinned on CUDA) and reused. At most one save is in flight: a save
that finds the previous one still writing waits for it (that wait counts as blocking). Zero-stall mode
double-buffers, so the per-step snapshot never overwrites the set being written. The writer runs DCP
over a process group of its own (gloo), so its collectives never interleave with training's.

A writer that fails emits a ``checkpoint`` event with ``status: "failed"`` at once, and the training
loop raises :class:`CheckpointError` at its next checkpoint call (or at ``close()``), which the worker
reports as the rank's ``error`` event: a failed save is never silent.

EMA (``ema_decay = d``): after every optimizer step ``e <- d * e + (1 - d) * w``, kept in fp32 with the
same sharding as ``w`` (each rank updates its own shard; no communication). Saved as ``ema.<fqn>``.
"""

from __future__ import annotations

import datetime as _dt
import io
import threading
import time
import traceback
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from workbench.checkpoint.state import TrainState
from workbench.checkpoint.store import CHECKSUM, FORMAT, VERSION, CheckpointStore, file_digest, new_hash

__all__ = ["EMA", "Checkpointer", "CheckpointError", "HostBuffers", "HashingFileSystem", "save", "manifest_base"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message names the step and the cause."""


# -- EMA -------------------------------------------------------------------------------------------


class EMA:
    """fp32 exponential moving average of a model's weights, sharded like the weights."""

    def __init__(self, view: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay={decay} must be in (0, 1), e.g. 0.999")
        self.decay = decay
        self.params: list[tuple[str, torch.Tensor]] = []
        self.shadow: dict[str, torch.Tensor] = {}
        from workbench.compat import get_fqns as _get_fqns

        for name, p in view.named_parameters():
            fqn = next(iter(_get_fqns(view, name)))  # strips DDP / activation-checkpoint prefixes
            self.params.append((fqn, p))
            self.shadow[fqn] = p.detach().to(torch.float32).clone()

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    @torch.no_grad()
    def update(self) -> None:
        shadows = [self._local(self.shadow[f]) for f, _ in self.params]
        weights = [self._local(p.detach()).to(torch.float32) for _, p in self.params]
        torch._foreach_lerp_(shadows, weights, 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average again from the current weights."""
        for fqn, p in self.params:
            self._local(self.shadow[fqn]).copy_(self._local(p.detach()))

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for fqn, t in sd.items():
            if self.shadow[fqn] is not t:
                self._local(self.shadow[fqn]).copy_(self._local(t))


# -- host staging ----------------------------------------------------------------------------------


class HostBuffers:
    """Preallocated host copies of a nested state dict; ``stage(sd)`` copies into them and returns a
    state dict of the same structure (DTensors rewrapped around the host shards)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def _buffer(self, key: str, local: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            pin = local.device.type == "cuda"
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
            self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers.values())
        return buf

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        out = self._stage(sd, "")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the async copies must land before the writer reads
        return out

    def _stage(self, sd: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in sd.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out[k] = self._stage(v, key + ".")
            elif isinstance(v, DTensor):
                local = v.to_local()
                buf = self._buffer(key, local)
                buf.copy_(local.detach(), non_blocking=local.is_cuda)
                out[k] = DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False,
                                            shape=v.shape, stride=v.stride())
            elif isinstance(v, torch.Tensor):
                buf = self._buffer(key, v)
                buf.copy_(v.detach(), non_blocking=v.is_cuda)
                out[k] = buf
            else:
                raise TypeError(f"checkpoint state {key!r} is a {type(v).__name__}, not a tensor; "
                                "store it as a tensor (loading never unpickles objects)")
        return out


def _check_tensors(sd: dict[str, Any], prefix: str = "") -> None:
    for k, v in sd.items():
        if isinstance(v, dict):
            _check_tensors(v, f"{prefix}{k}.")
        elif not isinstance(v, torch.Tensor):
            raise TypeError(f"checkpoint state {prefix}{k!r} is a {type(v).__name__}, not a tensor")


# Threads each rank writes its shards with (DCP splits the rank's items into one file per thread; writes,
# fsyncs and XXH3 release the GIL). DCP's write of the small preset's 305 MB with fsync, 2 cores, 6
# interleaved repeats (2026-11-23): median 0.61 s with 1 thread, 0.50 s with 2, 0.51 s with 4 (0.44 s with
# 1 thread and no fsync); more than 2 gains nothing there, and a multi-rank run shares the cores.
WRITE_THREADS = 2


# -- checksums while writing ---------------------------------------------------------------------


class _HashingStream(io.RawIOBase):
    """A write stream that feeds every byte written to a hash on its way to the file.

    DCP writes a shard front to back (``torch.save`` into the stream, or raw bytes); a seek would break
    the correspondence of hashed and stored bytes, so it marks the digest unusable (the file is then
    hashed from disk instead).
    """

    def __init__(self, raw: io.IOBase):
        super().__init__()
        self.raw, self.hash, self.n, self.sequential = raw, new_hash(), 0, True

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self.hash.update(view[:n])
        self.n += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = self.raw.seek(offset, whence)
        self.sequential = self.sequential and pos == self.n
        return pos

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes (through self.flush) while the file is still open
            self.raw.close()


class HashingFileSystem(FileSystem):
    """DCP's local filesystem, hashing each file as it is written: ``digests[name] = (bytes, hex)``.

    Set it as a ``FileSystemWriter``'s ``fs``. Renames (DCP writes ``.metadata.tmp`` then renames it) carry
    the digest along. A file written out of order gets no digest.
    """

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
            if stream.sequential:
                with self._lock:
                    self.digests[Path(path).name] = (stream.n, stream.hash.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


# -- one save --------------------------------------------------------------------------------------


def _write_and_publish(sd: dict[str, Any], store: CheckpointStore, step: int, nonce: str, manifest: dict,
                       rank: int, world: int, group, keep: int | None, keep_every: int) -> dict[str, Any]:
    """DCP-write ``sd`` into the step's tmp dir (fsynced), hashing this rank's files as they are written,
    and publish (rank 0).

    Runs on every rank (in the writer thread for async saves). Returns what rank 0 publishes.
    """
    tmp = store.tmp_path(step, nonce)
    if rank == 0:
        store.root.mkdir(parents=True, exist_ok=True)
        store.clean_stale(keep_tmp=tmp.name)
    tmp.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        writer = FileSystemWriter(tmp, sync_files=True, thread_count=WRITE_THREADS)
        writer.fs = HashingFileSystem()
        dcp.save(sd, storage_writer=writer, process_group=group, no_dist=group is None)
    mine = sorted(p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_"))
    if rank == 0:
        mine.append(".metadata")
    # DCP's sync_files=True has fsynced every shard and .metadata; each rank lists its own files' digests,
    # taken while writing. A file with none (written out of order), or whose size disagrees, is read back.
    files = {}
    for name in mine:
        got = writer.fs.digests.get(name)
        if got is None or got[0] != (tmp / name).stat().st_size:
            got = file_digest(tmp / name, algo=CHECKSUM)
        files[name] = {"bytes": got[0], CHECKSUM: got[1]}
    if group is not None and world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(files, gathered, dst=0, group=group)
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
    if rank != 0:
        return {}
    doc = dict(manifest, step=step, checksum=CHECKSUM, files=dict(sorted(files.items())),
               created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    final = store.publish(tmp, step, doc)
    removed = store.rotate(keep, keep_every)
    return {"path": str(final), "bytes": sum(f["bytes"] for f in files.values()), "rotated": removed}


def save(path: str | Path, state: TrainState, manifest: dict | None = None, *, process_group=None,
         keep: int | None = None, keep_every: int = 0) -> Path:
    """Synchronously save ``state`` as ``<path>/step-NNNNNN/`` (``path`` is the checkpoints dir).

    Works without a process group (one process). All ranks of ``process_group`` must call it.
    """
    group = process_group if dist.is_initialized() else None
    if dist.is_initialized() and group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    nonce = _shared_nonce(group)
    sd = state.state_dict()
    _check_tensors(sd)
    base = {**manifest_base(world, kinds=state.kinds(), ema=state.ema is not None), **(manifest or {}),
            "consumed_samples": state.consumed_samples, "world_size": world}
    store = CheckpointStore(Path(path))
    out = _write_and_publish(sd, store, state.step, nonce, base, rank, world, group, keep, keep_every)
    return Path(out["path"]) if rank == 0 else store.path(state.step)


def manifest_base(world: int, *, kinds: list[str], ema: bool, job: dict | None = None,
                  layout: dict | None = None, step: int = 0, consumed_samples: int = 0) -> dict[str, Any]:
    """The manifest's fields that do not depend on the files (``files`` and ``created`` come at publish)."""
    train = (job or {}).get("train", {})
    if train.get("mixed_precision") == "bf16":
        master = "model (the parameters are the fp32 master weights)"
    elif train.get("dtype") == "bfloat16":
        master = "none (pure bfloat16 training has no fp32 master weights)"
    else:
        master = "model (float32 training: the parameters are the only weights)"
    return {"format": FORMAT, "version": VERSION, "step": step, "consumed_samples": consumed_samples,
            "world_size": world, "layout": layout or {}, "job": job or {}, "kinds": list(kinds),
            "ema": bool(ema), "master_weights": master}


def _shared_nonce(group) -> str:
    """A random tag all ranks agree on (names this session's tmp directories)."""
    obj = [uuid.uuid4().hex[:8]]
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0), group=group)
    return obj[0]


# -- the trainer's checkpointer ------------------------------------------------------------------


class Checkpointer:
    """Periodic saves for a training loop: ``after_step(state)`` once per step, ``close()`` at the end.

    ``every``: save when ``state.step % every == 0``; ``mode``: "sync", "async" or "zero_stall".
    ``emit(type, **fields)`` receives the ``checkpoint`` events (rank 0 emits them).
    """

    def __init__(self, root: str | Path, *, every: int, mode: str = "sync", keep: int | None = None,
                 keep_every: int = 0, manifest: dict | None = None, emit: Callable[..., Any] | None = None):
        if mode not in ("sync", "async", "zero_stall"):
            raise ValueError(f"checkpoint mode={mode!r} is unknown; choose sync, async or zero_stall")
        self.store = CheckpointStore(Path(root))
        self.every, self.mode, self.keep, self.keep_every = every, mode, keep, keep_every
        self.manifest = manifest or {}
        self.emit = emit or (lambda *a, **k: None)
        self.distributed = dist.is_initialized()
        # A process group of the checkpointer's own: the writer thread's collectives never meet training's.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.nonce = _shared_nonce(self.group)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer") if mode != "sync" else None
        self._inflight: Future | None = None
        self._failure: str | None = None
        self._buffers = [HostBuffers()] + ([HostBuffers()] if mode == "zero_stall" else [])
        self._snap: dict[str, Any] | None = None  # zero-stall: the newest snapshot,
        self._snap_index = 0  # the buffer set the next snapshot goes to,
        self._snap_buffer = 0  # and the set the newest snapshot is in
        self._lock = threading.Lock()
        self.saves: list[dict[str, Any]] = []

    # -- failure handling ------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        with self._lock:
            failure, self._failure = self._failure, None
        if failure:
            raise CheckpointError(failure)

    def _wait_inflight(self) -> None:
        if self._inflight is not None:
            try:
                self._inflight.result()
            except Exception:  # noqa: BLE001 - already recorded by the writer job
                pass
            self._inflight = None
        self._raise_if_failed()

    # -- the loop's calls ------------------------------------------------------------------------
    def after_step(self, state: TrainState) -> None:
        """Snapshot (zero-stall) and/or save if ``state.step`` is a multiple of ``every``."""
        due = self.every > 0 and state.step % self.every == 0
        if self.mode == "zero_stall":
            t0 = time.perf_counter()
            if due:  # at most one save in flight (the snapshot below goes to the set it is not writing)
                self._wait_inflight()
            self._snapshot(state)
            if due:
                self._submit(self._snap, state, time.perf_counter() - t0, t0)
            return
        if due:
            self.save(state)

    def _snapshot(self, state: TrainState) -> None:
        # Write into the set the writer is not using: the other one than the last handed over.
        buf = self._buffers[self._snap_index]
        self._snap = buf.stage(state.state_dict())
        self._snap_buffer = self._snap_index

    def save(self, state: TrainState) -> None:
        t0 = time.perf_counter()
        if self.mode == "sync":
            self._raise_if_failed()
            sd = state.state_dict()
            _check_tensors(sd)
            try:
                self._run_job(sd, self._manifest(state), t0, blocking_s=None)
            except Exception as exc:  # noqa: BLE001
                self._failure = None
                raise CheckpointError(f"checkpoint at step {state.step} failed: {type(exc).__name__}: {exc}") from exc
            return
        self._wait_inflight()
        sd = self._buffers[0].stage(state.state_dict())
        self._submit(sd, state, time.perf_counter() - t0, t0)

    def _submit(self, sd: dict, state: TrainState, blocking_s: float, t0: float) -> None:
        self._inflight = self._pool.submit(self._run_job, sd, self._manifest(state), t0, blocking_s)
        if self.mode == "zero_stall":  # next snapshots go to the other buffer set
            self._snap_index = 1 - self._snap_buffer

    def _manifest(self, state: TrainState) -> dict[str, Any]:
        base = manifest_base(self.world, kinds=state.kinds(), ema=state.ema is not None)
        return {**base, **self.manifest, "step": state.step, "consumed_samples": state.consumed_samples,
                "world_size": self.world}

    def _run_job(self, sd: dict, manifest: dict, t0: float, blocking_s: float | None) -> None:
        step = manifest["step"]
        try:
            out = _write_and_publish(sd, self.store, step, self.nonce, manifest, self.rank, self.world,
                                     self.group, self.keep, self.keep_every)
        except Exception as exc:  # noqa: BLE001 - surfaced as an event now and an error at the next call
            msg = f"checkpoint at step {step} failed: {type(exc).__name__}: {exc}"
            with self._lock:
                self._failure = msg
            self.emit("checkpoint", step=step, status="failed", error=msg, traceback=traceback.format_exc(),
                      path=str(self.store.path(step)), mode=self.mode)
            raise
        total = time.perf_counter() - t0
        if self.rank == 0:
            record = {"step": step, "path": out["path"], "bytes": out["bytes"],
                      "blocking_s": total if blocking_s is None else blocking_s, "total_s": total,
                      "async": self.mode != "sync", "mode": self.mode, "status": "published"}
            if out.get("rotated"):
                record["rotated"] = out["rotated"]
            self.saves.append(record)
            self.emit("checkpoint", **record)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise CheckpointError if it failed."""
        self._wait_inflight()

    def close(self) -> None:
        """Wait for the save in flight (raising its error, if any) and stop the writer thread."""
        try:
            self._wait_inflight()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
