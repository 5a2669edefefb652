"""Every Triton kernel launch of ``workbench kernels check``, recorded in Triton's interpreter and compiled
ahead of time for an H100 (sm_90): what CI, which has no GPU, can show about the CUDA build of our kernels.

The interpreter runs a kernel's Python with numpy; it never types or lowers it, so a kernel can pass every
interpreter test and still fail to compile for a GPU. This module closes that gap in three steps::

    record    check(sizes="smallest") under TRITON_INTERPRET=1, every launch seen at
              InterpretedFunction.run and typed the way the CUDA JIT would type it:
                  tensor   -> "*fp32" / "*bf16" / "*u8" / "*i64" ...   (+ divisibility 16 of its address)
                  int      -> "i32" if it fits, else "i64"; 1 -> constexpr 1; multiple of 16 -> divisibility
                  float    -> "fp32";  tl.constexpr parameters -> their values
              (triton's own native_specialize_impl with the CUDA backend does the typing)
              + the memory-bound ops once more on 2^16 elements (GPU-sized tiles, 16-aligned sizes)
    select    a few launches per kernel that cover every pointer-dtype combination, every value of the
              kernel's own constexpr flags, every tile, every type each scalar took (i32, 1), every
              option set; every 2^16 launch; and per kernel code path one launch with every integer
              scalar and int32 tensor retyped 64-bit (tensors above 2^31 elements)
    compile   triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) down to PTX and a cubin
              with the ptxas bundled in the triton wheel, under TRITON_INTERPRET=0 (no GPU needed);
              from them: global loads/stores by vector width, 64-bit divisions, registers and spills

Run as a script it is the child process of each step that needs a Triton of its own:
``python tests/kernel_launches.py record OUT.json`` and ``python tests/kernel_launches.py compile
JOBS.json OUT.json``.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_DIR = REPO / "workbench" / "kernels"
TARGET = ("cuda", 90, 32)  # H100: compute capability 9.0, 32-thread warps
LARGE_OPS = ["masked_fill", "mask_select", "mask_assign", "set_value", "dropout_add"]
LARGE_SIZE = 1 << 16


# --------------------------------------------------------------------------------------------------
# which @triton.jit functions are kernels (launched from host code), which are device helpers
# --------------------------------------------------------------------------------------------------


def _is_jit(dec: ast.expr) -> bool:
    dec = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(dec, ast.Attribute) and dec.attr == "jit" or isinstance(dec, ast.Name) and dec.id == "jit"


def launched_kernels() -> dict[str, set[str]]:
    """``{module: {kernel names}}`` over ``workbench/kernels/triton_*.py``: the @triton.jit functions that
    host code refers to (``k[grid](...)`` or handed to a launcher); the ones only other @triton.jit
    functions call are device helpers and are compiled inside the kernels."""
    out = {}
    for path in sorted(KERNEL_DIR.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        jit = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(_is_jit, n.decorator_list))}
        host = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name not in jit:
                host |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in jit}
        out[f"workbench.kernels.{path.stem}"] = host
    return out


# --------------------------------------------------------------------------------------------------
# record (child process, TRITON_INTERPRET=1)
# --------------------------------------------------------------------------------------------------


def _record(out_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"   # before Triton loads: @triton.jit gives interpreted functions
    import triton.runtime.interpreter as interp
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from workbench.kernels.check import check

    launches: dict[str, dict] = {}
    counts: Counter = Counter()
    run = interp.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = inspect.signature(self.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        rec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": {}, "constexprs": {},
               "tl_constexprs": [], "aligned": [],
               "options": {k: v for k, v in sorted(kwargs.items()) if k not in params}}
        for name, p in params.items():
            value = bound.arguments[name]
            if "constexpr" in str(p.annotation):  # annotated tl.constexpr (a string under __future__)
                rec["signature"][name] = "constexpr"
                rec["constexprs"][name] = value
                rec["tl_constexprs"].append(name)
                continue
            # the CUDA JIT's own typing of a runtime argument (what JITFunction.run's binder calls)
            ty, spec = native_specialize_impl(CUDABackend, value, False, True, True)
            rec["signature"][name] = ty
            if ty == "constexpr":  # an int equal to 1: the JIT specialises it into the code
                rec["constexprs"][name] = spec
            elif spec == "D":      # address or value divisible by 16
                rec["aligned"].append(name)
        key = json.dumps(rec, sort_keys=True)
        launches[key] = rec
        counts[f"{rec['module']}.{rec['kernel']}"] += 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = recording_run
    t0 = time.perf_counter()
    result = check(sizes="smallest", progress=False)
    small = list(launches.values())
    launches.clear()
    # GPU-sized tiles and aligned sizes for the memory-bound ops (their interpreter runs stay fast)
    large = check(ops=LARGE_OPS, sizes=[LARGE_SIZE], dtypes=["bf16"], edge=False, progress=False)
    Path(out_path).write_text(json.dumps({
        "launches": small, "large_launches": list(launches.values()), "launch_counts": dict(counts),
        "check": result.headline(), "check_ok": result.ok and large.ok, "seconds": time.perf_counter() - t0}))


# --------------------------------------------------------------------------------------------------
# select (plain Python, in the test process)
# --------------------------------------------------------------------------------------------------


def kernel_id(rec: dict) -> str:
    return f"{rec['module']}.{rec['kernel']}"


def _features(rec: dict) -> set[tuple]:
    sig = rec["signature"]
    flags = _flags(rec)
    tile = tuple((k, v) for k, v in sorted(rec["constexprs"].items()) if k.startswith("BLOCK"))
    return ({("pointers", tuple(t for t in sig.values() if t.startswith("*")))} | {("flags", flags)}
            | {("tile", tile)}
            | {("options", json.dumps(rec["options"], sort_keys=True))}
            | {(name, ty) for name, ty in sig.items() if name not in rec["tl_constexprs"]})


def _tile(rec: dict) -> int:
    size = 1
    for k in rec["tl_constexprs"]:
        if k.startswith("BLOCK"):
            size *= int(rec["constexprs"][k])
    return size


def _flags(rec: dict) -> tuple:
    """The kernel's own constexpr switches (not its tile sizes): each value is a different code path."""
    return tuple((k, v) for k, v in sorted(rec["constexprs"].items())
                 if k in rec["tl_constexprs"] and not k.startswith("BLOCK"))


def select(launches: list[dict], large: list[dict]) -> list[dict]:
    """The launches to compile, each tagged with its ``variant``:

    ``recorded``  a few of ``launches`` per kernel covering all of their :func:`_features` (greedy set cover;
                  ties go to the launch with the most 16-divisible arguments, then the largest tile)
    ``large``     every one of ``large`` (GPU-sized tiles on 2^16 elements: what the PTX checks read)
    ``i64``       per kernel and :func:`_flags`, the largest-tile launch with every integer scalar ``i64``
    """
    chosen = []
    for kernel in sorted({kernel_id(r) for r in launches}):
        recs = [r for r in launches if kernel_id(r) == kernel]
        left = set().union(*map(_features, recs))
        while left:
            best = max(recs, key=lambda r: (len(_features(r) & left), len(r["aligned"]), _tile(r)))
            left -= _features(best)
            chosen.append({**best, "variant": "recorded"})
    chosen += [{**r, "variant": "large"} for r in large]
    by_path: dict[tuple, list[dict]] = {}
    for r in launches + large:
        by_path.setdefault((kernel_id(r), _flags(r)), []).append(r)
    for _, recs in sorted(by_path.items(), key=lambda kv: json.dumps(kv[0])):
        chosen.append(widened(max(recs, key=lambda r: (_tile(r), len(r["aligned"])))))
    return chosen


def widened(rec: dict) -> dict:
    """``rec`` as launched on tensors above 2^31 elements: each integer scalar ``i64`` (the JIT's type for
    an int that does not fit int32; none specialised to 1, those divisible by 16 stay so) and each int32
    tensor int64 (index_put's row ids and last-writer table switch to int64 at 2^31 rows), and a
    ``SMALL`` constexpr (int32 arithmetic below 2^31 elements) off."""
    sig, consts = dict(rec["signature"]), dict(rec["constexprs"])
    for name, ty in rec["signature"].items():
        if ty == "*i32":
            sig[name] = "*i64"
        elif ty == "i32" or ty == "constexpr" and name not in rec["tl_constexprs"] and type(consts[name]) is int:
            sig[name] = "i64"
            consts.pop(name, None)
    if consts.get("SMALL") is True:  # a kernel's "fewer than 2^31 elements" switch (masked_fill) turns off
        consts["SMALL"] = False
    return {**rec, "signature": sig, "constexprs": consts, "variant": "i64"}


# --------------------------------------------------------------------------------------------------
# compile (child process, TRITON_INTERPRET=0, no GPU)
# --------------------------------------------------------------------------------------------------

_MEMOP = re.compile(r"\b(ld|st|atom|red)\.global((?:\.[a-z0-9_]+)*)")
_DIV64 = re.compile(r"\b(?:div|rem)\.[su]64\b")


def memory_ops(ptx: str) -> dict[str, int]:
    """Global loads, stores and atomics in the PTX by width: ``{"ld.v4": 3, "ld.scalar": 1, "st.v4": 2}``
    (``v4`` of 32-bit words: 128 bits an instruction, the width that saturates HBM)."""
    out: Counter = Counter()
    for op, mods in _MEMOP.findall(ptx):
        width = next((m for m in mods.split(".") if m in ("v2", "v4", "v8")), "scalar")
        out[f"{op}.{width}"] += 1
    return dict(out)


def int64_divisions(ptx: str) -> int:
    """64-bit integer divisions and remainders in the PTX: each is a ~70-instruction software routine on
    the GPU, so one per element can make a memory-bound kernel compute-bound."""
    return len(_DIV64.findall(ptx))


def _resources(cubin: bytes, next_to: Path, cuobjdump: Path) -> dict[str, int]:
    """Registers, local memory (spills) and shared memory of the cubin's kernel, from cuobjdump (the
    cubin is written beside ``next_to``)."""
    if not cuobjdump.exists():
        return {}
    path = next_to.with_suffix(".cubin")
    path.write_bytes(cubin)
    text = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)], capture_output=True,
                          text=True, timeout=60).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # a CompilationError starts with the source location and ends with the reason: give both
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(e).__name__}: {text}"[:400]


def _compile(jobs_path: str, out_path: str) -> None:
    os.environ["TRITON_INTERPRET"] = "0"   # before Triton loads: @triton.jit gives JITFunctions
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget(*TARGET)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    results = []
    for job in json.loads(Path(jobs_path).read_text()):
        t0 = time.perf_counter()
        res = {"kernel": kernel_id(job), "variant": job["variant"], "signature": job["signature"],
               "constexprs": job["constexprs"], "aligned": job["aligned"]}
        try:
            fn = getattr(importlib.import_module(job["module"]), job["kernel"])
            names = list(fn.arg_names)
            attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in job["aligned"]}
            src = triton.compiler.ASTSource(fn=fn, signature=job["signature"], constexprs=job["constexprs"],
                                            attrs=attrs)
            compiled = triton.compile(src, target=target, options=job["options"])
            res.update(ok=True, memory_ops=memory_ops(compiled.asm["ptx"]),
                       int64_divisions=int64_divisions(compiled.asm["ptx"]),
                       resources=_resources(compiled.asm["cubin"], Path(out_path), cuobjdump))
        except Exception as e:  # noqa: BLE001 - every failure is a finding, reported per kernel
            res.update(ok=False, error=_first_line(e))
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(res)
        Path(out_path).write_text(json.dumps(results))  # partial results survive a timeout


if __name__ == "__main__":
    if sys.argv[1] == "record":
        _record(sys.argv[2])
    elif sys.argv[1] == "compile":
        _compile(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown step {sys.argv[1]!r}; use record OUT.json or compile JOBS.json OUT.json")
