"""The leak component: feeds the detector from each step, names culprits, reports state changes.

Series fed per step (all cheap reads of the ``StepRecord`` and the published state):

- CUDA, per device: step-end ``allocated`` (tensor/graph leak), ``inactive_split`` (fragmentation:
  absent under expandable segments and cudaMallocAsync, which do not maintain it), NVML used −
  reserved (memory outside PyTorch's allocator).
- Host RSS (host leak) — unless the census of CPU tensors grows as fast, which makes it theirs.
- Census, per device, whenever a new census is published: total bytes including the autograd graph
  it keeps alive (on CPU this is the tensor/graph leak alarm), and CUDA's allocated − census
  ("invisible", i.e. autograd-saved tensors), which turns an allocated-bytes leak into a graph leak.

The detector folds values into block floors every step (O(1)) and is evaluated every
``leak_check_every_steps``. On a state change the component names the culprits — the census diff
between the window's start and now with who holds a sample, the Python containers that grew for a
host leak, and on CUDA with allocation history the allocation sites — then logs one WARNING line,
appends the finding to ``leak-findings-rank<R>.jsonl`` in the output directory and publishes
``findings`` in the agent state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import inspect
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gpumemd import budget
from gpumemd.analysis.alloc_sites import SiteBytes, diff_sites, live_by_site, site_sentence
from gpumemd.analysis.headroom import reservable_bytes
from gpumemd.analysis.leak_detector import DetectorConfig, LeakDetector, LeakState, SeriesSpec, TrackStatus
from gpumemd.analysis.leak_wording import build_finding, count_sentence, culprits_from_diff, refine_kind
from gpumemd.probes.allocation_history import AllocationHistory, process_history
from gpumemd.probes.holders import HOLDER_BUDGET_S, cycle_holder, holder_of_group, who_holds
from gpumemd.probes.package_dirs import internal_dirs
from gpumemd.records.device import CPU, cuda_device, cuda_index
from gpumemd.records.findings import Culprit, Finding

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView
    from gpumemd.components.census import CensusComponent
    from gpumemd.records.census import Census, GroupDelta
    from gpumemd.records.step import StepRecord

log = logging.getLogger("gpumemd")
_HISTORY_USER = "leak"  # this component's name among the users of the allocation history


# Noise floors: the smallest growth per step each kind of series can tell from its own noise, whatever
# the materiality. The allocator's and the census's counters are exact; host RSS moves in pages and
# malloc chunks; inactive split bytes and NVML move in allocator blocks and segments.
NOISE_FLOOR_BYTES = {
    "allocated": 1024.0,
    "census": 1024.0,
    "host": 16 * 1024.0,  # a Hugging Face Trainer fit drifts by ~2-9 KiB/step of RSS while it warms up
    "fragmentation": 256 * 1024.0,
    "non_pytorch": 256 * 1024.0,
}
RSS_BURST_BYTES = 8 * 1024 * 1024
"""Host RSS rises in malloc-arena bursts of a few MiB while heaps warm up (measured: 3-6 MiB in the demo
and a Hugging Face Trainer fit). Over a short window one burst looks like a slope, so the host floor is
at least this much per window: 16 KiB/step at the default 500-step window, more for shorter ones."""

COUNT_FLOOR = 0.1
"""Long-lived tensors per step below which a count series never fires (one per 10 steps)."""

SCAN_EVERY = 10
"""Steps between survivor scans (and count-series observations) at least."""

SCAN_EVERY_MAX = 50
"""Steps between survivor scans at most, whatever the budget says: a 500-step window then still has
10 points of every count series, so the budget never starves detection."""

MAX_COUNT_SERIES = 16
"""Tensor groups watched as count series at most (the first that reach ``_COUNT_MIN`` tensors)."""

_COUNT_MIN = 8

_COUNT_HISTORY = 64
"""Scans whose group counts are kept (per family) to start a new count series with its past: 64
scans span 640 to 3,200 steps, more than a detection window."""

_GRAPH_NODES_MAX = 5_000
"""Nodes walked at most when counting the graph one leaked tensor keeps (one look per finding)."""

_GRAPH_NODES_KEPT = 8
"""A leaked tensor whose own graph has at least this many nodes is a graph leak (an output kept with
its forward's graph), not a tensor leak (a tensor with the one node of its last operation)."""

_UNFED_MAX = 32
"""Records waiting for the detector at most (they are fed at each evaluation, every 50 steps by default)."""


@dataclasses.dataclass(frozen=True)
class LeakOptions:
    """What the leak component reads of the configuration (``Config.options(LeakOptions)``; the
    fields are ``Config``'s, documented there)."""

    leak_min_bytes_per_step: int | None
    leak_host_min_bytes_per_step: int | None
    leak_warmup_steps: int
    leak_window_steps: int
    leak_check_every_steps: int
    leak_horizon_hours: float
    leak_history_on_suspect: bool
    overhead_budget: float
    history_steps: int
    record_history: bool
    history_max_entries: int


class LeakComponent:
    """Runs the leak detector on the training thread; see the module docstring.

    ``census`` (the census component, when censuses run) gives the censuses that name culprits;
    ``history`` is the process's allocation history, switched on at suspicion on CUDA."""

    name = "leak"

    def __init__(
        self,
        options: LeakOptions | None = None,
        *,
        census: CensusComponent | None = None,
        history: AllocationHistory | None = None,
        snapshot_fn: Callable[[], Mapping[str, Any]] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if options is None:
            from gpumemd.config import Config

            options = Config().options(LeakOptions)
        self._options = options
        self._census = census
        self._history = history if history is not None else process_history()
        self._snapshot_fn = snapshot_fn
        self._wall = wall_clock
        self._clock = clock  # times the budgeted work (scans, evaluations, heap looks)
        self._agent: AgentView | None = None
        self._detector: LeakDetector | None = None
        self._known: set[str] = set()
        self._findings: dict[tuple[str, str], Finding] = {}
        self._culprits: dict[tuple[str, str], _Evidence] = {}
        self._attempts: dict[tuple[str, str], int] = {}  # step of the last culprit search per finding
        self._last_census: Census | None = None
        self._host_baseline: tuple[int, dict[int, int], int] | None = None  # step, container lengths, graph nodes
        self._host_look_at: int | None = None  # the agent's steps_total at the last host look
        self._host_look_cost = 0.0  # seconds it took
        self._sites_before: dict[int, tuple[int, dict[str, SiteBytes]]] = {}
        self._named_sites: dict[int, tuple[str, ...]] = {}  # per device, once a finding is confirmed
        self._history_enabled_by_us = False
        self._host_spec = SeriesSpec("host_rss_bytes", "host_leak")
        self.evaluate_seconds = 0.0  # time spent in evaluations (benchmarks read it)
        self.scan_seconds = 0.0  # time spent in survivor scans (benchmarks read it)
        self.host_look_seconds = 0.0  # of evaluate_seconds, the heap looks (budgeted apart)
        self._tracker: Any = None
        self._count_specs: dict[Any, SeriesSpec] = {}  # survivor group key -> its count series
        self._chains: Any = None
        self._chain_specs: dict[Any, SeriesSpec] = {}  # chain group key -> its node-count series
        self._seconds_per_step: float | None = None
        self._own_record_bytes: float | None = None
        self._scan_interval = SCAN_EVERY  # steps between scans now (budgeted, see _scanned)
        self._last_scan_total = 0  # agent.steps_total at the last scan
        self._next_scan_total = SCAN_EVERY  # agent.steps_total at which the next scan runs
        self._scan_cost: float | None = None  # moving average of a scan's seconds
        self._previous_scan_step: int | None = None
        self._count_history: dict[int, collections.deque[tuple[int, dict[Any, int]]]] = {}
        self._append_failed = False  # the last append to the findings file failed (logged once)
        self._unfed: list[tuple[StepRecord, int]] = []  # records not yet fed to the detector (see on_step)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, agent: AgentView) -> None:
        c = self._options
        self._agent = agent
        self._detector = LeakDetector(DetectorConfig(
            min_bytes_per_step=c.leak_min_bytes_per_step or NOISE_FLOOR_BYTES["allocated"],
            warmup_steps=c.leak_warmup_steps,
            window_steps=c.leak_window_steps,
            check_every_steps=c.leak_check_every_steps,
        ))
        self._host_spec = SeriesSpec(
            "host_rss_bytes", "host_leak",
            explained_by=("census_bytes{device=cpu}", "long_lived_bytes{device=cpu}", "tensors{device=cpu,*",
                          "graph_nodes{device=cpu,*"))
        self._unfed = []  # a new detector: records fed to an earlier one stay with it
        self._seconds_per_step = None
        self._own_record_bytes = None
        self._scan_interval, self._last_scan_total, self._scan_cost = SCAN_EVERY, 0, None
        self._next_scan_total = SCAN_EVERY
        self._previous_scan_step = None
        try:
            from gpumemd.probes.graph_chains import GraphChainTracker
            from gpumemd.probes.survivors import SurvivorTracker

            self._tracker = SurvivorTracker()
            self._tracker.install()
            self._chains = GraphChainTracker()
        except Exception as exc:  # noqa: BLE001 - no count evidence then; bytes series still run
            log.info("gpumemd: long-lived tensor tracking is off (%s: %s)", type(exc).__name__, exc)
            self._tracker = None
            self._chains = None


    def stop(self) -> None:
        if self._tracker is not None:
            self._tracker.uninstall()
            self._tracker = None
        if self._chains is not None:
            self._chains.clear()
            self._chains = None
        self._count_specs.clear()
        self._chain_specs.clear()
        self._count_history.clear()
        self._unfed.clear()
        self._release_history()
        self._host_baseline = None
        self._sites_before.clear()
        self._named_sites.clear()
        self._last_census = None

    @property
    def findings_path(self) -> str:
        """The append-only JSON-lines file (created on the first state change). Named from the rank
        known when it is written: jobs often call ``init_process_group`` after attach."""
        assert self._agent is not None
        rank = self._agent.state().identity.rank
        return os.path.join(self._agent.output_dir, f"leak-findings-rank{rank}.jsonl")

    # --- per step ------------------------------------------------------------------------------

    def on_step(self, record: StepRecord) -> None:
        detector = self._detector
        agent = self._agent
        if detector is None or agent is None:
            return
        # The record waits in a short list and is fed to the detector, in one loop, just before the
        # evaluation that reads it (or once _UNFED_MAX wait). A sampled step end runs after a step of
        # compute, with the agent's code and data out of the cache: there each detector call costs
        # ~20 µs, in the loop ~2 µs. Same values, same order, so the detector decides the same.
        unfed = self._unfed
        unfed.append((record, agent.samples_total))
        census = agent.published.census
        if census is not None and census is not self._last_census:
            self._last_census = census
            self._feed_census(census, record)
        tracker = self._tracker
        total = agent.steps_total
        if tracker is not None:
            if tracker.callback_seconds:
                agent.add_thread_seconds(tracker.take_callback_seconds())
            if total >= self._next_scan_total:
                self._last_scan_total = total
                start = self._clock()
                try:
                    self._feed_counts(record)
                finally:
                    self._scanned(self._clock() - start)
        due = detector.next_due_step()
        if record.step >= due:
            start = self._clock()
            try:
                self._feed_unfed(unfed)
                self._evaluate(record.step)
            finally:
                self.evaluate_seconds += self._clock() - start
            due = detector.next_due_step()
        elif len(unfed) >= _UNFED_MAX:
            self._feed_unfed(unfed)
        # The next scan: every ``_scan_interval`` steps, and at every evaluation, so the culprit
        # search samples tensors and chain roots of that very step (an EMA's root is new each step).
        evaluation_at = total + max(1, due - record.step)
        self._next_scan_total = min(self._last_scan_total + self._scan_interval, evaluation_at)

    def _feed_unfed(self, unfed: list[tuple[StepRecord, int]]) -> None:
        try:
            for record, samples in unfed:
                self._feed(record, samples)
        finally:
            unfed.clear()

    def on_eve(self) -> None:
        """The step before a sampled one: if that one will scan, mark where its graphs begin."""
        agent = self._agent
        if self._chains is not None and agent is not None and agent.steps_total + 1 >= self._next_scan_total:
            self._chains.mark_step(agent.current_step)

    def _scanned(self, seconds: float) -> None:
        """Space the next scan so scans and evaluations together keep to their share of the budget
        (``budget.Part.LEAK_CHECKS``) at this step time, within ``SCAN_EVERY`` .. ``SCAN_EVERY_MAX``
        steps. Evaluations run on their own cadence (``leak_check_every_steps``), so the scans get the
        share less what the evaluations took so far, at least half of it."""
        self.scan_seconds += seconds
        cost = self._scan_cost = seconds if self._scan_cost is None else 0.8 * self._scan_cost + 0.2 * seconds
        assert self._agent is not None
        config = self._options
        longest = max(1, min(SCAN_EVERY_MAX, config.leak_window_steps // 10))  # 10 points per window
        interval = SCAN_EVERY
        step_seconds = self._agent.seconds_per_step  # typical step time: pauses between steps do not count
        if step_seconds:
            allowed = budget.share(config.overhead_budget, budget.Part.LEAK_CHECKS)
            steps = max(1, self._agent.steps_total)
            evaluations = (self.evaluate_seconds - self.host_look_seconds) / steps / step_seconds
            interval = budget.steps_between(cost, max(allowed / 2, allowed - evaluations), step_seconds)
        self._scan_interval = max(min(SCAN_EVERY, longest), min(longest, interval))

    def _observe(self, spec: SeriesSpec, step: int, value: float, phase: str) -> None:
        assert self._detector is not None
        if spec.name not in self._known:
            self._known.add(spec.name)
            self._detector.add_series(spec)
        self._detector.observe(spec.name, step, value, phase)

    def _feed(self, record: StepRecord, samples: int) -> None:
        """Feed one record's series (``samples``: the agent's records made when it was)."""
        step, phase = record.step, record.phase
        nvml = {n.device: n for n in record.nvml} if record.allocator else {}
        for a in record.allocator:
            d = a.device
            if a.allocated_bytes is not None:
                self._observe(_spec(f"allocated_bytes{{device={d}}}", "tensor_leak", d, explained_by=(
                    f"long_lived_bytes{{device=cuda:{d}}}", f"tensors{{device=cuda:{d},*")), step,
                              a.allocated_bytes, phase)
            if a.inactive_split_bytes is not None:
                # Fragmentation is what empty_cache() cannot release: inactive split blocks. Reserved −
                # allocated also holds whole cached segments, which the allocator frees and retries
                # with before any OOM: their growth is a cache, not fragmentation.
                self._observe(_spec(f"inactive_split_bytes{{device={d}}}", "fragmentation", d),
                              step, a.inactive_split_bytes, phase)
            n = nvml.get(d)
            # This process's own use only: the device's total use would count other processes (and,
            # under torchrun, the other ranks) as this job's non-PyTorch growth.
            if n is not None and a.reserved_bytes is not None and n.process_used_bytes is not None:
                self._observe(_spec(f"non_pytorch_bytes{{device={d}}}", "non_pytorch", d), step,
                              n.process_used_bytes - a.reserved_bytes, phase)
        duration = record.duration_s
        if duration is not None and duration > 0:
            avg = self._seconds_per_step  # the mean step time, pauses included: time-to-OOM projections
            self._seconds_per_step = duration if avg is None else 0.98 * avg + 0.02 * duration
        host = record.host
        if host is not None:
            # The agent's own step history grows until the ring buffer is full: not the job's memory.
            self._observe(self._host_spec, step, host.rss_bytes - self._own_bytes(record, samples), phase)

    def _own_bytes(self, record: StepRecord, samples: int) -> float:
        if self._own_record_bytes is None:
            self._own_record_bytes = float(_deep_size(record))
        return self._own_record_bytes * min(samples, self._options.history_steps)

    def _feed_counts(self, record: StepRecord) -> None:
        """Scan for long-lived tensors and feed the count series (every ``_scan_interval`` steps).

        A tensor is counted at the first scan it outlives whole, so every tensor counted now already
        existed at the previous scan: the counts are observed at that scan's step, which keeps a
        leak's onset where it began rather than one scan interval later."""
        tracker = self._tracker
        tracker.scan()
        step = self._previous_scan_step if self._previous_scan_step is not None else record.step
        self._previous_scan_step = record.step
        _, by_device = tracker.total()
        for device, nbytes in by_device.items():
            self._observe(_spec(f"long_lived_bytes{{device={device}}}", "tensor_leak", cuda_index(device),
                                sparse=True, alarm=False), step, nbytes, record.phase)
        self._observe_groups(self._count_specs, step, record.phase,
                             [(g.key, g.count, functools.partial(_tensor_spec, g)) for g in tracker.groups()])
        if self._chains is not None:
            self._feed_chains(record)

    def _feed_chains(self, record: StepRecord) -> None:
        """Follow autograd graphs chained across steps and feed their node counts."""
        roots = self._chain_roots()
        try:
            self._chains.scan(roots)
        finally:
            roots.clear()
        self._observe_groups(self._chain_specs, record.step, record.phase,
                             [(g.key, g.nodes, functools.partial(_chain_spec, g)) for g in self._chains.groups()])

    def _chain_roots(self) -> list[Any]:
        """Tensors a chain may end in: new ones with a ``grad_fn`` and long-lived ones (in-place
        accumulators). Strong references: the caller drops the list soon."""
        from gpumemd.probes.graph_chains import MAX_ROOTS

        tracker = self._tracker
        roots: list[Any] = tracker.new_graph_roots(MAX_ROOTS)
        seen = {id(t) for t in roots}
        roots.extend(t for t in tracker.long_lived_graph_samples(MAX_ROOTS) if id(t) not in seen)
        return roots

    def _observe_groups(self, specs: dict[Any, SeriesSpec], step: int, phase: str,
                        groups: list[tuple[Any, int, Callable[[], SeriesSpec]]]) -> None:
        """Feed one count series per group (key, count, how to make its spec): a group gets a series
        once it reaches ``_COUNT_MIN`` (``MAX_COUNT_SERIES`` at most), and with it the counts it had
        at the earlier scans (kept per family, bounded), so its history starts where the group did,
        not where it crossed the threshold; a watched group that is gone (all its tensors died, its
        chain ended) drops to 0."""
        history = self._count_history.setdefault(id(specs), collections.deque(maxlen=_COUNT_HISTORY))
        present: dict[Any, int] = {}
        for key, count, make_spec in groups:
            present[key] = count
            spec = specs.get(key)
            if spec is None:
                if count < _COUNT_MIN or len(specs) >= MAX_COUNT_SERIES:
                    continue
                spec = specs[key] = make_spec()
                for earlier, counts in history:  # what this group counted at the scans before
                    if earlier < step:
                        self._observe(spec, earlier, counts.get(key, 0), phase)
            self._observe(spec, step, count, phase)
        for key, spec in specs.items():
            if key not in present:
                self._observe(spec, step, 0, phase)
        history.append((step, present))

    def _min_slopes(self) -> dict[str, float]:
        """Per series, the growth per step that matters: what would exhaust the headroom it draws on
        within ``leak_horizon_hours`` at the measured step rate, never below its noise floor (or the
        fixed effect size the user set)."""
        assert self._agent is not None and self._detector is not None
        c = self._options
        horizon_steps = None
        if self._seconds_per_step:
            horizon_steps = c.leak_horizon_hours * 3600 / self._seconds_per_step
        out: dict[str, float] = {}
        for spec in self._detector.series():
            if spec.unit != "bytes":
                out[spec.name] = COUNT_FLOOR
                continue
            family = _family(spec.name)
            fixed = c.leak_host_min_bytes_per_step if family == "host" else c.leak_min_bytes_per_step
            if fixed is not None:
                out[spec.name] = float(fixed)
                continue
            floor = NOISE_FLOOR_BYTES.get(family, NOISE_FLOOR_BYTES["allocated"])
            if family == "host":
                floor = max(floor, RSS_BURST_BYTES / c.leak_window_steps)
            headroom = self._headroom(spec)
            material = headroom / horizon_steps if headroom is not None and horizon_steps else 0.0
            out[spec.name] = max(floor, material)
        return out

    def _feed_census(self, census: Census, record: StepRecord) -> None:
        step = census.step if census.step is not None else record.step
        cuda_devices = {a.device for a in record.allocator if a.allocated_bytes is not None}
        for dev, nbytes in census.bytes_by_device().items():
            index = cuda_index(dev)
            # On CUDA the allocator's step-end bytes are the alarm; the census only attributes.
            # CPU tensors are watched by the count series and host RSS; the census attributes.
            alarm = False if index is None else index not in cuda_devices
            self._observe(_spec(f"census_bytes{{device={dev}}}", "tensor_leak", index, sparse=True, alarm=alarm),
                          step, nbytes, record.phase)
        for dev, nbytes in census.invisible_bytes_by_device.items():
            self._observe(_spec(f"invisible_bytes{{device={dev}}}", "graph_leak", cuda_index(dev), sparse=True,
                                alarm=False), step, nbytes, record.phase)

    # --- evaluation ----------------------------------------------------------------------------

    def _evaluate(self, step: int) -> None:
        assert self._detector is not None and self._agent is not None
        statuses = self._detector.evaluate(step, self._min_slopes())
        if any(name == self._host_spec.name for name, _ in self._detector.rising) and not self._counts_active():
            self._host_look(step)
        if not statuses:
            return
        for status in statuses:
            key = (status.spec.name, status.phase)
            active = status.state is not None and status.state.active
            if active and (status.changed or self._retry_culprits(key, step)):
                self._attempts[key] = step
                self._culprits[key] = self._find_culprits(status)
        # Tensors that only an autograd graph keeps (saved inputs whose wrapper torch preserved) grow
        # with the graph tensors a Python container holds: one leak, reported once, by the latter.
        held_graphs = any(e.kind == "graph_leak" and not e.graph_kept and key in self._findings_or(statuses)
                          for key, e in self._culprits.items())
        # ... or by a graph chain (``total += loss`` without backward keeps each step's saved tensors):
        # the chain is the cause, and it is reported by its own series, rising now or active.
        chains = {spec.name for spec in self._chain_specs.values()}
        held_graphs = held_graphs or any(name in chains for name, _ in self._detector.rising) or any(
            f.series in chains and f.state != "cleared" for f in self._findings.values())
        for status in statuses:
            key = (status.spec.name, status.phase)
            active = status.state is not None and status.state.active
            evidence = self._culprits.get(key, _NO_EVIDENCE)
            if (evidence.graph_kept and held_graphs) or evidence.garbage:
                if status.changed:
                    log.debug("gpumemd: %s grows, but %s", status.spec.name, "cyclic garbage the collector will free"
                              if evidence.garbage else "it is kept by a graph already reported")
                continue
            if not active and status.verdict.reason.startswith("explained"):
                # The growth goes on, as another series' finding: withdraw this one, never say it stopped.
                self._findings.pop(key, None)
                self._culprits.pop(key, None)
                if status.changed:
                    log.info("gpumemd: %s growth is %s; reported there", status.spec.name, status.verdict.reason)
                continue
            dated = status
            if evidence.onset_step is not None and status.onset_step is not None:
                dated = dataclasses.replace(status, onset_step=min(status.onset_step, evidence.onset_step))
            finding = build_finding(
                dated, kind=self._kind(status, evidence), culprits=evidence.culprits if active else (),
                culprit_steps=evidence.steps, headroom_bytes=self._headroom(status.spec), sites=evidence.sites,
                bytes_per_unit=evidence.bytes_per_unit, seconds_per_step=self._seconds_per_step,
                holder_sentence=evidence.sentence, per_step=self._stated_rate(dated),
                culprits_step=self._attempts.get(key),
            )
            self._findings[key] = finding
            if status.changed:
                self._report(finding)
            if not active:
                self._culprits.pop(key, None)
        self._agent.publish(findings=tuple(self._findings.values()))

    def _stated_rate(self, status: TrackStatus) -> float:
        """The growth per step a finding states. For a count series, the slope since its onset: the
        window's slope mixes in the flat steps before it (one tensor per step read "+0.91/step")."""
        slope = status.verdict.slope.slope
        if status.spec.unit == "bytes" or status.onset_step is None or self._detector is None:
            return slope
        since = self._detector.slope_since(status.spec.name, status.phase, status.onset_step)
        return since if since is not None and since > 0 else slope

    def _findings_or(self, statuses: list[TrackStatus]) -> set[tuple[str, str]]:
        """Keys of the findings that are active now or in this evaluation."""
        keys = {k for k, f in self._findings.items() if f.state != "cleared"}
        keys.update((s.spec.name, s.phase) for s in statuses if s.state is not None and s.state.active)
        return keys

    def _counts_active(self) -> bool:
        """A count series is reporting, or rising: host RSS growth is most likely those tensors, so
        the heap scans that look for other culprits are not worth their cost."""
        assert self._detector is not None
        names = {spec.name for spec in (*self._count_specs.values(), *self._chain_specs.values())}
        if any(name in names for name, _ in self._detector.rising):
            return True
        return any(f.series in names and f.state != "cleared" for f in self._findings.values())

    def _retry_culprits(self, key: tuple[str, str], step: int) -> bool:
        """No culprit yet: look again, but at most once per window (each look scans the heap or takes
        a census, which must not happen every check of a finding that lasts for days)."""
        entry = self._culprits.get(key)
        if entry is not None and entry.culprits:
            return False
        assert self._agent is not None
        last = self._attempts.get(key)
        return last is None or step - last >= self._options.leak_window_steps // 2

    def _kind(self, status: TrackStatus, evidence: _Evidence) -> str:
        previous = self._findings.get((status.spec.name, status.phase))
        if status.state is LeakState.CLEARED and previous is not None:
            return previous.kind
        kind = evidence.kind if evidence.kind is not None else refine_kind(status.spec.kind, evidence.culprits)
        if kind == "tensor_leak" and status.spec.device is not None and self._detector is not None:
            # allocated bytes that the census cannot see growing as fast: autograd-saved tensors
            invisible = self._detector.slope_since(
                f"invisible_bytes{{device=cuda:{status.spec.device}}}", status.phase, status.window_start)
            if invisible is not None and invisible >= 0.5 * status.verdict.slope.slope:
                kind = "graph_leak"
        return kind

    def _headroom(self, spec: SeriesSpec) -> float | None:
        assert self._agent is not None
        if spec.device is None:
            # Host RAM available is the sampler's figure: a step's host sample carries the published
            # one, so the published state has it without building a state at every evaluation.
            host = self._agent.published.host
            return float(host.available_bytes) if host is not None and host.available_bytes is not None else None
        state = self._agent.state()
        nv = next((n for n in state.nvml if n.device == spec.device), None)
        a = next((s for s in state.allocator if s.device == spec.device), None)
        # What the allocator may still reserve: the driver's free memory, and under a per-process cap
        # (set_per_process_memory_fraction) no more than cap − reserved, however much the device has.
        reserved, cap = (a.reserved_bytes, a.cap_bytes) if a is not None else (None, None)
        reservable = reservable_bytes(nv.free_bytes if nv is not None else None, reserved, cap)
        if reservable is None:
            return None
        cached = 0
        if a is not None and a.reserved_bytes is not None:
            in_use = a.allocated_peak_bytes if a.allocated_peak_bytes is not None else a.allocated_bytes
            cached = max(0, a.reserved_bytes - (in_use or 0))
        # ... plus what the allocator caches beyond the step's peak
        return float(reservable + cached)

    # --- culprits ------------------------------------------------------------------------------

    def _find_culprits(self, status: TrackStatus) -> _Evidence:
        kind = status.spec.kind
        if kind == "host_leak":
            return self._host_culprits(status)
        if status.spec.unit == "tensors":
            return self._count_culprits(status)
        if status.spec.unit == "nodes":
            return self._chain_culprits(status)
        if kind in ("tensor_leak", "graph_leak"):
            return self._census_culprits(status)
        return _NO_EVIDENCE

    def _count_culprits(self, status: TrackStatus) -> _Evidence:
        """Who holds the tensors of a growing count series: a sample of the group, looked up now (so
        the container's size is the one when the sentence is written), and what one of them costs."""
        key = next((k for k, spec in self._count_specs.items() if spec is status.spec), None)
        tracker = self._tracker
        if key is None or tracker is None:
            return _NO_EVIDENCE
        group = next((g for g in tracker.groups() if g.key == key), None)
        sample = tracker.sample(key)
        holder = None
        graph_bytes = graph_nodes = 0
        graph_kept = False
        garbage = sample is None  # every tensor of the group died since the scan: nothing to blame
        try:
            if sample is not None:
                cycle = cycle_holder(sample)
                # Cyclic garbage while the collector runs is freed at its next collection (a burst),
                # not leaked; with gc disabled nothing will ever free it: that is the leak.
                garbage = cycle is not None and gc.isenabled() and gc.get_threshold()[0] > 0
                holder = cycle or who_holds(sample, time_budget_s=HOLDER_BUDGET_S, ignore=(self._count_specs,))
                if holder is None:
                    # Alive with no Python referrer: C++ keeps it, i.e. an autograd graph saved it
                    # (torch preserves the Python wrapper of saved tensors). Name the root of the
                    # largest live graph and its holder.
                    from gpumemd.probes.host_objects import growing_graph

                    root = growing_graph(0, min_added=1)
                    if root is not None and root.holder is not None:
                        graph_kept = True
                        holder = (f"the autograd graph ({root.nodes:,} nodes) of {root.description}, "
                                  f"held by {root.holder}")
                if status.spec.kind == "graph_leak":
                    from gpumemd.probes.host_objects import graph_size, saved_bytes

                    graph_bytes = saved_bytes(sample)
                    if not graph_bytes:  # backward() freed them: the nodes are what it keeps
                        graph_nodes = graph_size(sample, max_nodes=_GRAPH_NODES_MAX)
        finally:
            del sample
        own = group.nbytes / group.count if group is not None and group.count else 0.0
        per_tensor = own + graph_bytes
        desc = group.describe() if group is not None else status.spec.name
        sentence = count_sentence(self._stated_rate(status), desc, own, graph_bytes, holder, graph_nodes=graph_nodes)
        # a graph leak when what one tensor keeps is mostly its graph: saved tensors, or (freed by
        # backward()) a graph of its own nodes, which cost host memory per node
        graphy = graph_kept or (status.spec.kind == "graph_leak"
                                and (graph_bytes >= own or graph_nodes >= _GRAPH_NODES_KEPT))
        kind = "graph_leak" if graphy else "tensor_leak"
        culprit = Culprit(description=desc, count_delta=round(status.growth_bytes),
                          bytes_delta=round(status.growth_bytes * own), holder=holder,
                          graph_bytes_delta=round(status.growth_bytes * graph_bytes),
                          category="graph" if group is not None and group.graph else "other")
        return _Evidence((culprit,), status.step - (status.onset_step or status.step), (), kind,
                         bytes_per_unit=max(per_tensor, 1.0), sentence=sentence, graph_kept=graph_kept,
                         garbage=garbage)

    def _chain_culprits(self, status: TrackStatus) -> _Evidence:
        """Who holds the newest tensor of a growing graph chain, how large the graph it reaches is,
        and what its saved tensors cost (zero once backward() freed them: the nodes alone grow)."""
        from gpumemd.analysis.leak_wording import chain_sentence
        from gpumemd.probes.host_objects import graph_size, saved_bytes
        key = next((k for k, spec in self._chain_specs.items() if spec is status.spec), None)
        chains = self._chains
        sample = chains.sample(key) if key is not None and chains is not None else None
        if sample is None:
            return _NO_EVIDENCE
        try:
            holder = who_holds(sample, time_budget_s=HOLDER_BUDGET_S, ignore=(self._chain_specs,))
            nodes = graph_size(sample)
            saved = saved_bytes(sample)
        finally:
            del sample
        per_step = status.verdict.slope.slope
        since = status.onset_step if status.onset_step is not None else status.window_start
        saved_per_step = saved / max(1.0, status.step - since)
        desc = key[1] + "[" + ", ".join(str(d) for d in key[2]) + "]" if key is not None else status.spec.name
        sentence = chain_sentence(desc, nodes, saved_per_step, holder)
        culprit = Culprit(description=f"{desc} with grad_fn (autograd graph of {nodes:,} nodes)",
                          count_delta=round(status.growth_bytes), bytes_delta=0, holder=holder,
                          graph_bytes_delta=round(saved_per_step * (status.step - since)), category="graph",
                          noun="autograd node")
        # What a node itself costs is not measurable from Python: bytes (and a time to OOM) only
        # when the chain also keeps saved tensors worth a noise floor.
        material = saved_per_step >= NOISE_FLOOR_BYTES["census"] and per_step > 0
        began = self._chain_began_at(key)
        return _Evidence((culprit,), status.step - since, (), "graph_leak",
                         bytes_per_unit=saved_per_step / per_step if material else 0.0, sentence=sentence,
                         onset_step=began)

    def _chain_began_at(self, key: Any) -> int | None:
        if self._chains is None:
            return None
        return next((g.began_at for g in self._chains.groups() if g.key == key), None)

    def _census_culprits(self, status: TrackStatus) -> _Evidence:
        assert self._agent is not None
        censuses = self._census
        now = self._agent.state().census
        stale = now is None or now.step is None or status.step - now.step > self._options.leak_check_every_steps
        if stale and censuses is not None:
            now = censuses.take_now()
        earlier = censuses.at_or_after(int(status.window_start)) if censuses is not None else None
        if earlier is None or earlier is now:
            # No census inside the window (a slow cadence on a big heap): the newest one before it.
            older = [c for c in (censuses.history() if censuses is not None else [])
                     if c is not now and c.step is not None]
            earlier = older[-1] if older else earlier
        sites = self._sites(status)
        if now is None or earlier is None or earlier is now or now.step is None or earlier.step is None:
            return _Evidence(sites=sites)
        device = CPU if status.spec.device is None else cuda_device(status.spec.device)
        deltas = [d for d in now.diff(earlier) if d.device == device]
        culprits = list(culprits_from_diff(deltas))
        kind = refine_kind(status.spec.kind, culprits) if culprits else None  # before holders are named
        if culprits and culprits[0].holder is None:
            culprits[0] = self._name_holder(culprits[0], deltas)
        return _Evidence(tuple(culprits), float(now.step - earlier.step), sites, kind)

    def _name_holder(self, culprit: Culprit, deltas: list[GroupDelta]) -> Culprit:
        """The census looks up holders only for groups whose count grew; name the others here."""
        if culprit.category == "graph":
            # Tensors with a grad_fn that nothing in Python holds are kept by an autograd graph:
            # name the tensor at the root of the largest live graph and who holds it.
            from gpumemd.probes.host_objects import growing_graph

            root = growing_graph(0, min_added=1)
            if root is not None and root.holder is not None:
                return dataclasses.replace(
                    culprit, holder=f"the autograd graph ({root.nodes:,} nodes) of {root.description}, "
                                    f"held by {root.holder}")
        top = next((d for d in deltas if describe_matches(d, culprit)), None)
        holder = holder_of_group(top.key) if top is not None else None
        return dataclasses.replace(culprit, holder=holder) if holder is not None else culprit

    def _host_look(self, step: int, *, force: bool = False) -> None:
        """First look for a host leak's culprit: container sizes and the largest autograd graph, taken
        while host RSS is rising (two heap scans: 0.1-0.3 s on a big heap). At most once per two
        windows, and, unless ``force`` (a state change), within its share of the overhead budget
        (``budget.Part.HOST_LOOKS``) of the job's step time since the last look: RSS rises while a
        healthy job warms up, and a look every 1,000 steps of 1 ms would cost a quarter of the job.
        Step time, not wall time, as every budgeted part: a pause between steps (an eval loop, a
        checkpoint) does not make looks more frequent. The first look is not waited for: it is the
        baseline that lets a host leak's culprit be named when the leak is first suspected, and it
        comes in the job's first thousand steps, where RSS rises as heaps warm up (a one-time cost,
        like the first census: ``bench_step_overhead.py`` reports both as start-up)."""
        from gpumemd.probes.host_objects import container_lengths, largest_graph_nodes

        agent = self._agent
        assert agent is not None
        config = self._options
        if self._host_baseline is not None and step - self._host_baseline[0] < 2 * config.leak_window_steps:
            return
        if not force and self._host_look_at is not None:
            job_seconds = (agent.steps_total - self._host_look_at) * (agent.seconds_per_step or 0.0)
            if job_seconds * budget.share(config.overhead_budget, budget.Part.HOST_LOOKS) < self._host_look_cost:
                return  # the job has not yet paid for the last look within this share of the budget
        started = self._clock()
        self._host_baseline = (step, container_lengths(), largest_graph_nodes())
        self._host_look_at = agent.steps_total
        self._host_look_cost = self._clock() - started
        self.host_look_seconds += self._host_look_cost

    def _host_culprits(self, status: TrackStatus) -> _Evidence:
        from gpumemd.probes.host_objects import growing_containers, growing_graph

        # CPU tensors first: when a census taken now shows tensor/graph bytes growing at least half as
        # fast as RSS, the host leak is theirs, and the census diff names them and who holds them.
        census = self._census_culprits(status)
        if census.culprits and census.steps > 0:
            # The census interval may start before the onset: compare what the census saw grow with
            # what RSS gained over the part of that interval where the leak ran.
            in_census = sum(max(0, c.bytes_delta) + max(0, c.graph_bytes_delta) for c in census.culprits)
            since = status.onset_step if status.onset_step is not None else status.window_start
            leak_steps = min(census.steps, max(1.0, status.step - since))
            if in_census >= 0.5 * status.verdict.slope.slope * leak_steps:
                return dataclasses.replace(census, kind=refine_kind("tensor_leak", census.culprits), steps=leak_steps)
        baseline = self._host_baseline
        if baseline is None or baseline[0] >= status.step:
            self._host_baseline = None
            self._host_look(status.step, force=True)  # the next evaluation can compare
            return _NO_EVIDENCE
        since, lengths, graph_nodes = baseline
        steps = float(status.step - since)
        growth = status.verdict.slope.slope * steps  # what the host gained meanwhile
        grown = growing_containers(lengths, ignore=self._detector.buffer_ids() if self._detector else set())
        contained = sum(g.approx_bytes for g in grown)
        graph = growing_graph(graph_nodes, min_added=max(1, int(steps) // 2))
        if graph is not None and contained < 0.5 * growth:
            # Nothing Python-visible grew enough, but one autograd graph gains nodes every step.
            culprit = Culprit(description=f"{graph.description} (graph of {graph.nodes:,} autograd nodes, "
                              f"+{graph.nodes_added / max(steps, 1):.0f}/step)", count_delta=0, bytes_delta=0,
                              holder=graph.holder, graph_bytes_delta=int(growth))
            return _Evidence((culprit,), steps, (), "graph_leak")
        if not grown:
            self._host_baseline = None
            self._host_look(status.step, force=True)
            return _NO_EVIDENCE
        culprits = tuple(
            Culprit(description=f"{g.item_type} objects in a {g.type_name} of {g.length:,} items",
                    count_delta=g.items_added, bytes_delta=g.approx_bytes, holder=g.holder,
                    noun=f"{g.item_type} object")
            for g in grown
        )
        # RSS lags a leak (freed heap is reused first); the container dates it: its length at the
        # rate it grew says when it started growing.
        top = grown[0]
        onset: int | None = None
        if top.items_added > 0 and steps > 0:
            onset = int(status.step - top.length * steps / top.items_added)
        return _Evidence(culprits, steps, onset_step=onset)

    def _sites(self, status: TrackStatus) -> tuple[str, ...]:
        """CUDA allocation sites that grew since the leak was suspected (with allocation history)."""
        assert self._agent is not None
        d = status.spec.device
        if d is None:
            return ()
        config = self._options
        named = self._named_sites.get(d)
        if named is not None and status.state is LeakState.CONFIRMED:
            return named  # named at confirmation, when recording went off
        if status.state is LeakState.SUSPECTED and status.changed:
            self._named_sites.pop(d, None)
            history_on = config.record_history or self._history_enabled_by_us or (
                self._history.enabled_by_the_job()) or (
                config.leak_history_on_suspect and self._enable_history(config.history_max_entries))
            if not history_on:
                return ()
            snap = self._snapshot()
            if snap is not None:
                self._sites_before[d] = (status.step, live_by_site(snap, d, internal=internal_dirs()))
            return ()
        before = self._sites_before.get(d)
        snap = self._snapshot() if before is not None else None
        if before is None or snap is None:
            return ()
        grown = diff_sites(before[1], live_by_site(snap, d, internal=internal_dirs()), limit=3)
        sites = tuple(site_sentence(g, status.step - before[0]) for g in grown)
        if status.state is LeakState.CONFIRMED:
            self._named_sites[d] = sites
            # Decided: the sites are named. Recording on costs ~2 µs per allocation for the rest of a
            # week-long job, so it goes off now (if it was ours: a job's own recording stays on).
            self._sites_before.pop(d, None)
            self._release_history()
        return sites

    def _enable_history(self, max_entries: int) -> bool:
        if not self._history.acquire(_HISTORY_USER, max_entries):
            return False
        self._history_enabled_by_us = True
        return True

    def _release_history(self) -> None:
        if self._history_enabled_by_us:
            self._history_enabled_by_us = False
            self._history.release(_HISTORY_USER)

    def _snapshot(self) -> Mapping[str, Any] | Sequence[Any] | None:
        """The allocator's segments with their blocks' stacks, without the trace ring buffer: the
        full ``_snapshot()`` would build every trace entry (up to ``history_max_entries``) as Python
        objects on the training thread, and allocation sites need only the live blocks."""
        try:
            if self._snapshot_fn is not None:
                return self._snapshot_fn()
            import torch

            memory_snapshot = torch.cuda.memory.memory_snapshot
            if "include_traces" in inspect.signature(memory_snapshot).parameters:
                return memory_snapshot(include_traces=False)
            return torch.cuda.memory._snapshot()
        except (RuntimeError, AttributeError) as exc:
            log.info("gpumemd: no CUDA snapshot for allocation sites (%s)", exc)
            return None

    # --- surfaces ------------------------------------------------------------------------------

    def _report(self, finding: Finding) -> None:
        log.warning("gpumemd: %s", finding.summary)
        from gpumemd.files import append_line

        path = self.findings_path
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            line = json.dumps({"time": self._wall(), **_jsonable(dataclasses.asdict(finding))}, sort_keys=True)
            append_line(path, line)
            self._append_failed = False
        except OSError as exc:
            if not self._append_failed:  # said once until a write succeeds again
                log.warning("gpumemd: could not append to %s (%s); findings stay in the agent state", path, exc)
            self._append_failed = True


@dataclasses.dataclass(frozen=True, slots=True)
class _Evidence:
    """What the component found behind one finding: culprits over ``steps``, CUDA sites, and a kind
    when the evidence decides it (a growing autograd graph behind host growth is a graph leak)."""

    culprits: tuple[Culprit, ...] = ()
    steps: float = 0.0
    sites: tuple[str, ...] = ()
    kind: str | None = None
    bytes_per_unit: float = 1.0  # count series: bytes one tensor costs (its storage and its graph)
    sentence: str | None = None  # count series: the culprit sentence, written from the tensors
    graph_kept: bool = False  # count series: no Python holder; an autograd graph keeps them
    garbage: bool = False  # count series: unreachable cycles the (enabled) collector will free
    onset_step: int | None = None  # when the evidence dates the start (a container's length / its rate)


_NO_EVIDENCE = _Evidence()
_SPECS: dict[tuple[str, bool, bool], SeriesSpec] = {}


def _family(name: str) -> str:
    """The noise-floor family of a series name."""
    if name.startswith("host_"):
        return "host"
    if name.startswith("inactive_split"):
        return "fragmentation"
    if name.startswith("non_pytorch"):
        return "non_pytorch"
    if name.startswith(("census", "invisible", "long_lived")):
        return "census"
    return "allocated"


def _deep_size(obj: Any, depth: int = 4) -> int:
    """Sys.getsizeof of an object and what its fields and tuples hold (bounded depth): the memory
    one step record costs in the agent's ring buffer."""
    import sys

    size = sys.getsizeof(obj)
    if depth <= 0:
        return size
    if isinstance(obj, (tuple, list)):
        return size + sum(_deep_size(v, depth - 1) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return size + sum(_deep_size(getattr(obj, f.name), depth - 1) for f in dataclasses.fields(obj))
    return size


def _spec(name: str, kind: str, device: int | None, *, sparse: bool = False, alarm: bool = True,
          explained_by: tuple[str, ...] = ()) -> SeriesSpec:
    # Specs are immutable and few: cache them so the per-step path builds nothing.
    key = (name, sparse, alarm)
    spec = _SPECS.get(key)
    if spec is None:
        spec = SeriesSpec(name, kind, device, sparse=sparse, alarm=alarm, explained_by=explained_by)
        if len(_SPECS) < 1024:
            _SPECS[key] = spec
    return spec


def _tensor_spec(group: Any) -> SeriesSpec:
    """The count series of a survivor group (``probes.survivors.SurvivorGroup``)."""
    return SeriesSpec(f"tensors{{device={group.device},group={group.describe()}}}",
                      "graph_leak" if group.graph else "tensor_leak", cuda_index(group.device), sparse=True,
                      unit="tensors")


def _chain_spec(group: Any) -> SeriesSpec:
    """The node-count series of a graph-chain group (``probes.graph_chains.ChainGroup``)."""
    return SeriesSpec(f"graph_nodes{{device={group.device},group={group.describe()}}}", "graph_leak",
                      cuda_index(group.device), sparse=True, unit="nodes")


def describe_matches(delta: GroupDelta, culprit: Culprit) -> bool:
    return delta.bytes_delta == culprit.bytes_delta and delta.graph_bytes_delta == culprit.graph_bytes_delta


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
