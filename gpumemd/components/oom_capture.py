"""The one capture the CUDA OOM observer keeps, and when it still describes the OOM being reported.

The observer fires before the allocator raises; the report is written later, once the exception
reaches ``oom_guard`` or an excepthook. A capture only belongs to that OOM if it was taken in the
same step, a moment ago, on the device the message names. Otherwise it is of an OOM PyTorch
recovered from (a cuDNN workspace retry, a job's own ``except OutOfMemoryError``) and attaching it
would show the wrong moment; keeping it would hold a whole ``_snapshot()`` in RAM, unbounded when
the job records history with torch's default ``max_entries``.

Observers run on the allocating thread, which may be an autograd worker: the slot is read and
written under its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall

BURST_S = 1.0  # observer calls within this long of a capture, in the same step, reuse its snapshot
# An OOM propagates from the observer's call to oom_guard or the excepthook in milliseconds (the
# stack unwinding); a capture older than this is of another OOM, even in a job that marks no steps.
CAPTURE_TTL_S = 10.0


@dataclass(frozen=True)
class Capture:
    call: ObserverCall
    snapshot: dict[str, Any] | None
    memory_summary: str | None
    steps_total: int = 0  # the agent's step count when the observer fired
    captured_at: float | None = None  # the clock when the snapshot was taken (None: none was attempted)
    observed_at: float | None = None  # the clock when the observer fired


def belongs_to(capture: Capture, *, steps_total: int, now: float, device: Device | None) -> bool:
    """Whether ``capture`` is of the OOM being reported now, in step ``steps_total``, on ``device``
    (None: the message named no device, which is then not held against the capture)."""
    if capture.steps_total != steps_total:
        return False  # a step ended since: that OOM was recovered
    seen = capture.observed_at if capture.observed_at is not None else capture.captured_at
    if seen is not None and now - seen > CAPTURE_TTL_S:
        return False
    return device is None or device == capture.call.device


class CaptureSlot:
    """The pending capture, under a lock (observer threads write it, the reporting thread takes it)."""

    def __init__(self) -> None:
        # Reentrant: an observer that fires inside a snapshot taken under this lock must not deadlock.
        self._lock = threading.RLock()
        self._pending: Capture | None = None

    @property
    def pending(self) -> Capture | None:
        return self._pending

    def observe(self, call: ObserverCall, *, steps_total: int, now: float, may_snapshot: bool,
                snapshot: Callable[[], dict[str, Any] | None],
                summary: Callable[[int], str | None]) -> Capture:
        """Record an observer call. A burst (cuDNN retrying with ever smaller workspaces, each retry an
        OOM it catches) takes one snapshot: a call in the same step, within ``BURST_S`` of the last
        snapshot, keeps that snapshot and records its own numbers (the latest call is the one that
        may propagate). ``may_snapshot`` False (cap or cooldown reached) takes none."""
        ordinal = call.device.index if call.device.index is not None else 0
        with self._lock:
            earlier = self._pending
            taken = summary_text = taken_at = None
            if (earlier is not None and earlier.captured_at is not None and earlier.steps_total == steps_total
                    and now - earlier.captured_at < BURST_S):
                taken, taken_at = earlier.snapshot, earlier.captured_at  # all devices: still this moment
                summary_text = earlier.memory_summary if earlier.call.device == call.device else summary(ordinal)
            elif may_snapshot:  # no snapshot for an OOM that would not be reported anyway
                taken, taken_at = snapshot(), now
                summary_text = summary(ordinal)
            capture = Capture(call, taken, summary_text, steps_total, taken_at, now)
            self._pending = capture
            return capture

    def take(self, *, steps_total: int, now: float, device: Device | None) -> Capture | None:
        """The capture if it is of this OOM (see ``belongs_to``); the slot is emptied either way."""
        with self._lock:
            capture, self._pending = self._pending, None
        if capture is None or not belongs_to(capture, steps_total=steps_total, now=now, device=device):
            return None
        return capture

    def peek(self, *, steps_total: int, now: float) -> Capture | None:
        """The capture if it is of this moment (any device), left in place."""
        capture = self._pending
        if capture is None or not belongs_to(capture, steps_total=steps_total, now=now, device=None):
            return None
        return capture

    def drop_stale(self, *, steps_total: int, now: float) -> bool:
        """At a step end: a capture of an earlier step (or too old) was recovered from; let it go."""
        with self._lock:
            capture = self._pending
            if capture is None or belongs_to(capture, steps_total=steps_total, now=now, device=None):
                return False
            self._pending = None
            return True

    def clear(self) -> None:
        with self._lock:
            self._pending = None
