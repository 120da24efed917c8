"""OOM recognition: real exception classes, real message formats, real CPU allocation failures."""

from __future__ import annotations

import pytest
import torch
from cuda_recordings import recorded_ooms
from oom_snapshot_data import CPU_MESSAGE, NEW_MESSAGE, OLD_MESSAGE

from gpumemd.analysis.oom_message import classify_exception, parse_oom_message, parse_size
from gpumemd.records.device import Device

GiB, MiB = 2**30, 2**20


def test_sizes_follow_format_size_units() -> None:
    assert parse_size("512", "bytes") == 512
    assert parse_size("1.50", "KiB") == 1536
    assert parse_size("152.00", "MiB") == 152 * MiB
    assert parse_size("79.10", "GiB") == round(79.10 * GiB)


def test_new_format_reads_every_number() -> None:
    m = parse_oom_message(NEW_MESSAGE)
    assert m is not None
    assert (m.kind, m.format, m.device) == ("cuda", "cuda-2.1+", Device.cuda(0))
    assert m.requested_bytes == 8 * MiB
    assert m.total_bytes == round(79.10 * GiB)
    assert m.free_bytes == 3 * MiB
    assert m.process_bytes == round(79.09 * GiB)
    assert m.allocated_bytes == round(76.25 * GiB)
    assert m.private_pool_bytes == 1 * GiB
    assert m.reserved_unallocated_bytes == round(2.12 * GiB)
    assert m.reserved_bytes == round(76.25 * GiB) + round(2.12 * GiB)
    assert m.allowed_bytes is None


def test_new_format_with_a_cap_and_the_2_1_typo() -> None:
    text = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1 has a total capacty of 15.77 GiB of which "
            "10.00 GiB is free. 4.00 GiB allowed; Of the allocated memory 3.90 GiB is allocated by PyTorch, and "
            "50.00 MiB is reserved by PyTorch but unallocated.")
    m = parse_oom_message(text)
    assert m is not None and m.device == Device.cuda(1)
    assert m.allowed_bytes == 4 * GiB
    assert m.private_pool_bytes == 0
    assert m.reserved_unallocated_bytes == 50 * MiB


def test_legacy_format() -> None:
    m = parse_oom_message(OLD_MESSAGE)
    assert m is not None and m.format == "cuda-legacy"
    assert m.requested_bytes == 152 * MiB
    assert m.allocated_bytes == round(24.89 * GiB)
    assert m.reserved_bytes == round(30.70 * GiB)
    assert m.reserved_unallocated_bytes == round(30.70 * GiB) - round(24.89 * GiB)
    assert m.free_bytes == round(6.12 * MiB)


def test_cpu_and_mps_messages() -> None:
    cpu = parse_oom_message(CPU_MESSAGE)
    assert cpu is not None and (cpu.kind, cpu.requested_bytes) == ("cpu", 2**60)
    mps = parse_oom_message(
        "MPS backend out of memory (MPS allocated: 1.00 GiB). Tried to allocate 256.00 MiB on private pool.")
    assert mps is not None and (mps.kind, mps.requested_bytes) == ("mps", 256 * MiB)
    assert parse_oom_message("index out of range") is None


def test_torch_out_of_memory_error_is_cuda_oom() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    m = classify_exception(torch.cuda.OutOfMemoryError(NEW_MESSAGE))
    assert m is not None and m.kind == "cuda" and m.requested_bytes == 8 * MiB


def test_subclass_and_other_devices() -> None:
    class MyOom(torch.OutOfMemoryError):
        pass

    assert classify_exception(MyOom(OLD_MESSAGE)) is not None
    other = classify_exception(torch.OutOfMemoryError("XPU out of memory. Tried to allocate 2.00 GiB."))
    assert other is not None and other.kind == "device"


def test_a_real_cpu_allocation_failure_is_recognised() -> None:
    # 2**60 bytes exceeds any address space: malloc fails at once, nothing is touched.
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**60, dtype=torch.uint8)
    assert not isinstance(info.value, torch.OutOfMemoryError)
    m = classify_exception(info.value)
    assert m is not None and m.kind == "cpu" and m.requested_bytes == 2**60


def test_shape_overflow_and_unrelated_errors_are_not_oom() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty((2**31, 2**31), dtype=torch.float32)
    assert "Storage size calculation overflowed" in str(info.value)
    assert classify_exception(info.value) is None
    assert classify_exception(ValueError("CUDA out of memory")) is None
    assert classify_exception(RuntimeError("shape mismatch")) is None
    assert classify_exception(torch.AcceleratorError("CUDA error: an illegal memory access was encountered")) is None


def test_legacy_plain_runtime_error_with_cuda_message() -> None:
    m = classify_exception(RuntimeError(OLD_MESSAGE))  # torch < 1.13, TorchScript re-raise
    assert m is not None and m.kind == "cuda"


# c10/cuda/CUDAMallocAsyncAllocator.cpp, format_size() of each number; no fraction set: SIZE_MAX.
ASYNC_MESSAGE = (
    "Allocation on device 1 would exceed allowed memory. (out of memory)\n"
    "Currently allocated     : 9.43 GiB\n"
    "Requested               : 640.00 MiB\n"
    "Device limit            : 11.59 GiB\n"
    "Free (according to CUDA): 7.12 MiB\n"
    "PyTorch limit (set by user-supplied memory fraction)\n"
    "                        : 17179869184.00 GiB"
)


def test_cuda_malloc_async_message_names_its_device_and_numbers() -> None:
    """The cudaMallocAsync text was not parsed, and the report then blamed GPU 0."""
    m = classify_exception(torch.OutOfMemoryError(ASYNC_MESSAGE))
    assert m is not None and (m.kind, m.format, m.device) == ("cuda", "cuda-async", Device.cuda(1))
    assert m.requested_bytes == 640 * 2**20
    assert m.allocated_bytes == round(9.43 * 2**30) and m.total_bytes == round(11.59 * 2**30)
    assert m.free_bytes == round(7.12 * 2**20)
    assert m.allowed_bytes is None  # SIZE_MAX: no fraction was set
    capped = parse_oom_message(ASYNC_MESSAGE.replace("17179869184.00 GiB", "5.80 GiB"))
    assert capped is not None and capped.allowed_bytes == round(5.8 * 2**30)


def test_pre_2_1_message_with_a_memory_fraction_parses() -> None:
    """Torch < 2.1 puts "X allowed;" before "reserved" when a fraction is set."""
    text = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 2; 15.78 GiB total capacity; 14.56 GiB "
            "already allocated; 3.88 MiB free; 14.75 GiB allowed; 14.71 GiB reserved in total by PyTorch)")
    m = parse_oom_message(text)
    assert m is not None and (m.format, m.device) == ("cuda-legacy", Device.cuda(2))
    assert m.allowed_bytes == round(14.75 * 2**30) and m.reserved_bytes == round(14.71 * 2**30)
    assert m.allocated_bytes == round(14.56 * 2**30) and m.free_bytes == round(3.88 * 2**20)


@pytest.mark.parametrize("make", [
    lambda: torch.AcceleratorError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
                                   "reported at some other API call"),
    lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
], ids=["AcceleratorError", "cuBLAS", "cuDNN"])
def test_runtime_and_library_allocation_failures_are_ooms_for_every_caller(make) -> None:  # type: ignore[no-untyped-def]
    """One classifier for the reports, oom_guard and find_batch_size."""
    m = classify_exception(make())
    assert m is not None and (m.kind, m.format, m.device) == ("cuda", "cuda-runtime", None)


def test_cpu_not_enough_memory_wording() -> None:
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
                       "you tried to allocate 1073741824 bytes.")
    m = classify_exception(exc)
    assert m is not None and m.kind == "cpu" and m.requested_bytes == 2**30


def test_a_device_the_message_does_not_name_is_never_gpu_0() -> None:
    """An OOM without a device (a runtime/library allocation failure) was blamed on
    GPU 0; it is the one device this process uses, or unknown."""
    from gpumemd.records.samples import AllocatorSample
    from gpumemd.records.step import Identity
    from gpumemd.report.build import ReportInputs, oom_device

    m = classify_exception(torch.AcceleratorError("CUDA error: out of memory"))
    base = dict(created_at=0.0, identity=Identity(), source="excepthook", exception_type="AcceleratorError",
                exception_message="CUDA error: out of memory", message=m)
    assert oom_device(ReportInputs(**base, allocator=(AllocatorSample(device=Device.cuda(3)),))) == Device.cuda(3)  # type: ignore[arg-type]
    two = (AllocatorSample(device=Device.cuda(1)), AllocatorSample(device=Device.cuda(2)))
    assert oom_device(ReportInputs(**base, allocator=two)) is None  # type: ignore[arg-type]
    assert oom_device(ReportInputs(**base)) is None  # type: ignore[arg-type]


def test_rocm_hip_messages_are_the_cuda_allocators_numbers() -> None:
    from gpumemd.analysis.oom_message import parse_oom_message as parse
    from gpumemd.records.device import Device as Dev

    hip = ("HIP out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 191.98 GiB of which "
           "1.50 GiB is free. Of the allocated memory 180.00 GiB is allocated by PyTorch, and 4.00 GiB is reserved "
           "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    m = parse(hip)
    assert m is not None and m.format == "cuda-2.1+" and m.device == Dev.cuda(1)
    assert m.requested_bytes == 2 * 2**30 and m.reserved_bytes == 184 * 2**30
    runtime = parse("HIP error: out of memory")
    assert runtime is not None and runtime.format == "cuda-runtime"


def test_xpu_messages_are_read_on_their_own_device() -> None:
    from gpumemd.analysis.oom_message import parse_oom_message as parse
    from gpumemd.records.device import Device as Dev

    xpu = ("XPU out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 64.00 GiB. Of the "
           "allocated memory 58.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but "
           "unallocated. Please use `empty_cache` to release all unoccupied cached memory.")
    m = parse(xpu)
    assert m is not None and (m.kind, m.format, m.device) == ("device", "xpu", Dev("xpu", 0))
    assert (m.requested_bytes, m.total_bytes, m.free_bytes) == (4 * 2**30, 64 * 2**30, None)
    assert m.allocated_bytes == 58 * 2**30 and m.reserved_bytes == 59 * 2**30


@pytest.mark.parametrize("key", list(recorded_ooms()))
def test_recorded_cuda_oom_messages_parse_to_what_the_device_said(key: str) -> None:
    """Messages a real device printed (tests/data/cuda, see tests/cuda_recordings.py): the request
    the observer saw and the device's total, within the message's rounding (two decimals of its unit)."""
    device, facts = recorded_ooms()[key]
    m = parse_oom_message(facts["oom_message"])
    assert m is not None, facts["oom_message"]
    observed_device, requested = facts["oom_observer_args"][0][:2]
    assert m.device == Device.cuda(observed_device)
    assert m.requested_bytes is not None and abs(m.requested_bytes - requested) <= 0.005 * GiB
    if facts.get("backend") != "cudaMallocAsync":  # the async backend's "Device limit" is the cap, not the total
        # The message's "total capacity" is cudaMemGetInfo's total, below get_device_properties'
        # total_memory (on the H200: 139.80 GiB against 150,754,820,096 B, 645 MB apart).
        assert m.total_bytes is not None
        if "mem_get_info" in facts:
            assert abs(m.total_bytes - facts["mem_get_info"][1]) <= 0.005 * GiB
        assert 0.99 * device["total_memory"] <= m.total_bytes <= device["total_memory"]
