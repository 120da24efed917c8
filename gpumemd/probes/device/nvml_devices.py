"""Which NVML device each CUDA ordinal is: ``CUDA_VISIBLE_DEVICES`` read as torch reads it (integers,
``GPU-``/``MIG-`` UUID prefixes), MIG instances, and device UUIDs in CUDA's and NVML's spellings for
matching an ordinal by UUID once the job has initialised CUDA (``NvmlProbe``, ``probes.device.nvml``).
"""

from __future__ import annotations

import re
import sys
from typing import Any


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


def nvml_text(raw: Any) -> str:
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
        uuids = [nvml_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
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
        out.append((nvml_text(nvml.nvmlDeviceGetUUID(child)), child))
    return out


_HEX32 = re.compile(r"[0-9a-f]{32}")


def uuid_key(raw: Any) -> str | None:
    """The 32 hex digits of a device UUID, lower case, for comparing CUDA's and NVML's spellings: NVML's
    ``GPU-8-4-4-4-12`` and ``MIG-8-4-4-4-12``, torch's bare ``8-4-4-4-12`` (``str(_CUuuid)``). None for
    anything else, such as older drivers' ``MIG-GPU-<uuid>/<gi>/<ci>`` (which no CUDA UUID equals)."""
    if raw is None:
        return None
    text = nvml_text(raw).strip().lower()
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


class Gpu:
    """One NVML whole GPU as a UUID match candidate, with its MIG instances when in MIG mode."""

    __slots__ = ("handle", "index", "instances", "key")

    def __init__(self, index: int, handle: Any, key: str | None, instances: list[tuple[str | None, Any]]) -> None:
        self.index, self.handle, self.key, self.instances = index, handle, key, instances


def nvml_gpus(nvml: Any) -> list[Gpu]:
    gpus = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        instances = [(uuid_key(u), h) for u, h in mig_instances(nvml, handle)]
        gpus.append(Gpu(i, handle, uuid_key(nvml.nvmlDeviceGetUUID(handle)), instances))
    return gpus


def find_by_uuid(nvml: Any, gpus: list[Gpu], key: str, env_handle: Any) -> tuple[Any, str, str]:
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
            env_key = uuid_key(nvml.nvmlDeviceGetUUID(env_handle))
            for j, (mig_key, _) in enumerate(gpu.instances):
                if mig_key is not None and mig_key == env_key:
                    return env_handle, f"NVML GPU {gpu.index} MIG instance {j}", ""
        if len(gpu.instances) == 1:
            return gpu.instances[0][1], f"NVML GPU {gpu.index} MIG instance 0", ""
        return None, "", f"on MIG GPU {gpu.index}, instance unknown"
    return None, "", "no NVML device has its UUID"


def place_of(nvml: Any, gpus: list[Gpu], handle: Any) -> str:
    """``find_by_uuid``'s ``where`` for the env's handle, found by UUID (pynvml handles compare by identity)."""
    key = uuid_key(nvml.nvmlDeviceGetUUID(handle))
    for gpu in gpus:
        if gpu.key == key and not gpu.instances:
            return f"NVML GPU {gpu.index}"
        for j, (mig_key, _) in enumerate(gpu.instances):
            if mig_key == key:
                return f"NVML GPU {gpu.index} MIG instance {j}"
    return ""
