"""What a view looks like without a kernel: the static HTML each view adds to its display output.

A notebook saved by JupyterLab keeps each view as a widget reference (``widget-view+json``), which only
a live kernel (or saved widget state) can draw. ``jupyter nbconvert --to html`` skips a widget whose
state was not saved and shows the output's next format: this module supplies it. :func:`view_bundle`
is the display bundle of every view: the widget, a one-line text, and ``text/html`` drawn from the
widget tree as it is now (HTML and labels as they read, each control as "name: value", tabs and
accordions as sections, each :class:`PlotView` as its figure's JSON in a ``<div class="pw-static-plot">``).

The figures need plotly.js, which a notebook output must not carry (4.8 MB each time). The exporter
``jupyter nbconvert --to workbench-html`` (:mod:`workbench.widgets.export`) inlines it once, so the exported
file draws every plot offline; a plain ``--to html`` export shows the rest of the view and, where a plot
was, its title and trace names.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets

__all__ = ["view_bundle", "static_html"]

_DRAW = ("<script>(function(){var d=document.currentScript.previousElementSibling;"
         "function draw(){var f=JSON.parse(d.querySelector('script[type=\"application/json\"]').textContent);"
         "d.querySelector('.pw-static-fallback').remove();window.Plotly.newPlot(d,f.data,f.layout,"
         "{displaylogo:false,responsive:true});}"
         "if(window.Plotly)draw();else(window.__pwStatic=window.__pwStatic||[]).push(draw);})();</script>")


def view_bundle(view: Any, **kwargs: Any) -> dict:
    """The display bundle of ``view`` (an object with ``.widget``, or a widget): the widget, ``repr``, and
    :func:`static_html` for where there is no kernel."""
    w = view if isinstance(view, widgets.Widget) else view.widget
    bundle = widgets.DOMWidget._repr_mimebundle_(w, **kwargs)
    if w is not view:
        bundle["text/plain"] = repr(view)
    bundle["text/html"] = f'<div class="pw-static">{static_html(w)}</div>'
    return bundle


def _hidden(w: Any) -> bool:
    layout = getattr(w, "layout", None)
    return isinstance(layout, widgets.Layout) and (layout.display == "none" or layout.visibility == "hidden")


def static_html(w: Any) -> str:
    """``w`` and what it contains, as static HTML (see the module docstring)."""
    from workbench.widgets.plotly_view import PlotView

    if isinstance(w, PlotView):
        return _plot(w)
    if not isinstance(w, widgets.Widget) or _hidden(w):
        return ""
    if isinstance(w, (widgets.Tab, widgets.Accordion)):
        titles = list(getattr(w, "titles", ()) or ())
        parts = []
        for i, child in enumerate(w.children):
            title = html.escape(str(titles[i] if i < len(titles) and titles[i] else f"part {i + 1}"))
            parts.append(f"<details open><summary>{title}</summary>{static_html(child)}</details>")
        return "".join(parts)
    if isinstance(w, widgets.Box):
        direction = "row" if isinstance(w, widgets.HBox) else "column"
        inner = "".join(static_html(c) for c in w.children)
        return f'<div style="display:flex;flex-direction:{direction};flex-wrap:wrap;gap:4px">{inner}</div>'
    if isinstance(w, (widgets.HTML, widgets.HTMLMath)):
        return f"<div>{w.value}</div>"  # the view wrote this HTML (escaped where it shows data)
    if isinstance(w, widgets.Label):
        return f"<div>{html.escape(str(w.value))}</div>"
    if isinstance(w, widgets.Output):
        return "".join(_output(o) for o in w.outputs)
    if isinstance(w, (widgets.Button, widgets.FileUpload)):
        return ""
    if isinstance(w, widgets.ValueWidget):
        label = html.escape(str(getattr(w, "description", "") or ""))
        value = getattr(w, "label", None) if isinstance(w, (widgets.Dropdown, widgets.ToggleButtons)) else w.value
        text = html.escape(str(value))
        return f'<span class="pw-static-control">{label + ": " if label else ""}<b>{text}</b></span>'
    return ""


def _output(o: dict) -> str:
    data = o.get("data") or {}
    if "text/html" in data:
        return str(data["text/html"])
    text = data.get("text/plain") or o.get("text") or ""
    return f"<pre>{html.escape(str(text))}</pre>" if text else ""


def _plot(fig: Any) -> str:
    """A plot's figure JSON, drawn by plotly.js where the page has it (see the module docstring)."""
    if _hidden(fig) or not fig.data:
        return ""
    title = fig.layout.title.text if fig.layout.title and fig.layout.title.text else "plot"
    names = ", ".join(html.escape(str(t.name)) for t in fig.data if t.name)[:300]
    height = int(fig.layout.height or 450)
    width = f"{int(fig.layout.width)}px" if fig.layout.width else "100%"
    payload = fig.figure.replace("</", "<\\/")  # inside <script>: no "</script>" can end it early
    return (f'<div class="pw-static-plot" style="height:{height}px;width:{width};max-width:100%">'
            f'<div class="pw-static-fallback"><i>{html.escape(str(title))}</i>'
            f'{": " + names if names else ""} (plot: export with --to workbench-html to draw it)</div>'
            f'<script type="application/json">{payload}</script></div>{_DRAW}')
