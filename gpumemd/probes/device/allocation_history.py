"""The one switch for torch's CUDA allocation history, which is process-wide.

Two parts of gpumemd want allocation stacks: the OOM capture (``record_history``) and the leak
detector (on suspicion, to name allocation sites). ``torch.cuda.memory._record_memory_history`` is
global to the process, and the job may record its own history for its own snapshots. So:

- a recording that is already on when gpumemd asks (``torch._C._cuda_isHistoryEnabled()``) is the
  job's: it is used as it is, never reconfigured and never switched off (PyTorch's own
  ``_inductor/cudagraph_trees.py`` does the same);
- gpumemd switches recording on once for all its users and off when the last one releases it,
  only if it was gpumemd that switched it on.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

log = logging.getLogger("gpumemd")


class AllocationHistory:
    """Reference-counted users of the process's allocation history. Seam: ``torch_module``."""

    def __init__(self, torch_module: Any = None) -> None:
        self._torch = torch_module
        self._users: set[str] = set()
        self._ours = False  # gpumemd switched recording on (and so may switch it off)
        self._lock = threading.Lock()

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    @property
    def users(self) -> frozenset[str]:
        return frozenset(self._users)

    @property
    def switched_on_by_us(self) -> bool:
        return self._ours

    def enabled_by_the_job(self) -> bool:
        """Recording is on and gpumemd did not switch it on."""
        if self._ours:
            return False
        probe = getattr(getattr(self._t(), "_C", None), "_cuda_isHistoryEnabled", None)
        try:
            return bool(probe()) if probe is not None else False
        except Exception:  # noqa: BLE001 - CPU build, CUDA not initialised: nothing is recording
            return False

    def acquire(self, user: str, max_entries: int) -> bool:
        """Make sure history is recorded for ``user``; False when it cannot be (CPU, cudaMallocAsync)."""
        with self._lock:
            if user in self._users:
                return True
            if self._ours or self.enabled_by_the_job():
                self._users.add(user)
                return True
            try:
                self._switch_on(max_entries)
            except Exception as exc:  # noqa: BLE001 - cudaMallocAsync, CPU builds, old torch
                log.info("gpumemd: could not switch on CUDA allocation history (%s: %s)", type(exc).__name__, exc)
                return False
            self._ours = True
            self._users.add(user)
            return True

    def release(self, user: str) -> None:
        """``user`` no longer needs history; the last of gpumemd's users switches off what gpumemd
        switched on (a job's own recording is never touched)."""
        with self._lock:
            self._users.discard(user)
            if self._users or not self._ours:
                return
            self._ours = False
            try:
                self._switch_off()
            except Exception as exc:  # noqa: BLE001
                log.info("gpumemd: could not switch CUDA allocation history off (%s: %s)", type(exc).__name__, exc)

    def _switch_on(self, max_entries: int) -> None:
        record = self._t().cuda.memory._record_memory_history
        if "max_entries" in inspect.signature(record).parameters:
            record(enabled="all", context="all", stacks="python", max_entries=max_entries)
        else:  # torch < 2.1: the boolean API
            record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=True)

    def _switch_off(self) -> None:
        record = self._t().cuda.memory._record_memory_history
        try:
            record(enabled=None)
        except TypeError:
            record(False)


_process_history: AllocationHistory | None = None
_process_lock = threading.Lock()


def process_history() -> AllocationHistory:
    """The process's one owner of allocation history (torch's recording is process-wide too)."""
    global _process_history
    with _process_lock:
        if _process_history is None:
            _process_history = AllocationHistory()
        return _process_history
