"""``check``, ``bench``, their views, ``workbench kernels`` and ``bench_kernels.py``, over the real registered cases.

Without a GPU (CI): every kernel runs in Triton's interpreter on CPU tensors and is compared with the
torch reference path and torch's own ops; ``bench`` says there is no GPU and shows only the reference
path's CPU times. A deliberately wrong case (registered for one test only) shows the checker can fail.
"""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys

import pytest
import torch

import workbench.kernels  # noqa: F401  (sets TRITON_INTERPRET=1 before Triton loads, without CUDA)
from workbench.cli import main as cli_main
from workbench.display import view_for
from workbench.kernels import backend
from workbench.kernels.bench import (BENCH_COLUMNS, CHECK_COLUMNS, CPU_MAX_SIZE, OVERHEAD_COLUMNS, KernelBench,
                                     KernelCheck, bench, check, compare, load_cases)
from workbench.kernels.cases import CASES, KernelCase
from workbench.widgets import KernelBenchView, KernelCheckView

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")


@pytest.fixture(scope="module")
def checked() -> KernelCheck:
    return check(sizes="smallest", progress=False)  # every case, dtype and edge case; seconds in the interpreter


@pytest.fixture(scope="module")
def benched() -> KernelBench:
    return bench(sizes=[256, CPU_MAX_SIZE * 2], dtypes=["fp32"], repeats=2, progress=False)


def _toy(name: str, run, make=None, **kw) -> KernelCase:
    """A throwaway case over plain torch ops (only to show the checker's verdicts)."""
    def make_(n, dtype, device, gen):
        return {"x": torch.randn(n, generator=gen, device=device).to(dtype)}

    return KernelCase("toy", name, make or make_, run, lambda i: 2 * i["x"].numel() * i["x"].element_size(),
                      torch_eager=lambda i: i["x"] * 2, check_sizes=(17,), dtypes=(torch.float32,), **kw)


# --------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------


def test_every_registered_case_passes_in_the_interpreter(checked):
    cases = load_cases()
    assert len(cases) >= 5, sorted(cases)  # index_put, masked, set_value, dropout variants at least
    frame = checked.to_frame()
    assert list(frame.columns) == CHECK_COLUMNS
    assert set(frame["case"]) == set(cases), "every registered case is checked"
    assert checked.ok, checked.failures[["case", "dtype", "label", "note"]].to_string()
    assert (frame["status"] == "pass").all() and frame["ok"].all()
    expect = "triton (cuda)" if torch.cuda.is_available() else "triton (interpreter)"
    assert (frame["backend_ran"] == expect).all()
    # edge cases ran too (empty, non-contiguous, duplicates, masks...), beside the random inputs
    assert (frame["label"] != "random").sum() >= len(cases)
    assert set(frame["dtype"]) == {"fp32", "bf16", "fp16"}
    compared = frame[frame["vs_torch_err"].notna()]
    assert len(compared) > 0 and set(compared["case"]) >= {c.name for c in cases.values()
                                                             if c.torch_eager is not None and c.compare_eager}
    summary = checked.summary()
    assert summary["ok"] and summary["failed"] == 0 and summary["cases"] == len(cases)
    assert checked.headline().startswith(f"ok: {summary['passed']}/{summary['rows']} pass")
    doc = json.loads(checked.to_json())
    assert doc["summary"]["rows"] == len(frame) and len(doc["rows"]) == len(frame)


def test_check_fails_a_wrong_kernel_and_skips_where_triton_cannot_run(monkeypatch):
    # triton and torch backends disagree by one ulp: a failure, with the reason on the row
    def off_by_one_ulp(i):
        x = i["x"] * 2
        return torch.nextafter(x, torch.full_like(x, math.inf)) if backend.get_backend() == "triton" else x

    def unavailable(i):
        backend.choose(torch.device("meta"), "triton")  # Triton never runs on meta tensors

    monkeypatch.setitem(CASES, "toy/ulp", _toy("ulp", off_by_one_ulp, exact=True))
    monkeypatch.setitem(CASES, "toy/skip", _toy("skip", unavailable))
    result = check(ops=["toy"], progress=False)
    rows = result.to_frame().set_index("case")
    assert not result.ok and list(result.failures["case"]) == ["toy/ulp"]
    assert "bitwise" in rows.loc["toy/ulp", "note"] and rows.loc["toy/ulp", "max_abs_err"] > 0
    assert rows.loc["toy/skip", "status"] == "skip" and "meta" in rows.loc["toy/skip", "note"]
    assert list(result.skipped["case"]) == ["toy/skip"]
    assert result.headline().startswith("FAILED: 0/1 pass, 1 skipped")
    # the same wrong result within a loose tolerance passes; against torch eager it is compared too
    monkeypatch.setitem(CASES, "toy/ulp", _toy("ulp", off_by_one_ulp))
    assert check(ops=["toy/ulp"], progress=False).ok


def test_compare_is_bitwise_when_exact_and_within_tolerance_otherwise():
    a, b = torch.tensor([0.0, 1.0, float("nan")]), torch.tensor([-0.0, 1.0, float("nan")])
    assert not compare(a, b, True, (0, 0)).ok and compare(a, b, False, (0, 0)).ok  # -0.0 is another bit pattern
    assert compare(a, a.clone(), True, (0, 0)).ok
    d = compare((a + 1e-3,), (a,), False, (1e-2, 0))
    assert d.ok and d.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert not compare(a, a[:2], False, (1, 1)).ok and "against" in compare(a, a[:2], False, (1, 1)).why
    assert not compare(torch.tensor([1, 2]), torch.tensor([1, 3]), False, (10, 10)).ok  # integers: equal or not


def test_check_names_the_choices_for_an_unknown_op_or_dtype():
    with pytest.raises(ValueError, match="no kernel case matches 'nope'; choose from"):
        check(ops=["nope"], progress=False)
    with pytest.raises(ValueError, match="choose fp32, bf16 or fp16"):
        check(dtypes=["fp64"], progress=False)


# --------------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------------


@NO_GPU
def test_bench_without_a_gpu_says_so_and_shows_only_reference_times(benched):
    assert benched.gpu is None and benched.note.startswith("no GPU")
    frame = benched.to_frame()
    assert list(frame.columns) == BENCH_COLUMNS
    assert set(frame["case"]) == set(load_cases())
    small, big = frame[frame["size"] == 256], frame[frame["size"] > CPU_MAX_SIZE]
    assert (small["impl"] == "torch reference (cpu)").all()  # never the interpreter's times
    assert (small["time_ms"] > 0).all() and small["copy_ms"].gt(0).all() and small["compile_ms"].isna().all()
    assert small["gbps"].gt(0).all() and (small["vs_eager"] == small["eager_ms"] / small["time_ms"]).all()
    assert big["time_ms"].isna().all() and big["note"].str.startswith("skipped").all()
    over = benched.overhead_frame()  # dispatch overhead is a GPU figure: on CPU "ours" is the reference path
    assert list(over.columns) == OVERHEAD_COLUMNS and over.empty
    doc = json.loads(benched.to_json())
    assert doc["summary"]["gpu"] is None and doc["summary"]["timed"] == len(small)
    plot = benched.plot("gbps", case=frame["case"].iloc[0])
    assert set(plot["implementation"]) == {"ours (torch reference)", "torch eager", "copy_"}
    assert set(benched.plot("vs_eager")["implementation"]) == {"ours (torch reference)", "copy_"}


# --------------------------------------------------------------------------------------------------
# views
# --------------------------------------------------------------------------------------------------


def test_views_build_from_the_core_objects(checked, benched):
    view = view_for(benched)
    assert isinstance(view, KernelBenchView)
    case = benched.cases[0]
    view.select(case=case, dtype="fp32", metric="gbps")
    names = {t.name for t in view.fig.data}
    assert names == set(benched.plot("gbps", case=case, dtype="fp32")["implementation"]) and names
    for t in view.fig.data:  # the plot draws the core's numbers
        data = benched.plot("gbps", case=case, dtype="fp32")
        assert list(t.y) == pytest.approx(data[data["implementation"] == t.name].sort_values("size")["value"].tolist())
    assert case in view.table.value and "no GPU" in view.header.value
    with pytest.raises(ValueError, match="choose one of"):
        view.select(metric="speed")

    cv = view_for(checked)
    assert isinstance(cv, KernelCheckView) and html.escape(checked.headline()) in cv.header.value
    cv.select(status="fail")  # the failures only (none, when every kernel passes)
    n_fail = len(checked.failures)
    assert cv.table.value == "<i>no rows</i>" if not n_fail else cv.table.value.count("<tr>") == n_fail + 1
    op = checked.rows["op"].iloc[0]
    cv.select(op=op)
    assert "pass" in cv.table.value and op in cv.table.value
    assert "text/plain" in cv._repr_mimebundle_() and "<table>" in checked._repr_html_()


# --------------------------------------------------------------------------------------------------
# CLI and benchmark script
# --------------------------------------------------------------------------------------------------


def test_cli_check_json_and_exit_codes(workbench_cli, monkeypatch, capsys):
    op = "index_put"
    res = subprocess.run([*workbench_cli, "kernels", "check", "--op", op, "--dtype", "fp32", "--size", "64",
                          "--no-edge", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(res.stdout)
    assert doc["status"] == "ok" and doc["failed"] == 0 and doc["rows"] and doc["dtypes"] == ["fp32"]
    assert all(r["size"] == 64 and r["case"].startswith(op) for r in doc["rows"])

    assert cli_main(["kernels", "check", "--op", "nope", "--json"]) == 2
    assert "no kernel case matches" in json.loads(capsys.readouterr().out)["error"]
    monkeypatch.setitem(CASES, "toy/wrong", _toy("wrong", lambda i: i["x"] * (3 if backend.get_backend() == "triton"
                                                                               else 2)))
    assert cli_main(["kernels", "check", "--op", "toy"]) == 1
    out = capsys.readouterr().out
    assert "FAIL toy/wrong fp32 random" in out and out.strip().splitlines()[-1].startswith("FAILED: 0/1 pass")
    assert cli_main(["kernels", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["triton"] and "toy/wrong" in status["cases"]


@NO_GPU
def test_cli_bench_json_says_no_gpu(capsys):
    op = "masked_fill"
    assert cli_main(["kernels", "bench", "--op", op, "--dtype", "fp32", "--sizes", "128", "--repeats", "1",
                     "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpu"] is None and doc["note"].startswith("no GPU") and doc["rows"]
    assert all(r["impl"] == "torch reference (cpu)" and r["compile_ms"] is None for r in doc["rows"])
    assert cli_main(["kernels", "bench", "--sizes", "big", "--json"]) == 2


@NO_GPU
@pytest.mark.timeout(120)
def test_bench_kernels_script_prints_one_json_document(repo):
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_kernels.py"), "--quick"],
                          capture_output=True, text=True, timeout=110, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document; progress went to stderr
    assert "[check]" in proc.stderr
    assert doc["benchmark"] == "bench_kernels" and doc["quick"] is True
    assert doc["gpu"] is None and doc["note"].startswith("no GPU")
    assert doc["baselines"][:3] == ["torch eager", "torch.compile", "copy_"] and doc["interpreter"] is True
    # torch.library's dispatch cost, against the same body called directly: measured, positive
    cost = doc["dispatch_us"]
    assert cost["op_us"] > cost["direct_us"] > 0 and cost["dispatch_us"] == pytest.approx(
        cost["op_us"] - cost["direct_us"], abs=0.02)
    check_doc = doc["check"]
    assert check_doc["ok"] and check_doc["failed"] == 0 and doc["failures"] == []
    assert check_doc["cases"] == len(load_cases()) and check_doc["dtypes"] == ["fp32"]
    assert doc["targets"] and all(t["measured"] is None and t["why_none"] == "no GPU" for t in doc["targets"])
    for key in ("cpu_count", "torch", "platform"):
        assert doc["machine"][key], key
