"""A synthetic snapshot, in torch's exact format, for tests and benchmarks (:func:`write_synthetic_snapshot`)."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np

from workbench.memory.traces import _ACTIONS

__all__ = ["write_synthetic_snapshot"]


class _SpliceWriter:
    """Writes one protocol-4 pickle in pieces made by the C ``pickle.Pickler``, in bounded memory.

    A reader numbers memo slots in the order MEMOIZE opcodes arrive, and GET opcodes name slots by
    number. One persistent pickler (``head``) writes everything up to and including the first batch of
    trace entries, so its numbering is the reader's (the few opcodes written by hand get placeholder
    slots in its memo). The shared objects (key and action strings, frame dicts) are then taken from
    its memo with their slot numbers, and every later batch is pickled by a fresh pickler whose memo
    holds just those: its GETs of them are right, and its entries (new dicts and lists, never referred to
    again) are not kept anywhere. The picklers' FRAME opcodes are kept, resized where a piece is trimmed."""

    def __init__(self, f: Any):
        import io
        self.f = f
        self._bio = io.BytesIO()
        self.head: pickle.Pickler | None = pickle.Pickler(self._bio, protocol=4)
        self._placeholders: list = []
        self.shared: dict[int, tuple[int, Any]] = {}
        self.checked = False  # whether a batch was checked to make no shared object of its own
        f.write(b"\x80\x04")

    def raw(self, data: bytes, memoized: int = 0) -> None:
        """Opcodes written by hand; ``memoized`` of them are MEMOIZE (the head's numbering must follow)."""
        if memoized and self.head is not None:
            memo = self.head.memo.copy()
            for _ in range(memoized):
                ph = object()
                self._placeholders.append(ph)
                memo[id(ph)] = (len(memo), ph)
            self.head.memo = memo
        self.f.write(data)

    def head_obj(self, value: Any) -> None:
        assert self.head is not None, "the head pickler is retired once the first batch is written"
        self.head.dump(value)
        data = self._bio.getvalue()
        self._bio.seek(0)
        self._bio.truncate()
        self._write(data)

    def retire_head(self) -> None:
        """Keep the shared objects and their slots; the head's numbering is not followed from here on."""
        assert self.head is not None
        self.shared = {k: (idx, obj) for k, (idx, obj) in self.head.memo.copy().items()
                       if isinstance(obj, str) or (type(obj) is dict and "filename" in obj)}
        self.head = None

    def obj(self, value: Any, drop_prefix: bytes = b"", strict: bool = False) -> None:
        """A piece by a fresh pickler; ``strict``: it must not memoize a string or frame dict of its own
        (a second use of one would name a slot number the reader does not have)."""
        import io
        bio = io.BytesIO()
        p = pickle.Pickler(bio, protocol=4)
        p.memo = self.shared
        p.dump(value)
        if strict:
            new = [obj for key, (_, obj) in p.memo.copy().items() if key not in self.shared]
            assert not any(isinstance(o, str) or (type(o) is dict and "filename" in o) for o in new), \
                "a frame or string first used after the first batch"
        self._write(bio.getvalue(), drop_prefix)

    def items(self, batch: list) -> None:
        """Append ``batch`` to the list written last: that list's own EMPTY_LIST+MEMOIZE are dropped."""
        if batch:
            self.obj(batch, drop_prefix=b"]\x94", strict=not self.checked)  # the simulation repeats its steps
            self.checked = True

    def _write(self, data: bytes, drop_prefix: bytes = b"") -> None:
        pieces, pos = [], 2  # after PROTO
        while pos < len(data):
            if data[pos] == 0x95:
                k = int.from_bytes(data[pos + 1:pos + 9], "little")
                pieces.append(data[pos + 9:pos + 9 + k])
                pos += 9 + k
            else:
                pieces.append(data[pos:])
                break
        if drop_prefix:
            assert pieces[0].startswith(drop_prefix)
            pieces[0] = pieces[0][len(drop_prefix):]
        assert pieces[-1].endswith(b".")
        pieces[-1] = pieces[-1][:-1]
        for piece in pieces:
            if len(piece) >= 4:
                self.f.write(b"\x95" + len(piece).to_bytes(8, "little"))
            self.f.write(piece)


_SIMULATED_BYTES = 8 << 20  # a synthetic snapshot's steps are simulated up to here, then the last one repeats
_FRAME_TARGET = 64 << 10    # the pickler's frame size


def _repeat_step(w: _SpliceWriter, sim: "_TrainingSim", entries: list[dict], target_bytes: int) -> None:
    """Append copies of one simulated step's ``entries`` to the trace list being written, each later in
    time by the step's length, until the file reaches ``target_bytes``: gigabytes in seconds.

    A step after the first starts and ends with the same allocations alive (parameters and optimizer
    state), so its copies are valid steps: every address they allocate is free when they start. Each
    entry is pickled once, by a pickler holding the shared strings and frames as the head wrote them, so
    its bytes are the ones the C pickler writes for it in a list; copies differ only in the 7-byte
    ``time_us`` values (LONG1), rewritten with numpy. They are grouped as pickle groups them (MARK, at
    most 1000 items, APPENDS) in frames of about 64 KiB that end between opcodes."""
    import io
    sentinel = 0x5A << 48  # a 7-byte LONG1, as 2024's time_us values are
    pieces: list[bytes] = []
    offsets: list[int] = []
    for i, e in enumerate(entries):
        assert e["time_us"] < (1 << 55), "time_us must fit the 7-byte LONG1 the copies rewrite"
        bio = io.BytesIO()
        pk = pickle.Pickler(bio, protocol=4)
        pk.memo = w.shared
        pk.dump({**e, "time_us": sentinel + i})  # the same keys (the shared strings), in the same order
        data = bio.getvalue()
        body = data[11:-1] if data[2] == 0x95 else data[2:-1]  # PROTO, FRAME ... STOP
        mark = b"\x8a\x07" + (sentinel + i).to_bytes(7, "little")
        at = body.find(mark)
        assert at > 0 and body.find(mark, at + 1) < 0
        pieces.append(body)
        offsets.append(at + 2)
    template, times = bytearray(), []
    frame, frame_at = bytearray(), []
    def close_frame() -> None:
        if frame:
            template.extend(b"\x95" + len(frame).to_bytes(8, "little"))
            base = len(template)
            times.extend(base + o for o in frame_at)
            template.extend(frame)
            frame.clear()
            frame_at.clear()
    for b0 in range(0, len(pieces), 1000):
        frame.extend(b"(")
        for body, off in zip(pieces[b0:b0 + 1000], offsets[b0:b0 + 1000]):
            if len(frame) + len(body) > _FRAME_TARGET:
                close_frame()
            frame_at.append(len(frame) + off)
            frame.extend(body)
        frame.extend(b"e")
    close_frame()
    tpl = np.frombuffer(bytes(template), dtype=np.uint8)
    pos = np.asarray(times, dtype=np.int64)
    t0 = np.array([e["time_us"] for e in entries], dtype=np.int64)
    period = int(t0[-1] - t0[0]) + 20
    allocs = sum(1 for e in entries if e["action"] == "alloc")
    per_block = max(1, (32 << 20) // len(tpl))
    f = w.f
    reps = 0
    while f.tell() < target_bytes:
        k = min(per_block, -(-(target_bytes - f.tell()) // len(tpl)))
        block = np.tile(tpl, k)
        r = np.arange(1 + reps, 1 + reps + k, dtype=np.int64)
        when = t0[None, :] + r[:, None] * period
        assert when.max() < (1 << 55)
        raw = when.astype("<i8").view(np.uint8).reshape(k, len(t0), 8)[:, :, :7]
        at = (np.arange(k, dtype=np.int64)[:, None] * len(tpl) + pos[None, :])[:, :, None] + np.arange(7)
        block[at] = raw
        f.write(block.tobytes())
        reps += k
    sim.entries += reps * len(entries)
    sim.allocs += reps * allocs
    sim.steps += reps
    sim.clock = int(t0[-1]) + reps * period


def _synthetic_frames(n_frames: int) -> dict[str, list[dict]]:
    """Stacks (innermost first) of a training script, as torch records them: shared frame dicts."""
    def fr(filename: str, line: int, name: str) -> dict:
        return {"filename": filename, "line": line, "name": name}

    site = "/opt/conda/lib/python3.11/site-packages/torch"
    outer = [fr("/work/train.py", 88, "train_step"), fr("/work/train.py", 131, "main"),
             fr("/work/train.py", 140, "<module>")]
    pad = [fr("/work/loop.py", 10 + i, f"run_{i}") for i in range(max(0, n_frames - 12))]
    call = [fr(f"{site}/nn/modules/module.py", 1784, "_call_impl"),
            fr(f"{site}/nn/modules/module.py", 1773, "_wrapped_call_impl")]
    model = [fr("/work/model.py", 61, "forward")] + call + [fr("/work/model.py", 102, "forward")] + call
    stacks = {
        "linear": [fr(f"{site}/nn/modules/linear.py", 125, "forward")] + call + model,
        "attention": [fr(f"{site}/nn/functional.py", 6102, "scaled_dot_product_attention"),
                      fr("/work/model.py", 44, "forward")] + call + [fr("/work/model.py", 102, "forward")] + call,
        "norm": [fr(f"{site}/nn/modules/normalization.py", 217, "forward")] + call + model,
        "allgather": [fr(f"{site}/distributed/distributed_c10d.py", 3905, "all_gather_into_tensor"),
                      fr(f"{site}/distributed/c10d_logger.py", 81, "wrapper"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 250, "foreach_all_gather"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 290, "unshard"),
                      fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_state.py", 240, "_pre_forward")] + call + model,
        "loss": [fr(f"{site}/nn/functional.py", 3462, "cross_entropy"), fr("/work/train.py", 80, "loss_fn")],
        "backward": [fr(f"{site}/autograd/graph.py", 829, "_engine_run_backward"),
                     fr(f"{site}/autograd/__init__.py", 353, "backward"), fr(f"{site}/_tensor.py", 648, "backward"),
                     fr("/work/train.py", 84, "train_step")],
        "engine": [],  # autograd's CUDA device thread: no Python frames
        "reducescatter": [fr(f"{site}/distributed/distributed_c10d.py", 4407, "reduce_scatter_tensor"),
                          fr(f"{site}/distributed/c10d_logger.py", 81, "wrapper"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 420,
                             "foreach_reduce"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 470, "post_backward"),
                          fr(f"{site}/distributed/fsdp/_fully_shard/_fsdp_state.py", 320, "_post_backward")],
        "adam_state": [fr(f"{site}/optim/adamw.py", 150, "_init_group"), fr(f"{site}/optim/adamw.py", 210, "step"),
                       fr(f"{site}/optim/optimizer.py", 485, "wrapper"), fr("/work/train.py", 86, "train_step")],
        "adam_math": [fr(f"{site}/optim/adam.py", 610, "_multi_tensor_adam"), fr(f"{site}/optim/adam.py", 900, "adam"),
                      fr(f"{site}/optim/adamw.py", 226, "step"), fr(f"{site}/optim/optimizer.py", 485, "wrapper"),
                      fr("/work/train.py", 86, "train_step")],
        "zero_grad": [fr(f"{site}/optim/optimizer.py", 950, "zero_grad"), fr("/work/train.py", 87, "train_step")],
        "params": [fr(f"{site}/nn/modules/linear.py", 118, "reset_parameters"),
                   fr(f"{site}/nn/modules/linear.py", 110, "__init__"), fr("/work/model.py", 20, "__init__"),
                   fr("/work/train.py", 120, "main")],
        "data": [fr("/work/data.py", 33, "__next__"), fr("/work/train.py", 79, "train_step")],
    }
    for k, v in stacks.items():
        if v and k not in ("params", "reducescatter"):  # params: before the loop; reduce-scatter: a hook on
            stacks[k] = v + outer + pad                  # autograd's thread, below no frame of the script
    return stacks


class _TrainingSim:
    """A simulated FSDP training loop on one GPU, emitting trace entries as torch records them.

    Deterministic for a seed. After any whole number of steps (one or more) the live allocations are
    the same: parameters and AdamW state, so the segments a snapshot lists at the end are known after
    one step."""

    K = {k: k for k in ("action", "addr", "size", "stream", "time_us", "frames")}  # torch's shared key strings
    A = {a: a for a in _ACTIONS}

    def __init__(self, seed: int, n_frames: int, layers: int):
        self.rng = random.Random(seed)
        self.stacks = _synthetic_frames(n_frames)
        self.layers = layers
        self.clock = 1_718_000_000_000_000
        self.free_lists: dict[int, list[int]] = {}
        self.top = 0x7F3A_0000_0000
        self.live: dict[int, tuple[int, str]] = {}  # addr -> (size, stack name)
        self.total = self.peak = self.entries = self.allocs = self.steps = 0
        self.out: list[dict] = []
        rng = self.rng
        # before the trace: sharded parameters, and the data batch the first step frees
        self.param_sizes = [[rng.choice((1, 2, 4)) << 20 for _ in range(4)] for _ in range(layers)]
        for layer in self.param_sizes:
            for s in layer:
                self.alloc(s, "params", recorded=False)
        self.stale = [self.alloc(self.randint(1, 8) << 16, "data", recorded=False) for _ in range(2)]
        self.base = self.peak = self.total
        self.opt_state: list[int] = []

    def randint(self, a: int, b: int) -> int:
        return a + int(self.rng.random() * (b - a + 1))  # random.randint is slow Python; this is C

    def entry(self, action: str, addr: int, size: int, where: str) -> None:
        self.clock += self.randint(2, 40)
        K = self.K
        self.out.append({K["action"]: self.A[action], K["addr"]: addr, K["size"]: size, K["stream"]: 0,
                         K["time_us"]: self.clock, K["frames"]: list(self.stacks[where])})
        self.entries += 1

    def alloc(self, size: int, where: str, recorded: bool = True) -> int:
        size = max(512, (size + 511) // 512 * 512)
        fl = self.free_lists.get(size)
        if fl:
            addr = fl.pop()
        else:
            addr, self.top = self.top, self.top + size
        self.live[addr] = (size, where)
        self.total += size
        self.peak = max(self.peak, self.total)
        if recorded:
            self.allocs += 1
            self.entry("alloc", addr, size, where)
        return addr

    def free(self, addr: int, where: str) -> None:
        size, _ = self.live.pop(addr)
        self.free_lists.setdefault(size, []).append(addr)
        self.total -= size
        self.entry("free_requested", addr, size, where)
        self.entry("free_completed", addr, size, where)

    def step(self) -> None:
        alloc, free, sizes = self.alloc, self.free, self.param_sizes
        cache = 0x7E00_0000_0000 + self.steps * (2 << 20)
        self.entry("segment_alloc", cache, 2 << 20, "data")  # a cache segment, returned by empty_cache()
        batch_in = alloc(self.randint(1, 8) << 16, "data")
        for addr in self.stale:
            free(addr, "data")
        self.stale = []
        acts = []
        for layer in range(self.layers):  # forward: all-gather, kept activations, temporaries
            gathered = alloc(sum(sizes[layer]) * 2, "allgather")
            acts.append([alloc(self.randint(4, 64) << 14, ("linear", "attention", "norm")[i]) for i in range(3)])
            for _ in range(2):
                free(alloc(self.randint(1, 32) << 14, "linear"), "linear")
            free(gathered, "linear")
        loss = alloc(4096, "loss")
        seed_grad = alloc(4096, "backward")
        grads = []
        for layer in reversed(range(self.layers)):  # backward, on the engine thread (no Python frames)
            gathered = alloc(sum(sizes[layer]) * 2, "engine")
            for _ in range(2):
                free(alloc(self.randint(1, 32) << 14, "engine"), "engine")
            unsharded = alloc(sum(sizes[layer]) * 2, "engine")
            for addr in acts[layer]:
                free(addr, "engine")
            reduced = alloc(sum(sizes[layer]), "reducescatter")
            free(unsharded, "reducescatter")
            free(reduced, "reducescatter")
            grads.extend(alloc(s, "engine") for s in sizes[layer])
            free(gathered, "engine")
        free(seed_grad, "engine")
        free(loss, "engine")
        if not self.opt_state:  # AdamW's exp_avg and exp_avg_sq, on the first step
            self.opt_state = [alloc(s, "adam_state") for layer in sizes for s in layer for _ in range(2)]
        for _ in range(self.layers):
            free(alloc(self.randint(1, 16) << 16, "adam_math"), "adam_math")
        for addr in grads:  # zero_grad(set_to_none=True)
            free(addr, "zero_grad")
        free(batch_in, "data")
        self.entry("segment_free", cache, 2 << 20, "data")
        self.steps += 1

    def segments(self, device: int) -> list[dict]:
        """The live blocks as torch lists them: one segment each, with the stack that allocated it."""
        out = []
        for addr, (size, where) in sorted(self.live.items()):
            frames = list(self.stacks[where])
            out.append({"device": device, "address": addr, "total_size": size + 512, "allocated_size": size,
                        "active_size": size, "requested_size": size, "stream": 0, "segment_type": "large",
                        "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames,
                        "blocks": [{"address": addr, "size": size, "requested_size": size,
                                    "state": "active_allocated", "frames": frames},
                                   {"address": addr + size, "size": 512, "requested_size": 0, "state": "inactive",
                                    "frames": []}]})
        return out


def write_synthetic_snapshot(path: str | os.PathLike, target_bytes: int, seed: int = 0, n_frames: int = 24, *,
                             layers: int = 8, device: int = 0, devices: int = 1,
                             simulate_bytes: int = _SIMULATED_BYTES) -> dict[str, Any]:
    """Write a snapshot of a simulated FSDP training loop in torch's exact format, of about ``target_bytes``.

    Each step runs forward (an all-gather buffer, kept activations and temporaries per layer), backward
    (on autograd's device thread, so without frames: gradients, reduce-scatter buffers, activations
    freed), an AdamW step (state made on the first step, temporaries) and ``zero_grad``. Parameters and
    a data batch exist before the trace starts, so ``base_bytes`` is not zero and some frees have no
    allocation in the trace. Frees are recorded as torch does with ``context="all"``: free_requested,
    then free_completed, with the freeing stack. Whole steps are written until the file reaches
    ``target_bytes``, with bounded memory whatever the size; beyond ``simulate_bytes`` (8 MiB) the last
    simulated step is repeated, later in time, as bytes (a 1 GB file takes seconds). ``device``/``devices``
    place the trace among empty ones, as a process that sees several GPUs writes it.

    Returns the ground truth: ``bytes`` (the file's size), ``entries``, ``allocations``, ``steps``,
    ``peak_bytes`` (the exact peak of live requested bytes, ``base_bytes`` included), ``base_bytes`` and
    ``end_bytes``."""
    if not 0 <= device < devices:
        raise ValueError(f"device={device} is not among devices=0..{devices - 1}")
    probe = _TrainingSim(seed, n_frames, layers)
    probe.step()
    segments = probe.segments(device)
    sim = _TrainingSim(seed, n_frames, layers)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        w = _SpliceWriter(f)
        w.raw(b"}\x94(", memoized=1)  # the top dict: EMPTY_DICT MEMOIZE MARK
        w.head_obj("segments")
        w.head_obj(segments)
        w.head_obj("device_traces")
        w.raw(b"]\x94(", memoized=1)
        for d in range(devices):
            if d != device:
                (w.head_obj if w.head is not None else w.obj)([])
                continue
            sim.step()  # the first batch defines every frame and string: a whole step uses them all
            w.head_obj(sim.out)
            sim.out = []
            w.retire_head()
            per_entry = max(1, f.tell() // max(1, sim.entries))  # bytes an entry takes, from the first batch
            simulated = min(target_bytes, simulate_bytes)
            while f.tell() < simulated:
                sim.step()
                if len(sim.out) >= min(20_000, (simulated - f.tell()) // per_entry):
                    w.items(sim.out)
                    sim.out = []
            w.items(sim.out)
            sim.out = []
            if f.tell() < target_bytes:  # beyond simulate_bytes: one more simulated step, then copies of it
                sim.step()
                step, sim.out = sim.out, []
                w.items(step)
                _repeat_step(w, sim, step, target_bytes)
        w.raw(b"e")
        w.obj("allocator_settings")
        w.obj({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
               "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
               "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {"1": 0, "2": 0}})
        w.obj("external_annotations")
        w.obj([])
        w.raw(b"u.")
    assert sorted(sim.live) == sorted(probe.live), "the simulation's end state must not depend on its length"
    return {"path": str(path), "bytes": path.stat().st_size, "entries": sim.entries, "allocations": sim.allocs,
            "steps": sim.steps, "peak_bytes": sim.peak, "base_bytes": sim.base, "end_bytes": sim.total}
