"""Heap looks for a host leak's culprit keep to their share of the budget, measured in the job's step
time: a pause between steps (or wall time the job spends elsewhere) never makes them more frequent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fakes import ManualClock

from gpumemd import budget
from gpumemd.components.leak_host import HostLooks
from gpumemd.config import Config
from gpumemd.probes.heap.stepwise import run_to_end

LOOK_COST = 0.1  # seconds one heap look takes here
STEP = 0.01  # the job's typical step time


def look(component: HostLooks, step: int, agent: SimpleNamespace, *, force: bool = False) -> None:
    """One whole look, as the leak component's step ends run it (``look_stepwise``, to its end)."""
    run_to_end(component.look_stepwise(step, agent, force=force))


@pytest.fixture
def looks() -> tuple[HostLooks, SimpleNamespace, list[int]]:
    clock = ManualClock()
    seen: list[int] = []
    agent = SimpleNamespace(steps_total=0, seconds_per_step=STEP)

    def container_lengths() -> dict[int, int]:
        clock.now += LOOK_COST
        seen.append(agent.steps_total)
        return {}

    config = Config(output_dir="unused")
    component = HostLooks(window_steps=config.leak_window_steps, overhead_budget=config.overhead_budget, clock=clock,
                          container_lengths=container_lengths, largest_graph_nodes=lambda: 0)
    return component, agent, seen


def test_a_heap_look_waits_until_the_job_has_paid_for_the_last_within_its_share(
    looks: tuple[HostLooks, SimpleNamespace, list[int]],
) -> None:
    component, agent, seen = looks
    # 0.1 s per look at 0.1125% of the step time: one look per 88.9 s of job time, 8,889 steps of 10 ms.
    # The first is the baseline a host leak's culprit is named against: it is not waited for.
    allowed = budget.share(0.01, budget.Part.HOST_LOOKS)
    due = LOOK_COST / allowed / STEP
    assert 8_800 < due < 8_900
    for steps_total in (0, 2_000, 8_000, 8_880, 8_900, 12_000, 17_700, 17_800):
        agent.steps_total = steps_total
        look(component, steps_total, agent)
    assert seen == [0, 8_900, 17_800]


def test_time_between_steps_does_not_pay_for_a_look(
    looks: tuple[HostLooks, SimpleNamespace, list[int]],
) -> None:
    component, agent, seen = looks
    look(component, 0, agent)
    component._clock.now += 3600.0  # type: ignore[attr-defined]  # an hour outside the job's steps
    agent.steps_total = 2_000  # 20 s of steps: a look would cost 0.5% of them
    look(component, 2_000, agent)
    assert seen == [0]


def test_a_state_change_looks_at_once_whatever_the_budget(
    looks: tuple[HostLooks, SimpleNamespace, list[int]],
) -> None:
    component, agent, seen = looks
    look(component, 0, agent)
    agent.steps_total = 1_000  # two windows later, long before the budget allows a routine look
    look(component, 1_000, agent)
    look(component, 1_000, agent, force=True)
    assert seen == [0, 1_000]
