"""The OOM observer is in place from the job's first CUDA allocation: attached through torch's lazy-init
queue (``torch.cuda._lazy_call``), so an OOM in the first forward is captured at the moment. And a
capture only ever describes its own OOM: dropped at the next step end, never attached to a later OOM
of another step, another device or a moment long gone.

The fake ``torch.cuda`` below behaves as torch 2.13's does (``torch/cuda/__init__.py``): ``_lazy_call``
runs at once when CUDA is initialised and queues otherwise; ``_lazy_init`` runs the queue right after
``_cuda_init()`` with ``is_initialized()`` still False; the observer binding initialises CUDA; the
allocator calls the observers before raising ``OutOfMemoryError``."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from fakes import ManualClock
from oom_snapshot_data import NEW_MESSAGE, MiB, make_snapshot

from gpumemd.agent import Agent
from gpumemd.api import build_agent
from gpumemd.components import oom_component as oom_module
from gpumemd.components.base import AgentView
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_capture import CAPTURE_TTL_S, CaptureSlot
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.config import Config
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall


class _FakeCuda:
    def __init__(self) -> None:
        self.initialized = False
        self.initializing = False
        self.queued: list[Callable[[], None]] = []
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self.in_allocator_oom = False
        self.snapshots: list[dict[str, Any]] = []
        self.memory = SimpleNamespace(_snapshot=self._snapshot)

    def _lazy_call(self, fn: Callable[[], None], **kwargs: Any) -> None:
        if self.initialized:
            fn()
        else:
            self.queued.append(fn)

    def _lazy_init(self) -> None:
        if self.initialized or self.initializing:
            return
        self.initializing = True  # torch's _tls.is_initializing: re-entry returns at once
        try:
            for fn in self.queued:
                fn()  # is_initialized() is still False here, as in torch
        finally:
            self.initializing = False
        self.initialized = True

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return 1

    def attach(self, observer: Callable[[int, int, int, int], None]) -> None:
        self._lazy_init()  # the binding calls lazyInitDevice(CUDA)
        self.observers.append(observer)

    def _snapshot(self, device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
        snap = make_snapshot(history=4)
        snap["taken_inside_the_allocator"] = self.in_allocator_oom
        snap["fx"] = augment_with_fx_traces
        self.snapshots.append(snap)
        return snap

    def memory_summary(self, device: int) -> str:
        return f"summary of device {device}"

    def allocate(self, nbytes: int, device: int = 0) -> None:
        """A CUDA allocation: initialises CUDA on first use; past 40 MiB the observers run, then it raises."""
        self._lazy_init()
        if nbytes <= 8 * MiB:
            return
        self.in_allocator_oom = True
        try:
            for observer in self.observers:
                observer(device, nbytes, 40 * MiB, 3 * MiB)
        finally:
            self.in_allocator_oom = False
        raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)


def _fake_torch(cuda: _FakeCuda) -> Any:
    return SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_attach_out_of_memory_observer=cuda.attach),
                           version=SimpleNamespace(cuda="12.8", hip=None))


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The observer globals as in a process that never attached one."""
    monkeypatch.setattr(oom_module, "_observer_installed", False)
    monkeypatch.setattr(oom_module, "_observer_queued", False)
    monkeypatch.setattr(oom_module, "_observer_target", None)


def _census() -> CensusComponent:
    return CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census_steps)


def _start(out_dir: str, probe: SnapshotProbe, clock: ManualClock | None = None) -> tuple[OomComponent, Agent]:
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, census=False, leak_detection=False)
    component = OomComponent(config.options(OomOptions), snapshot_probe=probe, census=_census(),
                             **({"clock": clock} if clock is not None else {}))
    return component, build_agent(config, components=[component]).start()


def _report(component: OomComponent, job: Callable[[], None]) -> dict[str, Any]:
    with pytest.raises(torch.OutOfMemoryError):
        try:
            job()
        except torch.OutOfMemoryError as exc:  # what oom_guard does
            path = component.handle(exc, source="oom_guard")
            raise
    assert isinstance(path, str)
    with open(os.path.join(path, "snapshot.pickle"), "rb") as f:
        snapshot = pickle.load(f)
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        return {"report": json.load(f), "snapshot": snapshot}


def test_an_oom_in_the_first_forward_is_captured_by_the_observer(out_dir: str, fresh_process: None) -> None:
    cuda = _FakeCuda()
    component, agent = _start(out_dir, SnapshotProbe(torch_module=_fake_torch(cuda)))
    try:
        # attach() before the model moves to CUDA: queued, and CUDA left alone
        assert len(cuda.queued) == 1 and cuda.observers == [] and not cuda.initialized

        def first_forward() -> None:
            cuda.allocate(4 * MiB)  # model.cuda(): the job's first CUDA use runs the queue
            cuda.allocate(64 * MiB)  # the first forward's activations: OOM, no step has ended

        written = _report(component, first_forward)
        assert cuda.observers == [oom_module._trampoline]
        assert written["report"]["snapshot"]["source"] == "oom_observer"
        assert written["snapshot"]["taken_inside_the_allocator"] is True  # before the stack unwound
        assert written["snapshot"]["fx"] is True  # torch.compile frames mapped back where torch can
        assert len(cuda.snapshots) == 1  # the report used the observer's, took none of its own
        assert written["report"]["observer"]["requested_bytes"] == 64 * MiB
    finally:
        agent.stop()


def test_with_cuda_already_up_the_observer_attaches_at_once(out_dir: str, fresh_process: None) -> None:
    cuda = _FakeCuda()
    cuda.allocate(1)
    _, agent = _start(out_dir, SnapshotProbe(torch_module=_fake_torch(cuda)))
    try:
        assert cuda.observers == [oom_module._trampoline] and cuda.queued == []
    finally:
        agent.stop()
    component2, agent2 = _start(out_dir, SnapshotProbe(torch_module=_fake_torch(cuda)))  # a second attach
    try:
        assert len(cuda.observers) == 1  # torch keeps observers forever: never attached twice
        assert _report(component2, lambda: cuda.allocate(64 * MiB))["report"]["snapshot"]["source"] == "oom_observer"
    finally:
        agent2.stop()


def test_a_failing_attach_never_reaches_the_jobs_cuda_init(out_dir: str, fresh_process: None) -> None:
    cuda = _FakeCuda()
    torch_module = _fake_torch(cuda)

    def refuse(observer: Any) -> None:
        raise RuntimeError("cudaMallocAsync does not support attachOutOfMemoryObserver")

    torch_module._C._cuda_attach_out_of_memory_observer = refuse
    _, agent = _start(out_dir, SnapshotProbe(torch_module=torch_module))
    try:
        cuda.allocate(4 * MiB)  # torch would raise DeferredCudaCallError here if the queued call raised
        assert cuda.initialized and not oom_module._observer_installed
    finally:
        agent.stop()


# --- stale captures --------------------------------------------------------------------------------


class _Agent:
    running = True
    steps_total = 7

    def __init__(self) -> None:
        self.published: dict[str, Any] = {}

    @property
    def current_step(self) -> int:
        return self.steps_total - 1

    def state(self) -> Any:
        return SimpleNamespace(step=self.steps_total - 1, census=None, reports=())

    def publish(self, **changes: Any) -> None:
        self.published.update(changes)


def _component(clock: ManualClock, probe: SnapshotProbe) -> tuple[OomComponent, _Agent]:
    component = OomComponent(OomOptions(oom_max_reports=5, oom_cooldown_s=0.0, record_history=False,
                                        history_max_entries=0),
                             snapshot_probe=probe, census=_census(), clock=clock)
    agent = _Agent()
    component.start(cast(AgentView, agent))
    return component, agent


def test_the_next_step_end_settles_an_unclaimed_capture_as_caught(fresh_process: None) -> None:
    cuda = _FakeCuda()
    cuda.allocate(1)
    clock = ManualClock(100.0)
    component, agent = _component(clock, SnapshotProbe(torch_module=_fake_torch(cuda)))
    try:
        component.observe(0, 64 * MiB, 40 * MiB, 3 * MiB)  # the job catches it: no exception reaches us
        assert agent.published["ooms_caught"] == 1 and agent.published["oom_caught_steps"] == (7,)
        component.on_step(cast(Any, None))  # the same step: it may still propagate
        assert component._captures.pending is not None
        agent.steps_total += 1
        component.on_step(cast(Any, None))
        assert component._captures.pending is None  # settled as caught; the snapshot's memory is given back
        assert agent.published["ooms_total"] == 1
    finally:
        component.stop()


def test_a_capture_belongs_only_to_its_own_step_moment_and_device() -> None:
    slot = CaptureSlot()
    call = ObserverCall(Device.cuda(1), 64 * MiB, 40 * MiB, 3 * MiB, 0.0)

    def observe(now: float) -> None:
        slot.observe(call, steps_total=7, step=7, now=now, may_snapshot=True, snapshot=lambda: {"segments": []},
                     summary=lambda d: None)

    observe(100.0)
    assert slot.take(steps_total=7, now=100.5, device=Device.cuda(0)) is None  # the message names GPU 0
    observe(100.0)
    assert slot.take(steps_total=8, now=100.5, device=None) is None  # a step ended: recovered
    observe(100.0)  # a job that marks no steps (inference): the clock tells the moments apart
    assert slot.take(steps_total=7, now=100.0 + CAPTURE_TTL_S + 1, device=Device.cuda(1)) is None
    assert slot.pending is None  # and it was let go
    observe(100.0)
    taken = slot.take(steps_total=7, now=100.5, device=Device.cuda(1))
    assert taken is not None and taken.snapshot == {"segments": []}


def test_the_slot_is_written_under_its_lock() -> None:
    slot = CaptureSlot()
    held: list[bool] = []

    def snapshot() -> dict[str, Any]:
        held.append(slot._lock._is_owned())  # type: ignore[attr-defined]
        return {}

    slot.observe(ObserverCall(Device.cuda(0), 1, 2, 3, 0.0), steps_total=0, step=0, now=0.0, may_snapshot=True,
                 snapshot=snapshot, summary=lambda d: None)
    assert held == [True]


def test_a_stale_capture_is_not_attached_to_a_later_unrelated_oom(out_dir: str, fresh_process: None) -> None:
    cuda = _FakeCuda()
    clock = ManualClock(100.0)
    component, agent = _start(out_dir, SnapshotProbe(torch_module=_fake_torch(cuda)), clock=clock)
    try:
        cuda.allocate(4 * MiB)
        component.observe(0, 64 * MiB, 40 * MiB, 3 * MiB)  # recovered by the job, no step marked since
        clock.now += CAPTURE_TTL_S + 5
        written = _report(component, lambda: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError(NEW_MESSAGE)))
        assert written["report"]["snapshot"]["source"] == "report_time"
        assert written["snapshot"]["taken_inside_the_allocator"] is False
    finally:
        agent.stop()


# --- record_history: stacks from the first allocation ------------------------------------------------


class _RecordingCuda(_FakeCuda):
    """Records allocation history as torch does: only what is allocated while recording is on."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = False
        self.recorded: list[int] = []
        self.memory = SimpleNamespace(_snapshot=self._snapshot, _record_memory_history=self._record)

    def _record(self, enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
                max_entries: int = 0) -> None:
        self.recording = enabled is not None

    def allocate(self, nbytes: int, device: int = 0) -> None:
        self._lazy_init()
        if self.recording:
            self.recorded.append(nbytes)
        super().allocate(nbytes, device)


def _recording_torch(cuda: _RecordingCuda) -> Any:
    torch_module = _fake_torch(cuda)
    torch_module._C._cuda_isHistoryEnabled = lambda: cuda.recording
    return torch_module


def test_record_history_covers_the_first_forward(out_dir: str, fresh_process: None) -> None:
    cuda = _RecordingCuda()
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, census=False, leak_detection=False,
                    record_history=True)
    probe = SnapshotProbe(torch_module=_recording_torch(cuda))
    component = OomComponent(config.options(OomOptions), snapshot_probe=probe, census=_census())
    agent = build_agent(config, components=[component]).start()
    try:
        assert not cuda.initialized and not cuda.recording  # attach touched no CUDA
        with pytest.raises(torch.OutOfMemoryError):
            cuda.allocate(4 * MiB)  # the job's first CUDA use: history is on before this allocation
            cuda.allocate(64 * MiB)
        assert cuda.recorded == [4 * MiB, 64 * MiB]  # no step ever ended: still recorded from the start
    finally:
        agent.stop()
    assert not cuda.recording  # switched off with the component that switched it on


def test_a_history_queued_before_a_detach_stays_off(out_dir: str, fresh_process: None) -> None:
    cuda = _RecordingCuda()
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, census=False, leak_detection=False,
                    record_history=True)
    probe = SnapshotProbe(torch_module=_recording_torch(cuda))
    component = OomComponent(config.options(OomOptions), snapshot_probe=probe, census=_census())
    build_agent(config, components=[component]).start().stop()
    cuda.allocate(4 * MiB)  # CUDA comes up after the detach: the queued call runs and does nothing
    assert cuda.initialized and not cuda.recording and cuda.recorded == []
