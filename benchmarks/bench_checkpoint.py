"""Checkpoint save/load speed, as ratios to baselines measured on the same bytes in the same run.

    python benchmarks/bench_checkpoint.py                 # "small" preset (~25M params, ~300 MB state), 3 repeats
    python benchmarks/bench_checkpoint.py --quick         # "tiny" preset, 1 repeat (the test suite's smoke run)

One process, the full train state of a model after one AdamW step (fp32 weights + two moments + step
counters, LR scheduler, RNG), on the local disk in a temporary directory. Ratios (median over repeats):

* ``save_throughput_vs_raw``  workbench save GB/s  /  write+fsync of the same tensor bytes to one file
* ``save_time_vs_dcp``        workbench sync save time  /  plain ``dcp.save`` of the same state dict
                              (the difference: a manifest with the XXH3-128 of every file, taken as the
                              bytes are written, atomic publish, latest)
* ``checksum_time_vs_dcp``    XXH3-128 of the checkpoint's files read back (page cache warm; what hashing
                              costs, which the save now does on the bytes on their way out)  /  ``dcp.save``
* ``sha256_time_vs_dcp``      the same with sha256, what saves recorded before (for comparison)
* ``async_blocking_vs_sync``  time the training loop is blocked by an async save  /  sync save time
                              (target <= 0.1; the blocked part is the copy into reused host buffers)
* ``zero_stall_step_vs_sync`` per-step snapshot time of zero-stall mode  /  sync save time
* ``load_vs_safetensors``     workbench full-state load (checksum verification included) and a touch of
                              every tensor  /  ``safetensors.torch.load_file`` of the same tensors + touch
* ``load_without_verify_vs_safetensors``  the same with ``load(..., verify=False)``

Page cache: every save ends in fsync, so writes reach the disk; loads read files that were just written
(page cache warm) on both sides alike. stdout carries exactly one JSON document; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
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
from workbench.checkpoint.store import CHECKSUM, file_digest  # noqa: E402
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


def raw_write(tensors: dict[str, torch.Tensor], path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def touch(tensors) -> float:
    return float(sum(float(t.float().sum()) for t in tensors))


def one_repeat(preset: str, work: Path) -> dict[str, float]:
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
    for algo in (CHECKSUM, "sha256"):  # what the checksums alone cost, read back with the page cache warm
        t0 = time.perf_counter()
        for f in (work / "sync" / "step-000001").iterdir():
            if f.name != "workbench.json":
                file_digest(f, algo=algo)
        r["checksum_s" if algo == CHECKSUM else "sha256_s"] = time.perf_counter() - t0

    for mode in ("async", "zero_stall"):
        events: list[dict] = []
        ckpt = Checkpointer(work / mode, every=1, mode=mode, emit=lambda type, **f: events.append(f))
        for _ in range(3):  # the first saves allocate the host buffers (zero-stall: two sets); then reuse
            state.step += 1
            t0 = time.perf_counter()
            ckpt.after_step(state)
            blocked = time.perf_counter() - t0
            ckpt.wait()  # saves are far apart in training: the next one finds the writer idle
        ckpt.close()
        state.step -= 3
        r[f"{mode}_blocking_s"] = blocked
        r[f"{mode}_total_s"] = events[-1]["total_s"]
    # zero-stall's per-step cost: the snapshot alone (steps that do not persist)
    ckpt = Checkpointer(work / "zs_steps", every=1000, mode="zero_stall")
    ckpt.after_step(state)
    t0 = time.perf_counter()
    ckpt.after_step(state)
    r["zero_stall_snapshot_s"] = time.perf_counter() - t0
    ckpt.close()

    save_file({k: v.clone() if v.dim() == 0 else v for k, v in tensors.items()}, str(work / "st.safetensors"))
    t0 = time.perf_counter()
    loaded = load_file(str(work / "st.safetensors"))
    touch(loaded.values())
    r["safetensors_load_s"] = time.perf_counter() - t0

    target = make_state(preset)
    t0 = time.perf_counter()
    load(work / "sync", target.model, target.optimizer, scheduler=target.scheduler)
    touch(flat_tensors(target.state_dict(rng=False)).values())
    r["load_s"] = time.perf_counter() - t0
    target2 = make_state(preset)
    t0 = time.perf_counter()
    load(work / "sync", target2.model, target2.optimizer, scheduler=target2.scheduler, verify=False)
    touch(flat_tensors(target2.state_dict(rng=False)).values())
    r["load_noverify_s"] = time.perf_counter() - t0
    for k, v in state.model.state_dict().items():  # the benchmark measures a load that is right
        assert torch.equal(v, target.model.state_dict()[k]), k
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
            r = one_repeat(preset, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        runs.append(r)
        gb = r["bytes"] / 1e9
        _log(f"repeat {i + 1}/{repeats}: {gb:.3f} GB  raw write {gb / r['raw_write_s']:.2f} GB/s  "
             f"save {gb / r['sync_save_s']:.2f} GB/s  dcp {r['dcp_save_s']:.2f}s  async blocked "
             f"{r['async_blocking_s'] * 1e3:.0f} ms  load {r['load_s']:.2f}s  safetensors {r['safetensors_load_s']:.2f}s")

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
            "save_throughput_vs_raw": ratio("sync_save_s", "raw_write_s", invert=True),
            "save_time_vs_dcp": ratio("sync_save_s", "dcp_save_s"),
            "checksum_time_vs_dcp": ratio("checksum_s", "dcp_save_s"),
            "sha256_time_vs_dcp": ratio("sha256_s", "dcp_save_s"),
            "async_blocking_vs_sync": ratio("async_blocking_s", "sync_save_s"),
            "zero_stall_step_vs_sync": ratio("zero_stall_snapshot_s", "sync_save_s"),
            "load_vs_safetensors": ratio("load_s", "safetensors_load_s"),
            "load_without_verify_vs_safetensors": ratio("load_noverify_s", "safetensors_load_s"),
        },
        "seconds": {k: med(k) for k in runs[0] if k.endswith("_s")},
        "throughput_gb_s": {"raw_write": nbytes / 1e9 / med("raw_write_s"), "save": nbytes / 1e9 / med("sync_save_s"),
                            "dcp_save": nbytes / 1e9 / med("dcp_save_s")},
        "runs": runs,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
