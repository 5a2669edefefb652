"""The one parity check every multi-rank test uses: a layout's losses against the 1-process run's.

Tolerances (see tests/test_parity.py for why they are not zero): every step's loss within LOSS_TOL;
at step 0, before any update, the loss within LOSS0_TOL and the gradient norm within GNORM0_RTOL.
"""

from __future__ import annotations

import pandas as pd

LOSS_TOL, LOSS0_TOL, GNORM0_RTOL = 1e-3, 1e-5, 1e-4

# The layouts every parity check covers (tests/test_parity.py, and the kernels' tests/test_kernels_training.py).
LAYOUTS = {
    "dp_replicate=2": dict(nproc=2, dp_replicate=2),
    "dp_shard=2": dict(nproc=2, dp_shard=2),
    "tp=2": dict(nproc=2, tp=2),
    "tp=2+sp": dict(nproc=2, tp=2, sequence_parallel=True),
    "dp_shard=2 x tp=2": dict(nproc=4, dp_shard=2, tp=2),
}


def assert_matches_reference(df: pd.DataFrame, ref: pd.DataFrame, name: str, *, loss_tol: float = LOSS_TOL,
                             loss0_tol: float = LOSS0_TOL, gnorm0_rtol: float = GNORM0_RTOL) -> float:
    """Check every rank of ``df`` (Run.metrics) against ``ref`` (indexed by step); returns the worst diff."""
    worst = 0.0
    for rank, g in df.groupby("rank"):
        g = g.set_index("step")
        diff = (g["loss"] - ref["loss"]).abs()
        worst = max(worst, float(diff.max()))
        assert diff.max() <= loss_tol, f"{name} rank {rank}: loss differs by {diff.max():.2e} (> {loss_tol})"
        assert diff.loc[0] <= loss0_tol, f"{name} rank {rank}: step-0 loss differs by {diff.loc[0]:.2e}"
        g0, r0 = g["grad_norm"].loc[0], ref["grad_norm"].loc[0]
        assert abs(g0 - r0) <= gnorm0_rtol * r0, f"{name}: step-0 grad norm {g0} vs {r0}"
    # The loss is the global-batch mean: every rank reports the same value.
    assert df.groupby("step")["loss"].nunique().max() == 1
    return worst
