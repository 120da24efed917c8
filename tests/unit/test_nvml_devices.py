"""NVML device selection and details on fake NVML in pynvml's call shapes:
CUDA_VISIBLE_DEVICES parsed as torch parses it, MIG instances, only the devices a rank uses, memory
info v2 and compute-process fallbacks."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes import FakeGpu, FakeNvml, Handle, NvmlError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumemd.api import build_agent
from gpumemd.config import Config
from gpumemd.exporter.collector import StateCollector
from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.probes.device.nvml_devices import parse_visible_devices, uuids_to_indices, visible_indices
from gpumemd.records.device import Device
from gpumemd.records.samples import AllocatorSample, NvmlDeviceSample
from gpumemd.records.step import NVML_PAIR_MAX_AGE_S, Identity, nvml_paired

GIB = 1 << 30


@pytest.mark.parametrize(("var", "expected"), [
    (None, None),
    ("", []),  # set but empty: no device at all, not every device
    ("1,0", [1, 0]),
    ("1gpu2,2ampere", [1, 2]),  # strtoul: the leading digits
    ("0,-1,1", [0]),  # a negative entry ends the list
    ("0,x,1", [0]),  # so does an unreadable one
    ("0,1,0", []),  # a repeated entry empties it
    ("GPU-1aa,GPU-0", ["GPU-1aa", "GPU-0"]),
    ("GPU-1aa,0", ["GPU-1aa"]),  # a list of UUIDs stops at the first entry without the prefix
    ("MIG-x,MIG-x", []),
])
def test_cuda_visible_devices_read_as_torch_reads_it(var: str | None, expected: list[Any] | None) -> None:
    assert parse_visible_devices(var) == expected


def test_uuid_prefixes_ambiguous_or_unknown_end_the_list() -> None:
    uuids = ["GPU-12aa", "GPU-13bb", "GPU-2ccc"]
    assert uuids_to_indices(["GPU-2", "GPU-12"], uuids) == [2, 0]
    assert uuids_to_indices(["GPU-2", "GPU-1", "GPU-12"], uuids) == [2]  # "GPU-1" is ambiguous
    assert uuids_to_indices(["GPU-2", "GPU-2c"], uuids) == []  # the same device twice
    nvml = FakeNvml(4, uuid_bytes=True)
    assert visible_indices(nvml, 4, "0,5,1") == [0]  # CUDA trims at the first ordinal past the last GPU
    assert visible_indices(nvml, 4, "GPU-3a,GPU-1") == [3, 1]


def test_mig_instances_are_read_not_their_parent() -> None:
    nvml = FakeNvml([FakeGpu(), FakeGpu(mig=[FakeGpu(10 * GIB, uuid="MIG-aaaa"), FakeGpu(10 * GIB, uuid="MIG-bbbb")])],
                    uuid_bytes=True)
    probe = NvmlProbe(nvml=nvml, pid=1, visible="MIG-bb")
    (sample,) = probe.read()
    assert sample.device == Device.cuda(0)
    assert sample.total_bytes == 10 * GIB  # the instance's 10 GiB, not the 80 GiB GPU
    assert NvmlProbe(nvml=nvml, pid=1, visible="MIG-zz").read() == ()


def test_memory_info_v2_excludes_driver_reserved_and_falls_back_once(caplog: pytest.LogCaptureFixture) -> None:
    (v2,) = NvmlProbe(nvml=FakeNvml([FakeGpu(reserved=GIB // 2)]), pid=1, visible="0").read()
    assert v2.used_bytes == GIB  # v1 would say 1.5 GiB: driver-reserved memory included
    probe = NvmlProbe(nvml=FakeNvml([FakeGpu(reserved=GIB // 2)], memory_v2=False), pid=1, visible="0")
    with caplog.at_level(logging.INFO, logger="gpumemd"):
        assert probe.read()[0].used_bytes == GIB + GIB // 2
        probe.read()
    assert sum("memory info v2 unavailable" in r.getMessage() for r in caplog.records) == 1


def test_compute_processes_v3_then_v2_said_once(caplog: pytest.LogCaptureFixture) -> None:
    probe = NvmlProbe(nvml=FakeNvml(1, processes={42: 3 * GIB}, processes_v3=False), pid=42, visible="0")
    with caplog.at_level(logging.INFO, logger="gpumemd"):
        assert probe.read()[0].process_used_bytes == 3 * GIB
        assert probe.read()[0].process_used_bytes == 3 * GIB
    said = [r.getMessage() for r in caplog.records if "ComputeRunningProcesses" in r.getMessage()]
    assert len(said) == 1 and "using nvmlDeviceGetComputeRunningProcesses_v2" in said[0]


def test_pid_namespace_note_only_where_this_process_has_a_context(caplog: pytest.LogCaptureFixture) -> None:
    """Before CUDA is up (or on another rank's GPU) this pid is not listed on bare
    metal either; only a device this process holds memory on can tell a PID namespace."""
    probe = NvmlProbe(nvml=FakeNvml(2, processes=dict.fromkeys((7, 8), 2 * GIB)), pid=42, visible="0,1")
    with caplog.at_level(logging.INFO, logger="gpumemd"):
        probe.read()
        assert not any("PID namespace" in r.getMessage() for r in caplog.records)
        probe.read({1}, has_context=True)
    assert sum("PID namespace" in r.getMessage() for r in caplog.records) == 1


def test_torchrun_rank_reads_only_its_gpu_and_exports_at_most_40_series(
        monkeypatch: pytest.MonkeyPatch, out_dir: str) -> None:
    """Eight ranks each reading all eight GPUs gave 8x the series per rank."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    identity = Identity(rank=11, local_rank=3, world_size=16, source="torchrun")
    agent = build_agent(Config(output_dir=out_dir, sample_interval_s=0, census=False),
                  nvml_probe=NvmlProbe(nvml=FakeNvml(8, processes={99: 2 * GIB}), pid=12345, visible=None),
                  identity=identity).start()
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        agent.tick()
        state = agent.state()
        assert [n.device for n in state.nvml] == [Device.cuda(3)]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StateCollector(agent.state))
        text = generate_latest(registry).decode()
        series = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        assert len(series) <= 40, len(series)
        assert {s.labels.get("device") for s in series if "device" in s.labels} == {"3"}
    finally:
        agent.stop()


class _OneDeviceRefusesV3(FakeNvml):
    """Device 1 answers only the v2 process call (a MIG instance or another driver mode on some drivers),
    and device 2's memory call fails (a GPU fallen off the bus)."""

    def nvmlDeviceGetComputeRunningProcesses(self, h: Handle) -> list[SimpleNamespace]:
        self.v3_calls = getattr(self, "v3_calls", 0) + 1
        if h.path[0] == 1:
            raise NvmlError("Not Supported")
        return super().nvmlDeviceGetComputeRunningProcesses(h)

    def nvmlDeviceGetMemoryInfo(self, h: Handle, version: int | None = None) -> SimpleNamespace:
        if h.path[0] == 2:
            raise NvmlError("GPU is lost")
        return super().nvmlDeviceGetMemoryInfo(h, version)


def test_one_devices_errors_cost_only_that_device() -> None:
    nvml = _OneDeviceRefusesV3(3, processes={42: 3 * GIB})
    probe = NvmlProbe(nvml=nvml, pid=42, visible="0,1,2", wall_clock=lambda: 1234.5)
    first = probe.read()
    assert [(s.device.cuda_index, s.process_used_bytes) for s in first] == [(0, 3 * GIB), (1, 3 * GIB)]
    assert {s.read_at for s in first} == {1234.5}
    assert probe.health.errors == 1  # device 2's sample is absent; 0 and 1 are read
    nvml.v3_calls = 0
    probe.read()
    assert nvml.v3_calls == 1  # device 0 stays on v3; device 1 went to v2 alone, and is not asked v3 again


def test_a_step_record_pairs_nvml_only_with_the_reserved_bytes_of_its_moment() -> None:
    """The sampler read NVML (and the allocator) 4 s before this step end: process use minus reserved
    would mix two moments, unless reserved has not moved since the sampler's reading."""
    nvml = tuple(NvmlDeviceSample(Device.cuda(d), 80 * GIB, 10 * GIB, 70 * GIB, process_used_bytes=9 * GIB,
                                  read_at=100.0) for d in (0, 1))
    then = tuple(AllocatorSample(Device.cuda(d), reserved_bytes=6 * GIB) for d in (0, 1))
    now = (AllocatorSample(Device.cuda(0), reserved_bytes=8 * GIB), then[1])
    assert nvml_paired(nvml, at=104.0, read_with=then, now=now) == (nvml[1],)  # device 0 reserved 2 GiB since
    assert nvml_paired(nvml, at=100.0 + NVML_PAIR_MAX_AGE_S, read_with=then, now=now) == nvml  # fresh enough
    assert nvml_paired(nvml, at=104.0, read_with=(), now=now) == ()
