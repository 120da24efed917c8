"""A per-process cap (``torch.cuda.set_per_process_memory_fraction``) bounds headroom.

torch 2.13's allocator refuses to reserve past ``cap = fraction × total`` whatever the device has free,
so the room left is ``min(device_free, cap − reserved)``. Data in torch's shapes: the OOM message as
the native allocator writes it with a cap ("<cap> allowed;"), the OOM observer's arguments
``(device, alloc_size, cap, device_free)``, ``memory_stats`` dicts, and pynvml's call shapes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fakes import ManualClock

from gpumemd.analysis.breakdown import cuda_breakdown
from gpumemd.analysis.headroom import reservable_bytes
from gpumemd.analysis.oom_message import parse_oom_message
from gpumemd.api import build_agent
from gpumemd.components.leak import LeakComponent, LeakOptions
from gpumemd.config import Config
from gpumemd.exporter.collector import build_families
from gpumemd.probes.device.allocation_history import AllocationHistory
from gpumemd.probes.device.allocator import CAP_RECHECK_S, AllocatorProbe, torch_cap_reader
from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall
from gpumemd.records.plain import jsonable
from gpumemd.records.samples import AllocatorSample
from gpumemd.records.step import AgentState, Identity
from gpumemd.report.view import total_words

CUDA0 = Device.cuda(0)

MiB, GiB = 2**20, 2**30
DEVICE_TOTAL = 24 * GiB
CAP = 12 * GiB  # set_per_process_memory_fraction(0.5)
DEVICE_FREE = 10 * GiB  # another job shares the GPU: the device has room, the cap has none

# The native allocator's OOM under the cap (format of torch 2.13's CUDACachingAllocator: NVML's process
# line, then "<cap> allowed; ", then PyTorch's own figures).
CAPPED_MESSAGE = (
    "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of 24.00 GiB of which "
    "10.00 GiB is free. Including non-PyTorch memory, this process has 12.48 GiB memory in use. 12.00 GiB "
    "allowed; Of the allocated memory 11.95 GiB is allocated by PyTorch, and 20.00 MiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
ALLOCATED = round(11.95 * GiB)
RESERVED = ALLOCATED + 20 * MiB
# obs(device, alloc_size, allowed_memory_maximum.value_or(device_total), device_free)
OBSERVER = ObserverCall(device=CUDA0, requested_bytes=64 * MiB, total_or_cap_bytes=CAP, device_free_bytes=DEVICE_FREE,
                        wall_time=0.0)
CAPPED_SAMPLE = AllocatorSample(device=CUDA0, allocated_bytes=ALLOCATED, reserved_bytes=RESERVED, memory_fraction=0.5,
                                cap_bytes=CAP)


def _room(b: Any) -> int:
    return b.get("free") + b.get("headroom")


@pytest.mark.parametrize("sources", ["message+observer", "observer+allocator", "observer+nvml_total"])
def test_oom_breakdown_under_a_cap_is_bounded_by_it(sources: str) -> None:
    inputs: dict[str, Any] = {"observer": OBSERVER}
    if sources == "message+observer":
        inputs["message"] = parse_oom_message(CAPPED_MESSAGE)
    if sources == "observer+allocator":
        inputs["allocator"] = CAPPED_SAMPLE
    if sources == "observer+nvml_total":  # no fraction read: the observer's cap is below NVML's total
        inputs.update(allocator=dataclasses.replace(CAPPED_SAMPLE, memory_fraction=None, cap_bytes=None),
                      nvml_total_bytes=DEVICE_TOTAL)
    b = cuda_breakdown(device=CUDA0, **inputs)
    headroom = CAP - RESERVED  # ~31 MiB: less than the 64 MiB request, while 10 GiB is free on the device
    assert b.cap_bytes == CAP and b.total_bytes == CAP
    assert b.memory_fraction == pytest.approx(0.5, rel=0.01)
    assert b.headroom_bytes == pytest.approx(headroom, abs=MiB)
    assert _room(b) == b.headroom_bytes  # never the device-wide free memory
    assert b.get("free") == 0 and b.get("non_pytorch") == 0  # not items: they are not part of the cap
    assert sum(i.nbytes for i in b.items) <= CAP
    assert b.device_free_bytes == DEVICE_FREE
    if sources != "observer+allocator":  # the device total is known: memory outside PyTorch, device-wide
        assert b.device_total_bytes == DEVICE_TOTAL
        assert b.non_pytorch_bytes == pytest.approx(DEVICE_TOTAL - RESERVED - DEVICE_FREE, abs=MiB)
    # The verdict agrees with the figures: the cap is full, and it says so.
    assert b.verdict == "capacity", b.verdict_why
    assert "process cap of 12.00 GiB (fraction 0.50)" in b.verdict_why
    assert "10.00 GiB free on the device" in b.verdict_why


@pytest.mark.parametrize("fraction", [1.0, None])  # torch's "no cap", or no fraction read at all
def test_no_cap_keeps_the_device_view(fraction: float | None) -> None:
    observer = dataclasses.replace(OBSERVER, total_or_cap_bytes=DEVICE_TOTAL, device_free_bytes=20 * MiB)
    sample = dataclasses.replace(CAPPED_SAMPLE, memory_fraction=fraction, cap_bytes=None)
    b = cuda_breakdown(device=CUDA0, observer=observer, allocator=sample, nvml_total_bytes=DEVICE_TOTAL + 512 * MiB)
    assert b.cap_bytes is None and b.total_bytes == DEVICE_TOTAL  # CUDA's total vs NVML's: not a cap
    assert b.get("free") == 20 * MiB and b.get("non_pytorch") == DEVICE_TOTAL - RESERVED - 20 * MiB
    assert b.get("headroom") == 0 and b.headroom_bytes == 20 * MiB


def test_a_request_larger_than_the_cap_is_said_against_the_cap() -> None:
    observer = dataclasses.replace(OBSERVER, requested_bytes=16 * GiB)
    b = cuda_breakdown(device=CUDA0, observer=observer, message=parse_oom_message(CAPPED_MESSAGE))
    assert b.verdict == "request_exceeds_device"
    assert "larger than the process cap of 12.00 GiB" in b.verdict_why


def test_the_report_says_the_cap() -> None:
    b = cuda_breakdown(device=CUDA0, observer=OBSERVER, message=parse_oom_message(CAPPED_MESSAGE))
    words = total_words(jsonable(dataclasses.asdict(b)))
    assert words.startswith("Process cap: 12.00 GiB (fraction 0.50 of the device's 24.00 GiB)")
    assert "free on the device 10.00 GiB" in words
    assert total_words({"total_bytes": DEVICE_TOTAL}) == "Device total: 24.00 GiB"


def test_reservable_bytes() -> None:
    assert reservable_bytes(10 * GiB, 11 * GiB, 12 * GiB) == GiB
    assert reservable_bytes(512 * MiB, 11 * GiB, 12 * GiB) == 512 * MiB  # the device is the tighter bound
    assert reservable_bytes(10 * GiB, 13 * GiB, 12 * GiB) == 0
    assert reservable_bytes(10 * GiB, 11 * GiB, None) == 10 * GiB
    assert reservable_bytes(None, 11 * GiB, 12 * GiB) == GiB


# --- the probe: where the fraction is read -----------------------------------------------------------


def _stats(allocated: int = 4 * GiB, reserved: int = 6 * GiB) -> dict[str, int]:
    return {"allocated_bytes.all.current": allocated, "allocated_bytes.all.peak": allocated + GiB,
            "reserved_bytes.all.current": reserved, "reserved_bytes.all.peak": reserved,
            "inactive_split_bytes.all.current": 0, "segment.all.current": 3, "segment.all.allocated": 3}


def test_probe_reads_the_fraction_once_per_device_and_rechecks_it() -> None:
    calls: list[int] = []
    fraction = {"value": 0.5}

    def cap_fn(device: int) -> tuple[float, int]:
        calls.append(device)
        return fraction["value"], DEVICE_TOTAL

    clock = ManualClock(100.0)
    probe = AllocatorProbe(stats_fn=lambda d: _stats(), is_initialized=lambda: True, device_count=lambda: 2,
                           backend_fn=lambda: "native", cap_fn=cap_fn, clock=clock)
    for _ in range(100):  # a hundred sampled steps: one read per device, not one per step
        samples = probe.read()
    assert calls == [0, 1]
    assert [(s.memory_fraction, s.cap_bytes) for s in samples] == [(0.5, CAP), (0.5, CAP)]
    fraction["value"] = 1.0  # the job lifted the cap (torch returns 1.0 with none set)
    clock.now += CAP_RECHECK_S
    [first, _] = probe.read()
    assert calls == [0, 1, 0, 1] and first.memory_fraction == 1.0 and first.cap_bytes is None


def test_probe_without_a_fraction_getter_or_with_a_failing_one_still_samples() -> None:
    def broken(device: int) -> tuple[float, int]:
        raise RuntimeError("CUDA error: invalid device ordinal")

    for cap_fn in (broken, lambda d: None):
        probe = AllocatorProbe(stats_fn=lambda d: _stats(), is_initialized=lambda: True, device_count=lambda: 1,
                               backend_fn=lambda: "native", cap_fn=cap_fn)
        [sample] = probe.read()
        assert sample.reserved_bytes == 6 * GiB and sample.cap_bytes is None and sample.memory_fraction is None


def test_torch_reader_never_initialises_cuda() -> None:
    asked: list[str] = []
    fake = SimpleNamespace(cuda=SimpleNamespace(
        is_initialized=lambda: False,
        get_per_process_memory_fraction=lambda d: asked.append("fraction") or 0.5,
        get_device_properties=lambda d: asked.append("props") or SimpleNamespace(total_memory=DEVICE_TOTAL)))
    assert torch_cap_reader(fake)(0) is None and asked == []  # both getters call _lazy_init()
    fake.cuda.is_initialized = lambda: True
    assert torch_cap_reader(fake)(0) == (0.5, DEVICE_TOTAL)
    del fake.cuda.get_per_process_memory_fraction  # an older torch: no cap known
    assert torch_cap_reader(fake)(0) is None
    # The installed torch (a CPU build here): nothing to read, and CUDA stays uninitialised.
    assert hasattr(torch.cuda, "get_per_process_memory_fraction")
    assert torch_cap_reader(torch)(0) is None and not torch.cuda.is_initialized()


# --- steps to OOM and the exporter -------------------------------------------------------------------


def test_steps_to_oom_counts_only_the_room_under_the_cap(tmp_path: Any) -> None:
    from test_leak_component import FakeNvml, HistoryTorch  # one 80 GiB device, 68 GiB free

    step = {"n": 0}

    def stats(device: int) -> dict[str, int]:
        leaked = max(0, step["n"] - 60) * 2 * MiB
        return _stats(allocated=4 * GiB + leaked, reserved=6 * GiB + leaked)

    config = Config(output_dir=str(tmp_path), sample_interval_s=0, census=False, leak_warmup_steps=20,
                    leak_window_steps=100, leak_check_every_steps=10, leak_min_bytes_per_step=256 * 1024)
    component = LeakComponent(config.options(LeakOptions), census=None, snapshot_fn=lambda: {"segments": []},
                              history=AllocationHistory(HistoryTorch()))
    probe = AllocatorProbe(stats_fn=stats, is_initialized=lambda: True, device_count=lambda: 1,
                           backend_fn=lambda: "native", cap_fn=lambda d: (0.1, 80 * GiB))  # an 8 GiB cap
    agent = build_agent(config, allocator_probe=probe, nvml_probe=NvmlProbe(nvml=FakeNvml(), visible="0"),
                        identity=Identity(rank=0, world_size=1), components=[component], max_stride=1)
    agent.start()
    try:
        for n in range(300):
            step["n"] = n
            agent.mark_step(n)
        [finding] = agent.findings()
        state = agent.state()
    finally:
        agent.stop()
    sample = state.allocator[0]
    assert sample.cap_bytes == 8 * GiB
    reserved, peak = sample.reserved_bytes or 0, sample.allocated_peak_bytes or 0
    room = min(state.nvml[0].free_bytes, 8 * GiB - reserved) + max(0, reserved - peak)  # ~2.5 GiB, not 69
    assert finding.kind == "tensor_leak" and finding.steps_to_oom is not None
    assert finding.steps_to_oom == pytest.approx(room / finding.slope_bytes_per_step, rel=0.02)


def test_the_exporter_shows_the_cap_only_where_one_is_set() -> None:
    capped = AllocatorSample(CUDA0, allocated_bytes=GiB, reserved_bytes=2 * GiB, memory_fraction=0.5, cap_bytes=CAP)
    free = AllocatorSample(device=Device.cuda(1), allocated_bytes=GiB, reserved_bytes=2 * GiB, memory_fraction=1.0)
    state = AgentState(identity=Identity(rank=0, world_size=1), attached_at=0.0, updated_at=1.0,
                       allocator=(capped, free))
    [family] = [f for f in build_families(state) if f.name == "gpumemd_allocator_cap_bytes"]
    assert [(s.labels["device"], s.value) for s in family.samples] == [("0", float(CAP))]


def test_dashboard_headroom_is_bounded_by_the_cap(tmp_path: Any) -> None:
    from test_grafana_dashboard import JOB, evaluate, panel

    # the device's target (the panel's other one shows host headroom on ranks with no GPU)
    [target] = [t for t in panel("Device headroom")["targets"] if not t["expr"].startswith("gpumemd_host_")]
    series = {  # both devices: 30 GiB free on the device, 6 GiB reserved of which 2 GiB cached
        **{f'gpumemd_device_free_bytes{{{JOB},device="{d}"}}': f"{30 * GiB}x2" for d in "01"},
        **{f'gpumemd_allocator_reserved_bytes{{{JOB},device="{d}"}}': f"{6 * GiB}x2" for d in "01"},
        **{f'gpumemd_allocator_allocated_bytes{{{JOB},device="{d}"}}': f"{4 * GiB}x2" for d in "01"},
        f'gpumemd_allocator_cap_bytes{{{JOB},device="0"}}': f"{8 * GiB}x2",  # device 1 has no cap
    }
    evaluate(tmp_path, target["expr"], series, [(f'{{{JOB},device="0"}}', 4 * GiB),  # (8 - 6) + 2
                                                (f'{{{JOB},device="1"}}', 32 * GiB)])  # 30 + 2
