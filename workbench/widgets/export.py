"""``jupyter nbconvert --to workbench-html``: the HTML export with every view's plots drawn, offline.

Each view's display output carries a static copy of itself (:mod:`workbench.widgets.static`), with its
plots as figure JSON. This exporter is nbconvert's HTML exporter, preferring those static copies to widget references,
plus plotly.js, inlined once in the
page's head (the file the plotly package ships; nothing is fetched), and a script at the end that
draws every plot. Registered under the ``nbconvert.exporters`` entry point in pyproject.toml.
"""

from __future__ import annotations

from typing import Any

from nbconvert.exporters import HTMLExporter

from workbench.widgets.plotly_view import plotly_js

__all__ = ["StaticHTMLExporter"]


class StaticHTMLExporter(HTMLExporter):
    """nbconvert's HTML export, with plotly.js inlined once so the views' static plots draw."""

    export_from_notebook = "HTML, plots drawn (workbench)"

    @property
    def default_config(self) -> Any:
        # A view's static copy (text/html) before its widget reference: drawn from the notebook itself,
        # where the widget would need saved widget state and a widget manager fetched from a CDN.
        c = super().default_config.copy()
        order = list(c.NbConvertBase.display_data_priority)
        order.remove("text/html")
        order.insert(order.index("application/vnd.jupyter.widget-view+json"), "text/html")
        c.NbConvertBase.display_data_priority = order
        return c

    def from_notebook_node(self, nb: Any, resources: Any = None, **kw: Any) -> tuple[str, Any]:
        output, resources = super().from_notebook_node(nb, resources, **kw)
        if "pw-static-plot" in output:
            script = plotly_js().replace("</script", "<\\/script")
            flush = ("<script>(window.__pwStatic||[]).forEach(function(f){f()});"
                     "window.__pwStatic={push:function(f){f()}};</script>")
            # nbconvert's template loads require.js: plotly.js is UMD and would register with it instead of
            # setting window.Plotly, so it runs where `define`, `module` and `exports` are undefined.
            script = f"(function(define, module, exports){{{script}\n}})();"
            output = output.replace("</head>", f"<script>{script}</script>\n</head>", 1)
            output = output.replace("</body>", f"{flush}\n</body>", 1)
        return output, resources
