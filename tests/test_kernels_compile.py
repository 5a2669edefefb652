"""Every Triton kernel of ``workbench.kernels``, with the argument types and constexprs our launch code
really passes, compiles for an H100 (sm_90) with the installed Triton, down to PTX and a cubin, on a
machine without a GPU (tests/kernel_launches.py has the how).

CI only ever runs the kernels in Triton's interpreter, which neither types nor lowers them; these tests
are what stands between a kernel that passes on CPU and one that does not build on the GPU::

    record   check(sizes="smallest") in the interpreter: ~580 launches, ~260 distinct typings,
             + the memory-bound ops on 2^16 elements (GPU-sized tiles)
    select   ~100: a covering set (every dtype combination, flag, scalar type, tile), the 2^16 ones,
             and an all-64-bit variant of each kernel code path (tensors above 2^31 elements)
    compile  triton.compile(..., target=GPUTarget("cuda", 90, 32)) in two child processes

and, from the PTX and the cubin: the memory-bound kernels move data in 128-bit vectors (ld/st.global.v4),
and no kernel spills registers to local memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("triton")

import kernel_launches as kl  # noqa: E402 - tests/kernel_launches.py

WORKERS = 2
RECORD_TIMEOUT_S = 120   # ~10 s here; both limits together stay under pytest's 300 s per test
COMPILE_TIMEOUT_S = 150  # ~15 s here

# Memory-bound kernels and the code path on which every element is a contiguous run of the tensor: on
# GPU-sized, 16-aligned inputs their loads and stores must be 128-bit vectors (4-16 elements a thread).
VECTORISED = {
    "workbench.kernels.triton_dropout._dropout_add_fwd": {"ALIGNED": True},
    "workbench.kernels.triton_dropout._dropout_bwd": {"ALIGNED": True},
    "workbench.kernels.triton_masked._masked_fill_kernel": {"MASK_FLAT": True},
    "workbench.kernels.triton_masked._masked_fill_backward_kernel": {"MASK_FLAT": True},
    "workbench.kernels.triton_set_value._region_write_kernel": {"e_in": 1, "v_in": 1},  # unit column strides
}


def _env(tmp: Path, interpret: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    # the child's own Triton: interpreter on or off before it loads, a fresh cache (a real compile each
    # run, nothing written to ~/.triton), no GPU even where there is one (the target is given, not probed)
    env.update(TRITON_INTERPRET=interpret, TRITON_CACHE_DIR=str(tmp / "triton-cache"), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(kl.REPO), env.get("PYTHONPATH")])))
    return env


def _child(args: list[str], tmp: Path, interpret: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(kl.__file__)), *args], cwd=kl.REPO, env=_env(tmp, interpret),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    """Wait for every child; past ``timeout`` (all told) or on a failure, kill the rest and fail."""
    deadline = time.monotonic() + timeout
    try:
        for i, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{what} ({i}) did not finish in {timeout:.0f} s")
            assert proc.returncode == 0, f"{what} ({i}) failed (exit {proc.returncode}):\n{out[-4000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """Record the launches, select, compile; the records, the jobs and one result per job."""
    tmp = tmp_path_factory.mktemp("kernels-compile")
    t0 = time.monotonic()
    _wait([_child(["record", str(tmp / "launches.json")], tmp, "1")], RECORD_TIMEOUT_S, "recording the launches")
    rec = json.loads((tmp / "launches.json").read_text())
    t_record = time.monotonic() - t0
    jobs = kl.select(rec["launches"], rec["large_launches"])
    # deal the jobs round robin, so each worker gets a mix of cheap and costly kernels
    procs = []
    for w in range(WORKERS):
        (tmp / f"jobs{w}.json").write_text(json.dumps(jobs[w::WORKERS]))
        procs.append(_child(["compile", str(tmp / f"jobs{w}.json"), str(tmp / f"results{w}.json")], tmp, "0"))
    t1 = time.monotonic()
    _wait(procs, COMPILE_TIMEOUT_S, "compile worker")
    results = [r for w in range(WORKERS) for r in json.loads((tmp / f"results{w}.json").read_text())]
    _print_summary(rec, results, t_record, time.monotonic() - t1)
    return rec, jobs, results


def _print_summary(rec: dict, results: list[dict], t_record: float, t_compile: float) -> None:
    """One line per kernel: typings compiled, the most registers and spilled bytes, whether any typing
    has 128-bit loads, stores, atomics (``v4``), the 64-bit divisions in one typing (below 2^31 elements,
    and the most in any typing: the int64 variants)."""
    rows = defaultdict(lambda: {"n": 0, "ok": 0, "regs": 0, "local": 0, "v4": set(), "div64": 0, "div64_small": 0,
                                "s": 0.0})
    for r in results:
        row = rows[r["kernel"].rsplit(".", 1)[1]]
        row["n"] += 1
        row["ok"] += r["ok"]
        row["s"] += r["seconds"]
        res, ops = r.get("resources", {}), r.get("memory_ops", {})
        row["regs"], row["local"] = max(row["regs"], res.get("reg", 0)), max(row["local"], res.get("local", 0))
        row["v4"] |= {op.split(".")[0] for op in ops if op.endswith(".v4")}
        row["div64"] = max(row["div64"], r.get("int64_divisions", 0))
        if r.get("variant") != "i64":
            row["div64_small"] = max(row["div64_small"], r.get("int64_divisions", 0))
    print(f"\n{rec['check']}; {sum(rec['launch_counts'].values())} launches of {len(rec['launch_counts'])} kernels, "
          f"{len(rec['launches'])} + {len(rec['large_launches'])} distinct typings, recorded in {t_record:.1f} s; "
          f"{len(results)} compiled for sm_90 in {t_compile:.1f} s")
    print(f"{'kernel':30} {'compiled':>9} {'regs':>5} {'spill B':>8} {'v4':>12} {'div64 <2^31/any':>16} {'seconds':>8}")
    for name, row in sorted(rows.items()):
        print(f"{name:30} {row['ok']:>4}/{row['n']:<4} {row['regs']:>5} {row['local']:>8} "
              f"{'+'.join(sorted(row['v4'])) or '-':>12} {row['div64_small']:>8}/{row['div64']:<7} {row['s']:>8.1f}")


def test_every_launched_kernel_is_recorded(build):
    rec, _, _ = build
    kernels = kl.launched_kernels()
    assert sum(map(len, kernels.values())) >= 13, f"expected the 13 kernels of issue 11, found {kernels}"
    recorded = set(rec["launch_counts"])
    missing = sorted(f"{m}.{k}" for m, ks in kernels.items() for k in ks if f"{m}.{k}" not in recorded)
    assert not missing, (f"kernels never launched by `workbench kernels check` (so neither checked nor compiled "
                         f"here): {missing}; register a KernelCase or edge case that reaches them")


def test_every_recorded_kernel_compiles_for_sm90(build):
    rec, jobs, results = build
    assert len(results) == len(jobs)
    # every argument type a kernel was launched with (fp32, bf16, fp16, u8 masks, i32/i64 indices) is compiled
    for kernel in {kl.kernel_id(r) for r in rec["launches"]}:
        seen = {t for r in rec["launches"] if kl.kernel_id(r) == kernel for t in r["signature"].values()}
        done = {t for j in jobs if kl.kernel_id(j) == kernel for t in j["signature"].values()}
        assert seen <= done, f"{kernel}: argument types {sorted(seen - done)} recorded but never compiled"
    assert {j["variant"] for j in jobs} == {"recorded", "large", "i64"}
    failed = [f"{r['kernel']} [{r['variant']}] {r['error']}" for r in results if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(results)} kernel typings do not compile for sm_90:\n" + "\n".join(failed)


def test_memory_bound_kernels_move_128_bit_vectors(build):
    _, _, results = build
    for kernel, path in VECTORISED.items():
        mine = [r for r in results if r["kernel"] == kernel and r["ok"] and r["variant"] == "large"
                and all(_path_value(r, k) == v for k, v in path.items())]
        assert mine, f"{kernel}: no GPU-sized launch on the path {path} was recorded"
        for r in mine:
            ops = r["memory_ops"]
            assert ops.get("ld.v4") and ops.get("st.v4"), (
                f"{kernel} on {path}: the PTX has no 128-bit global loads and stores ({ops}): a memory-bound "
                "kernel that moves 2-4 bytes per instruction leaves most of the bandwidth unused")


def _path_value(result: dict, name: str):
    return result["constexprs"].get(name) if name in result["constexprs"] else result["signature"].get(name)


def test_no_kernel_spills_registers(build):
    _, _, results = build
    spills = [f"{r['kernel']} [{r['variant']}] {r['resources']}" for r in results
              if r["ok"] and (r["resources"].get("local", 0) or r["resources"].get("stack", 0))]
    assert not spills, "kernels spilling registers to local memory on sm_90:\n" + "\n".join(spills)
