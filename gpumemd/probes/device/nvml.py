"""The driver's view of each device through NVML (``import pynvml`` from nvidia-ml-py).

NVML creates no CUDA context, so it is safe before the job touches a GPU. Inside containers NVML may
report host-namespace PIDs: "this process's use" is then absent (None), not 0, and said once.
Devices are numbered as CUDA numbers them under ``CUDA_VISIBLE_DEVICES`` (parsed as torch parses
it), and the agent reads only the devices its process uses: under torchrun, eight ranks each
reading eight GPUs would multiply every series by eight and blame each rank for the others' memory.

``CUDA_VISIBLE_DEVICES`` alone names NVML's device only under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (NVML's
order) or on a one-GPU machine: CUDA's default order is fastest first. Once the job has initialised
CUDA (``read(..., has_context=True)``), each ordinal is matched once by UUID
(``torch.cuda.get_device_properties(i).uuid`` against ``nvmlDeviceGetUUID``, MIG instances included);
the probe never initialises CUDA itself.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection
from typing import Any

from gpumemd.probes.device.nvml_devices import (
    Gpu,
    find_by_uuid,
    nvml_gpus,
    place_of,
    torch_cuda_uuid,
    uuid_key,
    visible_handles,
)
from gpumemd.probes.health import ProbeHealth, log
from gpumemd.records.device import Device
from gpumemd.records.samples import NvmlDeviceSample


class NvmlProbe:
    """Per visible device: total/used/free and this process's own use. Seams: ``nvml`` module;
    ``cuda_uuid`` (ordinal -> CUDA's UUID of that device, or None), called only once CUDA is up;
    ``wall_clock`` (each sample's ``read_at``). ``defer``: NVML is not initialised here but by
    ``start()``, which the agent's sampler calls on its own thread (``nvmlInit`` loads the driver
    library and may take tens of milliseconds, seconds without persistence mode: not the training
    thread's to pay); ``read()`` returns nothing until then."""

    def __init__(self, nvml: Any = None, pid: int | None = None, visible: str | None = None,
                 cuda_uuid: Callable[[int], str | None] | None = None,
                 wall_clock: Callable[[], float] = time.time, *, defer: bool = False) -> None:
        self.health = ProbeHealth("nvml")
        self._nvml = nvml
        self._pid = os.getpid() if pid is None else pid
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        self._cuda_uuid = torch_cuda_uuid if cuda_uuid is None else cuda_uuid
        self._wall = wall_clock  # stamps each reading (NvmlDeviceSample.read_at)
        self._handles: list[tuple[int, Any]] | None = None  # from CUDA_VISIBLE_DEVICES
        self._by_uuid: dict[int, Any] = {}  # ordinal -> handle matched by UUID, or None: keep the env's
        self._targets: list[tuple[int, Any]] = []  # what read() reads: _handles with _by_uuid applied
        self._pid_note_logged = False
        self._memory_v2: bool | None = None  # None until tried; False: the driver has only v1
        self._process_calls: dict[int, list[str]] = {}  # ordinal -> pynvml names still to use, newest first
        self._started = False
        if not defer:
            self.start()

    def start(self) -> None:
        """Initialise NVML and find the visible devices (once; a second call does nothing)."""
        if self._started:
            return
        self._started = True
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
            self._handles = list(enumerate(visible_handles(self._nvml, count, self._visible)))
        except ImportError:
            self.health.absent("the NVML binding is not installed (pip install nvidia-ml-py)")
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.health.absent(f"NVML unavailable ({type(exc).__name__}: {exc})")
        else:
            if not self._handles:
                self.health.absent("NVML sees no device visible to this process")
                self._handles = None
            else:
                self._targets = list(self._handles)

    @property
    def visible_count(self) -> int:
        return len(self._handles or ())

    def read(self, devices: Collection[int] | None = None, *,
             has_context: bool = False) -> tuple[NvmlDeviceSample, ...]:
        """The visible devices, or only the CUDA ordinals in ``devices``. ``has_context``: this process
        has a CUDA context on them, so NVML must list its pid (else that is a PID namespace), and CUDA
        can say each device's UUID: an ordinal not matched yet is matched now (once; later reads, with
        or without ``has_context``, use the match)."""
        if self._handles is None:
            return ()
        if has_context:
            wanted = (o for o, _ in self._handles) if devices is None else devices
            todo = sorted({o for o in wanted if o not in self._by_uuid})
            if todo:
                self._match_by_uuid(todo)
        out = []
        failed = False
        for ordinal, handle in self._targets:
            if devices is not None and ordinal not in devices:
                continue
            try:  # one device's error (a GPU fallen off the bus, a MIG reconfiguration) costs only its sample
                mem = self._memory(handle)
                out.append(
                    NvmlDeviceSample(
                        device=Device.cuda(ordinal),
                        total_bytes=int(mem.total),
                        used_bytes=int(mem.used),
                        free_bytes=int(mem.free),
                        process_used_bytes=self._process_used(ordinal, handle, has_context),
                        read_at=self._wall(),
                    )
                )
            except Exception as exc:  # noqa: BLE001
                failed = True
                self.health.failed(exc)
        if not failed:
            self.health.ok()
        return tuple(out)

    def _match_by_uuid(self, ordinals: list[int]) -> None:
        """Match each ordinal to the NVML device (whole GPU, or MIG instance) with CUDA's UUID for it;
        where that fails, keep the ``CUDA_VISIBLE_DEVICES`` handle. Each outcome is cached and said
        once. Never raises: a mismatch here must not cost the sample."""
        env = dict(self._handles or ())
        missed: list[str] = []
        moved: list[str] = []
        gpus: list[Gpu] | None = None
        for ordinal in ordinals:
            self._by_uuid[ordinal] = None
            try:
                key = uuid_key(self._cuda_uuid(ordinal))
                if key is None:
                    missed.append(f"{ordinal} (CUDA gives no UUID)")
                    continue
                if gpus is None:
                    gpus = nvml_gpus(self._nvml)
                handle, where, why = find_by_uuid(self._nvml, gpus, key, env.get(ordinal))
                same = handle is not None and ordinal in env and where == place_of(self._nvml, gpus, env[ordinal])
            except Exception as exc:  # noqa: BLE001 - torch or NVML refused: the env's handle stays
                missed.append(f"{ordinal} ({type(exc).__name__}: {exc})")
                continue
            if handle is None:
                missed.append(f"{ordinal} ({why})")
                continue
            self._by_uuid[ordinal] = handle
            if not same:
                moved.append(f"{ordinal} -> {where}")
        if moved:
            log.info("gpumemd: CUDA device %s by UUID (CUDA_VISIBLE_DEVICES alone named another NVML device: "
                     "CUDA_DEVICE_ORDER is not NVML's PCI order?)", ", ".join(moved))
        if missed:
            log.info("gpumemd: NVML device of CUDA device %s not found by UUID; numbering it by "
                     "CUDA_VISIBLE_DEVICES", ", ".join(missed))
        env.update({o: h for o, h in self._by_uuid.items() if h is not None})  # now what read() reads
        self._targets = sorted(env.items(), key=lambda pair: pair[0])

    def _memory(self, handle: Any) -> Any:
        """Memory info v2 where the driver has it: v1's ``used`` includes the driver's reserved
        memory (hundreds of MiB), which would read as this job's growth or someone else's use."""
        nvml = self._nvml
        if self._memory_v2 is not False and hasattr(nvml, "nvmlMemory_v2"):
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
                self._memory_v2 = True
                return mem
            except Exception as exc:  # noqa: BLE001 - NVMLError_FunctionNotFound on older drivers
                if self._memory_v2 is None:
                    log.info("gpumemd: NVML memory info v2 unavailable (%s); device 'used' includes "
                             "driver-reserved memory", exc)
                self._memory_v2 = False
        return nvml.nvmlDeviceGetMemoryInfo(handle)

    def _processes(self, ordinal: int, handle: Any) -> list[Any] | None:
        """Compute processes through the newest call this device answers (v3, then v2), found once per
        device and said once: one device's refusal (a MIG instance, a GPU in another driver mode) leaves
        the others on v3. None when neither works: this device's per-process use is then absent."""
        calls = self._process_calls.get(ordinal)
        if calls is None:
            calls = self._process_calls[ordinal] = [
                n for n in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2")
                if hasattr(self._nvml, n)]
        errors: list[str] = []
        while calls:
            try:
                procs = list(getattr(self._nvml, calls[0])(handle))
            except Exception as exc:  # noqa: BLE001 - version mismatch, not supported: try the older call
                errors.append(f"{calls.pop(0)}: {type(exc).__name__}: {exc}")
                continue
            if errors:
                log.info("gpumemd: NVML on device %d: %s; using %s", ordinal, "; ".join(errors), calls[0])
            return procs
        if errors:
            log.info("gpumemd: NVML cannot list compute processes on device %d (%s); this process's use of it "
                     "is absent", ordinal, "; ".join(errors))
        return None

    def _process_used(self, ordinal: int, handle: Any, has_context: bool) -> int | None:
        procs = self._processes(ordinal, handle)
        if procs is None:
            return None
        for proc in procs:
            if int(proc.pid) == self._pid:
                used = getattr(proc, "usedGpuMemory", None)
                return int(used) if isinstance(used, int) else None
        if procs and has_context and not self._pid_note_logged:
            self._pid_note_logged = True
            log.info(
                "gpumemd: NVML lists processes on the device but not pid %d (a container's PID namespace?); "
                "this process's device use is reported as absent", self._pid,
            )
        return None

    def close(self) -> None:
        if self._handles is not None:
            # shutting down a driver handle must not fail detach
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._handles = None
            self._targets = []
