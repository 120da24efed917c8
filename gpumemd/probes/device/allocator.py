"""The CUDA caching allocator, read through torch's nested ``memory_stats`` dict (``flat_from_nested``).

Never touches a device the job has not touched: it reads nothing until the job itself has
initialised CUDA, and only reports devices whose allocator has ever reserved memory.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpumemd.probes.device.nvml_devices import counting_initialises_cuda
from gpumemd.probes.health import ProbeHealth
from gpumemd.records.device import Device
from gpumemd.records.samples import AllocatorSample

StatsFn = Callable[[int], Mapping[str, Any]]
CapFn = Callable[[int], tuple[float, int] | None]  # device -> (memory fraction, device total bytes)

DEVICE_RESCAN_S = 30.0
"""Seconds between looks at every visible device for one the job has started to use. Between them a
sample reads only the job's own devices: the current one and those it has reserved memory on (a
``memory_stats`` call per visible ordinal each sample was 8 calls per rank on an 8-GPU node)."""

CAP_RECHECK_S = 30.0
"""Seconds a device's memory fraction is trusted before it is read again. A job sets it once, at start
(``set_per_process_memory_fraction``), so a read per device every 30 s keeps it true at no cost to
the steps that sample the allocator (a clock read and a dict look-up between re-reads)."""

# Where torch reads its allocator settings, in the order doctor reports them (gpumemd.doctor).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

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


def expandable_segments_from_env(environ: Mapping[str, str]) -> bool:
    """Is ``expandable_segments:True`` in the first allocator-settings variable set? torch reads these
    when CUDA initialises. A job that switches it at run time (``torch.cuda.memory._set_allocator_settings``)
    is not seen: the OOM report reads the snapshot's ``allocator_settings`` instead."""
    text = next((environ[v] for v in ALLOC_CONF_VARS if environ.get(v, "").strip()), "")
    for item in text.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def sample_from_stats(ordinal: int, stats: Mapping[str, Any], *, backend: str = "native",
                      expandable_segments: bool = False, memory_fraction: float | None = None,
                      cap_bytes: int | None = None) -> AllocatorSample | None:
    """Turn CUDA device ``ordinal``'s flattened ``memory_stats`` dict into a sample; ``{}`` (CUDA not
    initialised) -> None.
    ``backend`` is ``torch.cuda.memory.get_allocator_backend()``: under ``cudaMallocAsync`` only the
    stats that backend maintains are read. Under ``expandable_segments`` torch does not count blocks of
    expandable segments in ``inactive_split`` (pytorch/pytorch#159564): it reads 0 whatever the
    fragmentation, so it is absent too. ``memory_fraction``/``cap_bytes``: the per-process cap."""
    if not stats:
        return None
    values: dict[str, int | None] = dict.fromkeys(_KEYS)
    for field_name, key in _kept_keys(backend, expandable_segments):
        raw = stats.get(key)
        if isinstance(raw, (int, float)):
            values[field_name] = int(raw)
    return AllocatorSample(device=Device.cuda(ordinal), memory_fraction=memory_fraction, cap_bytes=cap_bytes,
                           private_pool_reserved_bytes=None if backend == ASYNC_BACKEND else _private_pools(stats),
                           **values)


@functools.cache
def _kept_keys(backend: str, expandable_segments: bool) -> tuple[tuple[str, str], ...]:
    """(field, key) of the stats this backend keeps meaningful (see ``sample_from_stats``)."""
    return tuple((field_name, key) for field_name, key in _KEYS.items()
                 if (backend != ASYNC_BACKEND or field_name in _ASYNC_KEPT)
                 and not (expandable_segments and field_name == "inactive_split_bytes"))


_PRIVATE_POOLS = "reserved_bytes_by_private_pools."


def _private_pools(stats: Mapping[str, Any]) -> int | None:
    """Bytes reserved by every private pool (``reserved_bytes_by_private_pools.<a>_<b>.all.current``,
    one per pool id); None when torch lists none."""
    found = [v for k, v in stats.items() if k.startswith(_PRIVATE_POOLS) and k.endswith(".all.current")
             and isinstance(v, (int, float))]
    return int(sum(found)) if found else None


def torch_cap_reader(torch: Any) -> CapFn:
    """(fraction, device total) from torch, or None where it cannot say. Both getters call
    ``_lazy_init()``: they are asked only once the job itself initialised CUDA, so that never starts it.
    An older torch without ``get_per_process_memory_fraction``: no cap known (as if the fraction were 1)."""
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)

    def read(device: int) -> tuple[float, int] | None:
        if get_fraction is None or not torch.cuda.is_initialized():
            return None
        return float(get_fraction(device)), int(torch.cuda.get_device_properties(device).total_memory)

    return read


# Every flattened key gpumemd reads, as its path in torch's nested dict (``memory_stats_as_nested_dict``).
_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (key, tuple(key.split("."))) for key in (*_KEYS.values(), "segment.all.allocated"))


def flat_from_nested(nested: Mapping[str, Any]) -> dict[str, Any]:
    """The keys gpumemd reads, spelt as ``memory_stats()`` spells them, picked out of the nested dict
    torch's C++ binding returns (``torch.cuda.memory_stats_as_nested_dict``). ``memory_stats()`` walks
    all ~120 entries of that dict, joins every key and sorts the lot in Python (75-93 µs a call);
    picking the 16 that are read costs a fraction of it, on the training thread at every sampled step.
    Private pools are keyed by a ``(a, b)`` pool id, which ``memory_stats()`` joins as ``"a_b"``."""
    flat: dict[str, Any] = {}
    for key, path in _PATHS:  # indexing under try, not isinstance(Mapping) per level: ABC checks cost
        value: Any = nested
        try:
            for part in path:
                value = value[part]
        except (KeyError, TypeError, IndexError):
            continue  # a key this torch or backend does not keep: absent, as memory_stats() leaves it
        if value is not None:
            flat[key] = value
    pools = nested.get("reserved_bytes_by_private_pools")
    if isinstance(pools, Mapping):
        for pool_id, stat_array in pools.items():
            name = "_".join(str(p) for p in pool_id) if isinstance(pool_id, tuple) else str(pool_id)
            stat = stat_array.get("all") if isinstance(stat_array, Mapping) else None
            if isinstance(stat, Mapping) and "current" in stat:
                flat[f"{_PRIVATE_POOLS}{name}.all.current"] = stat["current"]
    return flat


def touched(stats: Mapping[str, Any]) -> bool:
    """Has this device's allocator ever reserved memory? (Its stats exist for every device once
    CUDA is initialised, including devices this rank never uses.)"""
    return bool(stats.get("reserved_bytes.all.peak", 0) or stats.get("segment.all.allocated", 0))


def _why_cuda_never(torch: Any, *, counting: bool) -> str | None:
    """Why CUDA can never come up in this process, if it cannot; ``counting``: torch's device count may
    be read to tell."""
    if torch.version.cuda is None and torch.version.hip is None:
        return "this torch is a CPU build"
    # Not torch.cuda.is_available(): without PYTORCH_NVML_BASED_CUDA_CHECK it calls
    # cudaGetDeviceCount, which initialises the driver in this process and poisons fork for
    # DataLoader workers. device_count() asks NVML while CUDA is not initialised.
    if counting and not counting_initialises_cuda(os.environ.get("CUDA_VISIBLE_DEVICES")) \
            and torch.cuda.device_count() == 0:
        return "no CUDA device is visible to this process"
    return None


def _torch_importable(health: ProbeHealth) -> bool:
    """A broken install (torch missing, or its native libraries failing to load) leaves the probe
    absent, saying why; the job's own ``import torch`` reports the install."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - whatever the import raises
        health.absent(f"torch cannot be imported ({type(exc).__name__}: {exc})")
        return False
    return True


def _no_stats(device: int) -> Mapping[str, Any]:
    return {}


def _never_up() -> bool:
    return False


class AllocatorProbe:
    """Reads the allocator of each device the job uses. Seams: ``stats_fn``, ``is_initialized``,
    ``device_count``, ``backend_fn``, ``current_device`` (torch's when torch supplies the other seams,
    else none); ``cap_fn`` (the memory fraction and device total: torch's when
    torch supplies the other seams, else none), ``environ`` (allocator settings), ``clock``."""

    def __init__(
        self,
        stats_fn: StatsFn | None = None,
        is_initialized: Callable[[], bool] | None = None,
        device_count: Callable[[], int] | None = None,
        backend_fn: Callable[[], str] | None = None,
        *,
        cap_fn: CapFn | None = None,
        current_device: Callable[[], int] | None = None,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.health = ProbeHealth("allocator")
        # A read is ``parse_fn(raw_fn(device))``: torch's nested dict picked apart (``flat_from_nested``),
        # or a given ``stats_fn``'s dict as it is. Quick step ends take the raw part now, the rest later.
        no_torch = None in (stats_fn, is_initialized, device_count, backend_fn) and not _torch_importable(self.health)
        if no_torch:  # absent, said why: nothing is read (``_never``), these only stand in for torch's
            stats_fn, is_initialized = stats_fn or _no_stats, is_initialized or _never_up
            device_count, backend_fn = device_count or int, backend_fn or str
        raw_fn: Callable[[int], Any] | None = stats_fn
        parse_fn: Callable[[Any], Mapping[str, Any]] | None = None
        self._never = no_torch  # CUDA can never come up here: read() returns at once
        if stats_fn is None or is_initialized is None or device_count is None or backend_fn is None:
            import torch

            never = _why_cuda_never(torch, counting=device_count is None)
            if never is not None:
                self.health.absent(never)
                self._never = stats_fn is None and is_initialized is None
            if raw_fn is None:
                memory = torch.cuda.memory

                def nested(device: int) -> Any:  # looked up at each call: tests on CPU patch it
                    return memory.memory_stats_as_nested_dict(device)

                raw_fn, parse_fn = nested, flat_from_nested
            is_initialized = is_initialized or torch.cuda.is_initialized
            device_count = device_count or torch.cuda.device_count
            backend_fn = backend_fn or torch.cuda.memory.get_allocator_backend
            cap_fn = cap_fn or torch_cap_reader(torch)
            current_device = current_device or torch.cuda.current_device
        assert raw_fn is not None  # given, or torch's
        self._raw_fn: Callable[[int], Any] = raw_fn
        self._parse_fn = parse_fn
        self._sampled: tuple[int, ...] = ()  # the devices the last read() sampled: read_raw reads those
        self._is_initialized = is_initialized
        self._device_count = device_count
        self._backend_fn = backend_fn
        self._count: int | None = None
        self.backend: str | None = None  # read once CUDA is up (the backend is fixed by then)
        self._cap_fn = cap_fn
        self._environ = os.environ if environ is None else environ
        self._clock = clock
        self.expandable_segments: bool | None = None  # read with the backend, from the environment
        self._caps: dict[int, tuple[float, float | None, int | None]] = {}  # device -> (read at, fraction, cap)
        self._current_device = current_device
        self._touched: set[int] = set()  # devices whose allocator has reserved memory
        self._scanned_at: float | None = None  # when every visible device was last looked at

    def read(self) -> tuple[AllocatorSample, ...]:
        if self._never or not self.health.call(self._is_initialized, False):
            return ()  # normal before the job's first CUDA op: nothing to read, nothing to say
        try:
            if self._count is None:
                self._count = int(self._device_count())
            if self.backend is None:
                self.backend = self._read_backend()
                self.expandable_segments = expandable_segments_from_env(self._environ)
            samples = []
            for device in self._devices_to_read():
                stats = self._stats(self._raw_fn(device))
                if not touched(stats):
                    continue
                self._touched.add(device)
                sample = self._sample(device, stats)
                if sample is not None:
                    samples.append(sample)
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into the training loop
            self._scanned_at = None  # a failed read tells nothing of the devices in use: look at all next time
            self._sampled = ()
            self.health.failed(exc)
            return ()
        self.health.ok()
        self._sampled = tuple(s.device.cuda_index for s in samples if s.device.cuda_index is not None)
        return tuple(samples)

    def read_raw(self) -> tuple[tuple[int, Any], ...]:
        """The devices the last ``read()`` sampled, as torch returns their statistics (one C++ call
        each, ~12 µs on an H200), for ``parse_raw`` later: a quick sampled step end reads these and
        leaves the picking apart, ~10x that after a step of compute, to a batch. A device first used
        since the last ``read()`` waits for the next one."""
        if not self._sampled:
            return ()
        raw_fn = self._raw_fn
        try:
            return tuple((device, raw_fn(device)) for device in self._sampled)
        except Exception as exc:  # noqa: BLE001 - a probe must never raise into the training loop
            self.health.failed(exc)
            return ()

    def parse_raw(self, raw: tuple[tuple[int, Any], ...]) -> tuple[AllocatorSample, ...]:
        """``read_raw``'s statistics as the samples ``read()`` would have made of them then."""
        samples = []
        try:
            for device, stats_raw in raw:
                sample = self._sample(device, self._stats(stats_raw))
                if sample is not None:
                    samples.append(sample)
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)
            return ()
        return tuple(samples)

    def _stats(self, raw: Any) -> Mapping[str, Any]:
        return self._parse_fn(raw) if self._parse_fn is not None else raw

    def _sample(self, device: int, stats: Mapping[str, Any]) -> AllocatorSample | None:
        fraction, cap = self._cap(device)
        return sample_from_stats(device, stats, backend=self.backend or "native",
                                 expandable_segments=bool(self.expandable_segments),
                                 memory_fraction=fraction, cap_bytes=cap)

    def _devices_to_read(self) -> list[int]:
        """Every visible device on the first read and every ``DEVICE_RESCAN_S``; in between the job's
        own: those it reserved memory on and the current device (``torch.cuda.set_device``)."""
        count = self._count or 0
        now = self._clock()
        if self._scanned_at is None or now - self._scanned_at >= DEVICE_RESCAN_S:
            self._scanned_at = now
            return list(range(count))
        current = None
        if self._current_device is not None:
            try:
                current = int(self._current_device())
            except Exception:  # noqa: BLE001 - the devices already known are still read
                current = None
        touched = self._touched
        if len(touched) == 1 and (current is None or current in touched):
            return list(touched)  # the usual case, one device in use: no set built, nothing sorted
        wanted = touched | {current} if current is not None else touched
        return sorted(d for d in wanted if 0 <= d < count)

    def _cap(self, device: int) -> tuple[float | None, int | None]:
        """The device's (memory fraction, cap): cached, read again after ``CAP_RECHECK_S``."""
        now = self._clock()
        cached = self._caps.get(device)
        if cached is not None and now - cached[0] < CAP_RECHECK_S:
            return cached[1], cached[2]
        fraction, cap = self._read_cap(device)
        self._caps[device] = (now, fraction, cap)
        return fraction, cap

    def _read_cap(self, device: int) -> tuple[float | None, int | None]:
        if self._cap_fn is None:
            return None, None
        try:
            read = self._cap_fn(device)
        except Exception:  # noqa: BLE001 - no cap figure is no reason to lose the allocator's sample
            return None, None
        if read is None:
            return None, None
        fraction, total = read
        # torch: allowed_memory_maximum = fraction x total; getMemoryFraction returns 1.0 when none is set
        return fraction, (int(fraction * total) if 0 <= fraction < 1 else None)

    def _read_backend(self) -> str:
        try:
            return str(self._backend_fn())
        except Exception:  # noqa: BLE001 - torch < 2.0 has no get_allocator_backend: native was the only one
            return "native"
