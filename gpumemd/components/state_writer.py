"""Keep the last known state on disk as the job runs (``gpumemd.report.last_state`` says what and why).

Built on the training thread at a sampled step end when what a reader would want to know changed
(a finding came, went or changed state; an OOM report; the first step) and otherwise at most every
``EVERY_S`` seconds, so that ``gpumemd top`` reads a state at most ~1 s old (plus a step, on jobs whose
steps are longer); at ``flush`` (a signal is ending the job) and at ``stop`` (with how the agent
ended). One small JSON document written to a temp file and renamed over the old one: a reader, or a
SIGKILL in the middle, sees the previous file or the new one. No fsync: the page cache outlives the
process, and a SIGKILL is what this file is for (a machine crash loses the last seconds, which the job
loses too).

Cost, measured on the 2-core box (``benchmarks/bench_top_overhead.py``): building the document and its
JSON takes 0.13-0.3 ms on the training thread; the temp file, write and rename ~0.15 ms of CPU but
0.3-3 ms of wall time on a busy ext4 (the journal), so the refresh each second runs on the sampler's
thread (``Agent.run_in_background``; file system calls release the GIL): the training thread does not
wait on the disk for it, and no thread of this component's own takes ~70 MiB of address space (a stack
and a malloc arena) from a job under ``ulimit -v``. News (a finding came, went or changed state, an OOM
report, the first step) is written on the training thread, before the job goes on: a SIGKILL the next
moment finds it. At one write a second this component's training-thread CPU, its per-step check
included, is ~0.05% of the job's time. Without a sampler thread (``sample_interval_s=0``), and at
``flush`` and ``stop`` (the process may end next), the caller writes. A write failure is logged once
and the job goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.components.base import ComponentBase
from gpumemd.files import replace_file
from gpumemd.report.last_state import state_document, state_file
from gpumemd.signal_locks import SIGNAL_WAIT_S, is_writer

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.records.findings import Finding
    from gpumemd.records.step import AgentState, StepRecord

log = logging.getLogger("gpumemd")

EVERY_S = 1.0
"""At most this many seconds between two writes while nothing a reader needs changed."""


class LastStateComponent(ComponentBase):
    """``gpumemd-state-rank<R>.json`` in the output directory, kept current."""

    name = "last_state"

    def __init__(self, *, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._agent: AgentView | None = None
        self._due = 0.0
        self._key: tuple[object, ...] | None = None
        self._failed = False
        self.writes = 0
        self._lock = threading.RLock()  # one write at a time, the newest last (re-entrant: a signal's flush)
        self._handled = threading.Condition(self._lock)  # notified as each document is written or skipped
        self._made = 0  # documents built; a write skips one older than the file's
        self._on_disk = 0
        self._last_handled = 0

    def start(self, agent: AgentView) -> None:
        self._agent, self._due, self._key = agent, 0.0, None

    def on_step(self, record: StepRecord) -> None:
        agent = self._agent
        if agent is None:
            return
        published = agent.published  # what components published: no state is built for the check
        key = self._key
        # The same tuples (identity, not a field-by-field compare): nothing was published since.
        unchanged = (key is not None and published.reports is key[1] and published.ooms_total == key[2])
        if unchanged and key is not None and published.findings is not key[0]:
            # Each evaluation of a live finding publishes it again with fresh figures: news for the
            # file only when a finding came, went or changed state (its figures wait for the interval).
            unchanged = _states(published.findings) == key[3]
            if unchanged:
                self._key = (published.findings, *key[1:])
        if unchanged and self._clock() < self._due:
            return
        # News (a finding came, went or changed state; an OOM report; the first step) is on disk before
        # the job goes on, as a SIGKILL the next moment must find it; the figures' refresh each second
        # goes to the sampler's thread.
        self._write(agent.state(), agent, background=unchanged)

    def flush(self) -> None:
        """A signal may end the process next: write now."""
        if self._agent is not None:
            self._write(self._agent.state(), self._agent)

    def stop(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            self._write(agent.state(), agent)  # with ``ended``: the agent published it before stopping us

    def _write(self, state: AgentState, agent: AgentView, *, background: bool = False) -> None:
        self._key = (state.findings, state.reports, state.ooms_total, _states(state.findings))
        self._due = self._clock() + self._every_s
        path = state_file(agent.output_dir, state.identity.rank)
        try:
            doc = state_document(state, written_at=time.time(), seconds_per_step=agent.seconds_per_step)
            data = json.dumps(doc, sort_keys=True).encode("utf-8")
        except (ValueError, TypeError) as exc:
            self._failed_once(path, exc)
            return
        self._made += 1
        made = self._made
        if background and agent.run_in_background(lambda: self._put(path, data, made)):
            return
        self._put(path, data, made, wait_s=SIGNAL_WAIT_S if is_writer() else -1)  # a signal's flush or stop

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until the newest document handed to the background is written (or skipped)."""
        target = self._made
        with self._handled:
            self._handled.wait_for(lambda: self._last_handled >= target, timeout)

    def _put(self, path: str, data: bytes, made: int, *, wait_s: float = -1) -> None:
        # A signal's flush runs on a thread of its own while the handler waits for it on the training
        # thread, which may hold this lock, interrupted inside its own write: the flush would wait for
        # it until the signal's deadline (25 s) and write nothing. Past ``wait_s`` it writes without
        # the lock: the file is replaced by a rename, whole either way, and the newest document wins.
        held = self._handled.acquire(timeout=wait_s)
        try:
            if made <= self._on_disk:  # a newer document is already there (a flush overtook the errand)
                return
            os.makedirs(os.path.dirname(path), exist_ok=True)
            replace_file(path, data, fsync=False)  # no fsync: see the module docstring
        except OSError as exc:
            self._failed_once(path, exc)
        else:
            self._on_disk = made
            self.writes += 1
            self._failed = False
        finally:
            self._last_handled = max(self._last_handled, made)
            if held:
                self._handled.notify_all()
                self._handled.release()

    def _failed_once(self, path: str, exc: Exception) -> None:
        if not self._failed:  # said once until a write succeeds again
            log.warning("gpumemd: could not write the state file %s (%s); a SIGKILL would leave no trace",
                        path, exc)
        self._failed = True


def _states(findings: tuple[Finding, ...]) -> tuple[tuple[str, str, str], ...]:
    return tuple((f.series, f.state, f.kind) for f in findings)
