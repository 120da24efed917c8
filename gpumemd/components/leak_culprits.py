"""Who is behind a leak finding: the culprit search of the leak component.

Per kind of series: a count series samples one tensor of its group and asks who holds it (and what
its autograd graph keeps); a graph chain, who holds its newest root; a bytes series, the census diff
between the window's start and now with who holds the top group, plus the CUDA allocation sites; a
host leak, the CPU tensors when a census shows them growing as fast, else the Python containers or
the autograd graph that grew (``leak_host``). The search reads the series (upstream) and returns
``Evidence``, which the wording turns into a sentence; it never feeds the detector.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.analysis.census_culprits import culprits_from_diff, refine_kind
from gpumemd.analysis.culprit_sentences import (
    chain_sentence,
    count_sentence,
    growth_sentence,
    workers_holder,
    workers_noun,
    workers_sentence,
)
from gpumemd.components.leak_bounds import DequeBounds
from gpumemd.components.leak_counts import grown_since
from gpumemd.components.leak_evidence import NO_EVIDENCE, Evidence
from gpumemd.components.leak_series import NOISE_FLOOR_BYTES
from gpumemd.probes.heap import host_objects
from gpumemd.probes.heap.gc_pause import job_collector_enabled
from gpumemd.probes.heap.stepwise import Stepwise, hold_weakly
from gpumemd.probes.holding.holder_groups import holder_of_group
from gpumemd.probes.holding.holders import (
    HOLDER_BUDGET_S,
    PATH_CUT,
    cycle_holder,
    who_holds_stepwise,
)
from gpumemd.probes.process import dataloaders
from gpumemd.records.device import CPU, cuda_index
from gpumemd.records.findings import Culprit

if TYPE_CHECKING:
    import torch

    from gpumemd.analysis.leak_detector import TrackStatus
    from gpumemd.components.base import AgentView
    from gpumemd.components.census_component import CensusComponent
    from gpumemd.components.leak_host import HostLooks
    from gpumemd.components.leak_series import LeakSeries
    from gpumemd.components.leak_sites import AllocationSites
    from gpumemd.probes.survival.graph_chains import GraphChainTracker
    from gpumemd.probes.survival.survivors import SurvivorTracker
    from gpumemd.records.census import GroupDelta

_GRAPH_NODES_MAX = 5_000
"""Nodes walked at most when counting the graph one leaked tensor keeps (one look per finding)."""

CHAIN_NODES_MAX = 20_000
"""Nodes counted at most in a growing graph chain (~3 µs each: ~60 ms; 160k nodes took 0.54 s in one
pass of a state change's search). A larger graph is said to be "20,000+ nodes"."""

_GRAPH_NODES_KEPT = 8
"""A leaked tensor whose own graph has at least this many nodes is a graph leak (an output kept with
its forward's graph), not a tensor leak (a tensor with the one node of its last operation)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _SampleHolder:
    """Who keeps one sampled tensor of a growing group."""

    holder: str | None = None
    graph_kept: bool = False  # no Python holder: an autograd graph keeps it
    garbage: bool = False  # in a reference cycle the (enabled) collector will free
    bound: tuple[int, int] | None = None  # (maxlen, length) of the bounded deque on its path (``HolderPath``)


class CulpritSearch:
    """Finds the evidence behind one track status; see the module docstring.

    ``census`` is the census component (None when censuses are off); ``host`` and ``sites`` keep
    their own state across starts (heap-look baselines, noted allocation sites)."""

    def __init__(self, agent: AgentView, series: LeakSeries, *, tracker: SurvivorTracker | None,
                 chains: GraphChainTracker | None, census: CensusComponent | None, host: HostLooks,
                 sites: AllocationSites, check_every_steps: int) -> None:
        self._agent = agent
        self._series = series
        self._tracker = tracker
        self._chains = chains
        self._census = census
        self._host = host
        self._sites = sites
        self._check_every_steps = check_every_steps
        self._bounds = DequeBounds(series)  # growth into a bounded deque that holds a sample: withheld while it fills

    def search(self, status: TrackStatus) -> Stepwise[Evidence]:
        """The search, one heap pass between ``yield``s (see ``probes.heap.stepwise``)."""
        kind = status.spec.kind
        if status.spec is self._series.workers_spec:
            return self._workers_culprits(status)
        if kind == "host_leak":
            return (yield from self._host_culprits(status))
        if status.spec.row_bytes:
            return (yield from self._family_culprits(status))
        if status.spec.unit == "tensors":
            return (yield from self._count_culprits(status))
        if status.spec.unit == "nodes":
            return (yield from self._chain_culprits(status))
        if kind in ("tensor_leak", "graph_leak"):
            return (yield from self._census_culprits(status))
        return NO_EVIDENCE

    # --- count series: one tensor of the group ---------------------------------------------------

    def _count_culprits(self, status: TrackStatus) -> Stepwise[Evidence]:
        """Who holds the tensors of a growing count series: a sample of the group, looked up now (so
        the container's size is the one when the sentence is written), and what one of them costs."""
        key = self._series.scans.counts.key_of(status.spec)
        tracker = self._tracker
        if key is None or tracker is None:
            return NO_EVIDENCE
        group = next((g for g in tracker.counts.groups() if g.key == key), None)
        count = group.count if group is not None else 0
        held = _SampleHolder(garbage=True)  # every tensor of the group died since the scan: nothing to blame
        # Grown past what filling the bounded deque that held its newest explains: the oldest member
        # left the deque, and what holds it is what grows.
        sampled = tracker.counts.sample(key, oldest=self._bounds.past(status, count))
        held_sample = hold_weakly(sampled) if sampled is not None else None
        del sampled
        if held_sample is not None:
            held = yield from self._holder_of_sample(held_sample)
        sample = held_sample() if held_sample is not None else None
        graph_bytes = graph_nodes = 0
        try:
            if sample is not None and status.spec.kind == "graph_leak":
                graph_bytes = host_objects.saved_bytes(sample)
                if not graph_bytes:  # backward() freed them: the nodes are what it keeps
                    graph_nodes = host_objects.graph_size(sample, max_nodes=_GRAPH_NODES_MAX)
        finally:
            del sample
        own = group.nbytes / group.count if group is not None and group.count else 0.0
        per_tensor = own + graph_bytes
        desc = group.describe() if group is not None else status.spec.name
        sentence = count_sentence(self._series.stated_rate(status), desc, own, graph_bytes, held.holder,
                                  graph_nodes=graph_nodes)
        # a graph leak when what one tensor keeps is mostly its graph: saved tensors, or (freed by
        # backward()) a graph of its own nodes, which cost host memory per node
        graphy = held.graph_kept or (status.spec.kind == "graph_leak"
                                     and (graph_bytes >= own or graph_nodes >= _GRAPH_NODES_KEPT))
        kind = "graph_leak" if graphy else "tensor_leak"
        culprit = Culprit(description=desc, count_delta=round(status.growth_bytes),
                          bytes_delta=round(status.growth_bytes * own), holder=held.holder,
                          graph_bytes_delta=round(status.growth_bytes * graph_bytes),
                          category="graph" if group is not None and group.graph else "other")
        sites = self._sites.sites(status)  # on CUDA with allocation history: the lines that allocate them
        # What a graph whose saved tensors backward() freed costs is its nodes' host memory, which Python
        # cannot measure: no bytes and no time to OOM from the tensor's own few bytes ("~4 B/step, out
        # of memory in ~70 days"); host RSS, which does see the nodes, judges the bytes.
        nodes_only = graph_nodes >= _GRAPH_NODES_KEPT and not graph_bytes
        bytes_per_unit = 0.0 if nodes_only else max(per_tensor, 1.0)
        bounded_until = self._bounds.until(status, held.bound, count, bytes_per_unit)
        return Evidence((culprit,), status.step - (status.onset_step or status.step), sites, kind,
                        bytes_per_unit=bytes_per_unit, sentence=sentence, graph_kept=held.graph_kept,
                        garbage=held.garbage, bounded_until=bounded_until)

    def _holder_of_sample(self, held_sample: Callable[[], torch.Tensor | None]) -> Stepwise[_SampleHolder]:
        """Who keeps the sample: a cycle, a Python path, else the autograd graph that saved it. One
        heap pass per ``yield``; the sample is held weakly across them (a long-lived tensor of a
        growing group: when it died meanwhile, nothing kept it)."""
        sample = held_sample()
        if sample is None:
            return _SampleHolder(garbage=True)
        # The path first, over a few step ends if it must: a name is the common answer, and the cycle
        # check costs a heap scan or more (on a slow machine the two did not fit one budget).
        search = who_holds_stepwise(sample, ignore=(self._series.scans.counts.specs,))
        del sample  # the search holds it weakly across its pauses
        found = yield from search
        path = found.text if found is not None else None
        if found is not None and PATH_CUT not in found.text:
            return _SampleHolder(found.text, bound=found.bound)
        yield
        sample = held_sample()
        if sample is None:
            return _SampleHolder(garbage=True)
        cycle = cycle_holder(sample)
        del sample
        # Cyclic garbage while the collector runs is freed at its next collection (a burst),
        # not leaked; with gc disabled nothing will ever free it: that is the leak.
        garbage = cycle is not None and job_collector_enabled() and gc.get_threshold()[0] > 0
        holder = cycle or path
        if holder is not None:
            return _SampleHolder(holder, garbage=garbage)
        # Alive with no Python referrer: C++ keeps it, i.e. an autograd graph saved it (torch
        # preserves the Python wrapper of saved tensors). Name the root of the largest live graph
        # and its holder. A tensor without grad_fn is said to be kept by a graph only when that
        # graph saves it: else (a look-up the budget cut short) its holder is unknown, not a graph.
        yield
        sample = held_sample()
        if sample is None:
            return _SampleHolder(garbage=True)
        unsaved = sample.grad_fn is None and not host_objects.saved_by_a_graph(sample)
        del sample
        if unsaved:
            return _SampleHolder(garbage=garbage)
        yield
        graph = _graph_holder()
        return _SampleHolder(graph, graph_kept=graph is not None, garbage=garbage)

    # --- the job's child processes -------------------------------------------------------------

    def _workers_culprits(self, status: TrackStatus) -> Evidence:
        """Which workers grow (the children alive now), each one's rate, and the DataLoader they run."""
        pids = self._series.worker_growth.pids
        loaders = dataloaders.loaders_of(pids)
        per_worker = self._series.stated_rate(status) / max(1, len(pids))
        sentence = workers_sentence(pids, per_worker, status.onset_step,
                                    [(loader.dataset, loader.persistent) for loader in loaders])
        datasets = [loader.dataset.split(" (")[0] for loader in loaders]  # the class, without its module
        culprit = Culprit(description=workers_noun(pids, bool(loaders)), count_delta=len(pids),
                          bytes_delta=round(status.growth_bytes), holder=workers_holder(pids, datasets),
                          noun="process", category="workers")
        since = status.onset_step if status.onset_step is not None else status.window_start
        return Evidence((culprit,), status.step - since, (), sentence=sentence)

    # --- a growing tensor: its newest, largest member ------------------------------------------

    def _family_culprits(self, status: TrackStatus) -> Stepwise[Evidence]:
        """Who holds the newest largest tensor of a growing family (alive: the scan that saw it ran
        at this step end), and how many rows it has now."""
        series = self._series
        key = series.scans.grown.key_of(status.spec)
        families = series.scans.families
        family = families.get(key) if key is not None and families is not None else None
        if key is None or families is None or family is None:
            return NO_EVIDENCE
        sample = families.sample(key)
        search = who_holds_stepwise(sample, ignore=(series.scans.grown.specs,)) if sample is not None else None
        del sample
        found = (yield from search) if search is not None else None
        holder = found.text if found is not None else None
        row_bytes = status.spec.row_bytes
        rows = series.stated_rate(status) / row_bytes
        desc = family.describe()
        sentence = growth_sentence(holder, desc, rows, row_bytes, family.rows)
        culprit = Culprit(description=desc, count_delta=round(status.growth_bytes / row_bytes),
                          bytes_delta=round(status.growth_bytes), holder=holder, noun="row",
                          category="graph" if family.key[3] else "other")
        since = status.onset_step if status.onset_step is not None else status.window_start
        return Evidence((culprit,), status.step - since, (), sentence=sentence)

    # --- graph chains: the newest root ---------------------------------------------------------

    def _chain_culprits(self, status: TrackStatus) -> Stepwise[Evidence]:
        """Who holds the newest tensor of a growing graph chain, how large the graph it reaches is,
        and what its saved tensors cost (zero once backward() freed them: the nodes alone grow)."""
        key = self._series.scans.chain_nodes.key_of(status.spec)
        chains = self._chains
        sample = chains.sample(key) if key is not None and chains is not None else None
        if key is None or chains is None or sample is None:
            return NO_EVIDENCE
        try:
            nodes = host_objects.graph_size(sample, max_nodes=CHAIN_NODES_MAX)
            saved = host_objects.saved_bytes(sample)
            search = who_holds_stepwise(sample, ignore=(self._series.scans.chain_nodes.specs,))
        finally:
            del sample
        found = yield from search
        holder = found.text if found is not None else None
        per_step = status.verdict.slope.slope
        since = status.onset_step if status.onset_step is not None else status.window_start
        saved_per_step = saved / max(1.0, status.step - since)
        desc = key[1] + "[" + ", ".join(str(d) for d in key[2]) + "]"
        at_least = nodes >= CHAIN_NODES_MAX
        sentence = chain_sentence(desc, nodes, saved_per_step, holder, at_least=at_least)
        shown = f"{nodes:,}{'+' if at_least else ''}"
        culprit = Culprit(description=f"{desc} with grad_fn (autograd graph of {shown} nodes)",
                          count_delta=round(status.growth_bytes), bytes_delta=0, holder=holder,
                          graph_bytes_delta=round(saved_per_step * (status.step - since)), category="graph",
                          noun="autograd node")
        # What a node itself costs is not measurable from Python: bytes (and a time to OOM) only
        # when the chain also keeps saved tensors worth a noise floor.
        material = saved_per_step >= NOISE_FLOOR_BYTES["graph_leak"] and per_step > 0
        began = next((g.began_at for g in chains.groups() if g.key == key), None)
        return Evidence((culprit,), status.step - since, (), "graph_leak",
                        bytes_per_unit=saved_per_step / per_step if material else 0.0, sentence=sentence,
                        onset_step=began)

    # --- bytes series: the census diff ---------------------------------------------------------

    def _census_culprits(self, status: TrackStatus) -> Stepwise[Evidence]:
        censuses = self._census
        now = self._agent.state().census
        stale = now is None or now.step is None or status.step - now.step > self._check_every_steps
        if stale and censuses is not None:
            now = yield from censuses.census_now()
            yield
        earlier = censuses.at_or_after(int(status.window_start)) if censuses is not None else None
        if earlier is None or earlier is now:
            # No census inside the window (a slow cadence on a big heap): the newest one before it.
            older = [c for c in (censuses.recent_censuses() if censuses is not None else [])
                     if c is not now and c.step is not None]
            earlier = older[-1] if older else earlier
        sites = self._sites.sites(status)
        if now is None or earlier is None or earlier is now or now.step is None or earlier.step is None:
            return Evidence(sites=sites)
        # A series off CUDA (the host's, a census's on cpu or another device) is diffed against cpu's groups.
        device = status.spec.device if cuda_index(status.spec.device) is not None else CPU
        deltas = [d for d in now.diff(earlier) if d.device == device]
        culprits = list(culprits_from_diff(deltas))
        kind = refine_kind(status.spec.kind, culprits) if culprits else None  # before holders are named
        if culprits and culprits[0].holder is None:
            culprits[0] = yield from _name_holder(culprits[0], deltas)
        return Evidence(tuple(culprits), float(now.step - earlier.step), sites, kind)

    # --- host RSS: CPU tensors, else containers or a graph --------------------------------------

    def _host_culprits(self, status: TrackStatus) -> Stepwise[Evidence]:
        # CPU tensors first: when a census taken now shows tensor/graph bytes growing at least half as
        # fast as RSS, the host leak is theirs, and the census diff names them and who holds them.
        census = yield from self._census_culprits(status)
        if census.culprits and census.steps > 0:
            # The census interval may start before the window: compare what the census saw grow since
            # the window (or the onset, when later) with what RSS gained since then. (Since the onset, a
            # deque(maxlen=N) of graphs that filled before RSS crept on explained the creep.)
            since = max(status.window_start, status.onset_step or 0)
            in_census = sum(grown_since(self._series.scans.counts, c, since) for c in census.culprits)
            leak_steps = min(census.steps, max(1.0, status.step - since))
            if in_census >= 0.5 * status.verdict.slope.slope * leak_steps:
                return dataclasses.replace(census, kind=refine_kind("tensor_leak", census.culprits), steps=leak_steps)
        yield
        # Raised while a CPU tensor finding was active: its growth is past what those tensors explain.
        after_tensors = any(f.kind == "tensor_leak" and f.device == CPU and f.state != "cleared"
                            and f.first_step < (status.first_step or 0) for f in self._agent.published.findings)
        return (yield from self._host.culprits(status, self._agent, ignore=self._series.detector.buffer_ids(),
                                               headroom=self._series.headroom(status.spec),
                                               tensors_explained=after_tensors))


def _graph_holder() -> str | None:
    """The root of the largest live autograd graph and who holds it, in one step end: the root is
    often this step's loss, gone by the next (callers yield before it, so it starts a step end)."""
    root = host_objects.growing_graph(0, min_added=1, holder_budget_s=HOLDER_BUDGET_S)
    if root is None or root.holder is None:
        return None
    return f"the autograd graph ({root.nodes:,} nodes) of {root.description}, held by {root.holder}"


def _name_holder(culprit: Culprit, deltas: list[GroupDelta]) -> Stepwise[Culprit]:
    """The census looks up holders only for groups whose count grew; name the others here."""
    if culprit.category == "graph":
        # Tensors with a grad_fn that nothing in Python holds are kept by an autograd graph:
        # name the tensor at the root of the largest live graph and who holds it.
        graph = _graph_holder()
        if graph is not None:
            return dataclasses.replace(culprit, holder=graph)
        yield
    top = next((d for d in deltas if _describes(d, culprit)), None)
    holder = holder_of_group(top.key) if top is not None else None
    return dataclasses.replace(culprit, holder=holder) if holder is not None else culprit


def _describes(delta: GroupDelta, culprit: Culprit) -> bool:
    return delta.bytes_delta == culprit.bytes_delta and delta.graph_bytes_delta == culprit.graph_bytes_delta
