"""The leak component's findings: from an evaluation's statuses and the evidence its culprit searches
found to the findings it publishes.

One finding per (series, phase), as the detector tracks them, is kept with the evidence behind it and
the step it was last searched at; growth that is not a finding of its own (tensors a reported graph
keeps, cyclic garbage, growth another series explains) is withheld. The findings of groups that grow
together under one holder are published merged by cause (``analysis.leak_causes``); on a state change
of a cause its headline is logged and the whole finding appended to the findings file (``leak_file``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd import budget
from gpumemd.analysis.census_culprits import refine_kind
from gpumemd.analysis.leak_causes import (
    NO_CAUSES,
    Causes,
    accounting_for,
    merge_causes,
    newly_critical,
    state_changes,
    withdrawn,
)
from gpumemd.analysis.leak_detector import LeakState, TrackStatus
from gpumemd.analysis.leak_headline import nearer_line, withdrawn_line
from gpumemd.analysis.leak_wording import build_finding
from gpumemd.components.leak_evidence import NO_EVIDENCE, Evidence
from gpumemd.components.leak_file import FindingsFile
from gpumemd.components.leak_pending import Key
from gpumemd.records.device import cuda_index

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.components.leak_options import LeakOptions
    from gpumemd.components.leak_pending import PendingEvaluation
    from gpumemd.components.leak_series import LeakSeries
    from gpumemd.records.findings import Finding

log = logging.getLogger("gpumemd")

RETRY_DOUBLINGS = 8
"""A finding without a culprit is looked at again half a window on, then twice as far each time, up to
256 half windows (64,000 steps at defaults): a few hundred looks a day on a 1 ms loop; and no sooner
than the job has paid for the last search within the heap looks' share of the budget
(``budget.Part.HOST_LOOKS``): a search for a C extension's leak (a census, four heap passes) took 0.2-0.4 s
on a 2.6 ms/step job, and its retries at this schedule cost that job ~10% of its first 4,000 steps."""


class LeakFindings:
    """The leak component's findings, kept across its starts; see the module docstring. ``census`` (the
    census component, None when censuses are off) is asked for a census that matches a confirmed leak;
    ``wall_clock`` stamps the findings file."""

    def __init__(self, options: LeakOptions, *, census: CensusComponent | None,
                 wall_clock: Callable[[], float]) -> None:
        self._options = options
        self._census = census
        self._wall = wall_clock
        self._findings: dict[Key, Finding] = {}  # per (series, phase); published merged by cause
        self._causes: Causes = NO_CAUSES
        self._said_critical: set[Key] = set()  # active causes a line has called critical (``_say_nearer``)
        self._culprits: dict[Key, Evidence] = {}
        self.attempts: dict[Key, int] = {}  # step of the last culprit search per finding
        self._retries: dict[Key, int] = {}  # looks again for a culprit in this episode (``retry_culprits``)
        self._search_seconds: dict[Key, float] = {}  # what the last culprit search of each finding took
        self.file: FindingsFile | None = None  # the findings file (``leak_file``), made at start

    def start(self, agent: AgentView) -> None:
        self.file = FindingsFile(agent, self._wall)

    def conclude(self, agent: AgentView, series: LeakSeries, pending: PendingEvaluation) -> None:
        self._culprits.update(pending.found)
        self._search_seconds.update(pending.spent)
        statuses, rising = pending.statuses, pending.rising
        if not statuses:
            return
        held_graphs = self._graphs_reported(series, statuses, rising)
        before = dict(self._findings)
        host_claim = _host_claimant(statuses, series.host_spec.name)
        changed = [(s.spec.name, s.phase) for s in statuses
                   if self._update(series, s, held_graphs, fresh=(s.spec.name, s.phase) in pending.found,
                                   host=s is host_claim) and (s.changed or _first_said(s, before))]
        if not changed and before.keys() == self._findings.keys() and all(
                self._findings[k] is f for k, f in before.items()):
            return  # every finding stands as published (confirmed leaks between re-tests): nothing to say
        # Groups that grow together under one holder are one cause: one finding, one line per
        # state change of it (the per-series findings above stay the detector's bookkeeping).
        previous, self._causes = self._causes, merge_causes(self._findings, self._causes)
        reported = state_changes(previous, self._causes, changed)
        for finding in reported:
            self._report(finding)
        self._say_nearer(previous, reported)
        for finding in withdrawn(previous, self._causes):  # said, so its end is said too (not to the file:
            # its growth goes on in the finding that accounts for it, whose lines are there)
            log.warning("gpumemd: %s", withdrawn_line(finding, accounting_for(finding, self._causes)))
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
        # Graphs a bounded deque holds stop with it, their saved tensors too: the tensors' series
        # settle later than the graphs', so that story holds for a window past the deque's.
        active_keys = self._findings_or(statuses)
        window_start = max(s.step for s in statuses) - self._options.leak_window_steps
        if any(e.kind == "graph_leak" and not e.graph_kept and (key in active_keys or (
                e.bounded_until is not None and e.bounded_until >= window_start))
               for key, e in self._culprits.items()):
            return True
        # ... or by a graph chain (``total += loss`` without backward keeps each step's saved tensors):
        # the chain is the cause, and it is reported by its own series, rising now or active.
        chains = series.scans.chain_nodes.names()
        return bool(chains & rising) or any(f.series in chains and f.state != "cleared"
                                            for f in self._findings.values())

    def _update(self, series: LeakSeries, status: TrackStatus, held_graphs: bool, *, fresh: bool,
                host: bool) -> bool:
        """Update one status's finding, unless it is not one (False). ``fresh``: a culprit search for
        it concluded in this evaluation; ``host``: it states host RSS's growth (``_host_claimant``)."""
        key = (status.spec.name, status.phase)
        evidence = self._culprits.get(key, NO_EVIDENCE)
        if self._withheld(status, evidence, held_graphs):
            return False
        previous = self._findings.get(key)
        active = status.state is not None and status.state.active
        if previous is None and not (active and status.verdict.passed):
            # Never said (withheld while it grew: explained by another series, kept by a reported graph):
            # its end is no news, nor is a growth that stopped before it could be said. Still active (one
            # check explained), its culprits stay for when it is said: dropped, it was said without them.
            if not active:
                self._culprits.pop(key, None)
            return False
        if previous is not None and previous.state == "cleared" and not active and not status.changed:
            # A cleared finding stands as it was said: its evidence (a count series' bytes per tensor)
            # went with its clearing, and rebuilt without it the exporter showed tensors as bytes.
            return True
        if previous is not None and not fresh and not status.changed and previous.updated_step == status.step:
            # The detector gave its last status again (a confirmed leak between its re-tests,
            # ``CONFIRMED_EVERY``): the finding stands as built then; rebuilding its sentences every check of a
            # finding that lasts for days was most of the cost of tracking it.
            return True
        dated = _dated(status, evidence)
        finding = build_finding(
            dated, kind=self._kind(series, status, evidence), culprits=evidence.culprits if active else (),
            culprit_steps=evidence.steps, headroom_bytes=series.headroom(status.spec), sites=evidence.sites,
            bytes_per_unit=evidence.bytes_per_unit, seconds_per_step=series.seconds_per_step,
            holder_sentence=evidence.sentence, per_step=series.stated_rate(dated),
            culprits_step=self.attempts.get(key), host_bytes_per_step=series.host_rate(dated) if host else None,
        )
        self._findings[key] = finding
        if not active:
            self._culprits.pop(key, None)
            self._retries.pop(key, None)
        return True

    def _withheld(self, status: TrackStatus, evidence: Evidence, held_graphs: bool) -> bool:
        """Growth that is not a finding of its own: tensors a reported graph keeps, cyclic garbage,
        or growth another series explains (a finding said of it is withdrawn, never said to have stopped)."""
        active = status.state is not None and status.state.active
        key = (status.spec.name, status.phase)
        if (evidence.graph_kept and held_graphs) or evidence.garbage:
            if status.changed:
                log.debug("gpumemd: %s grows, but %s", status.spec.name, "cyclic garbage the collector will free"
                          if evidence.garbage else "it is kept by a graph already reported")
            # Said before that graph's finding was (its tensors are counted first): withdrawn into it,
            # or it stood beside it to the end with a holder that was only the graph the search came by.
            said = self._findings.get(key)
            if said is not None and said.state != "cleared":
                del self._findings[key]
            return True
        if evidence.bounded_until is not None and key not in self._findings:
            # Growth into a deque(maxlen=N) stops at N: a healthy job's window of recent outputs is no
            # leak; nor is RSS the heap's fragmentation grew. Said nowhere unless it goes on (``retry_culprits``).
            if status.changed and evidence.fragmented:
                log.info("gpumemd: %s grows, but what malloc hands out does not: the heap fragments, not a leak",
                         status.spec.name)
            elif status.changed and evidence.culprits:
                log.info("gpumemd: %s grows, held by %s: bounded by its maxlen, not a leak", status.spec.name,
                         evidence.culprits[0].holder)
            elif status.changed:
                log.debug("gpumemd: %s grows; judged again at step %d, once malloc's bytes in use compare",
                          status.spec.name, evidence.bounded_until)
            return True  # its evidence stays: the statuses that follow a clearing are withheld too
        if not active and status.verdict.reason.startswith("explained"):
            # The growth goes on, as another series' finding: withdraw this one, never say it stopped.
            self._findings.pop(key, None)
            self._culprits.pop(key, None)
            if status.changed:
                log.info("gpumemd: %s growth is %s; reported there", status.spec.name, status.verdict.reason)
            return True
        return False

    def _findings_or(self, statuses: list[TrackStatus]) -> set[Key]:
        """Keys of the findings that are active now or in this evaluation."""
        keys = {k for k, f in self._findings.items() if f.state != "cleared"}
        keys.update((s.spec.name, s.phase) for s in statuses if s.state is not None and s.state.active)
        return keys

    def near_oom(self, within_steps: float) -> set[str]:
        """Series whose confirmed finding projects the out-of-memory within ``within_steps``."""
        return {f.series for f in self._findings.values() if f.state == "confirmed" and f.steps_to_oom is not None
                and f.steps_to_oom < within_steps}

    def said(self, key: Key) -> bool:
        """Whether a finding of this series has been said (a withheld growth, e.g. into a bounded
        deque, has none)."""
        return key in self._findings

    def counts_active(self, series: LeakSeries, rising: set[str]) -> bool:
        """A count series is reporting, or rising: host RSS growth is most likely those tensors, so
        the heap scans that look for other culprits are not worth their cost."""
        names = series.scans.counts.names() | series.scans.chain_nodes.names() | series.scans.grown.names()
        return bool(names & rising) or any(f.series in names and f.state != "cleared" for f in self._findings.values())

    def retry_culprits(self, key: Key, step: int, seconds_per_step: float | None) -> bool:
        """No culprit yet: look again, half a window on and twice as far each time (``RETRY_DOUBLINGS``),
        once the job has paid for the last search (``_paid_for``); or growth withheld as stopping on its
        own (``Evidence.bounded_until``) is due another look: at once while it is not said, as it may be a
        leak to say; once paid for when it is."""
        entry = self._culprits.get(key)
        if entry is not None and entry.bounded_until is not None:  # its deque full, or its heap grown on
            return step >= entry.bounded_until and (not self.said(key) or self._paid_for(key, step, seconds_per_step))
        if entry is not None and entry.culprits:
            return False
        last = self.attempts.get(key)
        if last is None:
            return True
        tries = self._retries.get(key, 0)
        if step - last < (self._options.leak_window_steps // 2) << min(tries, RETRY_DOUBLINGS):
            return False
        if not self._paid_for(key, step, seconds_per_step):
            return False
        self._retries[key] = tries + 1
        return True

    def _paid_for(self, key: Key, step: int, seconds_per_step: float | None) -> bool:
        """Has the job, since the last culprit search of ``key``, run long enough for that search to fit
        in the heap looks' share of the budget? (True while either figure is unknown.)"""
        cost, last = self._search_seconds.get(key), self.attempts.get(key)
        if not cost or last is None or not seconds_per_step:
            return True
        allowed = budget.share(self._options.overhead_budget, budget.Part.HOST_LOOKS)
        return (step - last) * seconds_per_step * allowed >= cost

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

    def _say_nearer(self, previous: Causes, reported: list[Finding]) -> None:
        """Say once an episode that a cause's out-of-memory is now projected within a day, unless its
        state-change line just said it (``newly_critical``). A log line only: the findings file keeps
        one line per state change, and the state file the projection as it moves."""
        for key, finding in newly_critical(self._causes, self._said_critical):
            self._said_critical.add(key)
            if not any(f is finding for f in reported):
                log.warning("gpumemd: %s", nearer_line(finding, previous.findings.get(key)))
        self._said_critical.intersection_update(
            key for key, f in self._causes.findings.items() if f.state != "cleared")

    def _report(self, finding: Finding) -> None:
        # One short line a person reads once; the whole sentence goes to the file and the state.
        log.warning("gpumemd: %s", finding.headline or finding.summary)
        if self.file is not None:
            self.file.append(finding)


def _host_claimant(statuses: list[TrackStatus], host: str) -> TrackStatus | None:
    """The active CPU tensor finding that states host RSS's growth as its own: the fastest in bytes.
    One, so two CPU leaks do not each project out-of-memory from the same growth; none while host RSS
    (series ``host``) has a finding raised after it, grown past what the tensors explain
    (``leak_verdicts.outgrew``): that growth is not theirs to state or to project from. (One raised
    before it is host RSS rising with those tensors, seen first, and withdrawn into their finding.)"""
    own = [s.first_step for s in statuses if s.spec.name == host and s.state is not None and s.state.active]
    cpu = [s for s in statuses if s.spec.kind == "tensor_leak" and s.spec.unit == "tensors"
           and s.spec.device is not None and cuda_index(s.spec.device) is None
           and s.state is not None and s.state.active]
    claimant = max(cpu, key=lambda s: s.verdict.slope.slope * s.spec.unit_bytes, default=None)
    if claimant is None or not own or own[0] is None or claimant.first_step is None:
        return claimant
    return None if own[0] > claimant.first_step else claimant


def _first_said(status: TrackStatus, before: dict[Key, Finding]) -> bool:
    """An active finding withheld until now (``LeakFindings._withheld``: its bounded deque is full and the
    group grows on) is said as it first stands, like a state change."""
    return (status.spec.name, status.phase) not in before and status.state is not None and status.state.active


def _dated(status: TrackStatus, evidence: Evidence) -> TrackStatus:
    """The status with the evidence's onset where it dates the growth better. Host RSS lags a leak (freed
    heap is reused first) and its hinge runs on into growth that preceded it and was another's (a
    deque(maxlen=N) of graphs filling, withheld: a list of raw samples kept from step 1,100 read "since
    step 102"): a container's length at its rate dates it better. A count series' knee, dated between
    scans, is already within a step or two; a chain's marks only place its start within a scan
    interval, so they date it only when the series cannot."""
    onset = evidence.onset_step
    if onset is None or (status.onset_step is not None and status.spec.unit != "bytes"):
        return status
    return dataclasses.replace(status, onset_step=max(0, onset))  # a length at its rate may point before step 0
