"""The CUDA allocator's own view: snapshots, allocation history, ``memory_summary`` and the OOM observer.

Everything goes through ``SnapshotProbe`` (seam: ``torch_module``), which never raises: on a CPU build
every call here is an AttributeError or AssertionError (TORCH_MEMORY_API.md §5), reported once as absent.

Loading a snapshot someone sent you is the other half: ``load_snapshot`` uses a restricted unpickler
that admits builtin containers and scalars only, so a crafted ``snapshot.pickle`` cannot run code.
"""

from __future__ import annotations

import inspect
import io
import pickle
from collections.abc import Callable
from typing import Any

from gpumemd.probes.health import ProbeHealth

OomObserver = Callable[[int, int, int, int], None]


class SnapshotProbe:
    """Reads the CUDA caching allocator's state; only ever after the job itself initialised CUDA."""

    def __init__(self, torch_module: Any = None) -> None:
        self.health = ProbeHealth("snapshot")
        self._torch = torch_module
        self.history_enabled = False

    def _t(self) -> Any:
        if self._torch is None:
            import torch

            self._torch = torch
        return self._torch

    def cuda_available(self) -> bool:
        """False where CUDA can never come up in this process (a CPU build, no device)."""
        try:
            return bool(self._t().cuda.is_available())
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False

    def cuda_initialized(self) -> bool:
        """True once the job has initialised CUDA (never initialises it)."""
        try:
            return bool(self._t().cuda.is_initialized())
        except Exception as exc:  # noqa: BLE001 - a probe never raises into the job
            self.health.failed(exc)
            return False

    def capture(self) -> dict[str, Any] | None:
        """``torch.cuda.memory._snapshot()`` (all devices), or None when there is no CUDA allocator."""
        if not self.cuda_initialized():
            return None
        try:
            snapshot = self._t().cuda.memory._snapshot()
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync raises RuntimeError, CPU AttributeError
            self.health.failed(exc)
            return None
        self.health.ok()
        return snapshot if isinstance(snapshot, dict) else None

    def memory_summary(self, device: int) -> str | None:
        """``torch.cuda.memory_summary(device)`` text, or None without CUDA."""
        if not self.cuda_initialized():
            return None
        try:
            return str(self._t().cuda.memory_summary(device))
        except Exception as exc:  # noqa: BLE001 - KeyError on CPU builds, RuntimeError elsewhere
            self.health.failed(exc)
            return None

    def enable_history(self, max_entries: int) -> bool:
        """Record allocation history with Python stacks in a ring buffer of ``max_entries``.

        Costs about 2 µs per allocation and several KB per entry (PyTorch's docstring), hence off by
        default. Feature-detected: the string API (2.1+), else the legacy boolean one.
        """
        if not self.cuda_initialized():
            return False
        memory = self._t().cuda.memory
        try:
            record = memory._record_memory_history
            if "max_entries" in inspect.signature(record).parameters:
                record(enabled="all", context="all", stacks="python", max_entries=max_entries)
            else:
                record(True, trace_alloc_max_entries=max_entries, trace_alloc_record_context=True)
        except Exception as exc:  # noqa: BLE001 - cudaMallocAsync, CPU builds
            self.health.failed(exc)
            return False
        self.history_enabled = True
        return True

    def disable_history(self) -> None:
        """Stop recording (and free the ring buffer), only if this probe turned it on."""
        if not self.history_enabled:
            return
        self.history_enabled = False
        try:
            self._t().cuda.memory._record_memory_history(enabled=None)
        except TypeError:
            try:
                self._t().cuda.memory._record_memory_history(False)
            except Exception as exc:  # noqa: BLE001
                self.health.failed(exc)
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)

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


# --- loading snapshots safely ------------------------------------------------------------------

# A real snapshot holds only dict/list/tuple/int/float/str/bool/None, which pickle encodes without
# any global. These few harmless constructors are admitted for snapshots other tools re-saved.
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
    ("builtins", "complex"), ("collections", "OrderedDict"),
})


class SnapshotLoadError(ValueError):
    """A snapshot that is truncated, not a pickle, not a snapshot, or that tries to load code."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise SnapshotLoadError(
            f"refused to load {module}.{name}: a snapshot may hold only builtin containers and scalars "
            "(this file was not written by PyTorch, or was tampered with)"
        )


def loads_snapshot(data: bytes) -> dict[str, Any] | list[Any]:
    """Unpickle a snapshot without running code; the result is a dict (``_snapshot``) or a list."""
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except SnapshotLoadError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError) as exc:
        raise SnapshotLoadError(f"not a readable pickle ({type(exc).__name__}: {exc}); truncated?") from None
    if isinstance(obj, dict) and isinstance(obj.get("segments"), list):
        return obj
    if isinstance(obj, list):
        return obj
    raise SnapshotLoadError(
        f"not a PyTorch memory snapshot: expected a dict with a 'segments' list, got {type(obj).__name__}"
    )


def load_snapshot(path: str) -> dict[str, Any] | list[Any]:
    """Read and safely unpickle ``path`` (see ``loads_snapshot``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise SnapshotLoadError(f"cannot read {path}: {exc.strerror or exc}") from None
    return loads_snapshot(data)
