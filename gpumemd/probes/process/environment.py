"""Versions, allocator configuration and identity, for the report's "environment" section.

Reads only what is already loaded: never initialises CUDA (the device name is read only once the job
has done so) and never raises.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from typing import Any

from gpumemd._version import __version__
from gpumemd.records.step import Identity

_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
              "PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_VISIBLE_DEVICES")


def collect_environment(identity: Identity, *, device: int | None = None) -> dict[str, Any]:
    """A JSON-ready dict; missing facts are None."""
    env: dict[str, Any] = {
        "gpumemd": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "argv": list(sys.argv)[:32],
        "rank": identity.rank,
        "local_rank": identity.local_rank,
        "world_size": identity.world_size,
        "identity_source": identity.source,
        "hostname": identity.hostname,
        "pid": identity.pid or os.getpid(),
        "allocator_env": {k: os.environ[k] for k in _ALLOC_ENV if k in os.environ},
        "torch": None,
        "cuda": None,
        "allocator_settings": None,
        "cuda_initialized": False,
        "device_name": None,
    }
    torch = sys.modules.get("torch")
    if torch is None:
        return env
    env["torch"] = str(getattr(torch, "__version__", "?"))
    env["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    get_settings = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    with contextlib.suppress(Exception):  # a report section, never worth failing the report for
        if get_settings is not None:
            env["allocator_settings"] = str(get_settings())
    with contextlib.suppress(Exception):
        env["cuda_initialized"] = bool(torch.cuda.is_initialized())
        if env["cuda_initialized"] and device is not None:
            env["device_name"] = str(torch.cuda.get_device_name(device))
    return env
