"""How much more memory the CUDA allocator can obtain, under a per-process cap or not (pure; no torch).

``torch.cuda.set_per_process_memory_fraction(f)`` caps the caching allocator at ``cap = f × total``:
it refuses a ``cudaMalloc`` that would take its *reserved* bytes past the cap, whatever the device has
free (c10 ``CUDACachingAllocator``: ``total_allocated_memory + size > allowed_memory_maximum``). So the
room left to reserve is ``min(device_free, cap − reserved)``, never the device-wide free memory alone;
without a cap it is the device's free memory. Memory outside PyTorch (the CUDA context, NCCL) does not
count against the cap; it only shrinks ``device_free``.
"""

from __future__ import annotations

_NOT_A_CAP = 0.95
"""An observer's "total or cap" this close to the device total is the total: CUDA's total and NVML's
differ by a few hundred MiB (79.10 vs 79.65 GiB on an H100 80GB; a larger share of a smaller card).
A cap this close to the total is still found where it matters: in the message ("X allowed;") and in
the fraction the allocator probe reads."""


def reservable_bytes(device_free: int | None, reserved: int | None, cap: int | None) -> int | None:
    """Bytes the allocator may still reserve from the driver: ``device_free``, and under a ``cap`` no
    more than ``cap − reserved``. None when ``device_free`` is unknown and no cap bounds it."""
    if cap is None or reserved is None:
        return device_free
    under_cap = max(0, cap - reserved)
    return under_cap if device_free is None else min(device_free, under_cap)


def cap_from_observer(total_or_cap: int | None, device_total: int | None) -> int | None:
    """The cap the OOM observer's third argument stands for, when it is one: torch passes the cap when a
    fraction is set and the device total otherwise, so only a figure clearly below the total is a cap."""
    if total_or_cap is None or device_total is None:
        return None
    return total_or_cap if total_or_cap < _NOT_A_CAP * device_total else None

