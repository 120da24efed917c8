"""Whether asking torch for the device count before CUDA is up initialises CUDA (and so poisons fork).

``torch.cuda.device_count()`` before CUDA is initialised counts devices through NVML
(``_device_count_nvml``), which creates no CUDA context. When that count fails it falls back to
``torch._C._cuda_getDeviceCount()`` (cudaGetDeviceCount), which initialises the CUDA driver in the
process and registers torch's fork handler: a process forked afterwards (DataLoader workers under the
``fork`` start method) cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess"). As torch 2.13
reads ``CUDA_VISIBLE_DEVICES`` (``_parse_visible_devices``), the count fails, and so falls back:
- always under a ``MIG-`` list (torch skips MIG UUIDs: ``_device_count_nvml`` returns -1);
- for a ``GPU-`` list or ordinals when NVML cannot be loaded or initialised (``libnvidia-ml.so.1``,
  ``nvmlInit``) or cannot list the devices.
ROCm counts through amdsmi instead; ``is_available()`` does the same unless
``PYTORCH_NVML_BASED_CUDA_CHECK=1``. gpumemd itself does not ask for the count under a ``MIG-`` list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpumemd.doctor.check import Check
from gpumemd.probes.device.nvml_devices import parse_visible_devices

_NAME = "device count"
_POISON = ("so torch.cuda.device_count() (and is_available()) before CUDA is up calls cudaGetDeviceCount, "
           "which initialises CUDA in this process: a DataLoader worker forked after it cannot use CUDA. "
           "Count after the job's own CUDA init, or use the spawn/forkserver start method")


def nvml_counts_devices() -> bool:
    """Does NVML load, initialise and count devices, as torch's ``_raw_device_count_nvml`` asks it?"""
    from ctypes import CDLL, byref, c_int

    try:
        nvml = CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit() != 0:
            return False
        count = c_int(-1)
        return nvml.nvmlDeviceGetCount_v2(byref(count)) == 0 and count.value >= 0
    except (OSError, AttributeError):
        return False


def check_device_count(torch: Any, environ: Mapping[str, str],
                       nvml_counts: Callable[[], bool] = nvml_counts_devices) -> Check:
    """One line: whether counting devices before CUDA is up stays fork-safe here."""
    if torch is None or getattr(torch.version, "cuda", None) is None:
        reason = "ROCm counts devices through amdsmi" if torch is not None and torch.version.hip else \
            "no CUDA build of torch"
        return Check(_NAME, "n/a", reason)
    parsed = parse_visible_devices(environ.get("CUDA_VISIBLE_DEVICES"))
    if parsed and isinstance(parsed[0], str) and parsed[0].startswith("MIG-"):
        return Check(_NAME, "warn", f"CUDA_VISIBLE_DEVICES names MIG instances, which torch does not count "
                     f"through NVML, {_POISON}")
    if parsed == []:
        return Check(_NAME, "ok", "CUDA_VISIBLE_DEVICES names no device: counted as 0 without CUDA")
    if not nvml_counts():
        return Check(_NAME, "warn", f"NVML (libnvidia-ml.so.1) cannot count the devices here, {_POISON}")
    return Check(_NAME, "ok", "counted through NVML before CUDA is up: fork stays safe")
