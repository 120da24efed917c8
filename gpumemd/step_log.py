"""The agent's step records: the ring of recent ones, the long thinned history, and the quick step
ends' reads that wait for the next full step end to become records.

A *quick* sampled step end (``StepEnds.end``: on steps so fast that even every ``MAX_STRIDE``th full
step end is over its share of the budget) reads the probes and keeps the reading here. At the next full
step end the readings become records, in order, in one loop: a record made and handed to the leak
detector right after a step of compute costs ~10x what it costs there, with the code and data in the
cache. Readers of the history (an OOM report, the exit) see the waiting ones too.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.step_history import StepHistory

if TYPE_CHECKING:
    from gpumemd.records.step import StepRecord
    from gpumemd.step_reading import QuickReading, StepReader

QUICK_MAX = 19
"""Quick step ends in a row at most: the state scrapes and the state file read is at most
``(QUICK_MAX + 1)`` strides old (200 steps; 800 while a leak is only tracked, ``stride.SPARSE_STRETCH``:
a second or two on the fast loops that have quick step ends, against a scrape every 15 s or so).
Survivor scans and leak evaluations run full step ends every 50 steps or less, so this bound only
spaces full ones while a confirmed leak is tracked (``leak_scans.TRACKING_STRETCH``: up to 800 steps
apart)."""


class StepLog:
    """``keep_steps`` recent records, the long history, and the quick readings not yet made records."""

    def __init__(self, reader: StepReader, keep_steps: int) -> None:
        self._reader = reader
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=keep_steps)
        self.long = StepHistory()  # since attach, thinned: the OOM report's timeline reaches the onset
        self.quick: list[QuickReading] = []

    def add(self, record: StepRecord) -> None:
        self.recent.append(record)
        self.long.add(record)

    def complete_quick(self, deliver: Callable[[StepRecord, int], None]) -> None:
        """The waiting readings as records, in order, into the history and to ``deliver`` (with the
        count of sampled step ends at each: the components' ``on_quick``)."""
        pending = self.quick
        if not pending:
            return
        self.quick = []
        for reading in pending:
            record = self._reader.complete(reading)
            self.add(record)
            deliver(record, reading.samples)

    def steps(self) -> list[StepRecord]:
        """The recent records, oldest first, the waiting readings' included (made now, kept nowhere)."""
        recent = list(self.recent)
        pending = self._pending()
        return (recent + pending)[-(self.recent.maxlen or 0):] if pending else recent

    def history(self) -> list[StepRecord]:
        return self.long.records() + self._pending()

    def _pending(self) -> list[StepRecord]:
        return [self._reader.complete(reading) for reading in list(self.quick)]
