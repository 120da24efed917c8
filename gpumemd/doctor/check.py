"""One line of ``gpumemd doctor``'s answer, and what the checks of every area share."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "n/a"]


@dataclass(frozen=True)
class Check:
    """One line of the doctor's answer. ``needed``: gpumemd cannot do its core job when this fails."""

    name: str
    status: Status
    detail: str
    needed: bool = False


def failed_needed(checks: list[Check]) -> list[Check]:
    """The checks that make the verdict "no": needed and failed (a warning never does)."""
    return [c for c in checks if c.needed and c.status == "fail"]


def dist_version(dist: str) -> str | None:
    """An installed distribution's version without importing it (frameworks import slowly)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
