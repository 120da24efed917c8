"""CensusComponent cadence (deterministic: a manual clock and a census that "costs" what we say),
kept censuses and publishing."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from fakes import ManualClock

from gpumemd.agent import Agent
from gpumemd.api import build_agent, build_components
from gpumemd.budget import Part, clocked_plan, share
from gpumemd.components.base import ComponentBase
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.config import Config
from gpumemd.probes.census.census_steps import CensusRequest, census_steps
from gpumemd.probes.heap.stepwise import Stepwise
from gpumemd.records.census import Census


class CostlyCensus:
    """Stands in for census_steps: advances the clock by ``cost`` (in ``slices`` equal slices) and
    records the steps it ran at."""

    def __init__(self, clock: ManualClock, cost: float, slices: int = 1) -> None:
        self.clock = clock
        self.cost = cost
        self.slices = slices
        self.steps: list[int | None] = []
        self.attempts: list[int | None] = []
        self.holders: list[int] = []
        self.fail = False
        self.slice_costs: list[float] = []

    def __call__(self, request: CensusRequest, **kwargs: Any) -> Stepwise[Census]:
        self.attempts.append(request.step)
        return self._slices(request.step, request.holders)

    def _slices(self, step: int | None, holders: int) -> Stepwise[Census]:
        for i in range(self.slices):
            if i:
                yield
            self.clock.now += self.cost / self.slices
            self.slice_costs.append(self.cost / self.slices)
            if self.fail:
                raise RuntimeError("census broke")
        self.steps.append(step)
        self.holders.append(holders)
        return Census(step=step, taken_at=self.clock.now, duration_s=self.cost, groups=())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def _agent(out_dir: str, component: CensusComponent, clock: ManualClock, others: Sequence[Any] = ()) -> Agent:
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, overhead_budget=0.01)
    return build_agent(config, components=[component, *others], clock=clock, wall_clock=clock, max_stride=1)


@pytest.fixture
def run_steps(out_dir: str, clock: ManualClock) -> Iterator[Any]:
    agents: list[Agent] = []

    def run(component: CensusComponent, steps: int, step_seconds: float = 1.0, others: Sequence[Any] = ()) -> Agent:
        agent = _agent(out_dir, component, clock, others)
        agents.append(agent)
        agent.start()
        for _ in range(steps):
            clock.now += step_seconds
            agent.mark_step()
        return agent

    yield run
    for agent in agents:
        agent.stop()


def test_interval_adapts_so_census_time_stays_within_the_budget(clock: ManualClock, run_steps: Any) -> None:
    census = CostlyCensus(clock, cost=0.1)
    component = CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census,
                                clock=clock)

    agent = run_steps(component, 200)

    # step 0 measures the cost; then a census once the job ran 0.1 s / (1% less the part left for
    # what the agent cannot clock, 0.75%) = 13.3 s: every 14 steps (15 when float rounding leaves the
    # agent's other share a hair above zero).
    planned = clocked_plan(0.01)
    expected = math.ceil(0.1 / planned)
    steps = [s for s in census.steps if s is not None]
    assert steps[0] == 0
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert gaps and all(expected <= gap <= expected + 1 for gap in gaps), gaps
    assert component.interval in (expected, expected + 1)
    overhead = agent.state().overhead
    # census time per job time between the first and the last adaptive census: within the planned share
    assert (len(steps) - 2) * 0.1 / (steps[-1] - steps[1]) <= planned
    assert overhead.census_seconds_total == pytest.approx(len(census.steps) * 0.1)
    assert agent.state().censuses_total == len(census.steps)
    assert census.holders[0] == 0 and set(census.holders[1:]) == {3}  # holders only with a previous


def test_a_costlier_census_or_faster_steps_space_censuses_out_further(
    clock: ManualClock, run_steps: Any
) -> None:
    census = CostlyCensus(clock, cost=0.5)
    component = CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census,
                                clock=clock)

    run_steps(component, 300, step_seconds=0.5)

    # 0.5 s / 0.75% = 66.7 s of job time = 134 steps of 0.5 s
    expected = math.ceil(0.5 / clocked_plan(0.01) / 0.5)
    assert census.steps[:3] == [0, expected, 2 * expected]
    assert component.interval == expected


class Busy(ComponentBase):
    """Another component whose every sampled step end costs ``cost`` seconds of the manual clock."""

    name = "busy"

    def __init__(self, clock: ManualClock, cost: float) -> None:
        self.clock, self.cost = clock, cost

    def start(self, agent: Any) -> None: ...

    def stop(self) -> None: ...

    def on_step(self, record: Any) -> None:
        self.clock.now += self.cost


@pytest.mark.parametrize(("busy_share", "census_share"), [
    (0.004, clocked_plan(0.01) - 0.004),  # the others take 0.4% of the step: the census the rest of 0.75%
    (0.006, share(0.01, Part.CENSUS)),  # the others take more than their shares: the census its own share
])
def test_the_census_gets_what_the_rest_of_the_agent_leaves_of_the_plan(
    clock: ManualClock, run_steps: Any, busy_share: float, census_share: float
) -> None:
    census = CostlyCensus(clock, cost=0.1)
    component = CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census,
                                clock=clock)

    run_steps(component, 300, others=[Busy(clock, busy_share)])

    expected = math.ceil(0.1 / census_share)  # steps of 1 s
    gaps = [b - a for a, b in itertools.pairwise(s for s in census.steps if s is not None)]
    assert gaps and all(expected - 1 <= gap <= expected + 1 for gap in gaps), (expected, gaps)


def test_census_every_steps_forces_the_interval(clock: ManualClock, out_dir: str) -> None:
    census = CostlyCensus(clock, cost=5.0)  # far over budget: ignored when the interval is forced
    component = CensusComponent(CensusOptions(census_every_steps=3, overhead_budget=0.01), census_fn=census,
                                clock=clock)
    agent = _agent(out_dir, component, clock)
    agent.start()
    try:
        for _ in range(10):
            clock.now += 1.0
            agent.mark_step()
    finally:
        agent.stop()

    assert census.steps == [2, 5, 8]
    assert component.interval == 3


def test_a_failing_census_never_raises_and_backs_off(clock: ManualClock, run_steps: Any) -> None:
    census = CostlyCensus(clock, cost=0.01)
    census.fail = True
    component = CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census,
                                clock=clock)

    agent = run_steps(component, 8)

    assert census.steps == [] and census.attempts == [0, 2, 6]  # waits 2, then 4 steps
    assert agent.state().censuses_total == 0
    census.fail = False
    clock.now += 1.0
    agent.mark_step()  # step 8: not yet (8 steps after the last try are needed)
    assert census.steps == []


def test_kept_censuses_are_bounded_spread_and_searchable(clock: ManualClock, out_dir: str) -> None:
    census = CostlyCensus(clock, cost=0.0)
    component = CensusComponent(CensusOptions(census_every_steps=1, overhead_budget=0.01), keep=4, census_fn=census,
                                clock=clock)
    agent = _agent(out_dir, component, clock)
    agent.start()
    try:
        for _ in range(20):
            clock.now += 1.0
            agent.mark_step()
        kept = [c.step for c in component.recent_censuses() if c.step is not None]
        assert len(kept) == 4 and kept[0] == 0 and kept[-1] == 19  # oldest and newest survive
        assert kept == sorted(kept)
        found = component.at_or_after(5)
        assert found is not None and found.step is not None and found.step >= 5
        assert component.at_or_after(20) is None
        now = component.take_now()
        assert agent.state().census is now and component.recent_censuses()[-1] is now
    finally:
        agent.stop()


def test_census_component_is_registered_first_and_periodic_only_when_enabled(out_dir: str) -> None:
    on = build_components(Config(output_dir=out_dir))
    assert on and on[0].name == "census" and isinstance(on[0], CensusComponent) and on[0]._periodic
    off = build_components(Config(output_dir=out_dir, census=False))
    assert [c.name for c in off].count("census") == 1 and isinstance(off[0], CensusComponent)
    assert not off[0]._periodic  # no census at step ends; still the path for Agent.census() and OOMs


def test_the_component_must_keep_two_censuses() -> None:
    with pytest.raises(ValueError, match="keep=1"):
        CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census_steps, keep=1)
