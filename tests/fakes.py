"""The fakes tests share: one manual clock, and NVML in pynvml's call shapes.

One of each, so a change in what the agent asks of a clock or of NVML is made (and reviewed) once,
not in every test file that needs one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TypeAlias

GIB = 1 << 30

# A byte count, or a function read at each NVML call (a device whose use follows the job's tensors).
Amount: TypeAlias = int | Callable[[], int]


class ManualClock:
    """A clock that moves only when the test sets (or adds to) ``now``: time-based decisions such as
    budgets, cooldowns and intervals become exact instead of depending on the machine's speed."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class NvmlError(Exception):
    """pynvml's NVMLError, as the fake raises it."""


class Handle:
    """A fresh object per call, like pynvml's ctypes pointers: equal only to itself."""

    def __init__(self, *path: int) -> None:
        self.path = path


def _amount(value: Amount) -> int:
    return value() if callable(value) else value


@dataclass
class FakeGpu:
    """One device as NVML sees it. ``used`` leaves out ``reserved`` (the driver's own memory), which
    memory info v1 counts in and v2 reports apart. ``uuid``: NVML's ``GPU-``/``MIG-`` spelling (None:
    ``GPU-<index>aaaa``). ``mig``: None, no MIG support (the mode call raises); a list, MIG-capable, in
    MIG mode when the list holds instances."""

    total: int = 80 * GIB
    used: Amount = GIB
    reserved: int = 0
    uuid: str | None = None
    mig: list[FakeGpu] | None = None

    def memory(self, v2: bool) -> SimpleNamespace:
        used = _amount(self.used)
        free = self.total - used - self.reserved
        if v2:
            return SimpleNamespace(total=self.total, used=used, free=free, reserved=self.reserved)
        return SimpleNamespace(total=self.total, used=used + self.reserved, free=free)


class FakeNvml:
    """The pynvml calls ``NvmlProbe`` makes, answering for ``gpus`` (or that many default GPUs).

    ``processes``: pid -> bytes, listed on every device. ``memory_v2`` / ``processes_v3`` False: an
    older driver, whose newer call raises "Function Not Found". ``uuid_bytes``: an old binding that
    returns ``bytes`` (today's pynvml returns ``str``). Counts ``nvmlDeviceGetCount`` calls; set
    ``uuid_error`` to make every UUID call raise; ``shutdown`` says whether the probe shut NVML down.
    """

    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: int | Sequence[FakeGpu] = 1, *, processes: Mapping[int, Amount] | None = None,
                 memory_v2: bool = True, processes_v3: bool = True, uuid_bytes: bool = False) -> None:
        self.gpus = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else list(gpus)
        self.processes = dict(processes or {})
        self.memory_v2, self.processes_v3, self.uuid_bytes = memory_v2, processes_v3, uuid_bytes
        self.count_calls = 0
        self.uuid_error: Exception | None = None
        self.shutdown = False

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        self.count_calls += 1
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Handle:
        if i >= len(self.gpus):
            raise NvmlError("Invalid Argument")
        return Handle(i)

    def _device(self, h: Handle) -> FakeGpu:
        gpu = self.gpus[h.path[0]]
        return gpu if len(h.path) == 1 else (gpu.mig or [])[h.path[1]]

    def nvmlDeviceGetUUID(self, h: Handle) -> str | bytes:
        if self.uuid_error is not None:
            raise self.uuid_error
        uuid = self._device(h).uuid or f"GPU-{h.path[0]}aaaa"
        return uuid.encode() if self.uuid_bytes else uuid

    def nvmlDeviceGetMigMode(self, h: Handle) -> list[int]:
        mig = self.gpus[h.path[0]].mig
        if mig is None:
            raise NvmlError("Not Supported")
        return [1, 1] if mig else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Handle) -> int:
        if self.gpus[h.path[0]].mig is None:
            raise NvmlError("Not Supported")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Handle, j: int) -> Handle:
        if j >= len(self.gpus[h.path[0]].mig or []):
            raise NvmlError("Not Found")
        return Handle(h.path[0], j)

    def nvmlDeviceGetMemoryInfo(self, h: Handle, version: int | None = None) -> SimpleNamespace:
        if version is not None and not self.memory_v2:
            raise NvmlError("Function Not Found")
        return self._device(h).memory(v2=version is not None)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Handle) -> list[SimpleNamespace]:
        if not self.processes_v3:
            raise NvmlError("Function Not Found: nvmlDeviceGetComputeRunningProcesses_v3")
        return self.nvmlDeviceGetComputeRunningProcesses_v2(h)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: Handle) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=_amount(used)) for pid, used in self.processes.items()]
