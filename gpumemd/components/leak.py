"""The leak component: feeds the detector from each step, names culprits, reports state changes.

Its work is in parts, and data flows one way through them: ``leak_series`` feeds the detector from
step records, survivor scans and censuses and says what growth matters; the detector
(``analysis.leak_detector``) decides; ``leak_culprits`` searches the evidence behind a finding —
the census diff between the window's start and now with who holds a sample, the Python containers
that grew for a host leak (``leak_host``), and on CUDA with allocation history the allocation sites
(``leak_sites``); ``analysis.leak_wording`` says it; ``analysis.leak_causes`` makes the findings of
groups that grow together under one holder one finding (the published one); ``leak_findings`` keeps
the findings and says their state changes.

This module runs them on the training thread. The detector folds values into block floors every
step (O(1)) and is evaluated every ``leak_check_every_steps``; survivor scans are spaced within the
overhead budget, and while only confirmed findings are tracked both may be spaced further
(``leak_scans.TRACKING_STRETCH``). On a state change of a cause the component logs one WARNING line (the finding's
headline, at most 200 characters), appends the whole finding to
``leak-findings-rank<R>.jsonl`` in the output directory and publishes ``findings`` in the agent state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpumemd.analysis.leak_types import LeakState
from gpumemd.components.leak_culprits import CulpritSearch
from gpumemd.components.leak_findings import LeakFindings
from gpumemd.components.leak_host import HostLooks
from gpumemd.components.leak_options import LeakOptions
from gpumemd.components.leak_pending import Key, PendingEvaluation
from gpumemd.components.leak_scans import KEYED_WHILE_TRACKING, ScanSchedule
from gpumemd.components.leak_series import LeakSeries
from gpumemd.components.leak_sites import AllocationSites
from gpumemd.probes.heap.gc_pause import collector_paused
from gpumemd.probes.heap.stepwise import Stepwise
from gpumemd.probes.survival.long_lived import LongLivedProbes, long_lived_probes

if TYPE_CHECKING:
    from gpumemd.analysis.leak_detector import TrackStatus
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.components.leak_evidence import Evidence
    from gpumemd.probes.device.allocation_history import AllocationHistory
    from gpumemd.probes.survival.graph_chains import GraphChainTracker
    from gpumemd.probes.survival.survivors import SurvivorTracker
    from gpumemd.records.step import StepRecord

__all__ = ["LeakComponent", "LeakOptions"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Parts:
    """What one start builds: the long-lived tensor trackers (None when tracking cannot run), the
    series that feed the detector, and the culprit search."""

    series: LeakSeries
    culprits: CulpritSearch
    tracker: SurvivorTracker | None
    chains: GraphChainTracker | None


class LeakComponent:
    """Runs the leak detector on the training thread; see the module docstring.

    ``census`` (the census component, None when censuses are off) gives the censuses that name
    culprits; ``history`` is the process's allocation history, switched on at suspicion on CUDA.
    ``snapshot_fn`` replaces torch's allocator snapshot."""

    name = "leak"

    def __init__(
        self,
        options: LeakOptions,
        *,
        census: CensusComponent | None,
        history: AllocationHistory,
        snapshot_fn: Callable[[], Mapping[str, Any]] | None = None,
        probes: Callable[[], LongLivedProbes] = long_lived_probes,
    ) -> None:
        self._options = options
        self._new_probes = probes  # fresh long-lived tensor trackers at each start
        self._census = census
        self._clock = time.perf_counter  # times the budgeted work: scans, evaluations, heap looks
        # Kept across starts: heap-look baselines and their budget, allocation sites noted at suspicion.
        self._host = HostLooks(window_steps=options.leak_window_steps, overhead_budget=options.overhead_budget,
                               clock=self._clock)
        self._sites = AllocationSites(options, history, snapshot_fn=snapshot_fn)
        self._agent: AgentView | None = None
        self._parts: _Parts | None = None
        self._findings = LeakFindings(options, census=census, wall_clock=time.time)  # ``leak_findings``
        self._scans = self._new_scans()
        self._deferred = False  # the last due evaluation waited for the step after a census
        self._sampled = False  # scans count a sample of their candidates (``_track_only``)
        self._pending: PendingEvaluation | None = None  # an evaluation whose searches go on
        self._series_seen: set[str] = set()  # the detector's series at the last evaluation (``_track_only``)
        self._new_series_at = 0  # the step of the last evaluation that found a series begun since
        self.evaluate_seconds = 0.0  # time spent in evaluations (benchmarks read it)
        self._scans_before = 0.0  # scan seconds of earlier starts
        self._eve_from = 0  # steps_total before which no eve scans or evaluates (``on_step``, ``on_eve``)

    def _new_scans(self) -> ScanSchedule:
        return ScanSchedule(window_steps=self._options.leak_window_steps, overhead_budget=self._options.overhead_budget)

    @property
    def scan_seconds(self) -> float:
        """Time spent in survivor scans (benchmarks read it)."""
        return self._scans_before + self._scans.seconds

    @property
    def host_look_seconds(self) -> float:
        """Of ``evaluate_seconds``, the heap looks (budgeted apart; benchmarks read it)."""
        return self._host.seconds

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, agent: AgentView) -> None:
        self._agent = agent
        self._findings.start(agent)
        self._scans_before += self._scans.seconds
        self._scans = self._new_scans()
        self._eve_from = 0
        made = self._new_probes()
        tracker, chains, families = made.tracker, made.chains, made.families
        series = LeakSeries(self._options, agent, tracker=tracker, chains=chains, families=families)
        culprits = CulpritSearch(agent, series, tracker=tracker, chains=chains, census=self._census,
                                 host=self._host, sites=self._sites,
                                 check_every_steps=self._options.leak_check_every_steps)
        self._parts = _Parts(series, culprits, tracker, chains)

    def stop(self) -> None:
        # The series, their past counts and the last census go with the parts; the trackers' gc
        # callback and weak references are released now.
        pending, self._pending = self._pending, None
        if pending is not None and self._parts is not None and self._agent is not None:
            # Detaching: no later step end. The searches left run now, so a state change found in
            # the last steps is still said and written.
            try:
                pending.finish_now()
                self._findings.conclude(self._agent, self._parts.series, pending)
            finally:
                pending.close()
        if self._agent is not None:
            self._agent.sample_sparsely(False)
        parts, self._parts = self._parts, None
        if parts is not None:
            if parts.tracker is not None:
                parts.tracker.uninstall()
            if parts.chains is not None:
                parts.chains.clear()
            if parts.series.scans.families is not None:
                parts.series.scans.families.clear()
        self._sites.clear()
        self._host.clear()

    @property
    def findings_path(self) -> str:
        """The findings file (``leak_file``), created on the first state change."""
        assert self._findings.file is not None
        return self._findings.file.path

    # --- per step ------------------------------------------------------------------------------

    def on_quick(self, record: StepRecord, samples_total: int) -> None:
        """A quick step end's record, at the next full one: it waits to be fed like any other."""
        if self._parts is not None:
            self._parts.series.wait(record, samples_total)

    def on_step(self, record: StepRecord) -> None:
        parts = self._parts
        agent = self._agent
        if parts is None or agent is None:
            return
        series = parts.series
        # The step end's heavy work (scans, searches) is bounded from here, with the census's slices in it.
        started = self._clock() - (self._census.step_end_seconds if self._census is not None else 0.0)
        series.wait(record, agent.samples_total)  # fed with the others just before an evaluation reads them
        series.feed_census(agent.published.census, record)
        tracker = parts.tracker
        total = agent.steps_total
        if tracker is not None:
            if tracker.callback_seconds:
                agent.add_thread_seconds(tracker.take_callback_seconds())
            if self._scans.due(total):
                scan_started = self._clock()
                keyed = KEYED_WHILE_TRACKING if self._sampled else None
                try:
                    series.scans.feed_counts(record, keyed_at_most=keyed)
                finally:
                    self._scanned(agent, total, self._clock() - scan_started)
        detector = series.detector
        due = detector.next_due_step()
        busy = self._pending is not None or record.step >= due
        if busy and self._defer_after_census(agent, record):
            pass  # evaluated (or its searches go on) at the next step end; the next scan is planned for it below
        elif busy:
            evaluation_started = self._clock()
            try:
                if self._pending is None:
                    series.feed_waiting()
                    self._evaluate(parts, record.step)
                self._advance(agent, parts, started)
            finally:
                self.evaluate_seconds += self._clock() - evaluation_started
            due = detector.next_due_step()
        self._scans.plan(total, due - record.step if self._pending is None else None)
        # The first steps_total whose eve may matter (``on_eve``): an eve costs ~10 µs after a step of
        # compute, and on a fast loop nine in ten are of a quick step end that neither scans nor evaluates.
        self._eve_from = min(self._scans.next_total, total + due - record.step) - 1

    def _defer_after_census(self, agent: AgentView, record: StepRecord) -> bool:
        """Whether a due evaluation waits one step: when the census component (which runs first)
        took its periodic census in this very step end, the evaluation's own heap scans (culprits,
        holders, host looks) go to the next one, so one pause of the job does not pay for both. Never
        twice in a row, so a census at every step cannot starve the detector."""
        fresh = self._census is not None and self._census.worked_at_step == record.step
        if fresh and not self._deferred:
            self._deferred = True
            agent.sample_within(1)
            return True
        self._deferred = False
        return False

    def on_eve(self) -> None:
        """The step before a sampled one: if that one will scan or evaluate, it runs in full, not quick;
        mark where its graphs begin (chains are dated by the marks, so they stay an evaluation apart,
        scanned or not)."""
        parts = self._parts
        agent = self._agent
        if parts is None or agent is None or agent.steps_total + 1 < self._eve_from:
            return
        if not self._scans.due(agent.steps_total + 1) and not (
                self._scans.idle and parts.series.detector.next_due_step() <= (agent.current_step or 0) + 1):
            return
        agent.sample_within(1)
        if parts.chains is not None:
            parts.chains.mark_step(agent.current_step)

    def _scanned(self, agent: AgentView, total: int, seconds: float) -> None:
        step_seconds = agent.seconds_per_step
        evaluations = 0.0
        if step_seconds:  # the evaluations' share of the job's time so far (heap looks are budgeted apart)
            evaluations = (self.evaluate_seconds - self.host_look_seconds) / max(1, agent.steps_total) / step_seconds
        self._scans.scanned(total, seconds, seconds_per_step=step_seconds, evaluations_share=evaluations)

    # --- evaluation ----------------------------------------------------------------------------

    def _evaluate(self, parts: _Parts, step: int) -> None:
        """Evaluate the detector and plan the culprit searches its state changes need (``_advance``
        runs them, one heap pass at a time on a big heap)."""
        assert self._agent is not None
        series = parts.series
        findings = self._findings
        statuses = series.evaluate(step)
        rising = series.rising_names()
        host_rising = series.host_spec.name in rising
        host_explained = host_rising and findings.counts_active(series, rising)
        self._track_only(series, statuses, rising - {series.host_spec.name} if host_explained else rising, step)
        self._scans.idle = not rising and not series.scans.found and not any(
            s.state is not None and s.state.active for s in statuses)
        series.detector.check_every = self._scans.check_every(series.detector.config.check_every_steps)
        work: list[tuple[Key | None, Stepwise[Evidence] | Stepwise[None]]] = []
        if host_rising:  # malloc's bytes in use, before any search's temporaries (``HostLooks._by_malloc``)
            self._host.read_in_use(step, self._agent)
        for status in sorted(statuses, key=_search_order):
            key = (status.spec.name, status.phase)
            active = status.state is not None and status.state.active
            if active and (status.changed or findings.retry_culprits(key, step, self._agent.seconds_per_step)):
                findings.attempts[key] = step
                if status.spec.name == series.host_spec.name:
                    self._host.read_in_use(step, self._agent, force=True)
                work.append((key, parts.culprits.search(status)))
            elif not active:
                self._sites.settle(status)  # a decided suspicion no longer needs allocation history
        if host_rising and not host_explained:
            work.append((None, self._host.look_stepwise(step, self._agent)))  # a baseline: nothing waits on it
        self._pending = PendingEvaluation(step, statuses, rising, work)

    def _track_only(self, series: LeakSeries, statuses: list[TrackStatus], rising: set[str], step: int) -> None:
        """Tracking: every finding is confirmed, none projects the out-of-memory soon, nothing else
        rises (host RSS that tensors under a finding explain does not count: ``counts_active``) or is
        suspected, and no series began within the last window (a group that just crossed the count
        threshold needs its points at the usual interval to be judged in time). Scans and evaluations
        may then be spaced further apart when the budget asks (``leak_scans.TRACKING_STRETCH``); anything
        that rises ends it at once, so the next evaluation is at the usual interval."""
        scans, detector = self._scans, series.detector
        names = {spec.name for spec in detector.series()}
        if not names <= self._series_seen:
            self._new_series_at = step
        self._series_seen = names
        states = {s.state for s in statuses}
        # Only findings said: a growth withheld (a bounded deque filling, then churning) is a healthy
        # job's, whose confirmed count series explained host RSS through rests of ten stretched checks
        # (8,000 steps): a host leak that began once the deque was full went unseen as long.
        scans.tracking = (LeakState.CONFIRMED in states and LeakState.SUSPECTED not in states
                          and not rising and not detector.near_oom
                          and step - self._new_series_at >= detector.config.window_steps
                          and all(self._findings.said((s.spec.name, s.phase)) for s in statuses
                                  if s.state is LeakState.CONFIRMED))
        if self._agent is not None:  # the step ends that feed the dense series stretch with the scans
            self._agent.sample_sparsely(scans.tracking)
        # A sample of the candidates stands for the rest (``KEYED_WHILE_TRACKING``) while tracking: every
        # confirmed growth is then a finding said, none a withheld one judged on its exact count against
        # its deque's bound.
        self._sampled = scans.tracking

    def _advance(self, agent: AgentView, parts: _Parts, started: float) -> None:
        """Run the pending searches within this step end's share; when all are done, update the
        findings and say their state changes."""
        pending = self._pending
        assert pending is not None
        done = not pending.work  # a quiet evaluation, the common case, has no search to run
        if not done:
            with collector_paused():  # the passes' allocations must not set off a collection of the job's heap
                done = pending.advance(self._clock, started)
        if not done:
            agent.sample_within(1)  # the next pass at the next step end
            return
        self._pending = None
        self._findings.conclude(agent, parts.series, pending)
        detector = parts.series.detector
        detector.near_oom = self._findings.near_oom(detector.near_oom_within)


def _search_order(status: TrackStatus) -> int:
    """Searches that sample what this evaluation's scan saw go first: a graph chain's root is replaced
    every step (an EMA), a count series' sample may be freed; a census diff can wait a step end."""
    return {"nodes": 0, "tensors": 1}.get(status.spec.unit, 2)

