"""OOM capture with a real agent on real CPU training steps: oom_guard, excepthooks, the CUDA observer
(called as PyTorch calls it), cap and cooldown, frames released, and a disk that fails halfway."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import pickle
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fakes import ManualClock

import gpumemd
from gpumemd.agent import Agent
from gpumemd.api import build_agent
from gpumemd.components import oom_component as oom_module
from gpumemd.components.census_component import CensusComponent, CensusOptions
from gpumemd.components.oom_component import OomComponent, OomOptions
from gpumemd.config import Config
from gpumemd.probes.census.census_steps import census_steps
from gpumemd.probes.snapshots.snapshot import SnapshotProbe
from gpumemd.report import writer

MiB = 2**20
NEW_MESSAGE = (
    "CUDA out of memory. Tried to allocate 8.00 MiB. GPU 0 has a total capacity of 79.10 GiB of which "
    "3.00 MiB is free. Including non-PyTorch memory, this process has 79.09 GiB memory in use. Of the "
    "allocated memory 76.25 GiB is allocated by PyTorch, and 2.12 GiB is reserved by PyTorch but unallocated. "
    "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "to avoid fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _forward_then_oom(model: torch.nn.Module, keep: list[Any]) -> None:
    activations = model(torch.randn(64, 16))  # a local of the failing frame, like real activations
    keep.append(weakref.ref(activations))
    raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)


def _load(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "report.json"), encoding="utf-8") as f:
        return json.load(f)


def test_guard_writes_the_report_and_reraises_with_the_traceback(out_dir: str) -> None:
    model, opt = _model()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, sample_interval_s=0, nvml=False)
    _train(model, opt, 3)
    refs: list[Any] = []
    guard = gpumemd.oom_guard()
    with pytest.raises(torch.OutOfMemoryError) as info:
        with guard:
            _forward_then_oom(model, refs)
    assert [f.name for f in traceback.extract_tb(info.value.__traceback__)][-1] == "_forward_then_oom"
    assert str(info.value) == NEW_MESSAGE
    # The failing frame's locals were released after the report, while the exception is still held.
    gc.collect()
    assert refs[0]() is None
    assert agent.reports() == [guard.last_report]
    assert agent.state().ooms_total == 1
    path = agent.reports()[0]
    assert os.path.basename(path).startswith("oom-rank0-step000003-")
    assert sorted(os.listdir(path)) == ["report.html", "report.json", "report.md"]  # no CUDA: no snapshot
    report = _load(path)
    assert report["source"] == "oom_guard" and report["step"] == 3
    assert report["oom"]["kind"] == "cuda" and report["oom"]["requested_bytes"] == 8 * MiB
    assert report["breakdown"]["device"] == "cuda:0"
    # the three steps recorded, then the memory read at the OOM in the step that failed
    assert [(r["step"], r["at_oom"]) for r in report["timeline"]] == [(0, False), (1, False), (2, False), (3, True)]
    assert report["environment"]["torch"] == torch.__version__
    assert report["tensors"]["available"], report["tensors"]
    names = {t.get("name") for t in report["tensors"]["top"]}
    assert any(n and "weight" in n for n in names)


def test_guard_suppress_as_a_decorator_and_other_errors_untouched(out_dir: str) -> None:
    model, opt = _model()
    agent = gpumemd.attach(model=model, optimizer=opt, output_dir=out_dir, sample_interval_s=0, nvml=False,
                           oom_cooldown_s=0)

    @gpumemd.oom_guard(suppress=True)
    def step() -> str:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 1152921504606846976 bytes. Error code 12 (Cannot allocate memory)")

    assert step() is None
    assert len(agent.reports()) == 1
    assert _load(agent.reports()[0])["breakdown"]["device"] == "cpu"
    with pytest.raises(ValueError, match="not memory"):
        with gpumemd.oom_guard(suppress=True):
            raise ValueError("not memory")
    with pytest.raises(RuntimeError, match="overflowed"):
        with gpumemd.oom_guard(suppress=True):
            torch.empty((2**31, 2**31), dtype=torch.float32)
    assert len(agent.reports()) == 1 and agent.state().ooms_total == 1


def test_guard_without_an_agent_writes_nothing(tmp_path: Any) -> None:
    assert gpumemd.current() is None
    with pytest.raises(torch.OutOfMemoryError):
        with gpumemd.oom_guard():
            raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)
    with gpumemd.oom_guard(suppress=True) as guard:
        raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)
    assert guard.last_report is None
    assert list(tmp_path.iterdir()) == []


def test_a_report_on_request(out_dir: str) -> None:
    assert gpumemd.oom_report() is None  # no agent: nothing to report from
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, nvml=False)
    path = gpumemd.oom_report()
    assert path is not None and agent.reports() == [path]
    report = _load(path)
    assert report["source"] == "request" and report["exception"]["type"] == "none"
    assert agent.state().ooms_total == 0  # a request is not an OOM
    caught = torch.cuda.OutOfMemoryError(NEW_MESSAGE)
    second = gpumemd.oom_report(caught)  # explicit requests ignore the cooldown
    assert second is not None and _load(second)["oom"]["requested_bytes"] == 8 * MiB


def _census() -> CensusComponent:
    return CensusComponent(CensusOptions(census_every_steps=0, overhead_budget=0.01), census_fn=census_steps)


def _agent(out_dir: str, component: OomComponent, **over: Any) -> Agent:
    config = Config(output_dir=out_dir, sample_interval_s=0, nvml=False, census=False, leak_detection=False,
                    **over)
    return build_agent(config, components=[component]).start()


def test_cap_and_cooldown(out_dir: str) -> None:
    clock = ManualClock()
    options = Config(output_dir=out_dir, oom_max_reports=2, oom_cooldown_s=10).options(OomOptions)
    component = OomComponent(options, snapshot_probe=SnapshotProbe(), census=_census(), clock=clock)
    agent = _agent(out_dir, component)
    try:
        results = []
        for now in (0.0, 5.0, 11.0, 30.0):  # written, cooldown, written, cap
            clock.now = now
            results.append(component.handle(torch.cuda.OutOfMemoryError(NEW_MESSAGE), source="test"))
        assert [isinstance(r, str) for r in results] == [True, False, True, False]
        assert results[1] is True and results[3] is True  # OOMs, counted, not reported
        assert agent.state().ooms_total == 4
        assert len(agent.reports()) == 2 and len(os.listdir(out_dir)) == 2
        same = torch.cuda.OutOfMemoryError(NEW_MESSAGE)
        clock.now = 100.0
        assert component.handle(same, source="test") is True
        assert component.handle(same, source="again") is False  # one exception is one OOM
        assert agent.state().ooms_total == 5
    finally:
        agent.stop()


class _FakeCudaProbe(SnapshotProbe):
    """The probe as it behaves on a CUDA build: data from the hand-made snapshot (PyTorch's format)."""

    def __init__(self, snapshot: dict[str, Any]) -> None:
        super().__init__(torch_module=object())
        self.initialized = False
        self.snapshot = snapshot
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self.captures = 0

    def cuda_available(self) -> bool:
        return True  # a CUDA build: the component looks at step ends until the job initialises CUDA

    def cuda_initialized(self) -> bool:
        return self.initialized

    def capture(self) -> dict[str, Any] | None:
        self.captures += 1
        return self.snapshot

    def memory_summary(self, device: int) -> str | None:
        return f"memory summary of device {device}"

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        self.observers.append(observer)
        return True


def _snapshot() -> dict[str, Any]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "unit"))
    try:
        from oom_snapshot_data import make_snapshot
    finally:
        sys.path.pop(0)
    return make_snapshot(history=12)


def test_the_observer_attaches_lazily_and_its_capture_is_used(out_dir: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(oom_module, "_observer_installed", False)
    snap = _snapshot()
    probe = _FakeCudaProbe(snap)
    component = OomComponent(Config(output_dir=out_dir, oom_cooldown_s=0).options(OomOptions), snapshot_probe=probe,
                             census=_census())
    agent = _agent(out_dir, component)
    try:
        agent.mark_step()
        assert probe.observers == []  # the job has not initialised CUDA: we must not either
        probe.initialized = True
        agent.mark_step()
        agent.mark_step()
        assert len(probe.observers) == 1
        observer = probe.observers[0]
        # PyTorch's call: (device, alloc_size, allowed_memory_maximum or device total, device_free)
        observer(0, 8 * MiB, 40 * MiB, 3 * MiB)
        assert probe.captures == 1
        path = component.handle(torch.cuda.OutOfMemoryError(NEW_MESSAGE), source="test")
        assert isinstance(path, str)
        with open(os.path.join(path, "snapshot.pickle"), "rb") as f:
            assert f.read() == pickle.dumps(snap)
        report = _load(path)
        assert report["snapshot"]["source"] == "oom_observer"
        assert report["observer"]["total_or_cap_bytes"] == 40 * MiB
        assert report["breakdown"]["total_bytes"] == 40 * MiB
        assert report["breakdown"]["allocated_bytes"] == 14 * MiB + 512  # from the snapshot, not the 3rd arg
        assert report["breakdown"]["verdict"] == "fragmentation"
        assert report["memory_summary"] == "memory summary of device 0"
        # The observer fires without an exception (cuDNN retry), then a step completes: dropped.
        observer(0, 8 * MiB, 40 * MiB, 3 * MiB)
        agent.mark_step()
        late = component.handle(torch.cuda.OutOfMemoryError(NEW_MESSAGE), source="test")
        assert isinstance(late, str)
        assert _load(late)["snapshot"]["source"] == "report_time"
    finally:
        agent.stop()
    observer(0, 8 * MiB, 40 * MiB, 3 * MiB)  # after detach PyTorch still calls it: a no-op
    assert probe.captures == 3


def test_the_observer_never_raises(monkeypatch: Any) -> None:
    class Broken:
        def observe(self, *args: int) -> None:
            raise KeyError("boom")

    broken = Broken()
    monkeypatch.setattr(oom_module, "_observer_target", weakref.ref(broken))
    assert oom_module._trampoline(0, 1, 2, 3) is None


def test_uncaught_oom_in_a_thread_and_excepthooks_restored(out_dir: str, monkeypatch: Any) -> None:
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    monkeypatch.setattr(sys, "excepthook", lambda t, v, tb: seen.append(v))
    before_thread, before_sys = threading.excepthook, sys.excepthook
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, nvml=False, oom_cooldown_s=0)
    assert threading.excepthook is not before_thread and sys.excepthook is not before_sys

    def worker() -> None:
        raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)

    t = threading.Thread(target=worker, name="loader")
    t.start()
    t.join()
    assert len(seen) == 1 and isinstance(seen[0], torch.OutOfMemoryError)  # the previous hook still ran
    assert _load(agent.reports()[0])["source"] == "thread_excepthook"
    exc = torch.cuda.OutOfMemoryError(NEW_MESSAGE)
    sys.excepthook(type(exc), exc, None)
    assert seen[-1] is exc and len(agent.reports()) == 2
    gpumemd.detach()
    assert threading.excepthook is before_thread and sys.excepthook is before_sys


def test_disk_failure_halfway_keeps_the_users_exception_and_no_directory(out_dir: str, monkeypatch: Any) -> None:
    real = writer._write_file

    def failing(path: str, data: bytes) -> None:
        if path.endswith("report.md"):
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(writer, "_write_file", failing)
    agent = gpumemd.attach(output_dir=out_dir, sample_interval_s=0, nvml=False)
    original = torch.cuda.OutOfMemoryError(NEW_MESSAGE)
    with pytest.raises(torch.OutOfMemoryError) as info:
        with gpumemd.oom_guard():
            raise original
    assert info.value is original
    assert agent.reports() == [] and agent.state().ooms_total == 1
    assert os.listdir(out_dir) == []


def _allocator_fails(probe: _FakeCudaProbe, requested: int = 8 * MiB) -> None:
    """What the caching allocator does when cudaMalloc fails: the observers, then the raise."""
    for observer in probe.observers:
        observer(0, requested, 40 * MiB, 3 * MiB)  # (device, alloc_size, total or cap, device_free)
    raise torch.cuda.OutOfMemoryError(NEW_MESSAGE)


def _ooms_metric(agent: Agent) -> float:
    from gpumemd.exporter.collector import StateCollector

    samples = [s for m in StateCollector(agent.state).collect() for s in m.samples if s.name == "gpumemd_ooms_total"]
    assert len(samples) == 1
    return float(samples[0].value)


def test_an_oom_the_job_catches_is_counted_and_reported(out_dir: str, monkeypatch: Any,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpumemd.status")  # the exit line
    monkeypatch.setattr(oom_module, "_observer_installed", False)
    probe = _FakeCudaProbe(_snapshot())
    probe.initialized = True  # the job made its CUDA context: the observer is attached at start
    component = OomComponent(Config(output_dir=out_dir).options(OomOptions), snapshot_probe=probe, census=_census())
    agent = _agent(out_dir, component)
    model, opt = _model()
    skipped = []
    try:
        for step in range(8):  # a skip-the-batch loop, as in accelerate and the HF Trainer
            try:
                if step in (3, 5):
                    _allocator_fails(probe)  # step 5: the cooldown holds its report back
                _train(model, opt, 1)
            except torch.OutOfMemoryError:
                skipped.append(step)
        assert skipped == [3, 5]
        assert agent.state().ooms_caught == 2 and _ooms_metric(agent) == 2
    finally:
        agent.stop()
    assert "2 OOMs caught by the job, at steps 3 and 4" in caplog.text
    (path,) = agent.reports()
    report = _load(path)
    assert report["source"] == "caught" and report["outcome"].startswith("caught: the job caught this OOM")
    assert report["step"] == 3 and report["observer"]["requested_bytes"] == 8 * MiB
    assert report["snapshot"]["source"] == "oom_observer"
    with open(os.path.join(path, "report.md"), encoding="utf-8") as f:
        assert "Outcome: caught: the job caught this OOM" in f.read()
    from gpumemd.report.last_state import state_document

    state = state_document(agent.state(), written_at=0.0, seconds_per_step=None)  # the state file's content
    assert state["ooms_caught"] == 2 and state["oom_caught_steps"] == [3, 4] and state["ooms_total"] == 2


def test_a_burst_in_one_step_is_one_report_and_find_batch_size_tries_none(out_dir: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(oom_module, "_observer_installed", False)
    probe = _FakeCudaProbe(_snapshot())
    probe.initialized = True
    component = OomComponent(Config(output_dir=out_dir, oom_cooldown_s=0).options(OomOptions),
                             snapshot_probe=probe, census=_census())
    agent = _agent(out_dir, component)
    model, opt = _model()
    try:
        for requested in (64 * MiB, 32 * MiB, 16 * MiB):  # a job's own "retry smaller", in one step
            with contextlib.suppress(torch.OutOfMemoryError):
                _allocator_fails(probe, requested)
        _train(model, opt, 1)

        def try_batch(batch: int) -> None:
            if batch > 4:
                _allocator_fails(probe, batch * MiB)
            model(torch.randn(batch, 16)).sum().backward()

        assert gpumemd.find_batch_size(try_batch, start=16, max=16, device="cpu", budget_bytes=2**30,
                                       reset_fn=lambda: opt.zero_grad(set_to_none=True))[0] <= 4
        _train(model, opt, 2)
        assert agent.state().ooms_caught == 3 and agent.state().oom_caught_steps == (0,)
    finally:
        agent.stop()
    (path,) = agent.reports()
    assert _load(path)["observer"]["requested_bytes"] == 16 * MiB  # the burst's last call


def test_an_oom_caught_after_the_last_step_end_is_reported_at_detach(out_dir: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(oom_module, "_observer_installed", False)
    probe = _FakeCudaProbe(_snapshot())
    probe.initialized = True
    component = OomComponent(Config(output_dir=out_dir).options(OomOptions), snapshot_probe=probe, census=_census())
    agent = _agent(out_dir, component)
    model, opt = _model()
    try:
        _train(model, opt, 2)
        with contextlib.suppress(torch.OutOfMemoryError):  # eval code that gives up on a batch, then ends
            _allocator_fails(probe)
    finally:
        agent.stop()
    (path,) = agent.reports()
    assert _load(path)["source"] == "caught" and agent.state().ooms_caught == 1
