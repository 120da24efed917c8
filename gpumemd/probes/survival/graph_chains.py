"""Autograd graphs chained across steps: the ``total_loss += loss`` leak, counted in graph nodes.

Why this exists: after ``backward()`` frees a graph's saved tensors, a tensor that keeps
accumulating the loss (``epoch_loss = epoch_loss + loss``, an EMA kept as a tensor attribute) holds
every step's graph *nodes*: C++ objects that no tensor count, census or allocator counter sees, and
that grow host memory by a few hundred bytes per step (below RSS noise for hours). What does show is
the graph's structure. Every autograd node carries a sequence number, increasing as the training
thread makes nodes (``Node._sequence_nr()``; ``torch._C._autograd._get_sequence_nr()`` reads the
next one for 0.1 µs). The tracker notes it at the end of the step before each scan. At a scan it
takes the tensors made since the last scan that are alive and have a ``grad_fn`` (the roots) and
searches each root's graph, smallest sequence number first, for a node made before that mark: a
healthy step's graph has none (its parameters' ``AccumulateGrad`` nodes aside), and stops the
search after a few nodes; a chain's previous link is one or two nodes below its root. A root that
spans steps is then followed down to the root the chain had at the last scan (nodes older than
that root cannot lead to it, so the search only walks the links made since); the nodes walked
extend the chain. ``groups()`` gives the nodes chained per tensor group, growing by the links made
per step. A chain whose last root is no longer reached (``epoch_loss = 0`` at an epoch's start)
ends and its series falls: a bounded sawtooth, not a leak.

Nothing here holds a node or a tensor strongly between scans (nodes cannot be weakly referenced; the
chain is remembered by sequence number, its newest root tensor weakly). Sequence numbers are per
thread: a graph built on another thread may be misread as spanning steps, which starts no growth by
itself, because growth needs the same chain to be reached again scan after scan.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpumemd.probes.heap.autograd_graph import LEAF_SEQUENCE_NR, oldest_first
from gpumemd.records.device import Device

if TYPE_CHECKING:
    from torch.autograd.graph import Node

log = logging.getLogger("gpumemd")

MAX_ROOTS = 16
"""Roots looked at per scan (newest first): a step leaves a handful of tensors with a grad_fn alive."""

SPAN_BUDGET = 8
"""Nodes popped per root to decide whether its graph reaches into an earlier step. A chain's previous
link is the first or second node popped (``total + loss``: one, ``0.9 * ema + 0.1 * loss``: two)."""

FOLLOW_BUDGET = 2_048
"""Nodes popped to follow a spanning root down to its chain's previous root (the links since the last
scan: 1-3 per step, times the steps between scans)."""

MAX_CHAINS = 8
"""Chains tracked at once; a further one is not followed until one ends."""

DATE_BUDGET = 4_096
"""Nodes popped, once per new chain, to find its oldest node (and so the step it began in)."""

MAX_MARKS = 256
"""Marks kept (step, sequence number) to date a chain's oldest node: 256 scans, 2,560+ steps."""

ChainKey = tuple[str, str, tuple[int, ...]]  # device name, dtype, shape of the chain's root tensor


@dataclass(slots=True)
class _Chain:
    key: ChainKey
    root_seq: int  # sequence number of the newest root's grad_fn
    root: weakref.ref[Any]
    nodes: int  # nodes walked along the chain, and the links made before it was found (``_measured``)
    first_seq: int | None = None  # the oldest node found below the root at discovery (None: not reached)
    found_at: int | None = None  # the step of the scan that found it
    found_nodes: int | None = None  # its links then, once measured at the next scan (None: not yet)


@dataclass(frozen=True, slots=True)
class ChainGroup:
    key: ChainKey
    nodes: int  # nodes chained (over every chain of this group)
    began_at: int | None = None  # the step the oldest chain began in, dated by the marks
    found: tuple[int, int] | None = None  # (step, links) of the oldest chain at the scan that found it, once measured

    @property
    def device(self) -> Device:
        return Device.parse(self.key[0])

    def describe(self) -> str:
        _, dtype, shape = self.key
        return f"{dtype}[{', '.join(str(d) for d in shape)}] with grad_fn"


def _next_sequence_nr() -> int | None:
    try:
        import torch

        return int(torch._C._autograd._get_sequence_nr())
    except (ImportError, AttributeError, RuntimeError):
        return None


class GraphChainTracker:
    """Follows autograd graphs that reach back across steps; see the module docstring."""

    def __init__(self) -> None:
        self._mark: int | None = None  # the next sequence number at the end of the last step noted
        self._marks: deque[tuple[int, int]] = deque(maxlen=MAX_MARKS)  # (step, mark) to date chains
        self._chains: list[_Chain] = []
        self.errors = 0
        self.popped = 0  # nodes popped over all searches (what the searches cost; tests read it)

    def groups(self) -> list[ChainGroup]:
        by_key: dict[ChainKey, list[_Chain]] = {}
        for c in self._chains:
            by_key.setdefault(c.key, []).append(c)
        out = []
        for k, cs in by_key.items():
            oldest = min(cs, key=lambda c: c.first_seq if c.first_seq is not None else LEAF_SEQUENCE_NR)
            at, links = oldest.found_at, oldest.found_nodes
            found = (at, links) if at is not None and links is not None else None
            out.append(ChainGroup(k, sum(c.nodes for c in cs), self._step_of(oldest.first_seq), found))
        return out

    def _step_of(self, seq: int | None, now: tuple[int, int] | None = None) -> int | None:
        """The step a node was made in, as well as the marks tell: after the last marked step at or
        below it, by as many steps as the nodes made since that mark take at the rate of the marks
        before (a chain's own nodes make the steps after its first denser: at the two marks around it
        an ``epoch_loss += loss`` from step 327 read 325), and never past the next mark (or ``now``: a
        step and the sequence number then). None when not dated (walk cut short, mark gone)."""
        if seq is None or not self._marks or self._marks[0][1] > seq:
            return None
        marks = sorted(self._marks, key=lambda m: m[1])
        i = max(j for j, m in enumerate(marks) if m[1] <= seq)
        after, after_seq = marks[i]
        by = marks[i + 1] if i + 1 < len(marks) else now
        last = by[0] if by is not None and by[0] > after else None
        rate = None  # nodes a step before the node
        if i > 0 and marks[i - 1][0] < after and marks[i - 1][1] < after_seq:
            rate = (after_seq - marks[i - 1][1]) / (after - marks[i - 1][0])
        elif last is not None and by is not None and by[1] > after_seq:
            rate = (by[1] - after_seq) / (last - after)
        step = after + 1 + (int((seq - after_seq) / rate) if rate else 0)
        return min(step, last) if last is not None else step

    def sample(self, key: ChainKey) -> Any:
        """The newest live root of a chain in this group (a strong reference: drop it soon)."""
        for c in reversed(self._chains):
            if c.key == key:
                t = c.root()
                if t is not None:
                    return t
        return None

    def clear(self) -> None:
        self._chains.clear()
        self._marks.clear()
        self._mark = None

    def mark_step(self, step: int | None = None) -> None:
        """Note where the step that ends now stands in the sequence (call it on the training
        thread, at the end of the step before a scan): nodes below it were made in earlier steps.
        With ``step`` (the step ending now), the mark also dates the chains found later."""
        self._mark = _next_sequence_nr()
        if step is not None and self._mark is not None:
            self._marks.append((step, self._mark))

    def scan(self, roots: Iterable[Any], step: int | None = None) -> None:
        """Follow the chains from the tensors made since the last scan (newest first), at ``step``
        (when given, a new chain's links made before it was found are measured: ``_measured``)."""
        try:
            self._scan(roots, step)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not disturb the job
            self.errors += 1
            self._chains.clear()
            if self.errors == 1:
                log.info("gpumemd: graph chain scan failed (%s: %s)", type(exc).__name__, exc)

    def _scan(self, roots: Iterable[Any], step: int | None) -> None:
        mark = self._mark
        if mark is None:
            return
        targets = {c.root_seq: c for c in self._chains}
        extended: set[int] = set()
        for t in roots:
            fn = t.grad_fn
            if fn is None:
                continue
            seq = fn._sequence_nr()
            chain = targets.get(seq)
            if chain is not None:  # the same root as at the last scan: the chain did not move
                extended.add(id(chain))
                continue
            if seq < mark or seq == LEAF_SEQUENCE_NR or not self._spans(fn, mark):
                continue
            hit, walked = self._follow(fn, targets)
            chain = targets.get(hit) if hit is not None else None
            if chain is not None:
                if id(chain) in extended:
                    continue  # two roots on one chain: counted once
                chain.nodes += walked
                chain.root_seq, chain.root = seq, weakref.ref(t)
                if chain.found_nodes is None:
                    self._measured(chain, walked, step)
            elif len(self._chains) < MAX_CHAINS:
                key = (str(t.device), str(t.dtype).removeprefix("torch."), tuple(t.shape))
                chain = _Chain(key, seq, weakref.ref(t), 1, self._oldest(fn), found_at=step)
                self._chains.append(chain)
            else:
                continue
            extended.add(id(chain))
        # A chain not reached this scan ended (its root was replaced by something that does not
        # reach it), unless its root is alive and unchanged (a tensor updated less often than we scan).
        self._chains = [c for c in self._chains if id(c) in extended or self._unchanged(c)]

    def _measured(self, chain: _Chain, walked: int, step: int | None) -> None:
        """A chain's second scan: the links it gained since the first give its rate, and at that rate
        the links made before it was found, from the step its oldest node was made in. Counted as one
        node when found, it was dated at the scan that found it: up to a scan interval late (an
        ``epoch_loss += loss`` from step 320 read "since step 351" at 50-step scans)."""
        chain.found_nodes = 1
        found = chain.found_at
        sequence_nr = _next_sequence_nr()
        began = self._step_of(chain.first_seq, (step, sequence_nr) if step is not None and sequence_nr else None)
        if found is None or step is None or began is None or step <= found or began > found:
            return
        before = max(1, round(walked / (step - found) * (found - began)))
        chain.found_nodes = before
        chain.nodes += before - 1

    @staticmethod
    def _unchanged(chain: _Chain) -> bool:
        t = chain.root()
        fn = t.grad_fn if t is not None else None
        return fn is not None and fn._sequence_nr() == chain.root_seq

    def _spans(self, fn: Node, mark: int) -> bool:
        """Whether ``fn``'s graph reaches a node made before ``mark`` within ``SPAN_BUDGET`` pops."""
        popped = 0
        try:
            for s, _ in oldest_first(fn, SPAN_BUDGET):
                popped += 1
                if s < mark:
                    return True
            return False
        finally:
            self.popped += popped

    def _oldest(self, fn: Node) -> int | None:
        """The smallest sequence number in ``fn``'s graph (parameters' accumulators aside), or None
        when ``DATE_BUDGET`` pops do not exhaust it. Once per new chain: it dates where it began."""
        popped = 0
        oldest = fn._sequence_nr()
        try:
            for s, _ in oldest_first(fn, DATE_BUDGET + 1):  # one more: is anything left?
                if popped >= DATE_BUDGET:
                    return None
                popped += 1
                oldest = min(oldest, s)
            return int(oldest)
        finally:
            self.popped += popped

    def _follow(self, fn: Node, targets: dict[int, _Chain]) -> tuple[int | None, int]:
        """(the tracked root that ``fn`` reaches, or None; nodes popped on the way). Smallest
        sequence number first, never below the oldest target: those nodes cannot lead to one."""
        if not targets:
            return None, 0
        popped = 0
        try:
            for s, _ in oldest_first(fn, FOLLOW_BUDGET, floor=min(targets)):
                popped += 1
                if s in targets:
                    return s, popped
            return None, popped
        finally:
            self.popped += popped
