"""Notebook controls generated from the config fields' settings (:mod:`workbench.settings`).

One control per setting, of the kind its field asks for::

    bool                    -> Checkbox
    choices                 -> Dropdown (the canonical spellings)
    int / float             -> BoundedIntText / BoundedFloatText within the field's range
    str (a path)            -> Text ("" for None)

The help text (with the meaning of special values and of None) is the tooltip. An optional integer
(``microbatches: int | None``) shows ``None`` as the value just below its minimum (0 for ``min=1``), as
the tooltip says. :func:`read_controls` turns the controls back into field values::

    controls = setting_controls("parallel", {"tp": 2})      # {"dp_replicate": BoundedIntText, ...}
    read_controls(controls, "parallel")                     # {"dp_replicate": 1, ..., "tp": 2, ...}
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import ipywidgets as widgets

from workbench.schema import Setting, check_value, kind_of, settings_of
from workbench.settings import config_class

__all__ = ["setting_controls", "read_controls", "write_controls"]

_INT_LIMIT = 1 << 30
_STYLE = {"description_width": "initial"}
_WIDTHS = {"bool": "170px", "choices": "220px", "int": "150px", "float": "170px", "str": "300px"}


def _none_value(kind: str, s: Setting) -> Any:
    """What an optional field's None looks like in its control."""
    if kind == "str":
        return ""
    return (s.min if s.min is not None else 0) - 1 if kind == "int" else -1.0


def _tooltip(name: str, kind: str, optional: bool, s: Setting) -> str:
    parts = [s.help]
    parts += [f"{v}: {meaning}" for v, meaning in s.special.items()]
    if optional and s.none:
        parts.append(f"{_none_value(kind, s)!r}: {s.none}" if kind != "str" else f"empty: {s.none}")
    if s.off:
        parts.append(s.off)
    return f"{name}: " + "; ".join(parts)


def _control(name: str, kind: str, optional: bool, s: Setting, value: Any) -> widgets.ValueWidget:
    tooltip = _tooltip(name, kind, optional, s)
    common = {"description": name, "tooltip": tooltip, "style": _STYLE}
    if value is None and optional:
        value = _none_value(kind, s)
    if kind == "bool":
        return widgets.Checkbox(value=bool(value), indent=False, layout={"width": _WIDTHS["bool"]}, **common)
    if s.choices:
        value = next((c for c in s.choices if str(c).lower() == str(value).lower()), value)
        return widgets.Dropdown(options=list(s.choices), value=value, layout={"width": _WIDTHS["choices"]}, **common)
    if kind == "str":
        return widgets.Text(value=value, layout={"width": _WIDTHS["str"]}, **common)
    lows = [v for v in s.special if not isinstance(v, bool)] + ([s.min] if s.min is not None else [])
    if optional:
        lows.append(_none_value(kind, s))
    if kind == "int":
        lo = int(min(lows)) if lows else -_INT_LIMIT
        hi = int(s.max) if s.max is not None else _INT_LIMIT
        return widgets.BoundedIntText(value=value, min=lo, max=hi, layout={"width": _WIDTHS["int"]}, **common)
    lo = float(min(lows)) if lows else -float(_INT_LIMIT)
    hi = float(s.max) if s.max is not None else float(_INT_LIMIT)
    return widgets.BoundedFloatText(value=value, min=lo, max=hi, layout={"width": _WIDTHS["float"]}, **common)


def setting_controls(section: "str | type", values: Mapping[str, Any] | None = None, *,
                     only: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> dict[str, widgets.ValueWidget]:
    """``{field: control}`` for the settings of ``section`` (``"parallel"``, ``"train"`` or a config class).

    ``values`` sets initial values (default: the fields' defaults); ``only``/``exclude`` pick fields.
    """
    values = values or {}
    out = {}
    for f, s in settings_of(config_class(section), only, exclude):
        kind, optional = kind_of(f)
        out[f.name] = _control(f.name, kind, optional, s, values.get(f.name, f.default))
    return out


def read_controls(controls: Mapping[str, widgets.ValueWidget], section: "str | type") -> dict[str, Any]:
    """The field values of the controls that belong to ``section`` (None back where the control shows it)."""
    out = {}
    for f, s in settings_of(config_class(section)):
        if f.name not in controls:
            continue
        kind, optional = kind_of(f)
        value = controls[f.name].value
        if optional and not s.choices and kind != "bool" and value == _none_value(kind, s):
            value = None
        out[f.name] = value
    return out


def write_controls(controls: Mapping[str, widgets.ValueWidget], section: "str | type", **values: Any) -> None:
    """Set controls from field values (None shown as the tooltip says); unknown names raise TypeError, values
    outside a field's choices or range raise its one-line ValueError."""
    fields = {f.name: (f, s) for f, s in settings_of(config_class(section)) if f.name in controls}
    for name, value in values.items():
        if name not in fields:
            raise TypeError(f"unknown setting {name!r}; choose from {list(fields)}")
        f, s = fields[name]
        kind, optional = kind_of(f)
        value = check_value(name, value, kind, optional, s)  # a bounded control would clamp it silently
        controls[name].value = _none_value(kind, s) if value is None and optional else value
