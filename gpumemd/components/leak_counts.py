"""The count series: what a survivor scan feeds the leak detector (the per-scan series of
``leak_series``): one series per tensor group and per graph chain once it reaches ``_COUNT_MIN``, started
with the counts it had at the earlier scans; the long-lived bytes per device; the bytes of each growing
tensor family. Once the tracker is capped the count series are held, never fed again.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

from gpumemd.components.leak_specs import chain_spec, family_spec, measure_spec, tensor_spec
from gpumemd.probes.survival.graph_chains import MAX_ROOTS
from gpumemd.probes.survival.survivor_counts import SurvivorGroup

if TYPE_CHECKING:
    import torch

    from gpumemd.analysis.leak_detector import LeakDetector, SeriesSpec
    from gpumemd.probes.survival.graph_chains import ChainKey, GraphChainTracker
    from gpumemd.probes.survival.survivor_counts import GroupKey
    from gpumemd.probes.survival.survivors import SurvivorTracker
    from gpumemd.probes.survival.tensor_families import FamilyKey, TensorFamilies
    from gpumemd.records.findings import Culprit
    from gpumemd.records.step import StepRecord

MAX_COUNT_SERIES = 16
"""Tensor groups watched as count series at most (the first that reach ``_COUNT_MIN`` tensors)."""

_COUNT_MIN = 8

_COUNT_PAST = 64
"""Scans whose group counts are kept (per family) to start a new count series with its past: 64
scans span 640 to 3,200 steps, more than a detection window."""

K = TypeVar("K", bound=Hashable)

log = logging.getLogger("gpumemd")


class GroupSeries(Generic[K]):
    """The count series of one family of groups (survivor groups, graph chains): a spec per watched
    group, and the counts of every group at the last scans (bounded), to start a new series with its past."""

    def __init__(self) -> None:
        self.specs: dict[K, SeriesSpec] = {}
        self.count_past: collections.deque[tuple[int, dict[K, int]]] = collections.deque(maxlen=_COUNT_PAST)

    def key_of(self, spec: SeriesSpec) -> K | None:
        return next((k for k, s in self.specs.items() if s is spec), None)

    def names(self) -> set[str]:
        return {spec.name for spec in self.specs.values()}


class CountFeeding:
    """The scan's part of ``LeakSeries`` (its ``scans``): fed at each survivor scan, it observes into the
    series' detector through ``observe`` (``LeakSeries._observe``, which adds a new series first)."""

    def __init__(self, detector: LeakDetector, observe: Callable[[SeriesSpec, int, float, str], None], *,
                 tracker: SurvivorTracker | None, chains: GraphChainTracker | None,
                 families: TensorFamilies | None) -> None:
        self.detector = detector
        self._observe = observe
        self._tracker = tracker
        self._chains = chains
        self.families = families
        self.counts: GroupSeries[GroupKey] = GroupSeries()
        self.grown: GroupSeries[FamilyKey] = GroupSeries()  # growing tensors' byte series, per family
        self.chain_nodes: GroupSeries[ChainKey] = GroupSeries()
        self._previous_scan_step: int | None = None
        self._capped = False  # the tracker hit its cap: the count series are held (see _hold_counts)
        self._long_lived: set[str] = set()  # names of the long-lived bytes series (one per device)
        self.found = True
        """The last scan counted a new long-lived tensor, followed a graph chain or saw a tensor family set
        a record (``leak_scans.IDLE_STRETCH``: scans that find nothing may space out)."""
        self._family_records = 0

    def feed_counts(self, record: StepRecord, *, keyed_at_most: int | None = None) -> None:
        """Scan for long-lived tensors and feed the count series (every scan interval); past
        ``keyed_at_most`` candidates, a sample of them is counted (``SurvivorTracker.scan``).

        A tensor is counted at the first scan it outlives whole, so every tensor counted now already
        existed at the previous scan: the counts are observed at that scan's step, which keeps a
        leak's onset where it began rather than one scan interval later."""
        tracker = self._tracker
        if tracker is None:
            return
        tracker.scan(keyed_at_most=keyed_at_most)
        step = self._previous_scan_step if self._previous_scan_step is not None else record.step
        self._previous_scan_step = record.step
        if tracker.counts.capped:
            self._hold_counts(tracker)
        else:
            self._feed_tensor_counts(tracker, step, record.phase)
        chained = False
        if self._chains is not None:
            chained = self._feed_chains(self._chains, tracker, record)
        records = self._family_records
        if self.families is not None:
            self._feed_families(self.families, tracker, record)
            self._family_records = self.families.records
        self.found = tracker.outlived > 0 or chained or self._family_records != records

    def _feed_families(self, families: TensorFamilies, tracker: SurvivorTracker, record: StepRecord) -> None:
        """The bytes of the largest new tensor of each family that keeps growing: one series per
        family once it is watched (``MAX_COUNT_SERIES`` at most), started with its past scans. The
        tensors are alive now, so their sizes are this step's."""
        tensors = tracker.new_tensors()
        try:
            seen = families.observe(tensors, record.step)
        finally:
            tensors.clear()
        specs = self.grown.specs
        for family in seen:
            spec = specs.get(family.key)
            if spec is None:
                if not family.watched or len(specs) >= MAX_COUNT_SERIES:
                    continue
                spec = specs[family.key] = family_spec(family)
                for earlier, rows in list(family.past)[:-1]:
                    self._observe(spec, earlier, rows * family.row_bytes, record.phase)
            self._observe(spec, record.step, family.rows * family.row_bytes, record.phase)

    def _feed_tensor_counts(self, tracker: SurvivorTracker, step: int, phase: str) -> None:
        _, by_device = tracker.counts.total()
        for device, nbytes in by_device.items():
            spec = measure_spec("long_lived_bytes", "tensor_leak", device, sparse=True, alarm=False)
            self._long_lived.add(spec.name)
            self._observe(spec, step, nbytes, phase)
        self._observe_groups(self.counts, step, phase,
                             [(g.key, g.count, functools.partial(tensor_spec, g)) for g in tracker.counts.groups()])

    def _hold_counts(self, tracker: SurvivorTracker) -> None:
        """Once the tracker is capped its counts stay flat however many tensors leak, which would read
        as a leak that stopped: the count series are held (a finding stays as it was, saying why,
        never cleared) and are fed no more. The bytes series (allocated, host RSS) still judge."""
        if self._capped:
            return
        self._capped = True
        reason = f"counting capped at {tracker.counts.max_tracked:,} long-lived tensors (a lower bound from here on)"
        for name in self.counts.names() | self._long_lived:
            self.detector.hold(name, reason)
        log.info("gpumemd: long-lived tensor %s; the count series keep their last state", reason)

    def _feed_chains(self, chains: GraphChainTracker, tracker: SurvivorTracker, record: StepRecord) -> bool:
        """Follow autograd graphs chained across steps and feed their node counts; True when there are any."""
        roots = _chain_roots(tracker)
        try:
            chains.scan(roots, record.step)
        finally:
            roots.clear()
        groups = chains.groups()
        for g in groups:  # a chain measured now had more links when found than the one it was counted as
            if g.found is not None and g.key not in self.chain_nodes.specs:
                for earlier, counts in self.chain_nodes.count_past:
                    if earlier == g.found[0] and g.key in counts:
                        counts[g.key] = g.found[1]
        self._observe_groups(self.chain_nodes, record.step, record.phase,
                             [(g.key, g.nodes, functools.partial(chain_spec, g)) for g in groups])
        return bool(groups)

    def _observe_groups(self, family: GroupSeries[K], step: int, phase: str,
                        groups: list[tuple[K, int, Callable[[], SeriesSpec]]]) -> None:
        """Feed one count series per group (key, count, how to make its spec): a group gets a series
        once it reaches ``_COUNT_MIN`` (``MAX_COUNT_SERIES`` at most), and with it the counts it had
        at the earlier scans (kept per family, bounded), so its series starts where the group did,
        not where it crossed the threshold; a watched group that is gone (all its tensors died, its
        chain ended) drops to 0."""
        specs = family.specs
        present: dict[K, int] = {}
        for key, count, make_spec in groups:
            present[key] = count
            spec = specs.get(key)
            if spec is None:
                if count < _COUNT_MIN or len(specs) >= MAX_COUNT_SERIES:
                    continue
                spec = specs[key] = make_spec()
                for earlier, counts in family.count_past:  # what this group counted at the scans before
                    if earlier < step:
                        self._observe(spec, earlier, counts.get(key, 0), phase)
            self._observe(spec, step, count, phase)
        for key, spec in specs.items():
            if key not in present:
                self._observe(spec, step, 0, phase)
        family.count_past.append((step, present))


def grown_since(counts: GroupSeries[GroupKey], culprit: Culprit, since: float) -> float:
    """The bytes a CPU census culprit grew by since ``since``: its growth over the census interval, less
    what its group, counted at the survivor scans, had gained before ``since``. A census taken long
    before host RSS rose (a fast loop's are thousands of steps apart) counted a deque(maxlen=N) of graphs
    filling, full before RSS, lagging it on a fragmented heap, crept past its level. As it was when
    the kept scans do not reach back to ``since``, or no group it describes was counted."""
    grown = max(0, culprit.bytes_delta) + max(0, culprit.graph_bytes_delta)
    before = next((c for step, c in reversed(counts.count_past) if step <= since), None)
    if culprit.count_delta <= 0 or before is None:
        return grown
    newest = counts.count_past[-1][1]
    keys = [k for k in {*before, *newest}
            if k[0] == "cpu" and SurvivorGroup(k, 0, 0).describe() == culprit.description]
    counted = sum(newest.get(k, 0) - before.get(k, 0) for k in keys)
    return min(grown, max(0, counted) * grown / culprit.count_delta) if keys else grown


def _chain_roots(tracker: SurvivorTracker) -> list[torch.Tensor]:
    """Tensors a chain may end in: new ones with a ``grad_fn`` and long-lived ones (in-place
    accumulators). Strong references: the caller drops the list soon."""
    roots: list[torch.Tensor] = tracker.new_graph_roots(MAX_ROOTS)
    seen = {id(t) for t in roots}
    roots.extend(t for t in tracker.counts.long_lived_graph_samples(MAX_ROOTS) if id(t) not in seen)
    return roots
