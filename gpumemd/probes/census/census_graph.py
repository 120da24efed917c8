"""Graph retention in the census: the saved storages nothing else counts, charged to the tensor
whose autograd graph keeps them.

Many roots (tensors with a live ``grad_fn``) are intermediates of one another: in
``total = total + loss`` every saved activation that still has a Python wrapper is itself a root.
A root whose ``grad_fn`` is reached from another root's graph is absorbed by it (union-find), so the
bytes and the ``kept_by`` of visible saved tensors end up on the outermost tensor, the one a holder
lookup can name. The walk is bounded in nodes; beyond it the graph bytes are a lower bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumemd.probes.heap.autograd_graph import GraphWalk

if TYPE_CHECKING:
    from torch.autograd.graph import Node

    from gpumemd.probes.census.census_groups import StorageRecord
    from gpumemd.probes.heap.storages import StorageKey, Storages

Root = tuple[int, "StorageRecord", "Node"]  # a root's index, its counted storage and the live grad_fn of a tensor on it
OnError = Callable[[str, BaseException], None]


class GraphCharge:
    """Graph retention for one census, charged over one or more slices (``walk``), then ``settle``.

    Each slice walks its roots with a fresh ``GraphWalk`` (nodes are held only while a slice runs:
    their Python wrappers, and so their ids, do not outlive it). What carries over from slice to
    slice needs no node: the storages charged (by storage key), the bytes charged to each root, the
    roots absorbed into others (by index) and the counted storages a graph saved. A root whose graph
    an earlier *slice* walked is walked again (its saved storages are charged already, so nothing is
    counted twice); only its absorption into the outer root is missed.
    """

    def __init__(self, records: list[StorageRecord], counted: dict[StorageKey, StorageRecord], storages: Storages,
                 on_error: OnError) -> None:
        self.records = records  # the roots' records, by root index
        self.counted = counted
        self.storages = storages
        self.on_error = on_error
        self.parent = list(range(len(records)))  # union-find over roots: the owner is the set's root
        self.charged: set[StorageKey] = set()
        self.charged_bytes = [0] * len(records)
        self.kept: dict[int, tuple[StorageRecord, int]] = {}  # counted saved storage -> the root whose graph saved it
        self.reached = 0  # nodes reached over all slices

    def walk(self, roots: list[Root], walk: GraphWalk, stop: Callable[[], bool] | None = None) -> int | None:
        """Walk ``roots`` (in index order) within ``walk``'s node bound, asking ``stop()`` before each
        root but the first; the index of the root whose walk the bound cut or that ``stop`` left
        unwalked, or None when every root was walked."""
        root_of_node: dict[int, int] = {}
        for i, _, grad_fn in roots:
            root_of_node.setdefault(id(grad_fn), i)
        try:
            for n, (i, record, root) in enumerate(roots):
                if n and stop is not None and stop():
                    return i  # the slice's time is up: the next slice begins at this root
                earlier = walk.walked_by(root)
                if earlier is not None:
                    self._absorb(i, into=earlier)  # an intermediate of an earlier root's graph
                    continue
                for node in walk.walk(root, i):
                    self._charge_node(walk, node, record, i)
                for node in walk.met:
                    other = root_of_node.get(id(node))
                    if other is not None:
                        self._absorb(other, into=i)  # that root lives inside this graph
                walk.met.clear()
                if walk.truncated:
                    return i
            return None
        finally:
            self.reached += walk.reached
            walk.clear()
            root_of_node.clear()

    def _charge_node(self, walk: GraphWalk, node: Node, record: StorageRecord, i: int) -> None:
        counted, charged, kept = self.counted, self.charged, self.kept
        for saved in walk.saved(node):
            try:
                parts = self.storages.parts(saved)
            except Exception as exc:  # noqa: BLE001
                self.on_error("a saved tensor", exc)
                continue
            for key, nbytes in parts:
                visible = counted.get(key)
                if visible is None:
                    if key not in charged:
                        charged.add(key)
                        self.charged_bytes[i] += nbytes
                elif visible is not record and id(visible) not in kept:
                    kept[id(visible)] = (visible, i)

    def settle(self) -> None:
        """Charge what was walked (all of it, also when a walk stopped early) to the owners."""
        roots = self.records
        for i, record in enumerate(roots):
            owner = roots[self._find(i)]
            owner.graph_bytes += self.charged_bytes[i]
            if owner is not record and record.kept_by is None:
                record.kept_by = owner
        for record, i in self.kept.values():
            owner = roots[self._find(i)]
            if owner is not record and record.kept_by is None:
                record.kept_by = owner
            if record.category == "other":
                # An anonymous tensor an autograd graph saves (its Python wrapper outlived the call
                # by PyObject preservation) is graph memory, not "other": `total += loss` must show
                # up as graph growth whether or not the saved inputs happen to be gc-visible.
                record.category = "graph"

    def _find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def _absorb(self, i: int, *, into: int) -> None:
        self.parent[self._find(i)] = self._find(into)  # one set already: its root points at itself again
