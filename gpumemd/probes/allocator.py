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
    "num_oom_rejections": "num_oom_rejections",  # torch >= 2.13: refused under a memory-fraction cap
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
    "segment_count": "segment.all.current",
}


# What the cudaMallocAsync backend maintains: its getDeviceStats fills allocated, active and reserved
# (current and peak) from the pool's attributes and leaves every other stat at zero ("some stats are
# not meaningful, and are always reported as zero", torch.cuda.memory_stats). A zero there is not a
# measurement: no OOMs counted, no fragmentation, no segments. Those fields are absent instead.
_ASYNC_KEPT = frozenset({"allocated_bytes", "allocated_peak_bytes", "reserved_bytes", "reserved_peak_bytes",
                         "active_bytes", "active_peak_bytes"})
ASYNC_BACKEND = "cudaMallocAsync"


def sample_from_stats(device: int, stats: Mapping[str, Any], *, backend: str = "native") -> AllocatorSample | None:
    """Turn one flattened ``memory_stats`` dict into a sample; ``{}`` (CUDA not initialised) -> None.
    ``backend`` is ``torch.cuda.memory.get_allocator_backend()``: under ``cudaMallocAsync`` only the
    stats that backend maintains are read."""
    if not stats:
        return None
    values: dict[str, int | None] = {}
    for field_name, key in _KEYS.items():
        raw = stats.get(key)
        kept = backend != ASYNC_BACKEND or field_name in _ASYNC_KEPT
        values[field_name] = int(raw) if kept and isinstance(raw, (int, float)) else None
    return AllocatorSample(device=device, **values)


def touched(stats: Mapping[str, Any]) -> bool:
    """Has this device's allocator ever reserved memory? (Its stats exist for every device once
    CUDA is initialised, including devices this rank never uses.)"""
    return bool(stats.get("reserved_bytes.all.peak", 0) or stats.get("segment.all.allocated", 0))


class AllocatorProbe:
    """Reads every touched device's allocator. Seams: ``stats_fn``, ``is_initialized``,
    ``device_count``, ``backend_fn``."""

    def __init__(
        self,
        stats_fn: StatsFn | None = None,
        is_initialized: Callable[[], bool] | None = None,
        device_count: Callable[[], int] | None = None,
        backend_fn: Callable[[], str] | None = None,
    ) -> None:
        self.health = ProbeHealth("allocator")
        self._never = False  # CUDA can never come up here: read() returns at once
        if stats_fn is None or is_initialized is None or device_count is None or backend_fn is None:
            import torch

            # Not torch.cuda.is_available(): without PYTORCH_NVML_BASED_CUDA_CHECK it calls
            # cudaGetDeviceCount, which initialises the driver in this process and poisons fork for
            # DataLoader workers. device_count() asks NVML while CUDA is not initialised.
            if torch.version.cuda is None and torch.version.hip is None:
                self.health.absent("this torch is a CPU build")
                self._never = stats_fn is None and is_initialized is None
            elif device_count is None and torch.cuda.device_count() == 0:
                self.health.absent("no CUDA device is visible to this process")
                self._never = stats_fn is None and is_initialized is None
            stats_fn = stats_fn or torch.cuda.memory_stats
            is_initialized = is_initialized or torch.cuda.is_initialized
            device_count = device_count or torch.cuda.device_count
            backend_fn = backend_fn or torch.cuda.memory.get_allocator_backend
        self._stats_fn = stats_fn
        self._is_initialized = is_initialized
        self._device_count = device_count
        self._backend_fn = backend_fn
        self._count: int | None = None
        self.backend: str | None = None  # read once CUDA is up (the backend is fixed by then)

    def read(self) -> tuple[AllocatorSample, ...]:
        if self._never or not self._safe_initialized():
            return ()  # normal before the job's first CUDA op: nothing to read, nothing to say
        try:
            if self._count is None:
                self._count = int(self._device_count())
            if self.backend is None:
                self.backend = self._read_backend()
            samples = []
            for device in range(self._count):
                stats = self._stats_fn(device)
                if not touched(stats):
                    continue
                sample = sample_from_stats(device, stats, backend=self.backend)
                if sample is not None:
                    samples.append(sample)
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into the training loop
            self.health.failed(exc)
            return ()
        self.health.ok()
        return tuple(samples)

    def _read_backend(self) -> str:
        try:
            return str(self._backend_fn())
        except Exception:  # noqa: BLE001 - torch < 2.0 has no get_allocator_backend: native was the only one
            return "native"

    def _safe_initialized(self) -> bool:
        try:
            return bool(self._is_initialized())
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)
            return False
