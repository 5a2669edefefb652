"""This machine's speeds, measured, saved as a device profile that step-time predictions use.

    profile = workbench.time.calibrate(quick=True)     # ~20 s on 2 cores; saved as devices/cpu.json
    workbench time calibrate --ranks 2,4 --json         # the same from the command line

What is measured (each a figure the link and roofline models of :mod:`workbench.time.devices` need):

- **matmul**: flop/s of ``A @ B`` per dtype (float32, bfloat16) over a few square GEMM sizes, best of a few
  repeats per size (``2 n^3 / t``). The profile's figure is the best size; every size is kept.
- **attention**: flop/s of causal ``scaled_dot_product_attention`` at one training-like shape; the
  profile's ``efficiency["attention"]`` is it over the matmul peak of the same dtype.
- **elementwise**: bytes/s of ``add``, ``mul`` and ``copy`` on tensors larger than the caches (bytes moved:
  two reads and a write for add/mul, a read and a write for copy). The profile's figure is their median.
- **op overhead**: seconds per tiny eager aten op (an add of 8 elements), and per view op.
- **collectives**: real process groups (gloo here; NCCL where there is a GPU per rank) of each group size in
  ``ranks``, spawned as separate processes with hard timeouts. For all_reduce, all_gather, reduce_scatter,
  all_to_all, broadcast and send_recv (each rank sends to the next and receives from the previous, as
  pipeline stages do) over several payloads, the time of one call (the slowest rank's, median over
  repeats) is fitted by least squares as ``latency + bytes / bandwidth`` (relative errors weighted alike,
  so small payloads fix the latency and large ones the bandwidth). ``bytes`` is the full buffer, as
  nccl-tests counts it: the tensor all-reduced or broadcast, all_gather's output, reduce_scatter's input,
  all_to_all's per-rank input, one send's message. One link fitted through the link model to all of them
  is the profile's ``intra`` (and, on one host, ``inter``) link.

A CPU profile is one rank's on one thread (:mod:`workbench.time.devices`), with ``cores``: how many
cores the ranks of a job share. The prediction shares them out (processor sharing: while k ranks compute
on c cores, each runs at min(1, c/k) of its speed). The figures are this process's best on one thread; on
a CPU with ``ranks``, once the collectives are timed, every one of the ``max(ranks)`` spawned ranks also
measures them at the same time, sustained, and that is kept in ``measured`` (``collectives.concurrent``) to
show what sharing costs. On a GPU (one per rank) the figures are this process's, timed with CUDA events.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["calibrate", "fit_latency_bandwidth", "fit_link", "measure_matmul", "measure_attention", "measure_elementwise",
           "measure_op_overhead", "measure_compute", "describe",
           "measure_collectives", "parse_ranks", "profile_dir", "COLLECTIVES", "MAX_CALIBRATE_RANKS"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
MAX_CALIBRATE_RANKS = 64  # processes spawned on this machine at once; more says nothing a fit of fewer does not
# the profile's dtype names (workbench.time.devices) for torch's
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}

# (quick, full) settings. Payload sizes are bytes of float32 buffers; matmul sizes are square GEMM sides.
_PLAN = {
    "cpu": {
        True: dict(matmul=(256, 512), matmul_repeats=3, elementwise_mb=32, elementwise_repeats=3, overhead_ops=2000,
                   payloads=(16 << 10, 256 << 10, 2 << 20), collective_repeats=4),
        False: dict(matmul=(256, 512, 1024), matmul_repeats=5, elementwise_mb=64, elementwise_repeats=5,
                    overhead_ops=10000, payloads=(4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20),
                    collective_repeats=8),
    },
    "cuda": {
        True: dict(matmul=(2048, 4096), matmul_repeats=5, elementwise_mb=256, elementwise_repeats=5,
                   overhead_ops=2000, payloads=(64 << 10, 4 << 20, 64 << 20), collective_repeats=5),
        False: dict(matmul=(2048, 4096, 8192), matmul_repeats=10, elementwise_mb=1024, elementwise_repeats=10,
                    overhead_ops=10000, payloads=(64 << 10, 1 << 20, 16 << 20, 128 << 20, 512 << 20),
                    collective_repeats=10),
    },
}


def profile_dir() -> Path:
    """Where calibrated profiles are saved and found (:func:`workbench.time.devices.profile_dir`):
    ``$WORKBENCH_DEVICE_PROFILE_DIR``, else ``~/.cache/workbench/devices``."""
    from workbench.time.devices import profile_dir as where

    return where().expanduser()


def parse_ranks(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"2,4"`` -> ``(2, 4)``: group sizes to measure collectives on, each from 2 to ``MAX_CALIBRATE_RANKS``.
    An empty string measures none. Raises one ValueError naming the bad part and the fix."""
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        out = []
        for p in parts:
            try:
                out.append(int(p))
            except ValueError:
                raise ValueError(f"--ranks: {p!r} is not a whole number; pass group sizes like 2,4") from None
    else:
        out = [int(r) for r in text]
    for r in out:
        if not 2 <= r <= MAX_CALIBRATE_RANKS:
            raise ValueError(f"--ranks: {r} is not a group size from 2 to {MAX_CALIBRATE_RANKS}; pass sizes like 2,4 "
                             "(or an empty string for no collectives)")
    return tuple(sorted(set(out)))


# ---------------------------------------------------------------------------------------------- timing
def _timer(device: str) -> Callable[[Callable[[], Any], int], float]:
    """``time(fn, inner)``: seconds per call of ``fn`` over ``inner`` back-to-back calls, synchronized: CUDA
    events on a GPU, the monotonic clock on the CPU."""
    import torch

    if device.startswith("cuda"):
        def cuda_time(fn: Callable[[], Any], inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner

        return cuda_time

    def cpu_time(fn: Callable[[], Any], inner: int) -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    return cpu_time


def _best(fn: Callable[[], Any], device: str, repeats: int, inner: int = 1, pick: Callable = min) -> float:
    """Seconds per call: ``pick`` (min: the device's best; statistics.median: what it sustains while sharing)
    over ``repeats`` timed stretches of ``inner`` calls, after one warm-up call."""
    clock = _timer(device)
    clock(fn, 1)  # warm-up: allocation, kernel selection, first-touch of pages
    return pick([clock(fn, inner) for _ in range(max(1, repeats))])


def measure_matmul(device: str = "cpu", sizes: Sequence[int] = (256, 512), dtypes: Sequence[str] = ("float32", "bfloat16"),
                   repeats: int = 3, pick: Callable = min, stretch: float = 1.0) -> dict[str, dict[str, float]]:
    """flop/s of an ``n x n`` by ``n x n`` matmul per dtype and size: ``{dtype: {str(n): flop/s}}`` (best of
    ``repeats``, or ``pick`` of them; ``stretch`` scales the calls per timed stretch)."""
    import torch

    out: dict[str, dict[str, float]] = {}
    for dt in dtypes:
        dtype = getattr(torch, dt)
        out[dt] = {}
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            flops = 2.0 * n * n * n
            # enough calls that one timed stretch is ~ms even for the smallest size on a fast device
            inner = max(1, int(stretch * (2e8 if device == "cpu" else 2e11) // flops))
            s = _best(lambda a=a, b=b: torch.mm(a, b), device, repeats, inner, pick)
            out[dt][str(n)] = flops / s
    return out


def measure_elementwise(device: str = "cpu", megabytes: int = 32, repeats: int = 3, pick: Callable = min) -> dict[str, float]:
    """bytes/s of add, mul and copy on float32 tensors of ``megabytes`` each (bytes moved: reads + writes)."""
    import torch

    n = megabytes * (1 << 20) // 4
    a, b, c = (torch.rand(n, device=device) for _ in range(3))
    ops = {"add": (lambda: torch.add(a, b, out=c), 3), "mul": (lambda: torch.mul(a, b, out=c), 3),
           "copy": (lambda: c.copy_(a), 2)}
    nbytes = n * 4
    return {name: moved * nbytes / _best(fn, device, repeats, 1, pick) for name, (fn, moved) in ops.items()}


def measure_op_overhead(device: str = "cpu", ops: int = 2000, repeats: int = 3, view: bool = False,
                        pick: Callable = min) -> float:
    """Seconds per tiny aten op as a training step runs it: a chain of tiny ``mul``/``add`` on a tensor that
    requires grad, forward and backward, over the aten ops that ran (autograd's recording and its engine
    included: on this CPU about 3x a bare ``torch.add``). ``view``: an op that only makes a view
    (``x.view(2, 4)``: dispatch, no kernel)."""
    import torch

    from workbench import compat

    y = torch.ones(8, device=device)
    if view:
        fn = lambda: y.view(2, 4)  # noqa: E731
        count = 1
    else:
        x = torch.ones(8, device=device, requires_grad=True)
        links = max(20, ops // 6)

        def fn():
            z = x
            for _ in range(links):
                z = z * 1.0001 + y
            z.sum().backward()

        class Count(compat.get("TorchDispatchMode")):  # the aten ops one chain runs, counted once
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Count.n += 1
                return func(*args, **(kwargs or {}))

        with Count():
            fn()
        count = max(1, Count.n)
    clock = _timer(device)
    clock(fn, 3 if not view else 100)
    calls = 3 if not view else ops
    return pick([clock(fn, calls) / count for _ in range(max(1, repeats))])


def measure_compute(device: str, plan: dict[str, Any], quick: bool, sustained: bool = False) -> dict[str, Any]:
    """matmul, attention, elementwise and per-op overhead figures of this process (``plan``: ``_PLAN``'s
    sizes). ``sustained``: the median of longer stretches instead of the best (ranks sharing cores)."""
    pick, reps = (statistics.median, max(5, plan["matmul_repeats"])) if sustained else (min, plan["matmul_repeats"])
    return {"matmul": measure_matmul(device, plan["matmul"], repeats=reps, pick=pick, stretch=4.0 if sustained else 1.0),
            "attention": measure_attention(device, quick=quick, repeats=reps, pick=pick),
            "elementwise": measure_elementwise(device, plan["elementwise_mb"], max(reps, plan["elementwise_repeats"]),
                                               pick),
            "op_overhead_s": measure_op_overhead(device, plan["overhead_ops"], reps, pick=pick),
            "view_overhead_s": measure_op_overhead(device, plan["overhead_ops"], reps, view=True, pick=pick)}


def _leaves(d: Any, prefix: str = "") -> list[tuple[str, float]]:
    """The numeric leaves of a nested dict, in key order (``a/b``: value): to average them across ranks."""
    if isinstance(d, dict):
        return [kv for k in sorted(d) for kv in _leaves(d[k], f"{prefix}{k}/")]
    return [(prefix[:-1], float(d))] if isinstance(d, (int, float)) and not isinstance(d, bool) else []


def _with_leaves(d: Any, values: dict[str, float], prefix: str = "") -> Any:
    if isinstance(d, dict):
        return {k: _with_leaves(v, values, f"{prefix}{k}/") for k, v in d.items()}
    return values.get(prefix[:-1], d)


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> dict[str, float]:
    """Least squares of ``seconds = latency + bytes / bytes_per_s`` over ``(bytes, seconds)`` points, each
    point's relative error weighted alike. Both come out positive: a negative intercept (noise) is fitted
    through the origin with the latency the smallest point's time share. Returns latency_s, bytes_per_s and
    the fit's worst relative error (``max_rel_error``)."""
    import numpy as np

    pts = [(float(b), float(s)) for b, s in points if b >= 0 and s > 0 and math.isfinite(s)]
    if not pts:
        raise ValueError("no (bytes, seconds) points to fit; measure at least one payload")
    x = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    w = 1.0 / t
    if len(pts) >= 2 and np.ptp(x) > 0:
        A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
        (lat, inv_bw), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    else:
        lat, inv_bw = 0.0, t[0] / max(x[0], 1.0)
    if inv_bw <= 0:  # the time did not grow with the payload (noise): the fastest call is the latency and
        lat = float(t.min())  # the bandwidth the steepest excess over it (1 TB/s when there is none)
        inv_bw = max(float(np.max((t - lat) / np.maximum(x, 1.0))), 1e-12)
    if lat < 0:
        inv_bw = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
        lat = float(min(t.min(), 1e-6))
    pred = lat + x * inv_bw
    return {"latency_s": float(lat), "bytes_per_s": float(1.0 / inv_bw),
            "max_rel_error": float(np.max(np.abs(pred - t) / t))}


# ---------------------------------------------------------------------------------------------- collectives
def measure_collectives(ranks: Sequence[int] = (2, 4), payloads: Sequence[int] = (16 << 10, 256 << 10, 2 << 20),
                        repeats: int = 4, backend: str | None = None, timeout_s: float = 120.0,
                        kinds: Sequence[str] = COLLECTIVES, compute: dict[str, Any] | None = None,
                        quick: bool = True) -> dict[str, Any]:
    """Time each collective on real process groups of every size in ``ranks`` and fit each.

    One set of ``max(ranks)`` processes is spawned (this interpreter, ``-m workbench.time.calibrate``); each
    smaller group is a subgroup of it. Returns ``{"backend", "world", "groups": {str(g): {kind: {latency_s,
    bytes_per_s, max_rel_error, points: [[bytes, seconds], ...]}}}, "concurrent": figures}``: with ``compute``
    (a ``_PLAN`` entry), every rank then measures :func:`measure_compute` at once, sustained, and
    ``figures`` are their mean per rank (what each rank of a job this size gets). Raises
    TimeoutError (the processes killed) when they do not finish in ``timeout_s``, RuntimeError naming the rank
    that failed.
    """
    ranks = parse_ranks(ranks)
    if not ranks:
        return {"backend": None, "world": 0, "groups": {}}
    unknown = [k for k in kinds if k not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collective(s) {unknown}; choose from {list(COLLECTIVES)}")
    if backend is None:
        backend = _default_backend(max(ranks))
    world = max(ranks)
    with tempfile.TemporaryDirectory(prefix="wb-calibrate-") as tmp:
        spec = {"world": world, "groups": list(ranks), "payloads": [int(p) for p in payloads], "repeats": int(repeats),
                "backend": backend, "kinds": list(kinds), "store": str(Path(tmp) / "store"),
                "out": str(Path(tmp) / "result.json"), "pg_timeout_s": max(10.0, float(timeout_s)),
                "compute": compute, "quick": bool(quick)}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])]))
        logs = [open(Path(tmp) / f"rank{r}.log", "w+b") for r in range(world)]  # noqa: SIM115 - closed below
        procs = [subprocess.Popen([sys.executable, "-m", "workbench.time.calibrate", "--rank-worker",
                                   str(Path(tmp) / "spec.json"), str(r)], env=env, stdout=logs[r], stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
                 for r in range(world)]
        try:
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                r = failed[0]
                raise RuntimeError(f"collective calibration: rank {r} of {world} failed ({backend}): "
                                   f"{_last_line(logs[r])}")
            if any(p.poll() is None for p in procs):
                raise TimeoutError(f"collective calibration on {world} {backend} ranks did not finish within "
                                   f"{timeout_s:g} s; the machine may be overloaded: pass fewer --ranks or a "
                                   "larger timeout")
            raw = json.loads(Path(spec["out"]).read_text())
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
    groups: dict[str, Any] = {}
    for g, by_kind in raw["groups"].items():
        groups[g] = {}
        for kind, points in by_kind.items():
            groups[g][kind] = {**fit_latency_bandwidth(points), "points": points}
    return {"backend": backend, "world": world, "groups": groups, "concurrent": raw.get("concurrent") or None}


def _last_line(f) -> str:
    f.flush()
    f.seek(0)
    lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "no output"


def _default_backend(world: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def _rank_worker(spec_path: str, rank: int) -> None:
    """One rank of :func:`measure_collectives` (run as ``python -m workbench.time.calibrate --rank-worker``)."""
    import signal
    from datetime import timedelta

    from workbench.lifeline import exit_now, follow_parent

    follow_parent(signal.SIGKILL)  # the calibrating process went away: do not linger
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, backend = spec["world"], spec["backend"]
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{rank % torch.cuda.device_count()}"
    dist.init_process_group(backend, init_method=f"file://{spec['store']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec["pg_timeout_s"]))
    sync = (lambda: torch.cuda.synchronize()) if device != "cpu" else (lambda: None)
    results: dict[str, dict[str, list]] = {}
    concurrent: dict[str, Any] = {}
    for g in spec["groups"]:
        group = dist.new_group(list(range(g))) if g < world else dist.group.WORLD
        if rank < g:
            results[str(g)] = {}
            for kind in spec["kinds"]:
                pts = []
                for nbytes in spec["payloads"]:
                    call = _collective(kind, nbytes, g, rank, group, device)
                    # small payloads: several calls per timed stretch, so a rank's late start after the
                    # barrier (a busy machine) is shared out instead of counted whole
                    inner = max(1, min(16, (1 << 20) // max(nbytes, 1)))
                    times = []
                    for i in range(spec["repeats"] + 1):
                        dist.barrier(group=group)
                        sync()
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            call()
                        sync()
                        times.append((time.perf_counter() - t0) / inner)
                    # the call's time is its slowest rank's; the first repeat warmed up
                    t = torch.tensor(times[1:], dtype=torch.float64, device=device)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                    pts.append([nbytes, statistics.median(t.cpu().tolist())])
                results[str(g)][kind] = pts
        dist.barrier()
    if spec.get("compute"):  # every rank computing at once, sharing the machine as a job's ranks do
        figures = measure_compute(device, spec["compute"], spec["quick"], sustained=True)
        leaves = _leaves(figures)
        mean = torch.tensor([v for _, v in leaves], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        concurrent = _with_leaves(figures, {k: float(v) / world for (k, _), v in zip(leaves, mean.tolist())})
    if rank == 0:
        tmp = spec["out"] + ".tmp"
        Path(tmp).write_text(json.dumps({"groups": results, "concurrent": concurrent}))
        os.replace(tmp, spec["out"])
    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def _collective(kind: str, nbytes: int, g: int, rank: int, group, device: str) -> Callable[[], None]:
    """A call doing ``kind`` once over ``nbytes`` (the full buffer, as nccl-tests counts it)."""
    import torch
    import torch.distributed as dist

    n = max(g, nbytes // 4 // g * g)  # float32 elements, divisible by the group size
    if kind == "all_reduce":
        x = torch.ones(n, device=device)
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        out, shard = torch.empty(n, device=device), torch.ones(n // g, device=device)
        return lambda: dist.all_gather_into_tensor(out, shard, group=group)
    if kind == "reduce_scatter":
        inp, shard = torch.ones(n, device=device), torch.empty(n // g, device=device)
        return lambda: _reduce_scatter(shard, inp, g, group)
    if kind == "all_to_all":
        inp, out = torch.ones(n, device=device), torch.empty(n, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    if kind == "broadcast":
        x = torch.ones(n, device=device)
        return lambda: dist.broadcast(x, src=0, group=group)
    if kind == "send_recv":
        send, recv = torch.ones(n, device=device), torch.empty(n, device=device)
        nxt, prv = (rank + 1) % g, (rank - 1) % g

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, send, nxt, group=group), dist.P2POp(dist.irecv, recv, prv, group=group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        return ring
    raise ValueError(f"unknown collective {kind!r}")


def _reduce_scatter(shard, inp, g: int, group) -> None:
    import torch.distributed as dist

    try:
        dist.reduce_scatter_tensor(shard, inp, group=group)
    except (RuntimeError, NotImplementedError):  # a gloo without reduce_scatter_tensor: the list form
        dist.reduce_scatter(shard, list(inp.chunk(g)), group=group)


# ---------------------------------------------------------------------------------------------- profile
def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def calibrate(*, ranks: Sequence[int] | str = (2, 4), quick: bool = False, out: str | os.PathLike | None = None,
              save: bool = True, device: str | None = None, progress: bool = True, timeout_s: float = 180.0):
    """Measure this machine and return its :class:`~workbench.time.devices.DeviceProfile` (``calibrated``
    True), saved as ``<profile_dir()>/<name>.json`` (or ``out``: a ``.json`` file or a directory) unless
    ``save`` is False; ``device_profile("cpu")`` (or the GPU's name) then finds it. ``device``: ``"cpu"`` or
    ``"cuda"`` (default: cuda when available). ``ranks``: group sizes for the collectives (empty: none
    measured; the profile keeps the default links and says so). ``quick`` keeps the whole run to ~20 s on 2
    cores (fewer sizes and repeats). The file also keeps every measurement (``measured``: per size, per
    collective and group size), which the profile reader ignores."""
    import torch

    from workbench.cpu_quota import usable_cpus
    from workbench.progress import tqdm

    ranks = parse_ranks(ranks)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: calibrate measures 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no GPU here; calibrate the CPU with device='cpu'")
    plan = _PLAN[device][bool(quick)]
    skipped = None
    if device == "cuda" and any(g > torch.cuda.device_count() for g in ranks):
        # NCCL needs a GPU per rank; gloo's figures would say nothing of this GPU's links
        skipped = (f"group sizes {[g for g in ranks if g > torch.cuda.device_count()]} skipped: "
                   f"{torch.cuda.device_count()} GPU(s) here, NCCL needs one per rank")
        ranks = tuple(g for g in ranks if g <= torch.cuda.device_count())
    where = "cuda:0" if device == "cuda" else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    stages = ["matmul", "attention", "elementwise", "op overhead"] + (["collectives"] if ranks else [])
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # one rank's view: the launcher gives each of several ranks one thread here
    measured: dict[str, Any] = {}
    try:
        with tqdm(total=len(stages), desc="calibrate", unit="stage", disable=not progress, leave=False,
                  file=sys.stderr) as bar:
            def stage(label: str) -> None:
                bar.set_postfix_str(label)

            stage("matmul")
            measured["matmul"] = measure_matmul(where, plan["matmul"], repeats=plan["matmul_repeats"])
            bar.update()
            stage("attention")
            measured["attention"] = measure_attention(where, quick=quick)
            bar.update()
            stage("elementwise")
            measured["elementwise"] = measure_elementwise(where, plan["elementwise_mb"], plan["elementwise_repeats"])
            bar.update()
            stage("op overhead")
            measured["op_overhead_s"] = measure_op_overhead(where, plan["overhead_ops"])
            measured["view_overhead_s"] = measure_op_overhead(where, plan["overhead_ops"], view=True)
            bar.update()
            if ranks:
                stage(f"collectives on {','.join(map(str, ranks))} ranks")
                measured["collectives"] = measure_collectives(
                    ranks, plan["payloads"], plan["collective_repeats"], backend="nccl" if device == "cuda" else "gloo",
                    timeout_s=timeout_s, compute=plan if device == "cpu" else None, quick=quick)
                bar.update()
    finally:
        if device == "cpu":
            torch.set_num_threads(threads)
    if skipped:
        measured["collectives_skipped"] = skipped
    measured["threads"] = 1 if device == "cpu" else None
    measured["usable_cpus"] = usable_cpus()
    measured["seconds"] = round(time.perf_counter() - t_start, 2)
    memory = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else _host_memory_bytes()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    fields = profile_fields(name, measured, source=f"workbench time calibrate on {socket.gethostname()} {date}",
                            memory_bytes=int(memory), device=device)
    profile = _to_profile(fields)
    if save:
        _save(profile, measured, _target(out, name))
    return profile


def measure_attention(device: str = "cpu", quick: bool = True, repeats: int = 3, pick: Callable = min) -> dict[str, Any]:
    """flop/s of ``scaled_dot_product_attention`` (causal, float32 here, bf16 on a GPU) at one training-like
    shape, counted as ``4 B H L^2 D`` (QK^T and AV, as torch's flop counter does)."""
    import torch
    import torch.nn.functional as F

    b, h, d = (2, 8, 64) if device == "cpu" else (4, 32, 128)
    seq = (256 if quick else 512) if device == "cpu" else 4096
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(b, h, seq, d, device=device, dtype=dtype) for _ in range(3))
    s = _best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats, 1, pick)
    return {"flops_per_s": 4.0 * b * h * seq * seq * d / s, "seq_len": seq, "dtype": DTYPES[str(dtype).split(".")[-1]]}


def profile_fields(name: str, measured: dict[str, Any], *, source: str, memory_bytes: int, device: str) -> dict[str, Any]:
    """The DeviceProfile's fields (a plain dict) from what :func:`calibrate` measured.

    On a CPU with collectives measured, the compute figures are those each of the ``max(ranks)`` ranks
    sustained while all of them computed at once (``measured.collectives.concurrent``): a CPU profile is one
    rank's, and ranks of a job share this machine's cores (and whatever else runs on it). Without ranks (or
    on a GPU, one per rank) they are this process's best (``measured``'s top level).
    ``matmul_flops`` is the best GEMM size per dtype. Efficiencies (fractions of that peak) are measured too:
    ``matmul`` the median size's rate (a model's GEMMs are not all the largest), ``attention`` SDPA's rate
    against the same dtype's peak, ``elementwise`` and ``collective`` 1 (their figures are achieved rates)."""
    coll = measured.get("collectives") or {}
    fig = measured  # one rank alone; sharing the cores is the prediction's (DeviceProfile.cores)
    matmul = {DTYPES.get(dt, dt): max(by_size.values()) for dt, by_size in fig["matmul"].items()}
    eff_mm = statistics.median(statistics.median(v.values()) / max(v.values()) for v in fig["matmul"].values())
    att = fig.get("attention") or {}
    eff_att = min(1.0, att["flops_per_s"] / matmul.get(att["dtype"], max(matmul.values()))) if att else 0.7
    if device == "cuda":
        per_rank = "one GPU per rank"
    else:
        per_rank = (f"compute figures of one thread alone (best of repeats); the ranks of a job share "
                    f"{measured.get('usable_cpus', '?')} cores (cores), which the prediction shares out")
        if coll.get("concurrent"):
            per_rank += (f"; while {coll['world']} ranks computed at once each reached matmul fp32 "
                         f"{max(coll['concurrent']['matmul']['float32'].values()) / 1e9:.1f} GFLOP/s "
                         "(measured.collectives.concurrent)")
    assumptions = {"per_rank": per_rank,
                   "matmul": f"best of square GEMMs {sorted(int(n) for n in next(iter(fig['matmul'].values())))}; "
                             "efficiency: the median size's rate over the best"}
    if coll.get("groups"):
        link = fit_link(coll["groups"])
        links = {"intra": _link_fields(link), "inter": _link_fields(link)}  # one host: every group is intra-node
        assumptions["links"] = (f"one link fitted to {coll['backend']} collectives on "
                                f"{', '.join(coll['groups'])} ranks (worst point off by {link['max_rel_error']:.0%}); "
                                "inter = intra (one host); per-collective fits in 'measured'")
    else:
        links = _default_links(name, device)
        assumptions["links"] = "not measured (no --ranks): the default links"
    return {"name": name, "calibrated": True, "source": source, "kind": device, "matmul_flops": matmul,
            "elementwise_bytes_per_s": float(statistics.median(fig["elementwise"].values())),
            "efficiency": {"matmul": float(min(1.0, eff_mm)), "attention": float(max(eff_att, 1e-3)),
                           "elementwise": 1.0, "collective": 1.0},
            "op_overhead_s": float(fig["op_overhead_s"]), "view_overhead_s": float(fig["view_overhead_s"]),
            "links": links, "gpus_per_node": 1 << 16 if device == "cpu" else 8,
            "cores": int(measured.get("usable_cpus") or os.cpu_count() or 1) if device == "cpu" else 0,
            "memory_bytes": int(memory_bytes), "assumptions": assumptions}


def _link_fields(link: dict[str, Any]) -> dict[str, Any]:
    return {k: link[k] for k in ("latency_s", "bytes_per_s", "algorithm")}


def _default_links(name: str, device: str) -> dict[str, dict[str, Any]]:
    """Links to keep when none were measured: the CPU default's, or a shipped GPU profile's of the same name."""
    from workbench.time.devices import device_profile

    base = "cpu"
    if device == "cuda":
        base = next((n for n in ("H200", "H100-SXM", "A100-SXM-80GB") if n.split("-")[0] in name), "H100-SXM")
    prof = device_profile(base) if device == "cuda" else _cpu_default_links()
    return {k: {"latency_s": v.latency_s, "bytes_per_s": v.bytes_per_s, "algorithm": v.algorithm}
            for k, v in (prof.links if hasattr(prof, "links") else prof).items()}


def _cpu_default_links():
    from workbench.time import devices

    return devices._cpu_default().links


def fit_link(groups: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """One link (latency_s, bytes_per_s, algorithm "ring") that best explains every measured point under the
    link model's own formula (:meth:`DeviceProfile.collective_time`), fitted by least squares on relative
    errors. The model is linear in ``latency`` and ``1 / bandwidth``: each point's two coefficients are the
    model's time with a unit latency and free bytes, and with no latency and one byte per second."""
    import numpy as np

    model = _link_model()
    rows, t = [], []
    for g, by_kind in groups.items():
        for kind, fit in by_kind.items():
            for nbytes, seconds in fit["points"]:
                rows.append((model(kind, nbytes, int(g), 1.0, math.inf), model(kind, nbytes, int(g), 0.0, 1.0)))
                t.append(seconds)
    A, t = np.array(rows, dtype=float), np.array(t, dtype=float)
    w = 1.0 / t
    (lat, inv_bw), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    if inv_bw <= 0 or lat < 0:  # noise: the medians of the per-collective fits
        fits = [f for by_kind in groups.values() for f in by_kind.values()]
        lat = statistics.median(f["latency_s"] for f in fits)
        inv_bw = 1.0 / statistics.median(f["bytes_per_s"] for f in fits)
    pred = A @ np.array([lat, inv_bw])
    return {"latency_s": float(lat), "bytes_per_s": float(1.0 / inv_bw), "algorithm": "ring",
            "max_rel_error": float(np.max(np.abs(pred - t) / t))}


def _link_model() -> Callable[[str, float, int, float, float], float]:
    """``time(kind, bytes, group_size, latency_s, bytes_per_s)`` under the one link model,
    :meth:`workbench.time.devices.DeviceProfile.collective_time`, on a throwaway profile with that link
    (``bytes_per_s`` inf: bytes cost nothing)."""
    from workbench.time.devices import DeviceProfile, Link

    def model(kind: str, nbytes: float, g: int, latency: float, bytes_per_s: float) -> float:
        free = bytes_per_s == math.inf
        link = Link(latency_s=latency, bytes_per_s=1.0 if free else bytes_per_s, algorithm="ring")
        prof = DeviceProfile(name="fit", calibrated=True, source="fit", matmul_flops={"fp32": 1.0},
                             elementwise_bytes_per_s=1.0, efficiency={"collective": 1.0}, op_overhead_s=0.0,
                             links={"intra": link, "inter": link}, gpus_per_node=max(g, 1), kind="cpu")
        return float(prof.collective_time(_KIND.get(kind, kind), 0.0 if free else nbytes, g, intra=True))

    return model


_KIND = {"send_recv": "send/recv"}  # our measurement's name -> the link model's


def _ring_time(kind: str, nbytes: float, g: int, latency: float, bytes_per_s: float) -> float:
    """The link model's time for a ring link (what :func:`fit_link` inverts)."""
    return _link_model()(kind, nbytes, g, latency, bytes_per_s)


def _to_profile(fields: dict[str, Any]):
    from workbench.time.devices import DeviceProfile

    return DeviceProfile.from_dict({"format": "workbench.device_profile", "version": 1, **fields},
                                   f"the calibrated profile of {fields['name']}")


def _target(out: str | os.PathLike | None, name: str) -> Path:
    if out is None:
        return profile_dir() / f"{name}.json"
    p = Path(out).expanduser()
    if p.suffix == ".json" and not p.is_dir():
        return p
    return p / f"{name}.json"


def _save(profile, measured: dict[str, Any], path: Path) -> None:
    """The profile's JSON plus ``measured`` (every figure behind it), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**profile.to_dict(), "measured": measured}, indent=1))
    os.replace(tmp, path)


def describe(profile, path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The profile as plain JSON values (for ``--json`` and the benchmark), with the measurements behind it
    (``measured``) when ``path``, the file :func:`calibrate` saved, has them."""
    doc = {**profile.to_dict(), "host": platform.node()}
    if path is not None:
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            saved = {}
        if isinstance(saved, dict) and isinstance(saved.get("measured"), dict):
            doc["measured"] = saved["measured"]
    return doc


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--rank-worker":
    _rank_worker(sys.argv[2], int(sys.argv[3]))
