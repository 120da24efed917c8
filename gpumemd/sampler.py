"""The background sampler: every ``sample_interval_s`` it reads the allocator, NVML and the host
between steps, so the published state stays fresh while a step runs long (or the job hangs).

It reads and times; publishing what it read is the agent's (``Agent.tick``). Its thread also runs
short errands handed to it (``run_soon``: the state file's write), so that file system calls, which can
take milliseconds of wall time on a journaled file system, never wait on the training thread, and no
second thread of the agent takes its ~70 MiB of address space (a stack and a malloc arena) from a job
under ``ulimit -v``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd import signal_locks

log = logging.getLogger("gpumemd")

if TYPE_CHECKING:
    from gpumemd.probes.device.allocator import AllocatorProbe
    from gpumemd.probes.device.nvml import NvmlProbe
    from gpumemd.probes.process.host import HostProbe
    from gpumemd.probes.process.workers import WorkersProbe
    from gpumemd.records.samples import AllocatorSample, HostSample, NvmlDeviceSample, WorkersSample

_ERRANDS_MAX = 4


class Sampler:
    """Reads the probes on request (``read``) and, once started, on its own thread (``tick`` each
    interval); ``seconds`` is the time its reads took, which the agent counts as its overhead."""

    def __init__(self, *, allocator: AllocatorProbe, host: HostProbe, nvml: NvmlProbe | None,
                 clock: Callable[[], float], workers: WorkersProbe | None = None) -> None:
        self._allocator = allocator
        self._workers = workers
        self._host = host
        self._nvml = nvml
        self._clock = clock
        self._local_world_size = 1
        self._stop = threading.Event()
        self._wake = threading.Event()  # an errand came, or the sampler stops
        self._errands: collections.deque[Callable[[], None]] = collections.deque(maxlen=_ERRANDS_MAX)
        self._thread: threading.Thread | None = None
        self.absent_reason: str | None = None  # why the thread could not start
        self.seconds = 0.0

    def attached(self) -> None:
        """The agent is attaching: learn the node's rank count (for ``read`` before CUDA is up)."""
        self._local_world_size = _local_world_size()

    def start(self, tick: Callable[[], None], interval_s: float) -> None:
        """Call ``tick`` every ``interval_s`` on a thread of its own (0: no thread). NVML starts on that
        thread, then ticks once at once (the NVML reading attach would have taken); without the thread,
        here."""
        self.absent_reason = None
        if interval_s > 0:
            self._stop.clear()
            thread = threading.Thread(target=self._loop, args=(tick, interval_s), name="gpumemd-sampler",
                                      daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread": a process at its thread limit
                log.info("gpumemd: sampler thread absent (%s); readings are taken at sampled steps only", exc)
                self.absent_reason = str(exc)  # said in the start line
            else:
                self._thread = thread
                return
        if self._nvml is not None:
            self._nvml.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None  # errands handed in from here run in their caller
        if thread is not None:
            # At a signal, the sampler may wait for a lock the interrupted training thread holds: 2 s.
            thread.join(timeout=signal_locks.SIGNAL_WAIT_S if signal_locks.is_writer() else 10)
        self._errands.clear()

    def run_soon(self, errand: Callable[[], None]) -> bool:
        """Run ``errand`` on this thread soon (timed into ``seconds``); False when there is no thread
        (none started, or stopped): then the caller runs it itself. The oldest waiting errands are
        dropped past ``_ERRANDS_MAX``: each is a newer state file than the one before."""
        if self._thread is None or self._stop.is_set():
            return False
        self._errands.append(errand)
        self._wake.set()
        return True

    def _loop(self, tick: Callable[[], None], interval_s: float) -> None:
        if self._nvml is not None:
            self._nvml.start()
            if not self._stop.is_set():
                tick()
        due = self._clock() + interval_s
        while not self._stop.is_set():
            self._wake.wait(max(0.0, due - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                break
            self._run_errands()
            if self._clock() >= due:
                tick()
                due = self._clock() + interval_s

    def _run_errands(self) -> None:
        while self._errands:
            errand = self._errands.popleft()
            start = self._clock()
            try:
                errand()
            except Exception:  # an errand's failure is its own: the sampler goes on
                log.debug("gpumemd: a sampler errand failed", exc_info=True)
            finally:
                self.seconds += self._clock() - start

    def read(self, local_rank: int) -> tuple[tuple[AllocatorSample, ...], tuple[NvmlDeviceSample, ...],
                                             HostSample | None]:
        """One reading of allocator, NVML and host (timed into ``seconds``)."""
        start = self._clock()
        allocator = self._allocator.read()
        nvml = self._read_nvml(allocator, local_rank)
        host = self._host.read()
        self.seconds += self._clock() - start
        return allocator, nvml, host

    def read_workers(self) -> WorkersSample | None:
        """The job's child processes with their USS and PSS (slow: this thread only), timed."""
        if self._workers is None:
            return None
        start = self._clock()
        try:
            return self._workers.read()
        finally:
            self.seconds += self._clock() - start

    def _read_nvml(self, allocator: tuple[AllocatorSample, ...], local_rank: int) -> tuple[NvmlDeviceSample, ...]:
        """Only the devices this process uses: those its allocator holds memory on; before CUDA is up,
        under a launcher with several ranks per node and several visible GPUs, LOCAL_RANK's
        (torchrun's convention); else every visible device (a one-GPU job, or ranks pinned by
        CUDA_VISIBLE_DEVICES)."""
        nvml = self._nvml
        if nvml is None:
            return ()
        if allocator:
            return nvml.read({i for a in allocator if (i := a.device.cuda_index) is not None}, has_context=True)
        if self._local_world_size > 1 and nvml.visible_count > 1:
            return nvml.read({local_rank % nvml.visible_count})
        return nvml.read()


def _local_world_size() -> int:
    """Ranks on this node, from the launcher's environment (torchrun, Slurm, Open MPI); 1 if unknown."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        raw = os.environ.get(name, "")
        if raw.strip().isdigit():
            return max(1, int(raw))
    return 1
