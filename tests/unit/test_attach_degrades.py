"""``attach()`` never raises into the job: a process psutil cannot read, a thread that cannot start or a
part that fails to start leaves the job running, with one line saying what is missing."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import gpumemd
from gpumemd.components.census_component import CensusComponent
from gpumemd.signal_endings import SignalEndings


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("gpumemd") and r.levelno >= level]


def _attach_with_a_failing(owner: type, method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           caplog: pytest.LogCaptureFixture) -> gpumemd.Agent:
    """attach() while ``owner.method`` raises as a process at its thread limit does."""
    def broken(*args: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(owner, method, broken)
    caplog.set_level(logging.INFO, logger="gpumemd")
    return gpumemd.attach(output_dir=str(tmp_path))


def test_psutil_that_cannot_read_the_process_leaves_host_totals_absent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def denied(*args: object, **kwargs: object) -> None:
        raise psutil.AccessDenied(pid=1)

    monkeypatch.setattr(psutil, "Process", denied)
    caplog.set_level(logging.INFO, logger="gpumemd")
    with gpumemd.attached(output_dir=str(tmp_path)) as agent:
        assert agent.running
        record = gpumemd.mark_step()
        assert record is not None and record.host is not None and record.host.rss_bytes > 0  # /proc/self/statm
    said = [line for line in _lines(caplog, logging.INFO) if "psutil cannot read this process" in line]
    assert len(said) == 2 and said[0].startswith("gpumemd: host RAM totals absent") and "AccessDenied" in said[0]
    assert said[1].startswith("gpumemd: watching ")  # the start line's "absent:" list says it where it is seen
    assert "absent: " in said[1] and "host RAM totals: psutil cannot read this process (AccessDenied" in said[1]


def test_a_sampler_thread_that_cannot_start_is_absent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("gpumemd"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    caplog.set_level(logging.INFO, logger="gpumemd")
    with gpumemd.attached(output_dir=str(tmp_path)) as agent:
        assert agent.running and gpumemd.mark_step() is not None
    said = [line for line in _lines(caplog, logging.INFO) if "can't start new thread" in line]
    assert len(said) == 2 and said[0].startswith("gpumemd: sampler thread absent")
    assert said[1].startswith("gpumemd: watching ")  # the start line's "absent:" list says it where it is seen
    assert "sampler thread: can't start new thread; readings are taken at sampled steps only" in said[1]


def test_a_part_that_fails_to_start_leaves_the_job_unwatched_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    agent = _attach_with_a_failing(CensusComponent, "start", tmp_path, monkeypatch, caplog)
    try:
        assert not agent.running and gpumemd.current() is None
        assert gpumemd.mark_step() is None  # the job's own calls are no-ops
        warnings = _lines(caplog, logging.WARNING)
        assert warnings == ["gpumemd: not attached (RuntimeError: can't start new thread); the job runs without "
                            "gpumemd"], warnings
    finally:
        gpumemd.detach()


def test_nvml_starts_on_the_sampler_thread_and_reads_at_once(tmp_path: Path) -> None:
    """nvmlInit loads the driver library (tens of ms; seconds without persistence mode): the sampler's
    thread pays it, not attach() on the training thread, and reads NVML as soon as it is up. With no
    sampler thread (``sample_interval_s=0``) it starts in attach, as before."""
    from fakes import FakeGpu, FakeNvml

    from gpumemd.api import build_agent
    from gpumemd.config import Config
    from gpumemd.probes.device.nvml import NvmlProbe

    inits: list[str] = []

    class Recording(FakeNvml):
        def nvmlInit(self) -> None:
            inits.append(threading.current_thread().name)

    for interval, thread in ((5.0, "gpumemd-sampler"), (0.0, threading.current_thread().name)):
        inits.clear()
        probe = NvmlProbe(nvml=Recording([FakeGpu()]), pid=1, visible="0", defer=True)
        assert inits == []  # built, not started
        agent = build_agent(Config(output_dir=str(tmp_path), sample_interval_s=interval, quiet=True),
                            nvml_probe=probe).start()
        try:
            deadline = time.monotonic() + 5.0  # the sampler's first tick follows nvmlInit at once
            while not agent.state().nvml and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the published state, which the sampler's thread writes
            assert inits == [thread]
            assert [s.device.cuda_index for s in agent.state().nvml] == [0]
        finally:
            agent.stop()


def test_an_agent_whose_start_failed_late_says_no_exit_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # installing the signal handlers comes after the components, the sampler and the first reading
    agent = _attach_with_a_failing(SignalEndings, "install", tmp_path, monkeypatch, caplog)
    try:
        assert not agent.running and gpumemd.current() is None
    finally:
        gpumemd.detach()
    said = _lines(caplog, logging.INFO)
    assert [line for line in said if line.startswith("gpumemd: not attached")] == [
        "gpumemd: not attached (RuntimeError: can't start new thread); the job runs without gpumemd"]
    assert not [line for line in said if "watched in" in line or "agent took" in line], said  # no exit summary


def test_a_torch_that_cannot_be_imported_leaves_the_job_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A broken install (torch missing, or its native libraries failing to load): the allocator is
    absent, saying why, and ``attach()`` returns; the job's own ``import torch`` reports the install.
    Before, the allocator probe raised, and so did the fallback ``attach()`` builds when an agent cannot
    start (it builds the same probes): ``gpumemd run`` died with a traceback of its own."""
    from gpumemd.probes.device.allocator import AllocatorProbe

    monkeypatch.setitem(sys.modules, "torch", None)  # ``import torch`` raises ModuleNotFoundError
    probe = AllocatorProbe()
    assert probe.read() == ()
    assert probe.health.absent_reason is not None and "torch cannot be imported (ModuleNotFoundError" in \
        probe.health.absent_reason
    caplog.set_level(logging.INFO, logger="gpumemd")
    agent = gpumemd.attach(output_dir=str(tmp_path))  # must not raise, whatever else needs torch
    try:
        lines = _lines(caplog, logging.INFO)
        started = [line for line in lines if line.startswith("gpumemd: watching ")]
        unwatched = [line for line in lines if "not attached" in line]
        assert len(started) + len(unwatched) == 1, lines
        assert not started or "allocator: torch cannot be imported" in started[0]
    finally:
        agent.stop()
