"""The tensor census: one pass over the gc-visible heap, every storage counted once, classified, named.

What the pass does, in order (TORCH_MEMORY_API.md §7 has the facts it relies on):

1. ``gc.get_objects()`` filtered by ``type(o) in kinds``, where ``kinds`` holds every live subclass of
   ``TensorBase``, ``nn.Module`` and ``Optimizer`` (walked from ``__subclasses__`` at each census).
   A set lookup on the exact type is ~3x cheaper than ``isinstance(o, torch.Tensor)`` (whose
   metaclass makes every miss walk the MRO), which is what keeps the census near the bare floor.
   Weak proxies report their own type, so they are never touched.
2. Named tensors are claimed first: parameters (FQNs from registered models, else from the root
   modules found in the scan), gradients through the parameters (``.grad`` is not gc-visible on its
   own), optimizer state through the optimizers (``Adam[<fqn>].exp_avg``, ``step`` counters included),
   buffers. Then every scanned tensor not yet claimed becomes ``graph`` (it has a live ``grad_fn``)
   or ``other``.
3. Each storage is counted once, by its identity (``probes.heap.storages`` says what folds into one).
4. Graph retention (``probes.census.census_graph``): saved storages counted nowhere else are charged
   to the tensor whose autograd graph keeps them, in a walk bounded in nodes.
5. Grouping (``probes.census.census_groups``), then holders (``probes.holding.holder_groups.fill_holders``) for the few
   anonymous groups that grew, once the pass has dropped every tensor it held.

A census is stepwise (``census_steps``, a ``probes.heap.stepwise`` generator): after the heap pass it
yields every ``CHUNK_TENSORS`` tensors counted, after the graph walk, every ``CHUNK_RECORDS`` records
grouped, and before the holder lookups, holding every tensor only weakly across a yield
(``probes.census.census_pass``). ``take_census`` runs it whole; the census component runs it a step end at
a time, so a leak that keeps 100k tensors (~6 µs each to count and group) costs the job several
bounded pauses, not one of half a second.

The census never synchronises a device, allocates on it or calls ``.item()``: it reads metadata
(storage pointers and sizes, dtypes, shapes) only. One caveat: reading a ``_saved_*`` attribute runs
the unpack hook of ``saved_tensors_hooks`` that were active when the graph was built (offloading hooks
copy back to the device); pass ``graph=False`` for jobs that offload activations that way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gpumemd.probes.census.census_groups import Grouping
from gpumemd.probes.census.census_pass import CensusPass
from gpumemd.probes.heap.stepwise import HEAP_PASS, Hinted, hold_weakly, run_to_end
from gpumemd.probes.holding.holder_groups import fill_holders
from gpumemd.records.census import Census
from gpumemd.records.samples import AllocatorSample

LARGEST = 50
"""How many of the largest storages a census keeps as ``TensorEntry`` (``Census.largest``)."""

GRAPH_MAX_NODES = 50_000
"""Autograd nodes walked per census at most; beyond it graph bytes are a lower bound."""

HOLDERS_TIME_BUDGET_S = 1.0
"""Time for all holder lookups of one census together (each one scans the heap)."""

CHUNK_TENSORS = 2_048
"""Tensors counted between two yields of a stepwise census (~2 µs each: a few ms)."""

CHUNK_RECORDS = 8_192
"""Storage records grouped between two yields (~0.4 µs each)."""

GRAPH_SLICE_NODES = 10_000
"""Autograd nodes walked in one slice of a census in step ends at most (~7-35 µs each: 70-350 ms); a
single graph larger than that is walked that far (its bytes a lower bound, ``graph_truncated``). The
slice also ends at the step end's ``pause_s``, between two graphs (``GRAPH_SLICE_MIN_S``)."""

GRAPH_SLICE_MIN_S = 0.02
"""A graph slice in step ends walks this long at least before the step end's pause ends it: each
slice resolves every root left (~1 µs each), so a slice must also make headway."""


@dataclass(frozen=True, slots=True)
class CensusRequest:
    """What a census is of and how it runs (``census_steps``).

    ``step`` is the step it is of; ``allocator`` (the last allocator reading) gives the invisible bytes
    and ``previous`` (the last census) the groups that grew, for holders. ``holders`` is how many groups
    get a ``who_holds`` line: the anonymous groups that grew most since ``previous``, or the largest
    anonymous groups without one; all lookups together stop after ``HOLDERS_TIME_BUDGET_S``.
    ``holders_largest`` (a census outside a step: at an OOM there is no later chance) tops the groups
    that grew up with the largest anonymous ones, so the report names what fills the memory too.
    ``pause_s`` (a census in step ends): the lookups stop once the step end that runs them has paid that
    much, from ``slice_started()`` (the step end's start; without it, the lookups'), so the last slice
    too is one bounded pause; ``graph_slice_nodes`` (``GRAPH_SLICE_NODES`` there) bounds each slice of
    the graph walk, None walks up to ``graph_max_nodes`` at once."""

    step: int | None = None
    holders: int = 3
    holders_largest: bool = False
    graph: bool = True
    previous: Census | None = None
    allocator: Sequence[AllocatorSample] | None = None
    largest: int = LARGEST
    graph_max_nodes: int = GRAPH_MAX_NODES
    graph_slice_nodes: int | None = None
    pause_s: float | None = None
    slice_started: Callable[[], float] | None = None
    clock: Callable[[], float] = time.perf_counter
    wall_clock: Callable[[], float] = time.time


def take_census(
    *,
    models: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    step: int | None = None,
    holders: int = 3,
    graph: bool = True,
    previous: Census | None = None,
    allocator: Sequence[AllocatorSample] | None = None,
    largest: int = LARGEST,
    graph_max_nodes: int = GRAPH_MAX_NODES,
    clock: Callable[[], float] = time.perf_counter,
    wall_clock: Callable[[], float] = time.time,
) -> Census:
    """Count every live tensor storage once, classify and name it, all now (``CensusRequest`` says what
    each option does; ``census_steps`` how)."""
    request = CensusRequest(step=step, holders=holders, graph=graph, previous=previous, allocator=allocator,
                            largest=largest, graph_max_nodes=graph_max_nodes, clock=clock, wall_clock=wall_clock)
    started = clock()
    census = run_to_end(census_steps(request, models=models, optimizers=optimizers))
    return dataclasses.replace(census, duration_s=clock() - started)


def census_steps(request: CensusRequest = CensusRequest(), *, models: Iterable[Any] = (),
                 optimizers: Iterable[Any] = ()) -> Hinted[Census]:
    """A census that yields between its slices (see the module docstring) and returns the ``Census``.
    ``models``/``optimizers`` name parameters, gradients and optimizer state; they are let go after the
    heap pass. Whoever runs the slices keeps their time: the census's ``duration_s`` is theirs to set
    (``take_census``, the census component)."""
    taken_at = request.wall_clock()
    census = CensusPass(request.graph_max_nodes)
    grouping = Grouping(census.storages, request.largest)
    try:
        census.begin(_distinct(models), _distinct(optimizers))
        del models, optimizers  # not kept alive across the job's steps by a census under way
        while census.left:
            yield None
            census.count(CHUNK_TENSORS)
        more = request.graph and bool(census.roots)
        while more:
            yield None
            more = census.charge(request.graph_slice_nodes, _graph_stop(request))
        records = census.records
        for i in range(0, len(records), CHUNK_RECORDS):
            if i:
                yield None
            grouping.add(records[i:i + CHUNK_RECORDS])
        objects, truncated, errors = census.objects_scanned, census.graph_truncated, census.errors
        groups, samples, owners, entries, invisible = grouping.finish(request.allocator or ())
    finally:
        census.release()  # drop every reference the pass holds before the heap is searched for holders
    del census, grouping
    if request.holders > 0 and samples:
        weak_samples = {key: hold_weakly(t) for key, t in samples.items()}
        weak_owners = {key: hold_weakly(t) for key, t in owners.items()}
        samples.clear()
        owners.clear()
        yield HEAP_PASS  # the lookups scan the heap: a slice of their own, early in a step end
        budget_s = _holders_budget(request)
        samples, owners = _alive(weak_samples), _alive(weak_owners)
        if budget_s > 0:
            groups = fill_holders(groups, samples, owners, holders=request.holders, previous=request.previous,
                                  budget_s=budget_s, largest_too=request.holders_largest)
    samples.clear()
    owners.clear()
    return Census(step=request.step, taken_at=taken_at, duration_s=0.0, groups=tuple(groups),
                  largest=tuple(entries), objects_scanned=objects, invisible_bytes_by_device=invisible,
                  graph_truncated=truncated, errors=errors)


def _pause_left(request: CensusRequest) -> float | None:
    """Seconds left of the step end's pause (``pause_s``) for a census in step ends, else None."""
    if request.pause_s is None:
        return None
    clock = request.clock
    paid_from = request.slice_started() if request.slice_started is not None else clock()
    return request.pause_s - (clock() - paid_from)


def _holders_budget(request: CensusRequest) -> float:
    """Seconds the holder lookups may take: ``HOLDERS_TIME_BUDGET_S``, less what the step end that runs
    them has paid already when the census runs in step ends (``pause_s``)."""
    left = _pause_left(request)
    return HOLDERS_TIME_BUDGET_S if left is None else min(HOLDERS_TIME_BUDGET_S, left)


def _graph_stop(request: CensusRequest) -> Callable[[], bool] | None:
    """When a graph slice in step ends stops taking roots: at the end of the step end's pause, after
    ``GRAPH_SLICE_MIN_S`` at least. Its node bound alone let a slice run 340 ms where nodes cost
    ~35 µs (a GPT-2 in transformers' Trainer, leaking its losses, on a slow 2-core VM)."""
    left = _pause_left(request)
    if left is None:
        return None
    clock = request.clock
    until = clock() + max(left, GRAPH_SLICE_MIN_S)
    return lambda: clock() > until


def _alive(held: dict[Any, Callable[[], Any]]) -> dict[Any, Any]:
    return {key: obj for key, ref in held.items() if (obj := ref()) is not None}


def _distinct(objects: Iterable[Any]) -> list[Any]:
    """Each object once, by identity: a model may define ``__eq__`` (a tensor-valued one cannot be a bool)."""
    out: list[Any] = []
    for obj in objects:
        if not any(obj is seen for seen in out):
            out.append(obj)
    return out
