"""How gpumemd names a device, and the one place that converts between the two spellings.

- Where tensors live (census groups, breakdowns, findings' text): torch's device string, ``"cpu"``
  or ``"cuda:N"`` (never a bare ``"cuda"``: ``normalize`` makes it ``"cuda:0"``).
- What the CUDA allocator and NVML report on (samples, series, metric labels): the CUDA ordinal
  ``N`` as torch numbers it in this process (after ``CUDA_VISIBLE_DEVICES``).

Every conversion goes through these functions, so a device named one way here and the other there
is still the same device.
"""

from __future__ import annotations

CPU = "cpu"
_CUDA_PREFIX = "cuda:"


def cuda_device(index: int) -> str:
    """``3`` -> ``"cuda:3"``."""
    return f"{_CUDA_PREFIX}{index}"


def normalize(device: str) -> str:
    """``"cuda"`` -> ``"cuda:0"`` (torch's current device at the time is device 0 for gpumemd's
    purposes: a census sees the tensor's own device, which always carries an index); others unchanged."""
    return cuda_device(0) if device == "cuda" else device


def cuda_index(device: str) -> int | None:
    """``"cuda:3"`` -> ``3``, ``"cuda"`` -> ``0``; None for any other device."""
    device = normalize(device)
    if not device.startswith(_CUDA_PREFIX):
        return None
    try:
        return int(device[len(_CUDA_PREFIX):])
    except ValueError:
        return None


def label(device: str) -> str:
    """The metric label of a device: the ordinal for CUDA (as on every allocator series), else the name."""
    index = cuda_index(device)
    return str(index) if index is not None else device
