"""How core objects show themselves in a notebook, without the core importing any view.

The core (``ShardingPlan``, ``CheckpointManifest``, ``Run``...) knows only this registry. A view layer
registers one view factory per core type::

    from workbench.display import register_view
    register_view(ShardingPlan, ShardingPlanView)          # what workbench/widgets/__init__.py does

and a core class that inherits :class:`RendersInNotebook` asks the registry when IPython displays it:

    evaluate `plan` in a cell -> RendersInNotebook._ipython_display_ -> view_for(plan)
        a view is registered for type(plan) (or a base class)?  -> display(ShardingPlanView(plan))
        none, or the view layer cannot be imported (no ipywidgets/plotly) -> display(plan._repr_html_())

Loading the view layer. A user who evaluates a plan has usually not imported ``workbench.widgets``
(``import workbench`` must stay light and widget-free). So the first time an object is displayed and no
view is registered for it, the registry imports the view plug-in packages *by name*
(:data:`VIEW_PLUGINS`, ``["workbench.widgets"]`` by default; :func:`add_view_plugin` adds others, e.g.
an extension's) with :func:`importlib.import_module`. Importing a plug-in runs its ``register_view``
calls. An ImportError (ipywidgets or plotly not installed) is remembered and the static HTML is shown;
any other error in a plug-in or a view is raised, so a broken view does not pass silently. The core
never names a widget class and never imports the view layer at module level, so the import graph stays
one-way: ``widgets -> core``.
"""

from __future__ import annotations

import html
import importlib
from typing import Any, Callable

__all__ = ["register_view", "view_for", "add_view_plugin", "VIEW_PLUGINS", "RendersInNotebook"]

ViewFactory = Callable[[Any], Any]

VIEW_PLUGINS: list[str] = ["workbench.widgets"]
_views: dict[type, ViewFactory] = {}
_loaded: dict[str, bool] = {}  # plug-in name -> imported (False: ImportError, a missing optional dependency)


def register_view(cls: type, factory: ViewFactory) -> None:
    """Show instances of ``cls`` (and its subclasses) as ``factory(obj)`` in a notebook."""
    _views[cls] = factory


def add_view_plugin(module: str) -> None:
    """Import ``module`` (a package that calls :func:`register_view`) when a view is first needed."""
    if module not in VIEW_PLUGINS:
        VIEW_PLUGINS.append(module)


def _find(cls: type) -> ViewFactory | None:
    for base in cls.__mro__:
        if base in _views:
            return _views[base]
    return None


def _load_plugins() -> None:
    for name in VIEW_PLUGINS:
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
            _loaded[name] = True
        except ImportError:  # ipywidgets / plotly missing: the core's static HTML stands in
            _loaded[name] = False


def view_for(obj: Any) -> Any | None:
    """The registered view of ``obj`` (plug-ins imported on first use), or None when there is none."""
    factory = _find(type(obj))
    if factory is None:
        _load_plugins()
        factory = _find(type(obj))
    return None if factory is None else factory(obj)


class RendersInNotebook:
    """Mixin: display the registered view of ``self``, else ``self._repr_html_()`` (or its repr)."""

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        view = view_for(self)
        if view is not None:
            display(view)
        elif hasattr(self, "_repr_html_"):
            display(HTML(self._repr_html_()))
        else:
            display(HTML(f"<pre>{html.escape(repr(self))}</pre>"))
