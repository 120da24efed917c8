"""OOM capture: the CUDA observer, the excepthooks, and the report written when an OOM propagates.

Moments, in order, for a CUDA OOM:
1. the allocator fails and calls PyTorch's out-of-memory observer *before* raising; ours takes the
   snapshot there (the OOM-time state, with the ``oom`` trace entry) and keeps it as "pending". The
   observer also fires for OOMs PyTorch retries internally (cuDNN workspaces), so it only captures,
   and a burst of calls (cuDNN halving its workspace in a loop) takes one snapshot per step and second;
2. the ``OutOfMemoryError`` propagates: ``gpumemd.oom_guard`` or an excepthook (uncaught, main or
   other thread) hands it to ``handle``, which writes the report with the pending capture (``oom_postmortem``);
3. a capture no OOM claimed is of an OOM the job caught (or torch retried): counted at once, and
   reported at the next sampled step end (or at stop), never attached to another (``oom_capture``);
   one report per step, under the same cap and cooldown. ``find_batch_size``'s tries are not OOMs
   of the job's (``oom_capture.probing``).
CPU allocation failures skip step 1. The observer goes on torch's lazy-init queue: attached when the
job initialises CUDA, before its first allocation (a first-forward OOM is caught at the moment), and
never initialising CUDA itself (not before a DataLoader forks); without a queue, at a step end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gpumemd.analysis.oom_message import classify_exception
from gpumemd.components.base import ComponentBase
from gpumemd.components.oom_capture import Capture, CaptureSlot, CaughtTally, probing_now
from gpumemd.components.oom_excepthooks import ExceptHooks
from gpumemd.components.oom_postmortem import PostMortem
from gpumemd.records.device import Device
from gpumemd.records.oom import ObserverCall, OomMessage
from gpumemd.signal_locks import YieldingLock

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.probes.snapshots.snapshot import SnapshotProbe
    from gpumemd.records.step import StepRecord

__all__ = ["FatalOomListener", "OomComponent", "OomOptions"]

log = logging.getLogger("gpumemd")

_CAUGHT_NOTE = ("the job caught this OOM, and the failing frames' tensors were gone by the time its report was "
                "written")  # the reports say "the last census, after step N: " before it (``view.census_when``)
_MARK = "_gpumemd_oom_handled"  # set on an exception once handled, so guard + excepthook report it once


# PyTorch keeps observers forever (no detach API): one process-wide trampoline is attached once and
# dispatches to whichever component is running, through a weak reference.
_observer_lock = threading.Lock()
_observer_installed = False
_observer_queued = False  # on torch's lazy-init queue (it runs at most once per process)
_observer_target: weakref.ref[OomComponent] | None = None


def _observer_attached(ok: bool) -> None:
    global _observer_installed
    _observer_installed = ok  # no lock: the queued call may run inside a locked section of ours


def _trampoline(device: int, alloc: int, total_or_cap: int, free: int) -> None:
    try:
        target = _observer_target() if _observer_target is not None else None
        if target is not None:
            target.observe(device, alloc, total_or_cap, free)
    except Exception:  # noqa: BLE001 - an exception here would replace the user's OutOfMemoryError
        pass


@dataclass(frozen=True)
class OomOptions:
    """What the OOM component reads of the configuration (``Config.options(OomOptions)``)."""

    oom_max_reports: int
    oom_cooldown_s: float
    record_history: bool
    history_max_entries: int


class FatalOomListener(Protocol):
    """Told when an uncaught OOM is about to end the process (the exporter hands it to Prometheus)."""

    def fatal_oom(self) -> None: ...


class OomComponent(ComponentBase):
    """Writes a post-mortem directory per OOM (capped, with a cooldown) and publishes ``reports``.

    ``snapshot_probe`` captures the allocator's state; ``census`` (the census component) takes the
    census at the OOM, and when the agent does not run it (periodic censuses off) this component
    starts and stops it, so an OOM report has its census either way; ``on_fatal`` (the exporter) is
    told before a fatal OOM ends the process."""

    name = "oom"

    def __init__(
        self,
        options: OomOptions,
        *,
        snapshot_probe: SnapshotProbe,
        census: CensusComponent,
        on_fatal: FatalOomListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = options
        self._on_fatal = on_fatal
        self._probe = snapshot_probe
        self._census = census
        self._owns_census = False  # started here: the agent does not run it
        self._clock = clock
        self._wall = wall_clock
        self._agent: AgentView | None = None
        self._lock = YieldingLock()  # a signal's writer waits for it 2 s at most (``signal_locks``)
        self._history_lock = threading.Lock()  # switching history on at CUDA init vs off at stop
        self._captures = CaptureSlot()
        self._written = 0
        self._last_report: float | None = None
        self._ooms = 0  # OOMs that propagated (a report's exception)
        self._caught = CaughtTally(max(1, options.oom_max_reports))
        self._cuda_hooked = False
        self._cuda_possible = True
        self._running = False
        self._hooks = ExceptHooks(self._hook_report, self._fatal, handled_mark=_MARK)
        self._postmortem = PostMortem(snapshot_probe, census, wall_clock)  # ``oom_postmortem``

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, agent: AgentView) -> None:
        self._agent = agent
        if not self._census.started:
            self._census.start(agent)
            self._owns_census = True
        self._running = True
        self._hooks.install()
        available = getattr(self._probe, "cuda_available", None)
        self._cuda_possible = bool(available()) if available is not None else True  # no step looks on a CPU build
        if self._cuda_possible:
            self._queue_observer()
            if self.config.record_history:
                self._queue_history()
        self._maybe_hook_cuda()

    def on_step(self, record: StepRecord) -> None:
        if not self._cuda_hooked and self._cuda_possible:
            self._maybe_hook_cuda()
        agent = self._agent
        if agent is not None:  # a capture no OOM claimed before this step ended: the job caught it
            self._settle(self._captures.settle(steps_total=agent.steps_total, now=self._clock()))

    def _settle(self, capture: Capture | None) -> None:
        """Report the caught OOMs settled so far (one report per step, cap and cooldown apply)."""
        self._caught.queue(capture)
        for one in self._caught.drain():
            try:
                self._report_caught(one)
            except Exception as err:  # noqa: BLE001 - the job goes on whatever happens here
                log.warning("gpumemd: could not write the caught OOM's report (%s: %s)", type(err).__name__, err)

    def stop(self) -> None:
        global _observer_target
        self._settle(self._captures.pop())  # an OOM caught after the last sampled step end
        self._running = False
        self._hooks.remove()
        with _observer_lock:
            if _observer_target is not None and _observer_target() is self:
                _observer_target = None
        with self._history_lock:  # a queued switch-on that runs after this finds _running False
            self._probe.disable_history()
        if self._owns_census:
            self._owns_census = False
            self._census.stop()

    # --- CUDA: history and the observer (lazy) -------------------------------------------------

    def _queue_observer(self) -> None:
        """Point the trampoline here and, once per process, put its attach on torch's lazy-init queue
        (at once if CUDA is up): in place before the job's first CUDA allocation."""
        global _observer_queued, _observer_target
        with _observer_lock:
            _observer_target = weakref.ref(self)
            if _observer_installed or _observer_queued:
                return
            _observer_queued = True
        # Outside our lock: with CUDA up the attach runs at once, inside torch's init lock.
        if not self._probe.attach_oom_observer_at_init(_trampoline, _observer_attached):
            with _observer_lock:
                _observer_queued = False  # no queue in this torch: attached at a step end instead

    def _queue_history(self) -> None:
        """``record_history``: recording from the job's first CUDA allocation (the lazy-init queue), so
        a first-step OOM's snapshot has its stacks; without a queue, from the first sampled step end."""
        me = weakref.ref(self)

        def wanted() -> bool:
            component = me()
            return component is not None and component._running

        self._probe.enable_history_at_init(self.config.history_max_entries, wanted, self._history_lock)

    def _maybe_hook_cuda(self) -> None:
        global _observer_installed, _observer_target
        if not self._probe.cuda_initialized():
            return
        self._cuda_hooked = True
        if self.config.record_history:
            self._probe.enable_history(self.config.history_max_entries)
        with _observer_lock:
            _observer_target = weakref.ref(self)
            if not _observer_installed and not _observer_queued:
                _observer_installed = self._probe.attach_oom_observer(_trampoline)

    def observe(self, device: int, alloc: int, total_or_cap: int, free: int) -> None:
        """The observer body: capture only (the report is written if the OOM really propagates);
        bursts share one snapshot (``CaptureSlot.observe``).

        PyTorch calls it as ``(device, alloc_size, allowed_memory_maximum or device_total, device_free)``:
        the third argument is the device total or the per-process cap, not allocated bytes.
        """
        agent = self._agent
        if not self._running or agent is None or not agent.running or probing_now():
            return
        call = ObserverCall(device=Device.cuda(int(device)), requested_bytes=int(alloc),
                            total_or_cap_bytes=int(total_or_cap), device_free_bytes=int(free),
                            wall_time=self._wall())
        now = self._clock()
        last = agent.current_step  # the last step ended, sampled or not
        step = 0 if last is None else last + 1  # the step that is running
        earlier = self._captures.observe(call, steps_total=agent.steps_total, step=step, now=now,
                                         may_snapshot=self._may_write(now), snapshot=self._probe.capture,
                                         summary=self._probe.memory_summary)
        with self._lock:
            self._caught.observed(step)  # caught until a propagating OOM's report claims it
            self._caught.queue(earlier)  # reported at the next step end, not inside the allocator
            self._publish_counts(agent)

    def _publish_counts(self, agent: AgentView) -> None:
        """Under ``_lock``: OOMs in all (caught or not) and those the job caught, with their steps."""
        caught = self._caught.count
        agent.publish(ooms_total=self._ooms + caught, ooms_caught=caught, oom_caught_steps=self._caught.steps())

    # --- excepthooks (``oom_excepthooks``) ---------------------------------------------------------

    def _hook_report(self, exc: BaseException | None, source: str) -> bool:
        return bool(self._running and self.handle(exc, source=source, clear=False))

    def _fatal(self) -> None:
        """An OOM reached ``sys.excepthook``: the process exits next, unless an interactive session
        goes on. The exporter gets the chance to hand the OOM to Prometheus first (``oom_linger_s``)."""
        agent = self._agent
        if not self._running or agent is None or not agent.running or _interactive() or self._on_fatal is None:
            return
        try:
            self._on_fatal.fatal_oom()
        except Exception as err:  # noqa: BLE001 - the exit must go on whatever happens here
            log.debug("gpumemd: exporting the fatal OOM failed (%s: %s)", type(err).__name__, err)

    # --- handling an OOM ----------------------------------------------------------------------

    def handle(self, exc: BaseException | None, *, source: str, clear: bool = True) -> str | bool:
        """Report ``exc`` if it is an OOM not reported yet. Returns the report path, True when it was
        an OOM but no report was written (cap, cooldown, failure), False when it is not an OOM.
        Never raises. With ``clear``, the failing frames' locals are released afterwards."""
        if exc is None or getattr(exc, _MARK, False):
            return False
        try:
            message = classify_exception(exc)
        except Exception:  # noqa: BLE001
            return False
        if message is None:
            return False
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, _MARK, True)
        path: str | bool = True
        try:
            path = self._report(exc, message, source, explicit=False) or True
        except Exception as err:  # noqa: BLE001 - the user's exception must go on unchanged
            log.warning("gpumemd: could not write the OOM report (%s: %s)", type(err).__name__, err)
        if clear:
            traceback.clear_frames(exc.__traceback__)
        return path

    def write_report(self, exc: BaseException | None = None, *, source: str = "request") -> str | None:
        """Write a report now (the user asked): for ``exc`` if given, else from the last capture.
        Subject to ``oom_max_reports`` but not to the cooldown. Returns the directory or None."""
        message = classify_exception(exc) if exc is not None else None
        # The observer's capture, unless a step ended after it fired or it is too old: that OOM was
        # recovered (cuDNN retried with less workspace) and the capture is of a different moment.
        agent = self._agent
        pending = self._captures.peek(steps_total=agent.steps_total, now=self._clock()) if agent is not None else None
        if message is None and pending is not None:
            message = OomMessage(kind="cuda", format="unparsed", device=pending.call.device)
        try:
            return self._report(exc, message, source, explicit=True)
        except Exception as err:  # noqa: BLE001
            log.warning("gpumemd: could not write the OOM report (%s: %s)", type(err).__name__, err)
            return None

    def _may_write(self, now: float) -> bool:
        return self._written < self.config.oom_max_reports and (
            self._last_report is None or now - self._last_report >= self.config.oom_cooldown_s)

    def _report(self, exc: BaseException | None, message: OomMessage | None, source: str,
                *, explicit: bool) -> str | None:
        agent = self._agent
        if agent is None or not self._running or not agent.running:  # not in a forked worker either
            return None
        now = self._clock()
        with self._lock:
            capture = None
            if message is None or message.kind != "cpu":  # a CUDA capture says nothing about host RAM
                capture = self._captures.take(steps_total=agent.steps_total, now=now,
                                              device=message.device if message is not None else None)
            if exc is not None and not explicit:
                self._ooms += 1
                self._caught.claimed(capture)
                self._publish_counts(agent)
            allowed = self._written < self.config.oom_max_reports if explicit else self._may_write(now)
            if not allowed:
                log.info("gpumemd: OOM #%d not reported (%d reports written, cap %d, cooldown %.0f s)",
                         self._ooms, self._written, self.config.oom_max_reports, self.config.oom_cooldown_s)
                return None
            self._last_report = now
        path = self._postmortem.write(agent, exc, message, source, capture)
        self._count_written(agent, path)
        log.warning("gpumemd: out-of-memory report written to %s", path)
        return path

    def _report_caught(self, capture: Capture) -> None:
        """The report of an OOM the job caught (one per step), from the observer's capture. The census is
        the last one taken: by now the failing frames are gone."""
        agent = self._agent
        if agent is None:
            return
        now = self._clock()
        with self._lock:
            if not self._may_write(now):
                log.info("gpumemd: caught OOM at step %d not reported (%d reports written, cap %d, cooldown %.0f s)",
                         capture.step, self._written, self.config.oom_max_reports, self.config.oom_cooldown_s)
                return
            self._last_report = now
        message = OomMessage(kind="cuda", format="unparsed", device=capture.call.device)
        path = self._postmortem.write(agent, None, message, "caught", capture,
                                      taken=(agent.state().census, _CAUGHT_NOTE))
        self._count_written(agent, path)
        log.warning("gpumemd: the job caught an out-of-memory error at step %d (%d in that step); report written "
                    "to %s", capture.step, capture.calls, path)

    def _count_written(self, agent: AgentView, path: str) -> None:
        """A report written: it counts towards ``oom_max_reports`` and is published with the others."""
        with self._lock:
            self._written += 1
            agent.publish(reports=(*agent.state().reports, path))


def _interactive() -> bool:
    """A REPL (or ``python -i``) shows the traceback and goes on: no exit to linger before."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or bool(sys.flags.inspect) \
        or bool(os.environ.get("PYTHONINSPECT"))
