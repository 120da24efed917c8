"""Autograd graphs, read one way: the nodes below a ``grad_fn`` and the tensors they saved.

The census (graph bytes behind each tensor), the host-object look (the largest graph's node count),
the leak evidence (what one tensor's graph saved) and the chain tracker (nodes by sequence number)
all read the same C++ structure, and each read has traps that are handled here once:

- Node wrappers may be made on access: a walk holds every node it reached until it ends, so that
  an id is never reused by another node in the middle of a walk.
- A graph can be millions of nodes (a loss accumulated for a whole run): every walk is bounded.
- Reading a ``_saved_*`` attribute raises once ``backward()`` freed it, and runs the unpack hook of
  the ``saved_tensors_hooks`` that were active when the graph was built (offloading hooks copy back
  to the device): callers that must not do that do not read saved tensors.

Two orders: depth first (``GraphWalk``: the census and the host-object counts) and oldest node first
(``oldest_first``: the chain tracker, which looks for nodes made before a given step).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor
    from torch.autograd.graph import Node

LEAF_SEQUENCE_NR = 2**64 - 1
"""The sequence number of ``AccumulateGrad`` nodes: parameters' gradient accumulators, which every
step's graph shares, so they say nothing about when a graph was made."""

# Per node class: the attributes that hold saved tensors. Bounded by the number of node classes
# torch (and the job's custom Functions) define.
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}
_SAVED_ATTRS_MAX = 4096


def next_nodes(node: Node) -> list[Node]:
    """The nodes ``node`` passes gradients to (its ``next_functions``, undefined inputs left out)."""
    return [child for child, _ in node.next_functions if child is not None]


class GraphWalk:
    """Depth-first walks over autograd graphs, each node reached once over all of them and at most
    ``max_nodes`` nodes in all (roots aside).

    The walks of several roots share what they reached: ``walk(root, index)`` yields only nodes no
    earlier walk reached, and notes in ``met`` the nodes it found that an earlier walk had reached
    (the graphs share them). With ``overrun``, a node is expanded while fewer than ``max_nodes`` are
    reached, so the count can pass ``max_nodes`` by the last node's inputs; without, the walk stops
    at the first node beyond ``max_nodes`` and says so in ``truncated``.
    """

    def __init__(self, max_nodes: int, *, overrun: bool = False) -> None:
        import torch  # lazily: `import gpumemd` stays light

        self.max_nodes = max_nodes
        self.overrun = overrun
        self.truncated = False
        self.met: list[Node] = []
        self._tensor_type = torch.Tensor
        self._first: dict[int, tuple[Node, int]] = {}  # node id -> (node, index of the walk that reached it)

    @property
    def reached(self) -> int:
        """Nodes reached so far, over all walks."""
        return len(self._first)

    def walked_by(self, node: Node) -> int | None:
        """The index of the walk that reached ``node``, or None when none did."""
        seen = self._first.get(id(node))
        return None if seen is None else seen[1]

    def walk(self, root: Node, index: int = 0) -> Iterator[Node]:
        """``root`` and the nodes below it that no earlier walk reached, depth first."""
        first, limit, overrun = self._first, self.max_nodes, self.overrun
        first[id(root)] = (root, index)
        stack = [root]
        while stack:
            if overrun and len(first) >= limit:
                self.truncated = True
                return
            node = stack.pop()
            yield node
            try:
                children = next_nodes(node)
            except Exception:  # noqa: BLE001 - a node type without edges
                continue
            for child in children:
                seen = first.get(id(child))
                if seen is None:
                    if not overrun and len(first) >= limit:
                        self.truncated = True
                        return
                    first[id(child)] = (child, index)
                    stack.append(child)
                elif seen[1] != index:
                    self.met.append(child)

    def saved(self, node: Node) -> Iterator[Tensor]:
        """The tensors ``node`` saved for backward: none once ``backward()`` freed them. Reading them
        runs their unpack hooks (see the module docstring), one attribute at a time: a hook's copy
        lives no longer than the caller looks at it."""
        for attr in _saved_attrs(type(node)):
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - freed by backward(), or undefined: nothing kept
                continue
            yield from tensors_in(value, self._tensor_type)

    def clear(self) -> None:
        """Let go of every node reached."""
        self._first.clear()
        self.met.clear()


def count_nodes(fn: Node, max_nodes: int) -> int:
    """Nodes in the graph below ``fn``: a depth-first walk that stops expanding at ``max_nodes``
    (the last node expanded can add its inputs beyond it)."""
    walk = GraphWalk(max_nodes, overrun=True)
    try:
        for _ in walk.walk(fn):
            pass
        return walk.reached
    finally:
        walk.clear()


def oldest_first(fn: Node, limit: int, *, floor: int = -1) -> Iterator[tuple[int, Node]]:
    """(sequence number, node) of at most ``limit`` nodes below ``fn``, smallest sequence number
    first, each once; parameters' accumulators and nodes made before ``floor`` left out (nodes
    below one are older still, so they cannot lead back to anything made after it)."""
    heap: list[tuple[int, int, Node]] = []
    seen: set[int] = set()
    popped = 0
    try:
        _push_inputs(heap, fn, floor, seen)
        while heap and popped < limit:
            s, _, node = heapq.heappop(heap)
            popped += 1
            yield s, node
            _push_inputs(heap, node, floor, seen)
    finally:
        heap.clear()  # the nodes (and the graph they keep) are not ours to hold


def _push_inputs(heap: list[tuple[int, int, Node]], node: Node, floor: int, seen: set[int]) -> None:
    for child in next_nodes(node):
        s = child._sequence_nr()
        if s == LEAF_SEQUENCE_NR or s < floor or s in seen:
            continue
        seen.add(s)
        heapq.heappush(heap, (s, id(child), child))


def tensors_in(value: object, tensor_type: type[Tensor]) -> list[Tensor]:
    """The tensors in a value: one tensor, or a list or tuple of them (a saved attribute, an
    optimizer's state entry)."""
    if isinstance(value, tensor_type):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, tensor_type)]
    return []


def _saved_attrs(node_type: type) -> tuple[str, ...]:
    attrs = _SAVED_ATTRS.get(node_type)
    if attrs is None:
        names = dir(node_type)
        attrs = tuple(a for a in names if a.startswith("_saved_"))
        if "saved_tensors" in names:  # custom autograd.Function nodes (ctx.save_for_backward)
            attrs += ("saved_tensors",)
        if len(_SAVED_ATTRS) < _SAVED_ATTRS_MAX:
            _SAVED_ATTRS[node_type] = attrs
    return attrs
