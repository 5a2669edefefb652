"""A KernelCheck the size of notebook 06's (300 rows over 18 cases), with failing and skipped rows, built
from plain values in milliseconds (tests of issue 28 finding 10; no kernel is run)."""

from __future__ import annotations

import pandas as pd

from workbench.kernels.check import CHECK_COLUMNS, KernelCheck

OPS = ["index_put", "masked_fill", "mask_select", "mask_assign", "set_value", "dropout_add"]


def synthetic_check(rows: int = 300, cases: int = 18, failing: int = 2, skipped: int = 3) -> KernelCheck:
    """``rows`` rows over ``cases`` cases; the first ``failing`` rows of case 5 fail, the last ``skipped``
    rows of the last case are skipped, the rest pass."""
    names = [f"{OPS[c % len(OPS)]}/variant-{c}" for c in range(cases)]
    out = []
    for i in range(rows):
        c = i % cases
        out.append({"case": names[c], "op": OPS[c % len(OPS)], "dtype": "fp32" if i % 2 else "bf16",
                    "size": 16 * (1 + i // cases), "label": "random", "backend_ran": "triton (interpreter)",
                    "status": "pass", "max_abs_err": 1e-7 * (i % 7), "max_rel_err": 1e-6 * (i % 5),
                    "vs_torch_err": 0.0, "ok": True, "seconds": 0.01, "note": ""})
    for row in [r for r in out if r["case"] == names[5 % cases]][:failing]:
        row.update(status="fail", ok=False, max_abs_err=0.5, note="against the reference: 3 of 64 elements differ")
    for row in [r for r in out if r["case"] == names[-1]][-skipped:] if skipped else []:
        row.update(status="skip", ok=False, backend_ran="none", max_abs_err=float("nan"),
                   note="Triton cannot run here: no interpreter")
    return KernelCheck(pd.DataFrame(out, columns=CHECK_COLUMNS), "cpu", "triton (interpreter)", "3.6.0", 7.5)
