"""A host leak's culprit when no tensor explains it: Python containers that grew, or an autograd graph;
or none, because the heap fragmented.

Two heap looks compared: container lengths and the largest autograd graph's node count, taken while
host RSS rises (the baseline) and again when the leak is suspected. Each look scans the heap (0.1-0.3 s
on a big one), so looks are spaced by their share of the overhead budget. With nothing grown, what
malloc has handed out (``probes.process.malloc_in_use``) tells fragmentation from a leak no Python
object shows (a C extension's).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd import budget
from gpumemd.analysis.leak_detector import TrackStatus
from gpumemd.analysis.units import format_bytes
from gpumemd.components.leak_evidence import NO_EVIDENCE, Evidence
from gpumemd.probes.heap import host_objects
from gpumemd.probes.heap.stepwise import Stepwise
from gpumemd.probes.holding.holders import HOLDER_BUDGET_S
from gpumemd.probes.process.malloc_in_use import malloc_in_use
from gpumemd.records.findings import Culprit

_READINGS = 16  # read every evaluation (50 steps) at most: 800 steps, more than a window

if TYPE_CHECKING:
    from gpumemd.components.base import AgentView


class HostLooks:
    """Budgeted heap looks and the host culprits they name; see the module docstring.

    ``container_lengths`` and ``largest_graph_nodes`` take one look (``probes.heap.host_objects``'s, or a
    test's); ``clock`` times them."""

    def __init__(self, *, window_steps: int, overhead_budget: float, clock: Callable[[], float],
                 container_lengths: Callable[[], dict[int, int]] = host_objects.container_lengths,
                 largest_graph_nodes: Callable[[], int] = host_objects.largest_graph_nodes,
                 in_use: Callable[[], int | None] = malloc_in_use) -> None:
        self._window_steps = window_steps
        self._overhead_budget = overhead_budget
        self._clock = clock
        self._container_lengths = container_lengths
        self._largest_graph_nodes = largest_graph_nodes
        self._in_use = in_use
        # step, container lengths, graph nodes
        self._baseline: tuple[int, dict[int, int], int] | None = None
        self._look_at: int | None = None  # the job's steps_total at the last look
        self._look_cost = 0.0  # seconds it took
        # (step, malloc's bytes in use), read at the start of the evaluations while host RSS rises
        # or its culprits are searched (``read_in_use``): the fragmentation test compares
        # readings from inside the window it judges, taken before any search's temporaries (a heap
        # scan's list of every object) are alive
        self._readings: collections.deque[tuple[int, int]] = collections.deque(maxlen=_READINGS)
        self._reading_cost = 0.0
        self._reading_at: int | None = None  # the job's steps_total at the last reading
        self.seconds = 0.0  # time spent in looks (budgeted apart from the leak checks)

    def clear(self) -> None:
        self._baseline = None
        self._readings.clear()

    def look_stepwise(self, step: int, job: AgentView, *, force: bool = False) -> Stepwise[None]:
        """First look for a host leak's culprit: container sizes and the largest autograd graph, taken
        while host RSS is rising (two heap scans: 0.1-0.3 s on a big heap), in two passes (containers,
        then graphs), one step end each in a training loop. At most once per two windows, and, unless
        ``force`` (a state change), within its share of the overhead budget
        (``budget.Part.HOST_LOOKS``) of the job's step time since the last look: RSS rises while a
        healthy job warms up, and a look every 1,000 steps of 1 ms would cost a quarter of the job.
        Step time, not wall time, as every budgeted part: a pause between steps (an eval loop, a
        checkpoint) does not make looks more frequent. The first look is not waited for: it is the
        baseline that lets a host leak's culprit be named when the leak is first suspected, and it
        comes in the job's first thousand steps, where RSS rises as heaps warm up (a one-time cost,
        like the first census: ``bench_step_overhead.py`` reports both as start-up)."""
        if not self._due(step, job, force=force):
            return
        started = self._clock()
        lengths = self._container_lengths()
        took = self._clock() - started
        yield
        started = self._clock()
        self._baseline = (step, lengths, self._largest_graph_nodes())
        self._look_at = job.steps_total
        self._look_cost = took + self._clock() - started
        self.seconds += self._look_cost

    def read_in_use(self, step: int, job: AgentView, *, force: bool = False) -> None:
        """Read malloc's bytes in use at the start of an evaluation while host RSS rises, within the looks'
        share of the budget (a read walks malloc's free lists: ~0.5 µs on a small heap, 4.7 ms on one of
        ~100k free chunks), or, ``force``, because host RSS's culprits are searched in it."""
        if self._readings and self._readings[-1][0] == step:
            return
        if self._reading_at is not None and not force:
            job_seconds = (job.steps_total - self._reading_at) * (job.seconds_per_step or 0.0)
            if job_seconds * budget.share(self._overhead_budget, budget.Part.HOST_LOOKS) < self._reading_cost:
                return
        started = self._clock()
        in_use = self._in_use()
        self._reading_cost = self._clock() - started
        self.seconds += self._reading_cost
        self._reading_at = job.steps_total
        if in_use is not None:
            self._readings.append((step, in_use))

    def _in_use_over(self, window_start: float) -> tuple[int, int, int, int] | None:
        """(step, bytes in use) of the first reading inside the window, then of the newest (this
        evaluation's: a search reads at its start); None without two. A resting finding's status is
        its last re-test's, its step long past."""
        if not self._readings:
            return None
        now = self._readings[-1]
        first = next(((s, b) for s, b in self._readings if window_start <= s < now[0]), None)
        return (*first, *now) if first is not None else None

    def _due(self, step: int, job: AgentView, *, force: bool) -> bool:
        if self._baseline is not None and step - self._baseline[0] < 2 * self._window_steps:
            return False
        if not force and self._look_at is not None:
            job_seconds = (job.steps_total - self._look_at) * (job.seconds_per_step or 0.0)
            if job_seconds * budget.share(self._overhead_budget, budget.Part.HOST_LOOKS) < self._look_cost:
                return False  # the job has not yet paid for the last look within this share of the budget
        return True

    def culprits(self, status: TrackStatus, job: AgentView, *, ignore: set[int],
                 headroom: float | None, tensors_explained: bool = False) -> Stepwise[Evidence]:
        """The containers (or the autograd graph) that grew since the baseline as fast as host RSS; with
        nothing grown (or no baseline yet: a look is taken now for the next search), what malloc's bytes
        in use say (``_by_malloc``). ``ignore``: ids of containers that are the agent's own (the
        detector's buffers). ``tensors_explained``: a tensor finding accounts for the tensors
        (``growing_containers_stepwise``). One heap pass between ``yield``s (``probes.heap.stepwise``)."""
        # This evaluation's step: a confirmed finding between its re-tests keeps its last status, whose
        # step is that re-test's (a fresh look dated there was never older than the finding).
        step = max(status.step, job.current_step or 0)
        baseline = self._baseline
        if baseline is None or baseline[0] >= step:
            self._baseline = None
            yield from self.look_stepwise(step, job, force=True)
            return self._by_malloc(status, step, headroom)
        since, lengths, graph_nodes = baseline
        steps = float(step - since)
        growth = status.verdict.slope.slope * steps  # what the host gained meanwhile
        grown = yield from host_objects.growing_containers_stepwise(
            lengths, ignore=ignore, holder_budget_s=HOLDER_BUDGET_S, tensors_explained=tensors_explained)
        contained = sum(g.approx_bytes for g in grown)
        yield
        graph = host_objects.growing_graph(graph_nodes, min_added=max(1, int(steps) // 2),
                                           holder_budget_s=HOLDER_BUDGET_S)
        if graph is not None and contained < 0.5 * growth:
            # Nothing Python-visible grew enough, but one autograd graph gains nodes every step.
            culprit = Culprit(description=f"{graph.description} (graph of {graph.nodes:,} autograd nodes, "
                              f"+{graph.nodes_added / max(steps, 1):.0f}/step)", count_delta=0, bytes_delta=0,
                              holder=graph.holder, graph_bytes_delta=int(growth))
            return Evidence((culprit,), steps, (), "graph_leak")
        if not grown or contained < growth / 4:
            # Containers that hold a small part of the growth (by their items' shallow sizes) are named
            # unless malloc says the heap fragments: a list that gains a tuple per check was named as
            # the holder of 21 KiB/step of a full deque's churn.
            evidence = self._by_malloc(status, step, headroom)
            if evidence.fragmented or (grown and evidence.bounded_until is not None):
                return evidence  # the baseline kept: the heap fragments, or malloc is not yet comparable
            if not grown:
                self._baseline = None
                yield
                yield from self.look_stepwise(step, job, force=True)
                return evidence
        culprits = tuple(
            Culprit(description=f"{g.item_type} objects in a {g.type_name} of {g.length:,} items",
                    count_delta=g.items_added, bytes_delta=g.approx_bytes, holder=g.holder,
                    noun=f"{g.item_type} object")
            for g in grown
        )
        # RSS lags a leak (freed heap is reused first); the container dates it: its length at the
        # rate it grew says when it started growing.
        top = grown[0]
        onset = int(step - top.length * steps / top.items_added) if top.items_added > 0 and steps > 0 else None
        return Evidence(culprits, steps, onset_step=onset)

    def _by_malloc(self, status: TrackStatus, step: int, headroom: float | None) -> Evidence:
        """Host RSS's growth that nothing Python-visible explains, told by malloc's bytes in use from the
        first reading inside the window to this evaluation's: the heap's fragmentation (withheld, looked at
        again a window on), or a leak no Python object shows (said, with a sentence saying so). Over half a window at
        least: one reading before the window measured another time's growth (a deque(maxlen=N) of graphs
        filling, before RSS crept on), and over 50 steps a few hundred KiB of noise outweighed a quarter of
        RSS's growth. Until then withheld; said where the C library has no ``mallinfo2``."""
        in_use = self._in_use_over(status.window_start)
        half = self._window_steps // 2
        if in_use is None or in_use[2] - in_use[0] < half:
            if not self._readings:
                return NO_EVIDENCE
            return Evidence((), 0.0, bounded_until=(in_use[0] if in_use is not None else self._readings[-1][0]) + half)
        since, before, at, now = in_use
        growth = status.verdict.slope.slope * (at - since)
        if _fragmented(before, now, growth, headroom):
            return Evidence((), float(at - since), fragmented=True, bounded_until=step + self._window_steps)
        if now - before < growth / 4:  # past an eighth of the memory left: said, but not malloc's
            return NO_EVIDENCE
        # Said with what was ruled out, so the reader looks where it grows (the exit line's next step too).
        rate = format_bytes((now - before) / (at - since))
        return Evidence((), float(at - since), sentence=(
            f"no Python object grew with it, and malloc's bytes in use rose +{rate}/step: memory a C extension "
            "or a native library allocates"))


def _fragmented(in_use_before: int, in_use_now: int, growth: float, headroom: float | None) -> bool:
    """Did host RSS grow (``growth`` since the reading of ``in_use_before``) while what malloc hands out grew
    by under a quarter of it, and is that growth under an eighth of the memory left? Then freed chunks
    between live ones grew the heap: no leak. A larger growth is said whatever its cause, as memory that
    malloc does not see (pinned or mapped by hand) is no better for running out."""
    if growth <= 0 or (headroom is not None and growth > headroom / 8):
        return False
    return in_use_now - in_use_before < growth / 4
