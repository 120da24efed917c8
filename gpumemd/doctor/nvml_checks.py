"""NVML: the binding, the driver and devices, and whether it lists this process."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from gpumemd.analysis.units import format_bytes
from gpumemd.doctor.check import Check, Status
from gpumemd.probes.device.nvml_devices import nvml_text, visible_indices


def import_nvml() -> Any:
    """The NVML binding (nvidia-ml-py's ``pynvml``), or None. Warnings caught: the deprecated ``pynvml``
    PyPI shim warns on import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import pynvml
        except ImportError:
            return None
    return pynvml


def check_nvml(nvml: Any, pid: int, *, visible: str | None = None, torch_sees_cuda: bool = False,
               has_context: bool = False, context_error: str | None = None) -> list[Check]:
    """Two lines: NVML itself (binding, init, driver, devices), and whether it lists this pid.
    Never needed: without NVML gpumemd still reads torch's allocator; only driver-level totals and
    this process's own driver-level use are absent. On a machine with no CUDA device there is
    nothing for NVML to read, so its absence is "n/a" there and a warning only where torch sees GPUs."""
    absent: Status = "warn" if torch_sees_cuda else "n/a"
    lost = "device totals and this process's driver-level use will be absent" if torch_sees_cuda \
        else "no CUDA device here either"
    skipped = Check("nvml process", "n/a", "NVML is not available")
    if nvml is None:
        return [Check("nvml", absent, f"the binding is not installed (pip install nvidia-ml-py): {lost}"), skipped]
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [Check("nvml", absent, f"not available ({type(exc).__name__}: {exc}): {lost}"), skipped]
    try:
        driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        indices = visible_indices(nvml, count, visible)
        handles = [(ordinal, nvml.nvmlDeviceGetHandleByIndex(i)) for ordinal, i in enumerate(indices)]
        detail = f"driver {driver}, {count} device{'s' if count != 1 else ''}"
        if len(indices) != count:
            detail += f", {len(indices)} visible to this process (CUDA_VISIBLE_DEVICES={visible!r})"
        if handles and not torch_sees_cuda:
            main = Check("nvml", "warn", f"{detail}, but torch cannot use them (see cuda): install a CUDA build "
                         "of torch to record device memory")
        else:
            main = Check("nvml", "ok" if handles else "warn", detail if handles else f"{detail}: none to read")
        return [main, _process_check(nvml, handles, pid, has_context, context_error)]
    finally:
        with contextlib.suppress(Exception):  # a handle that will not shut down changes no answer
            nvml.nvmlShutdown()


def _process_check(nvml: Any, handles: list[tuple[int, Any]], pid: int, has_context: bool,
                   context_error: str | None) -> Check:
    name = "nvml process"
    if not handles:
        return Check(name, "n/a", "no device visible to this process")
    if not has_context:
        why = f"no CUDA context could be created ({context_error})" if context_error else "no CUDA context"
        return Check(name, "n/a", f"not checked: {why}, so NVML would not list this process")
    others: set[int] = set()
    for ordinal, handle in handles:
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception as exc:  # noqa: BLE001 - NotSupported on some drivers and MIG
            return Check(name, "warn", f"NVML cannot list processes ({type(exc).__name__}: {exc}): per-process "
                         "used memory will be absent")
        for proc in procs:
            if int(proc.pid) == pid:
                used = getattr(proc, "usedGpuMemory", None)
                amount = format_bytes(used) if isinstance(used, int) else "amount not reported"
                return Check(name, "ok", f"NVML lists this process (pid {pid}, {amount} on device {ordinal}): "
                             "per-process used memory will be reported")
            others.add(int(proc.pid))
    if others:
        listed = ", ".join(map(str, sorted(others)[:5])) + (", ..." if len(others) > 5 else "")
        return Check(name, "warn", f"NVML lists pid(s) {listed} but not this process (pid {pid}): this process's "
                     "own GPU memory cannot be read (PID namespace, e.g. a container without --pid=host): "
                     "per-process used memory will be absent")
    return Check(name, "warn", f"NVML lists no process at all, not even this one (pid {pid}; MIG, or a driver "
                 "that hides processes): per-process used memory will be absent")
