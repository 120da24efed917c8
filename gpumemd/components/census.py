"""Tensor censuses at step ends, spaced so the agent stays inside its overhead budget.

A census holds the GIL for tens to hundreds of milliseconds, so it cannot run every step. The next
census is due ``N = ceil(cost / (share x seconds per step))`` steps after the last one, where ``cost``
is what the last census took, ``share`` is ``gpumemd.budget.census_share``: the budget's clocked plan
less the rest of the agent's clocked cost per step (as a share of the step), at least the census's own
share of the plan, and the seconds per step are the agent's typical step time (the median of recent
sampled steps: a pause between steps, such as an evaluation loop or a checkpoint, is not step time). So
N adapts as the heap (cost) or the step time changes, and the census costs ``share`` of the *step time*,
which is what the job notices. ``census_every_steps > 0`` forces N instead. The first census runs at the
first step end (it measures the cost). A failing census is retried after 2, 4, 8... steps.

The component keeps a few recent censuses (thinned so they span the whole run, not just the last few
intervals) for the leak detector and the OOM report: ``recent_censuses()``, ``at_or_after(step)``
and ``take_now()``. It is the one way a census is taken: periodic ones, the leak detector's
``take_now()``, and ``take_outside_step()`` for the job's ``Agent.census()`` and the census at an OOM.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumemd.budget import STEP_END_PAUSE_S, census_share
from gpumemd.components.base import ComponentBase
from gpumemd.probes.gc_pause import collector_paused

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gpumemd.components.base import AgentView
    from gpumemd.records.census import Census
    from gpumemd.records.samples import AllocatorSample
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")

KEPT_CENSUSES = 8
"""Censuses kept (a census of a large model is ~1 MB of Python objects)."""

MAX_INTERVAL = 100_000
"""Never go longer than this many steps without a census."""


class CensusFn(Protocol):
    """``gpumemd.probes.census.take_census``, as the component calls it (tests give their own)."""

    def __call__(self, *, models: Sequence[object], optimizers: Sequence[object], step: int | None,
                 allocator: Sequence[AllocatorSample] | None, previous: Census | None, holders: int,
                 pause_s: float | None) -> Census: ...


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
        self._every = options.census_every_steps  # > 0 forces the cadence
        self._periodic = options.census
        self._budget = options.overhead_budget
        self._holders = holders
        self._keep = keep
        self._clock = clock
        self._census_fn = census_fn
        self._agent: AgentView | None = None
        self._lock = threading.Lock()  # take_now() may come from another component or thread
        self._recent: list[Census] = []
        self._steps_since = 0
        self._next_look = 0  # steps since the last census at which _due() looks again
        self._retry_after = 0  # steps to wait after a failed census (doubles each failure)
        self._last_cost: float | None = None

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
            self._recent.clear()

    # --- cadence -----------------------------------------------------------------------------

    @property
    def interval(self) -> int:
        """Steps between censuses: forced, or what the budget allows at the current step time."""
        if self._every > 0:
            return self._every
        seconds_per_step = self._agent.seconds_per_step if self._agent is not None else None
        if self._last_cost is None or not seconds_per_step:
            return 1 if self._last_cost is None else MAX_INTERVAL
        steps = math.ceil(self._last_cost / (self._share(seconds_per_step) * seconds_per_step))
        return max(1, min(MAX_INTERVAL, steps))

    def on_step(self, record: StepRecord) -> None:
        if not self._periodic:
            return
        self._steps_since += record.steps
        if self._steps_since >= self._next_look and self._due():
            self._take(record.step, record.allocator)
        if self._every > 0 and self._agent is not None:
            # a forced cadence means those steps: have the agent sample the step the next one is due at
            self._agent.sample_within(max(self._every, self._retry_after) - self._steps_since)

    def _due(self) -> bool:
        if self._steps_since < self._retry_after:
            return False
        if self._every > 0:
            return self._steps_since >= self._every
        if self._last_cost is None or self._steps_since >= MAX_INTERVAL:
            return True  # the first census measures the cost
        if not (self._agent is not None and self._agent.seconds_per_step):
            self._next_look = self._steps_since + 1  # the step time is not known yet: look again next time
            return False
        interval = self.interval
        # Not due: look again halfway to the interval computed now (on the samples between, one
        # comparison); step time and cost change slowly, so a few looks per census are enough.
        self._next_look = self._steps_since + max(1, (interval - self._steps_since) // 2)
        return self._steps_since >= interval

    def _share(self, seconds_per_step: float) -> float:
        return census_share(self._budget, _other_share(self._agent, seconds_per_step))

    def take_now(self) -> Census:
        """Run a census now (outside the cadence), keep it with the recent ones and publish it."""
        state = self._agent.state() if self._agent is not None else None
        census = self._take(state.step if state else None, state.allocator if state else None)
        if census is None:
            raise RuntimeError("gpumemd: the census failed; see the gpumemd log for the reason")
        return census

    def take_outside_step(self) -> Census:
        """A census asked for outside a step end: by the job (``Agent.census()``) or at an OOM, while
        the failing frames still hold their tensors. Unlike a step's census it compares with the
        published census (the job's own censuses included), names holders even without one (the
        largest groups then), counts its time as training-thread time too (no step end clocks it), and
        raises what the census raised: the caller says why it has none."""
        agent = self._agent
        state = agent.state() if agent is not None else None
        census = self._take(state.step if state else None, state.allocator if state else None, outside_step=True)
        assert census is not None  # outside a step, a failure raises
        return census

    def _take(self, step: int | None, allocator: Sequence[AllocatorSample] | None, *,
              outside_step: bool = False) -> Census | None:
        agent = self._agent
        with self._lock:
            previous = self._previous(agent, outside_step=outside_step)
            started = self._clock()
            try:
                census = self._run(agent, step, allocator, previous, outside_step=outside_step)
            except Exception as exc:  # the job comes first: back off and carry on
                self._account(agent, self._clock() - started, outside_step=outside_step)
                self._retry_after = min(MAX_INTERVAL, max(2, self._retry_after * 2))
                if outside_step:
                    raise  # the caller reports it (the OOM report's census note, the job's own call)
                level = logging.WARNING if self._retry_after == 2 else logging.DEBUG  # said once
                log.log(level, "gpumemd: census failed at step %s (%s: %s); next try in %d steps",
                        step, type(exc).__name__, exc, self._retry_after)
                return None
            self._remember(census)
            self._account(agent, self._clock() - started, outside_step=outside_step)
            self._retry_after = 0
        if agent is not None:
            agent.publish(census=census, censuses_total=agent.state().censuses_total + 1)
        return census

    def _previous(self, agent: AgentView | None, *, outside_step: bool) -> Census | None:
        if outside_step:
            return agent.published.census if agent is not None else None
        return self._recent[-1] if self._recent else None

    def _run(self, agent: AgentView | None, step: int | None, allocator: Sequence[AllocatorSample] | None,
             previous: Census | None, *, outside_step: bool) -> Census:
        models = list(agent.models) if agent is not None else []
        optimizers = list(agent.optimizers) if agent is not None else []
        # Holders only for what grew since the previous census: a step's first one has nothing to
        # compare. Outside a step (an OOM) the largest groups get theirs: there is no later chance.
        holders = self._holders if previous is not None or outside_step else 0
        # In a step end the census is one bounded pause; outside one (an OOM, the job's own call) the
        # holders are worth the wait: there is no later chance.
        pause_s = None if outside_step else STEP_END_PAUSE_S
        with collector_paused():  # its allocations must not set off a collection of the job's heap
            return self._census_fn(models=models, optimizers=optimizers, step=step, allocator=allocator,
                                   previous=previous, holders=holders, pause_s=pause_s)

    def _account(self, agent: AgentView | None, cost: float, *, outside_step: bool) -> None:
        self._last_cost = cost
        self._steps_since = 0
        self._next_look = 0
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
                if a.step is not None and b.step is not None:
                    return float(b.step - a.step)
                return b.taken_at - a.taken_at

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


def _other_share(agent: AgentView | None, seconds_per_step: float) -> float:
    """The rest of the agent's cost (training thread and sampler, censuses left out) per step, as a
    share of the job's step time."""
    if agent is None or seconds_per_step <= 0:
        return 0.0
    overhead = agent.overhead()
    if not overhead.steps:
        return 0.0
    other = overhead.seconds_total - overhead.census_seconds_total
    return max(0.0, other / overhead.steps / seconds_per_step)
