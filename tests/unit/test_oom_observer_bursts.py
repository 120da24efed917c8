"""The CUDA OOM observer fires in bursts (cuDNN halving its workspace, each try an OOM
PyTorch catches itself). A burst takes one snapshot per step and second; the pending capture keeps the
latest call's numbers, the one whose OOM may propagate. The observer is called as PyTorch calls it:
``(device, alloc_size, allowed_memory_maximum or device_total, device_free)``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fakes import ManualClock as _Clock

from gpumemd.components.base import AgentView
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall

MiB = 2**20
GiB = 2**30


class _Probe(SnapshotProbe):
    """A CUDA build whose job has initialised CUDA; counts the snapshots and summaries taken."""

    def __init__(self) -> None:
        super().__init__()
        self.captures = 0
        self.summaries: list[int] = []

    def cuda_available(self) -> bool:
        return True

    def cuda_initialized(self) -> bool:
        return False  # no observer attached: the test calls ``observe`` as the trampoline would

    def capture(self) -> dict[str, Any] | None:
        self.captures += 1
        return {"segments": [], "device_traces": [[{"action": "oom", "size": 8 * MiB, "device_free": 0}]],
                "capture": self.captures}

    def memory_summary(self, device: int) -> str | None:
        self.summaries.append(device)
        return f"summary of device {device}"


class _Agent:
    running = True

    def __init__(self) -> None:
        self.steps_total = 41
        self.published: dict[str, object] = {}

    @property
    def current_step(self) -> int:
        return self.steps_total - 1  # the last step that ended: steps are numbered from 0

    def publish(self, **fields: object) -> None:
        self.published.update(fields)


@pytest.fixture
def setup() -> Iterator[tuple[OomComponent, _Probe, _Agent, _Clock]]:
    probe, agent, clock = _Probe(), _Agent(), _Clock(1000.0)
    wall = iter(range(1_000_000))
    component = OomComponent(OomOptions(oom_max_reports=5, oom_cooldown_s=0.0, record_history=False,
                                        history_max_entries=0),
                             snapshot_probe=probe, clock=clock, wall_clock=lambda: float(next(wall)),
                             census=CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01),
                                                    census_fn=census_steps))
    component.start(cast(AgentView, agent))
    try:
        yield component, probe, agent, clock
    finally:
        component.stop()


def _pending_call(component: OomComponent) -> ObserverCall:
    pending = component._captures.pending
    assert pending is not None
    return pending.call


def test_a_burst_in_one_step_takes_one_snapshot_and_keeps_the_last_calls_numbers(
        setup: tuple[OomComponent, _Probe, _Agent, _Clock]) -> None:
    component, probe, agent, clock = setup
    for i in range(50):  # cuDNN halving its workspace: 50 OOMs it catches, within a few milliseconds
        component.observe(0, (64 >> (i % 7)) * MiB, 80 * GiB, (3 + i) * MiB)
        clock.now += 0.001
    assert probe.captures == 1 and probe.summaries == [0]
    pending = component._captures.pending
    assert pending is not None and pending.snapshot is not None and pending.snapshot["capture"] == 1
    assert pending.memory_summary == "summary of device 0" and pending.steps_total == 41
    assert _pending_call(component) == ObserverCall(device=Device.cuda(0), requested_bytes=(64 >> (49 % 7)) * MiB,
                                                    total_or_cap_bytes=80 * GiB, device_free_bytes=52 * MiB,
                                                    wall_time=49.0)
    agent.steps_total += 1  # the next step: its OOM is another moment
    component.observe(0, 2 * MiB, 80 * GiB, 1 * MiB)
    assert probe.captures == 2
    pending = component._captures.pending
    assert pending is not None and pending.snapshot is not None and pending.snapshot["capture"] == 2
    assert pending.steps_total == 42 and _pending_call(component).requested_bytes == 2 * MiB


def test_a_step_that_never_ends_still_gets_a_fresh_snapshot_each_second(
        setup: tuple[OomComponent, _Probe, _Agent, _Clock]) -> None:
    component, probe, _, clock = setup  # a job that marks no steps: steps_total never moves
    component.observe(0, 8 * MiB, 80 * GiB, 3 * MiB)
    clock.now += 0.999
    component.observe(0, 4 * MiB, 80 * GiB, 3 * MiB)
    assert probe.captures == 1
    clock.now += 0.002  # 1.001 s after the snapshot: a stale one would miss this OOM's trace entry
    component.observe(0, 2 * MiB, 80 * GiB, 3 * MiB)
    assert probe.captures == 2
    pending = component._captures.pending
    assert pending is not None and pending.captured_at == clock.now


def test_another_device_in_the_window_reuses_the_snapshot_but_gets_its_own_summary(
        setup: tuple[OomComponent, _Probe, _Agent, _Clock]) -> None:
    component, probe, _, _ = setup
    component.observe(0, 8 * MiB, 80 * GiB, 3 * MiB)
    component.observe(1, 8 * MiB, 80 * GiB, 5 * MiB)  # the snapshot covers every device
    assert probe.captures == 1 and probe.summaries == [0, 1]
    pending = component._captures.pending
    assert pending is not None and pending.memory_summary == "summary of device 1"
    assert _pending_call(component).device == Device.cuda(1) and _pending_call(component).device_free_bytes == 5 * MiB


def test_no_snapshot_when_no_report_could_be_written(setup: tuple[OomComponent, _Probe, _Agent, _Clock]) -> None:
    component, probe, _, _ = setup
    component._written = component.config.oom_max_reports  # the cap is reached
    for _ in range(5):
        component.observe(0, 8 * MiB, 80 * GiB, 3 * MiB)
    assert probe.captures == 0
    pending = component._captures.pending
    assert pending is not None and pending.snapshot is None and pending.captured_at is None
    assert _pending_call(component).requested_bytes == 8 * MiB
