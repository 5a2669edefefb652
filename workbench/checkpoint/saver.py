"""Saving train state: synchronous, asynchronous, and zero-stall; plus an EMA of the weights.

What blocks the training loop in each mode (``blocking_s`` of the ``checkpoint`` event)::

    sync        [ DCP writes the live tensors, hashing them ][ publish ]        all of it
    async       [ take the state dict's references ] -> staging thread: [ copy to host buffers ]
                    -> writer thread: [ DCP write, hashing ][ publish ]
                the next optimizer.step() waits for the copy if it has not landed (a pre-step hook)
    zero-stall  every step: the same staging into one of two host buffer sets
                every N steps: hand that step's snapshot to the writer thread (no second copy)

Host buffers are allocated once (pinned on CUDA, filled on a side stream) and reused. At most one save
is in flight: a save that finds the previous one still writing waits for it (that wait counts as
blocking). Zero-stall mode
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
import sys
import threading
import time
import traceback
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException  # a BaseException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from workbench.checkpoint.filewriter import (ROOM_FIX, WRITEBACK_BYTES, CheckedWriter, HashingFileSystem,  # noqa: F401
                                            _HashingStream)
from workbench.checkpoint.index import manifest_index
from workbench.checkpoint.quant import check_mode as check_quant
from workbench.checkpoint.quant import plan as quant_plan
from workbench.checkpoint.quant import quantize_state
from workbench.checkpoint.state import TrainState, encode_state
from workbench.checkpoint.store import CHECKSUM, FORMAT, VERSION, CheckpointStore, file_digest
from workbench.disk import StorageError, storage_error

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
        self._streams: dict[torch.device, Any] = {}  # CUDA: one copy stream per device
        self._copy_streams: dict[torch.device, Any] = {}

    def _copy(self, buf: torch.Tensor, src: torch.Tensor) -> None:
        if src.is_cuda:
            with torch.cuda.stream(self._copy_streams[src.device]):
                buf.copy_(src.detach(), non_blocking=True)
        else:
            buf.copy_(src.detach())

    def _buffer(self, key: str, local: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
        shape = torch.Size(local.shape if shape is None else shape)
        dtype = local.dtype if dtype is None else dtype
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            pin = local.device.type == "cuda"
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
            self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers.values())
        return buf

    def reserve(self, sd: dict[str, Any], quant: dict[str, Any] | None = None, prefix: str = "") -> None:
        """Allocate (once) the buffers ``stage`` will fill for ``sd``, here on the caller's thread: memory
        recorders that follow the training thread then see the host copy under the ``checkpoint`` phase.
        Moments that ``quant`` quantizes get buffers of their stored shapes and dtypes."""
        from workbench.checkpoint.quant import stored_locals

        keys = (quant or {}).get("keys") or {}
        for k, v in sd.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                self.reserve(v, quant, key + ".")
            elif isinstance(v, torch.Tensor):
                local = v.to_local() if isinstance(v, DTensor) else v
                if key in keys:
                    for suffix, (shape, dtype) in stored_locals(key, local, quant).items():
                        self._buffer(key + suffix, local, shape, dtype)
                else:
                    self._buffer(key, local)

    def stage(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Copy every tensor of ``sd`` into the buffers; returns when the bytes have landed.

        CUDA tensors are copied on a side stream of their device that first waits for the work queued so far
        (the step that produced the values), so the copy overlaps later compute; may run on any thread.
        """
        devices = {t.device for t in _tensors(sd) if t.is_cuda}
        if not devices:
            return self._stage(sd, "")
        streams = {}
        for dev in devices:
            side = self._streams.get(dev)
            if side is None:
                side = self._streams[dev] = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.default_stream(dev))
            streams[dev] = side
        self._copy_streams = streams
        out = self._stage(sd, "")
        for side in streams.values():
            side.synchronize()  # the async copies must land before the writer reads
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
                self._copy(buf, local)
                out[k] = DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False,
                                            shape=v.shape, stride=v.stride())
            elif isinstance(v, torch.Tensor):
                buf = self._buffer(key, v)
                self._copy(buf, v)
                out[k] = buf
            else:
                raise TypeError(f"checkpoint state {key!r} is a {type(v).__name__}, not a tensor; "
                                "store it as a tensor (loading never unpickles objects)")
        return out


def _tensors(sd: dict[str, Any]):
    for v in sd.values():
        if isinstance(v, dict):
            yield from _tensors(v)
        elif isinstance(v, DTensor):
            yield v.to_local()
        elif isinstance(v, torch.Tensor):
            yield v


def _check_tensors(sd: dict[str, Any], prefix: str = "") -> None:
    for k, v in sd.items():
        if isinstance(v, dict):
            _check_tensors(v, f"{prefix}{k}.")
        elif not isinstance(v, torch.Tensor):
            raise TypeError(f"checkpoint state {prefix}{k!r} is a {type(v).__name__}, not a tensor")


# Threads each rank writes its shards with (DCP splits the rank's items into one file per thread; writes,
# fsyncs and XXH3 release the GIL). The small preset's 305 MB on 2 cores, 6 interleaved saves each
# (2026-11-27, after the CRC-32 fix and with early writeback): median 0.245 s with 1 thread, 0.19 s with 2,
# 0.175 s with 3. Three files also let a verified load's own thread take the third file's checksum while
# two threads hash the others (mapped load 23 ms against 27 ms with two files).
WRITE_THREADS = 3


# -- one save --------------------------------------------------------------------------------------


def _write_and_publish(sd: dict[str, Any], store: CheckpointStore, step: int, nonce: str, manifest: dict,
                       rank: int, world: int, group, keep: int | None, keep_every: int,
                       owner: str | None = None) -> dict[str, Any]:
    """DCP-write ``sd`` into the step's tmp dir (fsynced), hashing this rank's files as they are written,
    and publish (rank 0).

    Runs on every rank (in the writer thread for async saves). Returns what rank 0 publishes. A write that
    fails for lack of room or permission, on any rank, raises a :class:`~workbench.disk.StorageError` that
    says so (``no space left on device writing checkpoint step 4 to DIR (needs ~X, Y free there); ...``;
    the bytes needed are the failing rank's share). ``owner``: the run id the directory must still belong
    to when rank 0 publishes (:meth:`CheckpointStore.check_owner`; None: no check).
    """
    doing = f"writing checkpoint step {step} to"
    needed = sum(t.numel() * t.element_size() for t in _tensors(sd))  # this rank's share
    try:
        return _write_then_publish(sd, store, step, nonce, manifest, rank, world, group, keep, keep_every,
                                   doing, needed, owner)
    except CheckpointException as exc:  # a rank's write failed: its own error, named, if it was the disk
        named = next((e for e, _ in exc.failures.values() if isinstance(e, StorageError)), None)
        if named is None:
            raise
        raise StorageError(named.errno, str(named)) from None
    except OSError as exc:  # outside DCP's writes: the tmp directory, the manifest, the renames, latest
        named = storage_error(exc, doing=doing, where=store.root, needed=needed, fix=ROOM_FIX)
        if named is None:
            raise
        raise named from exc


def _write_then_publish(sd: dict[str, Any], store: CheckpointStore, step: int, nonce: str, manifest: dict,
                        rank: int, world: int, group, keep: int | None, keep_every: int, doing: str,
                        needed: int, owner: str | None) -> dict[str, Any]:
    tmp = store.tmp_path(step, nonce)
    if rank == 0:
        store.root.mkdir(parents=True, exist_ok=True)
        store.clean_stale(keep_tmp=tmp.name)
    tmp.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        writer = CheckedWriter(tmp, sync_files=True, thread_count=WRITE_THREADS)
        writer.fs = HashingFileSystem(target=store.root, doing=doing, needed=needed)
        md = dcp.save(sd, storage_writer=writer, process_group=group, no_dist=group is None)
    mine = sorted(p.name for p in tmp.iterdir() if p.name.startswith(f"__{rank}_"))
    if rank == 0:
        mine.append(".metadata")
    # DCP's sync_files=True has fsynced every shard and .metadata; each rank lists its own files' digests,
    # taken while writing. A file with none (written out of order), or whose size disagrees, is read back.
    files = {}
    # Where each tensor's bytes lie (see _HashingStream): recorded only when every tensor written is dense
    # (contiguous, its whole storage), so that a data record of the tensor's size is the tensor, row-major.
    dense = sys.byteorder == "little" and all(
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        for t in _tensors(sd))
    for name in mine:
        got = writer.fs.digests.get(name)
        if got is None or got[0] != (tmp / name).stat().st_size:
            got = file_digest(tmp / name, algo=CHECKSUM)
        files[name] = {"bytes": got[0], CHECKSUM: got[1]}
        spans = writer.fs.spans.get(name)
        if dense and name != ".metadata" and spans is not None:
            files[name]["spans"] = [x for span in spans for x in span]
    if group is not None and world > 1:
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(files, gathered, dst=0, group=group)
        if rank == 0:
            files = {k: v for part in gathered for k, v in part.items()}
    if rank != 0:
        return {}
    doc = dict(manifest, step=step, checksum=CHECKSUM, files=dict(sorted(files.items())),
               created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    if isinstance(md, Metadata):  # where each whole tensor lies, for loads that need not unpickle .metadata
        doc.update(manifest_index(md) or {})
    store.check_owner(owner)  # every rank has written its part: raising here strands no collective
    final = store.publish(tmp, step, doc)
    removed = store.rotate(keep, keep_every)
    return {"path": str(final), "bytes": sum(f["bytes"] for f in files.values()), "rotated": removed}


def save(path: str | Path, state: TrainState, manifest: dict | None = None, *, process_group=None,
         keep: int | None = None, keep_every: int = 0, quant: str | None = None) -> Path:
    """Synchronously save ``state`` as ``<path>/step-NNNNNN/`` (``path`` is the checkpoints dir).

    Works without a process group (one process). All ranks of ``process_group`` must call it.
    ``quant``: "int8" or "fp8" stores Adam's moments quantized (:mod:`workbench.checkpoint.quant`).
    """
    mode = check_quant(quant)
    group = process_group if dist.is_initialized() else None
    if dist.is_initialized() and group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    nonce = _shared_nonce(group)
    sd = state.state_dict()
    _check_tensors(sd)
    qinfo = quant_plan(sd, mode)
    sd = quantize_state(sd, qinfo)
    base = {**manifest_base(world, kinds=state.kinds(), ema=state.ema is not None), **(manifest or {}),
            "consumed_samples": state.consumed_samples, "world_size": world, "quant": qinfo}
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


def _failed(step: int, exc: BaseException) -> str:
    """The one line of a failed save: a disk condition in words, anything else with its type."""
    if isinstance(exc, StorageError):
        return f"checkpoint at step {step} failed: {exc}"
    return f"checkpoint at step {step} failed: {type(exc).__name__}: {exc}"


class _Staging:
    """One copy of the train state into a host buffer set, running on the staging thread.

    ``done`` is set when every byte has landed (or the copy failed: ``error``). ``wait_s`` is how long the
    training loop waited for it (at its next optimizer step, or at the next save).
    """

    def __init__(self, step: int, buffer: int):
        self.step, self.buffer = step, buffer
        self.quant: dict[str, Any] = {}
        self.done = threading.Event()
        self.sd: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.copy_s = 0.0
        self.wait_s = 0.0
        self.loop_s = 0.0  # the loop's own part of the save (capture, hand-off)
        self.done_t: float | None = None  # perf_counter() when the copy landed
        self.waiter_t: float | None = None  # ... when the loop started waiting for it, if it did

    def blocking_s(self) -> float:
        """The loop's part plus its wait for the copy (known exactly once the copy landed: a waiter that
        came before the copy landed registered itself first)."""
        waited = self.done_t - self.waiter_t if self.waiter_t is not None and self.done_t is not None else 0.0
        return self.loop_s + max(0.0, waited)

    def result(self) -> dict[str, Any]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.sd


class Checkpointer:
    """Periodic saves for a training loop: ``after_step(state)`` once per step, ``close()`` at the end.

    ``every``: save when ``state.step % every == 0``; ``mode``: "sync", "async" or "zero_stall".
    ``emit(type, **fields)`` receives the ``checkpoint`` events (rank 0 emits them).

    Async and zero-stall saves copy the state to host buffers on a staging thread while the loop goes on
    with the next step's forward and backward, which read the weights and optimizer state but do not write
    them. The first thing that writes them is the next ``optimizer.step()``: a pre-step hook on the
    optimizer waits there until the copy has landed. What the loop is blocked for (``blocking_s``) is
    taking the state dict on its own thread (references to the live tensors, plus fresh RNG, scheduler
    and step tensors) plus that wait, which is zero when forward and backward take longer than the copy.
    ``take_stall()`` gives the seconds lost since its last call (the trainer's ``ckpt_stall_s``). Without
    an optimizer (nothing to hook) the copy runs on the loop's thread. ``quant``: "int8"/"fp8" moments,
    quantized on the staging thread (:mod:`workbench.checkpoint.quant`). ``owner``: the id of the run
    that owns ``root`` (its ``owner.json``); a publish finding another run's id there fails instead.
    """

    def __init__(self, root: str | Path, *, every: int, mode: str = "sync", keep: int | None = None,
                 keep_every: int = 0, manifest: dict | None = None, emit: Callable[..., Any] | None = None,
                 quant: str | None = None, owner: str | None = None):
        if mode not in ("sync", "async", "zero_stall"):
            raise ValueError(f"checkpoint mode={mode!r} is unknown; choose sync, async or zero_stall")
        self.quant = check_quant(quant)
        self.owner = owner  # the run id the directory must belong to at each publish (workbench.train.rundir)
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
        background = mode != "sync"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer") if background else None
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage") if background else None
        self._inflight: Future | None = None
        self._failure: str | None = None
        self._buffers = [HostBuffers()] + ([HostBuffers()] if mode == "zero_stall" else [])
        self._staging: _Staging | None = None  # the newest copy the loop has not yet waited for
        self._snap: _Staging | None = None  # zero-stall: the newest snapshot,
        self._snap_index = 0  # and the buffer set the next snapshot goes to
        self._hooked: set[int] = set()  # ids of the optimizers whose step waits for the copy
        self._hooks: list[Any] = []
        self._lock = threading.Lock()
        self.saves: list[dict[str, Any]] = []
        self.stalls: list[float] = []  # seconds the loop was blocked, one entry per after_step that staged
        self._unreported = 0.0  # stall seconds not yet taken by take_stall()

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
            except (Exception, CheckpointException):  # noqa: BLE001 - already recorded by the writer job
                pass
            self._inflight = None
        self._raise_if_failed()

    # -- staging ----------------------------------------------------------------------------------
    def _hook(self, state: TrainState) -> bool:
        """Make the optimizer's next step wait for the copy in flight. False: no optimizer to hook."""
        if state.optimizer is None:
            return False
        from workbench.checkpoint.state import local_optimizer

        opt = local_optimizer(state.optimizer)
        if id(opt) not in self._hooked:
            self._hooks.append(opt.register_step_pre_hook(self._before_optimizer_step))
            self._hooked.add(id(opt))
        return True

    def _before_optimizer_step(self, *_: Any) -> None:
        self._unreported += self._wait_staged(count=True)

    def take_stall(self) -> float:
        """Seconds the loop lost to checkpointing since the last call: the last ``after_step``'s own time
        plus any wait for its copy at the optimizer step since. The trainer puts it in each step event."""
        out, self._unreported = self._unreported, 0.0
        return out

    def _wait_staged(self, count: bool = False) -> float:
        """Block until the newest copy has landed. ``count``: the seconds waited count against its save."""
        rec, self._staging = self._staging, None
        if rec is None or rec.done.is_set():
            return 0.0
        t0 = rec.waiter_t = time.perf_counter()
        rec.done.wait()
        rec.wait_s = time.perf_counter() - t0
        if count and self.stalls:
            self.stalls[-1] += rec.wait_s
        return rec.wait_s

    def _stage(self, state: TrainState, buffer: int) -> _Staging:
        """Start copying ``state`` into buffer set ``buffer``: on the staging thread when an optimizer step
        can wait for it, else here. The state dict (references, plus fresh RNG, scheduler and step tensors)
        is taken now, on the loop's thread."""
        rec = _Staging(state.step, buffer)
        # References to the live tensors, taken here: FSDP2 swaps the modules' parameters for unsharded ones
        # during forward and backward, so the state dict cannot be built on another thread meanwhile.
        sd = state.state_dict(encode=False)  # hyperparameters stay Python values until the staging thread
        rec.quant = quant_plan(sd, self.quant)  # from shapes only: cheap, and the same on every rank
        self._buffers[buffer].reserve(sd, rec.quant)  # allocations on the loop's thread (a no-op once done)

        def copy() -> None:
            t0 = time.perf_counter()
            try:
                full = encode_state(sd)
                _check_tensors(full)
                rec.sd = self._buffers[buffer].stage(quantize_state(full, rec.quant))
            except BaseException as exc:  # noqa: BLE001 - surfaced by the writer job and the next call
                rec.error = exc
            finally:
                rec.done_t = time.perf_counter()
                rec.copy_s = rec.done_t - t0
                rec.done.set()

        if self._stager is not None and self._hook(state):
            self._wait_staged()  # one copy at a time per buffer set (the thread runs them in order anyway)
            self._staging = rec
            self._stager.submit(copy)
        else:
            copy()
        return rec

    # -- the loop's calls ------------------------------------------------------------------------
    def after_step(self, state: TrainState) -> None:
        """Snapshot (zero-stall) and/or save if ``state.step`` is a multiple of ``every``."""
        due = self.every > 0 and state.step % self.every == 0
        if self.mode == "zero_stall":
            t0 = time.perf_counter()
            if due:  # at most one save in flight (the snapshot below goes to the set it is not writing)
                self._wait_inflight()
            self.stalls.append(0.0)
            self._snap = self._stage(state, self._snap_index)
            self._snap.loop_s = time.perf_counter() - t0
            self.stalls[-1] += self._snap.loop_s
            self._unreported += self._snap.loop_s
            if due:
                self._submit(self._snap, state, t0)
                self._snap_index = 1 - self._snap.buffer  # next snapshots go to the other buffer set
            return
        if due:
            self.save(state)

    def save(self, state: TrainState) -> None:
        t0 = time.perf_counter()
        if self.mode == "sync":
            self._raise_if_failed()
            sd = state.state_dict()
            _check_tensors(sd)
            qinfo = quant_plan(sd, self.quant)
            try:
                self._run_job(quantize_state(sd, qinfo), {**self._manifest(state), "quant": qinfo}, t0)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                self._failure = None
                raise CheckpointError(_failed(state.step, exc)) from exc
            return
        self._wait_inflight()
        self.stalls.append(0.0)
        rec = self._stage(state, 0)
        rec.loop_s = time.perf_counter() - t0
        self.stalls[-1] += rec.loop_s
        self._unreported += rec.loop_s
        self._submit(rec, state, t0)

    def _submit(self, rec: _Staging, state: TrainState, t0: float) -> None:
        self._inflight = self._pool.submit(self._run_job, rec, {**self._manifest(state), "quant": rec.quant}, t0)

    def _manifest(self, state: TrainState) -> dict[str, Any]:
        base = manifest_base(self.world, kinds=state.kinds(), ema=state.ema is not None)
        return {**base, **self.manifest, "step": state.step, "consumed_samples": state.consumed_samples,
                "world_size": self.world}

    def _run_job(self, sd: dict | _Staging, manifest: dict, t0: float) -> None:
        step = manifest["step"]
        rec = sd if isinstance(sd, _Staging) else None
        try:
            if rec is not None:
                sd = rec.result()
            out = _write_and_publish(sd, self.store, step, self.nonce, manifest, self.rank, self.world,
                                     self.group, self.keep, self.keep_every, self.owner)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - surfaced as an event now and an error at the next call
            msg = _failed(step, exc)
            with self._lock:
                self._failure = msg
            self.emit("checkpoint", step=step, status="failed", error=msg, traceback=traceback.format_exc(),
                      path=str(self.store.path(step)), mode=self.mode)
            raise
        total = time.perf_counter() - t0
        if self.rank == 0:
            # blocking: sync, the whole save; else the loop's capture plus its wait for the copy
            blocking = total if rec is None else rec.blocking_s()
            record = {"step": step, "path": out["path"], "bytes": out["bytes"], "blocking_s": blocking,
                      "total_s": total, "async": self.mode != "sync", "mode": self.mode, "status": "published"}
            if out.get("rotated"):
                record["rotated"] = out["rotated"]
            self.saves.append(record)
            self.emit("checkpoint", **record)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise CheckpointError if it failed."""
        self._wait_staged()
        self._wait_inflight()

    def close(self) -> None:
        """Wait for the save in flight (raising its error, if any) and stop the writer thread."""
        try:
            self._wait_staged()
            self._wait_inflight()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks, self._hooked = [], set()
            for pool in (self._stager, self._pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._stager = self._pool = None

