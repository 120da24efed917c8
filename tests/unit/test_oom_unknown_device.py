"""A device OOM whose error names no device, in a process that uses several:
the report shows the fullest device and says so, never the host's memory as if the host had run out.

The inputs are in torch's shapes: the ``torch.AcceleratorError`` text c10's ``C10_CUDA_CHECK`` builds for a
``cudaMalloc`` outside the caching allocator, ``memory_stats`` figures per device and NVML readings of an
H100 80GB (``total`` as ``nvmlDeviceGetMemoryInfo`` reports it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gpumemd.analysis.oom_message import classify_exception
from gpumemd.cli import main
from gpumemd.records.device import Device
from gpumemd.records.oom import OomMessage
from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample
from gpumemd.records.step import Identity, StepRecord
from gpumemd.report.build import ReportInputs, breakdown_device, build_report, oom_device
from gpumemd.report.schema import schema_errors
from gpumemd.report.writer import render_files, report_dir_name, write_report_dir

CUDA0 = Device.cuda(0)

MiB, GiB = 2**20, 2**30
H100_TOTAL = 85_520_809_984  # nvmlDeviceGetMemoryInfo(...).total of an H100 80GB HBM3 (79.65 GiB)
ACCELERATOR_OOM = (  # c10_cuda_check_implementation's text for cudaErrorMemoryAllocation
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)
NOTE = ("The error does not name its device; showing cuda:1, the fullest of the 2 devices this process uses "
        "(the least room left to reserve, 512.00 MiB, against 36.65 GiB on cuda:0)")


def _allocator(device: int, allocated: int, reserved: int, **over: Any) -> AllocatorSample:
    fields: dict[str, Any] = dict(allocated_bytes=allocated, allocated_peak_bytes=allocated + GiB,
                                  reserved_bytes=reserved, reserved_peak_bytes=reserved, active_bytes=allocated,
                                  num_ooms=0, num_alloc_retries=0, segment_count=40, memory_fraction=1.0)
    return AllocatorSample(device=Device.cuda(device), **{**fields, **over})


def _nvml(device: int, free: int) -> NvmlDeviceSample:
    return NvmlDeviceSample(device=Device.cuda(device), total_bytes=H100_TOTAL, used_bytes=H100_TOTAL - free,
                            free_bytes=free)


TWO = (_allocator(0, 40 * GiB, 42 * GiB), _allocator(1, 76 * GiB, 78 * GiB))
TWO_NVML = (_nvml(0, H100_TOTAL - 43 * GiB), _nvml(1, 512 * MiB))  # cuda:1: 512 MiB left on the device


def _inputs(**over: Any) -> ReportInputs:
    exc = torch.AcceleratorError(ACCELERATOR_OOM)
    allocator = over.pop("allocator", TWO)
    steps = [StepRecord(step=i, wall_time=1000.0 + i, duration_s=0.2, phase="train", allocator=allocator,
                        host=HostSample(rss_bytes=6 * GiB)) for i in range(5)]
    base: dict[str, Any] = dict(
        created_at=1763700000.5, identity=Identity(rank=1, world_size=2), source="excepthook",
        exception_type="AcceleratorError", exception_message=ACCELERATOR_OOM, message=classify_exception(exc),
        step=5, steps=steps, allocator=allocator, nvml=TWO_NVML,
        host=HostSample(rss_bytes=6 * GiB, available_bytes=400 * GiB, total_bytes=503 * GiB),
    )
    base.update(over)
    return ReportInputs(**base)


def _report(inputs: ReportInputs) -> dict[str, Any]:
    return json.loads(json.dumps(build_report(inputs), allow_nan=False))


def test_the_fullest_device_is_shown_and_the_report_says_why(tmp_path: Any, capsys: Any) -> None:
    inputs = _inputs()
    assert inputs.message is not None and (inputs.message.format, inputs.message.device) == ("cuda-runtime", None)
    assert oom_device(inputs) is None  # still unknown: the OOM component picks no memory_summary device by it
    report = _report(inputs)
    b = report["breakdown"]
    assert b["device"] == "cuda:1" and b["device_note"] == NOTE
    assert b["device_total_bytes"] == H100_TOTAL and b["allocated_bytes"] == 76 * GiB
    assert b["device_free_bytes"] is None  # the runtime message has no numbers; NVML free is not the OOM's
    assert {i["key"] for i in b["items"]} >= {"unattributed", "reserved_unallocated"}
    assert not {i["key"] for i in b["items"]} & {"process_other"}  # not the host's memory
    # The timeline and the peak follow the device shown, not the host's RSS.
    assert report["timeline"][-1]["allocated_bytes"] == 76 * GiB and report["peak_bytes"] == 77 * GiB
    files = {name: data.decode() for name, data in render_files(report, None).items()}
    assert NOTE + "." in files["report.md"] and NOTE + "." in files["report.html"]
    assert "AcceleratorError on cuda:1 (rank 1, step 5" in files["report.md"]  # the headline names it too
    assert schema_errors(report) is None
    path = write_report_dir(str(tmp_path), report_dir_name(1, 5, 1763700000.5), render_files(report, None))
    assert main(["report", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].startswith("verdict: unknown") and out[4] == NOTE + "."


def test_the_room_left_counts_the_process_cap() -> None:
    """Under set_per_process_memory_fraction the room is min(device free, cap − reserved): cuda:0, capped at
    20 GiB with 19.5 GiB reserved, is fuller than cuda:1 with 4 GiB free and no cap."""
    capped = _allocator(0, 19 * GiB, round(19.5 * GiB), memory_fraction=0.25, cap_bytes=20 * GiB)
    shown = breakdown_device(_inputs(allocator=(capped, _allocator(1, 70 * GiB, 72 * GiB)),
                                     nvml=(_nvml(0, 50 * GiB), _nvml(1, 4 * GiB))))
    assert shown.device == CUDA0 and shown.note is not None
    assert "(the least room left to reserve, 512.00 MiB, against 4.00 GiB on cuda:1)" in shown.note


def test_without_nvml_the_allocator_decides() -> None:
    """No NVML (pynvml missing) and no cap: the room is unknown, the allocator's reserved bytes decide; with
    more devices the runner-up is named as the next fullest."""
    three = (_allocator(0, 10 * GiB, 12 * GiB), _allocator(1, 30 * GiB, 31 * GiB), _allocator(2, 60 * GiB, 64 * GiB))
    shown = breakdown_device(_inputs(allocator=three, nvml=()))
    assert shown.device == Device.cuda(2) and shown.note == (
        "The error does not name its device; showing cuda:2, the fullest of the 3 devices this process uses "
        "(the most reserved by PyTorch, 64.00 GiB, against 31.00 GiB on cuda:1, the next fullest)")
    bare = (AllocatorSample(CUDA0), AllocatorSample(Device.cuda(1)))  # nothing known: say so, show the first
    shown = breakdown_device(_inputs(allocator=bare, nvml=()))
    assert shown.device == CUDA0 and shown.note is not None and "do not say which was fullest" in shown.note


def test_one_device_is_that_device_without_a_note() -> None:
    report = _report(_inputs(allocator=(_allocator(3, 70 * GiB, 72 * GiB),), nvml=(_nvml(3, GiB),)))
    assert report["breakdown"]["device"] == "cuda:3" and report["breakdown"]["device_note"] is None
    md = render_files(report, None)["report.md"].decode()
    assert "does not name its device" not in md


@pytest.mark.parametrize("case", ["cpu_oom", "no_allocator"])
def test_host_failures_and_no_allocator_keep_the_host_breakdown(case: str) -> None:
    if case == "cpu_oom":
        over: dict[str, Any] = dict(exception_type="RuntimeError", exception_message="DefaultCPUAllocator: ...",
                                    message=OomMessage(kind="cpu", format="cpu", requested_bytes=8 * GiB))
    else:
        over = dict(allocator=(), nvml=())
    report = _report(_inputs(**over))
    b = report["breakdown"]
    assert b["device"] == "cpu" and b["device_note"] is None
    assert {"process_other", "free"} <= {i["key"] for i in b["items"]}


def test_a_note_of_the_wrong_type_is_refused_by_name() -> None:
    assert schema_errors({"breakdown": {"device_note": 3}}) == "breakdown.device_note: expected a string, got 3"
    assert schema_errors({"breakdown": {"device_note": None}}) is None  # optional: older reports lack it
