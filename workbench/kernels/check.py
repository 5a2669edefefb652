"""Is every kernel correct? :func:`check` over the registered cases (``workbench kernels check``).

For each :class:`~workbench.kernels.cases.KernelCase` (``workbench.kernels.cases.CASES``), dtype and size,
plus every edge case (empty, non-contiguous, duplicate and out-of-range indices, all-true/all-false masks)::

    ours  = case.run(inputs)   under kernels='triton'   Triton: compiled on CUDA, interpreted on CPU
    ref   = case.run(inputs)   under kernels='torch'    the reference path, plain torch ops (ground truth)
    eager = case.torch_eager(inputs)                    torch's own ops: what a user writes today

    ours == ref bit for bit            (case.exact: integer logic, copies, masks)
    |ours - ref| <= atol + rtol |ref|  (otherwise; tol per dtype), and the same against eager
                                       where its values are comparable (case.compare_eager)

Correctness is what a CPU can show (through Triton's interpreter); speed is ``workbench.kernels.bench``.

    result = check(ops=["index_put"], dtypes=["fp32"])    # a KernelCheck; result.ok, .failures
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from workbench.display import RendersInNotebook
from workbench.kernels import _triton
from workbench.kernels.backend import KernelUnavailable, use
from workbench.kernels.cases import CASES, KernelCase, as_tuple

__all__ = ["check", "KernelCheck", "compare", "load_cases", "select", "parse_dtype", "CHECK_COLUMNS", "DTYPES"]

CHECK_COLUMNS = ["case", "op", "dtype", "size", "label", "backend_ran", "status", "max_abs_err", "max_rel_err",
                 "vs_torch_err", "ok", "seconds", "note"]
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# --------------------------------------------------------------------------------------------------
# Which cases
# --------------------------------------------------------------------------------------------------


def load_cases() -> dict[str, KernelCase]:
    """The registry of every op's cases (``workbench.kernels`` imports each op module, which registers them)."""
    import workbench.kernels  # noqa: F401

    return CASES


def select(ops: Iterable[str] | str | None = None) -> list[KernelCase]:
    """The registered cases named by ``ops`` (None: all): an op (``index_put``), a case name
    (``dropout_add/forward``: that case only) or the start of case names (``index_put/accumulate``)."""
    cases = list(load_cases().values())
    if ops is None:
        return cases
    ops = [ops] if isinstance(ops, str) else list(ops)

    def matches(c: KernelCase, o: str) -> bool:
        return c.name == o if o in CASES else (c.op == o or c.name.startswith(o))

    unknown = [o for o in ops if not any(matches(c, o) for c in cases)]
    if unknown:
        raise ValueError(f"no kernel case matches {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(sorted({c.op for c in cases}))} or a case name ({', '.join(sorted(CASES))})")
    return [c for c in cases if any(matches(c, o) for o in ops)]


def parse_dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if d not in DTYPES:
        raise ValueError(f"dtype {d!r} is not one the kernels take; choose fp32, bf16 or fp16")
    return DTYPES[d]


def _dtypes(case: KernelCase, dtypes: list[torch.dtype] | None) -> list[torch.dtype]:
    return list(case.dtypes) if dtypes is None else [d for d in case.dtypes if d in dtypes]


def _triton_label(st: _triton.TritonStatus) -> str:
    return "triton (interpreter)" if st.interpret else "triton (cuda)"


def _device() -> torch.device:
    """Where check runs: CUDA when Triton compiles for it, else CPU (Triton's interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() and not _triton.interpreting() else "cpu")


def _gen(seed: int) -> torch.Generator:
    """A CPU generator, whatever the device: cases draw on ``gen.device`` and move the tensors."""
    return torch.Generator().manual_seed(seed)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _progress(total: int, desc: str, progress: bool):
    from workbench.progress import tqdm

    return tqdm(total=total, desc=desc, unit="row", disable=not progress, leave=False)


# --------------------------------------------------------------------------------------------------
# Comparing outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class Diff:
    max_abs: float
    max_rel: float  # |ours - ref| / max(|ref|, atol)
    ok: bool
    why: str = ""


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare(ours: Any, ref: Any, exact: bool, tol: tuple[float, float]) -> Diff:
    """Compare two outputs (a tensor or a tuple of tensors): bitwise when ``exact``, else within ``tol``."""
    ours, ref = as_tuple(ours), as_tuple(ref)
    if len(ours) != len(ref):
        return Diff(math.nan, math.nan, False, f"{len(ours)} outputs against {len(ref)}")
    atol, rtol = tol
    worst_abs = worst_rel = 0.0
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a is None or b is None:
            if (a is None) != (b is None):
                return Diff(math.nan, math.nan, False, f"output {i} is None on one side only")
            continue
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return Diff(math.nan, math.nan, False, f"output {i}: {a.dtype}{list(a.shape)} against "
                                                   f"{b.dtype}{list(b.shape)}")
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.numel() == 0:
            continue
        if not (a.is_floating_point() or a.is_complex()):
            if not torch.equal(a, b):
                n = int((a != b).sum())
                return Diff(math.nan, math.nan, False, f"output {i}: {n} of {a.numel()} integer values differ")
            continue
        a64, b64 = a.double(), b.double()
        same = (a64 == b64) | (a64.isnan() & b64.isnan())
        diff = torch.where(same, 0.0, (a64 - b64).abs().nan_to_num(nan=math.inf))
        rel = diff / b64.abs().clamp_min(max(atol, 1e-30))
        worst_abs, worst_rel = max(worst_abs, float(diff.max())), max(worst_rel, float(rel.max()))
        if exact:
            iv = _INT_VIEW[a.element_size()]
            bad = int((a.contiguous().view(iv) != b.contiguous().view(iv)).sum())
            if bad:
                return Diff(worst_abs, worst_rel, False, f"output {i}: {bad} of {a.numel()} values differ bitwise")
        else:
            bad = int((diff > atol + rtol * b64.abs().nan_to_num(nan=0.0, posinf=0.0)).sum())
            if bad:
                return Diff(worst_abs, worst_rel, False, f"output {i}: {bad} of {a.numel()} values outside "
                                                         f"atol={atol:g}, rtol={rtol:g}")
    return Diff(worst_abs, worst_rel, True)


def _tol(case: KernelCase, dtype: torch.dtype) -> tuple[float, float]:
    return case.tol.get(dtype) or KernelCase.__dataclass_fields__["tol"].default_factory()[dtype]


def _size_of(inputs: dict[str, Any]) -> int:
    return max((v.numel() for v in inputs.values() if isinstance(v, torch.Tensor)), default=0)


# --------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------


def _run(case: KernelCase, inputs: dict[str, Any], backend: str) -> tuple[Any, BaseException | None]:
    try:
        with use(backend):
            return case.run(inputs), None
    except KernelUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - an op error is a finding, reported on its row
        return None, e


def _check_one(case: KernelCase, dtype: torch.dtype, size: int, label: str, inputs: dict[str, Any],
               ran: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    row = {"case": case.name, "op": case.op, "dtype": SHORT.get(dtype, str(dtype)), "size": size, "label": label,
           "backend_ran": ran, "max_abs_err": math.nan, "max_rel_err": math.nan, "vs_torch_err": math.nan,
           "note": ""}
    try:
        ours, err_ours = _run(case, inputs, "triton")
    except KernelUnavailable as e:
        return {**row, "backend_ran": "none", "status": "skip", "ok": False, "note": str(e),
                "seconds": time.perf_counter() - t0}
    ref, err_ref = _run(case, inputs, "torch")
    status, note = "pass", ""
    if err_ours is not None or err_ref is not None:
        # an invalid edge input (an out-of-range index): both backends must refuse it, with the same message;
        # a random input must not raise at all
        same = (label != "random" and err_ours is not None and err_ref is not None
                and type(err_ours) is type(err_ref) and str(err_ours) == str(err_ref))
        status = "pass" if same else "fail"
        note = (f"both raise {_first_line(err_ref)}" if same else
                f"triton: {_first_line(err_ours) if err_ours else 'returned'}; "
                f"torch: {_first_line(err_ref) if err_ref else 'returned'}")
        return {**row, "status": status, "ok": same, "note": note, "seconds": time.perf_counter() - t0}
    tol = _tol(case, dtype)
    d = compare(ours, ref, case.exact, tol)
    row.update(max_abs_err=d.max_abs, max_rel_err=d.max_rel)
    if not d.ok:
        status, note = "fail", f"against the reference: {d.why}"
    if case.torch_eager is not None and case.compare_eager:
        try:
            eager = case.torch_eager(inputs)
        except Exception as e:  # noqa: BLE001
            status, note = "fail", (note + "; " if note else "") + f"torch eager raised {_first_line(e)}"
        else:
            de = compare(ours, eager, False, tol)
            row["vs_torch_err"] = de.max_abs
            if not de.ok:
                status, note = "fail", (note + "; " if note else "") + f"against torch eager: {de.why}"
    elif case.torch_eager is not None:
        note = "torch eager not compared (its values differ by design)"
    return {**row, "status": status, "ok": status == "pass", "note": note, "seconds": time.perf_counter() - t0}


def check(ops: Iterable[str] | str | None = None, dtypes: Iterable[torch.dtype | str] | None = None,
          sizes: Iterable[int] | str | None = None, edge: bool = True, seed: int = 0,
          progress: bool = True) -> KernelCheck:
    """Run every selected case under kernels='triton' and 'torch' and compare (and against torch eager).

    ``ops``: op names or case-name prefixes (None: all). ``dtypes``: e.g. ``["fp32", "bf16"]`` (None: each
    case's own). ``sizes``: sizes to make (None: each case's ``check_sizes``; ``"smallest"``: the first
    of them). ``edge``: also every ``edge_cases`` entry. Where Triton cannot run, rows are skipped with
    the reason (never a crash); any other error of the op is a failing row.
    """
    cases = select(ops)
    want = None if dtypes is None else [parse_dtype(d) for d in dtypes]
    device = _device()
    st = _triton.status()
    ran = _triton_label(st)
    t0 = time.perf_counter()
    plan: list[tuple[KernelCase, torch.dtype, Any]] = []
    for case in cases:
        if sizes == "smallest":
            case_sizes = [min(case.check_sizes)]
        elif sizes is None:
            case_sizes = list(case.check_sizes)
        else:
            case_sizes = [int(s) for s in sizes]
        for dtype in _dtypes(case, want):
            plan += [(case, dtype, s) for s in case_sizes]
            if edge and case.edge_cases is not None:
                plan.append((case, dtype, "edge"))
    rows = []
    with _progress(len(plan), "kernels check", progress) as bar:
        for case, dtype, size in plan:
            bar.set_postfix_str(f"{case.name} {SHORT.get(dtype)} {size}", refresh=False)
            try:
                if size == "edge":
                    for label, inputs in case.edge_cases(dtype, device, _gen(seed)):
                        rows.append(_check_one(case, dtype, _size_of(inputs), label, inputs, ran))
                else:
                    inputs = case.make(size, dtype, device, _gen(seed))
                    rows.append(_check_one(case, dtype, size, "random", inputs, ran))
            except Exception as e:  # noqa: BLE001 - a case that cannot make its inputs is a failing row
                rows.append({"case": case.name, "op": case.op, "dtype": SHORT.get(dtype, str(dtype)),
                             "size": -1 if size == "edge" else size, "label": "edge" if size == "edge" else "random",
                             "backend_ran": "none", "status": "fail", "ok": False, "seconds": 0.0,
                             "note": f"making the inputs raised {_first_line(e)}"})
            bar.update(1)
    frame = pd.DataFrame(rows, columns=CHECK_COLUMNS)
    return KernelCheck(frame, str(device), ran, st.version, time.perf_counter() - t0)


@dataclass(eq=False)  # a frame inside: compare with to_frame()
class KernelCheck(RendersInNotebook):
    """Every kernel against its reference: one row per case, dtype and size or edge case.

    ``status`` is ``pass``, ``fail`` or ``skip`` (Triton could not run here; ``note`` says why). ``ok``
    (the object) means no row failed. Evaluate it in a notebook for the table.
    """

    rows: pd.DataFrame
    device: str
    backend: str        # "triton (interpreter)" or "triton (cuda)"
    triton_version: str | None
    wall_s: float

    @property
    def ok(self) -> bool:
        return not (self.rows["status"] == "fail").any()

    @property
    def failures(self) -> pd.DataFrame:
        return self.rows[self.rows["status"] == "fail"].reset_index(drop=True)

    @property
    def skipped(self) -> pd.DataFrame:
        return self.rows[self.rows["status"] == "skip"].reset_index(drop=True)

    def to_frame(self) -> pd.DataFrame:
        return self.rows.copy()

    def by_case(self) -> pd.DataFrame:
        """One row per case: rows checked, passed, failed, skipped, the largest errors, the seconds and a
        ``status`` (fail: any row failed; skip: every row skipped; else pass)."""
        return self._counts("case")

    def by_op(self) -> pd.DataFrame:
        """One row per op (kernel), as :meth:`by_case`, plus how many ``cases`` it has."""
        return self._counts("op")

    def _counts(self, by: str) -> pd.DataFrame:
        r = self.rows.assign(passed=self.rows["status"] == "pass", failed=self.rows["status"] == "fail",
                             skipped=self.rows["status"] == "skip")
        out = (r.groupby(by, sort=False)
                .agg(cases=("case", "nunique"), rows=("status", "size"), passed=("passed", "sum"),
                     failed=("failed", "sum"), skipped=("skipped", "sum"), max_abs_err=("max_abs_err", "max"),
                     vs_torch_err=("vs_torch_err", "max"), seconds=("seconds", "sum"))
                .reset_index())
        out.insert(1, "status", ["fail" if f else "skip" if s == n else "pass"
                                 for f, s, n in zip(out["failed"], out["skipped"], out["rows"])])
        return out if by == "op" else out.drop(columns="cases")

    def where(self, status: str | None = None, op: str | None = None) -> KernelCheck:
        """The rows with this ``status`` (pass, fail, skip) and of this op (or case), as a new KernelCheck."""
        r = self.rows
        if status is not None:
            r = r[r["status"] == status]
        if op is not None:
            r = r[(r["op"] == op) | (r["case"] == op)]
        return KernelCheck(r.reset_index(drop=True), self.device, self.backend, self.triton_version, self.wall_s)

    def summary(self) -> dict[str, Any]:
        r = self.rows
        counts = r["status"].value_counts()
        return {"ok": self.ok, "cases": int(r["case"].nunique()), "rows": len(r), "passed": int(counts.get("pass", 0)),
                "failed": int(counts.get("fail", 0)), "skipped": int(counts.get("skip", 0)),
                "dtypes": sorted(r["dtype"].unique().tolist()), "backend": self.backend, "device": self.device,
                "triton": self.triton_version, "seconds": round(self.wall_s, 2),
                "max_abs_err": _num(r["max_abs_err"].max()) if len(r) else None,
                "skip_reason": r.loc[r["status"] == "skip", "note"].iloc[0] if counts.get("skip", 0) else None}

    def headline(self) -> str:
        s = self.summary()
        ran = s["rows"] - s["skipped"]
        skip = f", {s['skipped']} skipped ({s['skip_reason']})" if s["skipped"] else ""
        return (f"{'ok' if s['ok'] else 'FAILED'}: {s['passed']}/{ran} pass{skip}, {s['cases']} cases x "
                f"{'/'.join(s['dtypes'])}, {self.backend} on {self.device}, {s['seconds']:.1f} s")

    def to_dict(self) -> dict[str, Any]:
        """The summary and every row, JSON-safe (NaN and inf as None)."""
        return {"summary": self.summary(), "rows": _records(self.rows)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def __repr__(self) -> str:
        return f"KernelCheck({self.headline()})"

    def _repr_html_(self) -> str:
        return _html_table(self.rows, ["case", "dtype", "size", "label", "status", "max_abs_err", "max_rel_err",
                                       "vs_torch_err", "seconds", "note"], html.escape(self.headline()))



# --------------------------------------------------------------------------------------------------


def _num(v: Any) -> Any:
    """A JSON-safe scalar: numpy numbers as Python ones, inf and NaN as None."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    return v


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _num(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v):
            return "" if math.isnan(v) else str(v)
        return f"{v:.3g}" if v and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def _html_table(frame: pd.DataFrame, cols: list[str], title: str) -> str:
    colors = {"pass": "#1a7f37", "fail": "#cf222e", "skip": "#9a6700"}
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = []
    for row in frame[cols].itertuples(index=False):
        cells = []
        for c, v in zip(cols, row):
            style = f" style='color:{colors[v]};font-weight:bold'" if c == "status" and v in colors else ""
            cells.append(f"<td{style}>{html.escape(_fmt(v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<div><b>{title}</b><table><tr>{head}</tr>{''.join(body)}</table></div>"
