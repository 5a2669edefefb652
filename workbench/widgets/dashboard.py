"""``RunDashboard``: pick a layout, launch a run, and watch every rank train, live.

A thin view over :func:`workbench.launch` and :class:`workbench.Run`. It holds no training logic: the
Launch button calls ``launch(...)`` with the control values, and a background thread reads the run's
``events.jsonl`` through the :class:`Run` (its history, status and root cause) every ``poll_s`` seconds and
redraws::

    dash = RunDashboard(preset="tiny", nproc=2, dp_shard=2, steps=10)
    dash                     # the widget: controls, progress, loss and tokens/s per rank, errors
    dash.launch()            # what the Launch button does; returns the Run
    dash.wait()              # block until the run ends, still updating (for headless notebooks)

Earlier runs stay in the plots, so layouts can be compared on one chart until "Clear" is pressed.
The memory plot shows each rank's memory per step (:meth:`Run.memory_history`): the peak within the
step from the ranks' ``memory`` events when the run records memory (``memory=True``), else the step
events' own ``mem_bytes``; its title says which.
A pipeline run (pp > 1) also gets a timeline of its latest complete step, drawn from the ranks'
``schedule`` events with the measured bubble next to the theory; a mixture-of-experts run gets its
tokens per expert. Both show the latest run only.

The task control picks what the ranks train: a language model (``workbench.launch``), or a contrastive
sentence encoder (``task="embedding"``: the same launch with an :class:`~workbench.embedding.EmbeddingConfig`,
``embedding=`` sets it; :func:`~workbench.embedding.embedding_task`). An embedding run adds a plot of held-out top-1 retrieval accuracy against chance,
from its ``eval`` events::

    RunDashboard(task="embedding", nproc=2, dp_shard=2, steps=60, global_batch=32, lr=1e-3)
"""

from __future__ import annotations

import dataclasses
import html
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
from workbench.settings import split_settings
from workbench.train.launcher import Run, build_job, launch, memory_shortfall
from workbench.widgets.controls import read_controls, setting_controls
from workbench.parallel.pipeline_bubble import pipeline_steps
from workbench.widgets.plots import (RANK_DASHES, RUN_COLORS, export_pipeline_trace, plot_pipeline_timeline,
                                     plot_tokens_per_expert, run_label)

# The training settings the dashboard shows controls for (every ParallelConfig setting gets one).
TRAIN_CONTROLS = ("data", "steps", "global_batch", "seed", "device")
# What the memory plot shows, by where Run.memory_history found it.
MEMORY_TITLES = {
    "memory": "Memory per step: each rank's peak within the step",
    "peak_mem_bytes": "Memory per step: each rank's peak tensor bytes",
    "mem_bytes": "Memory per step: mem_bytes (memory=True records the peak within each step)",
}


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _preset_options() -> list[tuple[str, str]]:
    """Presets whose training state fits this machine first (smallest first), then the planning-only ones
    (the core's one memory rule, ``memory_shortfall``, which also refuses them at launch)."""
    names = sorted(PRESETS, key=lambda n: PRESETS[n].n_params)
    trainable = [n for n in names if memory_shortfall(JobConfig(model=PRESETS[n])) is None]
    planning = [n for n in names if n not in trainable]
    return ([(f"{n} ({_human(PRESETS[n].n_params)} params)", n) for n in trainable]
            + [(f"{n} ({_human(PRESETS[n].n_params)}, plan only)", n) for n in planning])


TASKS = {"lm": "language model", "embedding": "embedding (contrastive)"}
# What an embedding run starts from when the dashboard is given no training settings of its own: the
# settings under which the tiny preset's held-out retrieval rises within a minute on 2 CPU cores.
EMBEDDING_DEFAULTS = {"global_batch": 32, "lr": 1e-3, "warmup_steps": 20}


@dataclass
class _RunView:
    """What the dashboard draws for one run: the Run's history as last drawn, and the plot traces.

    Every fact comes from the :class:`Run` (``history()``, ``status``, ``root_cause()``); the view keeps
    only how many of its events it has drawn (``seen``) and what is on screen.
    """

    run: Run
    label: str
    color: str
    steps: int
    seen: int = 0  # events of the run already drawn
    history: dict[int, Any] = field(default_factory=dict)  # run.history() when last drawn
    loss_traces: dict[int, Any] = field(default_factory=dict)
    tps_traces: dict[int, Any] = field(default_factory=dict)
    mem_traces: dict[int, Any] = field(default_factory=dict)
    eval_events: list[dict] = field(default_factory=list)  # embedding runs: rank 0's `eval` events
    eval_trace: Any = None
    pipeline_events: list[dict] = field(default_factory=list)  # `pipeline` + `schedule`, for the timeline
    moe_events: list[dict] = field(default_factory=list)  # `moe` + `step` (its aux_loss)
    timeline_step: Any = None  # (picked, step shown, steps complete) as last drawn
    moe_step: int | None = None
    launched_at: float = field(default_factory=time.time)
    finished: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class RunDashboard:
    """Launch and watch training runs from a notebook. Evaluate the object to show it.

    ``parallel``/``train`` (configs) and the keyword shortcuts (``tp=2``, ``steps=10``: any of their
    fields) set the controls' initial values; they mean what they mean to :func:`workbench.launch`
    (``nproc`` defaults to the product of the degrees). There is a control for every ParallelConfig
    setting and for the training settings in ``TRAIN_CONTROLS``; other training settings given here are
    passed to every launch as they are. Each run gets a fresh directory under ``out_root`` (a temporary
    directory when None). ``poll_s`` is how often the view reads new events.
    """

    def __init__(
        self,
        preset: str = "tiny",
        *,
        nproc: int | None = None,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        out_root: str | Path | None = None,
        poll_s: float = 0.2,
        task: str = "lm",
        embedding: Any = None,
        **settings: Any,
    ):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        if task not in TASKS:
            raise ValueError(f"task={task!r} is unknown; choose one of {', '.join(TASKS)}")
        from workbench.embedding.config import EmbeddingConfig

        if isinstance(embedding, dict):
            embedding = EmbeddingConfig.from_dict(embedding)
        emb_names = set(EmbeddingConfig.__dataclass_fields__)
        emb_given = {k: settings.pop(k) for k in list(settings) if k in emb_names}
        self.embedding = dataclasses.replace(embedding or EmbeddingConfig(), **emb_given)
        if task == "embedding" and train is None:
            settings = {**EMBEDDING_DEFAULTS, **settings}
        given = split_settings(settings, ("parallel", "train"), what="dashboard setting")
        layout = {**(parallel.to_dict() if parallel is not None else {}), **given["parallel"]}
        training = {**(train.to_dict() if train is not None else {}), **given["train"]}
        # Training settings without a control ride along unchanged to every launch.
        self._fixed_train = {k: v for k, v in training.items() if k not in TRAIN_CONTROLS}
        if nproc is None:  # the core's rule: the product of the degrees, dp_shard=-1 counting as 1
            degrees = ("dp_replicate", "dp_shard", "tp", "pp")
            nproc = ParallelConfig(**{k: v for k, v in layout.items() if k in degrees}).resolved().world_size
        self.out_root = out_root
        self.poll_s = poll_s
        self.runs: list[Run] = []
        self._views: list[_RunView] = []
        self._lock = threading.RLock()  # the poller thread and wait() both pump; one at a time

        style = {"description_width": "initial"}
        self.layout_controls = setting_controls("parallel", layout)
        self.train_controls = setting_controls("train", training, only=TRAIN_CONTROLS)
        self.controls: dict[str, widgets.ValueWidget] = {
            "task": widgets.Dropdown(options=[(v, k) for k, v in TASKS.items()], value=task, description="task",
                                     style=style, layout=widgets.Layout(width="240px")),
            "preset": widgets.Dropdown(options=_preset_options(), value=preset, description="model",
                                       style=style, layout=widgets.Layout(width="260px")),
            "nproc": widgets.BoundedIntText(nproc, min=1, max=1024, description="nproc", style=style,
                                            tooltip="nproc: processes to start; dp_shard=-1 takes the rest",
                                            layout=widgets.Layout(width="130px")),
            **self.layout_controls,
            **self.train_controls,
        }
        c = self.controls
        self.launch_button = widgets.Button(description="Launch", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.clear_button = widgets.Button(description="Clear", icon="eraser",
                                           tooltip="remove earlier runs from the plots")
        self.launch_button.on_click(lambda _: self.launch())
        self.stop_button.on_click(lambda _: self.stop())
        self.clear_button.on_click(lambda _: self.clear())
        self.progress = widgets.IntProgress(value=0, min=0, max=c["steps"].value, description="rank 0",
                                            style=style, layout=widgets.Layout(width="320px"))
        self.status = widgets.HTML("idle")
        self.error_panel = widgets.HTML("", layout=widgets.Layout(display="none", width="100%"))
        self.loss_fig = self._figure("Loss per step", "loss")
        self.tps_fig = self._figure("Throughput per step (whole job)", "tokens/s (global)")
        self.memory_fig = self._figure("Memory per step", "MiB per rank")
        self.accuracy_fig = self._figure("Held-out top-1 retrieval", "accuracy")
        self.accuracy_fig.layout.yaxis.range = [0, 1]
        self.accuracy_box = widgets.VBox([self.accuracy_fig], layout=widgets.Layout(display="none"))
        # Shown only for the runs that write their events: pipeline (pp > 1) and mixture-of-experts runs.
        self.bubble_label = widgets.HTML("")
        self.timeline_fig = go.FigureWidget(layout={"height": 260, "width": 1040, "title": "Pipeline timeline"})
        self.trace_button = widgets.Button(description="Export trace", icon="download",
                                           tooltip="write the pipeline schedule as a Chrome/Perfetto trace "
                                                   "(pipeline_trace.json in the run directory)")
        self.trace_button.on_click(lambda _: self._export_trace_clicked())
        self.trace_status = widgets.HTML("")
        # Which step the timeline shows: "latest" follows the run; "median" is the typical step.
        self.timeline_step = widgets.Dropdown(options=[("latest", "latest"), ("median over steps", "median")],
                                              value="latest", description="step",
                                              layout=widgets.Layout(width="220px"))
        self.timeline_step.observe(lambda _: self._show_timeline(), names="value")
        self.timeline_box = widgets.VBox([self.bubble_label, self.timeline_fig,
                                          widgets.HBox([self.timeline_step, self.trace_button, self.trace_status])],
                                         layout=widgets.Layout(display="none"))
        self.experts_fig = go.FigureWidget(layout={"height": 340, "width": 520, "title": "Tokens per expert"})
        self.experts_box = widgets.VBox([self.experts_fig], layout=widgets.Layout(display="none"))

        wrap = widgets.Layout(flex_flow="row wrap")
        self.widget = widgets.VBox([
            widgets.HBox([c["task"], c["preset"], *self.train_controls.values()], layout=wrap),
            widgets.HBox([c["nproc"], *self.layout_controls.values()], layout=wrap),
            widgets.HBox([self.launch_button, self.stop_button, self.clear_button, self.progress, self.status]),
            self.error_panel,
            widgets.HBox([self.loss_fig, self.tps_fig, self.memory_fig, self.accuracy_box],
                         layout=widgets.Layout(flex_flow="row wrap")),
            self.timeline_box,
            self.experts_box,
        ])

    def export_trace(self, path: str | Path | None = None, step: int | None = None) -> Path:
        """Write the latest run's pipeline schedule as Chrome/Perfetto Trace Event Format JSON (open it in
        ui.perfetto.dev or chrome://tracing): every complete step, or only ``step``. ``path`` defaults to
        ``pipeline_trace.json`` in the run directory. ValueError if there is no run or no schedule."""
        if self.run is None:
            raise ValueError("no run yet; launch one with pp > 1 to get a pipeline schedule")
        path = Path(path) if path is not None else self.run.run_dir / "pipeline_trace.json"
        return export_pipeline_trace(self.run, path, step=step)

    def _export_trace_clicked(self) -> None:
        try:
            path = self.export_trace()
        except ValueError as err:
            self.trace_status.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return
        self.trace_status.value = f"wrote <code>{html.escape(str(path))}</code> (open in ui.perfetto.dev)"

    # -- what the view shows ----------------------------------------------------------------------
    @staticmethod
    def _figure(title: str, ytitle: str) -> go.FigureWidget:
        return go.FigureWidget(layout={
            "title": title, "xaxis": {"title": "step"}, "yaxis": {"title": ytitle},
            # The legend sits above the plot, where a growing list of runs pushes the plot down instead
            # of running over the x-axis title.
            "height": 380, "width": 520, "margin": {"l": 60, "r": 10, "t": 50, "b": 40, "autoexpand": True},
            "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0,
                       "font": {"size": 10}},
        })

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        state = self.run.status if self.run is not None else "idle"
        return f"RunDashboard(task={self.controls['task'].value!r}, preset={self.controls['preset'].value!r}, runs={len(self.runs)}, status={state})"

    @property
    def run(self) -> Run | None:
        """The most recently launched run, or None."""
        return self.runs[-1] if self.runs else None

    @property
    def settings(self) -> dict[str, Any]:
        """The control values, as keyword arguments of :func:`workbench.launch` (``model`` first; an
        embedding task adds ``embedding``)."""
        out = {"model": self.controls["preset"].value, "nproc": self.controls["nproc"].value,
               **read_controls(self.layout_controls, "parallel"),
               **self._fixed_train, **read_controls(self.train_controls, "train")}
        if self.controls["task"].value == "embedding":
            from workbench.embedding import embedding_task

            out["task"] = embedding_task(self.embedding)
        return out

    # -- actions ----------------------------------------------------------------------------------
    def launch(self, *, fail_at: dict[str, int] | None = None) -> Run | None:
        """Launch a run with the current settings and start following it.

        An invalid setting is shown in the error panel (one line) and nothing is launched: returns None.
        ``fail_at={"rank": r, "step": s}`` is the core's test hook (that rank raises at that step).
        """
        if self.run is not None and not self.run.done:
            raise RuntimeError("a run is in progress; stop it or wait for it before launching another")
        settings = self.settings
        model = settings.pop("model")
        try:
            task = settings.get("task")
            build = task.build if task is not None else build_job  # includes the core's memory check
            job = build(model, **{k: v for k, v in settings.items() if k != "task"})
        except ValueError as exc:
            self._show_error("Invalid configuration", str(exc))
            self.status.value = "not launched"
            return None
        out = None
        if self.out_root is not None:
            Path(self.out_root).mkdir(parents=True, exist_ok=True)
            out = tempfile.mkdtemp(prefix=f"run{len(self.runs):03d}-{model}-", dir=self.out_root)
        run = launch(model, out=out, fail_at=fail_at, **settings)

        index = len(self._views)
        # The index and the run directory tell apart runs of one model and layout ("tiny pp=2" twice).
        view = _RunView(run=run, label=f"#{index} {run_label(run)} ({run.run_dir.name})", color=RUN_COLORS[index % len(RUN_COLORS)],
                        steps=job.train.steps)
        with self._lock:
            # Earlier runs become wide, faint bands, so a new curve that lands on one stays visible.
            for earlier in self._views:
                for trace in (*earlier.loss_traces.values(), *earlier.tps_traces.values(),
                              *earlier.mem_traces.values(), *([earlier.eval_trace] if earlier.eval_trace is not None else [])):
                    trace.line.width, trace.opacity = 6, 0.35
            self.runs.append(run)
            self._views.append(view)
            self._hide_error()
            self.progress.max, self.progress.value, self.progress.bar_style = view.steps, 0, ""
            self.status.value = self._progress_text(view)
            self.launch_button.disabled, self.stop_button.disabled = True, False
            self.timeline_box.layout.display = "" if job.parallel.pp > 1 else "none"
            self.bubble_label.value = "pipeline timeline: waiting for the first step…" if job.parallel.pp > 1 else ""
            self.timeline_fig.data = ()
            self.experts_box.layout.display = "none"
            self.experts_fig.data = ()
            if settings.get("task") is not None:
                self.accuracy_box.layout.display = ""
        view.thread = threading.Thread(target=self._follow, args=(view,), daemon=True,
                                       name=f"RunDashboard-{index}")
        view.thread.start()
        return run

    def stop(self) -> Run | None:
        """Stop the current run (every rank) and show it as stopped."""
        view = self._views[-1] if self._views else None
        if view is None or view.run.done:
            return self.run
        self.stop_button.disabled = True
        self.status.value = "stopping…"
        view.run.stop()
        self._pump(view)
        return view.run

    def wait(self, timeout: float | None = None, raise_on_error: bool = False) -> Run:
        """Block until the current run ends, updating the widgets meanwhile; returns the Run.

        A failure is shown in the error panel; ``raise_on_error=True`` also raises :class:`RunFailed`.
        On timeout the run is stopped and TimeoutError is raised (as :meth:`Run.wait` does).
        """
        if not self._views:
            raise RuntimeError("nothing was launched; see the error panel" if self.error_panel.value
                               else "nothing was launched; call launch() first")
        view = self._views[-1]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                self._pump(view)
                if view.finished.is_set():
                    break
                if deadline is not None and time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"run in {view.run.run_dir} did not finish within {timeout} s; it was stopped")
                view.finished.wait(self.poll_s)
        except KeyboardInterrupt:
            self.stop()
            raise
        if view.thread is not None:
            view.thread.join(timeout=5)
        err = view.run.error
        if raise_on_error and err is not None:
            raise err
        return view.run

    def clear(self) -> None:
        """Remove earlier runs from the plots (a run still going stays)."""
        with self._lock:
            keep = [v for v in self._views if not v.finished.is_set()]
            for v in self._views:
                if v not in keep:
                    v.loss_traces.clear()
                    v.tps_traces.clear()
                    v.mem_traces.clear()
                    v.eval_trace = None
            kept_evals = [v.eval_trace for v in keep if v.eval_trace is not None]
            self.accuracy_fig.data = [t for t in self.accuracy_fig.data
                                      if any(t is k for k in kept_evals) or (kept_evals and t.name == "chance")]
            for fig, attr in ((self.loss_fig, "loss_traces"), (self.tps_fig, "tps_traces"),
                              (self.memory_fig, "mem_traces")):
                kept = [t for v in keep for t in getattr(v, attr).values()]
                fig.data = [t for t in fig.data if any(t is k for k in kept)]

    # -- following a run --------------------------------------------------------------------------
    def _follow(self, view: _RunView) -> None:
        reported = False
        while not view.finished.is_set():
            try:
                self._pump(view)
            except Exception as exc:  # a view bug must not pass silently, nor kill the run
                if not reported:
                    self.status.value = f"dashboard update failed: {html.escape(repr(exc))}"
                    reported = True
                if view.run.done:  # nothing more will come; don't spin forever
                    view.finished.set()
            view.finished.wait(self.poll_s)

    def _pump(self, view: _RunView) -> None:
        """Read the events written since the last call and redraw. Safe to call from any thread."""
        with self._lock:
            if view.finished.is_set():
                return
            done = view.run.done  # checked before reading, so a finished run's last events are drained
            events = view.run.events_since(view.seen)
            view.seen += len(events)
            touched: set[int] = set()
            memory_touched: set[int] = set()
            new_kinds: set[str] = set()
            for e in events:
                kind, rank = e.get("type"), e.get("rank")
                if kind == "step":
                    touched.add(rank)
                if kind in ("step", "memory"):
                    memory_touched.add(rank)
                if kind in ("pipeline", "schedule"):
                    view.pipeline_events.append(e)
                    new_kinds.add("schedule")
                elif kind == "moe" or (kind == "step" and "aux_loss" in e):
                    view.moe_events.append(e)
                    new_kinds.add("moe")
                elif kind == "eval" and rank == 0:
                    view.eval_events.append(e)
                    new_kinds.add("eval")
            if touched:
                view.history = view.run.history()
                self._redraw(view, touched)
            if memory_touched:
                self._redraw_memory(view, memory_touched)
            if view is self._views[-1] and "schedule" in new_kinds:
                self._redraw_timeline(view)
            if view is self._views[-1] and "moe" in new_kinds:
                self._redraw_experts(view)
            if "eval" in new_kinds:
                self._redraw_accuracy(view)
            if view is self._views[-1]:
                self._show_progress(view)
            if done:
                self._finish(view)

    def _redraw(self, view: _RunView, ranks: set[int]) -> None:
        # tokens/s in a step event is the whole job's (every rank reports the same number): one line per run.
        for fig, key, traces, drawn in ((self.loss_fig, "loss", view.loss_traces, ranks),
                                        (self.tps_fig, "tokens_per_s", view.tps_traces, ranks & {0})):
            with fig.batch_update():
                for rank in sorted(drawn):
                    h = view.history[rank]
                    if rank not in traces:
                        fig.add_scatter(
                            mode="lines+markers", legendgroup=view.label,
                            name=view.label if fig is self.tps_fig else f"{view.label} r{rank}",
                            line={"color": view.color, "dash": RANK_DASHES[rank % len(RANK_DASHES)]},
                            marker={"size": 4},
                        )
                        traces[rank] = fig.data[-1]
                    traces[rank].x = tuple(h["step"].tolist())
                    traces[rank].y = tuple(h[key].tolist())

    def _redraw_memory(self, view: _RunView, ranks: set[int]) -> None:
        """Each rank's memory per step, from ``Run.memory_history`` (its ``source`` names the title)."""
        memory = view.run.memory_history()
        if memory.empty:
            return
        with self.memory_fig.batch_update():
            for rank, h in memory[memory["rank"].isin(ranks)].groupby("rank"):
                rank = int(rank)
                if rank not in view.mem_traces:
                    self.memory_fig.add_scatter(
                        mode="lines+markers", name=f"{view.label} r{rank}", legendgroup=view.label,
                        line={"color": view.color, "dash": RANK_DASHES[rank % len(RANK_DASHES)]},
                        marker={"size": 4}, hovertemplate="step %{x}: %{y:.1f} MiB (%{text})<extra></extra>",
                    )
                    view.mem_traces[rank] = self.memory_fig.data[-1]
                trace = view.mem_traces[rank]
                trace.x = tuple(h["step"].tolist())
                trace.y = tuple((h["peak_bytes"] / 2**20).tolist())
                trace.text = tuple(h["source"].tolist())
            if view is self._views[-1]:
                sources = set(memory["source"])
                source = "memory" if "memory" in sources else memory["source"].iloc[-1]
                self.memory_fig.layout.title.text = MEMORY_TITLES[source]

    def _redraw_accuracy(self, view: _RunView) -> None:
        """An embedding run's held-out top-1 retrieval by step, and chance (1 / candidates) as a dotted line."""
        steps = [e["step"] for e in view.eval_events]
        accs = [e["retrieval_accuracy"] for e in view.eval_events]
        with self.accuracy_fig.batch_update():
            if view.eval_trace is None:
                self.accuracy_fig.add_scatter(mode="lines+markers", name=f"{view.label}", legendgroup=view.label,
                                              line={"color": view.color}, marker={"size": 6})
                view.eval_trace = self.accuracy_fig.data[-1]
                chance = view.eval_events[0]["chance"]
                if not any(t.name == "chance" for t in self.accuracy_fig.data):
                    self.accuracy_fig.add_scatter(x=[0, view.steps], y=[chance, chance], mode="lines", name="chance",
                                                  line={"color": "#888", "dash": "dot"})
            view.eval_trace.x, view.eval_trace.y = tuple(steps), tuple(accs)

    def _redraw_timeline(self, view: _RunView) -> None:
        """Show the latest step every pipeline rank has reported (step 0, warm-up, only until step 1)."""
        if not any(e["type"] == "schedule" for e in view.pipeline_events):
            return
        try:
            steps = pipeline_steps(view.pipeline_events)
            picked = self.timeline_step.value
            fig = plot_pipeline_timeline(view.pipeline_events, None if picked == "latest" else picked)
        except ValueError:  # no step complete on every rank yet
            return
        options = [("latest", "latest"), ("median over steps", "median"), *[(f"step {s}", s) for s in steps]]
        if list(self.timeline_step.options) != options:
            self.timeline_step.options = options  # keeps the value, which is still among them
        meta = fig.layout.meta
        shown = (picked, meta["step"], len(steps))
        if shown == view.timeline_step:
            return
        view.timeline_step = shown
        self.timeline_fig.data = ()
        self.timeline_fig.add_traces(list(fig.data))
        self.timeline_fig.layout.update(fig.layout.to_plotly_json(), overwrite=True)
        self.timeline_fig.layout.width = 1040
        p, m, v = meta["pp"], meta["microbatches"], meta["stages_per_rank"]
        vm = f"{v}·{m}" if v > 1 else f"{m}"
        where = "median over steps" if meta["step"] == "median" else f"at step {meta['step']}"
        self.bubble_label.value = (
            f"<b>bubble</b> {where}: measured <b>{meta['bubble_measured']:.1%}</b> "
            f"vs theory (p−1)/({'v·' if v > 1 else ''}m+p−1) = {p - 1}/({vm}+{p - 1}) = "
            f"<b>{meta['bubble_theory']:.1%}</b> (p={p}, m={m}{f', v={v}' if v > 1 else ''})")

    def _show_timeline(self) -> None:
        """Redraw the latest run's timeline for the picked step (the step dropdown's callback)."""
        if self._views:
            with self._lock:
                self._redraw_timeline(self._views[-1])

    def _redraw_experts(self, view: _RunView) -> None:
        steps = [e["step"] for e in view.moe_events if e["type"] == "moe"]
        if not steps or max(steps) == view.moe_step:
            return
        fig = plot_tokens_per_expert(view.moe_events)
        view.moe_step = fig.layout.meta["step"]
        self.experts_fig.data = ()
        self.experts_fig.add_traces(list(fig.data))
        self.experts_fig.layout.update(fig.layout.to_plotly_json(), overwrite=True)
        self.experts_fig.layout.width = 520
        self.experts_box.layout.display = ""

    def _progress_text(self, view: _RunView) -> str:
        """One line of HTML: how far rank 0 is, its latest loss and throughput, and any rank's error."""
        h = view.history.get(0)
        if h is None or not len(h):
            started = view.run.started_ranks
            if started:
                return f"{len(started)}/{view.run.nproc} rank(s) started; building the model…"
            return f"starting {view.run.nproc} rank(s): {html.escape(view.label)}"
        last = h.iloc[-1]
        text = f"step {int(last['step']) + 1}/{view.steps} · loss {last['loss']:.4f} · {last['tokens_per_s']:,.0f} tokens/s"
        if view.eval_events:
            e = view.eval_events[-1]
            text += f" · top-1 {e['retrieval_accuracy']:.3f} at step {e['step']} (chance {e['chance']:.3f})"
        cause = view.run.root_cause()
        if cause is not None and cause.rank is not None:
            text += f" · rank {cause.rank} raised {html.escape(cause.message)}"
        return text

    def _show_progress(self, view: _RunView) -> None:
        h = view.history.get(0)
        if h is not None and len(h):
            self.progress.value = min(int(h["step"].iloc[-1]) + 1, view.steps)
        self.status.value = self._progress_text(view)

    def _finish(self, view: _RunView) -> None:
        run = view.run
        status = run.status  # "stopped" also when the stop came before torchrun could report it
        elapsed = time.time() - view.launched_at
        if view is self._views[-1]:
            self._show_progress(view)
            self.progress.bar_style = {"succeeded": "success", "failed": "danger", "stopped": "warning"}.get(status, "")
            if status == "failed":
                err = run.error
                where = f"rank {err.rank}" if err.rank is not None else "the launcher"
                self._show_error(f"{where} failed", err.message, err.traceback)
                self.status.value = f"<b>failed</b> ({where}) after {elapsed:.1f} s"
            else:
                h = view.history.get(0)
                detail = f" · {self._progress_text(view)}" if h is not None and len(h) else ""
                self.status.value = f"<b>{status}</b> after {elapsed:.1f} s{detail}"
            self.launch_button.disabled, self.stop_button.disabled = False, True
        view.finished.set()

    def _show_error(self, title: str, message: str, traceback: str = "") -> None:
        body = f"<b>{html.escape(title)}</b>: {html.escape(message)}"
        if traceback:
            body += ("<pre style='white-space:pre-wrap;max-height:320px;overflow:auto;font-size:11px;"
                     f"margin:4px 0 0 0'>{html.escape(traceback)}</pre>")
        self.error_panel.value = (
            "<div style='border-left:4px solid #d62728;background:rgba(214,39,40,0.06);padding:4px 8px'>"
            f"{body}</div>"
        )
        self.error_panel.layout.display = ""

    def _hide_error(self) -> None:
        self.error_panel.value = ""
        self.error_panel.layout.display = "none"


__all__ = ["RunDashboard"]
