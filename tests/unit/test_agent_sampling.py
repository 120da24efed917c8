"""Which steps the agent samples: every step while it fits the budget, every Nth on fast steps.

A manual clock drives the agent; a stand-in component makes each sampled step end cost what the test
says, so the stride follows from the arithmetic, not from this machine's speed."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from fakes import ManualClock as Clock

from gpumemd import budget
from gpumemd.agent import MAX_STRIDE, Agent
from gpumemd.api import build_agent
from gpumemd.config import Config
from gpumemd.records.step import StepRecord
from gpumemd.step_log import QUICK_MAX
from gpumemd.stride import SPARSE_STRETCH


class Costly:
    """A component whose on_step takes ``cost`` seconds of the manual clock; it records what it saw."""

    name = "costly"

    def __init__(self, clock: Clock, cost: float) -> None:
        self.clock = clock
        self.cost = cost
        self.records: list[StepRecord] = []
        self.eves: list[int] = []  # agent.steps_total at each on_eve
        self.agent: Agent | None = None

    def start(self, agent: Agent) -> None:
        self.agent = agent

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)
        self.clock.now += self.cost

    def on_eve(self) -> None:
        assert self.agent is not None
        self.eves.append(self.agent.steps_total)

    def stop(self) -> None:
        pass


def _run(out_dir: str, *, step_s: float, cost_s: float, steps: int, kind: type[Costly] = Costly,
         max_stride: int | None = None, **config: Any) -> tuple[Agent, Costly]:
    clock = Clock(100.0)
    component = kind(clock, cost_s)
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0, nvml=False, **config),
                  components=[component], clock=clock, wall_clock=clock, max_stride=max_stride)
    agent.start()
    try:
        for _ in range(steps):
            clock.now += step_s
            agent.mark_step()
    finally:
        agent.stop()
    return agent, component


def test_slow_steps_are_all_sampled(out_dir: str) -> None:
    # 100 µs per sampled end against a 1 s step: far inside the budget
    agent, costly = _run(out_dir, step_s=1.0, cost_s=1e-4, steps=50)
    assert [r.step for r in costly.records] == list(range(50))
    assert all(r.steps == 1 for r in costly.records) and agent.stride == 1
    assert agent.seconds_per_step == pytest.approx(1.0)


def test_fast_steps_are_sampled_every_nth_and_every_step_is_counted(out_dir: str) -> None:
    # 1 ms steps, 60 µs per sampled end: step ends may take 1% x 0.75 x 0.25 x 1 ms = 1.9 µs per step -> N = 10
    # (the most the leak detector allows), and even that is over the share (N would be 32): between two
    # full step ends, quick ones read the probes and leave the record and the components to the next full one
    agent, costly = _run(out_dir, step_s=1e-3, cost_s=60e-6, steps=200)
    records = agent.steps()  # every sampled step end's record, the quick ones' too
    assert [r.step for r in records[:3]] == [0, 1, 2]  # every step until the cost is known
    assert agent.stride == MAX_STRIDE and all(r.steps == MAX_STRIDE for r in records[4:])
    assert sum(r.steps for r in records) == records[-1].step + 1  # no step missing, none twice
    full = [r.step for r in costly.records]  # on_step sees the full step ends only
    assert set(full) < {r.step for r in records} and len(full) < len(records) / 2
    assert all(b - a <= (QUICK_MAX + 1) * MAX_STRIDE for a, b in itertools.pairwise(full[3:]))
    state = agent.state()
    assert state.steps_total == 200 and state.step == 199 and state.overhead.samples == len(records)
    # a record's duration is the mean step time over the steps it stands for (the sampled end excluded)
    assert records[-1].duration_s == pytest.approx(1e-3)
    # the eve callback runs at the end of the step before each sampled one
    sampled_totals = {r.step + 1 for r in records}
    assert all(total + 1 in sampled_totals for total in costly.eves)


class Asking(Costly):
    """Asks, at its first full step end past step 100, for a step end 25 steps on."""

    asked_for: int | None = None

    def on_step(self, record: StepRecord) -> None:
        super().on_step(record)
        if self.asked_for is None and record.step > 100 and self.agent is not None:
            self.asked_for = record.step + 25
            self.agent.sample_within(25)


def test_a_step_end_asked_for_runs_in_full_after_quick_ones(out_dir: str) -> None:
    """Quick step ends (every 10th step) come before the one asked for and leave the request standing:
    the component's step end runs when it asked, in full."""
    agent, component = _run(out_dir, step_s=1e-3, cost_s=60e-6, steps=400, kind=Asking)
    assert isinstance(component, Asking)
    full = [r.step for r in component.records]
    assert component.asked_for is not None and component.asked_for in full
    quick = {r.step for r in agent.steps()} - set(full)
    assert any(component.asked_for - 25 < q < component.asked_for for q in quick)


class Tracking(Costly):
    """Says a leak is only being tracked from its first full step end past step 200 to the first past 600
    (the leak component does at its evaluations); records the stride at each full step end."""

    def __init__(self, clock: Clock, cost: float) -> None:
        super().__init__(clock, cost)
        self.strides: list[tuple[int, int]] = []

    def on_step(self, record: StepRecord) -> None:
        super().on_step(record)
        assert self.agent is not None
        self.strides.append((record.step, self.agent.stride))
        self.agent.sample_sparsely(200 < record.step <= 600)


def test_sampled_step_ends_spread_out_while_a_leak_is_only_tracked(out_dir: str) -> None:
    # The budget would space full step ends ~32 steps apart (the test above): MAX_STRIDE caps it at 10
    # with quick step ends between; while a leak is only tracked, the cap is SPARSE_STRETCH x 10 = 40,
    # so the budget's stride holds; when tracking ends, the next plan is back to 10 at once.
    agent, component = _run(out_dir, step_s=1e-3, cost_s=60e-6, steps=1_000, kind=Tracking)
    assert isinstance(component, Tracking)
    records = agent.steps()
    assert sum(r.steps for r in records) == records[-1].step + 1  # no step missing, none twice
    tracked = [stride for step, stride in component.strides if 260 < step <= 600]
    assert tracked and len(set(tracked)) == 1 and 32 <= tracked[0] < MAX_STRIDE * SPARSE_STRETCH, component.strides
    after = [stride for step, stride in component.strides if step > 600]
    assert after and set(after[1:]) == {MAX_STRIDE}, component.strides
    assert all(r.steps == tracked[0] for r in records if 300 < r.step <= 600)


def test_a_stride_set_by_hand_does_not_spread_out(out_dir: str) -> None:
    _, component = _run(out_dir, step_s=1e-3, cost_s=60e-6, steps=400, kind=Tracking, max_stride=1)
    assert isinstance(component, Tracking)
    assert {stride for _, stride in component.strides} == {1}


def test_the_stride_shrinks_when_the_step_gets_slower(out_dir: str) -> None:
    # 5 ms steps, 30 µs per sampled end: step ends may take their share of the budget's clocked plan,
    # 1% x 0.75 x 0.25 = 0.1875% of 5 ms = 9.4 µs per step -> every 4th step
    assert budget.share(0.01, budget.Part.STEP_ENDS) == pytest.approx(0.001875)
    agent, costly = _run(out_dir, step_s=5e-3, cost_s=30e-6, steps=100)
    assert agent.stride == 4 and costly.records[-1].steps == 4
    assert costly.records == agent.steps()  # inside the share: every sampled step end is a full one


def test_a_pause_between_steps_is_not_step_time(out_dir: str) -> None:
    clock = Clock(100.0)
    component = Costly(clock, 0.0)
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0, nvml=False), components=[component],
                  clock=clock, wall_clock=clock)
    agent.start()
    try:
        for i in range(40):
            clock.now += 30.0 if i == 20 else 0.01  # one 30 s evaluation between two steps
            agent.mark_step()
        assert agent.seconds_per_step == pytest.approx(0.01)
    finally:
        agent.stop()


def test_phase_changes_and_components_get_the_steps_they_need(out_dir: str) -> None:
    clock = Clock(100.0)
    component = Costly(clock, 60e-6)
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0, nvml=False), components=[component],
                  clock=clock, wall_clock=clock)
    agent.start()
    try:
        for _ in range(50):
            clock.now += 1e-3
            agent.mark_step()
        assert agent.stride == MAX_STRIDE
        with agent.phase("eval"):
            clock.now += 1e-3
            agent.mark_step()  # the first step of a phase is sampled
        assert component.records[-1].phase == "eval"

        def step() -> StepRecord | None:
            clock.now += 1e-3
            return agent.mark_step()

        while step() is None:  # to a sampled step: the next one is MAX_STRIDE steps away...
            pass
        assert step() is None
        agent.sample_within(1)  # ...unless a component needs the end of the step under way
        record = step()
        assert record is not None and component.records[-1] is record
    finally:
        agent.stop()
