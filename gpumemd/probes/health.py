"""Shared bookkeeping for probes: log a failure once, count every failure, report availability."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("gpumemd")
_T = TypeVar("_T")
_D = TypeVar("_D")


class ProbeHealth:
    """Counts a probe's errors and logs only the first of each kind, so a week-long job gets one
    line per problem, not one per step."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.errors = 0
        self.available: bool | None = None  # None until the probe has tried once
        self.absent_reason: str | None = None  # why it cannot work here (said in the start line)
        self.partial: dict[str, str] = {}  # readings it cannot take here, each with why (the start line too)
        self._logged: set[str] = set()

    def absent(self, reason: str) -> None:
        """The probe cannot work on this machine (no CUDA, no driver): normal, said once at INFO."""
        if self.available is not False:
            log.info("gpumemd: %s probe absent: %s", self.name, reason)
        self.available = False
        self.absent_reason = reason

    def partly_absent(self, reading: str, reason: str) -> None:
        """The probe works here without ``reading`` (host RAM totals without psutil): said once at INFO,
        and in the start line's "absent:" list."""
        if reading not in self.partial:
            log.info("gpumemd: %s absent: %s", reading, reason)
        self.partial[reading] = reason

    def failed(self, exc: BaseException) -> None:
        """The probe worked before, or should work, and a read failed: counted, logged once per kind."""
        self.errors += 1
        kind = type(exc).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("gpumemd: %s probe failed (%s: %s); further %s errors are counted, not logged",
                        self.name, kind, exc, kind)

    def ok(self) -> None:
        self.available = True

    def call(self, fn: Callable[[], _T], default: _D) -> _T | _D:
        """``fn()``, or ``default`` when it raises: the probe ``failed``, the job never sees it."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.failed(exc)
            return default
