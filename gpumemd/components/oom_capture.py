"""The one capture the CUDA OOM observer keeps, and when it still describes the OOM being reported.

The observer fires before the allocator raises; the report is written later, once the exception
reaches ``oom_guard`` or an excepthook. A capture only belongs to that OOM if it was taken in the
same step, a moment ago, on the device the message names. Otherwise it is of an OOM the job caught
(its own ``except OutOfMemoryError``: skip the batch, retry smaller) or PyTorch retried (a cuDNN
workspace): attaching it to a later OOM would show the wrong moment, so it is handed back
(``settle``, ``observe``) to be counted and reported as caught, and not kept: a whole
``_snapshot()`` in RAM is unbounded when the job records history with torch's default ``max_entries``.

Observers run on the allocating thread, which may be an autograd worker: the slot is read and
written under its own lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall

_probing = 0  # find_batch_size tries in progress (any thread): their OOMs are gpumemd's, not the job's
_probing_lock = threading.Lock()


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """While gpumemd's own ``find_batch_size`` tries a batch: the observer ignores its OOMs."""
    global _probing
    with _probing_lock:
        _probing += 1
    try:
        yield
    finally:
        with _probing_lock:
            _probing -= 1


def probing_now() -> bool:
    return _probing > 0


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
    calls: int = 1  # observer calls folded into this capture: OOMs of one step (a burst is one report)
    step: int = 0  # the step that was running when the observer first fired in this step


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
        self.pending: Capture | None = None

    def observe(self, call: ObserverCall, *, steps_total: int, step: int, now: float, may_snapshot: bool,
                snapshot: Callable[[], dict[str, Any] | None],
                summary: Callable[[int], str | None]) -> Capture | None:
        """Record an observer call; returns the capture it replaces when that one is of an earlier step
        (an OOM the job caught and went on from), else None. Calls in one step fold into one capture
        (``calls``): a burst inside a step is one report. A burst (cuDNN retrying with ever smaller
        workspaces) takes one snapshot: a call within ``BURST_S`` of the last snapshot keeps it and
        records its own numbers (the latest call is the one that may propagate). ``may_snapshot``
        False (cap or cooldown reached) takes none."""
        ordinal = call.device.index if call.device.index is not None else 0
        with self._lock:
            earlier = self.pending
            same_step = earlier is not None and earlier.steps_total == steps_total
            taken = summary_text = taken_at = None
            if (earlier is not None and same_step and earlier.captured_at is not None
                    and now - earlier.captured_at < BURST_S):
                taken, taken_at = earlier.snapshot, earlier.captured_at  # all devices: still this moment
                summary_text = earlier.memory_summary if earlier.call.device == call.device else summary(ordinal)
            elif may_snapshot:  # no snapshot for an OOM that would not be reported anyway
                taken, taken_at = snapshot(), now
                summary_text = summary(ordinal)
            calls, first_step = (earlier.calls + 1, earlier.step) if earlier is not None and same_step else (1, step)
            self.pending = Capture(call, taken, summary_text, steps_total, taken_at, now, calls, first_step)
            return earlier if earlier is not None and not same_step else None

    def take(self, *, steps_total: int, now: float, device: Device | None) -> Capture | None:
        """The capture if it is of this OOM (see ``belongs_to``); the slot is emptied either way."""
        capture = self.pop()
        return capture if capture is not None and belongs_to(capture, steps_total=steps_total, now=now,
                                                             device=device) else None

    def peek(self, *, steps_total: int, now: float) -> Capture | None:
        """The capture if it is of this moment (any device), left in place."""
        capture = self.pending
        return capture if capture is not None and belongs_to(capture, steps_total=steps_total, now=now,
                                                             device=None) else None

    def settle(self, *, steps_total: int, now: float) -> Capture | None:
        """At a step end: a capture of an earlier step (or too old) is of an OOM the job caught and
        went on from; it leaves the slot and is returned."""
        if self.pending is None:  # every step end but an OOM's: no lock taken (one reference read)
            return None
        with self._lock:
            capture = self.pending
            if capture is None or belongs_to(capture, steps_total=steps_total, now=now, device=None):
                return None
            self.pending = None
            return capture

    def pop(self) -> Capture | None:
        """Whatever is pending, taken out (at stop: no OOM propagates any more)."""
        with self._lock:
            capture, self.pending = self.pending, None
            return capture


STEPS_SHOWN = 20  # steps of caught OOMs kept for the exit line and the state file (the latest)


class CaughtTally:
    """The OOMs the job caught. Every observer call counts as caught until a propagating OOM's report
    claims it, so the exit line and the metric are right at any moment; the captures of caught OOMs
    wait here (at most ``queue_max``) to be reported at a step end, never inside the allocator."""

    def __init__(self, queue_max: int) -> None:
        self._lock = threading.Lock()
        self._observed = 0
        self._claimed = 0
        self._steps: list[int] = []
        self._queue: list[Capture] = []
        self._queue_max = queue_max

    @property
    def count(self) -> int:
        return self._observed - self._claimed

    def steps(self) -> tuple[int, ...]:
        return tuple(self._steps[-STEPS_SHOWN:]) if self.count else ()

    def observed(self, step: int) -> None:
        with self._lock:
            self._observed += 1
            if not self._steps or self._steps[-1] != step:
                self._steps.append(step)
                del self._steps[:-STEPS_SHOWN]

    def claimed(self, capture: Capture | None) -> None:
        """The observer call of the OOM that propagated is not a caught one."""
        if capture is None:
            return
        with self._lock:
            self._claimed += 1
            if capture.calls == 1 and self._steps and self._steps[-1] == capture.step:
                self._steps.pop()  # its step saw no other OOM

    def queue(self, capture: Capture | None) -> None:
        if capture is None:
            return
        with self._lock:
            if len(self._queue) < self._queue_max:
                self._queue.append(capture)

    def drain(self) -> list[Capture]:
        if not self._queue:  # the usual step end: nothing queued, no lock taken
            return []
        with self._lock:
            out, self._queue = self._queue, []
            return out
