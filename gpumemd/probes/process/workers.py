"""The job's child processes (DataLoader workers and any others): their memory, read cheaply.

Why: a Dataset that caches decoded samples, or whose Python lists and dicts its workers copy page
by page as they read them (copy-on-read: reference counts are written on every read), grows the
workers while the training process stays flat, and the node runs out of RAM with nothing pointing
at them. This probe sees them two ways:

- ``rss()``, on the training thread every few steps: the children of the calling thread (the one
  that iterates the DataLoader starts its workers) from ``/proc/self/task/<tid>/children``, and
  each one's RSS from its ``statm``, both through kept-open files (one ``pread`` each, under a
  microsecond here), plus the children the sampler thread listed for the other threads;
- ``read()``, on the sampler thread: every thread's children, and each child's USS and PSS from
  ``smaps_rollup`` (half a millisecond or more per process: never on the training thread). USS is
  what copy-on-read shows in: the copied pages become the worker's own while its RSS stays flat.

Without ``/proc`` (macOS) psutil lists the children on the sampler thread and ``rss()`` reads them
through psutil. A probe that fails reports "absent" once (``ProbeHealth``); it never raises.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from gpumemd.probes.health import ProbeHealth
from gpumemd.records.samples import WorkerSample, WorkersSample

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
MAX_WORKERS = 256
"""Children followed at most (a fd each): a job that forks more is sampled, not followed whole."""


class WorkersProbe:
    """See the module docstring. ``proc`` is the /proc root (tests point it at a fake tree)."""

    def __init__(self, *, proc: str = "/proc", pid: int | None = None) -> None:
        self.health = ProbeHealth("workers")
        self._proc = proc
        self._pid = pid if pid is not None else os.getpid()
        self._has_proc = os.path.isdir(os.path.join(proc, str(self._pid), "task"))
        self._children_fds: dict[int, int] = {}  # tid -> its open children file (training thread's only)
        self._statm: dict[int, int] = {}  # child pid -> its open statm (opened and closed on one thread)
        self._statm_owner: int | None = None  # the thread that owns _statm
        self._listed: tuple[int, ...] = ()  # children the sampler thread found (assigned whole)
        self._lock = threading.Lock()

    # --- the training thread -------------------------------------------------------------------

    def rss(self) -> WorkersSample | None:
        """The children's RSS now (the calling thread's children and those the sampler listed)."""
        try:
            if not self._has_proc:
                return self._rss_psutil(self._listed)
            pids = self._own_children() | set(self._listed)
            return WorkersSample(tuple(self._read_statm(sorted(pids)[:MAX_WORKERS])))
        except Exception as exc:  # noqa: BLE001 - never raise into the job
            self.health.failed(exc)
            return None

    def _own_children(self) -> set[int]:
        tid = threading.get_native_id()
        fd = self._children_fds.get(tid)
        if fd is None:
            if len(self._children_fds) >= 8:  # steps ended on ever new threads: keep a few files only
                _close_all(self._children_fds)
            try:
                fd = os.open(os.path.join(self._proc, str(self._pid), "task", str(tid), "children"), _FLAGS)
            except OSError:
                fd = -1  # no such file (a kernel without CONFIG_PROC_CHILDREN): the sampler's list only
            self._children_fds[tid] = fd
        if fd < 0:
            return set()
        return {int(p) for p in os.pread(fd, 65536, 0).split()}

    def _read_statm(self, pids: list[int]) -> list[WorkerSample]:
        tid = threading.get_native_id()
        with self._lock:  # one thread at a time opens, reads and closes the statm files
            if self._statm_owner != tid:
                _close_all(self._statm)
                self._statm_owner = tid
            fds = self._statm
            out: list[WorkerSample] = []
            for pid in pids:
                fd = fds.get(pid)
                try:
                    if fd is None:
                        fd = fds[pid] = os.open(os.path.join(self._proc, str(pid), "statm"), _FLAGS)
                    raw = os.pread(fd, 128, 0)
                except OSError:
                    raw = b""
                if raw:
                    fields = raw.split(None, 3)
                    out.append(WorkerSample(pid, int(fields[1]) * _PAGE, file_bytes=int(fields[2]) * _PAGE))
            # Gone, or unreadable: an exited child's file reads nothing (or fails) for good, even once
            # its pid is reused, so it is closed and a live process of that pid gets a fresh one.
            alive = {w.pid for w in out}
            for pid in [p for p in fds if p not in alive]:
                with contextlib.suppress(OSError):
                    os.close(fds.pop(pid))
            return out

    # --- the sampler thread --------------------------------------------------------------------

    def read(self) -> WorkersSample | None:
        """Every thread's children, with RSS, USS and PSS (sampler thread only: ``smaps_rollup`` is slow)."""
        try:
            pids = self._all_children()
            self._listed = tuple(pids)
            if not self._has_proc:
                sample = self._rss_psutil(self._listed, full=True)
            else:
                sample = WorkersSample(tuple(w for pid in pids[:MAX_WORKERS] if (w := self._full(pid)) is not None))
            self.health.ok()
            return sample
        except Exception as exc:  # noqa: BLE001
            self.health.failed(exc)
            return None

    def _all_children(self) -> list[int]:
        if not self._has_proc:
            import psutil

            return sorted(c.pid for c in psutil.Process(self._pid).children())
        task = os.path.join(self._proc, str(self._pid), "task")
        pids: set[int] = set()
        for tid in os.listdir(task):
            with contextlib.suppress(OSError), open(os.path.join(task, tid, "children"), "rb") as f:
                pids.update(int(p) for p in f.read().split())
        return sorted(pids)

    def _full(self, pid: int) -> WorkerSample | None:
        try:
            with open(os.path.join(self._proc, str(pid), "statm"), "rb") as f:
                statm = f.read().split()
            rss, file_bytes = int(statm[1]) * _PAGE, int(statm[2]) * _PAGE
        except (OSError, ValueError, IndexError):
            return None  # gone since it was listed
        uss = pss = None
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(self._proc, str(pid), "smaps_rollup"), "rb") as f:
                fields = _kib_fields(f.read())
            pss = fields.get(b"Pss")
            if b"Private_Clean" in fields and b"Private_Dirty" in fields:
                uss = fields[b"Private_Clean"] + fields[b"Private_Dirty"]
        return WorkerSample(pid, rss, uss, pss, file_bytes)

    def _rss_psutil(self, pids: tuple[int, ...], *, full: bool = False) -> WorkersSample:
        import psutil

        out: list[WorkerSample] = []
        for pid in pids[:MAX_WORKERS]:
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if full:
                    info: Any = p.memory_full_info()
                    out.append(WorkerSample(pid, int(info.rss), int(info.uss), getattr(info, "pss", None)))
                else:
                    out.append(WorkerSample(pid, int(p.memory_info().rss)))
        return WorkersSample(tuple(out))

    def close(self) -> None:
        _close_all(self._children_fds)
        with self._lock:
            _close_all(self._statm)


def _close_all(fds: dict[int, int]) -> None:
    """Close every open file of ``fds`` (-1: none was opened) and forget them."""
    for fd in fds.values():
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
    fds.clear()


def _kib_fields(raw: bytes) -> dict[bytes, int]:
    """``Pss:  1234 kB`` lines as bytes per field."""
    out: dict[bytes, int] = {}
    for line in raw.splitlines():
        name, _, rest = line.partition(b":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == b"kB":
            out[name.strip()] = int(parts[0]) * 1024
    return out
