"""The schema: how a config field is declared (:func:`setting`) and checked (:func:`check`).

A setting is a field of a config dataclass declared with :func:`setting`, which keeps a :class:`Setting`
(help, choices, range, command-line spelling) in the field's metadata::

    tp: int = setting(1, "tensor-parallel degree", min=1)

This module is the bottom of the stack: :mod:`workbench.config` declares its fields with it, and
:mod:`workbench.settings` generates the argparse groups, the layout parser and the keyword shortcuts
from the same declarations (the notebook controls come from ``workbench.widgets.controls``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["Setting", "setting", "check", "check_value", "settings_of", "kind_of", "show", "bounded", "seconds",
           "METADATA_KEY"]

METADATA_KEY = "workbench"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """What a config field means to people: its help, allowed values and command-line spelling.

    ``min``/``max`` bound numbers (``exclusive_min``/``exclusive_max`` leave the bound out); ``limit`` is
    a sanity bound above the range's meaning (``n_layers`` up to 1024, a world of up to 65,536 ranks), so a
    typo or a hostile file is refused before it costs minutes or gigabytes, with ``limit_why`` saying why
    in the message (``n_layers=100000 is over the limit of 1,024 (the deepest published decoders have
    ~130); choose n_layers <= 1024``);
    ``special`` lists values allowed outside the range with their meaning (``{-1: "the rest of nproc"}``);
    ``none`` says what ``None`` means for an optional field; ``off`` is appended to range errors
    (``"0 turns it off"``); ``expect`` replaces the generated "must be ..." phrase. ``flag`` is the
    command-line flag (default ``--field-name``) and ``aliases`` more spellings of it; ``const`` makes
    the flag's value optional (``--resume`` alone means ``"latest"``); ``group`` is the argparse group
    (default: the config class's ``settings_group``). ``cli=False`` keeps a field off the command line.
    """

    help: str
    choices: tuple = ()
    min: float | None = None
    max: float | None = None
    limit: float | None = None
    limit_why: str = ""
    exclusive_min: bool = False
    exclusive_max: bool = False
    special: Mapping[Any, str] = field(default_factory=dict)
    none: str | None = None
    off: str | None = None
    expect: str | None = None
    choose: str = "one of"
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    const: Any = None
    metavar: str | None = None
    group: str | None = None
    cli: bool = True

    def flags(self, name: str) -> list[str]:
        return [self.flag or "--" + name.replace("_", "-"), *self.aliases]

    def describe(self, default: Any) -> str:
        """The help line with its default: ``tensor-parallel degree (default: 1)``."""
        if isinstance(default, bool) and default is False:
            return self.help
        if default is None:
            return f"{self.help} (default: {self.none})" if self.none else self.help
        if default in self.special and not isinstance(default, bool):
            return f"{self.help} (default: {default}, {self.special[default]})"
        if self.off and default == 0:
            return f"{self.help} (default: {default}; {self.off})"
        return f"{self.help} (default: {default})"


def setting(default: Any = dataclasses.MISSING, help: str = "", **meta: Any) -> Any:
    """A dataclass field carrying its :class:`Setting`: ``tp: int = setting(1, "tensor-parallel degree", min=1)``."""
    return field(default=default, metadata={METADATA_KEY: Setting(help=help, **meta)})


# --------------------------------------------------------------------------------------------------
# Field kinds and checks
# --------------------------------------------------------------------------------------------------


def kind_of(f: dataclasses.Field) -> tuple[str, bool]:
    """``("int" | "float" | "bool" | "str", optional)`` from the field's annotation."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None) or str(f.type)
    optional = "None" in text or "Optional" in text
    for kind in ("bool", "int", "float", "str"):
        if re.search(rf"\b{kind}\b", text):
            return kind, optional
    raise TypeError(f"setting {f.name}: annotation {text!r} is not bool, int, float or str (optionally | None)")


def settings_of(cls: type, only: Iterable[str] | None = None,
                exclude: Iterable[str] = ()) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of ``cls`` declared with :func:`setting`, in declaration order."""
    keep = None if only is None else set(only)
    out = []
    for f in dataclasses.fields(cls):
        s = f.metadata.get(METADATA_KEY)
        if s is None or (keep is not None and f.name not in keep) or f.name in exclude:
            continue
        out.append((f, s))
    return out


def _range_phrase(kind: str, s: Setting) -> str:
    if s.expect:
        return s.expect
    if kind == "int" and s.max is None and s.min == 1:
        return "a positive integer"
    if kind == "int" and s.max is None and s.min == 0:
        return "an integer >= 0"
    if kind == "float" and s.max is None and s.min == 0:
        return "a positive finite number" if s.exclusive_min else "a number >= 0"
    noun = "an integer" if kind == "int" else "a number"
    if s.min is not None and s.max is not None:
        return f"{noun} in {'(' if s.exclusive_min else '['}{s.min}, {s.max}{')' if s.exclusive_max else ']'}"
    if s.min is not None:
        return f"{noun} {'>' if s.exclusive_min else '>='} {s.min}"
    if s.max is not None:
        return f"{noun} {'<' if s.exclusive_max else '<='} {s.max}"
    return noun


def _canonical(value: Any, choices: tuple) -> Any:
    if isinstance(value, str):
        for c in choices:
            if isinstance(c, str) and c.lower() == value.lower():
                return c
    return value


_SHOW_CHARS = 60  # a value echoed in a message: a 10 MB string from a config.json is not repeated whole


def show(value: Any) -> str:
    """``repr(value)``, cut to a readable length (values may come from a hostile file)."""
    if isinstance(value, (list, tuple, dict, set)):  # repr of a deeply nested list recurses: name it instead
        return f"<a {type(value).__name__} of {len(value)} item(s)>"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"<an integer of {value.bit_length()} bits>"  # repr of a huge int is slow (and capped since 3.11)
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[:_SHOW_CHARS - 3] + "..."


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def check_value(name: str, value: Any, kind: str, optional: bool, s: Setting) -> Any:
    """The value in canonical form, or one ValueError naming the field, the value and what is allowed."""
    if value is None and optional:
        return None
    if s.choices:
        value = _canonical(value, s.choices)
        ok = _hashable(value) and value in s.choices and (kind != "int" or not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{name}={show(value)} is unknown; choose {s.choose} {list(s.choices)}")
        return value
    if s.special and not isinstance(value, bool) and _hashable(value) and value in s.special:
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name}={show(value)} must be True or False")
        return value
    if kind == "str":
        if isinstance(value, os.PathLike):  # a path setting given as a Path: stored as its text
            value = os.fspath(value)
        if not isinstance(value, str):
            raise ValueError(f"{name}={show(value)} must be text")
        return value
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # NaN compares False with everything, so it is refused here rather than slipping past min/max
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
            # an int (JSON's 1e400 written out) is finite, but one past float's range overflows wherever it is
            # used as the float it stands for (isfinite(10**400) itself raises OverflowError)
            abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value))
    if ok and s.min is not None:
        ok = value > s.min if s.exclusive_min else value >= s.min
    if ok and s.max is not None:
        ok = value < s.max if s.exclusive_max else value <= s.max
    if not ok:
        raise ValueError(f"{name}={show(value)} must be {_range_phrase(kind, s)}" + (f" ({s.off})" if s.off else ""))
    if s.limit is not None and value > s.limit:
        why = f" ({s.limit_why})" if s.limit_why else ""
        raise ValueError(f"{name}={show(value)} is over the limit of {_number(s.limit)}{why}; "
                         f"choose {name} <= {_number(s.limit, commas=False)}")
    return value


def _number(x: float, commas: bool = True) -> str:
    if float(x).is_integer():
        return f"{int(x):,}" if commas else str(int(x))
    return f"{x:g}"


def bounded(kind: str, name: str, **limits: Any):
    """An argparse ``type`` for a flag outside the configs, checked like a setting:
    ``p.add_argument("--bins", type=bounded("int", "bins", min=0, limit=MAX_BINS))``. A value out of
    range fails at parse time, before any work, with the setting's one-line message (``bins=-3 must be
    an integer >= 0``); ``nan``/``inf`` never pass as a float."""
    s = Setting(help="", **limits)
    parse = {"int": int, "float": float}[kind]

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            noun = "an integer" if kind == "int" else "a number"
            raise argparse.ArgumentTypeError(f"{name}={text[:60]!r} is not {noun}") from None
        try:
            return check_value(name, value, kind, False, s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = kind
    return convert


def seconds(name: str):
    """An argparse ``type`` for a duration: a positive finite number of seconds (not 0, -1, nan or inf)."""
    return bounded("float", name, min=0, exclusive_min=True, expect="a positive finite number of seconds")


def check(obj: Any) -> None:
    """Check every setting of the dataclass ``obj``; store choices in their canonical spelling.

    Called first thing in the config dataclasses' ``__post_init__`` (they are frozen, hence
    ``object.__setattr__``). Cross-field rules stay in the classes themselves.
    """
    for f, s in settings_of(type(obj)):
        kind, optional = kind_of(f)
        value = getattr(obj, f.name)
        canonical = check_value(f.name, value, kind, optional, s)
        if canonical is not value:
            object.__setattr__(obj, f.name, canonical)


# --------------------------------------------------------------------------------------------------
# Sections: the config classes, looked up when used
# --------------------------------------------------------------------------------------------------
