"""Plotly figures over runs, drawn from their events.

* ``plot_losses(run_1proc, run_fsdp, run_tp)``: same model, seed and global batch trace the same curve.
* ``plot_pipeline_timeline(run)``: one pipeline step, rank x time, a bar per measured forward (F) and
  backward (B), coloured by microbatch (an interleaved rank's later stages lighter); the title compares the measured bubble with (p-1)/(m+p-1).
* ``pipeline_trace(run)`` / ``export_pipeline_trace(run, path)``: that schedule as a Chrome/Perfetto trace.
* ``ema(values, weight)``: the smoothing the dashboard's EMA slider draws.
* ``plot_tokens_per_expert(run)``: how a mixture-of-experts router spread the tokens, per layer.

Each takes a :class:`Run` or a list of events (``read_events(run_dir)``, or made by hand).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import plotly.colors
import plotly.graph_objects as go

from workbench.parallel.pipeline_bubble import (COLUMNS, bubble_fraction, pipeline_step, pipeline_steps, schedule_frame,
                                                schedule_shape, theoretical_bubble)
from workbench.train.events import read_events
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


def ema(values: Iterable[float | None], weight: float) -> list[float | None]:
    """Exponential moving average, TensorBoard's smoothing: ``s_0 = x_0``, ``s_t = w s_(t-1) + (1-w) x_t``.

    ``weight`` 0 returns the values; closer to 1 is smoother. A missing or non-finite value leaves the
    average where it was (and is drawn at it), so one NaN does not blank the rest of the curve.
    """
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight={weight} is outside [0, 1); 0 is raw, 0.9 is smooth")
    out: list[float | None] = []
    s = None
    for x in values:
        if x is not None and math.isfinite(x):
            s = x if s is None else weight * s + (1 - weight) * x
        out.append(s)
    return out


def _events(run_or_events: Run | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(run_or_events, Run):
        return read_events(run_or_events.run_dir)
    return list(run_or_events)


MICROBATCH_COLORS = plotly.colors.qualitative.Plotly
PHASE_STYLE = {  # forward solid, backward hatched and lighter: the colour still names the microbatch
    "F": {"opacity": 1.0, "marker_pattern_shape": ""},
    "B": {"opacity": 0.7, "marker_pattern_shape": "/"},
}


def _lighter(color: str, amount: float) -> str:
    """``color`` (``#rrggbb``) mixed with white: ``amount`` 0 leaves it, 1 is white."""
    if amount <= 0:
        return color
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in (r, g, b))


def _median_step(events: list[dict[str, Any]]) -> tuple[Any, float]:
    """The median schedule over the complete steps (step 0, warm-up, left out if others exist): per action,
    the median start and end relative to its step's first action. Returns the frame and its bubble."""
    steps = pipeline_steps(events)
    steady = [s for s in steps if s != 0] or steps
    frame = schedule_frame([e for e in events if e.get("type") == "schedule"])
    frame = frame[frame["step"].isin(steady)]
    t0 = frame.groupby("step")["start"].transform("min")
    frame = frame.assign(start=frame["start"] - t0, end=frame["end"] - t0)
    keys = ["rank", "stage", "microbatch", "phase"]
    frame = frame.groupby(keys, as_index=False)[["start", "end"]].median()
    frame.insert(1, "step", -1)
    span = frame["end"].max() - frame["start"].min()
    busy = (frame["end"] - frame["start"]).groupby(frame["rank"]).sum()
    return frame[list(COLUMNS)], float((1.0 - busy / span).mean())


def plot_pipeline_timeline(run_or_events: Run | Iterable[dict[str, Any]],
                           step: int | str | None = None) -> go.Figure:
    """One pipeline step as a Gantt chart: a row per rank (labelled with its stages), time in ms from the
    step start.

    Each measured action is one horizontal bar, F solid and B hatched, coloured by microbatch; hovering
    shows stage, rank, microbatch, phase and duration. Under an interleaved schedule (v stages per rank,
    e.g. stages r and r+p) the rank's later stages are lighter shades of the microbatch's colour and the
    bars say their stage (``F3 s2``), so its chunks stay apart on the one row. White space in a row is
    that rank's bubble. The title gives the step's measured bubble (``bubble_fraction``) against the
    theory for equal stages, (p-1)/(v m+p-1). ``fig.layout.meta`` holds those numbers (``step``, ``bubble_measured``,
    ``bubble_theory``, ``pp``, ``microbatches``, ``stages_per_rank``, ``schedule``).
    ``step="median"``: each action's median start and end (from its step's start) over the steady steps,
    which a single noisy step can't show.
    """
    events = _events(run_or_events)
    if step == "median":
        frame, measured = _median_step(events)
    else:
        step = pipeline_step(events, step)
        in_step = [e for e in events if e.get("type") == "schedule" and e["step"] == step]
        frame = schedule_frame(in_step)
        measured = bubble_fraction(in_step, skip_first=False)
    pp, m, v = schedule_shape(frame)
    schedule = next((e["schedule"] for e in events if e.get("type") == "pipeline"), None)
    theory = theoretical_bubble(pp, m, v)

    t0 = frame["start"].min()  # ranks share one clock on one host; across hosts, clock skew shows here
    frame = frame.assign(start_ms=(frame["start"] - t0) * 1e3, end_ms=(frame["end"] - t0) * 1e3)
    frame["ms"] = frame["end_ms"] - frame["start_ms"]
    # One row per rank. An interleaved rank runs v stages ("chunks", e.g. stages r and r+p): its chunk
    # is the stage's place among the rank's stages, drawn as a lighter shade of the microbatch's colour.
    stages = {int(r): sorted(int(s) for s in g.unique()) for r, g in frame.groupby("rank")["stage"]}
    labels = {r: f"stage{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))} · rank {r}"
              for r, ss in stages.items()}
    frame["row"] = [labels[int(r)] for r in frame["rank"]]
    frame["chunk"] = [stages[int(r)].index(int(s)) for r, s in zip(frame["rank"], frame["stage"])]
    rows = [labels[r] for r in sorted(stages, key=lambda r: (stages[r], r))]

    fig = go.Figure()
    for (mb, chunk, phase), bars in frame.sort_values(["microbatch", "chunk", "phase"],
                                                      ascending=[True, True, False]).groupby(
            ["microbatch", "chunk", "phase"], sort=False):
        fig.add_bar(
            orientation="h", y=bars["row"].tolist(), base=bars["start_ms"].tolist(), x=bars["ms"].tolist(),
            name=f"microbatch {mb}", legendgroup=f"mb{mb}", showlegend=phase == "F" and chunk == 0,
            marker_color=_lighter(MICROBATCH_COLORS[int(mb) % len(MICROBATCH_COLORS)], 0.8 * chunk / v),
            marker_line_width=0.5, marker_line_color="white",
            text=[f"{phase}{mb}" + (f" s{s}" if v > 1 else "") for s in bars["stage"]], textposition="inside",
            insidetextanchor="middle", width=0.7,
            customdata=bars[["stage", "rank", "microbatch", "phase", "ms", "start_ms", "end_ms", "chunk"]
                            ].values.tolist(),
            hovertemplate=("stage %{customdata[0]} (rank %{customdata[1]}"
                           + (f", chunk %{{customdata[7]}} of {v}" if v > 1 else "")
                           + ")<br>microbatch %{customdata[2]}, %{customdata[3]}<br>%{customdata[4]:.2f} ms, "
                           "from %{customdata[5]:.2f} to %{customdata[6]:.2f} ms<extra></extra>"),
            **PHASE_STYLE[phase],
        )
    what = f"{schedule}, " if schedule else ""
    which = "median over steps" if step == "median" else f"step {step}"
    shape, vm = (f"p={pp}, m={m}, v={v}", "v·m") if v > 1 else (f"p={pp}, m={m}", "m")
    chunks = ", lighter = the rank's later stage (label: F/B, microbatch, stage)" if v > 1 else ""
    fig.update_layout(
        title=(f"Pipeline {which} ({what}{shape}): bubble: measured {measured:.0%} vs theory "
               f"{theory:.0%}<br><sup>theory (p-1)/({vm}+p-1); F solid, B hatched; colour = microbatch"
               f"{chunks}</sup>"),
        barmode="overlay", xaxis_title="ms from the step's first forward",
        yaxis={"categoryorder": "array", "categoryarray": rows, "autorange": "reversed"},
        height=190 + 45 * len(rows), margin={"l": max(120, 7 * max(map(len, rows))), "r": 20, "t": 70, "b": 90},
        legend={"orientation": "h", "yanchor": "top", "y": -0.5, "font": {"size": 10}},
        meta={"step": step, "bubble_measured": measured, "bubble_theory": theory, "pp": pp,
              "microbatches": m, "stages_per_rank": v, "schedule": schedule},
    )
    return fig


def pipeline_trace(run_or_events: Run | Iterable[dict[str, Any]], step: int | None = None) -> dict[str, Any]:
    """The measured pipeline schedule in Chrome/Perfetto Trace Event Format, for ``chrome://tracing`` or
    ui.perfetto.dev: one complete event (``"ph": "X"``) per forward/backward, ``pid`` = rank,
    ``tid`` = stage, ``ts``/``dur`` in microseconds from the first action shown.

    ``step=None`` exports every complete step (so steps can be compared side by side in the viewer);
    a step number exports that step only (ValueError naming the choices if it is incomplete).
    """
    events = _events(run_or_events)
    steps = [pipeline_step(events, step)] if step is not None else pipeline_steps(events)
    frame = schedule_frame([e for e in events if e.get("type") == "schedule"])
    frame = frame[frame["step"].isin(steps)]
    t0 = frame["start"].min() if len(frame) else 0.0
    trace = [{"name": f"{ph}{int(mb)}", "cat": "forward" if ph == "F" else "backward", "ph": "X",
              "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "pid": int(rank), "tid": int(stage),
              "args": {"step": int(st), "stage": int(stage), "microbatch": int(mb)}}
             for rank, st, stage, mb, ph, start, end in frame[list(COLUMNS)].itertuples(index=False)]
    names = [{"name": "process_name", "ph": "M", "pid": int(r), "tid": 0, "args": {"name": f"rank {int(r)}"}}
             for r in sorted(frame["rank"].unique())]
    return {"traceEvents": names + trace, "displayTimeUnit": "ms"}


def export_pipeline_trace(run_or_events: Run | Iterable[dict[str, Any]], path: str | Path,
                          step: int | None = None) -> Path:
    """Write :func:`pipeline_trace` as JSON to ``path`` and return the path."""
    path = Path(path)
    path.write_text(json.dumps(pipeline_trace(run_or_events, step)))
    return path


def plot_tokens_per_expert(run_or_events: Run | Iterable[dict[str, Any]], step: int | None = None) -> go.Figure:
    """Token-slots routed to each expert at one step (default: the latest), a bar group per layer.

    The dashed line is a perfectly balanced router (every expert gets total / E). The title carries
    the step's load-balancing loss ``aux_loss`` (sum over layers of E sum_e f_e P_e; 1 per layer
    when balanced). ``fig.layout.meta`` holds ``step`` and ``aux_loss``.
    """
    events = _events(run_or_events)
    moe = {}
    for e in events:  # every rank writes the same global counts; one per step is enough
        if e.get("type") == "moe":
            moe.setdefault(e["step"], e["tokens_per_expert"])
    if not moe:
        raise ValueError("no moe events; they are written by runs of mixture-of-experts models (e.g. tiny-moe)")
    step = max(moe) if step is None else step
    if step not in moe:
        raise ValueError(f"no moe event for step {step}; choose one of {sorted(moe)}")
    counts = moe[step]
    aux = next((e.get("aux_loss") for e in events if e.get("type") == "step" and e["step"] == step), None)
    n_experts = len(counts[0])
    experts = [f"expert {i}" for i in range(n_experts)]
    fig = go.Figure()
    for layer, row in enumerate(counts):
        fig.add_bar(x=experts, y=row, name=f"layer {layer}",
                    marker_color=MICROBATCH_COLORS[layer % len(MICROBATCH_COLORS)],
                    hovertemplate=f"layer {layer}, %{{x}}: %{{y}} token-slots<extra></extra>")
    fig.add_hline(y=sum(counts[0]) / n_experts, line_dash="dash", line_color="gray",
                  annotation_text="balanced", annotation_position="top left")
    aux_text = f", aux loss {aux:.3f} ({len(counts)} when balanced)" if aux is not None else ""
    fig.update_layout(title=f"Tokens per expert, step {step}{aux_text}", barmode="group",
                      yaxis_title="token-slots (top-k per token)", height=340,
                      margin={"l": 60, "r": 20, "t": 50, "b": 40}, meta={"step": step, "aux_loss": aux})
    return fig


__all__ = ["ema", "plot_losses", "plot_pipeline_timeline", "plot_tokens_per_expert", "pipeline_step", "run_label",
           "RUN_COLORS", "RANK_DASHES"]
