"""What grows on the host when the tensor census does not: Python containers and autograd graphs.

Bytes, strings and numpy arrays are not gc-tracked, but the lists, dicts, sets and deques that keep
them are. Two passes over ``gc.get_objects()`` a few dozen steps apart (only when the detector
already suspects a host leak: each pass scans the heap) show which containers gained items and
roughly how many bytes per item (``sys.getsizeof`` of a recent item).

The other host leak the census cannot see is an autograd graph that grows behind a single tensor
(``total_loss += loss`` after ``backward()``: the saved tensors are freed, the graph's nodes are
not). ``largest_graph_nodes`` / ``growing_graph`` compare the largest live graph's node count.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumemd.probes.heap.autograd_graph import GraphWalk, count_nodes
from gpumemd.probes.heap.heap_tensors import live_tensors, objects_of
from gpumemd.probes.heap.stepwise import Stepwise, hold_weakly
from gpumemd.probes.heap.storages import StorageKey, Storages
from gpumemd.probes.holding.holders import who_holds

if TYPE_CHECKING:
    import torch

_CONTAINERS: frozenset[type] = frozenset({list, dict, set, collections.deque})  # exact types
_MIN_LEN = 8  # smaller containers are not where a leak lives after a few hundred steps
_MAX_TRACKED = 50_000  # bounded memory for one snapshot: ids -> lengths
_MIN_ADDED = 4  # items a container must gain to be a culprit
_GROWN_SHOWN = 3  # grown containers named at most, most bytes first


@dataclass(frozen=True, slots=True)
class ContainerGrowth:
    """One container that gained items between two snapshots."""

    type_name: str  # "list", "dict", ...
    item_type: str  # type of a recent item ("bytes", "dict", ...)
    items_added: int
    approx_bytes: int  # items_added x sys.getsizeof(a recent item)
    length: int
    holder: str | None = None


def container_lengths() -> dict[int, int]:
    """id -> length of every gc-tracked container with at least ``_MIN_LEN`` items (bounded)."""
    out: dict[int, int] = {}
    containers = objects_of(_CONTAINERS)
    try:
        for obj in containers:
            try:
                n = len(obj)
            except Exception:  # noqa: BLE001 - an odd subclass must not stop the scan
                continue
            if type(obj) is collections.deque and obj.maxlen is not None:
                # Bounded: it stops at maxlen, so it is no leak's holder, however fast it fills. The
                # agent's own rings fill during the first steps, when RSS rises as heaps warm up: a
                # healthy job read "host memory leak confirmed … held by `agent._components.items`
                # … chains._marks" (a ring of (step, mark) tuples: no gpumemd type to skip it by).
                # What this gives up: a bound so large that memory runs out before it is reached
                # is not named as the holder (the finding itself still stands, from RSS).
                continue
            if n >= _MIN_LEN:
                out[id(obj)] = n
                if len(out) >= _MAX_TRACKED:
                    break
    finally:
        containers.clear()
    return out


def _recent_item(obj: Any) -> Any:
    """The item added before the newest (the newest when it is the only one): the holder search starts
    from it, and the newest is often still held by the loop's own variable as well (``x =
    model(batch); kept.append(x)``), whose one hop would be named instead of the container."""
    if isinstance(obj, dict):
        values = reversed(obj.values())
        newest = next(values, None)
        return next(values, newest)
    if isinstance(obj, (list, collections.deque)):
        return obj[-2] if len(obj) >= 2 else (obj[-1] if obj else None)
    return next(iter(obj), None) if obj else None


def growing_containers_stepwise(
    before: dict[int, int], *, ignore: set[int] | frozenset[int] = frozenset(), holder_budget_s: float,
    tensors_explained: bool = False,
) -> Stepwise[list[ContainerGrowth]]:
    """Containers from ``before`` that gained at least ``_MIN_ADDED`` items, most bytes first; the
    first one gets a ``who_holds`` line naming the variable or attribute that keeps it. ``ignore``:
    ids of containers that are the caller's own bounded buffers. ``tensors_explained``: containers of
    tensors are left out, their growth being a tensor finding's (host RSS grown past it: a list of the
    job's kept losses was named as the holder of a numpy cache's 40 KiB a step). Two passes: the heap
    scan, then (after a ``yield``) the holder search."""
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None) if tensors_explained else None
    found: list[tuple[int, Any, int, Any]] = []
    for obj in objects_of(_CONTAINERS):
        if id(obj) in ignore:
            continue
        was = before.get(id(obj))
        if was is None:
            continue
        try:
            added = len(obj) - was
            if added < _MIN_ADDED:
                continue
            item = _recent_item(obj)
            size = sys.getsizeof(item)
        except Exception:  # noqa: BLE001 - mutated while we looked, odd subclass: skip it
            continue
        if type(item).__module__.startswith("gpumemd"):
            continue  # the agent's own bounded buffers (step ring, census history) fill up at start
        if tensor_type is not None and isinstance(item, tensor_type):
            continue
        found.append((added * size, obj, added, item))
    found.sort(key=lambda f: f[0], reverse=True)
    grown = [ContainerGrowth(type(obj).__name__, type(item).__name__, added, approx, len(obj))
             for approx, obj, added, item in found[:_GROWN_SHOWN]]
    recent = hold_weakly(found[0][3]) if found and found[0][3] is not None else None
    found.clear()
    if recent is None:
        return grown
    yield
    item = recent()
    if item is not None:
        grown[0] = dataclasses.replace(grown[0], holder=who_holds(item, time_budget_s=holder_budget_s))
    del item
    return grown


# --- autograd graphs that grow behind one tensor (``total_loss += loss``) ------------------------

_GRAPH_NODE_BUDGET = 50_000  # nodes walked per look, over all graphs
_SAVED_WALK_NODES = 5_000  # nodes walked for the tensors one tensor's graph saved


@dataclass(frozen=True, slots=True)
class GraphGrowth:
    """The largest live autograd graph and how much it grew since the first look."""

    description: str  # "float32[] with grad_fn"
    nodes: int
    nodes_added: int
    holder: str | None


def _largest_graph() -> tuple[int, Any]:
    budget = _GRAPH_NODE_BUDGET
    best, best_tensor = 0, None
    tensors = live_tensors()
    try:
        for obj in tensors:
            if budget <= 0:
                break
            try:
                fn = obj.grad_fn
            except Exception:  # noqa: BLE001 - odd subclass
                continue
            if fn is None:
                continue
            n = count_nodes(fn, budget)
            budget -= n
            if n > best:
                best, best_tensor = n, obj
    finally:
        tensors.clear()
    return best, best_tensor


def largest_graph_nodes() -> int:
    """Nodes in the largest autograd graph that a live tensor keeps (bounded walk)."""
    return _largest_graph()[0]  # the tensor is let go with the tuple


def growing_graph(before_nodes: int, *, min_added: int, holder_budget_s: float = 0.5) -> GraphGrowth | None:
    """The largest live graph, if it gained at least ``min_added`` nodes since ``before_nodes``, and who
    holds its root, within ``holder_budget_s`` for the two together (at least 50 ms for the holder).
    One step end: the root is often this step's loss, gone by the next one."""
    started = time.monotonic()
    n, tensor = _largest_graph()
    if tensor is None or n - before_nodes < min_added:
        return None
    try:
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = "[" + ", ".join(str(d) for d in tensor.shape) + "]"
        budget = max(0.05, holder_budget_s - (time.monotonic() - started))
        holder = who_holds(tensor, time_budget_s=budget)
    finally:
        del tensor
    return GraphGrowth(f"{dtype}{shape} with grad_fn", n, n - before_nodes, holder)


def saved_by_a_graph(sample: Any) -> bool:
    """Does a live autograd graph save a tensor on ``sample``'s storage? The graphs of the tensors
    with a ``grad_fn`` are walked newest first, each node once, ``_GRAPH_NODE_BUDGET`` in all. What makes a
    tensor that nothing in Python holds "kept by a graph", rather than unexplained."""
    try:
        ptr = sample.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - no storage (a wrapper subclass): nothing to compare
        return False
    walk = GraphWalk(_GRAPH_NODE_BUDGET)
    tensors = live_tensors()
    try:
        for index, obj in enumerate(reversed(tensors)):
            if walk.truncated:
                return False
            fn = getattr(obj, "grad_fn", None)
            if fn is not None and walk.walked_by(fn) is None and _saves(walk, fn, index, ptr):
                return True
        return False
    finally:
        tensors.clear()
        walk.clear()


def _saves(walk: GraphWalk, fn: Any, index: int, ptr: int) -> bool:
    for node in walk.walk(fn, index):
        for saved in walk.saved(node):
            try:
                if saved.untyped_storage().data_ptr() == ptr:
                    return True
            except Exception:  # noqa: BLE001 - an odd saved value: not it
                continue
    return False


def graph_size(tensor: Any, *, max_nodes: int) -> int:
    """Nodes in the autograd graph ``tensor`` keeps (a bounded walk: at most ``max_nodes``)."""
    fn = getattr(tensor, "grad_fn", None)
    return 0 if fn is None else count_nodes(fn, max_nodes)


def saved_bytes(tensor: Any) -> int:
    """Bytes of the tensors that ``tensor``'s autograd graph saved (each storage once; a bounded
    walk): what keeping this one tensor alive costs beyond its own storage. A saved tensor counts its
    own storage only (none for sparse or wrapper tensors), unlike the census, which counts their
    components: the evidence sentences were measured this way."""
    torch = sys.modules.get("torch")
    fn = getattr(tensor, "grad_fn", None)
    if torch is None or fn is None:
        return 0
    walk = GraphWalk(_SAVED_WALK_NODES, overrun=True)
    counted: set[StorageKey] = set()
    total = 0
    try:
        for node in walk.walk(fn):
            for saved in walk.saved(node):
                try:
                    if _is_parameter(saved):
                        continue  # alive anyway, not this graph's cost
                    for key, nbytes in Storages.own(saved):
                        if key not in counted:
                            counted.add(key)
                            total += nbytes
                except Exception:  # noqa: BLE001
                    continue
    finally:
        walk.clear()
    return total


def _is_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter), or a view of one."""
    base = t._base if t._base is not None else t
    return bool(base.requires_grad and base.grad_fn is None)
