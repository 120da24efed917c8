"""Tensor censuses at step ends, spaced so the agent stays inside its overhead budget (``census_cadence``:
when the next census is due, and the back-off after a failing one).

A census runs in slices (``probes.census.census_steps.census_steps``): at a step end the component runs its slices
while the step end has paid less than ``CENSUS_SLICE_S``, and the rest at the next sampled step ends
(it asks the agent to sample them). An ordinary heap's census is one step end, as before; a heap
whose leak keeps 100k tensors is spread over a few, each pause bounded (``budget.STEP_END_PAUSE_S``).
A leak finding's culprit search that needs a census now drives the census under way, or begins one
(``census_now``); a census outside a step (``take_outside_step``) drops the one under way.

A confirmed leak finding asks for a census at the next step end (``take_soon``): on a fast loop the
interval can be thousands of steps, and the census's figures then predate the leak the finding states.

The component keeps a few recent censuses (thinned so they span the whole run, not just the last few
intervals) for the leak detector and the OOM report: ``recent_censuses()``, ``at_or_after(step)``
and ``census_now()``. It is the one way a census is taken: periodic ones, the leak detector's
``census_now()``, and ``take_outside_step()`` for the job's ``Agent.census()`` and the census at an OOM.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumemd.budget import HEAP_PASS_START_S, STEP_END_PAUSE_S, census_share
from gpumemd.components.base import ComponentBase
from gpumemd.components.census_cadence import CensusCadence, other_share
from gpumemd.probes.census.census_steps import GRAPH_SLICE_NODES, CensusRequest
from gpumemd.probes.heap.gc_pause import AutomaticHold, collector_paused, hold_automatic, release_automatic
from gpumemd.probes.heap.stepwise import HEAP_PASS, Hinted, Stepwise, run_to_end
from gpumemd.signal_locks import YieldingLock

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumemd.components.base import AgentView
    from gpumemd.records.census import Census
    from gpumemd.records.samples import AllocatorSample
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")

KEPT_CENSUSES = 8
"""Censuses kept (a census of a large model is ~1 MB of Python objects)."""

CENSUS_SLICE_S = STEP_END_PAUSE_S * 0.75
"""A census's next slice starts only while the step end has paid less than this: its slices are a few
milliseconds (the heap pass, at a census's first step end, and the holder lookups, bounded by
``STEP_END_PAUSE_S`` themselves, are the long ones)."""


class CensusFn(Protocol):
    """``gpumemd.probes.census.census_steps.census_steps``, as the component calls it (tests give their own)."""

    def __call__(self, request: CensusRequest, *, models: Sequence[object],
                 optimizers: Sequence[object]) -> Hinted[Census]: ...


@dataclass(eq=False)
class _Running:
    """A census under way: its slices run at step ends, or in a culprit search waiting for it."""

    work: Hinted[Census]
    hold: AutomaticHold | None = None  # automatic collections wait while it holds tracked objects
    heap_pass_next: bool = False  # its next slice scans the heap (``probes.heap.stepwise.HEAP_PASS``)
    cost: float = 0.0
    result: Census | None = None
    over: bool = False  # done, failed or dropped

    def end(self) -> None:
        """Done, failed or dropped: its generator releases what it held, then collections resume."""
        self.over = True
        self.work.close()
        release_automatic(self.hold)
        self.hold = None


@dataclass(frozen=True)
class CensusOptions:
    """What the census component reads of the configuration (``Config.options(CensusOptions)``)."""

    census_every_steps: int
    overhead_budget: float
    census: bool = True
    """Periodic censuses at step ends. Off, the component still takes the censuses asked for outside
    a step (the job's ``Agent.census()``, the census at an OOM): it is the one census path either way."""


class CensusComponent(ComponentBase):
    """Runs ``census_fn`` (``take_census``) every N steps and publishes ``census=`` and ``censuses_total=``."""

    name = "census"

    def __init__(
        self,
        options: CensusOptions,
        *,
        census_fn: CensusFn,
        holders: int = 3,
        keep: int = KEPT_CENSUSES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if keep < 2:
            raise ValueError(f"CensusComponent(keep={keep!r}) must keep at least 2 censuses")
        self._cadence = CensusCadence(options.census_every_steps, self._share)  # ``census_cadence``
        self._periodic = options.census
        self._budget = options.overhead_budget
        self._holders = holders
        self._keep = keep
        self._clock = clock
        self._census_fn = census_fn
        self._agent: AgentView | None = None
        # A census outside a step may come from another thread (an OOM's); a signal's writer waits 2 s at most.
        self._lock = YieldingLock()
        self._recent: list[Census] = []
        self._running: _Running | None = None  # the census under way (training thread only advances it)
        self._soon = False  # a census is asked for at the next step end (``take_soon``)
        self._step_end_began = 0.0  # this component's clock at the start of its latest on_step
        self.worked_at_step: int | None = None
        """The step whose step end last ran a slice of a census (the leak detector's evaluation then waits)."""
        self.step_end_seconds = 0.0
        """What the census's slices cost in the latest step end (the leak detector's passes count it)."""

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, agent: AgentView) -> None:
        self._agent = agent

    @property
    def started(self) -> bool:
        """Started and not stopped (the OOM component starts it when the agent does not run it)."""
        return self._agent is not None

    def stop(self) -> None:
        self._agent = None
        with self._lock:
            self._drop_running()
            self._recent.clear()

    # --- cadence -----------------------------------------------------------------------------

    @property
    def interval(self) -> int:
        """Steps between censuses: forced, or what the budget allows at the current step time."""
        return self._cadence.interval(self._agent)

    @property
    def last_cost(self) -> float | None:
        """What the last census took, in seconds (None before one; benchmarks read it)."""
        return self._cadence.last_cost

    def on_quick(self, record: StepRecord, samples_total: int) -> None:
        """A quick step end's record, at the next full one: its steps count towards the next census."""
        self._cadence.steps_since += record.steps

    def on_step(self, record: StepRecord) -> None:
        # The census is the first component: a step end's heavy work is bounded from here.
        self._step_end_began = self._clock()
        self.step_end_seconds = 0.0
        running = self._running
        if not self._periodic and running is None:
            return
        cadence = self._cadence
        cadence.steps_since += record.steps
        soon = self._soon and cadence.steps_since >= cadence.retry_after  # a failing census still backs off
        if running is None and (soon or (cadence.steps_since >= cadence.next_look and cadence.due(self._agent))):
            self._soon = False
            running = self._begin(record.step, record.allocator)
        if running is not None:
            self.worked_at_step = record.step
            self._advance(running, self._in_step_end)
            self.step_end_seconds = self._clock() - self._step_end_began
            if not running.over and self._agent is not None:
                self._agent.sample_within(1)  # the next slices at the next step end
        if cadence.every > 0 and self._agent is not None:
            # a forced cadence means those steps: have the agent sample the step the next one is due at
            self._agent.sample_within(max(cadence.every, cadence.retry_after) - cadence.steps_since)

    def _share(self, seconds_per_step: float) -> float:
        return census_share(self._budget, other_share(self._agent, seconds_per_step))

    def take_soon(self) -> None:
        """Begin a census at the next step end, run in slices as a periodic one (and the next periodic
        one an interval after it): a confirmed leak finding asks for one, so the census's figures
        (the state's, the demo's, an OOM report's comparison) show the growth the finding states. One
        under way already is that census."""
        if self._running is None and self._periodic and self._agent is not None:
            self._soon = True
            self._agent.sample_within(1)

    def take_now(self) -> Census:
        """Run a census now, whole (one under way is dropped: this one is newer), keep it with the
        recent ones and publish it."""
        with self._lock:
            self._drop_running()
        return run_to_end(self.census_now(in_step_end=False))

    def census_now(self, *, in_step_end: bool = True) -> Stepwise[Census]:
        """A census for a culprit search at a step end: the one under way (whatever step it began at:
        it is the freshest there will be soon) or a new one, run a step end's share at a time between
        the search's yields (``in_step_end`` False: whole, for ``take_now``). Raises RuntimeError when
        the census fails."""
        running = self._running
        if running is None:
            state = self._agent.state() if self._agent is not None else None
            running = self._begin(state.step if state else None, state.allocator if state else None,
                                  in_step_end=in_step_end)
        while True:
            self._advance(running, self._in_step_end if in_step_end else _always)
            if running.result is not None:
                return running.result
            if running.over:
                raise RuntimeError("gpumemd: the census failed or was dropped; see the gpumemd log")
            yield

    def take_outside_step(self) -> Census:
        """A census asked for outside a step end: by the job (``Agent.census()``) or at an OOM, while
        the failing frames still hold their tensors. It runs whole (a census under way is dropped: this
        one is newer). Unlike a step's census it compares with the published census (the job's own
        censuses included), names holders even without one (the largest groups then), counts its time
        as training-thread time too (no step end clocks it), and raises what the census raised: the
        caller says why it has none."""
        agent = self._agent
        state = agent.state() if agent is not None else None
        step, allocator = (state.step, state.allocator) if state else (None, None)
        with self._lock:
            self._drop_running()
            previous = agent.published.census if agent is not None else None
            started = self._clock()
            self._cadence.steps_since = 0
            try:
                census = run_to_end(self._work(agent, step, allocator, previous, outside_step=True,
                                               in_step_end=False))
            except Exception:
                self._account(agent, self._clock() - started, outside_step=True)
                self._cadence.finished(self._clock() - started, failed=True)
                self._cadence.back_off()
                raise  # the caller reports it (the OOM report's census note, the job's own call)
            cost = self._clock() - started
            census = dataclasses.replace(census, duration_s=cost)  # its time, kept by whoever runs it
            self._account(agent, cost, outside_step=True)
            self._cadence.finished(cost)
            self._remember(census)
        self._publish(census)
        return census

    # --- a census under way ------------------------------------------------------------------

    def _in_step_end(self, heap_pass: bool) -> bool:
        """Whether the next slice runs in this step end: a slice of a few ms while it has paid less
        than ``CENSUS_SLICE_S``, a heap pass (the holder lookups) only early in it."""
        limit = HEAP_PASS_START_S if heap_pass else CENSUS_SLICE_S
        return self._clock() - self._step_end_began < limit

    def _begin(self, step: int | None, allocator: Sequence[AllocatorSample] | None, *,
               in_step_end: bool = True) -> _Running:
        """A census under way from here; the next is due ``interval`` steps after this one began."""
        with self._lock:
            agent = self._agent
            previous = self._recent[-1] if self._recent else None
            work = self._work(agent, step, allocator, previous, outside_step=False, in_step_end=in_step_end)
            running = self._running = _Running(work, hold_automatic())
            self._cadence.began()
        return running

    def _advance(self, running: _Running, go_on: Callable[[bool], bool]) -> None:
        """Run slices of ``running``: one, then more while ``go_on(next is a heap pass)``; finish or
        fail it at its end."""
        census: Census | None = None
        first = True
        while not running.over and (first or go_on(running.heap_pass_next)):
            first = False
            with self._lock:
                if running is not self._running:
                    running.over = True  # dropped by a census outside a step
                    break
                started = self._clock()
                try:
                    with collector_paused():  # its allocations must not set off a collection of the job's heap
                        running.heap_pass_next = next(running.work) is HEAP_PASS
                except StopIteration as done:
                    census = done.value
                    running.end()
                except Exception as exc:  # noqa: BLE001 - the job comes first: back off and carry on
                    running.end()
                    self._fail(exc)
                cost = self._clock() - started
                running.cost += cost
                self._account(self._agent, cost, outside_step=False)
                if census is not None:  # its slices' time, kept here (the census keeps no clock)
                    census = running.result = dataclasses.replace(census, duration_s=running.cost)
                if running.over:
                    self._running = None
                    self._cadence.finished(running.cost, failed=census is None)
                    if census is not None:
                        self._remember(census)
        if census is not None:
            self._publish(census)

    def _fail(self, exc: Exception) -> None:
        retry_after = self._cadence.back_off()
        level = logging.WARNING if retry_after == 2 else logging.DEBUG  # said once
        log.log(level, "gpumemd: census failed (%s: %s); next try in %d steps", type(exc).__name__, exc,
                retry_after)

    def _drop_running(self) -> None:
        """Under the lock: drop the census under way (its generator releases what it held)."""
        running, self._running = self._running, None
        if running is not None:
            running.end()

    def _publish(self, census: Census) -> None:
        agent = self._agent
        if agent is not None:
            agent.publish(census=census, censuses_total=agent.state().censuses_total + 1)

    def _work(self, agent: AgentView | None, step: int | None, allocator: Sequence[AllocatorSample] | None,
              previous: Census | None, *, outside_step: bool, in_step_end: bool) -> Hinted[Census]:
        models = list(agent.models) if agent is not None else []
        optimizers = list(agent.optimizers) if agent is not None else []
        # Holders only for what grew since the previous census: a step's first one has nothing to
        # compare. Outside a step (an OOM) the largest groups get theirs too: there is no later chance.
        holders = self._holders if previous is not None or outside_step else 0
        # In step ends the lookups are bounded with the step end's other work and the graph walk is
        # sliced; a census run whole (an OOM, the job's own call, take_now) has its full budgets.
        in_step = agent is not None and in_step_end
        request = CensusRequest(step=step, allocator=allocator, previous=previous, holders=holders,
                                holders_largest=outside_step,
                                pause_s=STEP_END_PAUSE_S if in_step else None,
                                slice_started=(lambda: self._step_end_began) if in_step else None,
                                graph_slice_nodes=GRAPH_SLICE_NODES if in_step else None)
        return self._census_fn(request, models=models, optimizers=optimizers)

    def _account(self, agent: AgentView | None, cost: float, *, outside_step: bool) -> None:
        if agent is not None:
            agent.add_census_seconds(cost)
            if outside_step:
                agent.add_thread_seconds(cost)  # training-thread time that no step end clocked

    # --- recent censuses ----------------------------------------------------------------------

    def _remember(self, census: Census) -> None:
        recent = self._recent
        recent.append(census)
        if len(recent) > self._keep:
            # Drop the inner census closest to its predecessor: the kept ones spread over the run.
            def gap(i: int) -> float:
                a, b = recent[i - 1], recent[i]
                return float(b.step - a.step) if a.step is not None and b.step is not None else b.taken_at - a.taken_at

            victim = min(range(1, len(recent) - 1), key=gap)
            del recent[victim]

    def recent_censuses(self) -> list[Census]:
        """The kept censuses, oldest first (the newest is the published one)."""
        with self._lock:
            return list(self._recent)

    def at_or_after(self, step: int) -> Census | None:
        """The earliest kept census taken at ``step`` or later, or None."""
        with self._lock:
            for census in self._recent:
                if census.step is not None and census.step >= step:
                    return census
        return None


def _always(heap_pass: bool) -> bool:
    return True
