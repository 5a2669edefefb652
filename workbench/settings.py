"""Settings: how a config field is declared, and everything generated from that one declaration.

A setting is a field of a config dataclass (:class:`~workbench.config.ParallelConfig`,
:class:`~workbench.config.TrainConfig`, :class:`~workbench.config.ModelConfig`) declared with
:func:`setting`, which keeps a :class:`Setting` in the field's metadata::

    tp: int = setting(1, "tensor-parallel degree", min=1)
    pp_schedule: str = setting("1F1B", "pipeline schedule", choices=PP_SCHEDULES)
    sequence_parallel: bool = setting(False, "sequence parallel (needs tp > 1)", flag="--sp")

Everything else is generated from it, so a new setting is one edit with one default everywhere:

- :func:`check`: each value's type, range and choices (one-line ``ValueError``), called by the
  dataclasses' ``__post_init__``; choices match case-insensitively and are stored in their canonical
  spelling (``pp_schedule="1f1b"`` becomes ``"1F1B"``).
- :func:`add_arguments` / :func:`from_args`: the argparse groups of ``workbench train``, ``plan`` and
  ``ckpt plan-load``, and the config objects back from the parsed arguments.
- :func:`parse_settings` / :func:`parse_layout`: text layouts, ``"dp_shard=2,tp=2,sp,pp_schedule=1f1b"``
  or ``"--dp-shard 2 --tp 2 --sp"``.
- :func:`make_configs`: keyword shortcuts (``launch("tiny", tp=2, steps=20)``) routed to the configs.
- ``workbench.widgets.controls``: the notebook controls (the view layer; the core never imports it).
- :func:`bounded`, :func:`ranks`, :func:`seconds`, :func:`output_dir`: argparse types for the flags outside
  the configs (``--nproc``, ``--timeout``, ``--bins``, ``--out``), checked like a setting at parse time.

Config classes are looked up by section name (``"parallel"``, ``"train"``, ``"model"``: the fields of
``JobConfig``) in :mod:`workbench.config` each time, never captured at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Iterable, Mapping

from workbench.schema import (_FALSE, _TRUE, METADATA_KEY, Setting, bounded, check, kind_of,  # noqa: F401
                              seconds, setting, settings_of)

SECTIONS = {"parallel": "ParallelConfig", "train": "TrainConfig", "model": "ModelConfig"}

__all__ = [
    "Setting",
    "setting",
    "check",
    "config_class",
    "settings_of",
    "add_arguments",
    "from_args",
    "given",
    "parse_value",
    "parse_settings",
    "parse_layout",
    "split_settings",
    "make_configs",
    "bounded",
    "ranks",
    "seconds",
    "output_dir",
]

def config_class(section: "str | type") -> type:
    """``"parallel"`` -> ParallelConfig (looked up in workbench.config now); a class is returned as is."""
    if isinstance(section, type):
        return section
    from workbench import config

    try:
        return getattr(config, SECTIONS[section])
    except KeyError:
        raise ValueError(f"unknown config section {section!r}; choose one of {list(SECTIONS)}") from None


def _sections(sections: "str | type | Iterable[str | type]") -> list[type]:
    if isinstance(sections, (str, type)):
        sections = [sections]
    return [config_class(s) for s in sections]


def _fields(sections, only=None, exclude=()) -> list[tuple[dataclasses.Field, Setting]]:
    return [fs for cls in _sections(sections) for fs in settings_of(cls, only, exclude)]


# --------------------------------------------------------------------------------------------------
# argparse
# --------------------------------------------------------------------------------------------------


def _choice_type(choices: tuple, kind: str):
    def convert(text: str) -> Any:
        for c in choices:
            if str(c).lower() == text.lower():
                return c
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(map(str, choices))}; any case)")

    convert.__name__ = kind  # argparse names the type in "invalid <type> value" messages
    return convert


def add_arguments(parser: argparse.ArgumentParser, sections: "str | type | Iterable[str | type]", *,
                  only: Iterable[str] | None = None, exclude: Iterable[str] = (), given_only: bool = False,
                  help: Mapping[str, str] | None = None) -> list[str]:
    """Add the settings of ``sections`` (e.g. ``("parallel", "train")``) to ``parser``, in their groups.

    Each field becomes its flag (``--dp-shard``, plus aliases like ``--sp``) with ``dest`` the field
    name. ``given_only``: the default is left out of the namespace, so :func:`from_args` sees only what
    was typed (for commands whose defaults come from elsewhere). ``help`` replaces a field's help text on
    this command. Returns the field names added.
    """
    groups: dict[str, Any] = {}
    names = []
    for f, s in _fields(sections, only, exclude):
        if not s.cli:
            continue
        owner = next(c for c in _sections(sections) if f in dataclasses.fields(c))
        title = s.group or getattr(owner, "settings_group", owner.__name__)
        group = groups.get(title)
        if group is None:
            group = groups[title] = parser.add_argument_group(title)
        kind, optional = kind_of(f)
        default = f.default
        text = (help or {}).get(f.name) or s.describe(default)
        kw: dict[str, Any] = {"dest": f.name, "help": text,
                              "default": argparse.SUPPRESS if given_only else default}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
        else:
            if s.choices:
                kw["type"] = _choice_type(s.choices, kind)
                kw["choices"] = list(s.choices)
            else:
                kw["type"] = {"int": int, "float": float, "str": str}[kind]
            if s.const is not None:
                kw["nargs"], kw["const"] = "?", s.const
            if s.metavar:
                kw["metavar"] = s.metavar
        group.add_argument(*s.flags(f.name), **kw)
        names.append(f.name)
    return names


def ranks(name: str, min: int = 1):
    """An argparse ``type`` for a count or number of ranks (``--nproc``, ``--rank``): an integer from ``min``
    to the world-size limit (``workbench.config.MAX_RANKS``)."""
    from workbench.config import MAX_RANKS, MAX_RANKS_WHY

    return bounded("int", name, min=min, limit=MAX_RANKS, limit_why=MAX_RANKS_WHY)


def output_dir(text: str) -> str:
    """An argparse ``type`` for ``--out DIR``: refused at parse time, before any work, when the path or one
    of its parents is an existing file (whether it can be written is the job's own check)."""
    from pathlib import Path

    p = Path(text)
    for q in (p, *p.parents):
        if q.exists() and not q.is_dir():
            what = "is" if q == p else f"lies under {q}, which is"
            raise argparse.ArgumentTypeError(f"{text}: {what} a file, not a directory; pass a directory path "
                                             "(new or existing)")
        if q.exists():
            break
    return text


def given(args: argparse.Namespace, section: "str | type") -> dict[str, Any]:
    """``{field: value}`` for the settings of ``section`` present in parsed arguments."""
    return {f.name: getattr(args, f.name) for f, _ in settings_of(config_class(section)) if hasattr(args, f.name)}


def from_args(args: argparse.Namespace, section: "str | type", base: Any = None) -> Any:
    """The config of ``section`` from parsed arguments (fields not on the command line keep ``base``'s)."""
    values = given(args, section)
    return dataclasses.replace(base, **values) if base is not None else config_class(section)(**values)


# --------------------------------------------------------------------------------------------------
# Text layouts and keyword shortcuts
# --------------------------------------------------------------------------------------------------


def _keys(fields: list[tuple[dataclasses.Field, Setting]]) -> dict[str, dataclasses.Field]:
    """Every spelling of every setting: field name, flag and aliases, without dashes, lower case."""
    keys = {}
    for f, s in fields:
        keys[f.name.lower()] = f
        for flag in s.flags(f.name):
            keys[flag.lstrip("-").replace("-", "_").lower()] = f
    return keys


def _known(fields: list[tuple[dataclasses.Field, Setting]]) -> str:
    parts = []
    for f, s in fields:
        short = [fl.lstrip("-").replace("-", "_") for fl in s.flags(f.name)]
        short = [k for k in short if k != f.name]
        parts.append(f.name + (f" ({', '.join(short)})" if short else ""))
    return ", ".join(parts)


def parse_value(f: dataclasses.Field, text: str, where: str = "") -> Any:
    """Text -> the field's type: ints, floats, true/false, ``none`` for optional fields, choices any case."""
    s: Setting = f.metadata[METADATA_KEY]
    kind, optional = kind_of(f)
    prefix = f"{where}: " if where else ""
    if optional and text.lower() in ("none", "null"):
        return None
    if s.choices:
        for c in s.choices:
            if str(c).lower() == text.lower():
                return c
        raise ValueError(f"{prefix}{f.name}={text!r} is unknown; choose {s.choose} {list(s.choices)}")
    if kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{prefix}{f.name}={text!r} is not true or false; write e.g. '{f.name}=true'")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{prefix}{f.name}={text!r} is not an integer; write e.g. 'dp_shard=2,tp=2'") from None
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{prefix}{f.name}={text!r} is not a number; write e.g. '{f.name}=0.5'") from None
    return text


def parse_settings(text: str, sections: "str | type | Iterable[str | type]" = "parallel", *,
                   what: str = "layout") -> dict[str, Any]:
    """``"dp_shard=2,tp=2,sp,pp_schedule=1f1b"`` or ``"--dp-shard 2 --tp 2 --sp"`` -> {field: value}.

    Keys are field names or their flags (``sp``, ``dp-shard``); a bare boolean key means true and
    ``no_sp`` / ``--no-sp`` false. Unknown keys and bad values are one ValueError listing the known keys.
    """
    fields = _fields(sections)
    keys = _keys(fields)
    where = f"{what} {text!r}"
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    values: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i].lstrip("-")
        i += 1
        name, eq, val = tok.partition("=")
        key = name.replace("-", "_").lower()
        negated = False
        if key not in keys and key.startswith("no_") and key[3:] in keys:
            key, negated = key[3:], True
        f = keys.get(key)
        if f is None:
            raise ValueError(f"{where}: unknown setting {name!r}; known keys are {_known(fields)}")
        kind, _ = kind_of(f)
        if kind == "bool" and not eq:
            values[f.name] = not negated
            continue
        if negated:
            raise ValueError(f"{where}: 'no_' applies to true/false settings, not {f.name}")
        if not eq:
            if i >= len(tokens):
                raise ValueError(f"{where}: {f.name} needs a value; write e.g. '{f.name}=2'")
            val = tokens[i]
            i += 1
        values[f.name] = parse_value(f, val, where)
    return values


def parse_layout(text: str) -> Any:
    """A ParallelConfig from text: ``"dp_shard=2,tp=2,sp"``; unset fields keep their defaults."""
    return config_class("parallel")(**parse_settings(text, "parallel"))


def split_settings(settings: Mapping[str, Any], sections: "Iterable[str]" = ("parallel", "train"), *,
                   what: str = "setting") -> dict[str, dict[str, Any]]:
    """``{"tp": 2, "steps": 20}`` -> ``{"parallel": {"tp": 2}, "train": {"steps": 20}}``; unknown names raise."""
    out: dict[str, dict[str, Any]] = {s: {} for s in sections}
    owner = {f.name: s for s in sections for f, _ in settings_of(config_class(s))}
    unknown = sorted(set(settings) - set(owner))
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; known: {sorted(owner)}")
    for name, value in settings.items():
        out[owner[name]][name] = value
    return out


def make_configs(parallel: Any = None, train: Any = None, *, what: str = "setting",
                 **settings: Any) -> tuple[Any, Any]:
    """(ParallelConfig, TrainConfig) from whole configs and/or keyword shortcuts; shortcuts win.

    ``make_configs(tp=2, steps=20)``, ``make_configs(parallel=p, steps=5)``: each keyword goes to the
    config that declares it, so no parameter list of degrees is written anywhere else.
    """
    parts = split_settings(settings, ("parallel", "train"), what=what)
    out = []
    for section, base in (("parallel", parallel), ("train", train)):
        given = parts[section]
        if isinstance(base, dict):
            base = config_class(section).from_dict(base)
        out.append(dataclasses.replace(base, **given) if base is not None and given
                   else base if base is not None else config_class(section)(**given))
    return out[0], out[1]
