"""The driver's view of each device through NVML (``import pynvml`` from nvidia-ml-py).

NVML creates no CUDA context, so it is safe before the job touches a GPU. Inside containers NVML may
report host-namespace PIDs: "this process's use" is then absent (None), not 0, and said once.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from gpumemd.probes.health import ProbeHealth
from gpumemd.records.samples import NvmlDeviceSample


def visible_indices(nvml: Any, count: int, visible: str | None) -> list[int]:
    """NVML indices of the devices this process may use, honouring CUDA_VISIBLE_DEVICES
    (integers or GPU-/MIG- UUIDs), in CUDA ordinal order."""
    if visible is None or not visible.strip():
        return list(range(count))
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    out: list[int] = []
    uuids: dict[str, int] | None = None
    for item in wanted:
        if item.lstrip("-").isdigit():
            index = int(item)
            if index < 0:
                break  # CUDA stops at the first invalid entry
            if index < count:
                out.append(index)
            continue
        if uuids is None:
            uuids = {}
            for i in range(count):
                raw = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))
                uuids[raw.decode() if isinstance(raw, bytes) else str(raw)] = i
        match = [i for u, i in uuids.items() if u.startswith(item) or item.startswith(u)]
        if match:
            out.append(match[0])
    return out


class NvmlProbe:
    """Per visible device: total/used/free and this process's own use. Seam: ``nvml`` module."""

    def __init__(self, nvml: Any = None, pid: int | None = None, visible: str | None = None) -> None:
        self.health = ProbeHealth("nvml")
        self._nvml = nvml
        self._pid = os.getpid() if pid is None else pid
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        self._handles: list[tuple[int, Any]] | None = None
        self._pid_note_logged = False
        self._start()

    def _start(self) -> None:
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
            indices = visible_indices(self._nvml, count, self._visible)
            self._handles = [(ordinal, self._nvml.nvmlDeviceGetHandleByIndex(i)) for ordinal, i in enumerate(indices)]
        except ImportError:
            self.health.absent("the NVML binding is not installed (pip install nvidia-ml-py)")
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.health.absent(f"NVML unavailable ({type(exc).__name__}: {exc})")
        else:
            if not self._handles:
                self.health.absent("NVML sees no device visible to this process")
                self._handles = None

    def read(self) -> tuple[NvmlDeviceSample, ...]:
        if self._handles is None:
            return ()
        out = []
        try:
            for ordinal, handle in self._handles:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                out.append(
                    NvmlDeviceSample(
                        device=ordinal,
                        total_bytes=int(mem.total),
                        used_bytes=int(mem.used),
                        free_bytes=int(mem.free),
                        process_used_bytes=self._process_used(handle),
                    )
                )
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)
            return ()
        self.health.ok()
        return tuple(out)

    def _process_used(self, handle: Any) -> int | None:
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - not supported on some drivers/MIG: absent
            return None
        for proc in procs:
            if int(proc.pid) == self._pid:
                used = getattr(proc, "usedGpuMemory", None)
                return int(used) if isinstance(used, int) else None
        if procs and not self._pid_note_logged:
            self._pid_note_logged = True
            from gpumemd.probes.health import log

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
