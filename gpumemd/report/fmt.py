"""Formatting shared by the Markdown, HTML and terminal renderings."""

from __future__ import annotations

import datetime as _dt
from typing import Any

from gpumemd.analysis.units import format_bytes


def fmt_bytes(n: Any) -> str:
    """``1536`` -> ``"1.50 KiB"``; None -> ``"-"``."""
    return format_bytes(n, digits=2)


def fmt_time(epoch: Any) -> str:
    """Epoch seconds -> ISO-8601 UTC with milliseconds."""
    if not isinstance(epoch, (int, float)):
        return "-"
    try:
        stamp = _dt.datetime.fromtimestamp(float(epoch), tz=_dt.timezone.utc)
    except (OverflowError, OSError, ValueError):  # past what a date can say: the number itself
        return f"{epoch!r} s"
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
