"""The long history of step records: every record since attach, thinned evenly to a bounded count.

The ring of recent steps (``keep_steps`` records) shows the last stretch in full, but a leak's onset
may lie thousands of steps before an OOM, far behind it. Beside the ring the agent keeps this: records
at least ``spacing`` steps apart; when ``LONG_HISTORY_POINTS`` are kept every other one goes and the spacing
doubles, so the points always span the whole run, evenly, whatever its length. Memory stays at most
``LONG_HISTORY_POINTS`` records; each append is O(1) amortised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpumemd.records.step import StepRecord

LONG_HISTORY_POINTS = 256
"""Records kept at most: enough for a chart 900 pixels wide to read as a line, small in memory."""


class StepHistory:
    """Step records from the first on, ``spacing`` steps apart or more (see the module docstring)."""

    def __init__(self) -> None:
        self._points: list[StepRecord] = []
        self.spacing = 1
        """Steps between kept records at least; at least doubles each time the history thins."""

    def add(self, record: StepRecord) -> None:
        """Keep ``record`` when it is ``spacing`` steps or more past the last one kept."""
        points = self._points
        if points and record.step - points[-1].step < self.spacing and record.step >= points[-1].step:
            return  # (a step number going back, a job that restarted its count, starts a new stretch)
        points.append(record)
        if len(points) >= LONG_HISTORY_POINTS:
            del points[1::2]  # the first (attach) stays; the rest thin out evenly
            # New records come at the gap the kept ones now have (not less: sampled every Nth step,
            # records arrive N apart whatever the spacing), so the recent stretch is no denser.
            span = points[-1].step - points[0].step
            self.spacing = max(2 * self.spacing, span // (len(points) - 1))

    def records(self) -> list[StepRecord]:
        """The kept records, oldest first."""
        return list(self._points)
