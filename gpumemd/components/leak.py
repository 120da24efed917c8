"""The leak component: feeds the detector from each step, names culprits, reports state changes.

Its work is in parts, and data flows one way through them: ``leak_series`` feeds the detector from
step records, survivor scans and censuses and says what growth matters; the detector
(``analysis.leak_detector``) decides; ``leak_culprits`` searches the evidence behind a finding —
the census diff between the window's start and now with who holds a sample, the Python containers
that grew for a host leak (``leak_host``), and on CUDA with allocation history the allocation sites
(``leak_sites``); ``analysis.leak_wording`` says it; ``analysis.leak_causes`` makes the findings of
groups that grow together under one holder one finding (the published one).

This module runs them on the training thread. The detector folds values into block floors every
step (O(1)) and is evaluated every ``leak_check_every_steps``; survivor scans are spaced within the
overhead budget. On a state change of a cause the component logs one WARNING line (the finding's
headline, at most 200 characters), appends the whole finding to
``leak-findings-rank<R>.jsonl`` in the output directory and publishes ``findings`` in the agent state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpumemd.analysis.leak_causes import NO_CAUSES, Causes, merge_causes, state_changes
from gpumemd.analysis.leak_detector import LeakState, TrackStatus
from gpumemd.analysis.leak_wording import build_finding, refine_kind
from gpumemd.components.leak_culprits import CulpritSearch
from gpumemd.components.leak_evidence import NO_EVIDENCE, Evidence
from gpumemd.components.leak_file import FindingsFile
from gpumemd.components.leak_host import HostLooks
from gpumemd.components.leak_options import LeakOptions
from gpumemd.components.leak_pending import PendingEvaluation
from gpumemd.components.leak_scans import SCAN_EVERY, SCAN_EVERY_MAX, ScanSchedule
from gpumemd.components.leak_series import LeakSeries
from gpumemd.components.leak_sites import AllocationSites
from gpumemd.probes.gc_pause import collector_paused
from gpumemd.probes.long_lived import LongLivedProbes, long_lived_probes
from gpumemd.probes.stepwise import Stepwise

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.probes.allocation_history import AllocationHistory
    from gpumemd.probes.graph_chains import GraphChainTracker
    from gpumemd.probes.survivors import SurvivorTracker
    from gpumemd.records.findings import Finding
    from gpumemd.records.step import StepRecord

__all__ = ["SCAN_EVERY", "SCAN_EVERY_MAX", "LeakComponent", "LeakOptions"]

log = logging.getLogger("gpumemd")

_Key = tuple[str, str]  # a finding's (series, phase)


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
    ``snapshot_fn`` replaces torch's allocator snapshot; ``clock`` times the budgeted work (scans,
    evaluations, heap looks); ``wall_clock`` stamps the findings file."""

    name = "leak"

    def __init__(
        self,
        options: LeakOptions,
        *,
        census: CensusComponent | None,
        history: AllocationHistory,
        snapshot_fn: Callable[[], Mapping[str, Any]] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
        probes: Callable[[], LongLivedProbes] = long_lived_probes,
    ) -> None:
        self._options = options
        self._new_probes = probes  # fresh long-lived tensor trackers at each start
        self._census = census
        self._history = history
        self._wall = wall_clock
        self._clock = clock
        # Kept across starts: heap-look baselines and their budget, allocation sites noted at suspicion.
        self._host = HostLooks(window_steps=options.leak_window_steps, overhead_budget=options.overhead_budget,
                               clock=clock)
        self._sites = AllocationSites(options, history, snapshot_fn=snapshot_fn)
        self._agent: AgentView | None = None
        self._parts: _Parts | None = None
        self._findings: dict[_Key, Finding] = {}  # per (series, phase); published merged by cause
        self._causes: Causes = NO_CAUSES
        self._culprits: dict[_Key, Evidence] = {}
        self._attempts: dict[_Key, int] = {}  # step of the last culprit search per finding
        self._scans = self._new_scans()
        self._file: FindingsFile | None = None
        self._deferred = False  # the last due evaluation waited for the step after a census
        self._pending: PendingEvaluation | None = None  # an evaluation whose searches go on
        self.evaluate_seconds = 0.0  # time spent in evaluations (benchmarks read it)
        self._scans_before = 0.0  # scan seconds of earlier starts

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
        self._file = FindingsFile(agent, self._wall)
        self._scans_before += self._scans.seconds
        self._scans = self._new_scans()
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
                self._conclude(self._agent, self._parts.series, pending)
            finally:
                pending.close()
        parts, self._parts = self._parts, None
        if parts is not None:
            if parts.tracker is not None:
                parts.tracker.uninstall()
            if parts.chains is not None:
                parts.chains.clear()
            if parts.series.families is not None:
                parts.series.families.clear()
        self._sites.clear()
        self._host.clear()

    @property
    def findings_path(self) -> str:
        """The findings file (``leak_file``), created on the first state change."""
        assert self._file is not None
        return self._file.path

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
                try:
                    series.feed_counts(record)
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
        """The step before a sampled one: if that one will scan (and evaluate: an evaluation scans too),
        it runs in full, not quick; mark where its graphs begin."""
        parts = self._parts
        agent = self._agent
        if parts is None or agent is None or not self._scans.due(agent.steps_total + 1):
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
        statuses = series.evaluate(step)
        rising = series.rising_names()
        work: list[tuple[_Key | None, Stepwise[Evidence] | Stepwise[None]]] = []
        for status in sorted(statuses, key=_search_order):
            key = (status.spec.name, status.phase)
            active = status.state is not None and status.state.active
            if active and (status.changed or self._retry_culprits(key, step)):
                self._attempts[key] = step
                work.append((key, parts.culprits.search(status)))
            elif not active:
                self._sites.settle(status)  # a decided suspicion no longer needs allocation history
        if series.host_spec.name in rising and not self._counts_active(series, rising):
            work.append((None, self._host.look_stepwise(step, self._agent)))  # a baseline: nothing waits on it
        self._pending = PendingEvaluation(step, statuses, rising, work)

    def _advance(self, agent: AgentView, parts: _Parts, started: float) -> None:
        """Run the pending searches within this step end's share; when all are done, update the
        findings and say their state changes."""
        pending = self._pending
        assert pending is not None
        with collector_paused():  # the passes' allocations must not set off a collection of the job's heap
            done = pending.advance(self._clock, started)
        if not done:
            agent.sample_within(1)  # the next pass at the next step end
            return
        self._pending = None
        self._conclude(agent, parts.series, pending)

    def _conclude(self, agent: AgentView, series: LeakSeries, pending: PendingEvaluation) -> None:
        self._culprits.update(pending.found)
        statuses, rising = pending.statuses, pending.rising
        if not statuses:
            return
        held_graphs = self._graphs_reported(series, statuses, rising)
        before = dict(self._findings)
        changed = [(s.spec.name, s.phase) for s in statuses
                   if self._update(series, s, held_graphs, fresh=(s.spec.name, s.phase) in pending.found) and s.changed]
        if not changed and before.keys() == self._findings.keys() and all(
                self._findings[k] is f for k, f in before.items()):
            return  # every finding stands as published (confirmed leaks between re-tests): nothing to say
        # Groups that grow together under one holder are one cause: one finding, one line per
        # state change of it (the per-series findings above stay the detector's bookkeeping).
        previous, self._causes = self._causes, merge_causes(self._findings, self._causes)
        reported = state_changes(previous, self._causes, changed)
        for finding in reported:
            self._report(finding)
        agent.publish(findings=tuple(self._causes.findings.values()))
        self._census_to_match(agent, reported)

    def _census_to_match(self, agent: AgentView, reported: list[Finding]) -> None:
        """A census soon after a leak is confirmed (or refreshed while the census predates it), so the
        tensor figures tell the finding's story: a fast loop's census can be thousands of steps old."""
        census = agent.published.census
        taken = census.step if census is not None and census.step is not None else -1
        confirmed = [f.first_step for f in self._causes.findings.values() if f.state == "confirmed"]
        if self._census is not None and confirmed and (
                any(f.state == "confirmed" for f in reported) or taken < max(confirmed)):
            self._census.take_soon()

    def _graphs_reported(self, series: LeakSeries, statuses: list[TrackStatus], rising: set[str]) -> bool:
        """Is a retained graph reported by another finding, so tensors only a graph keeps are not?"""
        # Tensors that only an autograd graph keeps (saved inputs whose wrapper torch preserved) grow
        # with the graph tensors a Python container holds: one leak, reported once, by the latter.
        active_keys = self._findings_or(statuses)
        if any(e.kind == "graph_leak" and not e.graph_kept and key in active_keys
               for key, e in self._culprits.items()):
            return True
        # ... or by a graph chain (``total += loss`` without backward keeps each step's saved tensors):
        # the chain is the cause, and it is reported by its own series, rising now or active.
        chains = series.chain_nodes.names()
        return bool(chains & rising) or any(f.series in chains and f.state != "cleared"
                                            for f in self._findings.values())

    def _update(self, series: LeakSeries, status: TrackStatus, held_graphs: bool, *, fresh: bool) -> bool:
        """Update one status's finding, unless it is not one (False). ``fresh``: a culprit search for
        it concluded in this evaluation."""
        key = (status.spec.name, status.phase)
        evidence = self._culprits.get(key, NO_EVIDENCE)
        if self._withheld(status, evidence, held_graphs):
            return False
        previous = self._findings.get(key)
        if previous is not None and not fresh and not status.changed and previous.updated_step == status.step:
            # The detector gave its last status again (a confirmed leak between its re-tests, every
            # 4th check): the finding stands as built then; rebuilding its sentences every check of a
            # finding that lasts for days was most of the cost of tracking it.
            return True
        active = status.state is not None and status.state.active
        dated = _dated(status, evidence)
        finding = build_finding(
            dated, kind=self._kind(series, status, evidence), culprits=evidence.culprits if active else (),
            culprit_steps=evidence.steps, headroom_bytes=series.headroom(status.spec), sites=evidence.sites,
            bytes_per_unit=evidence.bytes_per_unit, seconds_per_step=series.seconds_per_step,
            holder_sentence=evidence.sentence, per_step=series.stated_rate(dated),
            culprits_step=self._attempts.get(key),
        )
        self._findings[key] = finding
        if not active:
            self._culprits.pop(key, None)
        return True

    def _withheld(self, status: TrackStatus, evidence: Evidence, held_graphs: bool) -> bool:
        """Growth that is not a finding of its own: tensors a reported graph keeps, cyclic garbage,
        or growth another series explains (its finding is withdrawn, never said to have stopped)."""
        if (evidence.graph_kept and held_graphs) or evidence.garbage:
            if status.changed:
                log.debug("gpumemd: %s grows, but %s", status.spec.name, "cyclic garbage the collector will free"
                          if evidence.garbage else "it is kept by a graph already reported")
            return True
        active = status.state is not None and status.state.active
        if not active and status.verdict.reason.startswith("explained"):
            # The growth goes on, as another series' finding: withdraw this one, never say it stopped.
            key = (status.spec.name, status.phase)
            self._findings.pop(key, None)
            self._culprits.pop(key, None)
            if status.changed:
                log.info("gpumemd: %s growth is %s; reported there", status.spec.name, status.verdict.reason)
            return True
        return False

    def _findings_or(self, statuses: list[TrackStatus]) -> set[_Key]:
        """Keys of the findings that are active now or in this evaluation."""
        keys = {k for k, f in self._findings.items() if f.state != "cleared"}
        keys.update((s.spec.name, s.phase) for s in statuses if s.state is not None and s.state.active)
        return keys

    def _counts_active(self, series: LeakSeries, rising: set[str]) -> bool:
        """A count series is reporting, or rising: host RSS growth is most likely those tensors, so
        the heap scans that look for other culprits are not worth their cost."""
        names = series.counts.names() | series.chain_nodes.names() | series.grown.names()
        if names & rising:
            return True
        return any(f.series in names and f.state != "cleared" for f in self._findings.values())

    def _retry_culprits(self, key: _Key, step: int) -> bool:
        """No culprit yet: look again, but at most once per window (each look scans the heap or takes
        a census, which must not happen every check of a finding that lasts for days)."""
        entry = self._culprits.get(key)
        if entry is not None and entry.culprits:
            return False
        last = self._attempts.get(key)
        return last is None or step - last >= self._options.leak_window_steps // 2

    def _kind(self, series: LeakSeries, status: TrackStatus, evidence: Evidence) -> str:
        previous = self._findings.get((status.spec.name, status.phase))
        if status.state is LeakState.CLEARED and previous is not None:
            return previous.kind
        kind = evidence.kind if evidence.kind is not None else refine_kind(status.spec.kind, evidence.culprits)
        if kind == "tensor_leak":
            # allocated bytes that the census cannot see growing as fast: autograd-saved tensors
            invisible = series.invisible_rate(status)
            if invisible is not None and invisible >= 0.5 * status.verdict.slope.slope:
                kind = "graph_leak"
        return kind

    # --- surfaces ------------------------------------------------------------------------------

    def _report(self, finding: Finding) -> None:
        # One short line a person reads once; the whole sentence goes to the file and the state.
        log.warning("gpumemd: %s", finding.headline or finding.summary)
        if self._file is not None:
            self._file.append(finding)


def _dated(status: TrackStatus, evidence: Evidence) -> TrackStatus:
    """The status with the earlier of its onset and the evidence's. Host RSS lags a leak (freed heap
    is reused first): a container's length at its rate dates it better. A count series' knee,
    dated between scans, is already within a step or two; a chain's marks only place its start
    within a scan interval, so they date it only when the series cannot."""
    onset = evidence.onset_step
    if onset is None or (status.onset_step is not None and status.spec.unit != "bytes"):
        return status
    if status.onset_step is not None:
        onset = min(status.onset_step, onset)
    return dataclasses.replace(status, onset_step=max(0, onset))  # a length at its rate may point before step 0


def _search_order(status: TrackStatus) -> int:
    """Searches that sample what this evaluation's scan saw go first: a graph chain's root is replaced
    every step (an EMA), a count series' sample may be freed; a census diff can wait a step end."""
    return {"nodes": 0, "tensors": 1}.get(status.spec.unit, 2)

