"""The agent's sampled step end: what runs on the training thread when the step clock's countdown
reaches zero, and what it counts (samples, the agent's clocked training-thread time).

Which steps are sampled: every step while the sampled step end fits its
share of ``overhead_budget`` (``gpumemd.budget``, ``Part.STEP_ENDS``) at the job's measured step time;
on faster steps every Nth (N <= ``MAX_STRIDE``), the others costing one counter decrement. A record then
stands for ``record.steps`` steps and its ``duration_s`` is their mean. Why: on a 1 ms CPU step a single
``/proc`` read costs as much as the whole per-step target (one syscall after a step of compute is ~20 µs
here), while the leak detector, which works on floors of 10-step blocks, loses nothing. Phase changes
and ``sample_within()`` (a component that measured a step) override the stride.

What one "step" is, and how steps are counted: ``gpumemd.step_clock``. What a sampled step end reads:
``gpumemd.step_reading``.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.step_clock import StepClock
from gpumemd.step_log import QUICK_MAX

if TYPE_CHECKING:
    from gpumemd.component_set import ComponentSet
    from gpumemd.records.step import StepRecord
    from gpumemd.signal_endings import SignalEndings
    from gpumemd.state_board import StateBoard
    from gpumemd.step_log import StepLog
    from gpumemd.step_reading import StepReader
    from gpumemd.stride import StridePlanner


class StepEnds:
    """The sampled step ends of one agent: it makes the agent's ``StepClock`` (``step_clock``) with
    ``end`` as the callback, and keeps the counts the agent's ``overhead()`` reports. ``running`` is
    the agent's: its start sets it, its stop clears it."""

    def __init__(self, *, clock: Callable[[], float], planner: StridePlanner, reader: StepReader, log: StepLog,
                 board: StateBoard, components: ComponentSet, signals: SignalEndings, identity_known: bool) -> None:
        self._clock = clock
        self._planner = planner
        self._reader = reader
        self._log = log
        self._board = board
        self._components = components
        self._signals = signals
        self.running = False
        self._fork_generation = _fork_generation
        self.step_clock = StepClock(self.end, self.active)
        self.samples = 0
        """Steps sampled (records made, quick step ends' included) since attach."""
        self.last_step_clock: float | None = None  # the clock at the end of the last sampled step end
        self.thread_seconds = 0.0
        """The agent's training-thread time: step ends, and what components report (``add_thread_seconds``)."""
        self.census_seconds = 0.0
        # (steps_total, thread_seconds, clock) every RECENT_STEPS steps, the two newest: ``recent``
        self._marks: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=2)
        self._mark_at = 0
        # Jobs often attach before init_process_group: re-read the rank on the first steps.
        self._identity_checks_left = 0 if identity_known else _IDENTITY_REFRESH_STEPS
        self._signals_due = 0.0  # clock time of the next look for handlers the job installed since

    def active(self) -> bool:
        """The agent runs, and in this process."""
        # A DataLoader worker forked after attach inherits this object but is not the job's
        # training process: it must record nothing (and it has no sampler thread: fork drops threads).
        # A fork counter, not os.getpid(): a syscall on every sampled step costs ~20 µs here.
        return self.running and _fork_generation == self._fork_generation

    def end(self, step: int | None) -> StepRecord | None:
        """A sampled step end: read the probes, record, run the components, plan the next sample."""
        start = self._clock()
        if not self.running or _fork_generation != self._fork_generation:  # self.active(), inlined
            return None
        clock = self.step_clock
        # ``clock.asked``, inlined: a quick step end is a few attribute reads and one pread, and each
        # call after a step of compute costs ~1-2 µs more than in a warm loop.
        quick = self._planner.quick and clock.steps_total < clock.asked_at and len(self._log.quick) < QUICK_MAX
        number, steps = clock.begin_sample(step)  # components may ask for a sample now (sample_within)
        duration = None if self.last_step_clock is None else (start - self.last_step_clock) / steps
        self.samples += 1
        if quick:  # the reads now; the record and the components at the next full step end
            self._log.quick.append(self._reader.quick(number, duration, steps, clock.current_phase, self.samples))
            clock.planned(self._planner.stride)
            end = self._clock()
            self.thread_seconds += end - start
            self.last_step_clock = end
            return None
        clock.asked_met()  # before the components: what they ask for now is for a later step end
        self._log.complete_quick(self._components.on_quick)
        record = self._reader.record(number, duration, steps, clock.current_phase)
        self._log.add(record)
        # One reference assignment makes the step visible to state() readers (components below,
        # scrapes on other threads); the state object itself is built only when someone reads it.
        self._board.pending = (record, clock.steps_total)
        if self._identity_checks_left:  # a late init_process_group, seen on the first steps
            self._identity_checks_left = 0 if self._board.refresh_identity() else self._identity_checks_left - 1
        self._components.on_step(record)
        if start >= self._signals_due:  # a handler the job installed since attach gets wrapped too
            self._signals_due = start + _SIGNAL_RECHECK_S
            self._signals.recheck()
        end = self._clock()
        self.step_clock.planned(self._planner.plan(end - start, duration))  # the stride, and the next eve
        # Clocked after planning: the planning (~10 µs after a step of compute) is the agent's time too.
        end = self._clock()
        self.thread_seconds += end - start
        self.last_step_clock = end
        if clock.steps_total >= self._mark_at:
            self._mark_at = clock.steps_total + RECENT_STEPS
            self._marks.append((clock.steps_total, self.thread_seconds, end))
        return record

    def recent(self, now: float) -> tuple[int, float] | None:
        """The agent's training-thread time over the last ``RECENT_STEPS`` to twice that many steps, as
        (steps, share of the wall time they took); None before there are that many. The exit line
        states it beside the whole run's share, which a short run's one-off costs (the first census,
        a finding's culprit searches) dominate."""
        if len(self._marks) < 2:
            return None
        steps, seconds, at = self._marks[0]
        wall = now - at
        return (self.step_clock.steps_total - steps, (self.thread_seconds - seconds) / wall) if wall > 0 else None


RECENT_STEPS = 1_000  # the exit line's recent cost covers the last 1,000 to 2,000 steps
_IDENTITY_REFRESH_STEPS = 16  # steps on which a late init_process_group is noticed
_SIGNAL_RECHECK_S = 5.0  # seconds between looks for signal handlers installed after attach

_fork_generation = 0


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
