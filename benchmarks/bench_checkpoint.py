"""Checkpoint save/load speed, as ratios to baselines measured on the same bytes in the same run.

    python benchmarks/bench_checkpoint.py                 # "small" preset (~25M params, ~300 MB state), 3 repeats
    python benchmarks/bench_checkpoint.py --quick         # "tiny" preset, 1 repeat (the test suite's smoke run)

One process, the full train state of a model after one AdamW step (fp32 weights + two moments + step
counters, LR scheduler, RNG), on the local disk in a temporary directory. Ratios (median over repeats):

* ``save_throughput_vs_raw``  workbench save GB/s  /  write+fsync of the same tensor bytes to one file,
                              measured side by side in the order raw, save, save, raw (their mean times):
                              this disk's write speed drifts within a repeat (a raw write took 0.19 s early
                              in one and 0.51 s later), and a single raw write early against a save made
                              after another 1.2 GB had been written measured the drift, not the save
* ``save_throughput_vs_raw_writeback``  the same against a raw write that also starts the disk's writeback
                              every 8 MiB (``sync_file_range``), as saves do since 2026-11-27: the same
                              bytes written with the same I/O technique, so what is left is the save's CPU
* ``save_time_vs_dcp``        workbench sync save time  /  plain ``dcp.save`` of the same state dict
                              (the difference: a manifest with the XXH3-128 of every file, taken as the
                              bytes are written, atomic publish, latest)
* ``checksum_time_vs_dcp``    XXH3-128 of the checkpoint's files read back (page cache warm; what hashing
                              costs, which the save now does on the bytes on their way out)  /  ``dcp.save``
* ``sha256_time_vs_dcp``      the same with sha256, what saves recorded before (for comparison)
* ``async_blocking_vs_sync``  time the training loop is blocked by an async save  /  sync save time
                              (target <= 1/60). Measured in a training loop: the copy into reused host
                              buffers runs beside the next step's forward and backward, and the loop is
                              blocked for the state-dict capture plus any wait at the next optimizer.step()
* ``zero_stall_step_vs_sync`` per-step stall of zero-stall mode (a step that snapshots but does not save)
                              /  sync save time
* ``zero_stall_step_vs_train_step``  the same stall  /  one training step without checkpointing
* ``load_vs_safetensors``     workbench full-state load (checksum verification included) and a touch of
                              every tensor  /  ``safetensors.torch.load_file`` of the same tensors + touch
* ``load_without_verify_vs_safetensors``  the same with ``load(..., verify=False)``
* ``load_dcp_reader_vs_safetensors``  the same through DCP's own reader (``load(..., direct=False)``: one
                              ``torch.load`` per item), what loads did before the direct read path
* ``load_mmap_vs_safetensors``  ``load(..., mmap=True)`` (verification on): the tensors pointed at the mapped
                              files, nothing copied, as ``load_file`` maps its file; each repeat's value is
                              the median of 5 interleaved pairs (``paired_*``), each load into a fresh state
* ``first_step_after_mmap_vs_next_step``  the training step right after a mapped load (its writes copy the
                              pages they touch) / the step after it: where the skipped copy is paid

Resume, as the trainer does it: a fresh model (initialized) and a fresh AdamW (no state yet) with its scheduler,
then ``load()`` + the touch; freed memory is handed back to the system first (``malloc_trim``), as in the new
process a resume runs in. Median of 5 interleaved rounds (3 with ``--quick``) of safetensors and the three paths:

* ``resume_vs_safetensors``   the default path (``load(...)``, ``mmap=None``: copies into the model's tensors,
                              maps the fresh optimizer's state where safe)  /  ``load_file`` + touch
* ``resume_copy_vs_safetensors``    ``mmap=False`` (every tensor copied; the optimizer's state into new memory)
* ``resume_mapped_vs_safetensors``  ``mmap=True`` (every tensor left on the mapped files)
* ``first_step_after_resume_vs_after_copy``  the first training step after the default resume / after the
                              copying one: the copy-on-write of the mapped pages is paid here
* ``first_step_after_mapped_vs_after_copy``  the same after ``mmap=True``
* ``resume_and_first_step_vs_copy``  default resume + touch + first step  /  the same with the copying path
* ``resume_and_first_step_mapped_vs_copy``  the same with ``mmap=True``
``cpu_seconds`` gives the process's CPU time (user + sys, the checksum threads included) beside each of these.
* ``int8_optimizer_bytes_vs_fp32``  bytes of the optimizer state saved with ``quant="int8"`` (Adam's moments
                              in int8 + fp32 block scales)  /  the same state in fp32 (target <= 0.27)
* ``int8_save_time_vs_sync``  that int8 save's time (quantizing included)  /  the fp32 sync save

Page cache: every save ends in fsync, so writes reach the disk; loads read files that were just written
(page cache warm) on both sides alike. stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from workbench.checkpoint import Checkpointer, TrainState, load, save  # noqa: E402
from workbench.checkpoint.load import checkpoint_shapes  # noqa: E402
from workbench.checkpoint.saver import WRITEBACK_BYTES  # noqa: E402
from workbench.checkpoint.store import CHECKSUM, file_digest, start_writeback  # noqa: E402
from workbench.config import PRESETS  # noqa: E402
from workbench.models import build_model  # noqa: E402
from bench_train import _log, machine_info  # noqa: E402  (shared machine facts)

warnings.filterwarnings("ignore", message=".*single process")




def make_state(preset: str) -> TrainState:
    cfg = PRESETS[preset]
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    x = torch.randint(0, cfg.vocab_size, (1, 33))
    F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return TrainState(model, opt, sched, step=1, consumed_samples=1)


def flat_tensors(sd: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flat_tensors(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v.detach().contiguous()
    return out


def raw_write(tensors: dict[str, torch.Tensor], path: Path, writeback: bool = False) -> float:
    """Write + fsync of the tensors' bytes to one file. ``writeback``: also start the disk's writeback every
    8 MiB (``sync_file_range``), as saves do: the same write with the same I/O technique."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        done = kicked = 0
        for t in tensors.values():
            f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
            done += t.numel() * t.element_size()
            if writeback and done - kicked >= WRITEBACK_BYTES:
                f.flush()
                start_writeback(f.fileno(), kicked, done - kicked)
                kicked = done
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def train_step(state: TrainState, x: torch.Tensor) -> None:
    F.cross_entropy(state.model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1


def touch(tensors) -> float:
    return float(sum(float(t.float().sum()) for t in tensors))


def live_tensors(state: TrainState) -> list[torch.Tensor]:
    """The tensors a load put in place, taken from the live objects (as a user's next step reads them):
    parameters, buffers and optimizer state. Not through ``state_dict()``, whose walk (about 7 ms here) is
    no part of loading, and which the safetensors side does not pay either."""
    ts = [*state.model.parameters(), *state.model.buffers()]
    return ts + [v for st in state.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def fresh_state(preset: str) -> TrainState:
    """What a resumed run loads into: the model as built (seeded init), an AdamW with no state yet."""
    model = build_model(PRESETS[preset], seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def _release_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``), so that what the next load
    allocates is faulted in as in a fresh process, not recycled from the previous round."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: what was freed may be reused


def _cpu() -> float:
    """This process's CPU time, user + sys, every thread (getrusage: microseconds; os.times ticks 10 ms)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


RESUME_PATHS = {"default": None, "copy": False, "mapped": True}  # load()'s mmap argument


def resume_rounds(preset: str, ckpt: Path, st_file: Path, x: torch.Tensor, rounds: int,
                  want: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Resumes into fresh states by each path, and ``load_file``, interleaved (the order rotates each round):
    median seconds (wall, and CPU under ``cpu_``) of the load + touch and of the first training step, and
    what each path reported (``LoadResult.read``). ``want``: the saved weights, which every load must give."""
    got: dict[str, list[float]] = {}
    read = {}

    def note(key: str, t0: float, c0: float) -> None:
        got.setdefault(f"{key}_s", []).append(time.perf_counter() - t0)
        got.setdefault(f"cpu_{key}_s", []).append(_cpu() - c0)

    names = ["st", *RESUME_PATHS]
    for k in range(rounds):
        for what in names[k % len(names):] + names[:k % len(names)]:
            if what == "st":
                _release_memory()
                t0, c0 = time.perf_counter(), _cpu()
                touch(load_file(str(st_file)).values())
                note("resume_st", t0, c0)
                continue
            state = fresh_state(preset)
            _release_memory()
            t0, c0 = time.perf_counter(), _cpu()
            res = load(ckpt, state.model, state.optimizer, scheduler=state.scheduler, mmap=RESUME_PATHS[what])
            touch(live_tensors(state))
            note(f"resume_{what}", t0, c0)
            for key, value in state.model.state_dict().items():  # (not timed) the load is right
                assert torch.equal(value, want[key]), (what, key)
            t0, c0 = time.perf_counter(), _cpu()
            train_step(state, x)
            note(f"first_step_after_{what}", t0, c0)
            read[what] = {k: v for k, v in res.read.items() if k != "dcp_reasons"}
            del state
    out = {k: statistics.median(v) for k, v in got.items()}
    for what in RESUME_PATHS:
        for p in ("", "cpu_"):
            out[f"{p}resume_and_first_step_{what}_s"] = statistics.median(
                a + b for a, b in zip(got[f"{p}resume_{what}_s"], got[f"{p}first_step_after_{what}_s"]))
    return out, read


def one_repeat(preset: str, work: Path, rounds: int = 5) -> dict[str, float]:
    state = make_state(preset)
    tensors = flat_tensors(state.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    r: dict[str, float] = {"bytes": nbytes}

    # Warm-up (not timed): first calls pay one-off costs (imports, planner caches, page faults).
    raw_write(tensors, work / "warm.bin")
    dcp.save(state.state_dict(), checkpoint_id=str(work / "warm_dcp"), no_dist=True)
    save(work / "warm", state)

    r["raw_write_s"] = raw_write(tensors, work / "raw.bin")

    t0 = time.perf_counter()
    dcp.save(state.state_dict(), checkpoint_id=str(work / "plain_dcp"), no_dist=True)
    r["dcp_save_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    save(work / "sync", state)
    r["sync_save_s"] = time.perf_counter() - t0

    # Save against raw, side by side (raw, save, save, raw), so a drift in the disk's speed within the
    # repeat falls on both alike; each pair's files are removed before the next pair writes.
    # The raw write with early writeback (what saves do) goes between them both times.
    raws, raws_wb, saves = [], [], []
    for k, order in enumerate((("raw", "raw_wb", "save"), ("save", "raw_wb", "raw"))):
        for what in order:
            if what == "raw":
                raws.append(raw_write(tensors, work / f"paired{k}.bin"))
            elif what == "raw_wb":
                raws_wb.append(raw_write(tensors, work / f"paired{k}.wb.bin", writeback=True))
            else:
                t0 = time.perf_counter()
                save(work / f"paired{k}", state)
                saves.append(time.perf_counter() - t0)
        (work / f"paired{k}.bin").unlink()
        (work / f"paired{k}.wb.bin").unlink()
        shutil.rmtree(work / f"paired{k}")
    r["paired_raw_write_s"], r["paired_save_s"] = statistics.mean(raws), statistics.mean(saves)
    r["paired_raw_writeback_s"] = statistics.mean(raws_wb)
    saved_weights = {k: v.clone() for k, v in state.model.state_dict().items()}  # the loads below must match

    # the same state with Adam's moments in int8 (block-wise scales): bytes of the optimizer state
    t0 = time.perf_counter()
    save(work / "int8", state, quant="int8")
    r["int8_save_s"] = time.perf_counter() - t0

    def optim_bytes(ckpt: Path) -> int:
        return sum(math.prod(shape) * dtype.itemsize for key, (shape, dtype) in checkpoint_shapes(ckpt).items()
                   if key.startswith("optim."))

    r["optim_bytes_fp32"] = optim_bytes(work / "sync" / "step-000001")
    r["optim_bytes_int8"] = optim_bytes(work / "int8" / "step-000001")
    for algo in (CHECKSUM, "sha256"):  # what the checksums alone cost, read back with the page cache warm
        t0 = time.perf_counter()
        for f in (work / "sync" / "step-000001").iterdir():
            if f.name != "workbench.json":
                file_digest(f, algo=algo)
        r["checksum_s" if algo == CHECKSUM else "sha256_s"] = time.perf_counter() - t0

    # Async and zero-stall inside a real training loop: the copy to host buffers runs beside the next step's
    # forward and backward, and that step's optimizer.step() waits for it. Blocked = the loop's own part of
    # after_step plus that wait (the Checkpointer's blocking_s), against a loop with no checkpointing.
    x = torch.randint(0, PRESETS[preset].vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    plain = []
    for _ in range(3):
        t0 = time.perf_counter()
        train_step(state, x)
        plain.append(time.perf_counter() - t0)
    r["train_step_s"] = min(plain)
    for mode in ("async", "zero_stall"):
        ckpt = Checkpointer(work / mode, every=2, mode=mode)
        steps = []
        for i in range(7):  # saves at 2, 4, 6: the first allocates the host buffers (zero-stall: two sets)
            if state.step % 2 == 1:
                ckpt.wait()  # saves are far apart in training: the next one finds the writer idle
            t0 = time.perf_counter()
            train_step(state, x)
            ckpt.after_step(state)
            steps.append(time.perf_counter() - t0)
        ckpt.close()
        state.step -= 7
        r[f"{mode}_blocking_s"] = ckpt.saves[-1]["blocking_s"]
        r[f"{mode}_total_s"] = ckpt.saves[-1]["total_s"]
        if mode == "zero_stall":  # the stall of a step that only snapshots (median over the later ones)
            r["zero_stall_snapshot_s"] = statistics.median(ckpt.stalls[3:])
            r["zero_stall_train_step_s"] = statistics.median(steps[3:])

    save_file({k: v.clone() if v.dim() == 0 else v for k, v in tensors.items()}, str(work / "st.safetensors"))
    t0 = time.perf_counter()
    loaded = load_file(str(work / "st.safetensors"))
    touch(loaded.values())
    r["safetensors_load_s"] = time.perf_counter() - t0

    target = make_state(preset)
    t0 = time.perf_counter()
    res = load(work / "sync", target.model, target.optimizer, scheduler=target.scheduler)
    touch(live_tensors(target))
    r["load_s"] = time.perf_counter() - t0
    assert res.read["path"] == "direct", res.read  # every tensor read straight into place
    target2 = make_state(preset)
    t0 = time.perf_counter()
    load(work / "sync", target2.model, target2.optimizer, scheduler=target2.scheduler, verify=False)
    touch(live_tensors(target2))
    r["load_noverify_s"] = time.perf_counter() - t0
    target3 = make_state(preset)
    t0 = time.perf_counter()
    res = load(work / "sync", target3.model, target3.optimizer, scheduler=target3.scheduler, direct=False)
    touch(live_tensors(target3))
    r["load_dcp_reader_s"] = time.perf_counter() - t0
    assert res.read["path"] == "dcp"
    target4 = make_state(preset)
    t0 = time.perf_counter()
    res = load(work / "sync", target4.model, target4.optimizer, scheduler=target4.scheduler, mmap=True)
    touch(live_tensors(target4))
    r["load_mmap_s"] = time.perf_counter() - t0
    assert res.read["path"] == "mmap", res.read
    # The mapped load against safetensors, side by side: a load of 305 MB takes 30-50 ms here, where one
    # shot swings by 20% (a stray fault, a free that unmaps), so each repeat takes the median of 5
    # interleaved pairs, each mapped load into a fresh train state (it replaces that state's tensors).
    st_times, mmap_times = [], []
    for k in range(5):
        fresh = make_state(preset)
        for what in (("st", "mmap") if k % 2 == 0 else ("mmap", "st")):
            t0 = time.perf_counter()
            if what == "st":
                touch(load_file(str(work / "st.safetensors")).values())
                st_times.append(time.perf_counter() - t0)
            else:
                load(work / "sync", fresh.model, fresh.optimizer, scheduler=fresh.scheduler, mmap=True)
                touch(live_tensors(fresh))
                mmap_times.append(time.perf_counter() - t0)
        del fresh
    r["paired_safetensors_load_s"] = statistics.median(st_times)
    r["paired_load_mmap_s"] = statistics.median(mmap_times)
    for k, v in saved_weights.items():  # the benchmark measures loads that are right
        assert torch.equal(v, target.model.state_dict()[k]), k
        assert torch.equal(v, target4.model.state_dict()[k]), k
    # A mapped load copies nothing; the first step's writes copy the pages they touch (copy-on-write)
    t0 = time.perf_counter()
    train_step(target4, x)
    r["first_step_after_mmap_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_step(target4, x)
    r["next_step_after_mmap_s"] = time.perf_counter() - t0
    del target, target2, target3, target4
    resumed, r["resume_read"] = resume_rounds(preset, work / "sync", work / "st.safetensors", x, rounds, saved_weights)
    r.update(resumed)
    assert r["resume_read"]["default"]["mmap"] == "auto", r["resume_read"]
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None, help="model preset (default: small; tiny with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny preset, 1 repeat: a smoke run")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1, what each rank of a 2-process run on 2 cores gets; "
                         "on a busy machine more threads stall in OpenMP barriers on every small copy)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    preset = args.preset or ("tiny" if args.quick else "small")
    repeats = args.repeats or (1 if args.quick else 3)
    torch.manual_seed(0)
    runs = []
    for i in range(repeats):
        work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
        try:
            r = one_repeat(preset, work, rounds=3 if args.quick else 5)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        runs.append(r)
        gb = r["bytes"] / 1e9
        _log(f"repeat {i + 1}/{repeats}: {gb:.3f} GB  raw write {gb / r['paired_raw_write_s']:.2f} GB/s  "
             f"save {gb / r['paired_save_s']:.2f} GB/s (side by side)  dcp {r['dcp_save_s']:.2f}s  async blocked "
             f"{r['async_blocking_s'] * 1e3:.0f} ms  load {r['load_s']:.2f}s  safetensors {r['safetensors_load_s']:.2f}s  "
             f"resume {r['resume_default_s'] * 1e3:.0f} ms (copying {r['resume_copy_s'] * 1e3:.0f}, mapped "
             f"{r['resume_mapped_s'] * 1e3:.0f}, safetensors {r['resume_st_s'] * 1e3:.0f})")

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def ratio(num: str, den: str, invert: bool = False) -> dict[str, Any]:
        vals = [(r[den] / r[num]) if invert else (r[num] / r[den]) for r in runs]
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    nbytes = runs[0]["bytes"]
    doc = {
        "benchmark": "bench_checkpoint",
        "preset": preset, "n_params": PRESETS[preset].n_params, "state_bytes": nbytes,
        "repeats": repeats, "quick": args.quick, "threads": args.threads, "machine": machine_info(),
        "ratios": {
            # throughput ratio = (bytes / save_s) / (bytes / raw_s) = raw_s / save_s
            "save_throughput_vs_raw": ratio("paired_save_s", "paired_raw_write_s", invert=True),
            "save_throughput_vs_raw_writeback": ratio("paired_save_s", "paired_raw_writeback_s", invert=True),
            "save_time_vs_dcp": ratio("sync_save_s", "dcp_save_s"),
            "checksum_time_vs_dcp": ratio("checksum_s", "dcp_save_s"),
            "sha256_time_vs_dcp": ratio("sha256_s", "dcp_save_s"),
            "async_blocking_vs_sync": ratio("async_blocking_s", "sync_save_s"),
            "zero_stall_step_vs_sync": ratio("zero_stall_snapshot_s", "sync_save_s"),
            "zero_stall_step_vs_train_step": ratio("zero_stall_snapshot_s", "train_step_s"),
            "load_vs_safetensors": ratio("load_s", "safetensors_load_s"),
            "load_without_verify_vs_safetensors": ratio("load_noverify_s", "safetensors_load_s"),
            "load_dcp_reader_vs_safetensors": ratio("load_dcp_reader_s", "safetensors_load_s"),
            "load_mmap_vs_safetensors": ratio("paired_load_mmap_s", "paired_safetensors_load_s"),
            "first_step_after_mmap_vs_next_step": ratio("first_step_after_mmap_s", "next_step_after_mmap_s"),
            "resume_vs_safetensors": ratio("resume_default_s", "resume_st_s"),
            "resume_copy_vs_safetensors": ratio("resume_copy_s", "resume_st_s"),
            "resume_mapped_vs_safetensors": ratio("resume_mapped_s", "resume_st_s"),
            "first_step_after_resume_vs_after_copy": ratio("first_step_after_default_s", "first_step_after_copy_s"),
            "first_step_after_mapped_vs_after_copy": ratio("first_step_after_mapped_s", "first_step_after_copy_s"),
            "resume_and_first_step_vs_copy": ratio("resume_and_first_step_default_s", "resume_and_first_step_copy_s"),
            "resume_and_first_step_mapped_vs_copy": ratio("resume_and_first_step_mapped_s",
                                                          "resume_and_first_step_copy_s"),
            "int8_optimizer_bytes_vs_fp32": ratio("optim_bytes_int8", "optim_bytes_fp32"),
            "int8_save_time_vs_sync": ratio("int8_save_s", "sync_save_s"),
        },
        "seconds": {k: med(k) for k in runs[0] if k.endswith("_s") and not k.startswith("cpu_")},
        "cpu_seconds": {k[len("cpu_"):]: med(k) for k in runs[0] if k.startswith("cpu_")},
        "resume_read": runs[-1]["resume_read"],  # what each path's load reported (LoadResult.read), last round
        "throughput_gb_s": {"raw_write": nbytes / 1e9 / med("paired_raw_write_s"), "save": nbytes / 1e9 / med("paired_save_s"),
                            "dcp_save": nbytes / 1e9 / med("dcp_save_s")},
        "runs": runs,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
