"""Long-lived tensors, counted per group between censuses, from the garbage collector's young generations.

Why this design: a census scans the whole heap (tens of ms), so
under a 1% budget it runs every few thousand steps on a fast job, and a list gaining one 2 KiB tensor
per step is invisible in host RSS (freed heap chunks absorb it). What is cheap is where new objects
live: CPython keeps every gc-tracked object allocated since the last collection in generation 0, and
in a training loop, whose allocations and frees balance, it stays small (a collection runs once it
exceeds ``threshold0``, 700 by default). Every ``scan_every`` steps the tracker lists the tensors
there and takes *weak* references to them; a tensor still alive at the next
scan has outlived a step boundary by ``scan_every`` steps: it is counted in its group (device, dtype,
shape, has grad_fn) and a weakref callback uncounts it when it dies. A tensor that a collection moves
to an older generation between two scans is caught by a ``gc.callbacks`` hook that lists the young
tensors of generation 0 when any collection starts. So ``groups()`` gives the number of long-lived
tensors per group, exact to ``scan_every`` steps (past 16 new members of a group at a scan, a sample
stands for the rest: ``survivor_counts``), with no heap scan and no strong reference: object
lifetimes never change. benchmarks/bench_leak.py measures the cost per step.

What it cannot see: tensors only C++ holds (saved activations without a Python wrapper: the census's
graph walk covers those) and tensors that were already old at attach (the baseline). Under
``gc.disable()`` the young generation holds everything allocated since; the scan spaces itself out
when it gets slow.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import random
import time
import weakref
from typing import Any

from gpumemd.probes.heap.gc_pause import collector_paused, job_collector_enabled
from gpumemd.probes.survival.survivor_counts import PER_GROUP_PER_SCAN, GroupKey, SurvivorCounts

log = logging.getLogger("gpumemd")

MAX_TRACKED = 200_000
"""Long-lived tensors counted at most; beyond it new ones are not counted (``capped``). Each one counted
by its own weakref costs ~200 bytes here (the weakref, its dict entry and its id: group keys are
shared), and torch keeps the 64-byte Python object of its storage, made when it is sized, while the
tensor lives: ~52 MB at the cap if every tensor were its own sample. A sample stands for its group's
other new members of a scan (``survivor_counts.PER_GROUP_PER_SCAN``): a leak of one shape, 500 tensors
a scan, costs 10 bytes a tensor, ~2 MB at the cap (benchmarks/bench_survivor_memory.py)."""

_MAX_PENDING = 100_000  # candidates between two scans (a job that makes tensors faster is sampled)

YOUNG_COLLECT_AT = 256
"""Objects in generation 0 beyond which a scan runs the young collection itself (``threshold0`` when
that is lower). CPython collects generation 0 when allocations minus deallocations of tracked objects
pass ``threshold0``; a job in steady state (and the agent's own ring of step records, once full) frees
an old object for each new one, so that count stays low while generation 0's list grows by the
survivors of every step: 20,000 objects after 10,000 steps, a 300 µs scan (measured). Most of that
growth is the agent's own (two objects per step record, one floor tuple per 10 steps: ~25 objects
between two scans of a 1 ms job), and listing generation 0 is the largest part of a scan and grows with
it: collecting at 256 objects (listing ~130 on average) instead of 2,000 costs a 1 ms job ~2.5 µs a step
less, and the collection (of ~256 objects, every ~10 scans) is the one CPython would have run a little
later: it only moves survivors on (and frees young cyclic garbage a little sooner). Never under
``gc.disable()`` or a zero threshold."""

class SurvivorTracker:
    """Counts tensors promoted to the oldest gc generation, per group; see the module docstring."""

    def __init__(self, *, max_tracked: int = MAX_TRACKED) -> None:
        import torch

        self._tensor_types = frozenset({torch.Tensor})  # exact type: parameters are not the leak
        self.counts = SurvivorCounts(max_tracked)  # what is read of it: groups, totals, samples, the cap
        # Candidates listed at the last scan (counted at the next one if alive) and those the gc
        # callback listed since (they become candidates at the next scan, so that a tensor is
        # counted only once it has outlived at least one whole scan interval).
        self._pending: list[weakref.ref[Any]] = []
        self._listed: list[weakref.ref[Any]] = []
        self._newest: int | None = None  # ``new_tensors`` describes only the newest this many (``scan``)
        self._random = random.Random(0)  # ``_stratified``'s picks: the same run, the same counts
        self._installed = False
        self._collecting = False  # our own young collection: its callback has nothing new to list
        self.collections = 0  # collections seen
        self.callback_seconds = 0.0  # time in the gc callback not yet taken by take_callback_seconds()
        self.young_objects = 0  # objects in the young generations at the last look
        self.outlived = 0  # candidates that outlived the interval up to the last scan (counted at it)
        self.errors = 0

    # --- lifecycle ---------------------------------------------------------------------------

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_gc)
            self._installed = False
        self._pending.clear()
        self._listed.clear()
        self.counts.clear()

    # --- reading (training thread, every few steps) ------------------------------------------

    def new_graph_roots(self, limit: int) -> list[Any]:
        """Up to ``limit`` tensors with a ``grad_fn`` made since the last scan and still alive, newest
        first (strong references: the caller drops them soon). Read right after ``scan()``."""
        out: list[Any] = []
        for ref in reversed(self._pending):
            t = ref()
            if t is not None and t.grad_fn is not None:
                out.append(t)
                if len(out) >= limit:
                    break
        return out

    def new_tensors(self) -> list[tuple[Any, GroupKey]]:
        """The tensors made since the last scan and still alive, as listed by it (after a scan that keyed
        at most some: the newest ``NEWEST_DESCRIBED``), each with its group key (strong references: the
        caller drops the list soon). Read right after ``scan()``, at most once: what grows by being
        replaced each step (``torch.cat`` onto a kept tensor) is only ever here, never counted; and the
        keys read now are those the next scan counts these tensors by."""
        pending = self._pending if self._newest is None else self._pending[-self._newest:]
        return self.counts.describe([t for ref in pending if (t := ref()) is not None])

    # --- scanning (training thread) and the gc callback (any thread) ---------------------------

    def scan(self, *, keyed_at_most: int | None = None) -> None:
        """Count the candidates of the last scan that are still alive, then list the young tensors
        as the next candidates. Called at step ends, every ``scan_every`` steps. ``keyed_at_most``
        (while a confirmed leak is tracked: ``leak_scans.KEYED_WHILE_TRACKING``): past that many
        candidates alive, a stratified sample is counted, each standing for its stratum (``_stratified``)."""
        try:
            # Each counted tensor gets a tracked weakref that outlives the scan: 2,000 of them (a
            # 10-tensor/step leak between two scans) set off several collections inside the loop, a
            # full one among them now and then (leak checks 96.6 against 31.9 µs/step at ~2 ms steps:
            # benchmarks/bench_leak_tracking.py --leak-rate 10). Held off, the one collection they
            # call for comes at the job's next allocation.
            pending, self._pending = self._pending, []
            counts = self.counts
            counted = counts.refs
            alive = [t for ref in pending if (t := ref()) is not None and id(t) not in counted]
            pending.clear()
            self.outlived = len(alive)
            # A sample may stand for a group's other new members only if the collection below can
            # move them out of generation 0 (else they would be listed, and counted, again).
            most = PER_GROUP_PER_SCAN if job_collector_enabled() and gc.get_threshold()[0] > 0 else None
            weights = None
            if keyed_at_most is not None and most is not None and len(alive) > keyed_at_most:
                alive, weights = _stratified(alive, keyed_at_most, self._random, counts.represented)
            self._newest = None if keyed_at_most is None else NEWEST_DESCRIBED
            with collector_paused():
                counts.count(alive, most, weights)
            listed, self._listed = self._listed, []
            # Members a sample stands for are never candidates again: they are left out of what was
            # listed (and of what the gc callback lists, until the collection below moves them out
            # of generation 0: the one the pause held off may start on the next allocation).
            represented = counts.represented
            try:
                if represented:
                    listed = [ref for ref in listed if id(ref()) not in represented]
                self._pending = listed + self._young(collect=True, skip=represented)
            finally:
                counts.represented = set()
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not disturb the job
            self.errors += 1
            self._pending.clear()
            if self.errors == 1:
                log.info("gpumemd: survivor scan failed (%s: %s)", type(exc).__name__, exc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # A collection moves generation 0's survivors to an older generation, where no scan looks:
        # list them as candidates first (weakly: holding them would keep cyclic garbage
        # alive through the very collection that is about to free it).
        if phase != "start" or self._collecting:
            return
        start = time.perf_counter()
        try:
            self.collections += 1
            if len(self._listed) < _MAX_PENDING:
                self._listed.extend(self._young(skip=self.counts.represented))
        except Exception:  # noqa: BLE001 - never disturb the collector
            self.errors += 1
        self.callback_seconds += time.perf_counter() - start

    def take_callback_seconds(self) -> float:
        """Seconds spent in the gc callback since the last call (the agent counts them as its own)."""
        seconds, self.callback_seconds = self.callback_seconds, 0.0
        return seconds

    def _young(self, *, collect: bool = False, skip: set[int] | frozenset[int] = frozenset()
               ) -> list[weakref.ref[Any]]:
        counts = self.counts
        if counts.tracked >= counts.max_tracked:
            counts.capped = True
            return []
        types = self._tensor_types
        # Generation 0 only: every collection (the callback above) lists it before moving its
        # survivors on, so a tensor is seen in generation 0 at least once whatever happens to it.
        young = gc.get_objects(generation=0)
        self.young_objects = len(young)
        found = list(itertools.compress(young, map(types.__contains__, map(type, young))))
        young.clear()
        # Only from a scan: inside the gc callback a collection is already starting.
        threshold0 = gc.get_threshold()[0] if collect else 0
        if threshold0 > 0 and (skip or self.young_objects > min(YOUNG_COLLECT_AT, threshold0)) and gc.isenabled():
            self._collecting = True
            try:
                gc.collect(0)
            finally:
                self._collecting = False
        counted = counts.refs
        out = [weakref.ref(t) for t in found if id(t) not in counted and id(t) not in skip]
        found.clear()
        return out


NEWEST_DESCRIBED = 16
"""After a scan given ``keyed_at_most`` (while a confirmed leak is tracked), the new tensors whose keys are
read for the tensor families: the newest, among which is a tensor replaced by a larger one every step."""


def _stratified(alive: list[Any], at_most: int, rng: random.Random, left_out: set[int]) -> tuple[list[Any], list[int]]:
    """A stratified sample of the candidates alive (``at_most`` equal strata, one random member of each),
    with the members each stands for (its stratum); the ids of the others are added to ``left_out``.
    Why: a leak of one tensor a step puts every one of its tensors through a scan, and reading a
    tensor's group key costs ~2 µs on the training thread here, several times that after a step of
    compute (most of what tracking such a leak cost a 2 ms step). Every candidate's survival is still
    known (only dereferenced, not read), so counts and bytes stay exact while one group survives; what
    is estimated is the group of the members left out (the one their stratum's pick is in), right on
    average: random picks, since a training loop's tensors come in a pattern that evenly spaced picks
    could follow."""
    n = len(alive)  # more than at_most: no stratum is empty
    strata = list(itertools.pairwise((i * n) // at_most for i in range(at_most + 1)))
    picks = [low + rng.randrange(high - low) for low, high in strata]
    chosen = set(picks)
    left_out.update(id(alive[i]) for i in range(n) if i not in chosen)
    return [alive[i] for i in picks], [high - low for low, high in strata]
