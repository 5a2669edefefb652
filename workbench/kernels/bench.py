"""Is every kernel fast? :func:`bench` over the registered cases (``workbench kernels bench``).

For each :class:`~workbench.kernels.cases.KernelCase` (``workbench.kernels.cases.CASES``), dtype and size::

    ours  = case.run(inputs)   under kernels='triton'   Triton: compiled on CUDA, interpreted on CPU
    ref   = case.run(inputs)   under kernels='torch'    the reference path, plain torch ops (ground truth)
    eager = case.torch_eager(inputs)                    torch's own ops: what a user writes today

    bench (CUDA):  time_ms        median of CUDA-event times after warm-up
                   GB/s           bytes_moved / time          (the least traffic the op must make)
                   copy_fraction  copy_ms / time_ms           copy_ms: dst.copy_(src) of bytes_moved / 2
                                                              bytes (read + write = the same traffic)
                   vs_eager       eager_ms / time_ms          > 1: ours is faster
                   vs_compile     compile_ms / time_ms        torch.compile(torch_eager), mode default

Without a GPU ``bench`` times only the torch reference path and torch eager on CPU at small sizes, and
says so in its ``note``: Triton's interpreter runs a kernel one program at a time in numpy, so its times
say nothing about speed and are never reported as such. Correctness is what a CPU can show: ``check``.

    result = bench(sizes=[1 << 20, 1 << 24])              # a KernelBench; .to_frame(), .plot("gbps")
    workbench kernels check|bench [--json]
"""

from __future__ import annotations

import html
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from workbench.display import RendersInNotebook
from workbench.kernels import _triton
from workbench.kernels.backend import KernelUnavailable, use
from workbench.kernels.cases import KernelCase
from workbench.kernels.check import (SHORT, KernelCheck, _dtypes, _first_line, _gen, _html_table, _num,
                                     _progress, _records, _tol, _triton_label, check, compare, load_cases,
                                     parse_dtype, select)
from workbench.kernels.check import CHECK_COLUMNS  # noqa: F401  (one import for both halves)

__all__ = ["check", "bench", "dispatch_cost", "KernelCheck", "KernelBench", "load_cases", "select", "parse_dtype",
           "CHECK_COLUMNS", "BENCH_COLUMNS", "OVERHEAD_COLUMNS", "METRICS", "IMPLEMENTATIONS"]

BENCH_COLUMNS = ["case", "dtype", "size", "impl", "time_ms", "eager_ms", "compile_ms", "copy_ms", "bytes", "gbps",
                 "copy_gbps", "copy_fraction", "vs_eager", "vs_compile", "max_err", "device", "note"]
OVERHEAD_COLUMNS = ["case", "dtype", "size", "impl", "ours_us", "eager_us", "overhead_us", "calls", "device"]
# metric -> (label, value of an implementation from its time and the row), for plots over sizes
METRICS: dict[str, tuple[str, Callable[[float, pd.Series], float]]] = {
    "time": ("time (ms)", lambda ms, r: ms),
    "gbps": ("GB/s", lambda ms, r: r["bytes"] / (ms * 1e6)),
    "copy_fraction": ("fraction of copy_ bandwidth", lambda ms, r: r["copy_ms"] / ms),
    "vs_eager": ("speed-up over torch eager", lambda ms, r: r["eager_ms"] / ms),
    "vs_compile": ("speed-up over torch.compile", lambda ms, r: r["compile_ms"] / ms),
}
IMPLEMENTATIONS = {"ours": "time_ms", "torch eager": "eager_ms", "torch.compile": "compile_ms", "copy_": "copy_ms"}
CPU_MAX_SIZE = 1 << 20  # without a GPU: the reference path on CPU, small sizes only
TINY = 64               # elements (or rows) for the dispatch-overhead measurement

# --------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------


def _cuda_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cpu_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _per_call_us(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _copy_ms(nbytes: int, dtype: torch.dtype, device: torch.device, timer: Callable) -> float:
    n = max(1, nbytes // 2 // torch.empty((), dtype=dtype).element_size())
    src = torch.empty(n, dtype=dtype, device=device).fill_(1)  # fill_: pages touched before timing
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _compiled(fn: Callable[[dict], Any]) -> Callable[[dict], Any]:
    torch.compiler.reset()  # a fresh cache per size: no recompile limit, no shapes left over from the last row
    return torch.compile(fn, dynamic=False)


def _measure(case: KernelCase, dtype: torch.dtype, size: int, device: torch.device, gpu: bool, repeats: int,
             do_compile: bool, seed: int, row: dict[str, Any], notes: list[str]) -> None:
    """Fill ``row`` with the times of one case at one size (its tensors die when this returns)."""
    timer = (lambda fn: _cuda_ms(fn, repeats)) if gpu else (lambda fn: _cpu_ms(fn, repeats))
    inputs = case.make(size, dtype, device, _gen(seed))
    nbytes = row["bytes"] = int(case.bytes_moved(inputs))
    if gpu:
        free, _ = torch.cuda.mem_get_info(device)
        if 1.5 * nbytes > free:  # outputs and the copy_ buffers (bytes_moved) on top of the inputs
            notes.append(f"skipped: outputs and copy_ buffers need about {1.5 * nbytes / 2**30:.1f} GiB, "
                         f"{free / 2**30:.1f} GiB free on the GPU")
            return
    with use("triton" if gpu else "torch"):
        ours = case.run(inputs)
        row["time_ms"] = timer(lambda: case.run(inputs))
    if gpu:
        with use("torch"):
            row["max_err"] = compare(ours, case.run(inputs), case.exact, _tol(case, dtype)).max_abs
    del ours
    if case.torch_eager is not None:
        row["eager_ms"] = timer(lambda: case.torch_eager(inputs))
        if do_compile and gpu:
            try:
                fn = _compiled(case.torch_eager)
                fn(inputs)
                row["compile_ms"] = timer(lambda: fn(inputs))
            except Exception as e:  # noqa: BLE001 - a baseline that does not compile is a note
                notes.append(f"torch.compile failed: {_first_line(e)}")
        elif not gpu:
            notes.append("torch.compile not timed without a GPU")
    inputs.clear()  # the case's tensors go before the copy_ buffers come
    row["copy_ms"] = _copy_ms(nbytes, dtype, device, timer)


def _bench_row(case: KernelCase, dtype: torch.dtype, size: int, device: torch.device, gpu: bool,
               repeats: int, do_compile: bool, seed: int) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "dtype": SHORT.get(dtype, str(dtype)), "size": size,
                           "impl": _triton_label(_triton.status()) if gpu else "torch reference (cpu)",
                           "device": torch.cuda.get_device_name(device) if gpu else "cpu"}
    notes: list[str] = []
    itemsize = torch.empty((), dtype=dtype).element_size()
    if gpu:
        torch.cuda.empty_cache()  # mem_get_info counts the allocator's cached blocks as used
        free, _ = torch.cuda.mem_get_info(device)
        if 2 * size * itemsize > free:
            notes.append(f"skipped: needs more than {2 * size * itemsize / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                         "free on the GPU")
    if not notes:
        try:
            _measure(case, dtype, size, device, gpu, repeats, do_compile, seed, row, notes)
        except torch.cuda.OutOfMemoryError as e:
            notes.append(f"skipped: out of GPU memory ({_first_line(e)[:160]})")
        except KernelUnavailable as e:
            notes.append(f"skipped: {e}")
        except Exception as e:  # noqa: BLE001 - one broken row must not lose a GPU session's other rows
            notes.append(f"error: {_first_line(e)[:300]}")
        if gpu:
            torch.cuda.empty_cache()
    row["note"] = "; ".join(notes + [case.note] * bool(case.note))
    return row


def _overhead_row(case: KernelCase, device: torch.device, calls: int, seed: int, gpu: bool) -> dict[str, Any]:
    """Wall time per call, back to back, on a tiny input: launch and Python dispatch, not the work.

    On CPU our op runs its torch reference path (Triton's interpreter would time numpy), so the
    difference to torch's own op is what the custom-op dispatch and our argument checks cost."""
    dtype = case.dtypes[0]
    inputs = case.make(TINY, dtype, device, _gen(seed))
    with use("triton" if gpu else "torch"):
        ours = _per_call_us(lambda: case.run(inputs), calls, gpu)
    eager = _per_call_us(lambda: case.torch_eager(inputs), calls, gpu) if case.torch_eager else math.nan
    impl = _triton_label(_triton.status()) if gpu else "torch reference (cpu)"
    return {"case": case.name, "dtype": SHORT.get(dtype, str(dtype)), "size": TINY, "impl": impl,
            "ours_us": ours, "eager_us": eager, "overhead_us": ours - eager, "calls": calls,
            "device": torch.cuda.get_device_name(device) if gpu else "cpu"}


_PROBE: list = []


def _dispatch_probe():
    """A custom op registered the way ours are (fake + autograd) whose body only allocates an empty tensor:
    calling it through ``torch.ops`` against calling the body directly isolates what torch.library's
    dispatch costs each call of one of our ops."""
    if not _PROBE:
        @torch.library.custom_op("workbench_bench::probe", mutates_args=())
        def probe(x: torch.Tensor) -> torch.Tensor:
            return x.new_empty(x.shape)

        @probe.register_fake
        def _(x):
            return x.new_empty(x.shape)

        probe.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)
        _PROBE.append((torch.ops.workbench_bench.probe.default, lambda x: x.new_empty(x.shape)))
    return _PROBE[0]


def dispatch_cost(calls: int = 20000, device: str | torch.device = "cpu") -> dict[str, float]:
    """Microseconds per call that torch.library's custom-op dispatch adds, with and without a tensor
    that requires grad (the autograd node): ``{"direct_us", "op_us", "op_grad_us", "dispatch_us",
    "dispatch_grad_us"}``. Host-side Python cost, the same on CPU and GPU (GPU launches come on top)."""
    op, direct = _dispatch_probe()
    x = torch.empty(16, device=device)
    xg = torch.empty(16, device=device, requires_grad=True)
    cuda = torch.device(device).type == "cuda"
    d = _per_call_us(lambda: direct(x), calls, cuda)
    o = _per_call_us(lambda: op(x), calls, cuda)
    og = _per_call_us(lambda: op(xg), calls, cuda)
    return {"direct_us": d, "op_us": o, "op_grad_us": og, "dispatch_us": o - d, "dispatch_grad_us": og - d,
            "calls": calls}


def bench(ops: Iterable[str] | str | None = None, dtypes: Iterable[torch.dtype | str] | None = None,
          sizes: Iterable[int] | str | None = None, repeats: int = 20, compile: bool = True, overhead: bool = True,
          seed: int = 0, progress: bool = True) -> KernelBench:
    """Time every selected case against torch eager, torch.compile and ``copy_`` on the same GPU, same run.

    ``sizes`` default to each case's ``bench_sizes`` on a GPU (``"smallest"``: the first). Without a GPU (or with Triton interpreting)
    the result's ``note`` says so and it holds only the torch reference path's and torch eager's CPU
    times at each case's ``check_sizes`` (sizes above 2^20 are skipped): honest, not kernel speed.
    ``overhead`` (GPU only) adds the eager cost per call of our op against torch's on a tiny input:
    launches and Python dispatch. On CPU our op would run its whole reference path there, which says
    nothing about dispatch: :func:`dispatch_cost` measures that part on any machine.
    """
    overhead = overhead and torch.cuda.is_available()
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time at least 1 repeat")
    cases = select(ops)
    want = None if dtypes is None else [parse_dtype(d) for d in dtypes]
    st = _triton.status()
    gpu = torch.cuda.is_available() and st.usable and not st.interpret
    device = torch.device("cuda" if gpu else "cpu")
    if gpu:
        note = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, Triton {st.version}"
    elif torch.cuda.is_available():
        note = (f"a GPU is here but Triton cannot compile for it ({st.why or 'TRITON_INTERPRET=1 is set'}): only "
                "the torch reference path's and torch eager's CPU times are shown, at small sizes")
    else:
        note = ("no GPU: Triton runs in its interpreter here, whose times say nothing about speed; shown are the "
                "torch reference path's and torch eager's CPU times at small sizes. Run `workbench kernels "
                "bench` or benchmarks/bench_kernels.py on a GPU for kernel figures")
    plan = []
    for case in cases:
        own = list(case.bench_sizes if gpu else case.check_sizes)
        case_sizes = own if sizes is None else [min(own)] if sizes == "smallest" else [int(s) for s in sizes]
        plan += [(case, d, s) for d in _dtypes(case, want) for s in case_sizes]
    t0 = time.perf_counter()
    rows, over = [], []
    with _progress(len(plan) + (len(cases) if overhead else 0), "kernels bench", progress) as bar:
        for case, dtype, size in plan:
            bar.set_postfix_str(f"{case.name} {SHORT.get(dtype)} {size}", refresh=False)
            if not gpu and size > CPU_MAX_SIZE:
                rows.append({"case": case.name, "dtype": SHORT.get(dtype, str(dtype)), "size": size, "device": "cpu",
                             "impl": "torch reference (cpu)",
                             "note": f"skipped: without a GPU only sizes up to {CPU_MAX_SIZE} are timed"})
            else:
                rows.append(_bench_row(case, dtype, size, device, gpu, repeats, compile, seed))
            bar.update(1)
        if overhead:
            for case in cases:
                over.append(_overhead_row(case, device, calls=200, seed=seed, gpu=gpu))
                bar.update(1)
    frame = pd.DataFrame(rows).reindex(columns=BENCH_COLUMNS)
    for col in ("time_ms", "eager_ms", "compile_ms", "copy_ms", "bytes", "max_err"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype(float)
    frame["gbps"] = frame["bytes"] / (frame["time_ms"] * 1e6)
    frame["copy_gbps"] = frame["bytes"] / (frame["copy_ms"] * 1e6)
    frame["copy_fraction"] = frame["copy_ms"] / frame["time_ms"]
    frame["vs_eager"] = frame["eager_ms"] / frame["time_ms"]
    frame["vs_compile"] = frame["compile_ms"] / frame["time_ms"]
    frame["note"] = frame["note"].fillna("")
    return KernelBench(frame, pd.DataFrame(over, columns=OVERHEAD_COLUMNS), note,
                       torch.cuda.get_device_name(device) if gpu else None, repeats, time.perf_counter() - t0)


@dataclass(eq=False)
class KernelBench(RendersInNotebook):
    """Times of our kernels against torch eager, torch.compile and copy_, per case, dtype and size.

    ``gpu`` is the GPU's name, or None when this ran without one (then ``impl`` is "torch reference
    (cpu)" and ``note`` says so). ``overhead`` holds microseconds per eager call on a tiny input.
    """

    rows: pd.DataFrame
    overhead: pd.DataFrame
    note: str
    gpu: str | None
    repeats: int
    wall_s: float

    def to_frame(self) -> pd.DataFrame:
        return self.rows.copy()

    def overhead_frame(self) -> pd.DataFrame:
        return self.overhead.copy()

    @property
    def cases(self) -> list[str]:
        return list(dict.fromkeys(self.rows["case"]))

    def where(self, case: str | None = None, dtype: str | None = None) -> KernelBench:
        """The rows (and overheads) of this case and dtype, as a new KernelBench."""
        r, o = self.rows, self.overhead
        if case is not None:
            r, o = r[r["case"] == case], o[o["case"] == case]
        if dtype is not None:
            r = r[r["dtype"] == dtype]
        return KernelBench(r.reset_index(drop=True), o.reset_index(drop=True), self.note, self.gpu, self.repeats,
                           self.wall_s)

    def plot(self, metric: str = "time", case: str | None = None, dtype: str | None = None) -> pd.DataFrame:
        """Long data for a plot over sizes: ``case, dtype, size, implementation, value`` of ``metric``
        (one of :data:`METRICS`) for each implementation (ours, torch eager, torch.compile, copy_) that
        was timed. A ratio of an implementation to itself (vs_eager of torch eager) is left out."""
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r}: choose one of {', '.join(METRICS)}")
        fn = METRICS[metric][1]
        r = self.where(case, dtype).rows
        skip = {"vs_eager": "torch eager", "vs_compile": "torch.compile", "copy_fraction": "copy_"}.get(metric)
        out = []
        for _, row in r.iterrows():
            for impl, col in IMPLEMENTATIONS.items():
                ms = row[col]
                if impl == skip or not (isinstance(ms, float) and math.isfinite(ms) and ms > 0):
                    continue
                name = "ours" if impl != "ours" else ("ours (triton)" if self.gpu else "ours (torch reference)")
                out.append({"case": row["case"], "dtype": row["dtype"], "size": row["size"],
                            "implementation": name if impl == "ours" else impl, "value": fn(ms, row)})
        return pd.DataFrame(out, columns=["case", "dtype", "size", "implementation", "value"])

    def summary(self) -> dict[str, Any]:
        r = self.rows
        timed = r[r["time_ms"].notna()]
        return {"gpu": self.gpu, "note": self.note, "cases": int(r["case"].nunique()), "rows": len(r),
                "timed": len(timed), "skipped": int(r["note"].str.startswith("skipped").sum()),
                "errors": int(r["note"].str.startswith("error").sum()),
                "repeats": self.repeats, "seconds": round(self.wall_s, 2),
                "median_copy_fraction": _num(timed["copy_fraction"].median()) if self.gpu and len(timed) else None,
                "median_vs_eager": _num(timed["vs_eager"].median()) if self.gpu and len(timed) else None}

    def to_dict(self) -> dict[str, Any]:
        """The summary, every row and the dispatch overheads, JSON-safe (NaN and inf as None)."""
        return {"summary": self.summary(), "rows": _records(self.rows), "overhead": _records(self.overhead)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __repr__(self) -> str:
        s = self.summary()
        where = f"on {self.gpu}" if self.gpu else "no GPU: CPU reference times only"
        return f"KernelBench({s['timed']}/{s['rows']} rows timed, {s['cases']} cases, {where})"

    def _repr_html_(self) -> str:
        cols = ["case", "dtype", "size", "impl", "time_ms", "eager_ms", "compile_ms", "gbps", "copy_fraction",
                "vs_eager", "vs_compile", "max_err", "note"]
        out = _html_table(self.rows, cols, f"{html.escape(repr(self))}<br><i>{html.escape(self.note)}</i>")
        if len(self.overhead):
            out += _html_table(self.overhead, ["case", "impl", "ours_us", "eager_us", "overhead_us"],
                               f"eager dispatch: microseconds per call on a tiny input ({TINY} elements)")
        return out
