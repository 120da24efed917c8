"""Formatting shared by the Markdown, HTML and terminal renderings."""

from __future__ import annotations

import datetime as _dt
from typing import Any


def fmt_bytes(n: Any) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} PiB"  # pragma: no cover - the loop always returns


def fmt_time(epoch: Any) -> str:
    """Epoch seconds -> ISO-8601 UTC with milliseconds."""
    if not isinstance(epoch, (int, float)):
        return "-"
    stamp = _dt.datetime.fromtimestamp(float(epoch), tz=_dt.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def fmt_shape(shape: Any) -> str:
    if not isinstance(shape, (list, tuple)):
        return "-"
    return "[" + ", ".join(str(d) for d in shape) + "]"
