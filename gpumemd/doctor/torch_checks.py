"""torch, NumPy and CUDA: importable, recent enough, and which devices torch can use here."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumemd.analysis.units import format_bytes
from gpumemd.doctor.check import Check, dist_version

MIN_TORCH = (2, 1)  # pyproject's torch>=2.1: older builds lack the history and snapshot APIs we read


@dataclass(frozen=True)
class TorchImport:
    module: Any  # None when ``import torch`` failed
    error: str | None
    numpy_warning: str | None  # torch's "Failed to initialize NumPy: ..." UserWarning, if it gave one


def import_torch() -> TorchImport:
    """``import torch`` with its warnings caught: a missing or broken NumPy makes torch warn "Failed to
    initialize NumPy" on import, which belongs on doctor's numpy line, not on stderr before the answer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - a broken install raises anything (OSError for a .so)
            return TorchImport(None, f"{type(exc).__name__}: {exc}", _numpy_warning(caught))
    return TorchImport(torch, None, _numpy_warning(caught))


def _numpy_warning(caught: list[warnings.WarningMessage]) -> str | None:
    for w in caught:
        if "numpy" in str(w.message).lower():  # the C++ location torch appends says nothing to a user
            return re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message)).strip()
    return None


def _version_tuple(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def _build(torch: Any) -> str:
    version = getattr(torch, "version", None)
    hip, cuda = getattr(version, "hip", None), getattr(version, "cuda", None)
    if hip:
        return f"ROCm {hip} build"
    return f"CUDA {cuda} build" if cuda else "CPU-only build (no CUDA)"


def check_torch(torch: Any, error: str | None = None) -> Check:
    """Importable, and at least the oldest version gpumemd supports."""
    floor = ".".join(map(str, MIN_TORCH))
    if torch is None:
        return Check("torch", "fail", f"cannot import torch ({error}): gpumemd needs PyTorch >= {floor}",
                     needed=True)
    version = str(getattr(torch, "__version__", "?"))
    parsed = _version_tuple(version)
    if parsed is None or parsed < MIN_TORCH:
        return Check("torch", "fail", f"{version} is older than {floor}, the oldest gpumemd supports "
                     "(or its version cannot be read)", needed=True)
    return Check("torch", "ok", f"{version}, {_build(torch)}", needed=True)


def check_numpy(numpy_warning: str | None) -> Check:
    """gpumemd never uses NumPy; torch does for interop, and says so on import when it cannot."""
    if numpy_warning:
        return Check("numpy", "warn", f"torch could not initialise NumPy ({numpy_warning}): tensor.numpy() "
                     "and NumPy interop will fail; gpumemd itself does not use NumPy")
    version = dist_version("numpy")
    if version is None:
        return Check("numpy", "n/a", "not installed: torch runs without it, and so does gpumemd")
    return Check("numpy", "ok", version)


def cuda_ready(torch: Any) -> bool:
    """torch can use at least one CUDA (or ROCm) device here."""
    if torch is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check_cuda reports the CUDA initialisation warning
        return bool(torch.cuda.is_available())


def check_cuda(torch: Any, environ: Mapping[str, str]) -> Check:
    """Device count, names and sizes; why there are none when a CUDA build sees none."""
    if torch is None:
        return Check("cuda", "n/a", "torch is not importable")
    if not torch.backends.cuda.is_built():
        return Check("cuda", "n/a", "CPU-only torch build: no device memory to record; gpumemd records host "
                     "memory, tensors and leaks only")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
    if not available:
        why = "; ".join(str(w.message).strip() for w in caught) or "no driver or no device"
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            why += f"; CUDA_VISIBLE_DEVICES={visible!r}"
        return Check("cuda", "warn", f"torch is a {_build(torch)} but sees no device ({why}): gpumemd "
                     "records host memory only")
    count = int(torch.cuda.device_count())
    devices = [f"{i} {props.name} ({format_bytes(int(props.total_memory))})"
               for i, props in enumerate(map(torch.cuda.get_device_properties, range(count)))]
    return Check("cuda", "ok", f"{count} device{'s' if count != 1 else ''}: {', '.join(devices)}")


def cuda_context(torch: Any) -> tuple[Any, str | None]:
    """A 1-element tensor on the current device, so this process has a CUDA context NVML can list.
    Returns (the tensor, to keep alive while NVML looks; None and why when it cannot be made)."""
    try:
        return torch.ones(1, device="cuda"), None
    except Exception as exc:  # noqa: BLE001 - any CUDA error here is itself the answer
        return None, f"{type(exc).__name__}: {exc}"
