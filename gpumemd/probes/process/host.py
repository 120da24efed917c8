"""Host memory: this process's RSS, the headroom under the limits it runs under (the machine's available
RAM, its cgroup's memory limit, its rlimits), torch's pinned-host bytes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from gpumemd.probes.health import ProbeHealth
from gpumemd.probes.process.host_limits import CgroupMemory, binding, rlimits
from gpumemd.records.samples import HostLimit, HostSample

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_forks = 0  # forks this process has seen (in the child): a kept-open fd is the parent's after one


def _forked() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


class _StatmReader:
    """RSS from a kept-open ``/proc/self/statm``: one ``pread`` per step, about 3x cheaper than
    opening the file each time and far cheaper than psutil on the per-step path. A forked child
    must not read the parent's file: a fork counter tells, not ``os.getpid()`` (a second syscall
    on every sampled step, 3-5 µs after a step of compute)."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._forks = _forks
        self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def __call__(self) -> tuple[int, int]:
        """The resident size and, of it, the pages mapped from files and shared memory: on the per-step
        path, right after a step of compute, parsing all seven fields cost ~1.5 µs more a read (median of
        1,500 reads at ~2 ms steps). ``_read``, inlined."""
        if self._fd is None or _forks != self._forks:
            raise OSError("statm reader closed (or inherited by a forked child)")
        fields = os.pread(self._fd, 128, 0).split(None, 3)
        return int(fields[1]) * _PAGE, int(fields[2]) * _PAGE

    def fields(self) -> list[int]:
        """statm's fields in bytes: size (virtual), resident, shared, text, lib, data (+ stack), dt."""
        return [int(v) * _PAGE for v in self._read().split()]

    def _read(self) -> bytes:
        if self._fd is None or _forks != self._forks:
            raise OSError("statm reader closed (or inherited by a forked child)")
        return os.pread(self._fd, 128, 0)

    def close(self) -> None:
        if self._fd is not None and os.getpid() == self._pid:
            os.close(self._fd)
        self._fd = None


class HostProbe:
    """``resident()`` is the cheap per-step read; ``read()`` the fuller one for the sampler thread."""

    def __init__(self, pinned_fn: Callable[[], int | None] | None = None, *, root: str = "/") -> None:
        self.health = ProbeHealth("host")
        self.cgroup = CgroupMemory(root)  # found once: each sample then reads its files once
        self._psutil: Any = None
        self._process: Any = None
        psutil_error: str | None = None
        try:
            import psutil

            self._psutil = psutil
            self._process = psutil.Process()
        except Exception as exc:  # noqa: BLE001 - a sandbox without /proc, a psutil that cannot load
            psutil_error = f"psutil cannot read this process ({type(exc).__name__}: {exc})"
        self._fast_rss: _StatmReader | None = None
        if os.path.exists("/proc/self/statm"):
            with contextlib.suppress(OSError):  # psutil below
                self._fast_rss = _StatmReader()
        self._pinned_fn = pinned_fn if pinned_fn is not None else _torch_pinned_bytes
        if psutil_error is not None:  # RSS may still come from /proc/self/statm; RAM totals cannot
            if self._fast_rss is None:
                self.health.absent(psutil_error)
            else:
                self.health.partly_absent("host RAM totals", psutil_error)

    def resident(self) -> tuple[int, int | None] | None:
        """RSS, and of it the pages mapped from files and shared memory (None where unknown)."""
        try:
            if self._fast_rss is not None:
                return self._fast_rss()
            if self._process is None:
                return None
            info = self._process.memory_info()
            shared = getattr(info, "shared", None)  # Linux only
            return int(info.rss), int(shared) if shared is not None else None
        except Exception as exc:  # noqa: BLE001 - never raise into the job
            self.health.failed(exc)
            return None

    def close(self) -> None:
        if self._fast_rss is not None:
            self._fast_rss.close()
            self._fast_rss = None

    def read(self) -> HostSample | None:
        resident = self.resident()
        if resident is None:
            return None
        rss, file_bytes = resident
        limits = self.limits()
        bound = binding(limits)
        self.health.ok()
        pinned = self.health.call(self._pinned_fn, None)
        if bound is None:
            return HostSample(rss_bytes=rss, pinned_bytes=pinned, file_bytes=file_bytes)
        return HostSample(rss_bytes=rss, available_bytes=bound.headroom_bytes, total_bytes=bound.limit_bytes,
                          pinned_bytes=pinned, limit=bound.kind, limits=tuple(limits), file_bytes=file_bytes)

    def limits(self) -> list[HostLimit]:
        """Every memory limit found now, host RAM first; each one that cannot be read is left out."""
        out: list[HostLimit] = []
        if self._psutil is not None:  # absent when psutil cannot read this process (said at start)
            try:
                vm = self._psutil.virtual_memory()
                out.append(HostLimit("ram", int(vm.total), int(vm.total) - int(vm.available)))
            except Exception as exc:  # noqa: BLE001
                self.health.failed(exc)
        try:
            cgroup = self.cgroup.read()
            if cgroup is not None:
                out.append(cgroup)
            out.extend(rlimits(*self._sizes()))
        except Exception as exc:  # noqa: BLE001 - never raise into the job
            self.health.failed(exc)
        return out

    def _sizes(self) -> tuple[int | None, int | None]:
        """The process's virtual size and data size (what RLIMIT_AS and RLIMIT_DATA are checked against)."""
        if self._fast_rss is not None:
            fields = self._fast_rss.fields()
            return fields[0], fields[5]
        if self._process is None:
            return None, None
        info = self._process.memory_info()
        return int(info.vms), getattr(info, "data", None)


def _torch_pinned_bytes() -> int | None:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None  # host_memory_stats() is {} until CUDA is up; absent, not 0
    fn = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.7
    if fn is None:
        return None
    value = fn().get("allocated_bytes.current")
    return int(value) if value is not None else None
