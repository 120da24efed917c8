"""An evaluation's culprit searches, spread over step ends: one heap pass at a time.

A state change used to run its whole culprit search in the step end that found it: a census, a
holder search, a look for the graph that keeps a tensor, a heap look for a host leak. On a heap of
a million objects that was one pause of 0.5-1.7 s. The searches are generators that yield between
heap passes (``probes.heap.stepwise``); this runs them in order and stops once the step end has paid
``SLICE_START_S``, so the next pass waits for the next step end (which the component asks the agent
to sample). On an ordinary heap every pass is a few milliseconds and all of them finish at once.

The findings of the evaluation are written when its searches are done, a few steps later at most on
a big heap: their steps (onset, first step) are those of the evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpumemd.budget import HEAP_PASS_START_S
from gpumemd.probes.heap.stepwise import Stepwise

if TYPE_CHECKING:
    from gpumemd.analysis.leak_detector import TrackStatus
    from gpumemd.components.leak_evidence import Evidence

SLICE_START_S = HEAP_PASS_START_S
"""A heap pass starts only while the step end has paid less than this; the longest pass (a holder
search, within ``probes.holding.holders.HOLDER_BUDGET_S``) then ends within ``STEP_END_PAUSE_S`` or about."""

Key = tuple[str, str]  # a finding's (series, phase)


@dataclass(slots=True)
class PendingEvaluation:
    """What one evaluation found and the searches it still runs: ``work`` in order, each under the key
    of the finding it searches for (None: a heap look that only prepares a later search)."""

    step: int
    statuses: list[TrackStatus]
    rising: set[str]
    work: list[tuple[Key | None, Stepwise[Evidence] | Stepwise[None]]]
    found: dict[Key, Evidence] = field(default_factory=dict)
    spent: dict[Key, float] = field(default_factory=dict)  # seconds each finding's search took

    def advance(self, clock: Callable[[], float], started: float) -> bool:
        """Run passes while the step end (begun at ``started``) has paid less than ``SLICE_START_S``;
        True when every search is done."""
        work = self.work
        while work and clock() - started < SLICE_START_S:
            key, search = work[0]
            began = clock()
            try:
                next(search)
            except StopIteration as done:
                work.pop(0)
                if key is not None:
                    self.found[key] = done.value
            finally:
                if key is not None:
                    self.spent[key] = self.spent.get(key, 0.0) + clock() - began
        return not work

    def finish_now(self) -> None:
        """Run what is left at once (the job is detaching: no later step end)."""
        self.advance(lambda: 0.0, 0.0)  # a clock that never moves: every pass runs now

    def close(self) -> None:
        """Drop the searches left (each releases what it held)."""
        for _, search in self.work:
            search.close()
        self.work.clear()
