"""A census in slices: the real pass holds no tensor across a slice, and the component spreads a
costly census over step ends, each bounded, and lets a culprit search finish the one under way."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fakes import ManualClock
from test_census_component import CostlyCensus, _agent

from gpumemd.agent import Agent
from gpumemd.components.census_component import CENSUS_SLICE_S, CensusComponent, CensusOptions
from gpumemd.probes.census.census_steps import CHUNK_TENSORS, CensusRequest, census_steps, take_census
from gpumemd.probes.heap.stepwise import HEAP_PASS, Hinted, run_to_end
from gpumemd.records.census import Census

SLICED = 3 * CHUNK_TENSORS  # enough anonymous tensors for a census of several slices


def _other_bytes(census: Any) -> int:
    return census.bytes_by_category()["other"]


def test_between_its_slices_a_census_holds_no_tensor_of_the_job() -> None:
    kept = [torch.zeros(25) for _ in range(SLICED)]  # 100 B each, one storage each
    base = [sys.getrefcount(t) for t in kept]
    previous = take_census(holders=0)
    work = census_steps(CensusRequest(holders=1, previous=previous))
    slices = 0
    while True:
        try:
            next(work)
        except StopIteration as done:
            census = done.value
            break
        slices += 1
        assert [sys.getrefcount(t) for t in kept] == base, f"a tensor held across slice {slices}"
    assert slices >= 3
    assert _other_bytes(census) >= SLICED * 100  # counted all the same


def test_tensors_freed_between_slices_are_not_counted_nor_kept_alive() -> None:
    kept = [torch.zeros(25) for _ in range(SLICED)]
    alive = [weakref.ref(t) for t in kept]
    with_them = _other_bytes(take_census(holders=0))
    work = census_steps(CensusRequest(holders=0))
    next(work)  # the heap pass is done: every tensor was seen
    kept.clear()  # the job drops them before the census counts them
    assert all(ref() is None for ref in alive)
    without = _other_bytes(run_to_end(work))
    assert with_them - without >= SLICED * 100


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def _component(clock: ManualClock, census: Any, every: int = 0) -> CensusComponent:
    return CensusComponent(CensusOptions(census_every_steps=every, overhead_budget=0.01), census_fn=census,
                           clock=clock)


def _pauses(out_dir: str, component: CensusComponent, clock: ManualClock, steps: int) -> tuple[Agent, list[float]]:
    """Run ``steps`` steps of 1 s; what each step end cost (the census's slices move the clock)."""
    agent = _agent(out_dir, component, clock)
    agent.start()
    paused = []
    try:
        for _ in range(steps):
            clock.now += 1.0
            before = clock.now
            agent.mark_step()
            paused.append(round(clock.now - before, 9))
    finally:
        agent.stop()
    return agent, paused


def test_a_costly_census_is_spread_over_step_ends_each_a_bounded_pause(clock: ManualClock, out_dir: str) -> None:
    census = CostlyCensus(clock, cost=1.0, slices=50)  # 20 ms slices, 1 s in all
    agent, paused = _pauses(out_dir, _component(clock, census), clock, 12)
    assert census.steps == [0]  # one census, of the step it began at
    busy = [p for p in paused if p > 0]
    assert len(busy) >= 6 and max(busy) <= CENSUS_SLICE_S + 0.02 + 1e-9, paused
    assert abs(sum(busy) - census.cost) < 1e-6  # the slices, and nothing else, took the step ends' time
    assert agent.state().censuses_total == 1 and agent.state().census is not None
    assert agent.state().census.step == 0


@pytest.fixture
def under_way(clock: ManualClock, out_dir: str) -> Iterator[tuple[CostlyCensus, CensusComponent, Agent]]:
    """An agent whose first census (1 s in 20 ms slices) began at step 0 and is under way."""
    census = CostlyCensus(clock, cost=1.0, slices=50)
    component = _component(clock, census)
    agent = _agent(out_dir, component, clock)
    agent.start()
    try:
        clock.now += 1.0
        agent.mark_step()  # step 0: the first census begins and runs a step end's share
        assert census.steps == [] and component._running is not None
        yield census, component, agent
    finally:
        agent.stop()


def test_a_culprit_search_finishes_the_census_under_way(under_way: Any) -> None:
    census, component, agent = under_way
    assert gc.get_threshold()[0] == 0  # automatic collections wait while its objects live across steps
    result = run_to_end(component.census_now())
    assert gc.get_threshold()[0] > 0
    assert census.attempts == [0] and result.step == 0  # that census, not a new one
    assert agent.state().census is result and component._running is None


def test_a_census_outside_a_step_drops_the_one_under_way(under_way: Any, clock: ManualClock) -> None:
    census, component, agent = under_way
    census.slices = 1
    outside = component.take_outside_step()  # the job's Agent.census(), or an OOM
    for _ in range(5):
        clock.now += 1.0
        agent.mark_step()
    assert census.attempts[:2] == [0, 0] and census.steps == [0]  # the dropped one never finished
    assert agent.state().census is outside and agent.state().censuses_total == 1
    assert gc.get_threshold()[0] > 0  # the dropped census let go of its hold


def _graph_census(slice_nodes: int | None, model: torch.nn.Module) -> Any:
    return run_to_end(census_steps(CensusRequest(holders=0, graph_slice_nodes=slice_nodes), models=[model]))


def test_the_graph_walk_in_slices_charges_what_one_walk_charges() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    losses = [model(torch.randn(4, 16)).pow(2).mean() for _ in range(300)]  # ~6 nodes each: 300 roots
    whole = _graph_census(None, model)
    sliced = _graph_census(200, model)  # ~30 graphs a slice
    assert not whole.graph_truncated and not sliced.graph_truncated
    assert sliced.bytes_by_category()["graph"] == whole.bytes_by_category()["graph"] > 300 * 4 * 16 * 4
    del losses


def test_a_graph_slice_in_a_step_end_ends_with_the_step_ends_pause() -> None:
    """Nodes cost 7-35 µs by machine and model, so a node bound alone does not bound the pause: a
    slice takes no further root once the step end has paid ``pause_s``, and misses none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    losses = [model(torch.randn(4, 16)).pow(2).mean() for _ in range(300)]
    clock = ManualClock(now=0.0)
    began = [0.0]

    def tick() -> float:  # each root's walk "costs" 1 ms: the stop check is one clock read per root
        clock.now += 0.001
        return clock.now

    request = CensusRequest(holders=0, graph_slice_nodes=None, pause_s=0.2, slice_started=lambda: began[0],
                            clock=tick)
    census = census_steps(request, models=[model])
    paid: list[float] = []
    try:
        while True:
            began[0] = clock.now  # a new step end
            next(census)
            paid.append(clock.now - began[0])
    except StopIteration as done:
        sliced = done.value
    walking = [p for p in paid if p > 0]  # the graph slices: 300 roots at 1 ms in 0.2 s pauses
    assert len(walking) >= 2 and max(walking) <= 0.2 + 0.002, paid  # one root past the pause at most
    whole = _graph_census(None, model)
    assert not sliced.graph_truncated
    assert sliced.bytes_by_category()["graph"] == whole.bytes_by_category()["graph"]
    del losses


def test_a_graph_larger_than_a_slice_is_walked_that_far_and_said_to_be_cut() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 256))
    y = torch.zeros(4, dtype=torch.long)
    total = torch.zeros(())
    for _ in range(200):  # one chain; each step's log_softmax output (4 KiB) has no Python wrapper
        total = total + torch.nn.functional.cross_entropy(torch.randn(4, 16) @ w, y)
    whole = run_to_end(census_steps(CensusRequest(holders=0, graph_slice_nodes=None)))
    cut = run_to_end(census_steps(CensusRequest(holders=0, graph_slice_nodes=300)))
    assert not whole.graph_truncated and cut.graph_truncated
    assert 0 < cut.bytes_by_category()["graph"] < whole.bytes_by_category()["graph"]
    del total


def test_a_job_that_stops_with_a_census_under_way_gets_its_collector_back(under_way: Any) -> None:
    _, component, agent = under_way
    agent.stop()
    assert component._running is None and gc.get_threshold()[0] > 0


def test_a_census_taken_now_is_a_new_one_not_the_one_under_way(under_way: Any) -> None:
    census, component, agent = under_way
    census.slices = 1
    now = component.take_now()
    assert census.attempts == [0, 0] and census.steps == [0]  # begun anew; the older one dropped
    assert agent.state().census is now and component._running is None


def test_a_heap_pass_waits_for_an_early_moment_in_a_step_end(clock: ManualClock, out_dir: str) -> None:
    def census(request: CensusRequest, **kwargs: Any) -> Hinted[Census]:
        clock.now += 0.1  # the heap pass and the counting
        yield HEAP_PASS  # next: holder lookups, a heap scan that cannot be cut short
        clock.now += 0.15
        return Census(step=request.step, taken_at=clock.now, duration_s=0.25, groups=())

    agent, paused = _pauses(out_dir, _component(clock, census), clock, 3)
    assert paused[:2] == [0.1, 0.15]  # not 0.25 in one step end
    assert agent.state().censuses_total == 1


def test_a_forced_cadence_counts_from_where_each_census_began(clock: ManualClock, out_dir: str) -> None:
    census = CostlyCensus(clock, cost=0.45, slices=3)  # one 150 ms slice per step end: 3 step ends each
    _pauses(out_dir, _component(clock, census, every=5), clock, 17)
    assert census.attempts == [4, 9, 14] and census.steps == [4, 9, 14]
