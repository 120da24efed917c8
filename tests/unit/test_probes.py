"""Probes fed with data in exactly the shape PyTorch produces (TORCH_MEMORY_API.md §1.1)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from cuda_recordings import nested_from_flat, recorded_memory_stats
from fakes import FakeGpu, FakeNvml, ManualClock

from gpumemd.probes.device.allocator import DEVICE_RESCAN_S, AllocatorProbe, sample_from_stats, touched
from gpumemd.probes.device.nvml import NvmlProbe
from gpumemd.probes.device.nvml_devices import visible_indices
from gpumemd.probes.process.host import HostProbe
from gpumemd.probes.process.identity import current_identity, identity_from_env
from gpumemd.records.device import Device

_ARRAYS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
           "active_bytes", "inactive_split_bytes", "requested_bytes")


def torch_stats(allocated: int, reserved: int, *, old: bool = False) -> OrderedDict[str, int]:
    """A flattened memory_stats() dict with the 2.13 key set (123 keys); ``old`` drops the keys that
    older releases lack (requested_bytes, num_device_*, num_sync_all_streams, num_oom_rejections)."""
    values = {"allocated_bytes": allocated, "reserved_bytes": reserved, "active_bytes": allocated,
              "inactive_split_bytes": 2 * 1024 * 1024, "requested_bytes": allocated - 512,
              "segment": 3, "allocation": 10, "active": 10, "inactive_split": 1}
    flat: dict[str, int] = {}
    for name in _ARRAYS:
        for pool in ("all", "large_pool", "small_pool"):
            for stat in ("current", "peak", "allocated", "freed"):
                v = values[name] if pool == "all" else values[name] // 2
                flat[f"{name}.{pool}.{stat}"] = v * (2 if stat == "peak" else 1)
    for name in ("oversize_allocations", "oversize_segments"):
        for stat in ("current", "peak", "allocated", "freed"):
            flat[f"{name}.{stat}"] = 0
    flat.update(num_alloc_retries=4, num_ooms=1, num_sync_all_streams=0, num_device_alloc=7,
                num_device_free=2, num_oom_rejections=0, max_split_size=-1)
    if old:
        for key in list(flat):
            if key.startswith(("requested_bytes", "num_device", "num_sync", "num_oom_rej")):
                del flat[key]
    assert old or len(flat) == 123
    return OrderedDict(sorted(flat.items()))


def test_sample_reads_the_documented_keys() -> None:
    sample = sample_from_stats(0, torch_stats(1000, 4096))
    assert sample is not None
    assert (sample.allocated_bytes, sample.reserved_bytes, sample.allocated_peak_bytes) == (1000, 4096, 2000)
    assert (sample.num_alloc_retries, sample.num_ooms, sample.num_device_alloc) == (4, 1, 7)
    assert sample.requested_bytes == 488 and sample.segment_count == 3


def test_missing_keys_are_absent_not_zero() -> None:
    sample = sample_from_stats(1, torch_stats(1000, 4096, old=True))
    assert sample is not None
    assert sample.requested_bytes is None and sample.num_device_alloc is None
    assert sample.allocated_bytes == 1000


def test_empty_stats_before_cuda_init_is_no_sample() -> None:
    assert sample_from_stats(0, {}) is None


def test_probe_reads_only_touched_devices_and_only_after_init() -> None:
    initialised = [False]
    stats = {0: torch_stats(10, 20), 1: OrderedDict((k, 0) for k in torch_stats(0, 0))}
    probe = AllocatorProbe(stats_fn=lambda d: stats[d], is_initialized=lambda: initialised[0],
                           device_count=lambda: 2)
    assert probe.read() == ()
    initialised[0] = True
    samples = probe.read()
    assert [s.device for s in samples] == [Device.cuda(0)]
    assert probe.health.available is True


def test_probe_failure_degrades_to_absent_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    def boom(device: int) -> dict[str, int]:
        raise RuntimeError("driver went away")

    probe = AllocatorProbe(stats_fn=boom, is_initialized=lambda: True, device_count=lambda: 1)
    with caplog.at_level("WARNING", logger="gpumemd"):
        assert probe.read() == () and probe.read() == ()
    assert probe.health.errors == 2
    assert sum("driver went away" in r.getMessage() for r in caplog.records) == 1


def test_real_cpu_build_allocator_probe_is_absent() -> None:
    probe = AllocatorProbe()
    assert probe.read() == ()
    assert probe.health.available is False


def test_host_probe_reads_this_process() -> None:
    probe = HostProbe(pinned_fn=lambda: None)
    sample = probe.read()
    assert sample is not None and sample.rss_bytes > 10 * 1024 * 1024
    assert sample.available_bytes is not None and sample.total_bytes is not None
    assert sample.available_bytes <= sample.total_bytes
    resident = probe.resident()
    assert resident is not None and resident[1] is not None and 0 <= resident[1] <= resident[0]


TWO_GPUS = [FakeGpu(used=10 << 30), FakeGpu(used=11 << 30)]  # of 80 GiB each


def test_nvml_reads_devices_and_this_process() -> None:
    nvml = FakeNvml(TWO_GPUS, processes={123: 5 << 30})
    probe = NvmlProbe(nvml=nvml, pid=123, visible="1")
    (sample,) = probe.read()
    assert (sample.device, sample.used_bytes, sample.process_used_bytes) == (Device.cuda(0), 11 << 30, 5 << 30)
    probe.close()
    assert nvml.shutdown


def test_nvml_foreign_pid_namespace_is_absent_not_zero() -> None:
    probe = NvmlProbe(nvml=FakeNvml(TWO_GPUS, processes={1: 5 << 30}), pid=999, visible="0,1")
    samples = probe.read()
    assert len(samples) == 2 and all(s.process_used_bytes is None for s in samples)


def test_nvml_missing_library_is_absent() -> None:
    class Missing(FakeNvml):
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    probe = NvmlProbe(nvml=Missing(TWO_GPUS), pid=1)
    assert probe.read() == () and probe.health.available is False


def test_visible_devices_by_index_and_uuid() -> None:
    nvml = FakeNvml(TWO_GPUS, uuid_bytes=True)
    assert visible_indices(nvml, 2, None) == [0, 1]
    assert visible_indices(nvml, 2, "1,0") == [1, 0]
    assert visible_indices(nvml, 2, "GPU-1aa") == [1]
    assert visible_indices(nvml, 2, "0,-1,1") == [0]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8, "torchrun")),
        ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16"}, (5, 1, 16, "slurm")),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"},
         (2, 0, 4, "openmpi")),
    ],
)
def test_identity_from_launcher_env(env: dict[str, str], expected: tuple[int, int, int, str]) -> None:
    ident = identity_from_env(env)
    assert ident is not None
    assert (ident.rank, ident.local_rank, ident.world_size, ident.source) == expected


def test_identity_defaults_to_single_process() -> None:
    ident = current_identity({})
    assert (ident.rank, ident.world_size, ident.source) == (0, 1, "default") and ident.pid > 0


def test_cuda_malloc_async_zeros_are_absent_not_zero() -> None:
    """Under backend:cudaMallocAsync torch reports OOMs, retries, fragmentation,
    segments and requested bytes as 0 whatever happens; they are absent, not a measured 0."""
    stats = torch_stats(1000, 4096)
    native = sample_from_stats(0, stats)
    asynchronous = sample_from_stats(0, stats, backend="cudaMallocAsync")
    assert native is not None and asynchronous is not None
    assert native.num_ooms == 1 and native.inactive_split_bytes is not None
    assert (asynchronous.allocated_bytes, asynchronous.reserved_bytes) == (1000, 4096)
    assert asynchronous.active_bytes == native.active_bytes and asynchronous.allocated_peak_bytes is not None
    for name in ("num_ooms", "num_alloc_retries", "inactive_split_bytes", "segment_count", "requested_bytes",
                 "num_device_alloc", "num_device_free"):
        assert getattr(asynchronous, name) is None, name
    probe = AllocatorProbe(stats_fn=lambda d: stats, is_initialized=lambda: True, device_count=lambda: 1,
                           backend_fn=lambda: "cudaMallocAsync")
    (sample,) = probe.read()
    assert probe.backend == "cudaMallocAsync" and sample.num_ooms is None and sample.reserved_bytes == 4096


def test_allocator_probe_never_asks_cuda_runtime_for_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch.cuda.is_available() calls cudaGetDeviceCount (cuInit) unless
    PYTORCH_NVML_BASED_CUDA_CHECK is set, which poisons fork for DataLoader workers."""
    import torch

    def poisoned() -> bool:
        raise AssertionError("torch.cuda.is_available() called at attach")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # as on a CUDA build
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    probe = AllocatorProbe()
    assert probe.read() == ()
    assert probe.health.absent_reason == "no CUDA device is visible to this process"


def test_only_the_jobs_own_devices_are_read_between_rescans() -> None:
    """torch.cuda.memory_stats is per device: a sample reads the current device and those the job
    reserved memory on, and looks at all eight only every DEVICE_RESCAN_S (a device taken up later)."""
    reserved = {3: 2**20}  # torchrun rank 3: its own GPU only
    asked: list[int] = []

    def stats(device: int) -> dict[str, int]:
        asked.append(device)
        held = reserved.get(device, 0)
        return {"reserved_bytes.all.current": held, "reserved_bytes.all.peak": held, "allocated_bytes.all.current": 0}

    clock = ManualClock(0.0)
    probe = AllocatorProbe(stats_fn=stats, is_initialized=lambda: True, device_count=lambda: 8,
                           backend_fn=lambda: "native", current_device=lambda: 3, clock=clock)
    assert [s.device.cuda_index for s in probe.read()] == [3]
    assert asked == list(range(8))  # the first read looks at every device
    asked.clear()
    for _ in range(5):
        clock.now += 1.0
        probe.read()
    assert asked == [3] * 5
    reserved[5] = 2**20  # the job starts using another GPU (model parallel)
    clock.now += DEVICE_RESCAN_S
    asked.clear()
    assert [s.device.cuda_index for s in probe.read()] == [3, 5]
    assert asked == list(range(8))
    asked.clear()
    clock.now += 1.0
    probe.read()
    assert asked == [3, 5]


def _replayed() -> dict[str, dict[str, int]]:
    pools = dict(torch_stats(3 * 2**20, 8 * 2**20))
    pools.update({f"reserved_bytes_by_private_pools.1_0.{p}.{s}": 2**21 for p in ("all", "large_pool", "small_pool")
                  for s in ("current", "peak", "allocated", "freed")})
    return {"torch-shaped": dict(torch_stats(1000, 4096)), "torch-shaped:private-pools": dict(sorted(pools.items())),
            **recorded_memory_stats()}


@pytest.mark.parametrize("flat", list(_replayed().values()), ids=list(_replayed()))
def test_the_nested_read_gives_what_torchs_own_flattening_gives(
        monkeypatch: pytest.MonkeyPatch, flat: dict[str, int]) -> None:
    """The probe reads torch's nested dict and picks its keys (no flattening and sorting of ~120 keys
    per sample). Fed the nested dict of a recording from a real device, torch's own ``memory_stats()``
    gives the recording back, and the probe's sample is the one the flattened dict gives."""
    import torch

    nested = nested_from_flat(flat)
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", lambda device=None: nested)
    assert dict(torch.cuda.memory_stats(0)) == flat  # the nested form is the one torch flattens
    probe = AllocatorProbe(is_initialized=lambda: True, device_count=lambda: 1, backend_fn=lambda: "native",
                           cap_fn=lambda d: None, current_device=lambda: 0)
    samples = probe.read()
    expected = sample_from_stats(0, torch.cuda.memory_stats(0))
    assert samples == ((expected,) if expected is not None and touched(flat) else ())
    if flat.get("reserved_bytes_by_private_pools.1_0.all.current"):
        assert samples[0].private_pool_reserved_bytes == flat["reserved_bytes_by_private_pools.1_0.all.current"]
    # A quick step end's read: torch's nested dict now, the same sample made of it later.
    raw = probe.read_raw()
    assert raw == (((0, nested),) if samples else ())
    assert probe.parse_raw(raw) == samples


def test_a_step_records_allocator_sample_is_found_however_the_user_names_the_device() -> None:
    """``allocator_for`` takes what torch's own calls take: an ordinal, a name, a ``torch.device``."""
    import torch

    from gpumemd.records.step import StepRecord

    samples = tuple(s for d in (0, 1) if (s := sample_from_stats(d, torch_stats(1000 * (d + 1), 4096))) is not None)
    record = StepRecord(step=1, wall_time=0.0, duration_s=None, allocator=samples)
    for name in (0, "cuda:0", "cuda", torch.device("cuda", 0), torch.device("cuda"), Device.cuda(0)):
        found = record.allocator_for(name)
        assert found is not None and found.allocated_bytes == 1000, name
    found = record.allocator_for(torch.device("cuda:1"))
    assert found is not None and found.allocated_bytes == 2000
    assert record.allocator_for(2) is None and record.allocator_for("cpu") is None
    for bad in (-1, True, 1.5):
        with pytest.raises((ValueError, TypeError), match="device"):
            record.allocator_for(bad)
