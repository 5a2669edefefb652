"""``PlotView``: a plotly figure that is also a widget, and draws every time.

plotly's ``go.FigureWidget`` keeps the figure it was built with as its widget state and sends every later
change as a one-off message. A view that renders after a message went by, a second view of the same
figure, or the views JupyterLab rebuilds after a page reload therefore draw from the state alone: empty
axes, with the traces only in the kernel (issue 28). ``PlotView`` keeps the *whole* figure in its state
(one JSON string, ``figure``), so whatever draws it draws all of it:

    fig = PlotView(layout={"height": 300})
    with fig.batch_update():              # many edits, one state change
        fig.add_scatter(y=[1, 3, 2, 4])
        fig.layout.title = "loss"
    fig                                   # or put it in a VBox, like any widget

It is a ``go.Figure`` (every ``add_*``/``update_*``/``for_each_trace``/``write_html`` works) and an
``anywidget.AnyWidget``. Each edit outside ``batch_update()`` sends the figure once; inside it, the whole
batch sends once at the end. ``trace.on_click`` callbacks fire for clicks in the browser.

The front end (``plotly_view.js``, a few KB) loads plotly.js once per page from the jupyter_server
extension's ``workbench/static/plotly.min.js`` route (``workbench.jupyter.handlers``), the file the
plotly package ships, so nothing is fetched from the internet and the 4.8 MB bundle is not part of each
widget's state.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import anywidget
import plotly.graph_objects as go
import plotly.io as pio
import traitlets
from plotly.callbacks import Points
from plotly.offline import get_plotlyjs_version

__all__ = ["PlotView", "PLOTLY_ROUTE", "plotly_js"]

# Served by workbench.jupyter.handlers; the version in the query string lets the browser cache it for good.
PLOTLY_ROUTE = "workbench/static/plotly.min.js"


def plotly_js() -> str:
    """The plotly.js the plotly package ships (what the server route serves and HTML exports inline)."""
    import plotly

    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


class PlotView(go.Figure, anywidget.AnyWidget):
    """A ``go.Figure`` whose widget state is the whole figure (see the module docstring)."""

    _esm = Path(__file__).with_name("plotly_view.js")
    figure = traitlets.Unicode("{}").tag(sync=True)
    config = traitlets.Dict().tag(sync=True)  # plotly.js config (e.g. {"displayModeBar": False})
    plotly_src = traitlets.Unicode(f"{PLOTLY_ROUTE}?v={get_plotlyjs_version()}").tag(sync=True)

    def __init__(self, data: Any = None, layout: Any = None, frames: Any = None, skip_invalid: bool = False,
                 **kwargs: Any):
        self._sync_lock = threading.RLock()
        self._hold = 0  # open batch_update() contexts
        self._dirty = False  # an edit inside them, not sent yet
        self._ready = False  # the figure is not sent until go.Figure.__init__ has built it
        super().__init__(data, layout, frames, skip_invalid, **kwargs)
        self._ready = True
        self.on_msg(self._on_frontend_msg)
        self._send_figure()

    # -- keeping the state whole ------------------------------------------------------------------
    def _send_figure(self) -> None:
        if not self._ready:
            return
        with self._sync_lock:
            if self._hold:
                self._dirty = True
                return
            self._dirty = False
            self.figure = pio.to_json({"data": self._data, "layout": self._layout}, validate=False)

    @contextmanager
    def batch_update(self) -> Iterator[None]:
        """Edits inside are sent as one state change when the outermost batch ends."""
        with self._sync_lock:
            self._hold += 1
        try:
            with super().batch_update():
                yield
        finally:
            with self._sync_lock:
                self._hold -= 1
                send = self._hold == 0 and self._dirty
            if send:
                self._send_figure()

    # go.Figure calls these after every edit (no-ops there; FigureWidget sends deltas). Here each one
    # sends the figure whole, or marks it changed inside a batch: edits of traces' and layout's properties
    # there reach _send_update_msg once, when go.Figure's batch ends.
    def _send_addTraces_msg(self, *args: Any, **kwargs: Any) -> None:
        self._send_figure()

    _send_moveTraces_msg = _send_deleteTraces_msg = _send_restyle_msg = _send_addTraces_msg
    _send_relayout_msg = _send_update_msg = _send_animate_msg = _send_addTraces_msg

    # -- from the page ----------------------------------------------------------------------------
    def _on_frontend_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        by_trace: dict[int, dict[str, list]] = {}
        for p in content.get("points") or []:
            try:
                t, i = int(p["trace"]), int(p["index"])
            except (KeyError, TypeError, ValueError):
                continue
            if 0 <= t < len(self.data):
                d = by_trace.setdefault(t, {"point_inds": [], "xs": [], "ys": []})
                d["point_inds"].append(i)
                d["xs"].append(p.get("x"))
                d["ys"].append(p.get("y"))
        for t, d in by_trace.items():
            trace = self.data[t]
            trace._dispatch_on_click(Points(trace_name=trace.name, trace_index=t, **d), None)

    # -- display: the widget, never plotly's renderers ----------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from workbench.widgets.static import view_bundle

        return view_bundle(self, **kwargs)

    # go.Figure's _ipython_display_ would show it through plotly's renderers; without one, IPython uses the
    # bundle above (a method calling display(self) here would recurse).
    _ipython_display_ = None

    def show(self, *args: Any, **kwargs: Any) -> None:
        from IPython.display import display

        display(self)

    def __repr__(self) -> str:
        return f"PlotView({len(self.data)} traces)"
