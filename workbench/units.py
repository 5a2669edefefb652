"""Bytes as people read them: the one formatter every table, CLI line and view uses.

Binary units (1 KiB = 1024 B), because memory and checkpoint sizes are powers of two and a GPU's
"80 GB" is 80 GiB-ish in every tool that reports allocations::

    format_bytes(512)          -> "512 B"
    format_bytes(4_194_304)    -> "4.00 MiB"
    format_bytes(-3 * 2**30)   -> "-3.00 GiB"    (a difference)
"""

from __future__ import annotations

__all__ = ["format_bytes", "BYTE_UNITS"]

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: whole bytes below 1 KiB, two decimals above."""
    value = float(n)
    for unit in BYTE_UNITS:
        if abs(value) < 1024 or unit == BYTE_UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
