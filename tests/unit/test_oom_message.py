"""OOM recognition: real exception classes, real message formats, real CPU allocation failures."""

from __future__ import annotations

import pytest
import torch
from oom_snapshot_data import CPU_MESSAGE, NEW_MESSAGE, OLD_MESSAGE

from gpumemd.analysis.oom_message import classify_exception, parse_oom_message, parse_size

GiB, MiB = 2**30, 2**20


def test_sizes_follow_format_size_units() -> None:
    assert parse_size("512", "bytes") == 512
    assert parse_size("1.50", "KiB") == 1536
    assert parse_size("152.00", "MiB") == 152 * MiB
    assert parse_size("79.10", "GiB") == round(79.10 * GiB)


def test_new_format_reads_every_number() -> None:
    m = parse_oom_message(NEW_MESSAGE)
    assert m is not None
    assert (m.kind, m.format, m.device) == ("cuda", "cuda-2.1+", 0)
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
    assert m is not None and m.device == 1
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
    assert classify_exception(torch.AcceleratorError("CUDA error: out of memory")) is None


def test_legacy_plain_runtime_error_with_cuda_message() -> None:
    m = classify_exception(RuntimeError(OLD_MESSAGE))  # torch < 1.13, TorchScript re-raise
    assert m is not None and m.kind == "cuda"
