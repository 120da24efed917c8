"""Bytes for people, one way everywhere (findings, reports, the CLI): binary units like torch's memory_viz."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: object, *, digits: int = 1, missing: str = "-") -> str:
    """``1536`` -> ``"1.5 KiB"`` (``digits`` decimals above 1 KiB); not a number -> ``missing``."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return missing
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in UNITS:
        if value < 1024 or unit == UNITS[-1]:
            return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable: the last unit always returns")
