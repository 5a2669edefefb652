"""``RunDashboard``: pick a layout, launch a run, and watch every rank train, live.

A thin view over :func:`workbench.launch` and :class:`workbench.Run`. It holds no training logic: the
Launch button calls ``launch(...)`` with the control values, and a background thread reads the run's
``events.jsonl`` through the :class:`Run` (its history, status and root cause) every ``poll_s`` seconds and
redraws::

    dash = RunDashboard(preset="tiny", nproc=2, dp_shard=2, steps=10)
    dash                     # the widget: controls, progress, every step metric of every rank, errors
    dash.launch()            # what the Launch button does; returns the Run
    dash.wait()              # block until the run ends, still updating (for headless notebooks)

The page gets at most one update per ``poll_s`` (0.25 s: four a second), whatever the step rate: each takes
every event written since the last one, and sends nothing where nothing changed. The status line and bar
follow every update; the figures, which cost a browser far more to draw, are redrawn (each in one batch) at
the page's own pace (:class:`~workbench.widgets.page_pace.PagePace`). That thread is the only one that
draws. A fast run used to be redrawn up to ten times a second, by that thread and by ``wait()`` both, faster
than the page could draw, until it fell a minute behind and its websocket timed out (issue 28). ``wait()``
in a notebook cell keeps the widgets answering (:class:`~workbench.widgets.comm_pump.CommPump`): a click on
Stop acts at once, even under Run All, where the next cells queue behind the waiting one.

Earlier runs stay in the plots, so layouts can be compared on one chart until "Clear" is pressed.
Every metric of the step events gets a figure (``STEP_METRICS``): loss and step time per rank; tokens/s,
gradient norm and learning rate, which every rank reports alike, once per run (rank 0's, "global").
Three display controls redraw every run already drawn: an EMA smoothing slider (0 = raw; above it the
smoothed line is drawn over a faint raw one, for the noisy measurements), a log-scale y toggle (loss,
gradient norm, step time) and the x axis: step, or wall-clock seconds since the run's first event.
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

import contextlib
import dataclasses
import html
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import pandas as pd

from workbench.config import PRESETS, JobConfig, ParallelConfig, TrainConfig
from workbench.settings import split_settings
from workbench.train.launcher import Run, build_job, launch, memory_shortfall
from workbench.widgets.comm_pump import CommPump
from workbench.widgets.controls import read_controls, setting_controls
from workbench.widgets.page_pace import PagePace
from workbench.widgets.dashboard_model import MEMORY_TITLES, SMOOTHED, STEP_METRICS, X_AXES, _RunView
from workbench.parallel.pipeline_bubble import pipeline_steps
from workbench.widgets.plots import (RANK_DASHES, RUN_COLORS, ema, export_pipeline_trace, plot_pipeline_timeline,
                                     plot_tokens_per_expert, run_label)
from workbench.widgets.plotly_view import PlotView
from workbench.widgets.static import view_bundle

# The training settings the dashboard shows controls for (every ParallelConfig setting gets one).
TRAIN_CONTROLS = ("data", "steps", "global_batch", "seed", "device", "init_from")
PLOT_PX, LEGEND_ROW_PX = 280, 16  # a metric figure's plot area, and what each legend entry adds above it
WAIT_TICK_S = 0.05  # how often wait() looks at the run and the page's messages: a click acts within it
STOP_DRAWN_S = 5.0  # stop() returns once the end is drawn, or after this long if the follow thread lags
PAGE_WAIT_S = 2.0  # the longest the follow thread waits for the page to draw a redraw (then: no page)
MARKERS_UP_TO = 60  # points per line drawn with markers


def _points_mode(n: int) -> str:
    """A marker per point while a line is short; past that, the line alone: a browser draws each marker as
    an element of its own, and 300 steps of markers make each redraw of the figures 2.5x slower."""
    return "lines+markers" if n <= MARKERS_UP_TO else "lines"


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


class RunDashboard:
    """Launch and watch training runs from a notebook. Evaluate the object to show it.

    ``parallel``/``train`` (configs) and the keyword shortcuts (``tp=2``, ``steps=10``: any of their
    fields) set the controls' initial values; they mean what they mean to :func:`workbench.launch`
    (``nproc`` defaults to the product of the degrees). There is a control for every ParallelConfig
    setting and for the training settings in ``TRAIN_CONTROLS``; other training settings given here are
    passed to every launch as they are. Each run gets a fresh directory under ``out_root`` (a temporary
    directory when None). ``poll_s`` is how often the view reads new events and redraws what they changed:
    at most ``1 / poll_s`` redraws a second, however fast the run writes.
    """

    def __init__(
        self,
        preset: str = "tiny",
        *,
        nproc: int | None = None,
        parallel: ParallelConfig | None = None,
        train: TrainConfig | None = None,
        out_root: str | Path | None = None,
        poll_s: float = 0.25,
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
        # The follow thread draws; the kernel's thread changes the same widgets from the controls' callbacks
        # (display controls, Clear, Launch): one at a time.
        self._lock = threading.RLock()

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
        # Pipeline-only settings follow pp: disabled (and not applied) while pp == 1.
        self.layout_controls["pp"].observe(lambda _: self._pipeline_controls(), names="value")
        self._pipeline_controls()
        self.launch_button = widgets.Button(description="Launch", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.clear_button = widgets.Button(description="Clear", icon="eraser",
                                           tooltip="remove earlier runs from the plots")
        self.launch_button.on_click(lambda _: self.launch())
        self.stop_button.on_click(lambda _: self._stop_clicked())
        self.clear_button.on_click(lambda _: self.clear())
        self.progress = widgets.IntProgress(value=0, min=0, max=c["steps"].value, description="rank 0",
                                            style=style, layout=widgets.Layout(width="320px"))
        self.status = widgets.HTML("idle")
        self.page_pace = PagePace()  # shows nothing: the page says when it has drawn a redraw (_follow)
        self.error_panel = widgets.HTML("", layout=widgets.Layout(display="none", width="100%"))
        self.metric_figs = {m.column: self._figure(m.title, m.ytitle) for m in STEP_METRICS}
        self.loss_fig, self.tps_fig = self.metric_figs["loss"], self.metric_figs["tokens_per_s"]
        self.grad_norm_fig, self.lr_fig = self.metric_figs["grad_norm"], self.metric_figs["lr"]
        self.step_time_fig = self.metric_figs["step_time_s"]
        self.lr_fig.layout.yaxis.exponentformat = "e"  # 3e-4, not plotly's SI "300µ"
        self.memory_fig = self._figure("Memory per step", "MiB per rank")
        self.accuracy_fig = self._figure("Held-out top-1 retrieval", "accuracy")
        self.accuracy_fig.layout.yaxis.range = [0, 1]
        self.accuracy_box = widgets.VBox([self.accuracy_fig], layout=widgets.Layout(display="none"))
        # How the metric figures draw every run: they redraw what is on screen, nothing is relaunched.
        self.smoothing = widgets.FloatSlider(
            value=0.0, min=0.0, max=0.99, step=0.01, readout_format=".2f", continuous_update=False,
            description="smoothing (EMA)", style=style, layout=widgets.Layout(width="320px"),
            tooltip="0: raw; w > 0 draws s_t = w s_(t-1) + (1-w) x_t over a faint raw line "
                    "(loss, tokens/s, grad norm, step time)")
        self.log_y = widgets.Checkbox(value=False, description="log y (loss, grad norm, step time)", indent=False,
                                      layout=widgets.Layout(width="260px"))
        self.x_axis = widgets.ToggleButtons(options=[("step", "step"), ("wall-clock s", "time")], value="step",
                                            description="x axis", style=style,
                                            tooltips=["training step", X_AXES["time"]])
        for control in (self.smoothing, self.log_y, self.x_axis):
            control.observe(self._apply_display, names="value")
        # Shown only for the runs that write their events: pipeline (pp > 1) and mixture-of-experts runs.
        self.bubble_label = widgets.HTML("")
        self.timeline_fig = PlotView(layout={"height": 260, "width": 1040, "title": "Pipeline timeline"})
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
        self.experts_fig = PlotView(layout={"height": 340, "width": 520, "title": "Tokens per expert"})
        self.experts_box = widgets.VBox([self.experts_fig], layout=widgets.Layout(display="none"))

        wrap = widgets.Layout(flex_flow="row wrap")
        self.widget = widgets.VBox([
            widgets.HBox([c["task"], c["preset"], *self.train_controls.values()], layout=wrap),
            widgets.HBox([c["nproc"], *self.layout_controls.values()], layout=wrap),
            widgets.HBox([self.launch_button, self.stop_button, self.clear_button, self.progress, self.status,
                          self.page_pace]),
            self.error_panel,
            widgets.HBox([self.smoothing, self.log_y, self.x_axis], layout=wrap),
            widgets.HBox([self.loss_fig, self.tps_fig, self.memory_fig, self.grad_norm_fig, self.lr_fig,
                          self.step_time_fig, self.accuracy_box], layout=wrap),
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

    def _pipeline_controls(self) -> None:
        off = self.layout_controls["pp"].value == 1
        for name in ("pp_schedule", "microbatches"):
            control = self.layout_controls.get(name)
            if control is not None:
                control.disabled = off
                tip = (control.tooltip or "").removesuffix(" (applies when pp > 1)")
                control.tooltip = tip + (" (applies when pp > 1)" if off else "")

    def _export_trace_clicked(self) -> None:
        try:
            path = self.export_trace()
        except ValueError as err:
            self.trace_status.value = f"<span style='color:#b00'>{html.escape(str(err))}</span>"
            return
        self.trace_status.value = f"wrote <code>{html.escape(str(path))}</code> (open in ui.perfetto.dev)"

    # -- what the view shows ----------------------------------------------------------------------
    @staticmethod
    def _figure(title: str, ytitle: str) -> PlotView:
        fig = PlotView(layout={
            # The title at the very top, then the legend (one run or rank per row), then the plot: the
            # legend pushes the plot down (_fit_legend) instead of running over the title or the x axis.
            "title": {"text": title, "yref": "container", "y": 0.99, "yanchor": "top", "x": 0.02, "xanchor": "left"},
            "xaxis": {"title": "step"}, "yaxis": {"title": ytitle},
            "width": 520, "margin": {"l": 60, "r": 10, "b": 40, "autoexpand": True},
            "legend": {"orientation": "v", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0,
                       "font": {"size": 10}},
        })
        RunDashboard._fit_legend(fig)
        return fig

    @staticmethod
    def _fit_legend(fig: PlotView) -> None:
        """Room above the plot for the title and one legend row per entry; the plot keeps its height."""
        rows = sum(1 for t in fig.data if t.showlegend is not False)
        top = 45 + LEGEND_ROW_PX * rows
        fig.layout.margin.t, fig.layout.height = top, PLOT_PX + top + 40

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return view_bundle(self, **kwargs)

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
        if out.get("pp") == 1 and "microbatches" in out:  # its control is disabled: it does not apply
            out["microbatches"] = None
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
            # The bar and the plots below still show the last run that did start: say so, in red.
            shown = f"; the plots show {html.escape(self._views[-1].label)}" if self._views else ""
            self.status.value = f"<span style='color:#d62728'>not launched: invalid configuration{shown}</span>"
            self.progress.bar_style = ""
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
            self.runs.append(run)
            self._views.append(view)
            for earlier in self._views[:-1]:  # now wide, faint bands (_restyle)
                self._restyle(earlier)
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
        """Stop the current run (every rank); returns once its ranks have exited and the end is drawn."""
        view = self._views[-1] if self._views else None
        if view is None or view.run.done:
            return self.run
        self._show_stopping(view)
        view.run.stop()
        view.wake.set()  # the follow thread draws the end now, not at its next poll
        view.finished.wait(STOP_DRAWN_S)
        return view.run

    def _stop_clicked(self) -> None:
        """The Stop button: "stopping" at once, and the ranks stopped on a thread of their own, so the kernel
        (or the wait() that handed it the click) goes on answering the page while torchrun shuts down."""
        view = self._views[-1] if self._views else None
        if view is None or view.run.done:
            return
        self._show_stopping(view)
        threading.Thread(target=self.stop, daemon=True, name="RunDashboard-stop").start()

    def _show_stopping(self, view: _RunView) -> None:
        with self._lock:
            view.stopping = True
            self.stop_button.disabled = True
            self.status.value = "stopping…"

    def wait(self, timeout: float | None = None, raise_on_error: bool = False) -> Run:
        """Block until the current run ends, updating the widgets meanwhile; returns the Run.

        In a notebook cell the widgets go on answering: a click on Stop or a display control acts at once,
        and the cells queued behind this one (Run All) run after it, in order.
        A failure is shown in the error panel; ``raise_on_error=True`` also raises :class:`RunFailed`.
        On timeout the run is stopped and TimeoutError is raised (as :meth:`Run.wait` does).
        """
        if not self._views:
            raise RuntimeError("nothing was launched; see the error panel" if self.error_panel.value
                               else "nothing was launched; call launch() first")
        view = self._views[-1]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # The follow thread draws; this thread only waits. In a notebook cell it also hands the page's
            # widget messages (a click on Stop) to the kernel meanwhile, which would otherwise hold them until
            # the cell ends; in a script or an older ipykernel, CommPump.here() is None and this just waits.
            with CommPump.here() or contextlib.nullcontext() as pump:
                while not view.finished.is_set():
                    if deadline is not None and time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"run in {view.run.run_dir} did not finish within {timeout} s; "
                                           "it was stopped")
                    if pump is not None:
                        pump.pump(WAIT_TICK_S)
                    else:
                        view.finished.wait(WAIT_TICK_S)
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
                    v.traces.clear()
                    v.smoothed.clear()
                    v.eval_trace = None
                    v.shown = False
            kept_evals = [v.eval_trace for v in keep if v.eval_trace is not None]
            self.accuracy_fig.data = [t for t in self.accuracy_fig.data
                                      if any(t is k for k in kept_evals) or (kept_evals and t.name == "chance")]
            kept = [t for v in keep for t in (*v.traces.values(), *v.smoothed.values())]
            for fig in (*self.metric_figs.values(), self.memory_fig):
                fig.data = [t for t in fig.data if any(t is k for k in kept)]
                self._fit_legend(fig)
            self._fit_legend(self.accuracy_fig)

    # -- following a run --------------------------------------------------------------------------
    def _follow(self, view: _RunView) -> None:
        """The one thread that draws a run: every ``poll_s`` (at once when Stop wakes it) it takes the events
        written since its last look and shows what they changed: at most ``1 / poll_s`` updates a second
        reach the page, however fast the run writes; its end is drawn as soon as the process has exited."""
        reported = False
        while not view.finished.is_set():
            view.wake.clear()  # a wake during this redraw makes the next one come at once
            try:
                # The status line follows every poll; the figures, which cost a browser far more to draw, go
                # at the page's pace: once it has drawn the last ones and had as long again to itself (for
                # a click on Stop). Without a page, or with a fast one, poll_s sets the pace of both.
                if self._pump(view, figures=self.page_pace.ready(PAGE_WAIT_S)):
                    self.page_pace.sent()
            except Exception as exc:  # a view bug must not pass silently, nor kill the run
                if not reported:
                    self.status.value = f"dashboard update failed: {html.escape(repr(exc))}"
                    reported = True
                if view.run.done:  # nothing more will come; don't spin forever
                    view.finished.set()
            if not view.run.done:  # once it is, the next look drains it and draws the end, at once
                view.wake.wait(self.poll_s)

    def _pump(self, view: _RunView, figures: bool = True) -> bool:
        """Read the events written since the last call and show them (the follow thread's): the progress
        bar and status always, the figures only if ``figures`` (or the run is over); until then what the
        events touched waits in ``view.pending_*``. True if figures were redrawn."""
        with self._lock:
            if view.finished.is_set():
                return False
            done = view.run.done  # checked before reading, so a finished run's last events are drained
            events = view.run.events_since(view.seen)
            view.seen += len(events)
            if view.t0 is None and events:
                view.t0 = events[0].get("time")
            for e in events:
                kind, rank = e.get("type"), e.get("rank")
                if kind == "step":
                    view.pending_steps.add(rank)
                if kind in ("step", "memory"):
                    view.pending_memory.add(rank)
                if kind in ("pipeline", "schedule"):
                    view.pipeline_events.append(e)
                    view.pending_kinds.add("schedule")
                elif kind == "moe" or (kind == "step" and "aux_loss" in e):
                    view.moe_events.append(e)
                    view.pending_kinds.add("moe")
                elif kind == "eval" and rank == 0:
                    view.eval_events.append(e)
                    view.pending_kinds.add("eval")
            if view.pending_steps:
                view.history = view.run.history()  # what the status line and the figures read
            drew = (figures or done) and bool(view.pending_steps or view.pending_memory or view.pending_kinds)
            if drew:
                self._redraw_pending(view)
            if view is self._views[-1]:
                self._show_progress(view)
            if done:
                self._finish(view)
            return drew

    def _redraw_pending(self, view: _RunView) -> None:
        """Redraw the figures that the events read since their last redraw touched (``view.history`` is new)."""
        touched, memory, kinds = view.pending_steps, view.pending_memory, view.pending_kinds
        view.pending_steps, view.pending_memory, view.pending_kinds = set(), set(), set()
        if touched:
            self._redraw(view, touched)
        if memory:
            self._redraw_memory(view, memory)
        if view is self._views[-1] and "schedule" in kinds:
            self._redraw_timeline(view)
        if view is self._views[-1] and "moe" in kinds:
            self._redraw_experts(view)
        if "eval" in kinds:
            self._redraw_accuracy(view)

    # -- drawing a run's metrics ------------------------------------------------------------------
    def _x(self, view: _RunView, frame: Any) -> tuple:
        """The x values of a frame's rows (``step`` and ``time`` columns) on the chosen x axis."""
        if self.x_axis.value == "time":
            time_ = pd.to_numeric(frame["time"], errors="coerce")  # a row without a time is not drawn
            t0 = view.t0 if view.t0 is not None else time_.min()
            return tuple((time_ - t0).tolist())
        return tuple(frame["step"].tolist())

    def _line(self, view: _RunView, fig: PlotView, key: tuple[str, int], name: str,
              smoothed: bool = False, **kwargs: Any) -> Any:
        """The trace of ``key`` (its EMA if ``smoothed``) in ``fig``, added and styled the first time."""
        lines = view.smoothed if smoothed else view.traces
        if key not in lines:
            rank = key[1]
            fig.add_scatter(mode="lines" if smoothed else "lines+markers", legendgroup=view.label,
                            name=f"{name} (EMA)" if smoothed else name, showlegend=not smoothed,
                            line={"color": view.color, "dash": RANK_DASHES[rank % len(RANK_DASHES)]},
                            marker={"size": 4}, **kwargs)
            lines[key] = fig.data[-1]
            self._style(view, key, lines[key], smoothed)
            if not smoothed:
                self._fit_legend(fig)
        return lines[key]

    def _style(self, view: _RunView, key: tuple[str, int], trace: Any, smoothed: bool) -> None:
        """The latest run in full; earlier runs as wide, faint bands, so a new curve that lands on one stays
        visible. While smoothing is on, a smoothed metric's raw line is fainter still, under its EMA."""
        latest = view is self._views[-1]
        faint = not smoothed and key[0] in SMOOTHED and self.smoothing.value > 0
        trace.line.width = 2 if latest else 6
        trace.opacity = (1.0 if latest else 0.35) * (0.25 if faint else 1.0)

    def _restyle(self, view: _RunView) -> None:
        for key, trace in view.traces.items():
            self._style(view, key, trace, smoothed=False)
        for key, trace in view.smoothed.items():
            self._style(view, key, trace, smoothed=True)
        if view.eval_trace is not None:
            self._style(view, ("eval", 0), view.eval_trace, smoothed=False)

    def _redraw(self, view: _RunView, ranks: set[int]) -> None:
        """Every step metric of ``ranks`` (the whole job's metrics from rank 0 only) from ``view.history``."""
        weight = self.smoothing.value
        for metric in STEP_METRICS:
            fig = self.metric_figs[metric.column]
            with fig.batch_update():
                for rank in sorted(ranks if metric.per_rank else ranks & {0}):
                    h = view.history.get(rank)
                    if h is None or metric.column not in h.columns:  # e.g. a run written before the field was
                        continue
                    key = (metric.column, rank)
                    name = f"{view.label} r{rank}" if metric.per_rank else view.label
                    x, y = self._x(view, h), h[metric.column].tolist()
                    raw = self._line(view, fig, key, name)
                    raw.x, raw.y, raw.mode = x, tuple(y), _points_mode(len(y))
                    if weight > 0 and metric.smooth:
                        line = self._line(view, fig, key, name, smoothed=True)
                        line.x, line.y = x, tuple(ema(y, weight))

    def _redraw_memory(self, view: _RunView, ranks: set[int] | None = None) -> None:
        """Each rank's memory per step, from ``Run.memory_history`` (its ``source`` names the title)."""
        memory = view.run.memory_history()
        if memory.empty:
            return
        drawn = memory if ranks is None else memory[memory["rank"].isin(ranks)]
        with self.memory_fig.batch_update():
            for rank, h in drawn.groupby("rank"):
                trace = self._line(view, self.memory_fig, ("memory", int(rank)), f"{view.label} r{int(rank)}",
                                   hovertemplate="step %{customdata}: %{y:.1f} MiB (%{text})<extra></extra>")
                trace.x = self._x(view, h)
                trace.y = tuple((h["peak_bytes"] / 2**20).tolist())
                trace.mode = _points_mode(len(h))
                trace.text = tuple(h["source"].tolist())
                trace.customdata = tuple(h["step"].tolist())
            if view is self._views[-1]:
                sources = set(memory["source"])
                source = "memory" if "memory" in sources else memory["source"].iloc[-1]
                self.memory_fig.layout.title.text = MEMORY_TITLES[source]

    def _redraw_accuracy(self, view: _RunView) -> None:
        """An embedding run's held-out top-1 retrieval by step, and chance (1 / candidates) as a dotted line."""
        frame = pd.DataFrame({"step": [e["step"] for e in view.eval_events],
                              "time": [e.get("time", float("nan")) for e in view.eval_events]})
        accs = [e["retrieval_accuracy"] for e in view.eval_events]
        with self.accuracy_fig.batch_update():
            if view.eval_trace is None:
                self.accuracy_fig.add_scatter(mode="lines+markers", name=f"{view.label}", legendgroup=view.label,
                                              line={"color": view.color}, marker={"size": 6})
                view.eval_trace = self.accuracy_fig.data[-1]
                self._style(view, ("eval", 0), view.eval_trace, smoothed=False)
                chance = view.eval_events[0]["chance"]
                if not any(t.name == "chance" for t in self.accuracy_fig.data):
                    self.accuracy_fig.add_scatter(x=[0, view.steps], y=[chance, chance], mode="lines", name="chance",
                                                  line={"color": "#888", "dash": "dot"})
                self._fit_legend(self.accuracy_fig)
            view.eval_trace.x, view.eval_trace.y = self._x(view, frame), tuple(accs)
            # chance spans the runs' x range: their steps, or their seconds on the wall-clock axis
            chance = next(t for t in self.accuracy_fig.data if t.name == "chance")
            shown = [v for v in self._views if v.eval_trace is not None]
            end = (max(max(v.eval_trace.x, default=0) for v in shown) if self.x_axis.value == "time"
                   else max(v.steps for v in shown))
            chance.x = (0, end)

    def _apply_display(self, _change: Any = None) -> None:
        """The display controls' callback: axis type and title, then every shown run redrawn in place."""
        with self._lock:
            for fig in (*self.metric_figs.values(), self.memory_fig, self.accuracy_fig):
                fig.layout.xaxis.title.text = X_AXES[self.x_axis.value]
            for metric in STEP_METRICS:
                if metric.log:
                    self.metric_figs[metric.column].layout.yaxis.type = "log" if self.log_y.value else "linear"
            if self.smoothing.value == 0:  # raw again: the EMA lines go
                gone = [t for v in self._views for t in v.smoothed.values()]
                for fig in self.metric_figs.values():
                    fig.data = [t for t in fig.data if not any(t is g for g in gone)]
                for v in self._views:
                    v.smoothed.clear()
            for view in self._views:
                if not view.shown:
                    continue
                if view.history:
                    self._redraw(view, set(view.history))
                if view.traces:
                    self._redraw_memory(view)
                if view.eval_events:
                    self._redraw_accuracy(view)
                self._restyle(view)

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
            f"{html.escape(view.label)}: <b>bubble</b> {where}: measured <b>{meta['bubble_measured']:.1%}</b> "
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
        text = self._progress_text(view)
        self.status.value = f"stopping… · {text}" if view.stopping else text

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
