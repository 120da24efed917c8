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
import re
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

from gpumemd.probes.health import ProbeHealth, log
from gpumemd.records.device import Device
from gpumemd.records.samples import NvmlDeviceSample


def parse_visible_devices(var: str | None) -> list[int] | list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` read as torch reads it (``torch.cuda._parse_visible_devices``); None
    when unset (every device). ``""`` is no device; integers are read like ``strtoul`` ("1gpu" is 1)
    and a negative or unreadable entry ends the list; ``GPU-``/``MIG-`` lists stop at the first entry
    without the prefix; a repeated entry makes the whole list empty."""
    if var is None:
        return None
    for prefix in ("GPU-", "MIG-"):
        if var.startswith(prefix):
            names: list[str] = []
            for elem in var.split(","):
                if elem in names:
                    return []
                if not elem.startswith(prefix):
                    break
                names.append(elem)
            return names
    ordinals: list[int] = []
    for elem in var.split(","):
        digits = re.match(r"[+-]?\d+", elem.strip())
        value = int(digits[0]) if digits else -1
        if value in ordinals:
            return []
        if value < 0:
            break
        ordinals.append(value)
    return ordinals


def counting_initialises_cuda(visible: str | None) -> bool:
    """Would ``torch.cuda.device_count()`` before CUDA is up call cudaGetDeviceCount whatever NVML can do?
    Under a ``MIG-`` list it does (torch 2.13's ``_device_count_nvml`` skips MIG UUIDs), which initialises
    CUDA in this process and poisons fork: gpumemd then leaves the count alone until the job is on CUDA."""
    parsed = parse_visible_devices(visible)
    return parsed is not None and bool(parsed) and str(parsed[0]).startswith("MIG-")


def uuids_to_indices(candidates: list[str], uuids: list[str]) -> list[int]:
    """UUID prefixes -> indices, as torch does: an unknown or ambiguous prefix ends the list, a
    device named twice makes it empty."""
    out: list[int] = []
    for candidate in candidates:
        matches = [i for i, u in enumerate(uuids) if u.startswith(candidate)]
        if len(matches) != 1:
            break
        if matches[0] in out:
            return []
        out.append(matches[0])
    return out


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def visible_indices(nvml: Any, count: int, visible: str | None) -> list[int]:
    """NVML indices of the whole GPUs this process may use, in CUDA ordinal order (``MIG-`` lists
    name MIG instances, not GPUs: see ``visible_handles``)."""
    parsed = parse_visible_devices(visible)
    if parsed is None:
        return list(range(count))
    if parsed and isinstance(parsed[0], str):
        if parsed[0].startswith("MIG-"):
            return []
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        return uuids_to_indices([str(p) for p in parsed], uuids)
    out: list[int] = []
    for index in parsed:
        if not isinstance(index, int) or index >= count:
            break  # CUDA trims the list at the first ordinal past the last device
        out.append(index)
    return out


def visible_handles(nvml: Any, count: int, visible: str | None) -> list[Any]:
    """NVML handles in CUDA ordinal order: whole GPUs, or the MIG instances a ``MIG-`` list names
    (a MIG instance has its own memory; its parent's totals would be the wrong device)."""
    parsed = parse_visible_devices(visible)
    if not (parsed and isinstance(parsed[0], str) and parsed[0].startswith("MIG-")):
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in visible_indices(nvml, count, visible)]
    instances = [m for i in range(count) for m in mig_instances(nvml, nvml.nvmlDeviceGetHandleByIndex(i))]
    picked = uuids_to_indices([str(p) for p in parsed], [u for u, _ in instances])
    return [instances[k][1] for k in picked]


def mig_instances(nvml: Any, parent: Any) -> list[tuple[str, Any]]:
    """(UUID, handle) of each MIG instance of ``parent``; none when it is not in MIG mode (or the GPU or
    driver has no MIG)."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(parent)
    except Exception:  # noqa: BLE001 - no MIG support on this GPU or driver
        return []
    if not current:
        return []
    out: list[tuple[str, Any]] = []
    for j in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            child = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)
        except Exception:  # noqa: BLE001 - an empty slot
            continue
        out.append((_text(nvml.nvmlDeviceGetUUID(child)), child))
    return out


_HEX32 = re.compile(r"[0-9a-f]{32}")


def uuid_key(raw: Any) -> str | None:
    """The 32 hex digits of a device UUID, lower case, for comparing CUDA's and NVML's spellings: NVML's
    ``GPU-8-4-4-4-12`` and ``MIG-8-4-4-4-12``, torch's bare ``8-4-4-4-12`` (``str(_CUuuid)``). None for
    anything else, such as older drivers' ``MIG-GPU-<uuid>/<gi>/<ci>`` (which no CUDA UUID equals)."""
    if raw is None:
        return None
    text = _text(raw).strip().lower()
    for prefix in ("mig-", "gpu-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    digits = text.replace("-", "")
    return digits if _HEX32.fullmatch(digits) else None


def torch_cuda_uuid(ordinal: int) -> str | None:
    """``str(torch.cuda.get_device_properties(ordinal).uuid)`` where the job has initialised CUDA; None
    otherwise (this never initialises CUDA: that would take GPU memory and poison fork)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    return None if uuid is None else str(uuid)


class _Gpu:
    """One NVML whole GPU as a UUID match candidate, with its MIG instances when in MIG mode."""

    __slots__ = ("handle", "index", "instances", "key")

    def __init__(self, index: int, handle: Any, key: str | None, instances: list[tuple[str | None, Any]]) -> None:
        self.index, self.handle, self.key, self.instances = index, handle, key, instances


def nvml_gpus(nvml: Any) -> list[_Gpu]:
    gpus = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        instances = [(uuid_key(u), h) for u, h in mig_instances(nvml, handle)]
        gpus.append(_Gpu(i, handle, uuid_key(nvml.nvmlDeviceGetUUID(handle)), instances))
    return gpus


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
        gpus: list[_Gpu] | None = None
        for ordinal in ordinals:
            self._by_uuid[ordinal] = None
            try:
                key = uuid_key(self._cuda_uuid(ordinal))
                if key is None:
                    missed.append(f"{ordinal} (CUDA gives no UUID)")
                    continue
                if gpus is None:
                    gpus = nvml_gpus(self._nvml)
                handle, where, why = self._find(gpus, key, env.get(ordinal))
                same = handle is not None and ordinal in env and where == self._env_place(gpus, env[ordinal])
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
        merged = dict(self._handles or ())
        merged.update({o: h for o, h in self._by_uuid.items() if h is not None})
        self._targets = sorted(merged.items(), key=lambda pair: pair[0])

    def _find(self, gpus: list[_Gpu], key: str, env_handle: Any) -> tuple[Any, str, str]:
        """(handle, where, why not): the MIG instance or whole GPU whose UUID is ``key``."""
        for gpu in gpus:
            for j, (mig_key, mig_handle) in enumerate(gpu.instances):
                if mig_key == key:
                    return mig_handle, f"NVML GPU {gpu.index} MIG instance {j}", ""
        for gpu in gpus:
            if gpu.key != key:
                continue
            if not gpu.instances:
                return gpu.handle, f"NVML GPU {gpu.index}", ""
            # CUDA gave the parent's UUID (older drivers do for a MIG device): its memory is not ours.
            if env_handle is not None:
                env_key = uuid_key(self._nvml.nvmlDeviceGetUUID(env_handle))
                for j, (mig_key, _) in enumerate(gpu.instances):
                    if mig_key is not None and mig_key == env_key:
                        return env_handle, f"NVML GPU {gpu.index} MIG instance {j}", ""
            if len(gpu.instances) == 1:
                return gpu.instances[0][1], f"NVML GPU {gpu.index} MIG instance 0", ""
            return None, "", f"on MIG GPU {gpu.index}, instance unknown"
        return None, "", "no NVML device has its UUID"

    def _env_place(self, gpus: list[_Gpu], handle: Any) -> str:
        """``where`` for the env's handle, found by UUID (pynvml handles compare by identity)."""
        key = uuid_key(self._nvml.nvmlDeviceGetUUID(handle))
        for gpu in gpus:
            if gpu.key == key and not gpu.instances:
                return f"NVML GPU {gpu.index}"
            for j, (mig_key, _) in enumerate(gpu.instances):
                if mig_key == key:
                    return f"NVML GPU {gpu.index} MIG instance {j}"
        return ""

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
