"""The CUDA allocator's own view: snapshots, allocation history, ``memory_summary`` and the OOM observer.

Everything goes through ``SnapshotProbe`` (seam: ``torch_module``), which never raises: on a CPU build
every call here is an AttributeError or AssertionError (TORCH_MEMORY_API.md §5), reported once as absent.

Loading a snapshot someone sent you is the other half, in ``snapshot_load``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from gpumemd.probes.device.allocation_history import AllocationHistory, process_history
from gpumemd.probes.device.nvml_devices import counting_initialises_cuda
from gpumemd.probes.health import ProbeHealth

OomObserver = Callable[[int, int, int, int], None]
_HISTORY_USER = "oom"  # this probe's name among the users of the allocation history


class SnapshotProbe:
    """Reads the CUDA caching allocator's state; only ever after the job itself initialised CUDA."""

    def __init__(self, torch_module: Any = None, history: AllocationHistory | None = None) -> None:
        self.health = ProbeHealth("snapshot")
        self._torch = torch_module
        self.history_enabled = False
        # The real torch shares the process's one history owner; a fake torch (tests) gets its own.
        self._history = history or (process_history() if torch_module is None else AllocationHistory(torch_module))

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def cuda_available(self) -> bool:
        """False where CUDA can never come up in this process (a CPU build, no device)."""
        try:
            # device_count(), not is_available(): NVML-based before CUDA is up, so fork stays safe
            torch = self._t()
            if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
                return False
            if counting_initialises_cuda(os.environ.get("CUDA_VISIBLE_DEVICES")):
                return True  # a MIG list: counting would initialise CUDA; the lazy-init queue waits harmlessly
            return int(torch.cuda.device_count()) > 0
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False

    def cuda_initialized(self) -> bool:
        """True once the job has initialised CUDA (never initialises it)."""
        return bool(self.health.call(lambda: self._t().cuda.is_initialized(), False))  # noqa: PLW0108 - _t() may raise

    def capture(self) -> dict[str, Any] | None:
        """``torch.cuda.memory._snapshot()`` (all devices), or None when there is no CUDA allocator."""
        if not self.cuda_initialized():
            return None
        try:
            snapshot = self._snapshot_fn()()
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync raises RuntimeError, CPU AttributeError
            self.health.failed(exc)
            return None
        self.health.ok()
        return snapshot if isinstance(snapshot, dict) else None

    def _snapshot_fn(self) -> Callable[[], Any]:
        """``_snapshot``, asking torch to map frames of torch.compile's generated code back to the
        model's source where its signature offers it (``augment_with_fx_traces``, torch 2.9+). The
        mapping is plain Python over the frames: if it fails, the snapshot is taken without it."""
        take = self._t().cuda.memory._snapshot
        try:
            offers_fx = "augment_with_fx_traces" in inspect.signature(take).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            offers_fx = False
        if not offers_fx:
            return take

        def augmented() -> Any:
            try:
                return take(augment_with_fx_traces=True)
            except Exception:  # noqa: BLE001 - the FX registry is torch-private: fall back to the plain one
                return take()

        return augmented

    def memory_summary(self, device: int) -> str | None:
        """``torch.cuda.memory_summary(device)`` text, or None without CUDA."""
        if not self.cuda_initialized():
            return None
        # KeyError on CPU builds, RuntimeError elsewhere
        return self.health.call(lambda: str(self._t().cuda.memory_summary(device)), None)

    def enable_history(self, max_entries: int) -> bool:
        """Record allocation history with Python stacks in a ring buffer of ``max_entries``, through
        the process's one ``AllocationHistory`` (a recording the job switched on is used as it is).

        Costs about 2 µs per allocation and several KB per entry (PyTorch's docstring), hence off by
        default. Feature-detected: the string API (2.1+), else the legacy boolean one.
        """
        return self.cuda_initialized() and self._acquire_history(max_entries)

    def _acquire_history(self, max_entries: int) -> bool:
        if self.history_enabled:
            return True
        if not self._history.acquire(_HISTORY_USER, max_entries):
            self.health.absent("allocation history cannot be recorded here (cudaMallocAsync or an old torch)")
            return False
        self.history_enabled = True
        return True

    def disable_history(self) -> None:
        """This probe no longer needs history: switched off only if gpumemd switched it on and no other
        part of gpumemd still uses it."""
        if not self.history_enabled:
            return
        self.history_enabled = False
        self._history.release(_HISTORY_USER)

    def enable_history_at_init(self, max_entries: int, wanted: Callable[[], bool],
                               lock: threading.Lock) -> bool:
        """Have allocation history recorded from the job's first CUDA allocation: queued on torch's
        lazy-init queue like the observer (``attach_oom_observer_at_init``), so an OOM in the first
        forward has its stacks, and never initialising CUDA itself. At init it switches history on only
        if ``wanted()`` still says so (the queue runs once, maybe long after a detach), under ``lock``,
        which the caller also holds while it switches history off (a detach racing the job's CUDA init).
        False: this torch has no queue (the caller switches it on at a step end instead)."""
        health = self.health

        def at_init() -> None:
            try:
                with lock:
                    if wanted():
                        self._acquire_history(max_entries)  # is_initialized() is still False in _lazy_init
            except Exception as exc:  # noqa: BLE001 - never into the job's CUDA init (DeferredCudaCallError)
                with contextlib.suppress(Exception):
                    health.failed(exc)

        return self._queue_at_init(at_init)

    def attach_oom_observer_at_init(self, observer: OomObserver, attached: Callable[[bool], None]) -> bool:
        """Have ``observer`` attached when CUDA initialises, through torch's lazy-init queue
        (``torch.cuda._lazy_call``): at once if CUDA is up, else queued, and run by ``_lazy_init``
        right after ``_cuda_init()``, before the job's first CUDA allocation. Nothing here initialises
        CUDA. ``attached(ok)`` is told when the attach ran. False: this torch has no queue or no
        observer API (a CPU build), and the caller attaches at a step end instead.

        The queued call must never raise: ``_lazy_init`` turns an exception from it into a
        ``DeferredCudaCallError`` in the job's first CUDA call."""
        attach = getattr(getattr(self._t(), "_C", None), "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        health = self.health

        def at_init() -> None:
            # Inside _lazy_init, is_initialized() is still False: attach directly, no check
            ok = False
            try:
                attach(observer)
                ok = True
            except Exception as exc:  # noqa: BLE001 - cudaMallocAsync / pluggable allocators raise
                health.failed(exc)
            with contextlib.suppress(Exception):  # see above: never into the job's CUDA init
                attached(ok)

        return self._queue_at_init(at_init)

    def _queue_at_init(self, at_init: Callable[[], None]) -> bool:
        """Queue ``at_init`` on torch's lazy-init queue; False when this torch has none or it refused."""
        lazy_call = getattr(getattr(self._t(), "cuda", None), "_lazy_call", None)
        if lazy_call is None:
            return False
        try:
            lazy_call(at_init)
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False
        return True

    def attach_oom_observer(self, observer: OomObserver) -> bool:
        """Register ``observer`` with the CUDA allocator. It initialises CUDA: call it only once
        ``cuda_initialized()``. There is no way to remove it again (PyTorch has no detach)."""
        if not self.cuda_initialized():
            return False
        attach = getattr(self._t()._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            self.health.absent("this torch has no CUDA out-of-memory observer (CPU build or torch < 2.0)")
            return False
        try:
            attach(observer)
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync / pluggable allocators raise
            self.health.failed(exc)
            return False
        return True
