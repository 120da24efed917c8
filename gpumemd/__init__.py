"""gpumemd: a memory flight recorder for long PyTorch jobs.

``gpumemd.attach()`` in a training script (or ``gpumemd run train.py``) samples the CUDA caching
allocator, NVML and the host every step into a bounded ring of step records, counts and names live
tensors, detects leaks, writes OOM post-mortems and serves it all to Prometheus.

Importing this package is cheap: torch, pynvml and prometheus_client load only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumemd._version import __version__
from gpumemd.api import attach, attached, current, detach, mark_step, phase
from gpumemd.config import Config

if TYPE_CHECKING:
    from gpumemd.agent import Agent
    from gpumemd.batch_size import find_batch_size
    from gpumemd.guard import oom_guard, oom_report
    from gpumemd.probes.holding.holders import who_holds

__all__ = [
    "Agent",
    "Config",
    "__version__",
    "attach",
    "attached",
    "current",
    "detach",
    "find_batch_size",
    "mark_step",
    "oom_guard",
    "oom_report",
    "phase",
    "who_holds",
]

# Names whose modules import torch: loaded on first use so `import gpumemd` stays cheap.
_LAZY: dict[str, str] = {
    "Agent": "gpumemd.agent",
    "find_batch_size": "gpumemd.batch_size",
    "who_holds": "gpumemd.probes.holding.holders",
    "oom_guard": "gpumemd.guard",
    "oom_report": "gpumemd.guard",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpumemd' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
