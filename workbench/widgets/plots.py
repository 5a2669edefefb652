"""Plotly figures over finished runs: compare layouts by their loss curves.

Same model, same seed, same global batch: data parallel, FSDP and tensor parallel should trace the
same curve. ``plot_losses(run_1proc, run_fsdp, run_tp)`` overlays them so the eye can check.
"""

from __future__ import annotations

import plotly.graph_objects as go

from workbench.train.launcher import Run

# One color per run; ranks of the same run share it and differ by dash.
RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
RANK_DASHES = ("solid", "dot", "dash", "dashdot", "longdash", "longdashdot")


def run_label(run: Run) -> str:
    """``"tiny dp_shard=2"``: the model and the layout, which is what differs between compared runs."""
    return f"{run.job.model.name} {run.job.parallel.describe()}"


def plot_losses(*runs: Run, rank: int = 0, title: str = "Loss per step") -> go.Figure:
    """One loss-vs-step line per run (the given rank's view), labeled by model and layout."""
    fig = go.Figure()
    for i, run in enumerate(runs):
        df = run.metrics
        df = df[df["rank"] == rank]
        fig.add_scatter(
            x=df["step"].tolist(),
            y=df["loss"].tolist(),
            mode="lines+markers",
            name=run_label(run),
            line={"color": RUN_COLORS[i % len(RUN_COLORS)], "dash": RANK_DASHES[i % len(RANK_DASHES)]},
            marker={"size": 5},
        )
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=f"loss (rank {rank})",
                      height=380, margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"title": "run"})
    return fig


__all__ = ["plot_losses", "run_label", "RUN_COLORS", "RANK_DASHES"]
