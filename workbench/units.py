"""Bytes as people read them: the one formatter every table, CLI line and view uses.

Binary units (1 KiB = 1024 B), because memory and checkpoint sizes are powers of two and a GPU's
"80 GB" is 80 GiB-ish in every tool that reports allocations::

    format_bytes(512)          -> "512 B"
    format_bytes(4_194_304)    -> "4.00 MiB"
    format_bytes(-3 * 2**30)   -> "-3.00 GiB"    (a difference)
"""

from __future__ import annotations

__all__ = ["format_bytes", "parse_bytes", "axis_unit", "BYTE_UNITS"]

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: whole bytes below 1 KiB, two decimals above."""
    value = float(n)
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def axis_unit(largest: float) -> tuple[str, int]:
    """``(name, bytes per unit)`` for a plot axis whose largest value is ``largest`` bytes: the largest binary
    unit that keeps it at 1 or more, so a 4 MiB model is drawn in MiB and a 70B one in GiB::

        axis_unit(4 * 2**20)  -> ("MiB", 1048576)
    """
    value, scale = abs(float(largest)), 1
    for unit in BYTE_UNITS:
        if value < 1024 or unit == BYTE_UNITS[-1]:
            return unit, scale
        value /= 1024
        scale *= 1024
    raise AssertionError("unreachable")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``80GiB``, ``"1.5 GB"``, ``2**30`` -> bytes; one ValueError line otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory budget {value} must be positive")
        return int(value)
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("kmgtib")
    unit = text[len(num):]
    try:
        n = float(num)
    except ValueError:
        n = None
    if n is None or unit not in _UNITS or n <= 0:
        raise ValueError(f"memory budget {value!r}: write bytes or a size like 80GiB, 24GB, 512MiB")
    return int(n * _UNITS[unit])


def check_margin(value: str) -> None:
    """A ``--margin`` flag's value: a size (``1.5GiB``), ``0`` or ``auto``; else a one-line ValueError."""
    if value.strip().lower() in ("auto", "0", "0b"):
        return
    try:
        parse_bytes(value)
    except ValueError:
        raise ValueError(f"--margin {value!r}: write a size like 1.5GiB or 512MiB, 0, or auto") from None
