"""The CUDA caching allocator, read through ``torch.cuda.memory_stats``.

Never touches a device the job has not touched: it reads nothing until the job itself has
initialised CUDA, and only reports devices whose allocator has ever reserved memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpumemd.probes.health import ProbeHealth
from gpumemd.records.samples import AllocatorSample

StatsFn = Callable[[int], Mapping[str, Any]]

# AllocatorSample field -> flattened memory_stats key. Every key is optional (older torch,
# cudaMallocAsync); a missing key becomes None, never 0.
_KEYS: dict[str, str] = {
    "allocated_bytes": "allocated_bytes.all.current",
    "allocated_peak_bytes": "allocated_bytes.all.peak",
    "reserved_bytes": "reserved_bytes.all.current",
    "reserved_peak_bytes": "reserved_bytes.all.peak",
    "active_bytes": "active_bytes.all.current",
    "active_peak_bytes": "active_bytes.all.peak",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "requested_bytes": "requested_bytes.all.current",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
    "segment_count": "segment.all.current",
}


def sample_from_stats(device: int, stats: Mapping[str, Any]) -> AllocatorSample | None:
    """Turn one flattened ``memory_stats`` dict into a sample; ``{}`` (CUDA not initialised) -> None."""
    if not stats:
        return None
    values: dict[str, int | None] = {}
    for field_name, key in _KEYS.items():
        raw = stats.get(key)
        values[field_name] = int(raw) if isinstance(raw, (int, float)) else None
    return AllocatorSample(device=device, **values)


def touched(stats: Mapping[str, Any]) -> bool:
    """Has this device's allocator ever reserved memory? (Its stats exist for every device once
    CUDA is initialised, including devices this rank never uses.)"""
    return bool(stats.get("reserved_bytes.all.peak", 0) or stats.get("segment.all.allocated", 0))


class AllocatorProbe:
    """Reads every touched device's allocator. Seams: ``stats_fn``, ``is_initialized``, ``device_count``."""

    def __init__(
        self,
        stats_fn: StatsFn | None = None,
        is_initialized: Callable[[], bool] | None = None,
        device_count: Callable[[], int] | None = None,
    ) -> None:
        self.health = ProbeHealth("allocator")
        self._never = False  # CUDA can never come up here: read() returns at once
        if stats_fn is None or is_initialized is None or device_count is None:
            import torch

            if not torch.cuda.is_available():
                self.health.absent("this torch is a CPU build" if torch.version.cuda is None and
                                   torch.version.hip is None else "torch.cuda.is_available() is False")
                self._never = stats_fn is None and is_initialized is None
            stats_fn = stats_fn or torch.cuda.memory_stats
            is_initialized = is_initialized or torch.cuda.is_initialized
            device_count = device_count or torch.cuda.device_count
        self._stats_fn = stats_fn
        self._is_initialized = is_initialized
        self._device_count = device_count
        self._count: int | None = None

    def read(self) -> tuple[AllocatorSample, ...]:
        if self._never or not self._safe_initialized():
            return ()  # normal before the job's first CUDA op: nothing to read, nothing to say
        try:
            if self._count is None:
                self._count = int(self._device_count())
            samples = []
            for device in range(self._count):
                stats = self._stats_fn(device)
                if not touched(stats):
                    continue
                sample = sample_from_stats(device, stats)
                if sample is not None:
                    samples.append(sample)
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into the training loop
            self.health.failed(exc)
            return ()
        self.health.ok()
        return tuple(samples)

    def _safe_initialized(self) -> bool:
        try:
            return bool(self._is_initialized())
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)
            return False
